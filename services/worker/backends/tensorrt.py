"""Native TensorRT backend: a cached engine, N execution contexts, each with its own CUDA stream and buffers.

Load (once, off the event loop):

1. TensorRT, cuda-python and a GPU, or one ConfigError line saying what is
   missing (:func:`~splitstream.worker.engines.environment.load_environment`).
2. The engine this GPU needs, from ``engines/`` in the version directory
   (:mod:`~splitstream.worker.engines.cache`); none there: build it when
   ``tensorrt.build_on_start`` allows, else fail naming the key looked for.
   An engine whose record names another GPU or TensorRT version is refused.
3. ``Runtime.deserialize_cuda_engine``; tensors by name (``num_io_tensors``,
   ``get_tensor_name/mode/dtype/shape``); the engine's profiles are checked
   against the ones the key promised.
4. ``tensorrt.contexts`` execution contexts. Each owns a non-blocking CUDA
   stream created with the configured priority, and for every I/O tensor a
   device buffer and a pinned host buffer sized for the largest shape any
   profile allows. Their addresses are bound once (``set_tensor_address``).

Run (from up to ``instance_count`` executor threads): take a free context from
the pool (waiting if all are busy), pick the profile that takes the batch (or
split a batch larger than every profile into chunks), then per chunk
``set_input_shape`` → copy inputs host→device → ``infer_shapes`` →
``execute_async_v3`` → copy outputs device→host → synchronise the stream,
and put the context back. Every CUDA call's error is checked.

Close: synchronise every stream, drop the contexts, free device and pinned
buffers, destroy the streams, then drop the engine and the runtime, in that
order (a context must not outlive the memory bound to it, nor the engine).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from splitstream.common.errors import ConfigError
from splitstream.common.tensors import NUMPY_DTYPES
from splitstream.worker.config import ModelConfig
from splitstream.worker.engines.cache import EngineCache, EngineMismatch, describe_key, engine_key
from splitstream.worker.engines.cuda import (
    DeviceBuffer,
    PinnedBuffer,
    checked,
    create_stream,
    stream_priority,
)
from splitstream.worker.engines.environment import TensorRTEnvironment, load_environment
from splitstream.worker.engines.profiles import Profile, batch_split_warning, check_shapes, plan_chunks
from splitstream.worker.engines.spec import ENGINES_DIR, resolve_spec
from splitstream.worker.metadata import ModelMetadata, TensorSpec

#: NumPy dtype → Open Inference Protocol datatype (BYTES has no TensorRT type).
_DATATYPES = {dtype: name for name, dtype in NUMPY_DTYPES.items() if name != "BYTES"}


class EngineRunError(RuntimeError):
    """TensorRT refused a step of a run (a shape, a profile switch, the enqueue); the message says which."""


@dataclass
class IOTensor:
    name: str
    is_input: bool
    dtype: np.dtype[Any]
    #: The engine's shape, -1 for dynamic dimensions.
    shape: tuple[int, ...]
    #: Bytes of the largest shape any profile allows: what each context's buffers hold.
    max_bytes: int = 0


@dataclass
class ExecutionSlot:
    """One execution context with everything it alone uses: stream, buffers, active profile."""

    index: int
    context: Any
    stream: Any
    priority: int
    device: dict[str, DeviceBuffer] = field(default_factory=dict)
    host: dict[str, PinnedBuffer] = field(default_factory=dict)
    profile: int = 0

    @property
    def buffer_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.device.values())


class TensorRTBackend:
    """Runs ``model.onnx``'s TensorRT engine for this GPU (built by ``splitstream-build-engine`` or at start)."""

    platform = "tensorrt_plan"

    def __init__(
        self,
        directory: Path,
        config: ModelConfig,
        *,
        logger: structlog.stdlib.BoundLogger,
        environment: Callable[[], TensorRTEnvironment] = load_environment,
    ) -> None:
        self._directory = directory
        self._config = config
        self._logger = logger
        self._environment = environment
        self._model = directory.parent.name
        self._version = directory.name
        self._env: TensorRTEnvironment | None = None
        self._runtime: Any = None
        self._engine: Any = None
        self._profiles: tuple[Profile, ...] = ()
        self._tensors: dict[str, IOTensor] = {}
        self._slots: list[ExecutionSlot] = []
        self._pool: queue.SimpleQueue[ExecutionSlot] = queue.SimpleQueue()
        self._streams: list[Any] = []
        self._metadata: ModelMetadata | None = None
        self._trt_logger: Any = None
        #: A slot being set up: released by close() if its setup fails half-way.
        self._slots_in_progress: ExecutionSlot | None = None
        #: The engine's human tag (e.g. ``resnet-v2-fp16-dyn``) once loaded; what the registry advertises.
        self.engine_tag: str | None = None
        #: Device memory each execution context holds (TensorRT's activations + the I/O buffers), once loaded.
        self.context_device_memory_bytes: tuple[int, ...] = ()
        #: A profile's min shapes (with a batch of 1): shapes the engine surely takes, for the warm-up run.
        self.warm_up_shapes: dict[str, tuple[int, ...]] = {}

    # --- load ---------------------------------------------------------------------------------------------------

    def load(self) -> None:
        env = self._env = self._environment()
        try:
            self._load(env)
        except BaseException:
            self.close()
            raise

    def _load(self, env: TensorRTEnvironment) -> None:
        config = self._config
        resolved = resolve_spec(self._directory, config, model=self._model, version=self._version)
        spec = resolved.spec
        key = engine_key(spec, env.device)
        cache = EngineCache(self._directory / ENGINES_DIR)
        found = cache.load(key, env.device)
        if found is None:
            if not config.trt.build_on_start:
                raise ConfigError(
                    f"no TensorRT engine for this GPU in {cache.directory}: looked for {key.directory_name}, "
                    f"{describe_key(key)}; build it on a machine with this GPU and TensorRT with "
                    f"`splitstream-build-engine --model-repository {self._directory.parent.parent} --model "
                    f"{self._model} --version {self._version}`, or set tensorrt.build_on_start: true"
                )
            from splitstream.worker.engines.builder import build_and_store

            self._logger.warning("no engine for this GPU in the cache, building one (this can take minutes)")
            build_and_store(env, self._directory, config, model=self._model, version=self._version, log=self._logger)
            found = cache.load(key, env.device)
            if found is None:
                raise ConfigError(f"{cache.path_of(key)}: the engine just built is missing")
        plan, record = found
        trt = env.trt
        from splitstream.worker.engines.builder import make_logger

        trt_logger = make_logger(trt, self._logger)
        self._trt_logger = trt_logger
        self._runtime = trt.Runtime(trt_logger)
        if spec.version_compatible:
            self._runtime.engine_host_code_allowed = True
        self._engine = self._runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            raise EngineMismatch(
                f"{cache.path_of(key)}: TensorRT {env.device.tensorrt_version} could not deserialize the engine "
                f"({'; '.join(trt_logger.errors) or 'no error logged'})"
            )
        self._profiles = spec.profiles
        self._read_tensors(trt)
        self._check_engine_profiles()
        warning = batch_split_warning(self._profiles, max_batch_size=config.max_batch_size)
        if warning:
            self._logger.warning(warning)
        contexts = config.trt.contexts or config.instance_count
        if contexts < config.instance_count:
            self._logger.warning(
                "fewer execution contexts than instances: runs wait for a free context",
                contexts=contexts,
                instance_count=config.instance_count,
            )
        self._size_buffers(env)
        for index in range(contexts):
            self._slots.append(self._create_slot(env, index))
        for slot in self._slots:
            self._pool.put(slot)
        self.engine_tag = str(record.get("tag") or spec.tag)
        self.warm_up_shapes = _warm_up_shapes(self._profiles)
        device_memory = self._engine_device_memory()
        self.context_device_memory_bytes = tuple(device_memory + slot.buffer_bytes for slot in self._slots)
        self._logger.info(
            "tensorrt engine loaded",
            tag=self.engine_tag,
            engine=key.directory_name,
            gpu=env.device.gpu_name,
            tensorrt=env.device.tensorrt_version,
            contexts=contexts,
            stream_priority=self._slots[0].priority if self._slots else None,
            device_bytes_per_context=list(self.context_device_memory_bytes),
        )

    def _read_tensors(self, trt: Any) -> None:
        engine = self._engine
        inputs: list[TensorSpec] = []
        outputs: list[TensorSpec] = []
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            if engine.is_shape_inference_io(name):
                raise ConfigError(f"tensor '{name}' is a shape tensor; the worker serves execution tensors only")
            trt_dtype = engine.get_tensor_dtype(name)
            try:
                dtype = np.dtype(trt.nptype(trt_dtype))
            except TypeError:
                raise ConfigError(
                    f"tensor '{name}' has TensorRT type {trt_dtype}, which has no NumPy type (BF16, FP8, INT4 and FP4 "
                    "cannot be served); keep the model's inputs and outputs FP32/FP16"
                ) from None
            datatype = _DATATYPES.get(dtype)
            if datatype is None:
                raise ConfigError(f"tensor '{name}' has type {dtype}, which the worker cannot serve")
            shape = tuple(int(dim) for dim in engine.get_tensor_shape(name))
            tensor = IOTensor(name=name, is_input=is_input, dtype=dtype, shape=shape)
            self._tensors[name] = tensor
            (inputs if is_input else outputs).append(TensorSpec(name=name, datatype=datatype, shape=shape))
        self._metadata = ModelMetadata(inputs=tuple(inputs), outputs=tuple(outputs))

    def _check_engine_profiles(self) -> None:
        """The engine must have been built with the profiles its key names (a cheap guard against a wrong plan)."""
        engine = self._engine
        built = [profile for profile in self._profiles if profile.shapes]
        if engine.num_optimization_profiles != max(len(built), 1):
            raise EngineMismatch(
                f"the engine has {engine.num_optimization_profiles} optimisation profiles, its key names {len(built)}"
            )
        for index, profile in enumerate(built):
            for name, (low, opt, high) in profile.shapes:
                actual = tuple(tuple(int(d) for d in shape) for shape in engine.get_tensor_profile_shape(name, index))
                if actual != (low, opt, high):
                    raise EngineMismatch(
                        f"the engine's profile {index} gives input '{name}' {[list(s) for s in actual]}, its key "
                        f"names {[list(low), list(opt), list(high)]}"
                    )

    def _size_buffers(self, env: TensorRTEnvironment) -> None:
        """Each tensor's largest size: inputs at every profile's max, outputs as the engine infers them there."""
        engine = self._engine
        context = engine.create_execution_context()
        if context is None:
            raise ConfigError(f"TensorRT could not create an execution context ({'; '.join(self._trt_logger.errors)})")
        stream = create_stream(env.cudart, 0)
        self._streams.append(stream)
        try:
            profiles = self._profiles if any(p.shapes for p in self._profiles) else (Profile(()),)
            for index, profile in enumerate(profiles):
                if profile.shapes:
                    self._select_profile(context, stream, index, env)
                shapes: dict[str, tuple[int, ...]] = {}
                for tensor in self._tensors.values():
                    if tensor.is_input:
                        ranges = profile.range_of(tensor.name)
                        shape = ranges[2] if ranges is not None else tensor.shape
                        if not context.set_input_shape(tensor.name, shape):
                            raise EngineRunError(f"input '{tensor.name}': TensorRT refused shape {list(shape)}")
                        shapes[tensor.name] = shape
                missing = context.infer_shapes()
                if missing:
                    raise EngineRunError(f"TensorRT cannot infer output shapes; inputs lacking shapes: {list(missing)}")
                for tensor in self._tensors.values():
                    if not tensor.is_input:
                        shape = tuple(int(dim) for dim in context.get_tensor_shape(tensor.name))
                        if any(dim < 0 for dim in shape):
                            raise ConfigError(
                                f"output '{tensor.name}' has a data-dependent shape {list(shape)}; the worker sizes "
                                "output buffers from the profile's max shapes and cannot serve it"
                            )
                        shapes[tensor.name] = shape
                for name, shape in shapes.items():
                    tensor = self._tensors[name]
                    nbytes = int(np.prod(shape, dtype=np.int64)) * tensor.dtype.itemsize
                    tensor.max_bytes = max(tensor.max_bytes, nbytes)
            checked(env.cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        finally:
            del context

    def _select_profile(self, context: Any, stream: Any, index: int, env: TensorRTEnvironment) -> None:
        if not context.set_optimization_profile_async(index, int(stream)):
            raise EngineRunError(f"TensorRT refused to switch to optimisation profile {index}")
        checked(env.cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def _create_slot(self, env: TensorRTEnvironment, index: int) -> ExecutionSlot:
        cudart = env.cudart
        priority, _ = stream_priority(cudart, self._config.trt.stream_priority)
        stream = create_stream(cudart, priority)
        self._streams.append(stream)
        context = self._engine.create_execution_context()
        if context is None:
            raise ConfigError(
                f"TensorRT could not create execution context {index} (device memory?): "
                f"{'; '.join(self._trt_logger.errors) or 'no error logged'}"
            )
        slot = ExecutionSlot(index=index, context=context, stream=stream, priority=priority)
        self._slots_in_progress = slot
        for tensor in self._tensors.values():
            slot.device[tensor.name] = DeviceBuffer.allocate(cudart, tensor.max_bytes)
            slot.host[tensor.name] = PinnedBuffer.allocate(cudart, tensor.max_bytes)
            if not context.set_tensor_address(tensor.name, slot.device[tensor.name].ptr):
                raise EngineRunError(f"TensorRT refused the address of tensor '{tensor.name}'")
        self._slots_in_progress = None
        if any(profile.shapes for profile in self._profiles):
            slot.profile = index % len(self._profiles)
            self._select_profile(context, stream, slot.profile, env)
        return slot

    def _engine_device_memory(self) -> int:
        engine = self._engine
        # device_memory_size_v2 exists from 10.x on; without _v2 it is gone in 11.
        return int(engine.device_memory_size_v2) if hasattr(engine, "device_memory_size_v2") else 0

    # --- serving ------------------------------------------------------------------------------------------------

    def metadata(self) -> ModelMetadata:
        if self._metadata is None:
            raise RuntimeError("metadata() called before load()")
        return self._metadata

    def check_request(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse (InvalidInput) a request whose shapes no optimisation profile takes; the batch size is free."""
        check_shapes(self._profiles, shapes, batched=self._config.max_batch_size > 0)

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        if self._env is None or not self._slots:
            raise RuntimeError("run() called before load()")
        slot = self._pool.get()
        try:
            return self._run(slot, inputs, output_names)
        finally:
            self._pool.put(slot)

    def _run(
        self, slot: ExecutionSlot, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        assert self._env is not None
        batched = self._config.max_batch_size > 0
        shapes = {name: tuple(array.shape) for name, array in inputs.items()}
        chunks = plan_chunks(self._profiles, shapes, batched=batched)
        parts: dict[str, list[np.ndarray]] = {name: [] for name in output_names}
        for profile, start, stop in chunks:
            chunk = {name: array[start:stop] if batched else array for name, array in inputs.items()}
            if len(chunks) == 1:
                chunk = dict(inputs)
            for name, array in self._run_chunk(slot, profile, chunk, output_names).items():
                parts[name].append(array)
        return {name: arrays[0] if len(arrays) == 1 else np.concatenate(arrays) for name, arrays in parts.items()}

    def _run_chunk(
        self, slot: ExecutionSlot, profile: int, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        env = self._env
        assert env is not None
        cudart, context, stream = env.cudart, slot.context, slot.stream
        handle = int(stream)
        if any(p.shapes for p in self._profiles) and slot.profile != profile:
            if not context.set_optimization_profile_async(profile, handle):
                raise EngineRunError(f"TensorRT refused to switch context {slot.index} to profile {profile}")
            slot.profile = profile
        to_device = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        for name, array in inputs.items():
            tensor = self._tensors[name]
            if not context.set_input_shape(name, array.shape):
                raise EngineRunError(f"input '{name}': TensorRT refused shape {list(array.shape)}")
            staged = slot.host[name].view(tensor.dtype, array.shape)
            np.copyto(staged, array, casting="no")
            checked(
                cudart.cudaMemcpyAsync(slot.device[name].ptr, slot.host[name].ptr, staged.nbytes, to_device, stream),
                f"cudaMemcpyAsync(input '{name}', host to device)",
            )
        missing = context.infer_shapes()
        if missing:
            raise EngineRunError(f"TensorRT cannot infer output shapes; inputs lacking shapes: {list(missing)}")
        if not context.execute_async_v3(handle):
            raise EngineRunError(f"TensorRT failed to enqueue the inference: {'; '.join(self._trt_logger.errors[-3:])}")
        to_host = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        shapes = {}
        for name in output_names:
            tensor = self._tensors[name]
            shape = tuple(int(dim) for dim in context.get_tensor_shape(name))
            nbytes = int(np.prod(shape, dtype=np.int64)) * tensor.dtype.itemsize
            checked(
                cudart.cudaMemcpyAsync(slot.host[name].ptr, slot.device[name].ptr, nbytes, to_host, stream),
                f"cudaMemcpyAsync(output '{name}', device to host)",
            )
            shapes[name] = shape
        checked(cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        # Copies out of the pinned buffers: the next run of this context reuses them.
        return {name: slot.host[name].view(self._tensors[name].dtype, shape).copy() for name, shape in shapes.items()}

    # --- teardown -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything in dependency order; safe after a failed or partial load, and twice."""
        env = self._env
        if env is None:
            return
        cudart = env.cudart
        problems: list[str] = []

        def attempt(what: str, action: Callable[..., object], *args: Any) -> None:
            try:
                action(*args)
            except Exception as error:  # keep releasing the rest; report at the end
                problems.append(f"{what}: {error}")

        def cuda(call: Callable[..., Any], *args: Any) -> None:
            checked(call(*args), getattr(call, "__name__", "CUDA call"))

        # 1. Nothing may still run: wait for every stream.
        for stream in self._streams:
            attempt("cudaStreamSynchronize", cuda, cudart.cudaStreamSynchronize, stream)
        # 2. Contexts go before the memory bound to them and before the engine.
        slots = list(self._slots)
        if self._slots_in_progress is not None:
            slots.append(self._slots_in_progress)
        for slot in slots:
            slot.context = None
        self._slots = []
        self._slots_in_progress = None
        self._pool = queue.SimpleQueue()
        # 3. Their buffers, then 4. the streams.
        for slot in slots:
            for device_buffer in slot.device.values():
                attempt("cudaFree", device_buffer.free, cudart)
            for host_buffer in slot.host.values():
                attempt("cudaFreeHost", host_buffer.free, cudart)
        for stream in self._streams:
            attempt("cudaStreamDestroy", cuda, cudart.cudaStreamDestroy, stream)
        self._streams = []
        # 5. The engine, then 6. the runtime that deserialized it.
        self._engine = None
        self._runtime = None
        self._env = None
        if problems:
            self._logger.warning("tensorrt teardown reported errors", problems=problems)


def _warm_up_shapes(profiles: Sequence[Profile]) -> dict[str, tuple[int, ...]]:
    """The min shapes of the first profile that takes a batch of one row (the config guarantees there is one)."""
    profile = next((p for p in profiles if p.min_batch <= 1), profiles[0] if profiles else None)
    if profile is None:
        return {}
    return {name: low for name, (low, _, _) in profile.shapes}
