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
    generation:                   # optional; present: a generative (decoupled) model, see GenerationConfig
      max_tokens_limit: 4096      # the most tokens one request may ask for
      pad_id: 10                  # token a prompt shorter than the model's context is padded with on the left
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

import argparse
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ModelWrapValidatorHandler,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from splitstream.common.errors import ConfigError
from splitstream.common.schema import Document, Flag, Shape, int_at_least, one_of, validate
from splitstream.worker.metadata import TensorSpec

BACKENDS = ("onnxruntime", "tensorrt")
EXECUTION_PROVIDERS = ("tensorrt", "cuda", "cpu")
PRECISIONS = ("fp32", "fp16", "int8")
PRECISION_MODES = ("onnx", "builder_flags")
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_cc")
STREAM_PRIORITIES = ("normal", "high")


def _section_or_defaults(value: Any) -> Any:
    """A section written with nothing under it (``tensorrt:``) means "all defaults", as an empty mapping does."""
    return {} if value is None else value


def _non_empty_list(what: str) -> Any:
    """A YAML list (kept as a tuple) with at least one item; items are validated by the field's item type."""

    def check(value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise ValueError(f"must be a non-empty list of {what}")
        return tuple(value)

    return BeforeValidator(check)


def _list_of(what: str) -> Any:
    def check(value: Any) -> Any:
        if not isinstance(value, list):
            raise ValueError(f"must be a list of {what}")
        return tuple(value)

    return BeforeValidator(check)


class ProfileConfig(Document):
    """One TensorRT optimisation profile: per input name, its smallest, tuned-for and largest shape.

    Only the shapes themselves are checked here (same names and ranks in all
    three, ``min <= opt <= max``); whether they fit the model's inputs is
    checked against the ONNX graph (:mod:`splitstream.worker.engines.profiles`).
    """

    #: Input name → its smallest shape.
    min: dict[str, Shape]
    #: Input name → the shape TensorRT tunes for.
    opt: dict[str, Shape]
    #: Input name → its largest shape.
    max: dict[str, Shape]

    @model_validator(mode="wrap")
    @classmethod
    def _all_three(cls, data: Any, handler: ModelWrapValidatorHandler[ProfileConfig]) -> ProfileConfig:
        """A missing shape set reads "lacks opt" (the names are the words of the rule), after any wrong value."""
        try:
            return handler(data)
        except ValidationError as error:
            first = error.errors()[0]
            if first["type"] == "missing" and len(first["loc"]) == 1:
                raise ValueError(f"lacks {first['loc'][0]}") from None
            raise

    @model_validator(mode="after")
    def _consistent(self) -> ProfileConfig:
        names = set(self.min)
        if not names:
            raise ValueError("min: must name at least one input")
        for kind in ("opt", "max"):
            other = set(getattr(self, kind))
            if other != names:
                raise ValueError(f"{kind}: names {sorted(other)}, but min names {sorted(names)}")
        for name in sorted(names):
            low, opt, high = self.min[name], self.opt[name], self.max[name]
            if not len(low) == len(opt) == len(high):
                raise ValueError(f"input '{name}': min, opt and max must have the same rank")
            if any(dim < 0 for dim in low):
                raise ValueError(f"input '{name}': min {list(low)} has a negative dimension")
            if not all(a <= b <= c for a, b, c in zip(low, opt, high, strict=True)):
                raise ValueError(
                    f"input '{name}': needs min <= opt <= max in every dimension, got "
                    f"min {list(low)}, opt {list(opt)}, max {list(high)}"
                )
        return self


def _stream_priority(value: Any) -> str | int:
    if isinstance(value, bool) or not (isinstance(value, int) or value in STREAM_PRIORITIES):
        raise ValueError(f"must be one of {list(STREAM_PRIORITIES)} or an integer CUDA priority")
    return value  # type: ignore[no-any-return]


class TensorRTConfig(Document):
    """How the native TensorRT backend builds and runs engines (``backend: tensorrt``)."""

    #: ``fp32``, or ``fp16`` / ``int8`` made by the precision step (:mod:`splitstream.worker.engines.precision`).
    precision: one_of(*PRECISIONS) = "fp32"  # type: ignore[valid-type]
    #: ``onnx``: the prepared ONNX carries the precision (TensorRT 10.x and 11.x); ``builder_flags``:
    #: the FP32 graph plus TensorRT 10.x's FP16/INT8 builder flags (refused on 11+, where they are gone).
    precision_mode: one_of(*PRECISION_MODES) = "onnx"  # type: ignore[valid-type]
    #: For int8: the explicitly quantised (Q/DQ) ONNX file in the version directory; default model.onnx.
    quantized_model: str | None = None
    #: Optimisation profiles; empty: one derived from the model (batch 1..max_batch_size, opt = max).
    profiles: Annotated[tuple[ProfileConfig, ...], _non_empty_list("{min, opt, max}")] = ()
    #: Builder workspace limit (memory pool WORKSPACE); None: TensorRT's default.
    workspace_bytes: int_at_least(1) | None = None  # type: ignore[valid-type]
    #: Execution contexts (each with its own CUDA stream and buffers); None: instance_count.
    contexts: int_at_least(1) | None = None  # type: ignore[valid-type]
    #: ``normal``, ``high`` (the device's greatest priority) or a CUDA stream priority (lower = more urgent).
    stream_priority: Annotated[str | int, PlainValidator(_stream_priority)] = "normal"
    #: No engine for this GPU in the cache: build one at start (minutes) instead of failing.
    build_on_start: Flag = False
    #: ``none``, ``ampere_plus`` (one engine for Ampere and later) or ``same_cc`` (same compute capability).
    hardware_compatibility: one_of(*HARDWARE_COMPATIBILITY) = "none"  # type: ignore[valid-type]
    #: The engine runs on later TensorRT of the same major version.
    version_compatible: Flag = False
    #: Reuse and save the builder's timing cache in ``engines/``.
    timing_cache: Flag = True

    @field_validator("quantized_model")
    @classmethod
    def _quantized_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must be a file name")
        if info.data.get("precision") != "int8":
            raise ValueError("only used with precision: int8")
        if Path(value).is_absolute() or ".." in Path(value).parts:
            raise ValueError("must name a file inside the version directory")
        return value


def _directory(value: str) -> str:
    if not value:
        raise ValueError("must be a directory path")
    return value


class TensorRTProviderConfig(Document):
    """Options of ONNX Runtime's TensorRT execution provider (``onnxruntime.tensorrt``)."""

    #: Directory (relative to the version directory) where the provider keeps its engines; None: no cache.
    engine_cache_path: Annotated[str, AfterValidator(_directory)] | None = None
    #: Directory for the provider's timing cache; None: no timing cache.
    timing_cache_path: Annotated[str, AfterValidator(_directory)] | None = None
    #: Let the provider build FP16 kernels.
    fp16: Flag = False
    #: Provider workspace limit; None: the provider's default.
    workspace_bytes: int_at_least(1) | None = None  # type: ignore[valid-type]
    #: The provider's one optimisation profile; None: it builds for the shapes it sees.
    profile: ProfileConfig | None = None


class OnnxRuntimeConfig(Document):
    """ONNX Runtime backend options beyond ``execution_providers`` (``onnxruntime``)."""

    #: Options of ONNX Runtime's TensorRT execution provider, used when it is among the providers.
    tensorrt: Annotated[TensorRTProviderConfig, BeforeValidator(_section_or_defaults)] = Field(
        default_factory=TensorRTProviderConfig
    )


#: Upper bounds of config.yaml fields whose huge values are typos, not settings.
MAX_QUEUE_DELAY_US = 10_000_000
MAX_BATCH_SIZE = 65_536


class DynamicBatchingConfig(Document):
    """Queue concurrent requests and run them as one batch (needs ``max_batch_size > 0``)."""

    #: ``false`` keeps the section but runs each request alone.
    enabled: Flag = True
    #: How long the first request of a batch may wait for others to join it (at most 10 s: a batch that
    #: waits longer holds its first caller past any sensible deadline).
    max_queue_delay_us: int_at_least(0, MAX_QUEUE_DELAY_US) = 0  # type: ignore[valid-type]


#: The most tokens a generation config may allow one request: beyond it a typo, not a setting.
MAX_TOKENS_LIMIT = 1_000_000


class GenerationConfig(Document):
    """A generative model (``generation:``): the graph predicts the next token, the worker streams tokens.

    The graph takes the last tokens (INT64 [batch, n]) and returns logits (FP32 [batch, 256]) over
    a byte vocabulary (token id = byte value). Clients call it as they call TensorRT-LLM's ensemble
    (``text_input``, ``max_tokens``, ...; see docs/streams.md, "The worker"); every active
    sequence is stepped in one backend run of up to ``max_batch_size`` rows (in-flight batching).
    """

    #: The most tokens one request may ask for (``max_tokens``); more is refused naming the input.
    max_tokens_limit: int_at_least(1, MAX_TOKENS_LIMIT) = 4096  # type: ignore[valid-type]
    #: The token a prompt shorter than the model's context is padded with, on the left (newline: the
    #: separator the demo's models were counted with, so an empty prompt starts "a new text").
    pad_id: int_at_least(0, 255) = 10  # type: ignore[valid-type]


class TensorDocument(Document):
    """``{name, datatype, shape}`` as written; becomes a :class:`TensorSpec` (which checks the datatype)."""

    name: str
    datatype: str
    shape: Shape


def _tensor_spec(document: TensorDocument) -> TensorSpec:
    try:
        return TensorSpec(name=document.name, datatype=document.datatype.upper(), shape=document.shape)
    except ConfigError as error:
        raise ValueError(str(error)) from None


#: A tensor entry, validated as a document and delivered as the worker's own TensorSpec.
Tensor = Annotated[TensorSpec, PlainValidator(lambda value: _tensor_spec(TensorDocument.model_validate(value)))]


def _providers(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise ValueError(f"must list at least one of {list(EXECUTION_PROVIDERS)}")
    for provider in value:
        if provider not in EXECUTION_PROVIDERS:
            raise ValueError(f"each must be one of {list(EXECUTION_PROVIDERS)}, got {provider!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{list(value)} lists a provider twice")
    return value


def _unique_names(value: tuple[TensorSpec, ...] | None) -> tuple[TensorSpec, ...] | None:
    if value is not None:
        names = [spec.name for spec in value]
        if not names:
            raise ValueError("must not be empty (leave it out to read it from the model)")
        if len(set(names)) != len(names):
            raise ValueError(f"{names} names a tensor twice")
    return value


Tensors = Annotated[tuple[Tensor, ...] | None, _list_of("{name, datatype, shape}"), AfterValidator(_unique_names)]


class ModelConfig(Document):
    """The validated content of one ``config.yaml``."""

    #: ``onnxruntime`` or ``tensorrt`` (native engines; needs the [tensorrt] extra and a GPU).
    backend: one_of(*BACKENDS)  # type: ignore[valid-type]
    #: >0: the first dimension of every tensor is the batch dimension; 0: no batch dimension. At most
    #: 65,536: buffers and profiles are sized for it, so a typo must not ask for a petabyte.
    max_batch_size: int_at_least(0, MAX_BATCH_SIZE) = 0  # type: ignore[valid-type]
    #: Absent: off. Present (even empty): on, with its defaults.
    dynamic_batching: Annotated[DynamicBatchingConfig, BeforeValidator(_section_or_defaults)] = Field(
        default_factory=lambda: DynamicBatchingConfig(enabled=False)
    )
    #: Concurrent backend runs.
    instance_count: int_at_least(1) = 1  # type: ignore[valid-type]
    #: ONNX Runtime intra-op threads (0: ONNX Runtime decides).
    intra_op_threads: int_at_least(0) = 1  # type: ignore[valid-type]
    #: Preference order among ``tensorrt``, ``cuda``, ``cpu`` (backend onnxruntime).
    execution_providers: Annotated[tuple[str, ...], _list_of("providers"), AfterValidator(_providers)] = ("cpu",)
    #: ``[{name, datatype, shape}]`` (-1: a dynamic dimension); absent: read from the model.
    inputs: Tensors = None
    #: Same as inputs, for the outputs.
    outputs: Tensors = None
    #: Backend onnxruntime only: options of ONNX Runtime's TensorRT execution provider (``tensorrt:``).
    onnxruntime: Annotated[OnnxRuntimeConfig, BeforeValidator(_section_or_defaults)] | None = None
    #: Backend tensorrt only; every field has a default.
    tensorrt: Annotated[TensorRTConfig, BeforeValidator(_section_or_defaults)] | None = None
    #: Present (even empty): a generative model whose graph predicts the next token; absent: a tensor model.
    generation: Annotated[GenerationConfig, BeforeValidator(_section_or_defaults)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _backend_first(cls, data: Any) -> Any:
        if isinstance(data, dict) and "backend" not in data:
            raise ValueError(f"backend: is required (one of {list(BACKENDS)})")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.dynamic_batching.enabled and self.max_batch_size == 0:
            raise ValueError("dynamic_batching: needs max_batch_size > 0 (the batch dimension to stack requests on)")
        if self.tensorrt is not None and self.backend != "tensorrt":
            raise ValueError(f"tensorrt: configures backend tensorrt, but backend is {self.backend}")
        if self.onnxruntime is not None and self.backend != "onnxruntime":
            raise ValueError(f"onnxruntime: configures backend onnxruntime, but backend is {self.backend}")
        if self.generation is not None:
            if self.max_batch_size == 0:
                raise ValueError("generation: needs max_batch_size > 0 (the most sequences stepped together)")
            if self.dynamic_batching.enabled:
                raise ValueError(
                    "generation: replaces dynamic_batching (every active sequence joins the next step); remove it"
                )
            if self.instance_count != 1:
                raise ValueError(
                    "generation: steps every sequence in one backend run at a time; instance_count must be 1"
                )
        return self

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
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"{path}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
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
        """Build from parsed YAML; raises ConfigError naming the field path and the problem."""
        if not isinstance(data, dict):
            raise ConfigError(f"must be a mapping of settings, got {type(data).__name__}")
        return validate(cls, data)


def add_model_repository_argument(parser: argparse.ArgumentParser) -> None:
    """The worker and the engine builder read the same repository layout, so they take it the same way."""
    parser.add_argument(
        "--model-repository",
        type=Path,
        required=True,
        default=argparse.SUPPRESS,
        metavar="DIR",
        help="directory holding MODEL/VERSION/{model.onnx,config.yaml}",
    )
