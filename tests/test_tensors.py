"""One decoder for every tensor of every message: a request's inputs (the worker validates with it) and a
response's outputs (the replayer compares with it) are read by the same code, refuse the same malformed
payloads, and name the tensor (and its side) that does not fit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from splitstream.common.errors import InvalidInput
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.tensors import datatype_of, input_arrays, output_arrays, to_raw
from tests.tensors import add_raw_input, add_typed_input

NUMERIC = st.sampled_from(["<f4", "<f8", "<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8", "?"])


def response_of(arrays: dict[str, np.ndarray]) -> oip.ModelInferResponse:
    """A response carrying ``arrays`` as raw outputs, the way a worker answers."""
    response = oip.ModelInferResponse(model_name="m")
    for name, array in arrays.items():
        response.outputs.add(name=name, datatype=datatype_of(array), shape=list(array.shape))
        response.raw_output_contents.append(to_raw(array))
    return response


@given(array=hnp.arrays(NUMERIC, hnp.array_shapes(min_dims=1, max_dims=3, max_side=4)), typed=st.booleans())
def test_any_numeric_array_comes_back_equal_as_an_input_raw_or_typed_and_as_an_output(
    array: np.ndarray, typed: bool
) -> None:
    request = oip.ModelInferRequest(model_name="m")
    (add_typed_input if typed else add_raw_input)(request, "x", array)
    np.testing.assert_array_equal(input_arrays(request)["x"], array)
    np.testing.assert_array_equal(output_arrays(response_of({"y": array}))["y"], array)


def test_bytes_tensors_round_trip_with_empty_and_binary_elements() -> None:
    array = np.array([[b"", b"\x00\xff"], [b"text", b"\x01"]], dtype=object)
    request = oip.ModelInferRequest(model_name="m")
    add_raw_input(request, "s", array)
    assert input_arrays(request)["s"].tolist() == array.tolist()
    assert output_arrays(response_of({"s": array}))["s"].tolist() == array.tolist()


def test_a_raw_slot_count_that_does_not_match_the_tensors_is_refused_on_both_sides() -> None:
    request = oip.ModelInferRequest(model_name="m")
    add_raw_input(request, "x", np.zeros(2, np.float32))
    request.raw_input_contents.append(b"extra")
    with pytest.raises(InvalidInput, match="request has 2 raw_input_contents for 1 inputs"):
        input_arrays(request)
    response = response_of({"y": np.zeros(2, np.float32)})
    response.raw_output_contents.append(b"extra")
    with pytest.raises(InvalidInput, match="response has 2 raw_output_contents for 1 outputs"):
        output_arrays(response)


def test_typed_contents_beside_raw_contents_are_refused_naming_the_tensor_and_its_side() -> None:
    request = oip.ModelInferRequest(model_name="m")
    add_raw_input(request, "x", np.zeros(2, np.float32))
    request.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidInput, match="input 'x': sets typed contents while the request uses raw_input_contents"):
        input_arrays(request)
    response = response_of({"y": np.zeros(2, np.float32)})
    response.outputs[0].contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidInput, match="output 'y': sets typed contents while the response uses raw_output"):
        output_arrays(response)


@pytest.mark.parametrize(
    ("raw", "datatype", "shape", "message"),
    [
        (b"\x00" * 7, "FP32", [2], "output 'y': raw content is 7 bytes, but FP32 with shape [2] needs 8 bytes"),
        (b"\x05\x00\x00\x00ab", "BYTES", [1], "output 'y': BYTES element 0 runs past the end of the content"),
        (b"\x01\x00", "BYTES", [1], "output 'y': BYTES raw content ends inside an element length"),
        (b"\x00\x00\x00\x00", "BYTES", [2], "output 'y': 1 BYTES elements, but shape [2] needs 2"),
        (b"\x00" * 4, "BF17", [1], "tensor 'y': unsupported datatype 'BF17'"),
    ],
)
def test_a_raw_output_that_does_not_fit_its_header_names_the_output_and_the_problem(
    raw: bytes, datatype: str, shape: list[int], message: str
) -> None:
    response = oip.ModelInferResponse(model_name="m")
    response.outputs.add(name="y", datatype=datatype, shape=shape)
    response.raw_output_contents.append(raw)
    with pytest.raises(InvalidInput) as caught:
        output_arrays(response)
    assert str(caught.value) == message
