"""Load ``tests/fakegpu`` (a fake TensorRT and cuda-python, see its README) into this process, and undo it.

With ``SPLITSTREAM_TEST_REAL_CUDA=1`` only the fake ``tensorrt`` is loaded, here and in the worker
processes the tests start: ``cuda`` stays the installed cuda-python, so streams, device and pinned
buffers and every copy are real, on a real GPU. Tests that need a knob only the fake cudart has
(``FAKE_CUDA_DEVICES``, ``FAKE_GPU_NAME``/``FAKE_GPU_CC``, its allocation log, injected failures)
are marked :func:`needs_fake_cuda` and skipped then; the normal run covers them.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

FAKEGPU = Path(__file__).resolve().parent / "fakegpu"
#: Real CUDA, fake engine: the tests run TensorRT's stand-in on the installed cuda-python and a real GPU.
REAL_CUDA = os.environ.get("SPLITSTREAM_TEST_REAL_CUDA", "") not in ("", "0")
MODULES = ("tensorrt",) if REAL_CUDA else ("tensorrt", "cuda", "cuda.bindings", "cuda.bindings.runtime")


def needs_fake_cuda(what: str) -> pytest.MarkDecorator:
    """Skip under ``SPLITSTREAM_TEST_REAL_CUDA=1``: the test relies on ``what``, which only the fake cudart has."""
    return pytest.mark.skipif(
        REAL_CUDA, reason=f"needs the fake cudart ({what}); SPLITSTREAM_TEST_REAL_CUDA=1 runs on real CUDA"
    )


@functools.cache
def fake_gpu_path() -> Path:
    """The directory to put first on the path: ``tests/fakegpu``, or one holding only its ``tensorrt`` (real CUDA)."""
    if not REAL_CUDA:
        return FAKEGPU
    directory = Path(tempfile.mkdtemp(prefix="splitstream-fake-tensorrt-"))
    (directory / "tensorrt").symlink_to(FAKEGPU / "tensorrt", target_is_directory=True)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def fake_gpu_pythonpath() -> str:
    """``PYTHONPATH`` for a process that should see the fakes first (and whatever this one's PYTHONPATH held)."""
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([str(fake_gpu_path()), *([inherited] if inherited else [])])


@contextmanager
def fake_gpu(monkeypatch: pytest.MonkeyPatch, **environment: str) -> Iterator[tuple[ModuleType, ModuleType]]:
    """Import the fake ``tensorrt`` and ``cuda.bindings.runtime`` (FAKE_* settings from ``environment``).

    Yields ``(trt, cudart)``; afterwards the modules are gone from ``sys.modules``
    again, so no other test sees them. Under ``SPLITSTREAM_TEST_REAL_CUDA=1``
    ``cudart`` is cuda-python's, and only ``tensorrt`` comes and goes.
    """
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    path = str(fake_gpu_path())
    saved = {name: sys.modules.pop(name) for name in MODULES if name in sys.modules}
    sys.path.insert(0, path)
    try:
        import tensorrt
        from cuda.bindings import runtime

        if not REAL_CUDA:
            runtime.ALLOCATIONS.clear()
            runtime.STREAMS.clear()
            runtime.EVENTS.clear()
            runtime.FAIL.clear()
        yield tensorrt, runtime
    finally:
        sys.path.remove(path)
        for name in MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
