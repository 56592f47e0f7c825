"""A fake ``tensorrt`` whose "engines" run the ONNX model with ONNX Runtime on CPU (see ../README.md).

It mimics the parts of TensorRT's Python API splitstream uses, with TensorRT's
rules where they matter to the caller: no EXPLICIT_BATCH (networks are always
explicit batch), dynamic inputs need an optimisation profile, shapes outside
the active profile are refused, ``execute_async_v3`` reads and writes only
the bound device addresses, a plan deserializes only on the TensorRT version
that built it (unless version compatible).

Device memory is read and written through whichever ``cuda.bindings.runtime``
is imported: the fake one next to this package, or cuda-python on a real GPU
(``bench/gpu_smoke.py --fake-tensorrt``).
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from cuda.bindings import runtime as _cudart

__version__ = os.environ.get("FAKE_TENSORRT_VERSION", "11.4.0.106")
_MAJOR = int(__version__.split(".")[0])
_PLAN_MAGIC = b"FAKEPLAN\n"


# --- types -------------------------------------------------------------------------------------------------------


class _DataType:
    def __init__(self, name: str, numpy_type: Any) -> None:
        self.name = name
        self._numpy = numpy_type

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


float32 = _DataType("FLOAT", np.float32)
float16 = _DataType("HALF", np.float16)
int8 = _DataType("INT8", np.int8)
int32 = _DataType("INT32", np.int32)
int64 = _DataType("INT64", np.int64)
_bool = _DataType("BOOL", np.bool_)
globals()["bool"] = _bool  # TensorRT's name; set this way so the builtin stays usable in annotations here
uint8 = _DataType("UINT8", np.uint8)
bfloat16 = _DataType("BF16", None)
_ONNX_TYPES: dict[int, _DataType] = {
    onnx.TensorProto.FLOAT: float32,
    onnx.TensorProto.FLOAT16: float16,
    onnx.TensorProto.INT8: int8,
    onnx.TensorProto.INT32: int32,
    onnx.TensorProto.INT64: int64,
    onnx.TensorProto.BOOL: _bool,
    onnx.TensorProto.UINT8: uint8,
    onnx.TensorProto.BFLOAT16: bfloat16,
}


def nptype(trt_type: _DataType) -> Any:
    if trt_type._numpy is None:
        raise TypeError("Could not resolve TensorRT datatype to an equivalent numpy datatype.")
    return trt_type._numpy


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0


class NetworkDefinitionCreationFlag(enum.IntEnum):
    STRONGLY_TYPED = 1


_flags = {"VERSION_COMPATIBLE": 11, "TF32": 6}
if _MAJOR < 11:
    _flags.update(FP16=0, INT8=1)
BuilderFlag = enum.IntEnum("BuilderFlag", _flags)  # type: ignore[misc]
_levels = {"NONE": 0, "AMPERE_PLUS": 1}
if _MAJOR >= 11:
    _levels["SAME_COMPUTE_CAPABILITY"] = 2
HardwareCompatibilityLevel = enum.IntEnum("HardwareCompatibilityLevel", _levels)  # type: ignore[misc]


class ILogger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    def __init__(self) -> None:
        pass

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        pass


class Logger(ILogger):
    def __init__(self, min_severity: ILogger.Severity = ILogger.Severity.WARNING) -> None:
        super().__init__()


# --- building ----------------------------------------------------------------------------------------------------


class INetworkDefinition:
    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.model: onnx.ModelProto | None = None
        self.path = ""


class ParserError:
    def __init__(self, code: str, desc: str, node: int = -1, name: str = "", operator: str = "") -> None:
        self._fields = (code, desc, node, name, operator)

    def code(self) -> str:
        return self._fields[0]

    def desc(self) -> str:
        return self._fields[1]

    def node(self) -> int:
        return self._fields[2]

    def node_name(self) -> str:
        return self._fields[3]

    def node_operator(self) -> str:
        return self._fields[4]


#: Ops the fake "parser" refuses, like TensorRT does for what it cannot import.
UNSUPPORTED_OPS = frozenset({"StringNormalizer", "FakeUnsupportedOp"})


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: ILogger) -> None:
        self._network = network
        self._logger = logger
        self._errors: list[ParserError] = []

    def parse_from_file(self, path: str) -> bool:
        model = onnx.load(path)
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as error:
            self._errors.append(ParserError("MODEL_DESERIALIZE_FAILED", " ".join(str(error).split())))
            return False
        for index, node in enumerate(model.graph.node):
            if node.op_type in UNSUPPORTED_OPS:
                self._errors.append(
                    ParserError(
                        "UNSUPPORTED_NODE",
                        f"No importer registered for op: {node.op_type}",
                        index,
                        node.name,
                        node.op_type,
                    )
                )
        if self._errors:
            return False
        self._network.model = model
        self._network.path = path
        return True

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> ParserError:
        return self._errors[index]


class IOptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, list[list[int]]] = {}

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:
        self.shapes[input] = [list(min), list(opt), list(max)]


class ITimingCache:
    def __init__(self, data: bytes) -> None:
        self.builds = json.loads(data)["builds"] if data else 0

    def serialize(self) -> bytes:
        return json.dumps({"builds": self.builds}).encode()


class IBuilderConfig:
    def __init__(self) -> None:
        self.pools: dict[int, int] = {}
        self.profiles: list[IOptimizationProfile] = []
        self.flags: set[int] = set()
        self.hardware_compatibility_level = HardwareCompatibilityLevel["NONE"]
        self._timing_cache: ITimingCache | None = None

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        self.pools[int(pool)] = pool_size

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def set_flag(self, flag: Any) -> None:
        self.flags.add(int(flag))

    def create_timing_cache(self, serialized_timing_cache: bytes) -> ITimingCache:
        return ITimingCache(serialized_timing_cache)

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        self._timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache:
        assert self._timing_cache is not None
        return self._timing_cache


class Builder:
    def __init__(self, logger: ILogger) -> None:
        self._logger = logger

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        if _MAJOR >= 11:
            assert flags == 0, "TensorRT 11: STRONGLY_TYPED is deprecated and ignored"
        return INetworkDefinition(flags)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> bytes | None:
        assert network.model is not None
        for value in _real_inputs(network.model):
            dims = value.type.tensor_type.shape.dim
            dynamic = any(not dim.HasField("dim_value") for dim in dims)
            if dynamic and (not config.profiles or any(value.name not in p.shapes for p in config.profiles)):
                self._logger.log(
                    ILogger.Severity.ERROR,
                    f"Network has dynamic or shape inputs, but no optimization profile has been defined "
                    f"for '{value.name}'.",
                )
                return None
        if config._timing_cache is not None:
            config._timing_cache.builds += 1
        header = {
            "tensorrt": __version__,
            "version_compatible": int(BuilderFlag["VERSION_COMPATIBLE"]) in config.flags,
            "profiles": [p.shapes for p in config.profiles],
            "flags": sorted(config.flags),
            "strongly_typed": network.flags,
        }
        return _PLAN_MAGIC + json.dumps(header).encode() + b"\n" + network.model.SerializeToString()


def _real_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {init.name for init in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


# --- running -----------------------------------------------------------------------------------------------------


class Runtime:
    def __init__(self, logger: ILogger) -> None:
        self._logger = logger
        self.engine_host_code_allowed = False

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> ICudaEngine | None:
        data = bytes(serialized_engine)
        if not data.startswith(_PLAN_MAGIC):
            self._logger.log(ILogger.Severity.ERROR, "Serialization assertion magicTagRead == kMAGIC_TAG failed.")
            return None
        header_line, model_bytes = data[len(_PLAN_MAGIC) :].split(b"\n", 1)
        header = json.loads(header_line)
        if header["tensorrt"] != __version__ and not (header["version_compatible"] and self.engine_host_code_allowed):
            self._logger.log(
                ILogger.Severity.ERROR,
                f"The engine plan file is not compatible with this version of TensorRT, expecting library version "
                f"{__version__} got {header['tensorrt']}, please rebuild.",
            )
            return None
        return ICudaEngine(header, onnx.load_from_string(model_bytes))


class ICudaEngine:
    def __init__(self, header: dict[str, Any], model: onnx.ModelProto) -> None:
        self.header = header
        self._session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self._tensors: list[tuple[str, TensorIOMode, _DataType, tuple[int, ...]]] = []
        for values, mode in ((_real_inputs(model), TensorIOMode.INPUT), (model.graph.output, TensorIOMode.OUTPUT)):
            for value in values:
                tensor_type = value.type.tensor_type
                shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
                self._tensors.append((value.name, mode, _ONNX_TYPES[tensor_type.elem_type], shape))
        self.device_memory_size_v2 = 4096
        self.contexts_created = 0

    @property
    def num_io_tensors(self) -> int:
        return len(self._tensors)

    @property
    def num_optimization_profiles(self) -> int:
        return max(len(self.header["profiles"]), 1)

    def _tensor(self, name: str) -> tuple[str, TensorIOMode, _DataType, tuple[int, ...]]:
        return next(t for t in self._tensors if t[0] == name)

    def get_tensor_name(self, index: int) -> str:
        return self._tensors[index][0]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self._tensor(name)[1]

    def get_tensor_dtype(self, name: str) -> _DataType:
        return self._tensor(name)[2]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._tensor(name)[3]

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        return [tuple(shape) for shape in self.header["profiles"][profile_index][name]]

    def create_execution_context(self) -> IExecutionContext:
        self.contexts_created += 1
        return IExecutionContext(self)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [t[0] for t in self._tensors if t[1] == TensorIOMode.OUTPUT]
        return dict(zip(names, self._session.run(names, feeds), strict=True))


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self._engine = engine
        self._profile = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        self._output_shapes: dict[tuple[Any, ...], dict[str, tuple[int, ...]]] = {}

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        if not 0 <= profile_index < self._engine.num_optimization_profiles:
            return False
        if not _stream_is_live(stream_handle):
            return False
        self._profile = profile_index
        self._shapes.clear()
        return True

    def set_input_shape(self, name: str, shape: Any) -> bool:
        shape = tuple(int(d) for d in shape)
        profiles = self._engine.header["profiles"]
        if profiles and name in profiles[self._profile]:
            low, _, high = profiles[self._profile][name]
            if len(shape) != len(low) or not all(a <= s <= b for a, s, b in zip(low, shape, high, strict=True)):
                return False
        elif any(
            want != -1 and got != want for got, want in zip(shape, self._engine.get_tensor_shape(name), strict=True)
        ):
            return False
        self._shapes[name] = shape
        return True

    def infer_shapes(self) -> list[str]:
        inputs = [t[0] for t in self._engine._tensors if t[1] == TensorIOMode.INPUT]
        return [name for name in inputs if name not in self._shapes]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        if self._engine.get_tensor_mode(name) == TensorIOMode.INPUT:
            return self._shapes.get(name, self._engine.get_tensor_shape(name))
        key = tuple(sorted(self._shapes.items()))
        if key not in self._output_shapes:
            feeds = {
                input_name: np.zeros(shape, dtype=nptype(self._engine.get_tensor_dtype(input_name)))
                for input_name, shape in self._shapes.items()
            }
            self._output_shapes[key] = {n: tuple(a.shape) for n, a in self._engine.run(feeds).items()}
        return self._output_shapes[key][name]

    def set_tensor_address(self, name: str, memory: int) -> bool:
        self._addresses[name] = int(memory)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        """Run the model on the bound device buffers, through whichever ``cuda.bindings.runtime`` is imported.

        TensorRT would enqueue the work on ``stream_handle``. This stand-in waits for that stream (the
        caller enqueued its input copies there), copies the inputs device to host, runs ONNX Runtime, copies
        the outputs host to device and waits for the device, so work the caller enqueues on the stream next
        sees them. With the fake cudart that is a checked ``memmove``; with cuda-python, real GPU memory.
        """
        if not _stream_is_live(stream_handle) or self.infer_shapes():
            return False
        if any(name not in self._addresses for name, *_ in self._engine._tensors):
            return False
        if not _ok(_cudart.cudaStreamSynchronize(stream_handle)):
            return False
        to_host = _cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        to_device = _cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        feeds = {}
        for name, mode, dtype, _ in self._engine._tensors:
            if mode != TensorIOMode.INPUT:
                continue
            array = np.empty(self._shapes[name], dtype=nptype(dtype))
            if array.nbytes and not _ok(
                _cudart.cudaMemcpy(array.ctypes.data, self._addresses[name], array.nbytes, to_host)
            ):
                return False
            feeds[name] = array
        for name, array in self._engine.run(feeds).items():
            array = np.ascontiguousarray(array)
            if array.nbytes and not _ok(
                _cudart.cudaMemcpy(self._addresses[name], array.ctypes.data, array.nbytes, to_device)
            ):
                return False
        # A pageable host-to-device cudaMemcpy may return before its DMA lands; the caller's stream does not
        # wait for the legacy default stream it ran on, so wait here.
        return _ok(_cudart.cudaDeviceSynchronize())


def _ok(result: Any) -> bool:
    """A cuda-python call's ``(error, *results)`` (or bare error) succeeded."""
    error = result[0] if isinstance(result, tuple) else result
    return int(error) == 0


def _stream_is_live(handle: int) -> bool:
    """The fake cudart keeps a table of live streams; the real one has none (its calls report bad handles)."""
    streams = getattr(_cudart, "STREAMS", None)
    return streams is None or int(handle) in streams
