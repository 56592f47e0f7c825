"""Check a request's tensor headers against the model's metadata before any payload is decoded.

Checking names, datatypes and shapes first means a wrong request gets the
clearest message ("expected shape [-1, 4], got [2, 5]") rather than a byte
count error, costs no decoding, and never reaches an engine. Byte lengths and
typed contents are checked when the payload is decoded (``common.tensors``).
Every problem raises InvalidInput naming the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from splitstream.common.errors import InvalidInput
from splitstream.worker.metadata import DYNAMIC, ModelMetadata


class InputHeader(NamedTuple):
    """What a request says about one input tensor (its payload is decoded later)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class RequestPlan:
    """What a valid request needs from the scheduler."""

    #: Rows along the batch dimension (1 when the model has none).
    rows: int
    #: Outputs to return, in response order: as requested, else the model's order.
    output_names: tuple[str, ...]


def validate_request(
    inputs: Sequence[InputHeader],
    requested_outputs: Sequence[str],
    metadata: ModelMetadata,
    *,
    max_batch_size: int,
) -> RequestPlan:
    """Raise InvalidInput for the first problem found; otherwise say how to run the request."""
    seen: set[str] = set()
    rows: int | None = None
    rows_from = ""
    for header in inputs:
        spec = metadata.input(header.name)
        if spec is None:
            raise InvalidInput(f"unknown input '{header.name}'; the model's inputs are {list(metadata.input_names)}")
        if header.name in seen:
            raise InvalidInput(f"input '{header.name}' appears more than once")
        seen.add(header.name)
        if header.datatype != spec.datatype:
            raise InvalidInput(
                f"input '{header.name}': wrong datatype, expected {spec.datatype}, got {header.datatype or '(empty)'}"
            )
        shape = list(header.shape)
        if any(dim < 0 for dim in shape):
            raise InvalidInput(f"input '{header.name}': shape {shape} has a negative dimension")
        if len(shape) != len(spec.shape) or any(
            want != DYNAMIC and got != want for got, want in zip(shape, spec.shape, strict=False)
        ):
            raise InvalidInput(
                f"input '{header.name}': wrong shape, expected {list(spec.shape)} (-1 = any size), got {shape}"
            )
        if max_batch_size > 0:
            batch = shape[0]
            if batch < 1:
                raise InvalidInput(f"input '{header.name}': batch dimension must be at least 1, got {batch}")
            if batch > max_batch_size:
                raise InvalidInput(f"input '{header.name}': batch of {batch} exceeds max_batch_size {max_batch_size}")
            if rows is not None and batch != rows:
                raise InvalidInput(
                    f"input '{header.name}': batch of {batch} differs from input '{rows_from}' with batch of {rows}"
                )
            rows, rows_from = batch, header.name
    missing = [name for name in metadata.input_names if name not in seen]
    if missing:
        raise InvalidInput(f"missing input '{missing[0]}'; the model needs {list(metadata.input_names)}")
    known_outputs = metadata.output_names
    chosen: list[str] = []
    for name in requested_outputs:
        if name not in known_outputs:
            raise InvalidInput(f"unknown requested output '{name}'; the model's outputs are {list(known_outputs)}")
        if name in chosen:
            raise InvalidInput(f"output '{name}' is requested more than once")
        chosen.append(name)
    return RequestPlan(rows=rows or 1, output_names=tuple(chosen) or known_outputs)
