"""Load ``tests/fakegpu`` (a fake TensorRT and cuda-python, see its README) into this process, and undo it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

FAKEGPU = Path(__file__).resolve().parent / "fakegpu"
MODULES = ("tensorrt", "cuda", "cuda.bindings", "cuda.bindings.runtime")


@contextmanager
def fake_gpu(monkeypatch: pytest.MonkeyPatch, **environment: str) -> Iterator[tuple[ModuleType, ModuleType]]:
    """Import the fake ``tensorrt`` and ``cuda.bindings.runtime`` (FAKE_* settings from ``environment``).

    Yields ``(trt, cudart)``; afterwards the modules are gone from ``sys.modules``
    again, so no other test sees them.
    """
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    saved = {name: sys.modules.pop(name) for name in MODULES if name in sys.modules}
    sys.path.insert(0, str(FAKEGPU))
    try:
        import tensorrt
        from cuda.bindings import runtime

        runtime.ALLOCATIONS.clear()
        runtime.STREAMS.clear()
        runtime.EVENTS.clear()
        runtime.FAIL.clear()
        yield tensorrt, runtime
    finally:
        sys.path.remove(str(FAKEGPU))
        for name in MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
