"""ONNX Runtime backend: one InferenceSession shared by all executor threads.

``InferenceSession.run`` is thread-safe and releases the GIL, so
``instance_count`` concurrent runs need one session, not one per thread. With
``intra_op_threads: 1`` each run stays on its calling thread, which makes
``instance_count`` the number of cores the model uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import structlog

from splitstream.common.errors import ConfigError
from splitstream.worker.config import TensorRTProviderConfig
from splitstream.worker.engines.profiles import Profile
from splitstream.worker.metadata import DYNAMIC, ModelMetadata, TensorSpec

#: config.yaml's names for execution providers → ONNX Runtime's.
PROVIDERS = {
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}

#: ONNX Runtime's type strings → Open Inference Protocol datatypes.
DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


class OnnxRuntimeBackend:
    """Runs ``model.onnx`` with the first available execution providers of the configured preference."""

    platform = "onnxruntime_onnx"
    engine_tag: str | None = None
    context_device_memory_bytes: tuple[int, ...] = ()
    warm_up_shapes: Mapping[str, tuple[int, ...]] = {}

    def __init__(
        self,
        path: Path,
        *,
        intra_op_threads: int,
        execution_providers: Sequence[str],
        logger: structlog.stdlib.BoundLogger,
        tensorrt_options: TensorRTProviderConfig | None = None,
    ) -> None:
        self._path = path
        self._intra_op_threads = intra_op_threads
        self._execution_providers = tuple(execution_providers)
        self._tensorrt_options = tensorrt_options or TensorRTProviderConfig()
        self._logger = logger
        self._session: ort.InferenceSession | None = None
        self._metadata: ModelMetadata | None = None
        self._string_inputs: frozenset[str] = frozenset()

    def load(self) -> None:
        if not self._path.is_file():
            raise ConfigError(f"{self._path}: no such file")
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        providers = self._providers()
        try:
            session = ort.InferenceSession(str(self._path), sess_options=options, providers=providers)
        except Exception as error:  # onnxruntime raises its own exception types for bad models
            problem = " ".join(str(error).split())
            raise ConfigError(f"{self._path}: onnxruntime cannot load it ({problem})") from None
        self._metadata = ModelMetadata(
            inputs=tuple(_spec(arg, "input", self._path) for arg in session.get_inputs()),
            outputs=tuple(_spec(arg, "output", self._path) for arg in session.get_outputs()),
        )
        self._string_inputs = frozenset(spec.name for spec in self._metadata.inputs if spec.datatype == "BYTES")
        self._session = session
        self._logger.info("onnxruntime session loaded", path=str(self._path), providers=session.get_providers())

    def metadata(self) -> ModelMetadata:
        if self._metadata is None:
            raise RuntimeError("metadata() called before load()")
        return self._metadata

    def check_request(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """ONNX Runtime takes any shape the metadata allows."""

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        if self._session is None:
            raise RuntimeError("run() called before load()")
        feeds: dict[str, Any] = {
            name: _as_strings(array) if name in self._string_inputs else array for name, array in inputs.items()
        }
        names = list(output_names)
        results = self._session.run(names, feeds)
        return dict(zip(names, results, strict=True))

    def close(self) -> None:
        self._session = None

    def _providers(self) -> list[str | tuple[str, dict[str, str]]]:
        """The configured providers onnxruntime has, in preference order; the rest are skipped with a warning.

        The TensorRT execution provider gets its options from ``onnxruntime.tensorrt``
        (:func:`tensorrt_provider_options`).
        """
        available = set(ort.get_available_providers())
        chosen: list[str | tuple[str, dict[str, str]]] = []
        for name in self._execution_providers:
            provider = PROVIDERS[name]
            if provider not in available:
                self._logger.warning("execution provider not available, skipping it", provider=name)
            elif name == "tensorrt":
                chosen.append((provider, tensorrt_provider_options(self._tensorrt_options, self._path.parent)))
            else:
                chosen.append(provider)
        if not chosen:
            self._logger.warning("no configured execution provider is available, using cpu")
            chosen.append(PROVIDERS["cpu"])
        return chosen


def tensorrt_provider_options(options: TensorRTProviderConfig, directory: Path) -> dict[str, str]:
    """ONNX Runtime TensorRT execution provider options for ``onnxruntime.tensorrt``; paths relative to ``directory``.

    A cache path turns its cache on (``trt_engine_cache_enable``, ``trt_timing_cache_enable``). The
    provider keys its cached engines itself (by model, GPU and TensorRT version), so they live apart
    from the native backend's ``engines/``. A profile gives all three of min/opt/max shapes for every
    input it names, as the provider requires.
    """
    values: dict[str, str] = {}
    if options.engine_cache_path is not None:
        values["trt_engine_cache_enable"] = "True"
        values["trt_engine_cache_path"] = str(directory / options.engine_cache_path)
    if options.timing_cache_path is not None:
        values["trt_timing_cache_enable"] = "True"
        values["trt_timing_cache_path"] = str(directory / options.timing_cache_path)
    if options.fp16:
        values["trt_fp16_enable"] = "True"
    if options.workspace_bytes is not None:
        values["trt_max_workspace_size"] = str(options.workspace_bytes)
    if options.profile is not None:
        values.update(
            Profile(
                tuple(
                    (name, (options.profile.min[name], options.profile.opt[name], options.profile.max[name]))
                    for name in sorted(options.profile.min)
                )
            ).ort_options()
        )
    return values


def _spec(arg: Any, kind: str, path: Path) -> TensorSpec:
    datatype = DATATYPES.get(arg.type)
    if datatype is None:
        raise ConfigError(f"{path}: {kind} '{arg.name}' has type {arg.type}, which the worker cannot serve")
    shape = tuple(dim if isinstance(dim, int) and dim >= 0 else DYNAMIC for dim in (arg.shape or ()))
    return TensorSpec(name=arg.name, datatype=datatype, shape=shape)


def _as_strings(array: np.ndarray) -> np.ndarray:
    """BYTES elements arrive as ``bytes``; onnxruntime string tensors take ``str`` (it would store ``repr``).

    Invalid UTF-8 becomes U+FFFD instead of raising: one bad element must not
    fail every request of the batch it was stacked into.
    """
    out = np.empty(array.shape, dtype=np.object_)
    out.reshape(-1)[:] = [item.decode("utf-8", "replace") if isinstance(item, bytes) else item for item in array.flat]
    return out
