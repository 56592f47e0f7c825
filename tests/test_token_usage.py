"""Tokens in and out of a recorded call (splitstream.common.token_usage): what the recorder writes as the
readable fields ``prompt_tokens`` and ``completion_tokens``, and what it leaves unknown rather than guess."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import REDACTED_OUTPUTS_TAG, entry_fields
from splitstream.common.token_usage import token_counts, ttft_ns


def response(
    request_id: str, text: bytes | None, *, final: bool = False, usage: tuple[int, int] | None = None
) -> bytes:
    """A response as our generating worker sends it: text_output, and the usage outputs on the final one."""
    message = oip.ModelStreamInferResponse()
    answer = message.infer_response
    answer.id = request_id
    answer.parameters["triton_final_response"].bool_param = final
    if text is not None:
        answer.outputs.add(name="text_output", datatype="BYTES", shape=[1, 1])
        answer.raw_output_contents.append(struct.pack("<I", len(text)) + text)
    if usage is not None:
        for name, value in zip(("prompt_tokens", "completion_tokens"), usage, strict=True):
            answer.outputs.add(name=name, datatype="INT32", shape=[1, 1])
            answer.raw_output_contents.append(struct.pack("<i", value))
    return message.SerializeToString()


def stream_record(*responses: bytes) -> recorder_pb2.CallRecord:
    record = recorder_pb2.CallRecord(schema_version=1, request_id="r")
    for index, data in enumerate(responses):
        record.stream.responses.add(index=index, offset_ns=index, payload=recorder_pb2.Payload(inline=data))
    record.stream.responses_total = len(responses)
    record.stream.first_response_ns = 7_000_000
    return record


def test_usage_outputs_are_summed_over_the_requests_of_a_stream() -> None:
    record = stream_record(
        response("a", b"x"),
        response("b", b"y"),
        response("a", b"z", final=True, usage=(4, 2)),
        response("b", b"", final=True, usage=(10, 1)),  # an end token: the final response's text is empty
    )
    assert token_counts(record) == (14, 3)
    fields = entry_fields(record)
    assert (fields["prompt_tokens"], fields["completion_tokens"], fields["ttft_ms"]) == ("14", "3", "7.000")


def test_without_usage_outputs_the_responses_carrying_text_are_counted_and_the_prompt_is_unknown() -> None:
    record = stream_record(response("a", b"x"), response("a", b"y"), response("a", None, final=True))
    assert token_counts(record) == (None, 2)  # the empty final response carries no text
    assert (entry_fields(record)["prompt_tokens"], entry_fields(record)["completion_tokens"]) == ("", "2")


def test_the_records_usage_comes_first_and_an_http_calls_first_token_is_its_ttft() -> None:
    record = stream_record(response("a", b"x", final=True, usage=(4, 1)))
    record.usage.prompt_tokens, record.usage.completion_tokens = 30, 12
    record.http.first_token_ns = 9_000_000
    assert token_counts(record) == (30, 12)
    assert ttft_ns(record) == 9_000_000


def truncated() -> recorder_pb2.CallRecord:
    record = stream_record(response("a", b"x"))
    record.stream.truncated, record.stream.responses_total = True, 40
    return record


def blob() -> recorder_pb2.CallRecord:
    record = stream_record(response("a", b"x", final=True, usage=(4, 1)))
    record.stream.responses[0].payload.blob_sha256 = "ab" * 32
    return record


def redacted() -> recorder_pb2.CallRecord:
    record = stream_record(response("a", b"x", final=True, usage=(0, 0)))
    record.tags[REDACTED_OUTPUTS_TAG] = "completion_tokens,prompt_tokens"
    return record


def unreadable() -> recorder_pb2.CallRecord:
    return stream_record(response("a", b"x"), b"\xff\xff\xff")


@pytest.mark.parametrize("make", [truncated, blob, redacted, unreadable], ids=lambda f: f.__name__)
def test_a_stream_whose_responses_are_not_all_there_to_read_has_its_tokens_unknown(
    make: Callable[[], recorder_pb2.CallRecord],
) -> None:
    assert token_counts(make()) == (None, None)


def test_a_unary_call_has_no_tokens_and_no_ttft() -> None:
    record = recorder_pb2.CallRecord(schema_version=1, request_id="u")
    assert token_counts(record) == (None, None)
    assert ttft_ns(record) == 0
