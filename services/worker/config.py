"""A model version's ``config.yaml``: how the worker serves it.

Layout: ``<repository>/<model>/<version>/{model.onnx,config.yaml}``. Every field
is validated when the file is read, unknown keys included, so a typo fails at
start-up with a message naming the field instead of being silently ignored::

    backend: onnxruntime          # the only backend so far
    max_batch_size: 8             # >0: first dim of every tensor is the batch dim; 0: no batch dim
    dynamic_batching:             # optional; absent or enabled: false → each request runs alone
      enabled: true
      max_queue_delay_us: 500
    instance_count: 1             # concurrent backend runs
    intra_op_threads: 1           # onnxruntime intra-op threads (0 = onnxruntime decides)
    execution_providers: [cpu]    # preference order among tensorrt, cuda, cpu
    inputs:  [{name: x, datatype: FP32, shape: [-1, 4]}]   # optional; default from the model
    outputs: [...]                # optional, same
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from splitstream.common.errors import ConfigError
from splitstream.worker.metadata import TensorSpec

BACKENDS = ("onnxruntime",)
EXECUTION_PROVIDERS = ("tensorrt", "cuda", "cpu")


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
        return cls(**values)


def _dynamic_batching(data: Any) -> DynamicBatchingConfig:
    if data is None:  # `dynamic_batching:` with nothing under it turns batching on with defaults
        return DynamicBatchingConfig()
    if not isinstance(data, Mapping):
        raise ConfigError(f"dynamic_batching: must be a mapping, got {data!r}")
    _reject_unknown("dynamic_batching.", data, {f.name for f in fields(DynamicBatchingConfig)})
    return DynamicBatchingConfig(**data)


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


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: must be true or false, got {value!r}")
