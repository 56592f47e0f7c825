"""Inference backends behind one interface (:class:`~splitstream.worker.backends.base.Backend`)."""

from __future__ import annotations

from pathlib import Path

import structlog

from splitstream.worker.backends.base import Backend
from splitstream.worker.config import ModelConfig


def create_backend(config: ModelConfig, directory: Path, *, logger: structlog.stdlib.BoundLogger) -> Backend:
    """The backend ``config.backend`` names, for the model version in ``directory`` (not loaded yet).

    Imports happen here so a worker only imports the engine it uses; the TensorRT
    backend imports TensorRT and cuda-python only in :meth:`load`, so a missing
    one is reported there as one ConfigError line.
    """
    if config.backend == "onnxruntime":
        from splitstream.worker.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(
            directory / "model.onnx",
            intra_op_threads=config.intra_op_threads,
            execution_providers=config.execution_providers,
            logger=logger,
            tensorrt_options=config.ort.tensorrt,
        )
    if config.backend == "tensorrt":
        from splitstream.worker.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(directory, config, logger=logger)
    raise AssertionError(f"unreachable: ModelConfig accepted backend {config.backend!r}")
