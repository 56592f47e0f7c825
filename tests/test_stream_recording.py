"""Token streams recorded: real router, stand-ins for Triton's decoupled models, recorder and redis-server.

A stream is one record: its requests and responses with index and offset from the stream's start,
TTFT, the final status; capped per stream (truncated, every response still counted); recorded as
cancelled when the client leaves; spooled like unary calls while the recorder is away."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator

import grpc
import pytest
from redis.asyncio import Redis

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import REDACTED_OUTPUTS_TAG, routing_key_hmac
from splitstream.recorder.validation import check_stream
from tests.harness import ServiceProcess, Stack
from tests.recording_stack import HMAC_KEY, MODEL, RecordingStack
from tests.records import RecordedStream, stream_of
from tests.stream_client import OpenStream, is_final, run_stream
from tests.triton_decoupled import start_standin, stream_request

STREAM_CAP = 2000
BLOB_THRESHOLD = 100  # a token's response (~150 bytes) is over it: stored by reference


def standin(stack: Stack, version: str) -> ServiceProcess:
    return start_standin(stack, MODEL, version, "--delay-ms", "10")


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingStack]:
    stack = RecordingStack(
        tmp_path_factory.mktemp("stream-recording"),
        recorder_args=(
            "--blob-threshold-bytes",
            str(BLOB_THRESHOLD),
            "--redact-output",
            "cum_log_probs:mask",
            "--redact-input",
            "text_input:mask",
        ),
        router_args=("--record-stream-max-bytes", str(STREAM_CAP)),
        worker=standin,
    )
    yield stack
    stack.close()


def read_stream(recording: RecordingStack, record: recorder_pb2.CallRecord) -> RecordedStream:
    async def read() -> RecordedStream:
        client = Redis.from_url(recording.redis.url)
        try:
            return await stream_of(client, record)
        finally:
            await client.aclose()

    return asyncio.run(read())


@pytest.mark.slow
def test_a_stream_is_one_record_with_every_message_in_order_its_offsets_and_ttft(recording: RecordingStack) -> None:
    prompt = b"secret prompt " * 50
    first = stream_request("rec-1", 3, model=MODEL, text=prompt)
    second = stream_request("rec-1b", 2, model=MODEL)
    result = run_stream(recording.router.address, [first, second], metadata=[("x-routing-key", "user-rec")])
    assert result.code == grpc.StatusCode.OK, result.details
    (record,) = [r for r in recording.wait_recorded({"rec-1"}) if r.request_id == "rec-1"]
    assert (record.status_code, record.version, record.response.size_bytes) == (0, "v1", 0)
    assert record.routing_key_hmac == routing_key_hmac(HMAC_KEY.encode(), "user-rec")
    stream = record.stream
    assert (stream.responses_total, stream.truncated) == (5, False)
    assert [m.index for m in stream.requests] == [0, 1]
    assert [m.index for m in stream.responses] == [0, 1, 2, 3, 4]
    offsets = [m.offset_ns for m in stream.responses]
    assert offsets == sorted(offsets)
    assert stream.requests[0].offset_ns == 0
    assert stream.first_response_ns == offsets[0] > 0
    assert record.latency_ns >= offsets[-1]  # the duration covers every response
    assert {m.payload.WhichOneof("body") for m in stream.responses} == {"blob_sha256"}
    recorded = read_stream(recording, record)
    # Input redaction applies to every request: the prompt is kept masked (zeroed, same length), the rest as sent.
    masked = oip.ModelInferRequest.FromString(first)
    masked.raw_input_contents[0] = b"\x00" * 4  # one BYTES element, zeroed: an empty string
    assert [r.SerializeToString() for _, _, r in recorded.requests] == [masked.SerializeToString(), second]
    assert prompt not in recording.redis_bytes()
    client_got = result.decoded()
    assert [r.infer_response.id for _, _, r in recorded.responses] == [r.infer_response.id for r in client_got]
    assert [is_final(r) for _, _, r in recorded.responses] == [is_final(r) for r in client_got]
    # Output redaction applies to every response: cum_log_probs zeroed, text kept, the output named.
    for (_, _, kept), sent in zip(recorded.responses, client_got, strict=True):
        assert kept.infer_response.raw_output_contents[0] == sent.infer_response.raw_output_contents[0]
        assert kept.infer_response.raw_output_contents[1] == struct.pack("<f", 0.0)
        assert sent.infer_response.raw_output_contents[1] != struct.pack("<f", 0.0)
    assert record.tags[REDACTED_OUTPUTS_TAG] == "cum_log_probs"


def test_a_stream_over_the_cap_is_recorded_truncated_with_every_response_counted(recording: RecordingStack) -> None:
    result = run_stream(recording.router.address, [stream_request("rec-long", 60, model=MODEL)])
    assert result.code == grpc.StatusCode.OK, result.details
    assert len(result.responses) == 60
    (record,) = [r for r in recording.wait_recorded({"rec-long"}) if r.request_id == "rec-long"]
    stream = record.stream
    assert stream.truncated
    assert stream.responses_total == 60
    kept = [m.index for m in stream.responses]
    assert 0 < len(kept) < 60
    assert kept == list(range(len(kept)))  # a prefix of the stream
    assert sum(m.payload.size_bytes for m in [*stream.requests, *stream.responses]) <= STREAM_CAP


def test_a_stream_the_client_cancels_is_recorded_as_cancelled_with_what_was_sent(recording: RecordingStack) -> None:
    stream = OpenStream(recording.router.address)
    try:
        stream.send(stream_request("rec-cancel", 1000, model=MODEL))
        got = [stream.next() for _ in range(3)]
        stream.cancel()
        stream.finish()
    finally:
        stream.close()
    (record,) = [r for r in recording.wait_recorded({"rec-cancel"}) if r.request_id == "rec-cancel"]
    assert record.status_code == grpc.StatusCode.CANCELLED.value[0]
    assert 3 <= record.stream.responses_total < 1000
    kept = read_stream(recording, record).responses[:3]
    assert [r.infer_response.id for _, _, r in kept] == ["rec-cancel"] * 3
    assert len(got) == 3


@pytest.mark.slow
def test_streams_are_spooled_while_the_recorder_is_down_and_arrive_once_it_is_back(recording: RecordingStack) -> None:
    recording.recorder.stop()
    try:
        for i in range(3):
            result = run_stream(recording.router.address, [stream_request(f"rec-spool-{i}", 2, model=MODEL)])
            assert result.code == grpc.StatusCode.OK, result.details
    finally:
        recording.restart_recorder()
    ids = {f"rec-spool-{i}" for i in range(3)}
    records = [r for r in recording.wait_recorded(ids) if r.request_id in ids]
    assert sorted(r.stream.responses_total for r in records) == [2, 2, 2]


# -- what the recorder accepts ----------------------------------------------------------------------


def stream_record(**changes: object) -> recorder_pb2.CallRecord:
    record = recorder_pb2.CallRecord(request_id="r", model="m", receive_unix_ns=1, schema_version=1)
    stream = record.stream
    stream.requests.add(index=0, offset_ns=0).payload.inline = b"q"
    for index, offset in enumerate((10, 20, 30)):
        stream.responses.add(index=index, offset_ns=offset).payload.inline = b"a"
    stream.first_response_ns = 10
    stream.responses_total = 3
    for name, value in changes.items():
        setattr(stream, name, value)
    return record


@pytest.mark.parametrize(
    ("spoil", "named"),
    [
        (lambda r: setattr(r.stream.responses[1], "index", 0), "stream.responses[1].index"),
        (lambda r: setattr(r.stream.responses[2], "offset_ns", 5), "stream.responses[2].offset_ns"),
        (lambda r: setattr(r.stream, "responses_total", 2), "responses_total"),
        (lambda r: setattr(r.stream, "first_response_ns", 11), "first_response_ns"),
        (lambda r: setattr(r.response, "inline", b"x"), "response must be empty"),
        (lambda r: setattr(r.stream.requests[0].payload, "blob_sha256", "ab"), "stream.requests[0].payload"),
    ],
)
def test_the_recorder_rejects_a_stream_record_that_does_not_add_up_naming_the_field(spoil: object, named: str) -> None:
    record = stream_record()
    check_stream(record)  # the unspoiled record is accepted
    assert callable(spoil)
    spoil(record)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_stream(record)


def test_a_truncated_stream_record_with_a_kept_prefix_is_accepted() -> None:
    record = stream_record(responses_total=50, truncated=True)
    check_stream(record)
