"""The one small interface every inference backend implements.

Backends see NumPy arrays keyed by tensor name, never protobuf: the servicer
converts at the edge and the batcher stacks requests before a backend runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from splitstream.worker.metadata import ModelMetadata


class Backend(Protocol):
    """An engine that runs one model version.

    Contract: :meth:`load` is called once, off the event loop, before anything
    else; :meth:`run` may then be called from several executor threads at once
    (up to ``instance_count``), so it must be thread-safe; :meth:`close` is
    called once after the last run finished.
    """

    #: Written into ModelMetadata.platform (e.g. ``onnxruntime_onnx``, Triton's name).
    platform: str
    #: A human tag of the engine serving the model (``resnet-v2-fp16-dyn``) once loaded; None when the
    #: backend has no engine of its own (ONNX Runtime).
    engine_tag: str | None
    #: Device memory held per execution context once loaded (empty when the backend does not know it).
    context_device_memory_bytes: tuple[int, ...]
    #: Input shapes the warm-up run uses once loaded (batch of 1); inputs not named use 1 for dynamic dims.
    warm_up_shapes: Mapping[str, tuple[int, ...]]

    def load(self) -> None:
        """Build the engine; raises ConfigError when the model file cannot be served."""

    def metadata(self) -> ModelMetadata:
        """The tensors as the engine sees them (``-1`` for dynamic dims); only valid after :meth:`load`."""

    def check_request(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise InvalidInput when the engine cannot take these input shapes (called before queueing a request)."""

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one (possibly batched) inference and return exactly ``output_names``. Blocking."""

    def close(self) -> None:
        """Release the engine's resources."""
