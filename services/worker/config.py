"""A model version's ``config.yaml``: how the worker serves it.

Layout: ``<repository>/<model>/<version>/{model.onnx,config.yaml}``. Every field
is validated when the file is read, unknown keys included, so a typo fails at
start-up with a message naming the field instead of being silently ignored::

    backend: onnxruntime          # onnxruntime | tensorrt (native engines; needs the [tensorrt] extra and a GPU)
    max_batch_size: 8             # >0: first dim of every tensor is the batch dim; 0: no batch dim
    dynamic_batching:             # optional; absent or enabled: false → each request runs alone
      enabled: true
      max_queue_delay_us: 500
    instance_count: 1             # concurrent backend runs
    intra_op_threads: 1           # onnxruntime intra-op threads (0 = onnxruntime decides)
    execution_providers: [cpu]    # preference order among tensorrt, cuda, cpu
    inputs:  [{name: x, datatype: FP32, shape: [-1, 4]}]   # optional; default from the model
    outputs: [...]                # optional, same
    onnxruntime:                  # optional, backend onnxruntime only
      tensorrt:                   # options of ONNX Runtime's TensorRT execution provider (when it is used)
        engine_cache_path: trt-ep-cache   # relative to the version directory; turns the engine cache on
        timing_cache_path: trt-ep-cache   # turns the timing cache on
        fp16: false
        workspace_bytes: 1073741824
        profile: {min: {x: [1, 4]}, opt: {x: [8, 4]}, max: {x: [8, 4]}}
    tensorrt:                     # optional, backend tensorrt only (every field has a default)
      precision: fp16             # fp32 | fp16 | int8 (int8: a Q/DQ model, see quantized_model)
      precision_mode: onnx        # onnx: the graph carries the precision | builder_flags: TensorRT 10.x only
      quantized_model: model.qdq.onnx   # int8 only; default model.onnx, which must then hold Q/DQ nodes
      profiles: [{min: {x: [1, 4]}, opt: {x: [8, 4]}, max: {x: [8, 4]}}]   # default: batch 1..max_batch_size
      workspace_bytes: 1073741824 # builder workspace limit; default TensorRT's (the device's memory)
      contexts: 2                 # execution contexts, each with its own CUDA stream; default instance_count
      stream_priority: normal     # normal | high | a CUDA priority (lower = more urgent)
      build_on_start: false       # no engine for this GPU: build one at start (true) or fail naming the key
      hardware_compatibility: none      # none | ampere_plus | same_cc
      version_compatible: false   # engine runs on later TensorRT of the same major version
      timing_cache: true          # reuse and save the builder's timing cache in engines/
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from splitstream.common.errors import ConfigError
from splitstream.worker.metadata import TensorSpec

BACKENDS = ("onnxruntime", "tensorrt")
EXECUTION_PROVIDERS = ("tensorrt", "cuda", "cpu")
PRECISIONS = ("fp32", "fp16", "int8")
PRECISION_MODES = ("onnx", "builder_flags")
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_cc")
STREAM_PRIORITIES = ("normal", "high")


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """One TensorRT optimisation profile: per input name, its smallest, tuned-for and largest shape.

    Only the shapes themselves are checked here (same names and ranks in all
    three, ``min <= opt <= max``); whether they fit the model's inputs is
    checked against the ONNX graph (:mod:`splitstream.worker.engines.profiles`).
    """

    min: Mapping[str, tuple[int, ...]]
    opt: Mapping[str, tuple[int, ...]]
    max: Mapping[str, tuple[int, ...]]

    def __post_init__(self) -> None:
        names = set(self.min)
        if not names:
            raise ConfigError("min: must name at least one input")
        for kind in ("opt", "max"):
            other = set(getattr(self, kind))
            if other != names:
                raise ConfigError(f"{kind}: names {sorted(other)}, but min names {sorted(names)}")
        for name in sorted(names):
            low, opt, high = self.min[name], self.opt[name], self.max[name]
            if not len(low) == len(opt) == len(high):
                raise ConfigError(f"input '{name}': min, opt and max must have the same rank")
            if any(dim < 0 for dim in low):
                raise ConfigError(f"input '{name}': min {list(low)} has a negative dimension")
            if not all(a <= b <= c for a, b, c in zip(low, opt, high, strict=True)):
                raise ConfigError(
                    f"input '{name}': needs min <= opt <= max in every dimension, got "
                    f"min {list(low)}, opt {list(opt)}, max {list(high)}"
                )


@dataclass(frozen=True, kw_only=True)
class TensorRTConfig:
    """How the native TensorRT backend builds and runs engines (``backend: tensorrt``)."""

    #: fp32, or fp16 / int8 made by the precision step (:mod:`splitstream.worker.engines.precision`).
    precision: str = "fp32"
    #: ``onnx``: the prepared ONNX carries the precision (TensorRT 10.x and 11.x); ``builder_flags``:
    #: the FP32 graph plus TensorRT 10.x's FP16/INT8 builder flags (refused on 11+, where they are gone).
    precision_mode: str = "onnx"
    #: For int8: the explicitly quantised (Q/DQ) ONNX file in the version directory; default model.onnx.
    quantized_model: str | None = None
    #: Optimisation profiles; empty: one derived from the model (batch 1..max_batch_size, opt = max).
    profiles: tuple[ProfileConfig, ...] = ()
    #: Builder workspace limit (memory pool WORKSPACE); None: TensorRT's default.
    workspace_bytes: int | None = None
    #: Execution contexts (each with its own CUDA stream and buffers); None: instance_count.
    contexts: int | None = None
    #: ``normal``, ``high`` (the device's greatest priority) or a CUDA stream priority (lower = more urgent).
    stream_priority: str | int = "normal"
    #: No engine for this GPU in the cache: build one at start (minutes) instead of failing.
    build_on_start: bool = False
    hardware_compatibility: str = "none"
    version_compatible: bool = False
    timing_cache: bool = True

    def __post_init__(self) -> None:
        _check_choice("tensorrt.precision", self.precision, PRECISIONS)
        _check_choice("tensorrt.precision_mode", self.precision_mode, PRECISION_MODES)
        _check_choice("tensorrt.hardware_compatibility", self.hardware_compatibility, HARDWARE_COMPATIBILITY)
        if self.quantized_model is not None:
            if not isinstance(self.quantized_model, str) or not self.quantized_model:
                raise ConfigError(f"tensorrt.quantized_model: must be a file name, got {self.quantized_model!r}")
            if self.precision != "int8":
                raise ConfigError("tensorrt.quantized_model: only used with precision: int8")
            if Path(self.quantized_model).is_absolute() or ".." in Path(self.quantized_model).parts:
                raise ConfigError(
                    f"tensorrt.quantized_model: must name a file inside the version directory, got "
                    f"{self.quantized_model!r}"
                )
        if self.workspace_bytes is not None:
            _check_int("tensorrt.workspace_bytes", self.workspace_bytes, minimum=1)
        if self.contexts is not None:
            _check_int("tensorrt.contexts", self.contexts, minimum=1)
        priority = self.stream_priority
        if isinstance(priority, bool) or not (isinstance(priority, int) or priority in STREAM_PRIORITIES):
            raise ConfigError(
                f"tensorrt.stream_priority: must be one of {list(STREAM_PRIORITIES)} or an integer CUDA priority, "
                f"got {priority!r}"
            )
        for name in ("build_on_start", "version_compatible", "timing_cache"):
            _check_bool(f"tensorrt.{name}", getattr(self, name))


@dataclass(frozen=True, kw_only=True)
class TensorRTProviderConfig:
    """Options of ONNX Runtime's TensorRT execution provider (``onnxruntime.tensorrt``)."""

    #: Directory (relative to the version directory) where the provider keeps its engines; None: no cache.
    engine_cache_path: str | None = None
    #: Directory for the provider's timing cache; None: no timing cache.
    timing_cache_path: str | None = None
    fp16: bool = False
    workspace_bytes: int | None = None
    #: The provider's one optimisation profile; None: it builds for the shapes it sees.
    profile: ProfileConfig | None = None

    def __post_init__(self) -> None:
        for name in ("engine_cache_path", "timing_cache_path"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"onnxruntime.tensorrt.{name}: must be a directory path, got {value!r}")
        _check_bool("onnxruntime.tensorrt.fp16", self.fp16)
        if self.workspace_bytes is not None:
            _check_int("onnxruntime.tensorrt.workspace_bytes", self.workspace_bytes, minimum=1)


@dataclass(frozen=True, kw_only=True)
class OnnxRuntimeConfig:
    """ONNX Runtime backend options beyond ``execution_providers`` (``onnxruntime``)."""

    tensorrt: TensorRTProviderConfig = field(default_factory=TensorRTProviderConfig)


@dataclass(frozen=True, kw_only=True)
class DynamicBatchingConfig:
    """Queue concurrent requests and run them as one batch (needs ``max_batch_size > 0``)."""

    enabled: bool = True
    #: How long the first request of a batch may wait for others to join it.
    max_queue_delay_us: int = 0

    def __post_init__(self) -> None:
        _check_bool("dynamic_batching.enabled", self.enabled)
        _check_int("dynamic_batching.max_queue_delay_us", self.max_queue_delay_us, minimum=0)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The validated content of one ``config.yaml``."""

    backend: str
    max_batch_size: int = 0
    dynamic_batching: DynamicBatchingConfig = field(default_factory=lambda: DynamicBatchingConfig(enabled=False))
    instance_count: int = 1
    intra_op_threads: int = 1
    execution_providers: tuple[str, ...] = ("cpu",)
    inputs: tuple[TensorSpec, ...] | None = None
    outputs: tuple[TensorSpec, ...] | None = None
    onnxruntime: OnnxRuntimeConfig | None = None
    tensorrt: TensorRTConfig | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: must be one of {list(BACKENDS)}, got {self.backend!r}")
        _check_int("max_batch_size", self.max_batch_size, minimum=0)
        _check_int("instance_count", self.instance_count, minimum=1)
        _check_int("intra_op_threads", self.intra_op_threads, minimum=0)
        if not self.execution_providers:
            raise ConfigError(f"execution_providers: must list at least one of {list(EXECUTION_PROVIDERS)}")
        for provider in self.execution_providers:
            if provider not in EXECUTION_PROVIDERS:
                raise ConfigError(
                    f"execution_providers: each must be one of {list(EXECUTION_PROVIDERS)}, got {provider!r}"
                )
        if len(set(self.execution_providers)) != len(self.execution_providers):
            raise ConfigError(f"execution_providers: {list(self.execution_providers)} lists a provider twice")
        if self.dynamic_batching.enabled and self.max_batch_size == 0:
            raise ConfigError("dynamic_batching: needs max_batch_size > 0 (the batch dimension to stack requests on)")
        for kind in ("inputs", "outputs"):
            specs = getattr(self, kind)
            if specs is not None:
                names = [spec.name for spec in specs]
                if not names:
                    raise ConfigError(f"{kind}: must not be empty (leave it out to read it from the model)")
                if len(set(names)) != len(names):
                    raise ConfigError(f"{kind}: {names} names a tensor twice")
        if self.tensorrt is not None and self.backend != "tensorrt":
            raise ConfigError(f"tensorrt: configures backend tensorrt, but backend is {self.backend}")
        if self.onnxruntime is not None and self.backend != "onnxruntime":
            raise ConfigError(f"onnxruntime: configures backend onnxruntime, but backend is {self.backend}")

    @property
    def trt(self) -> TensorRTConfig:
        """The ``tensorrt`` section, defaults filled in when it is absent."""
        return self.tensorrt if self.tensorrt is not None else TensorRTConfig()

    @property
    def ort(self) -> OnnxRuntimeConfig:
        """The ``onnxruntime`` section, defaults filled in when it is absent."""
        return self.onnxruntime if self.onnxruntime is not None else OnnxRuntimeConfig()

    @property
    def batching(self) -> bool:
        """True when concurrent requests are stacked into one backend run."""
        return self.max_batch_size > 0 and self.dynamic_batching.enabled

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        """Read and validate ``path``; every ConfigError message starts with the path."""
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except OSError as error:
            raise ConfigError(f"{path}: cannot read it ({error.strerror})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            problem = " ".join(str(error).split())
            raise ConfigError(f"{path}: not valid YAML ({problem})") from None
        try:
            return cls.from_mapping(data if data is not None else {})
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None

    @classmethod
    def from_mapping(cls, data: Any) -> ModelConfig:
        """Build from parsed YAML; raises ConfigError naming the field and the problem."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"must be a mapping of settings, got {type(data).__name__}")
        _reject_unknown("", data, {f.name for f in fields(cls)})
        if "backend" not in data:
            raise ConfigError(f"backend: is required (one of {list(BACKENDS)})")
        values: dict[str, Any] = dict(data)
        if "dynamic_batching" in values:
            values["dynamic_batching"] = _dynamic_batching(values["dynamic_batching"])
        if "execution_providers" in values:
            providers = values["execution_providers"]
            if not isinstance(providers, list):
                raise ConfigError(f"execution_providers: must be a list, got {providers!r}")
            values["execution_providers"] = tuple(providers)
        for kind in ("inputs", "outputs"):
            if kind in values:
                values[kind] = _tensors(kind, values[kind])
        if "tensorrt" in values:
            values["tensorrt"] = _tensorrt(values["tensorrt"])
        if "onnxruntime" in values:
            values["onnxruntime"] = _onnxruntime(values["onnxruntime"])
        return cls(**values)


def _dynamic_batching(data: Any) -> DynamicBatchingConfig:
    if data is None:  # `dynamic_batching:` with nothing under it turns batching on with defaults
        return DynamicBatchingConfig()
    if not isinstance(data, Mapping):
        raise ConfigError(f"dynamic_batching: must be a mapping, got {data!r}")
    _reject_unknown("dynamic_batching.", data, {f.name for f in fields(DynamicBatchingConfig)})
    return DynamicBatchingConfig(**data)


def _tensorrt(data: Any) -> TensorRTConfig:
    if data is None:
        return TensorRTConfig()
    if not isinstance(data, Mapping):
        raise ConfigError(f"tensorrt: must be a mapping, got {data!r}")
    _reject_unknown("tensorrt.", data, {f.name for f in fields(TensorRTConfig)})
    values = dict(data)
    if "profiles" in values:
        profiles = values["profiles"]
        if not isinstance(profiles, list) or not profiles:
            raise ConfigError(f"tensorrt.profiles: must be a non-empty list of {{min, opt, max}}, got {profiles!r}")
        values["profiles"] = tuple(_profile(f"tensorrt.profiles[{i}]", item) for i, item in enumerate(profiles))
    return TensorRTConfig(**values)


def _onnxruntime(data: Any) -> OnnxRuntimeConfig:
    if data is None:
        return OnnxRuntimeConfig()
    if not isinstance(data, Mapping):
        raise ConfigError(f"onnxruntime: must be a mapping, got {data!r}")
    _reject_unknown("onnxruntime.", data, {f.name for f in fields(OnnxRuntimeConfig)})
    provider = data.get("tensorrt")
    if provider is None:
        return OnnxRuntimeConfig()
    if not isinstance(provider, Mapping):
        raise ConfigError(f"onnxruntime.tensorrt: must be a mapping, got {provider!r}")
    _reject_unknown("onnxruntime.tensorrt.", provider, {f.name for f in fields(TensorRTProviderConfig)})
    values = dict(provider)
    if values.get("profile") is not None:
        values["profile"] = _profile("onnxruntime.tensorrt.profile", values["profile"])
    return OnnxRuntimeConfig(tensorrt=TensorRTProviderConfig(**values))


def _profile(where: str, data: Any) -> ProfileConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: must be a mapping {{min, opt, max}}, got {data!r}")
    _reject_unknown(f"{where}.", data, {"min", "opt", "max"})
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for kind in ("min", "opt", "max"):
        if kind not in data:
            raise ConfigError(f"{where}: lacks {kind}")
        by_name = data[kind]
        if not isinstance(by_name, Mapping):
            raise ConfigError(f"{where}.{kind}: must map input names to shapes, got {by_name!r}")
        shapes[kind] = {}
        for name, shape in by_name.items():
            if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                raise ConfigError(f"{where}.{kind}.{name}: must be a list of integers, got {shape!r}")
            shapes[kind][str(name)] = tuple(shape)
    try:
        return ProfileConfig(min=shapes["min"], opt=shapes["opt"], max=shapes["max"])
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _tensors(kind: str, data: Any) -> tuple[TensorSpec, ...]:
    if not isinstance(data, list):
        raise ConfigError(f"{kind}: must be a list of {{name, datatype, shape}}, got {data!r}")
    specs = []
    for index, item in enumerate(data):
        where = f"{kind}[{index}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where}: must be a mapping {{name, datatype, shape}}, got {item!r}")
        _reject_unknown(f"{where}.", item, {"name", "datatype", "shape"})
        missing = [key for key in ("name", "datatype", "shape") if key not in item]
        if missing:
            raise ConfigError(f"{where}: lacks {missing}")
        name, datatype, shape = item["name"], item["datatype"], item["shape"]
        if not isinstance(name, str):
            raise ConfigError(f"{where}.name: must be a string, got {name!r}")
        if not isinstance(datatype, str):
            raise ConfigError(f"{where}.datatype: must be a string such as FP32, got {datatype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise ConfigError(f"{where}.shape: must be a list of integers (-1 = dynamic), got {shape!r}")
        try:
            specs.append(TensorSpec(name=name, datatype=datatype.upper(), shape=tuple(shape)))
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
    return tuple(specs)


def _reject_unknown(prefix: str, data: Mapping[Any, Any], known: set[str]) -> None:
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown field (known: {sorted(known)})")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: must be one of {list(choices)}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: must be true or false, got {value!r}")
