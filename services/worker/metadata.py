"""What tensors a served model takes and returns: the contract requests are validated against.

A backend reports what its engine says (:class:`ModelMetadata` with ``-1`` for
dynamic dimensions); ``config.yaml`` may declare the same tensors to narrow
dynamic dimensions. :func:`resolve` merges the two and refuses declarations
the engine cannot honour, so a request that passes validation is one the
engine accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitstream.common.errors import ConfigError
from splitstream.common.tensors import NUMPY_DTYPES

DYNAMIC = -1


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """A tensor's name, Open Inference Protocol datatype and shape (``-1`` = any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("tensor name must not be empty")
        if self.datatype not in NUMPY_DTYPES:
            raise ConfigError(
                f"tensor '{self.name}': datatype must be one of {sorted(NUMPY_DTYPES)}, got {self.datatype!r}"
            )
        if any(dim < DYNAMIC for dim in self.shape):
            raise ConfigError(f"tensor '{self.name}': dimensions must be -1 (dynamic) or >= 0, got {list(self.shape)}")


@dataclass(frozen=True, kw_only=True)
class ModelMetadata:
    """Inputs and outputs of a model, in the order clients see them."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.inputs if spec.name == name), None)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)


def resolve(
    engine: ModelMetadata,
    *,
    inputs: Sequence[TensorSpec] | None,
    outputs: Sequence[TensorSpec] | None,
    max_batch_size: int,
    source: str = "config.yaml",
) -> ModelMetadata:
    """Merge the engine's tensors with those ``source`` declares; raise ConfigError on a conflict.

    A declaration must name exactly the engine's tensors, with the same
    datatype and rank; it may fix a dimension the engine leaves dynamic, never
    the reverse. An engine shape of rank 0 may mean "rank unknown", so a
    declaration overrides it. With ``max_batch_size > 0`` every tensor's first
    dimension is the batch dimension and must be dynamic.
    """
    merged = ModelMetadata(
        inputs=_merge("inputs", engine.inputs, inputs, source),
        outputs=_merge("outputs", engine.outputs, outputs, source),
    )
    if max_batch_size > 0:
        for kind, specs in (("input", merged.inputs), ("output", merged.outputs)):
            for spec in specs:
                if not spec.shape or spec.shape[0] != DYNAMIC:
                    raise ConfigError(
                        f"{source}: max_batch_size {max_batch_size} makes the first dimension of every tensor the "
                        f"batch dimension, but {kind} '{spec.name}' has shape {list(spec.shape)}; its first "
                        "dimension must be -1 (or set max_batch_size: 0)"
                    )
    return merged


def _merge(
    kind: str, engine: tuple[TensorSpec, ...], declared: Sequence[TensorSpec] | None, source: str
) -> tuple[TensorSpec, ...]:
    if declared is None:
        return engine
    by_name = {spec.name: spec for spec in engine}
    declared_names = [spec.name for spec in declared]
    if sorted(declared_names) != sorted(by_name):
        raise ConfigError(
            f"{source}: {kind} must name exactly the model's {kind} {sorted(by_name)}, got {declared_names}"
        )
    for spec in declared:
        actual = by_name[spec.name]
        where = f"{source}: {kind} '{spec.name}'"
        if spec.datatype != actual.datatype:
            raise ConfigError(f"{where}: datatype {spec.datatype} does not match the model's {actual.datatype}")
        if not actual.shape:
            continue
        if len(spec.shape) != len(actual.shape):
            raise ConfigError(
                f"{where}: shape {list(spec.shape)} has a different rank than the model's {list(actual.shape)}"
            )
        for declared_dim, actual_dim in zip(spec.shape, actual.shape, strict=True):
            if actual_dim != DYNAMIC and declared_dim != actual_dim:
                raise ConfigError(f"{where}: shape {list(spec.shape)} conflicts with the model's {list(actual.shape)}")
    return tuple(declared)
