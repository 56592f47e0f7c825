"""KServe v2 REST tensors ↔ Open Inference Protocol messages, the datatypes no test model has (BYTES, BOOL,
INT8, BF16): what a worker gets for a JSON or binary tensor, and what a client gets back."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.router.http.kserve import KServeError, OutputChoice, infer_answer, parse_infer


def parse(document: dict[str, object], binary: bytes = b"") -> tuple[oip.ModelInferRequest, OutputChoice]:
    head = json.dumps(document).encode()
    return parse_infer("m", "", head + binary, str(len(head)) if binary else None)


def test_json_tensors_reach_the_worker_in_the_raw_layout_nested_or_flat() -> None:
    request, _ = parse(
        {
            "id": "a",
            "parameters": {"priority": 2, "tag": "x"},
            "inputs": [
                {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["hé", ""]},
                {"name": "b", "shape": [1, 3], "datatype": "BOOL", "data": [[True, False, True]]},
                {"name": "i", "shape": [2, 2], "datatype": "INT8", "data": [[-1, 2], [3, 127]]},
            ],
        }
    )
    assert (request.model_name, request.id) == ("m", "a")
    assert request.parameters["priority"].int64_param == 2
    assert request.parameters["tag"].string_param == "x"
    arrays = tensors.input_arrays(request)
    assert arrays["s"].tolist() == ["hé".encode(), b""]
    assert arrays["b"].tolist() == [[True, False, True]]
    assert arrays["i"].dtype == np.int8
    assert arrays["i"].tolist() == [[-1, 2], [3, 127]]


@pytest.mark.parametrize(
    ("tensor", "says"),
    [
        ({"datatype": "INT32", "data": [1.5]}, "not a INT32 value"),
        ({"datatype": "INT32", "data": [True]}, "not a INT32 value"),
        ({"datatype": "BOOL", "data": [1]}, "not a BOOL value"),
        ({"datatype": "INT8", "data": [128]}, "does not fit INT8"),
        ({"datatype": "BYTES", "data": [1]}, "not a BYTES value"),
        ({"datatype": "BF16", "data": [1.0]}, "binary data"),
        ({"datatype": "FP32", "data": 1.0}, "must be an array"),
    ],
)
def test_a_json_element_of_the_wrong_type_is_refused_not_converted(tensor: dict[str, object], says: str) -> None:
    with pytest.raises(KServeError) as caught:
        parse({"inputs": [{"name": "t", "shape": [1], **tensor}]})
    assert caught.value.status == 400
    assert says in caught.value.message


def test_binary_bytes_and_bf16_pass_through_as_sent() -> None:
    strings = struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0)
    bf16 = bytes([0x80, 0x3F, 0x00, 0x40])
    request, _ = parse(
        {
            "inputs": [
                {"name": "s", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": len(strings)}},
                {"name": "h", "shape": [2], "datatype": "BF16", "parameters": {"binary_data_size": 4}},
            ]
        },
        strings + bf16,
    )
    assert list(request.raw_input_contents) == [strings, bf16]
    assert [dict(tensor.parameters) for tensor in request.inputs] == [{}, {}]  # binary_data_size is HTTP's only


def test_binary_bytes_that_do_not_hold_the_shapes_elements_are_refused() -> None:
    strings = struct.pack("<I", 2) + b"ab"
    with pytest.raises(KServeError) as caught:
        parse(
            {"inputs": [{"name": "s", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}]},
            strings,
        )
    assert "1 BYTES elements" in caught.value.message


def test_outputs_come_back_as_json_or_binary_as_asked() -> None:
    response = oip.ModelInferResponse(model_name="m", model_version="v1", id="a")
    for name, array in (("s", np.array([b"x", b"yz"], dtype=np.object_)), ("f", np.ones((1, 2), np.float32))):
        response.outputs.add(name=name, datatype=tensors.datatype_of(array), shape=list(array.shape))
        response.raw_output_contents.append(tensors.to_raw(array))
    body, length = infer_answer(response, OutputChoice(default=False))
    assert length is None
    assert json.loads(body) == {
        "model_name": "m",
        "model_version": "v1",
        "id": "a",
        "outputs": [
            {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["x", "yz"]},
            {"name": "f", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 1.0]},
        ],
    }
    body, length = infer_answer(response, OutputChoice(default=True, per_output={"f": False}))
    assert length is not None
    outputs = json.loads(body[:length])["outputs"]
    assert outputs[0]["parameters"] == {"binary_data_size": 11}
    assert body[length:] == struct.pack("<I", 1) + b"x" + struct.pack("<I", 2) + b"yz"
    assert outputs[1]["data"] == [1.0, 1.0]
