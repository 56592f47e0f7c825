"""HTTP calls recorded, and feedback over HTTP: a router with --http-port and --recorder in front of two
generating workers (demo/language.py's v1 and v2 at 50/50), its child shipper, a recorder and redis-server.

Each call to the OpenAI-compatible front door is one record in Redis: the routing fields as for gRPC, the
HTTP exchange (body as received; body or each SSE event as sent, with offsets), the usage the client got,
the worker stream it was translated to; never the Authorization header or the body's ``user``. A client that
goes away mid-stream is recorded as 499 with what it was sent. ``POST /v1/feedback`` lands an outcome event
in the feedback stream under the call's request id, as ``Feedback/Report`` does."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from demo import language
from splitstream.common.archive import ArchiveQuery, open_archive, read_calls, stored_records
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import feedback_key, routing_key_hmac, stream_key
from splitstream.router.http.recording import HttpExchange
from tests.harness import ServiceProcess, Stack, free_port, metric_samples, scrape_metrics, wait_for
from tests.recording_stack import HMAC_KEY, RecordingStack
from tests.test_archive import archived_everything, local_archive, running_archiver

MODEL = "writer"
SECRET = "sk-http-recording-5ecret-token"
USER = "user-http-rec-alice"
#: Payloads over this are stored once as blobs (a long prompt's body): the archive inlines them back.
BLOB_THRESHOLD = 1024
#: --record-stream-max-bytes: a short answer's events fit, a long one's are cut.
STREAM_CAP = 4000
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The "},
]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RecordingStack, int]]:
    tmp = tmp_path_factory.mktemp("http-recording")
    models = tmp / "models"
    language.write_versions(models, MODEL, generation={"max_tokens_limit": 1_000_000})

    def worker(stack: Stack, version: str) -> ServiceProcess:
        return stack.worker(models, MODEL, version)

    http_port = free_port()
    stack = RecordingStack(
        tmp,
        model=MODEL,
        versions={"v1": {}, "v2": {}},
        experiment={
            "salt": "http-recording",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        },
        worker=worker,
        router_args=("--http-port", str(http_port), "--record-stream-max-bytes", str(STREAM_CAP)),
        recorder_args=("--blob-threshold-bytes", str(BLOB_THRESHOLD), "--redact-metadata", "x-user-email:mask"),
    )
    try:
        wait_for(lambda: accepts(http_port), timeout_s=30, what="the HTTP port to accept")
        yield stack, http_port
    finally:
        stack.close()


def accepts(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/v1/models")
        return connection.getresponse().status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def client(recording: tuple[RecordingStack, int]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{recording[1]}/v1", api_key=SECRET, max_retries=0, timeout=30)


def recorded(stack: RecordingStack, request_id: str) -> recorder_pb2.CallRecord:
    (record,) = [r for r in stack.wait_recorded({request_id}) if r.request_id == request_id]
    return record


def post(port: int, path: str, body: bytes) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", path, body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


@pytest.mark.slow
def test_a_chat_is_one_record_with_its_http_exchange_routing_fields_and_usage(
    recording: tuple[RecordingStack, int], client: openai.OpenAI
) -> None:
    stack, _ = recording
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=12, user=USER, extra_headers={"x-user-email": "alice@example.com"}
    )
    completion = raw.parse()
    request_id = raw.headers["x-request-id"]
    record = recorded(stack, request_id)
    assert (record.model, record.version, record.status_code) == (MODEL, raw.headers["x-splitstream-version"], 0)
    assert record.arm == record.version
    assert record.routing_key_hmac == routing_key_hmac(HMAC_KEY.encode(), USER)
    assert recorder_pb2.Assignment.Name(record.assignment) == "ASSIGNMENT_HASH"
    assert dict(record.phase.weights) == {"v1": 50.0, "v2": 50.0}
    assert record.endpoint == stack.workers[record.version].address
    assert record.latency_ns > 0
    http_call = record.http
    assert (http_call.method, http_call.path, http_call.status, http_call.api) == (
        "POST",
        "/v1/chat/completions",
        200,
        "chat",
    )
    sent = json.loads(http_call.request_body.inline)
    assert sent["messages"] == CHAT
    assert sent["user"] == "hmac:" + record.routing_key_hmac  # a routing key: stored as its HMAC only
    assert http_call.request_content_type == "application/json"
    answered = json.loads(http_call.response_body.inline)
    assert answered == json.loads(raw.content)
    assert answered["id"] == completion.id == "chatcmpl-" + request_id
    assert http_call.response_content_type == "application/json"
    assert (list(http_call.events), http_call.events_total, http_call.first_token_ns) == ([], 0, 0)
    assert completion.usage is not None
    assert (record.usage.prompt_tokens, record.usage.completion_tokens) == (
        completion.usage.prompt_tokens,
        completion.usage.completion_tokens,
    )
    # The translated worker stream, as a gRPC token stream's record holds it.
    assert record.stream.responses_total == 12
    assert record.request.size_bytes > 0
    # The client's headers, less credentials.
    assert record.metadata["user-agent"].startswith("OpenAI/Python")
    assert "authorization" not in record.metadata
    assert record.metadata["x-user-email"].startswith("hmac:")  # the recorder's metadata rules, as for gRPC
    everything = stack.redis_bytes()
    assert SECRET.encode() not in everything
    assert USER.encode() not in everything


def test_a_streamed_chat_is_recorded_event_by_event_with_offsets_ttft_and_the_usage_sent(
    recording: tuple[RecordingStack, int], client: openai.OpenAI
) -> None:
    stack, _ = recording
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-splitstream-version": "v2", "x-request-id": "http-streamed-1"},
    )
    chunks = list(raw.parse())
    record = recorded(stack, "http-streamed-1")
    assert (record.version, record.pinned, record.status_code) == ("v2", True, 0)
    http_call = record.http
    assert (http_call.status, http_call.api, http_call.response_content_type) == (200, "chat", "text/event-stream")
    assert not http_call.HasField("response_body")
    events = list(http_call.events)
    assert [e.index for e in events] == list(range(len(events)))
    assert http_call.events_total == len(events) == len(chunks) + 1  # the chunks, then [DONE]
    assert not http_call.truncated
    offsets = [e.offset_ns for e in events]
    assert offsets == sorted(offsets)
    assert offsets[0] > 0
    assert events[-1].payload.inline == b"[DONE]"
    sent = [json.loads(e.payload.inline) for e in events[:-1]]
    assert [e["id"] for e in sent] == [c.id for c in chunks]
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert [e["choices"][0]["delta"].get("content", "") for e in sent if e["choices"]] == texts
    # TTFT: the first event carrying text (the first is the role alone).
    assert 0 < http_call.first_token_ns == events[1].offset_ns
    usage = chunks[-1].usage
    assert usage is not None
    assert (record.usage.prompt_tokens, record.usage.completion_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )


def test_tritons_generate_and_generate_stream_are_recorded_with_their_events_ttft_and_usage(
    recording: tuple[RecordingStack, int],
) -> None:
    """Triton's generate extension on the same port is recorded as the OpenAI routes are: the body as received,
    the answer (one JSON object, or each SSE event with its offset), TTFT and the tokens the last answer gave."""
    stack, port = recording
    body = json.dumps({"text_input": "The ", "max_tokens": 6}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", f"/v2/models/{MODEL}/generate", body, {"x-request-id": "kserve-generate-1"})
    response = connection.getresponse()
    whole = json.loads(response.read())
    assert response.status == 200
    record = recorded(stack, "kserve-generate-1")
    assert (record.http.status, record.http.api, record.http.path) == (200, "generate", f"/v2/models/{MODEL}/generate")
    assert record.http.request_body.inline == body
    assert json.loads(record.http.response_body.inline) == whole
    assert (record.usage.prompt_tokens, record.usage.completion_tokens) == (
        whole["prompt_tokens"],
        whole["completion_tokens"],
    )

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", f"/v2/models/{MODEL}/generate_stream", body, {"x-request-id": "kserve-generate-2"})
    response = connection.getresponse()
    sent = [line[6:] for line in response.read().split(b"\n") if line.startswith(b"data: ")]
    assert response.status == 200
    assert len(sent) == 6
    record = recorded(stack, "kserve-generate-2")
    assert (record.http.status, record.http.api, record.http.events_total) == (200, "generate-stream", 6)
    assert [e.payload.inline for e in record.http.events] == sent
    assert 0 < record.http.first_token_ns == record.http.events[0].offset_ns
    last = json.loads(sent[-1])
    assert (record.usage.prompt_tokens, record.usage.completion_tokens) == (
        last["prompt_tokens"],
        last["completion_tokens"],
    )
    assert record.stream.responses_total == 6  # the translated worker stream, as for the OpenAI routes


def test_a_client_that_goes_away_mid_stream_is_recorded_as_499_with_the_events_it_was_sent(
    recording: tuple[RecordingStack, int],
) -> None:
    stack, port = recording
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"model": MODEL, "prompt": "The ", "max_tokens": 1_000_000, "stream": True}
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps(body),
        {"Content-Type": "application/json", "x-request-id": "http-gone-1", "Authorization": f"Bearer {SECRET}"},
    )
    response = connection.getresponse()
    assert response.status == 200
    got = []
    for line in response:
        if line.startswith(b"data: "):
            got.append(line[6:].strip())
        if len(got) == 5:
            break
    response.close()
    connection.close()
    record = recorded(stack, "http-gone-1")
    assert record.http.status == 499
    assert record.status_code == 1  # CANCELLED
    assert record.http.api == "completion"
    kept = [e.payload.inline for e in record.http.events]
    assert kept[:5] == got  # what the client read, in order; perhaps a few more were written before it left
    assert b"[DONE]" not in kept
    assert record.http.events_total >= len(kept)
    assert "authorization" not in record.metadata
    assert record.usage.ByteSize() == 0  # the generation never reported its usage


@pytest.mark.slow
def test_an_http_record_read_back_from_the_archive_has_its_exchange_and_usage_with_blobs_inlined(
    recording: tuple[RecordingStack, int], client: openai.OpenAI, tmp_path: Path
) -> None:
    stack, _ = recording
    since = time.time_ns()
    prompt = "The " * 400  # over the blob threshold: the request body is stored by reference
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=5, extra_headers={"x-request-id": "http-archived-1"}
    )
    in_redis = recorded(stack, "http-archived-1")
    assert in_redis.http.request_body.WhichOneof("body") == "blob_sha256"
    with running_archiver(tmp_path, stack.redis.url):
        redis: Any = stack.redis.client()
        try:
            wait_for(
                lambda: archived_everything(redis, stream_key(MODEL)), timeout_s=60, what="the archive to catch up"
            )
        finally:
            redis.close()
    archive = open_archive(local_archive(tmp_path))
    table = read_calls(archive, ArchiveQuery(model=MODEL, since_ns=since, until_ns=time.time_ns()))
    (archived,) = [s.record for s in stored_records(table) if s.record.request_id == "http-archived-1"]
    http_call = archived.http
    assert (http_call.method, http_call.path, http_call.status, http_call.api) == (
        "POST",
        "/v1/chat/completions",
        200,
        "chat",
    )
    assert http_call.request_body.WhichOneof("body") == "inline"  # the blob, inlined: the file stands alone
    assert json.loads(http_call.request_body.inline)["messages"] == messages
    assert json.loads(http_call.response_body.inline) == json.loads(raw.content)
    assert (
        (archived.usage.prompt_tokens, archived.usage.completion_tokens)
        == (
            in_redis.usage.prompt_tokens,
            in_redis.usage.completion_tokens,
        )
        != (0, 0)
    )


def test_a_stream_over_the_cap_keeps_a_prefix_of_its_events_and_counts_them_all(
    recording: tuple[RecordingStack, int],
) -> None:
    stack, port = recording
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"model": MODEL, "prompt": "The ", "max_tokens": 80, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"x-request-id": "http-long-1"})
    sent = [line for line in connection.getresponse().read().split(b"\n") if line.startswith(b"data: ")]
    connection.close()
    record = recorded(stack, "http-long-1")
    events = record.http.events
    assert record.http.truncated
    assert record.http.events_total == len(sent)  # every event counted
    assert 0 < len(events) < len(sent)
    assert [e.payload.inline for e in events] == [line[6:] for line in sent[: len(events)]]  # a prefix, in order
    assert sum(e.payload.size_bytes for e in events) <= STREAM_CAP


def feedback_entries(stack: RecordingStack, metric: str) -> list[dict[str, str]]:
    redis: Any = stack.redis.client()
    try:
        raw = redis.xrange(feedback_key(MODEL))
    finally:
        redis.close()
    decoded = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw]
    return [entry for entry in decoded if entry["metric"] == metric]


def test_feedback_posted_for_a_chats_response_id_lands_in_the_feedback_stream_joined_to_the_call(
    recording: tuple[RecordingStack, int], client: openai.OpenAI
) -> None:
    stack, port = recording
    completion = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, user=USER)
    request_id = completion.id.removeprefix("chatcmpl-")
    record = recorded(stack, request_id)
    body = {"id": completion.id, "metric": "thumbs_up", "value": 1, "idempotency_key": "vote-1"}
    status, ack = post(port, "/v1/feedback", json.dumps(body).encode())
    assert status == 200, ack
    assert ack == {
        "object": "feedback",
        "accepted": True,
        "request_id": request_id,
        "model": MODEL,
        "metric": "thumbs_up",
    }
    # Sent twice with its idempotency key: written once. A request id works as well as the response id.
    assert post(port, "/v1/feedback", json.dumps(body).encode())[0] == 200
    at = "2026-01-02T03:04:05Z"
    later = {"id": request_id, "metric": "rating", "value": 4.5, "timestamp": at, "user": USER}
    assert post(port, "/v1/feedback", json.dumps(later).encode())[0] == 200

    (vote,) = wait_for(
        lambda: feedback_entries(stack, "thumbs_up") or None, timeout_s=30, what="the thumbs-up to be recorded"
    )
    (rating,) = wait_for(lambda: feedback_entries(stack, "rating") or None, timeout_s=30, what="the rating")
    assert vote["request_id"] == record.request_id
    assert (float(vote["value"]), vote["idempotency_key"]) == (1.0, "vote-1")
    assert rating["request_id"] == record.request_id
    assert rating["unit"] == record.routing_key_hmac
    assert int(rating["event_ns"]) == 1767323045 * 10**9
    assert len(feedback_entries(stack, "thumbs_up")) == 1  # the duplicate, logged before the rating, was not written
    accepted = metric_samples(scrape_metrics(stack.router.metrics_port), "splitstream_router_feedback_accepted_total")
    assert sum(value for _, value in accepted) >= 3  # counted as Feedback/Report's events are
    assert USER.encode() not in stack.redis_bytes()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b'{"id": "chatcmpl-x", "value": 1}', "metric"),
        (b'{"id": "chatcmpl-x", "metric": "click"}', "value"),
        (b'{"id": "chatcmpl-x", "metric": "click", "value": "1"}', "value"),
        (b'{"id": "chatcmpl-x", "metric": "click", "value": true}', "value"),
        (b'{"id": "chatcmpl-x", "metric": "click", "value": NaN}', "value"),
        (b'{"id": 7, "metric": "click", "value": 1}', "id"),
        (b'{"metric": "click", "value": 1}', "id"),
        (b'{"id": "chatcmpl-x", "metric": "no spaces", "value": 1}', "metric"),
        (b'{"id": "chatcmpl-x", "metric": "click", "value": 1, "timestamp": "yesterday"}', "timestamp"),
        (b'{"id": "chatcmpl-x", "metric": "click", "value": 1, "timestamp": 1e15}', "timestamp"),
        (b'{"id": "chatcmpl-x", "metric": "click", "value": 1, "model": "nope"}', "model"),
        (b'{"id": "chatcmpl-x", "metric": "click", "value": 1, "rating": 5}', "rating"),
    ],
)
def test_a_bad_feedback_body_is_a_400_naming_the_field(
    recording: tuple[RecordingStack, int], body: bytes, param: str | None
) -> None:
    status, answer = post(recording[1], "/v1/feedback", body)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param
    if param is not None:
        assert f"'{param}'" in answer["error"]["message"]


def test_sse_bytes_written_in_any_pieces_are_recorded_event_by_event_with_the_first_texts_offset() -> None:
    """A relay passes an upstream's stream through in whatever chunks it comes: events are cut out of the bytes
    as they end, whatever the cut."""
    stream = (
        b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
        b": a comment\n\n"
        b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    cuts = [(written, cut) for written in (stream, stream.replace(b"\n", b"\r\n")) for cut in range(1, len(written))]
    for written, cut in cuts:  # LF line ends, then CRLF, cut at every byte
        exchange = HttpExchange("POST", "/v1/chat/completions", "chat", max_bytes=1 << 20, started_ns=0)
        exchange.written(written[:cut])
        exchange.written(written[cut:])
        assert [data for _, _, data in exchange.events] == [
            b'{"choices":[{"delta":{"role":"assistant"}}]}',
            b'{"choices":[{"delta":{"content":"Hi"}}]}',
            b"[DONE]",
        ]
        assert exchange.first_token_ns == exchange.events[1][1]
