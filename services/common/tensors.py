"""Open Inference Protocol tensors ↔ NumPy arrays, in one place.

Every conversion between protobuf tensor messages and arrays goes through this
module, so workers, the replayer and tests agree on byte layouts: raw contents
are little-endian C-order element data; BYTES elements are each a 4-byte
little-endian length followed by the bytes (the protocol's raw BYTES layout).

Decoding a message's tensors is :func:`input_arrays` / :func:`output_arrays`, one
implementation for both (the worker validates requests with it, the replayer reads
answers with it): a message is all raw contents or all typed contents, and whatever
does not fit raises :class:`~splitstream.common.errors.InvalidInput` naming the tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from splitstream.common.errors import InvalidInput
from splitstream.common.proto.inference import grpc_service_pb2 as oip

#: Protocol datatype → NumPy dtype (little-endian). BF16 has no NumPy type.
NUMPY_DTYPES: Mapping[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(np.object_),
}

#: Which InferTensorContents field carries each datatype's typed values (FP16 has none).
CONTENTS_FIELDS: Mapping[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_LENGTH = struct.Struct("<I")


def datatype_of(array: np.ndarray) -> str:
    """The protocol datatype name for ``array``'s dtype."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    for name, dtype in NUMPY_DTYPES.items():
        if name != "BYTES" and array.dtype == dtype:
            return name
    raise TypeError(f"no Open Inference Protocol datatype for NumPy dtype {array.dtype}")


def element_count(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def to_raw(array: np.ndarray) -> bytes:
    """Serialize ``array`` in the protocol's raw layout."""
    if datatype_of(array) == "BYTES":
        parts = []
        for item in array.reshape(-1):
            data = item.encode() if isinstance(item, str) else bytes(item)
            parts.append(_LENGTH.pack(len(data)))
            parts.append(data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


#: Which side of a call a tensor is on: the word error messages name it by.
Kind = Literal["input", "output"]


class Tensor(Protocol):
    """What a request's input and a response's output share (InferInputTensor, InferOutputTensor)."""

    @property
    def name(self) -> str: ...
    @property
    def datatype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def contents(self) -> oip.InferTensorContents: ...


def from_raw(name: str, datatype: str, shape: Sequence[int], raw: bytes, *, kind: Kind = "input") -> np.ndarray:
    """Decode raw contents; raises InvalidInput naming the tensor when the bytes do not fit."""
    dtype = _dtype(name, datatype)
    count = element_count(shape)
    if datatype == "BYTES":
        return _bytes_from_raw(f"{kind} '{name}'", shape, count, raw)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidInput(
            f"{kind} '{name}': raw content is {len(raw)} bytes, but {datatype} with shape "
            f"{list(shape)} needs {expected} bytes"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def from_contents(
    name: str, datatype: str, shape: Sequence[int], contents: oip.InferTensorContents, *, kind: Kind = "input"
) -> np.ndarray:
    """Decode typed contents; raises InvalidInput when they do not fit the datatype or shape."""
    dtype = _dtype(name, datatype)
    field = CONTENTS_FIELDS.get(datatype)
    if field is None:
        raise InvalidInput(f"{kind} '{name}': {datatype} has no typed contents field; send it as raw contents")
    used = [f.name for f, _ in contents.ListFields()]
    stray = [f for f in used if f != field]
    if stray:
        raise InvalidInput(f"{kind} '{name}': datatype {datatype} takes '{field}', but the message sets {stray}")
    values = getattr(contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise InvalidInput(f"{kind} '{name}': {len(values)} values in '{field}', but shape {list(shape)} needs {count}")
    if datatype == "BYTES":
        array = np.empty(count, dtype=np.object_)
        array[:] = list(values)
        return array.reshape(shape)
    try:
        return np.array(values, dtype=dtype).reshape(shape)
    except OverflowError as error:
        raise InvalidInput(f"{kind} '{name}': a value in '{field}' does not fit {datatype}") from error


def input_arrays(request: oip.ModelInferRequest) -> dict[str, np.ndarray]:
    """Every input of a request as an array; InvalidInput naming the input when one does not decode."""
    return _arrays("input", request.inputs, request.raw_input_contents)


def output_arrays(response: oip.ModelInferResponse) -> dict[str, np.ndarray]:
    """Every output of a response as an array; InvalidInput naming the output when one does not decode."""
    return _arrays("output", response.outputs, response.raw_output_contents)


def _arrays(kind: Kind, tensors: Sequence[Tensor], raw: Sequence[bytes]) -> dict[str, np.ndarray]:
    """Payloads → arrays, one way per message: all raw (Triton's default) or all typed contents. A raw slot
    per tensor, in order, or none: with any other count no slot can be matched to its tensor."""
    if raw and len(raw) != len(tensors):
        raise InvalidInput(
            f"{message_of(kind)} has {len(raw)} raw_{kind}_contents for {len(tensors)} {kind}s; send one per {kind}, "
            f"in {kind} order"
        )
    arrays: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(tensors):
        if raw:
            if tensor.contents.ListFields():
                raise InvalidInput(
                    f"{kind} '{tensor.name}': sets typed contents while the {message_of(kind)} uses "
                    f"raw_{kind}_contents; use one or the other"
                )
            arrays[tensor.name] = from_raw(tensor.name, tensor.datatype, tensor.shape, raw[index], kind=kind)
        else:
            arrays[tensor.name] = from_contents(tensor.name, tensor.datatype, tensor.shape, tensor.contents, kind=kind)
    return arrays


def message_of(kind: Kind) -> str:
    """``input`` → ``request``: the message a tensor of that kind travels in."""
    return "request" if kind == "input" else "response"


def _dtype(name: str, datatype: str) -> np.dtype[Any]:
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is None:
        raise InvalidInput(f"tensor '{name}': unsupported datatype {datatype!r}")
    return dtype


def _bytes_from_raw(tensor: str, shape: Sequence[int], count: int, raw: bytes) -> np.ndarray:
    items: list[bytes] = []
    offset = 0
    view = memoryview(raw)
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInput(f"{tensor}: BYTES raw content ends inside an element length")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput(f"{tensor}: BYTES element {len(items)} runs past the end of the content")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise InvalidInput(f"{tensor}: {len(items)} BYTES elements, but shape {list(shape)} needs {count}")
    array = np.empty(count, dtype=np.object_)
    array[:] = items
    return array.reshape(shape)
