"""Hypothesis strategies for fuzzing a real service with ModelInfer bytes and metadata.

Shared by the router's and the worker's fuzz tests: what a careless or hostile client
can put on the wire. Byte-level strategies start from a valid request of the served
model (so most calls get past the first checks) and damage it; the structured one
builds requests that parse but say odd things about their tensors.
"""

from __future__ import annotations

import math
import string
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
from hypothesis import strategies as st

from splitstream.common.headers import DEFAULT_ROUTING_KEY_HEADER, REQUEST_ID_HEADER, VERSION_HEADER
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.tensors import CONTENTS_FIELDS, NUMPY_DTYPES
from tests.harness import make_request

INT64 = (-(2**63), 2**63 - 1)
T = TypeVar("T")
#: The fuzzed call's deadline; the services answer a valid call in milliseconds, so only a hang reaches it.
DEADLINE_S = 10.0
#: No client input is a server fault: UNKNOWN is an exception grpc caught, INTERNAL one we caught,
#: DEADLINE_EXCEEDED a call left unanswered.
FAULTS = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)


def call(method: grpc.UnaryUnaryMultiCallable, request: bytes, headers: Sequence[tuple[str, str | bytes]] = ()) -> None:
    """One call, asserted to end within its deadline with a status other than a server fault: the one
    promise the router and the worker both make whatever a client sends."""
    started = time.monotonic()
    try:
        method(request, metadata=headers, timeout=DEADLINE_S)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details()
    assert code not in FAULTS, (code, details)
    assert time.monotonic() - started < DEADLINE_S


def valid_request(model: str, version: str, request_id: str, rows: int) -> bytes:
    """A well-formed call of the affine test model (input ``x``, FP32 ``[rows, 4]``)."""
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    return bytes(make_request(model, x, version=version, request_id=request_id).SerializeToString())


def valid_requests(model: str) -> st.SearchStrategy[bytes]:
    """Mostly ``model`` and a servable version, so most calls get past routing and naming checks."""
    return st.builds(
        valid_request,
        model=st.just(model) | st.just(model) | st.just(model) | st.sampled_from(["", "other"]) | st.text(max_size=12),
        version=st.just("") | st.just("v1") | st.just("v2") | st.text(max_size=8),
        request_id=st.text(max_size=16),
        rows=st.integers(min_value=1, max_value=3),
    )


@st.composite
def _mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        position = draw(st.integers(min_value=0, max_value=len(data) - 1))
        data[position] = draw(st.integers(min_value=0, max_value=255))
    return bytes(data)


def mutated(model: str) -> st.SearchStrategy[bytes]:
    """A valid request of ``model`` with one to eight bytes overwritten."""
    return _mutated(valid_requests(model))


def request_bytes(model: str) -> st.SearchStrategy[bytes]:
    """Valid, mutated, truncated, extended and random bytes."""
    valid = valid_requests(model)
    return st.one_of(
        valid,
        mutated(model),
        st.tuples(valid, st.integers(min_value=0, max_value=200)).map(lambda pair: pair[0][: pair[1]]),
        st.tuples(valid, st.binary(min_size=1, max_size=64)).map(lambda pair: pair[0] + pair[1]),
        st.binary(max_size=256),
    )


#: The headers services read: each present in about half the calls, since a list of random keys
#: rarely holds one (150 examples of such lists carried ``x-request-id`` first 10 times).
READ_HEADERS = (REQUEST_ID_HEADER, VERSION_HEADER, DEFAULT_ROUTING_KEY_HEADER, "authorization")
#: What a gRPC client lets through: lowercase keys of [a-z0-9-_.], printable-ASCII values.
header_keys = st.sampled_from(["x-tenant", *READ_HEADERS]) | st.text(
    alphabet=string.ascii_lowercase + string.digits + "-_.", min_size=1, max_size=12
).filter(lambda key: not key.startswith("grpc-") and not key.endswith("-bin"))
#: Printable ASCII, and pieces of percent-escapes, since services decode the ones in ids: escapes of
#: UTF-8 and of what is not UTF-8 (a lone byte, a cut sequence, an encoded surrogate), and malformed ones.
PERCENT_PIECES = ["%", "%2", "%25", "%41", "%C3%BC", "%c3", "%ff", "%80", "%ed%a0%80", "%zz", "a", " "]
header_values = (
    st.text(alphabet=[chr(code) for code in range(0x20, 0x7F)], max_size=24)
    | st.lists(st.sampled_from(PERCENT_PIECES), min_size=1, max_size=4).map("".join)
).map(str.strip)
metadata = st.builds(
    lambda read, other: [*read.items(), *other],
    st.fixed_dictionaries({}, optional=dict.fromkeys(READ_HEADERS, header_values)),
    st.lists(
        st.tuples(header_keys, header_values) | st.tuples(st.just("trace-bin"), st.binary(max_size=16)), max_size=4
    ),
)

#: Every datatype the protocol names, plus names it does not.
DATATYPES = [*NUMPY_DTYPES, "BF16", "", "fp32", "FLOAT", "STRING"]
#: Small dimensions mostly (they pass shape checks), the int64 extremes sometimes.
dims = st.integers(min_value=-2, max_value=9) | st.sampled_from([*INT64, 2**31, 2**32 + 4]) | st.integers(*INT64)
shapes = st.lists(dims, max_size=4)


@st.composite
def _typed_contents(draw: st.DrawFn, tensor: oip.ModelInferRequest.InferInputTensor) -> None:
    """Values in one typed-contents field, often the datatype's own with the count its shape needs."""
    own = CONTENTS_FIELDS.get(tensor.datatype, "fp32_contents")
    field = _mostly(draw, own, st.sampled_from(sorted(set(CONTENTS_FIELDS.values()))))
    exact = min(_elements(tensor.shape), 64)
    count = _mostly(draw, exact, st.integers(min_value=0, max_value=12))
    values: st.SearchStrategy[object]
    if field == "bool_contents":
        values = st.booleans()
    elif field == "bytes_contents":
        values = st.binary(max_size=8)
    elif field in ("fp32_contents", "fp64_contents"):
        values = st.floats(width=32 if field == "fp32_contents" else 64)
    elif field == "int_contents":
        values = st.integers(min_value=-(2**31), max_value=2**31 - 1)
    elif field == "uint_contents":
        values = st.integers(min_value=0, max_value=2**32 - 1)
    elif field == "int64_contents":
        values = st.integers(*INT64)
    else:
        values = st.integers(min_value=0, max_value=2**64 - 1)
    getattr(tensor.contents, field).extend(draw(st.lists(values, min_size=count, max_size=count)))


@st.composite
def _structured_request(
    draw: st.DrawFn,
    model: str,
    version: str,
    input_names: tuple[str, ...],
    input_shape: tuple[int, ...],
    output_names: tuple[str, ...],
) -> bytes:
    request = oip.ModelInferRequest(
        model_name=_mostly(draw, model, st.sampled_from(["", "other"])),
        model_version=_mostly(draw, version, st.sampled_from(["", "v0", "ü"])),
        id=draw(st.text(max_size=16)),
    )
    raw = draw(st.booleans())
    for _ in range(_mostly(draw, len(input_names), st.integers(min_value=0, max_value=3))):
        tensor = request.inputs.add(
            name=_mostly(draw, input_names[0], st.sampled_from([*input_names, "", "nope"])),
            datatype=_mostly(draw, "FP32", st.sampled_from(DATATYPES)),
            # Mostly the model's shape (a small size for each -1), so some get past shape checks.
            shape=draw(_mostly(draw, _sizes(input_shape), st.just(shapes))),
        )
        if raw:
            # Often the exact size the header asks for, so the bytes get past the length check.
            count = max(1, min(_elements(tensor.shape), 64))
            exact = _mostly(draw, True, st.just(False))
            request.raw_input_contents.append(
                draw(st.binary(min_size=count * 4, max_size=count * 4) if exact else st.binary(max_size=64))
            )
        elif _mostly(draw, True, st.just(False)):
            draw(_typed_contents(tensor))
    if raw and _mostly(draw, False, st.just(True)):
        request.raw_input_contents.append(draw(st.binary(max_size=16)))  # a slot without a tensor
    for _ in range(_mostly(draw, 0, st.integers(min_value=1, max_value=3))):
        request.outputs.add(name=_mostly(draw, output_names[0], st.sampled_from([*output_names, "", "nope"])))
    if draw(st.booleans()):
        request.parameters[draw(st.text(max_size=8))].string_param = draw(st.text(max_size=8))
    return bytes(request.SerializeToString())


def structured_requests(
    model: str,
    version: str,
    *,
    input_names: tuple[str, ...],
    input_shape: tuple[int, ...],
    output_names: tuple[str, ...],
) -> st.SearchStrategy[bytes]:
    """Requests that parse but say odd things: datatypes, shapes, contents and outputs of any kind.
    Mostly addressed to ``model`` ``version`` with its tensors' names and shape (``-1``: any size),
    so most reach the tensor checks and some the model."""
    return _structured_request(model, version, input_names, input_shape, output_names)


def _mostly(draw: st.DrawFn, usual: T, odd: st.SearchStrategy[T]) -> T:
    """``usual`` seven times in eight, else a draw of ``odd``, so a request has few odd parts and most reach
    the model. Three fair booleans, not ``sampled_from`` or ``a | b``: hypothesis draws those far from
    evenly (measured: with ``sampled_from([model] * 4 + ["", "other"])`` 61 of 120 named another model)."""
    odd_one = draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans())
    return draw(odd) if odd_one else usual


def _sizes(shape: tuple[int, ...]) -> st.SearchStrategy[list[int]]:
    """``shape`` with each ``-1`` a size from 0 to 10 (past the test model's max_batch_size of 8)."""
    return st.tuples(*(st.integers(min_value=0, max_value=10) if dim == -1 else st.just(dim) for dim in shape)).map(
        list
    )


def _elements(shape: Sequence[int]) -> int:
    """What ``shape`` holds, negative dimensions counted as 0 (Python ints: int64 extremes do not overflow)."""
    return math.prod(max(dim, 0) for dim in shape)


def all_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a nested document (mappings and lists), for tests that try values in every field."""
    paths = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            paths += all_paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            paths += all_paths(child, (*prefix, index))
    return paths
