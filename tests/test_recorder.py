"""The recorder end to end: a real recorder process, a real redis-server, real gRPC streams.

Each test gets its own redis-server on a free port (small stream nodes, so
approximate trimming is close to exact) and its own recorder. A few logic tests
(validation, masking, configuration) run in-process.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from grpc import StatusCode, aio
from grpc_health.v1 import health_pb2
from redis.asyncio import Redis

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import feedback_pb2, recorder_pb2, recorder_pb2_grpc
from splitstream.common.records import (
    REDACTED_HTTP_TAG,
    REDACTED_OUTPUTS_TAG,
    MissingBlob,
    blob_key,
    payload_bytes,
    redacted_outputs,
    stream_key,
)
from splitstream.recorder.config import Action, Rule, parse_args
from splitstream.recorder.redaction import Redactor
from splitstream.recorder.validation import MAX_BATCH_ITEMS, parse_batch
from tests import launcher
from tests.harness import ROOT, ServiceProcess, free_port, health_status, metric_samples, scrape_metrics, wait_for
from tests.records import read_records, request_of, response_of
from tests.redis_server import RedisServer
from tests.tensors import add_raw_input, add_typed_input

HMAC_KEY = "test-hmac-key"
NODE_ENTRIES = 10
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# --- fixtures and helpers -------------------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    # Small macro-nodes with no byte limit: approximate trimming (MAXLEN ~ / MINID ~) drops whole
    # nodes, so this keeps "about N" within NODE_ENTRIES and makes node boundaries predictable.
    config = ("--stream-node-max-entries", str(NODE_ENTRIES), "--stream-node-max-bytes", "0")
    server = RedisServer(tmp_path / "redis", config=config).start()
    yield server
    server.stop()


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


RecorderFactory = Callable[..., ServiceProcess]


@pytest.fixture
def start_recorder(tmp_path: Path, redis_server: RedisServer) -> Iterator[RecorderFactory]:
    """Start a recorder on free ports against this test's Redis; all are stopped at the end."""
    started: list[ServiceProcess] = []

    def start(*extra: str, wait_serving: bool = True) -> ServiceProcess:
        port, metrics_port = free_port(), free_port()
        args = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]
        args += ["--redis-url", redis_server.url, *extra]
        process = ServiceProcess(
            f"recorder-{port}",
            "splitstream.recorder",
            args,
            log_dir=tmp_path,
            port=port,
            env={"SPLITSTREAM_HMAC_KEY": HMAC_KEY},
        )
        started.append(process)
        return process.start(wait_serving=wait_serving)

    yield start
    for process in started:
        process.stop()


def request_bytes(request_id: str, **inputs: np.ndarray) -> bytes:
    request = oip.ModelInferRequest(model_name="m", id=request_id)
    for name, array in inputs.items():
        add_raw_input(request, name, array)
    return request.SerializeToString()


def response_bytes(**outputs: np.ndarray) -> bytes:
    response = oip.ModelInferResponse(model_name="resnet", model_version="v1")
    for name, array in outputs.items():
        response.outputs.add(name=name, datatype=tensors.datatype_of(array), shape=list(array.shape))
        response.raw_output_contents.append(tensors.to_raw(array))
    return response.SerializeToString()


def call_record(
    request_id: str,
    *,
    model: str = "resnet",
    version: str = "v1",
    status_code: int = 0,
    request: bytes = b"",
    response: bytes = b"",
    metadata: dict[str, str] | None = None,
) -> recorder_pb2.CallRecord:
    record = recorder_pb2.CallRecord(
        schema_version=1,
        request_id=request_id,
        receive_unix_ns=time.time_ns(),
        model=model,
        version=version,
        arm=version,
        routing_key_hmac="ab" * 32,
        status_code=status_code,
        status_message="" if status_code == 0 else "bad input",
        latency_ns=2_500_000,
        endpoint="127.0.0.1:9000",
        router_id="router-a",
        metadata=metadata or {},
    )
    record.request.inline = request or request_bytes(request_id, x=np.arange(4, dtype=np.float32))
    if response:
        record.response.inline = response
    return record


def batch(sequence: int, *records: recorder_pb2.CallRecord) -> recorder_pb2.RecordBatch:
    return recorder_pb2.RecordBatch(sequence=sequence, records=records)


async def send(address: str, *batches: recorder_pb2.RecordBatch | bytes) -> list[recorder_pb2.RecordAck]:
    """Send batches on one stream, each after the previous one's ack; raises AioRpcError if the stream fails."""
    async with aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            "/splitstream.v1.Recorder/Record", response_deserializer=recorder_pb2.RecordAck.FromString
        )()
        acks = []
        for item in batches:
            await call.write(item if isinstance(item, bytes) else item.SerializeToString())
            acks.append(await call.read())
        await call.done_writing()
        assert await call.code() == StatusCode.OK
        return acks


async def rpc_error(coroutine: object) -> aio.AioRpcError:
    with pytest.raises(aio.AioRpcError) as info:
        await coroutine  # type: ignore[misc]
    return info.value


def metric(process: ServiceProcess, name: str, **labels: str) -> float:
    samples = metric_samples(scrape_metrics(process.metrics_port), name)
    return sum(value for sample_labels, value in samples if labels.items() <= sample_labels.items())


Entries = list[tuple[bytes, dict[bytes, bytes]]]


async def xrange(redis: Redis, key: str | bytes) -> Entries:
    """XRANGE with binary replies, typed (redis-py's own annotations cover every reply mode at once)."""
    return cast(Entries, await redis.xrange(key))


async def all_redis_bytes(redis: Redis) -> list[bytes]:
    """Every key, field and value in Redis, as bytes: the whole haystack a leak would be in."""
    found: list[bytes] = []
    async for key in redis.scan_iter(count=1000):
        found.append(key)
        kind = cast(bytes, await redis.type(key)).decode()
        if kind == "stream":
            for entry_id, fields in await xrange(redis, key):
                found.append(entry_id)
                for field, value in fields.items():
                    found += [field, value]
        elif kind == "string":
            found.append(cast(bytes, await redis.get(key)))
        else:
            raise AssertionError(f"unexpected {kind} key {key!r}: the recorder writes streams and strings only")
    return found


# --- end to end -------------------------------------------------------------------------------------


async def test_records_arrive_in_their_model_stream_with_readable_fields_and_acks_carry_the_sequence(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    recorder = start_recorder()
    response = oip.ModelInferResponse(model_name="resnet", model_version="v1", id="a-1")
    sent = [
        call_record("a-1", response=response.SerializeToString()),
        call_record("a-2", status_code=3),
        call_record("b-1", model="bert", version="v2"),
    ]
    sent[2].arm, sent[2].assignment, sent[2].routing_key_hmac = "v1", recorder_pb2.ASSIGNMENT_SPILL, ""
    sent[2].phase.id, sent[2].phase.control = "0123456789abcdef", "v1"
    sent[2].principal = "web-frontend"
    sent[2].usage.prompt_tokens, sent[2].usage.completion_tokens = 12, 34  # a generation that reported its usage
    streamed = call_record("b-2", model="bert", version="v2")
    streamed.stream.first_response_ns, streamed.stream.responses_total = 12_500_000, 7
    shadow = sent[0].shadows.add(version="v2", endpoint="127.0.0.1:9001", status_code=0, latency_ns=3_000_000)
    shadow.response.inline = response.SerializeToString()

    acks = await send(recorder.address, batch(41, *sent[:2]), batch(42, sent[2], streamed))

    assert [(ack.sequence, ack.written) for ack in acks] == [(41, 2), (42, 2)]
    entries = await xrange(redis, stream_key("resnet")) + await xrange(redis, stream_key("bert"))
    readable = [{k.decode(): v.decode() for k, v in fields.items() if k != b"record"} for _, fields in entries]
    plain = {"blobs": "0", "tags": ""}  # no payload stored as a blob (default threshold), no tags
    no_usage = {"prompt_tokens": "", "completion_tokens": ""}
    unit = {"unit": "ab" * 32, "principal": "", "ttft_ms": "", "tokens": ""} | no_usage | plain  # unary: no figures
    assert readable == [
        {"request_id": "a-1", "time_ns": str(sent[0].receive_unix_ns), "model": "resnet", "version": "v1"}
        | {"status": "OK", "latency_ms": "2.500", "arm": "v1", "assignment": "unspecified", "phase": ""}
        | unit,
        {"request_id": "a-2", "time_ns": str(sent[1].receive_unix_ns), "model": "resnet", "version": "v1"}
        | {"status": "INVALID_ARGUMENT", "latency_ms": "2.500", "arm": "v1", "assignment": "unspecified"}
        | {"phase": ""}
        | unit,
        {"request_id": "b-1", "time_ns": str(sent[2].receive_unix_ns), "model": "bert", "version": "v2"}
        | {"status": "OK", "latency_ms": "2.500", "arm": "v1", "assignment": "spill", "phase": "0123456789abcdef"}
        | {"unit": "", "principal": "web-frontend", "ttft_ms": "", "tokens": ""}
        | {"prompt_tokens": "12", "completion_tokens": "34"}
        | plain,
        {"request_id": "b-2", "time_ns": str(streamed.receive_unix_ns), "model": "bert", "version": "v2"}
        | {"status": "OK", "latency_ms": "2.500", "arm": "v2", "assignment": "unspecified", "phase": ""}
        | {"unit": "ab" * 32, "principal": "", "ttft_ms": "12.500", "tokens": "7"}
        | no_usage  # seven responses counted, none kept: their tokens are unknown, not zero
        | plain,
    ]
    stored = [item.record async for item in read_records(redis, "resnet")]
    for original in sent[:2]:  # what was sent, plus the sizes the recorder fills in
        original.request.size_bytes = len(original.request.inline)
        if original.response.inline:
            original.response.size_bytes = len(original.response.inline)
        for each in original.shadows:
            each.response.size_bytes = len(each.response.inline)
    assert stored == sent[:2]
    assert await response_of(redis, stored[0]) == response
    assert await response_of(redis, stored[1]) is None
    assert (await request_of(redis, stored[1])).id == "a-2"
    assert metric(recorder, "splitstream_recorder_records_written_total", model="resnet") == 2
    assert metric(recorder, "splitstream_recorder_records_written_total", model="bert") == 2
    assert metric(recorder, "splitstream_recorder_batches_total", result="ok") == 2
    assert metric(recorder, "splitstream_recorder_write_seconds_count") == 2


async def test_a_large_input_sent_twice_is_stored_once_and_reads_back_byte_for_byte(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    recorder = start_recorder("--blob-ttl-s", "3600")
    image = np.random.default_rng(7).integers(0, 256, size=1 << 20, dtype=np.uint8)
    large = request_bytes("same", image=image)

    await send(recorder.address, batch(1, call_record("first", request=large)))
    await send(recorder.address, batch(1, call_record("second", request=large)))

    blobs = [key async for key in redis.scan_iter(match=blob_key("*"))]
    assert blobs == [blob_key(hashlib.sha256(large).hexdigest()).encode()]
    stored = [item.record async for item in read_records(redis, "resnet")]
    assert [r.request.blob_sha256 for r in stored] == [hashlib.sha256(large).hexdigest()] * 2
    assert [r.request.size_bytes for r in stored] == [len(large)] * 2
    assert await payload_bytes(redis, stored[1].request) == large
    restored = tensors.input_arrays(await request_of(redis, stored[0]))["image"]
    np.testing.assert_array_equal(restored, image)
    assert 3500 < await redis.ttl(blobs[0]) <= 3600
    assert metric(recorder, "splitstream_recorder_blobs_written_total") == 1

    # Every new reference refreshes the blob's TTL, so it outlives the newest record using it.
    await redis.expire(blobs[0], 30)
    await send(recorder.address, batch(2, call_record("third", request=large)))
    assert await redis.ttl(blobs[0]) > 3500
    await redis.delete(blobs[0])
    with pytest.raises(MissingBlob, match="expired or was evicted"):
        await payload_bytes(redis, stored[0].request)


async def test_redaction_leaves_no_sensitive_value_anywhere_in_redis(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    recorder = start_recorder(
        "--redact-metadata",
        "authorization",
        "--redact-metadata",
        "x-user-email:mask",
        "--redact-input",
        "account:drop",
        "--redact-input",
        "face:mask",
    )
    secret_token, email = "Bearer tok-5f0c9e27d1", "someone@example.org"
    # Distinctive byte patterns that cannot occur by chance; the large face goes through the blob path.
    account = np.frombuffer(b"ACCT-7731-SECRET" * 8, dtype=np.uint8)
    faces = {"small": b"FACE-0423-SECRET" * 16, "large": b"FACE-0423-SECRET" * 8192}
    x = np.arange(16, dtype=np.float32)
    metadata = {"authorization": secret_token, "x-user-email": email, "x-trace": "trace-1"}
    records = [
        call_record(
            name,
            request=request_bytes(name, x=x, account=account, face=np.frombuffer(face, dtype=np.uint8)),
            metadata=metadata,
        )
        for name, face in faces.items()
    ]

    await send(recorder.address, batch(1, *records))

    haystack = await all_redis_bytes(redis)
    assert any(key.startswith(b"splitstream:blob:") for key in haystack), "the large request should be a blob"
    for needle in (secret_token.encode(), email.encode(), b"ACCT-7731", b"FACE-0423"):
        assert not [item for item in haystack if needle in item], f"{needle!r} is stored in Redis"
    for stored in [item.record async for item in read_records(redis, "resnet")]:
        masked_email = "hmac:" + hmac.new(HMAC_KEY.encode(), email.encode(), hashlib.sha256).hexdigest()
        assert dict(stored.metadata) == {"x-user-email": masked_email, "x-trace": "trace-1"}
        request = await request_of(redis, stored)
        assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
            ("x", "FP32", [16]),
            ("face", "UINT8", [len(faces[stored.request_id])]),
        ]
        arrays = tensors.input_arrays(request)  # raw slots still line up with inputs
        np.testing.assert_array_equal(arrays["x"], x)
        assert not arrays["face"].any()


async def test_output_redaction_leaves_no_sensitive_output_anywhere_in_redis_and_names_what_it_redacted(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    recorder = start_recorder("--redact-output", "embedding:drop", "--redact-output", "score:mask")
    # Distinctive byte patterns that cannot occur by chance; the large score goes through the blob path.
    embedding = np.frombuffer(b"EMBD-5521-SECRET" * 8, dtype=np.uint8)
    scores = {"small": b"SCOR-9184-SECRET" * 4, "large": b"SCOR-9184-SECRET" * 8192}
    label = np.array([3, 1], dtype=np.int64)
    records = []
    for name, score in scores.items():
        sensitive = response_bytes(label=label, embedding=embedding, score=np.frombuffer(score, dtype="<f4"))
        record = call_record(name, response=sensitive)
        shadow = record.shadows.add(version="v2", endpoint="127.0.0.1:9001", status_code=0, latency_ns=1_000)
        shadow.response.inline = sensitive
        records.append(record)
    # Nothing to redact: its bytes (fields out of the canonical order, as any other encoder may write
    # them) must be stored as they came, not re-serialized.
    untouched = response_bytes(label=label) + oip.ModelInferResponse(id="untouched").SerializeToString()
    records.append(call_record("untouched", response=untouched))
    failed = call_record("failed", status_code=3)
    failed.shadows.add(version="v2", endpoint="127.0.0.1:9001", status_code=3, status_message="bad input")
    records.append(failed)

    await send(recorder.address, batch(1, *records))

    haystack = await all_redis_bytes(redis)
    assert any(key.startswith(b"splitstream:blob:") for key in haystack), "the large response should be a blob"
    for needle in (b"EMBD-5521", b"SCOR-9184"):
        assert not [item for item in haystack if needle in item], f"{needle!r} is stored in Redis"
    stored = {item.record.request_id: item.record async for item in read_records(redis, "resnet")}
    for name, score in scores.items():
        record = stored[name]
        assert dict(record.tags) == {REDACTED_OUTPUTS_TAG: "embedding,score"}
        assert redacted_outputs(record) == {"embedding", "score"}
        (shadow,) = record.shadows
        shadow_bytes = await payload_bytes(redis, shadow.response)
        assert shadow.response.size_bytes == len(shadow_bytes)
        for response in (await response_of(redis, record), oip.ModelInferResponse.FromString(shadow_bytes)):
            assert response is not None
            assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
                ("label", "INT64", [2]),
                ("score", "FP32", [len(score) // 4]),
            ]
            arrays = tensors.output_arrays(response)  # raw slots still line up with outputs
            np.testing.assert_array_equal(arrays["label"], label)
            assert not arrays["score"].any()
    assert await payload_bytes(redis, stored["untouched"].response) == untouched
    assert not stored["untouched"].tags
    assert not stored["failed"].tags
    assert stored["failed"].shadows[0].status_message == "bad input"


async def test_an_unreadable_response_under_output_rules_is_rejected_alone_and_named_in_the_ack(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    recorder = start_recorder("--redact-output", "score:mask")
    fine = response_bytes(score=np.ones(3, np.float32))
    unreadable = call_record("bad-one", response=b"\xff\xff\xff")
    bad_shadow = call_record("bad-shadow", response=fine)
    bad_shadow.shadows.add(version="v2", status_code=0).response.inline = fine
    bad_shadow.shadows.add(version="v3", status_code=0).response.inline = b"\xff\xff\xff"
    (ack,) = await send(
        recorder.address, batch(7, call_record("good-1", response=fine), unreadable, bad_shadow, call_record("good-2"))
    )
    assert (ack.sequence, ack.written) == (7, 2)
    assert [(r.index, r.request_id) for r in ack.rejected] == [(1, "bad-one"), (2, "bad-shadow")]
    assert "the response payload is not an inference.ModelInferResponse" in ack.rejected[0].reason
    assert "shadows[1].response payload is not an inference.ModelInferResponse" in ack.rejected[1].reason
    stored = [item.record.request_id async for item in read_records(redis, "resnet")]
    assert stored == ["good-1", "good-2"]
    assert metric(recorder, "splitstream_recorder_records_rejected_total") == 2
    assert metric(recorder, "splitstream_recorder_batches_total", result="invalid") == 0


@pytest.mark.slow
async def test_retention_by_count_keeps_about_maxlen_records_per_stream(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    maxlen, total = 200, 2000
    recorder = start_recorder("--retention-maxlen", str(maxlen))

    batches = [batch(n, *(call_record(f"r-{n}-{i}") for i in range(100))) for n in range(total // 100)]
    acks = await send(recorder.address, *batches)

    assert sum(ack.written for ack in acks) == total
    length = await redis.xlen(stream_key("resnet"))
    assert maxlen <= length <= maxlen + NODE_ENTRIES  # MAXLEN ~ drops whole nodes only
    newest = [item.record.request_id async for item in read_records(redis, "resnet")][-1]
    assert newest == "r-19-99"


@pytest.mark.parametrize("count_limit", [[], ["--retention-maxlen", "1000"]], ids=["age", "age-and-count"])
async def test_retention_by_age_drops_records_older_than_the_limit(
    start_recorder: RecorderFactory, redis: Redis, count_limit: list[str]
) -> None:
    recorder = start_recorder("--retention-age-s", "1", *count_limit)
    # Two full macro-nodes of old records, so the newer records start a node of their own.
    await send(recorder.address, batch(1, *(call_record(f"old-{i}") for i in range(2 * NODE_ENTRIES))))
    written_at = time.time()
    assert await redis.xlen(stream_key("resnet")) == 2 * NODE_ENTRIES

    wait_for(lambda: time.time() > written_at + 1.1, timeout_s=5, what="the old records to pass the age limit")
    await send(recorder.address, batch(2, *(call_record(f"new-{i}") for i in range(3))))

    remaining = [item.record.request_id async for item in read_records(redis, "resnet")]
    assert remaining == ["new-0", "new-1", "new-2"]


async def test_an_age_retention_reaching_back_before_1970_keeps_every_record_and_refuses_no_batch(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    """127 years, meant as "keep for ever": the trim bound was a negative stream id, Redis refused every
    batch ("Invalid stream ID", INTERNAL) and routers, halving the refused batches, dropped every record."""
    recorder = start_recorder("--retention-age-s", "4000000000")
    large = request_bytes("big", x=np.zeros(1 << 16, dtype=np.float32))  # 256 KiB: a blob, with its TTL
    acks = await send(recorder.address, batch(1, call_record("small"), call_record("big", request=large)))
    assert [ack.written for ack in acks] == [2]
    stored = [item.record async for item in read_records(redis, "resnet")]
    assert [r.request_id for r in stored] == ["small", "big"]
    assert await payload_bytes(redis, stored[1].request) == large


async def test_a_message_that_is_no_batch_is_refused_and_a_bad_record_is_rejected_alone(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    recorder = start_recorder()
    garbage = np.random.default_rng(3).integers(0, 256, size=512, dtype=np.uint8).tobytes()

    error = await rpc_error(send(recorder.address, garbage))
    assert error.code() == StatusCode.INVALID_ARGUMENT
    assert "not a splitstream.v1.RecordBatch" in (error.details() or "")

    bad = call_record("bad-one", model="res net")
    unparsable = recorder_pb2.EncodedRecordBatch(records=[b"\x12\xff"]).SerializeToString()
    data = batch(5, call_record("good-1"), bad).SerializeToString() + unparsable
    data += batch(0, call_record("good-2")).SerializeToString()  # concatenated messages merge: 4 records
    (ack,) = await send(recorder.address, data)
    assert (ack.sequence, ack.written) == (5, 2)
    assert [(r.index, r.request_id) for r in ack.rejected] == [(1, "bad-one"), (2, "")]
    assert "whitespace" in ack.rejected[0].reason
    assert "not a splitstream.v1.CallRecord" in ack.rejected[1].reason
    assert [item.record.request_id async for item in read_records(redis, "resnet")] == ["good-1", "good-2"]
    assert metric(recorder, "splitstream_recorder_batches_total", result="invalid") == 1
    assert metric(recorder, "splitstream_recorder_records_rejected_total") == 2
    assert health_status(recorder.address) == SERVING


async def test_a_batch_of_millions_of_empty_records_is_refused_unparsed_and_acks_stay_small(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    """An empty record is 2 bytes on the wire and cost the recorder about a kilobyte to reject: a 2 MB batch
    of a million took 12 s and 900 MB, and its 51 MB ack was over the sender's receive limit (a batch at the
    128 MiB receive limit would have needed some 60 GB). More than MAX_BATCH_ITEMS is now RESOURCE_EXHAUSTED
    before anything is parsed (the router's shipper resends it in smaller batches), and the ack cuts what it
    quotes of a rejected record."""
    recorder = start_recorder()
    await send(recorder.address, batch(1, call_record("kept")))

    started = time.monotonic()
    error = await rpc_error(send(recorder.address, b"\x12\x00" * 1_000_000))
    assert error.code() == StatusCode.RESOURCE_EXHAUSTED
    assert f"more than {MAX_BATCH_ITEMS} records and events" in (error.details() or "")
    assert time.monotonic() - started < 5
    error = await rpc_error(send(recorder.address, b"\x12\x00" * (MAX_BATCH_ITEMS + 1)))
    assert error.code() == StatusCode.RESOURCE_EXHAUSTED

    (ack,) = await send(recorder.address, b"\x12\x00" * MAX_BATCH_ITEMS)  # the most a batch may hold
    assert (ack.written, len(ack.rejected)) == (0, MAX_BATCH_ITEMS)
    (ack,) = await send(recorder.address, batch(2, call_record("i" * 1_000_000, model="res net"), call_record("ok")))
    assert ack.written == 1
    (rejected,) = ack.rejected
    assert (rejected.index, rejected.request_id) == (0, "i" * 200)
    assert ack.ByteSize() < 1000
    assert [item.record.request_id async for item in read_records(redis, "resnet")] == ["kept", "ok"]
    assert health_status(recorder.address) == SERVING


async def test_redis_outage_makes_writes_unavailable_and_health_not_serving_until_redis_returns(
    start_recorder: RecorderFactory, redis_server: RedisServer, redis: Redis
) -> None:
    recorder = start_recorder("--redis-timeout-s", "1", "--health-interval-s", "0.2")
    await send(recorder.address, batch(1, call_record("before")))

    redis_server.stop()
    started = time.monotonic()
    error = await rpc_error(send(recorder.address, batch(2, call_record("during"))))
    assert error.code() == StatusCode.UNAVAILABLE
    assert "redis" in (error.details() or "")
    assert time.monotonic() - started < 5, "a dead Redis must fail a batch fast"
    wait_for(lambda: health_status(recorder.address) == NOT_SERVING, timeout_s=5, what="NOT_SERVING")
    assert metric(recorder, "splitstream_recorder_batches_total", result="redis_error") == 1

    redis_server.start()  # same port, empty (nothing is persisted)
    wait_for(lambda: health_status(recorder.address) == SERVING, timeout_s=10, what="SERVING again")
    acks = await send(recorder.address, batch(3, call_record("after")))
    assert acks[0].written == 1
    assert [item.record.request_id async for item in read_records(redis, "resnet")] == ["after"]


async def test_redis_refusing_writes_at_maxmemory_makes_the_recorder_not_serving_until_a_batch_is_written_again(
    tmp_path: Path,
) -> None:
    # A tiny maxmemory under noeviction: Redis answers PING but refuses writes once full.
    server = RedisServer(tmp_path / "full-redis", config=("--maxmemory", "3mb", "--maxmemory-policy", "noeviction"))
    server.start()
    port, metrics_port = free_port(), free_port()
    recorder = ServiceProcess(
        f"recorder-{port}",
        "splitstream.recorder",
        [
            *("--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)),
            *("--redis-url", server.url, "--health-interval-s", "0.2", "--blob-threshold-bytes", str(1 << 20)),
        ],
        log_dir=tmp_path,
        port=port,
        env={"SPLITSTREAM_HMAC_KEY": HMAC_KEY},
    ).start()
    client = Redis.from_url(server.url)
    try:
        payload = request_bytes("filler", x=np.random.default_rng(0).standard_normal(25_000).astype(np.float32))
        refusal = None
        for n in range(1, 200):  # ~100 KiB a record: Redis is full within a few dozen
            try:
                await send(recorder.address, batch(n, call_record(f"fill-{n}", request=payload)))
            except aio.AioRpcError as error:
                refusal = error
                break
        assert refusal is not None, "Redis never refused a write"
        assert refusal.code() == StatusCode.UNAVAILABLE
        assert "refuses writes" in (refusal.details() or "")
        assert "maxmemory" in (refusal.details() or "")
        assert "fill-" not in (refusal.details() or "")  # no record field (request id) in the status
        wait_for(lambda: health_status(recorder.address) == NOT_SERVING, timeout_s=5, what="NOT_SERVING")
        assert metric(recorder, "splitstream_recorder_redis_writable") == 0
        assert metric(recorder, "splitstream_recorder_redis_up") == 0
        assert await client.ping()  # Redis itself answers all along

        await client.config_set("maxmemory", "0")  # the operator makes room
        # A router's resend is what finds out: NOT_SERVING does not stop streams, and a small probe
        # write would pass while batches do not.
        (ack,) = await send(recorder.address, batch(999, call_record("after")))
        assert ack.written == 1
        wait_for(lambda: health_status(recorder.address) == SERVING, timeout_s=10, what="SERVING again")
        assert metric(recorder, "splitstream_recorder_redis_writable") == 1
    finally:
        recorder.stop()
        await client.aclose()
        server.stop()


async def test_a_stream_key_of_the_wrong_type_fails_that_batch_and_leaves_the_recorder_serving(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    """WRONGTYPE is about one key, not about Redis: every other model's records are still written, and
    health stays SERVING (it had gone NOT_SERVING for every model, as if Redis refused all writes)."""
    recorder = start_recorder("--health-interval-s", "0.2")
    await redis.set("splitstream:calls:broken", "not a stream")
    error = await rpc_error(send(recorder.address, batch(1, call_record("to-broken", model="broken"))))
    assert error.code() == StatusCode.INTERNAL
    assert "WRONGTYPE" in (error.details() or "")
    (ack,) = await send(recorder.address, batch(2, call_record("to-resnet")))
    assert ack.written == 1
    for _ in range(5):  # several health intervals: it never goes NOT_SERVING
        assert health_status(recorder.address) == SERVING
        assert metric(recorder, "splitstream_recorder_redis_writable") == 1
        await asyncio.sleep(0.2)


async def test_a_password_in_the_redis_url_reaches_a_protected_redis_and_stays_out_of_the_log(
    tmp_path: Path, start_recorder: RecorderFactory
) -> None:
    with RedisServer(tmp_path / "protected", password="s3cret-pw") as protected:
        url = protected.url.replace("/0", "/2")
        recorder = start_recorder("--redis-url", url)  # the later --redis-url wins
        await send(recorder.address, batch(1, call_record("guarded")))

        client = Redis.from_url(url)
        try:
            assert [item.record.request_id async for item in read_records(client, "resnet")] == ["guarded"]
        finally:
            await client.aclose()
        assert "s3cret-pw" not in recorder.log()


async def test_sigterm_ends_open_streams_with_unavailable_and_exits_zero(start_recorder: RecorderFactory) -> None:
    recorder = start_recorder()
    async with aio.insecure_channel(recorder.address) as channel:
        call = recorder_pb2_grpc.RecorderStub(channel).Record()
        await call.write(batch(1, call_record("one")))
        assert (await call.read()).sequence == 1

        recorder.signal(signal.SIGTERM)
        error = await rpc_error(call.read())
        assert error.code() == StatusCode.UNAVAILABLE
        assert "shutting down" in (error.details() or "")
    assert recorder.wait(timeout_s=15) == 0


@pytest.mark.parametrize(
    ("args", "env", "problem"),
    [
        (["--retention-maxlen", "-5"], {}, "must not be negative"),
        (["--redact-metadata", "authorization:mask"], {}, "needs an HMAC key"),
        (["--redis-url", "http://127.0.0.1:6379"], {}, "--redis-url must start with"),
        (["--port", "eighty"], {}, "invalid int value"),
        ([], {"SPLITSTREAM_RECORDER_BLOB_TTL_S": "a week"}, "SPLITSTREAM_RECORDER_BLOB_TTL_S"),
        (["--log-level", "LOUD"], {}, "--log-level: must be one of"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args: list[str], env: dict[str, str], problem: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    result = launcher.run(
        [sys.executable, "-m", "splitstream.recorder", "--redis-url", "redis://127.0.0.1:1/0", *args],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("splitstream-recorder: error:")
    assert problem in lines[0]


# --- in-process logic -------------------------------------------------------------------------------


def _http_events(*events: tuple[int, int], total: int | None = None) -> recorder_pb2.HttpCall:
    """An HTTP exchange of status 200 with events of these (index, offset_ns)."""
    call = recorder_pb2.HttpCall(status=200, events_total=len(events) if total is None else total)
    for index, offset_ns in events:
        call.events.add(index=index, offset_ns=offset_ns).payload.inline = b"{}"
    return call


def _bad(**changes: object) -> recorder_pb2.CallRecord:
    record = call_record("bad-one")
    for field, value in changes.items():
        if field == "request_blob":
            record.request.blob_sha256 = str(value)
        elif field == "request_size":
            record.request.size_bytes = int(value)  # type: ignore[call-overload]
        elif field == "request_inline":
            record.request.inline = value  # type: ignore[assignment]
        elif field == "http":
            record.http.CopyFrom(value)  # type: ignore[arg-type]
        else:
            setattr(record, field, value)
    return record


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (_bad(schema_version=2), "schema_version is 2"),
        (_bad(request_id=""), "request_id is empty"),
        (_bad(model=""), "model is empty"),
        (_bad(model="m" * 201), "at most 200"),
        (_bad(model="m\x07"), "control characters"),
        (_bad(receive_unix_ns=0), "receive_unix_ns is 0"),
        (_bad(request_blob="ab" * 32), "blob reference"),
        (_bad(request_size=99999), "size_bytes 99999"),
        (_bad(request_inline=b"\xff\xff\xff"), "not an inference.ModelInferRequest"),
        (_bad(http=recorder_pb2.HttpCall(status=0)), "http.status is 0"),
        (_bad(http=_http_events((0, 5), (1, 3))), "http.events[1].offset_ns is 3, before the previous 5"),
        (_bad(http=_http_events((1, 5), (1, 6))), "http.events[1].index is 1, after index 1"),
        (_bad(http=_http_events((0, 5), total=0)), "http.events_total is 0 but 1 events are kept"),
    ],
)
def test_each_kind_of_bad_record_is_named_in_the_rejection(record: recorder_pb2.CallRecord, problem: str) -> None:
    data = batch(9, call_record("fine"), record).SerializeToString()
    parsed = parse_batch(data, decode_requests=True)
    assert [item.record.request_id for item in parsed.checked] == ["fine"]
    (rejection,) = parsed.rejected
    assert (rejection.index, rejection.request_id) == (1, record.request_id)
    assert problem in rejection.reason


def test_masked_inputs_keep_name_type_and_shape_with_zeroed_data_raw_or_typed() -> None:
    redactor = Redactor(metadata=(), inputs=(Rule("secret", Action.MASK), Rule("gone", Action.DROP)), hmac_key=b"k")
    words = np.array([b"alpha", b"beta"], dtype=np.object_)
    raw = oip.ModelInferRequest()
    for name, array in (("gone", np.ones(3, np.int64)), ("secret", words), ("keep", np.arange(3, dtype=np.int32))):
        add_raw_input(raw, name, array)
    typed = oip.ModelInferRequest()
    add_typed_input(typed, "secret", np.array([1.5, -2.0], dtype=np.float32))
    add_typed_input(typed, "keep", np.array([7, 8], dtype=np.int64))

    assert redactor.redact_request(raw)
    assert redactor.redact_request(typed)

    raw_arrays = tensors.input_arrays(raw)
    assert list(raw_arrays) == ["secret", "keep"]
    assert raw_arrays["secret"].tolist() == [b"", b""]
    np.testing.assert_array_equal(raw_arrays["keep"], np.arange(3, dtype=np.int32))
    typed_arrays = tensors.input_arrays(typed)
    assert typed_arrays["secret"].tolist() == [0.0, 0.0]
    assert typed_arrays["keep"].tolist() == [7, 8]


def test_an_http_calls_bodies_are_dropped_where_rules_of_their_kind_redacted_or_cannot_tell() -> None:
    """A JSON body holds what the translated tensors hold and no rule masks a JSON field: a body goes when a rule
    redacted its translated side, or when there is none to tell (passed through); otherwise it is kept."""

    def http_record(*, translated: bool) -> recorder_pb2.CallRecord:
        record = call_record("http-1", request=request_bytes("http-1", text_input=np.array([b"secret"], np.object_)))
        if not translated:
            record.ClearField("request")
            record.ClearField("response")
        record.http.status = 200
        record.http.request_body.inline = b'{"prompt": "secret"}'
        record.http.response_body.inline = b'{"choices": []}'
        return record

    inputs = Redactor(metadata=(), inputs=(Rule("text_input", Action.MASK),), hmac_key=b"k")
    translated = http_record(translated=True)
    inputs.redact(translated, oip.ModelInferRequest.FromString(translated.request.inline))
    assert not translated.http.HasField("request_body")
    assert translated.http.response_body.inline == b'{"choices": []}'  # no output rule: kept
    assert translated.tags[REDACTED_HTTP_TAG] == "request_body"

    other = Redactor(metadata=(), inputs=(Rule("image", Action.MASK),), hmac_key=b"k")
    untouched = http_record(translated=True)
    other.redact(untouched, oip.ModelInferRequest.FromString(untouched.request.inline))
    assert untouched.http.request_body.inline == b'{"prompt": "secret"}'  # the rule matched nothing: kept
    assert REDACTED_HTTP_TAG not in untouched.tags

    passed = http_record(translated=False)
    outputs = Redactor(metadata=(), inputs=(Rule("x", Action.DROP),), outputs=(Rule("y", Action.DROP),), hmac_key=b"")
    outputs.redact(passed, oip.ModelInferRequest(), oip.ModelInferResponse())
    assert not passed.http.HasField("request_body")
    assert not passed.http.HasField("response_body")
    assert passed.tags[REDACTED_HTTP_TAG] == "request_body,response_body"


def test_masked_outputs_keep_name_type_and_shape_with_zeroed_data_and_dropped_ones_leave_no_slot() -> None:
    redactor = Redactor(
        metadata=(), inputs=(), outputs=(Rule("secret", Action.MASK), Rule("gone", Action.DROP)), hmac_key=b""
    )
    words = np.array([b"alpha", b"beta"], dtype=np.object_)
    raw = oip.ModelInferResponse.FromString(
        response_bytes(gone=np.ones(3, np.int64), secret=words, keep=np.arange(3, dtype=np.int32))
    )
    typed = oip.ModelInferResponse()
    typed.outputs.add(name="secret", datatype="FP32", shape=[2]).contents.fp32_contents.extend([1.5, -2.0])
    typed.outputs.add(name="keep", datatype="INT64", shape=[2]).contents.int64_contents.extend([7, 8])

    assert redactor.redact_response(raw) == ["gone", "secret"]
    assert redactor.redact_response(typed) == ["secret"]
    assert redactor.redact_response(oip.ModelInferResponse()) == []

    raw_arrays = tensors.output_arrays(raw)
    assert list(raw_arrays) == ["secret", "keep"]
    assert raw_arrays["secret"].tolist() == [b"", b""]
    np.testing.assert_array_equal(raw_arrays["keep"], np.arange(3, dtype=np.int32))
    typed_arrays = tensors.output_arrays(typed)
    assert typed_arrays["secret"].tolist() == [0.0, 0.0]
    assert typed_arrays["keep"].tolist() == [7, 8]


def test_rules_come_comma_separated_from_the_environment_and_flags_replace_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPLITSTREAM_RECORDER_REDACT_METADATA", "Authorization,cookie:mask")
    monkeypatch.setenv("SPLITSTREAM_HMAC_KEY", "k")
    from_env = parse_args(["--redact-input", "input:0", "--redact-input", "face:mask"])
    assert from_env.redact_metadata == (Rule("authorization", Action.DROP), Rule("cookie", Action.MASK))
    assert from_env.redact_input == (Rule("input:0", Action.DROP), Rule("face", Action.MASK))
    assert parse_args(["--redact-metadata", "x-key"]).redact_metadata == (Rule("x-key", Action.DROP),)
    monkeypatch.setenv("SPLITSTREAM_RECORDER_REDACT_OUTPUT", "embedding,logits:0:mask")
    assert parse_args([]).redact_output == (Rule("embedding", Action.DROP), Rule("logits:0", Action.MASK))
    assert parse_args(["--redact-output", "score:mask"]).redact_output == (Rule("score", Action.MASK),)


def test_blobs_outlive_the_age_retention_of_the_records_that_reference_them() -> None:
    assert parse_args(["--blob-ttl-s", "3600"]).effective_blob_ttl_s == 3600
    assert parse_args(["--blob-ttl-s", "3600", "--retention-age-s", "864000"]).effective_blob_ttl_s == 864000 + 86400
    assert parse_args(["--blob-ttl-s", "0", "--retention-age-s", "60"]).effective_blob_ttl_s == 0


def test_masking_tensors_needs_no_key_masking_metadata_does(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SPLITSTREAM_")]:
        monkeypatch.delenv(name)
    config = parse_args(["--redact-input", "face:mask", "--redact-output", "score:mask"])
    assert config.redact_input == (Rule("face", Action.MASK),)
    assert config.redact_output == (Rule("score", Action.MASK),)
    with pytest.raises(SystemExit) as exited:
        parse_args(["--redact-metadata", "cookie:mask"])
    assert exited.value.code == 2


def feedback_event(metric: str = "click", **fields: object) -> bytes:
    event = feedback_pb2.FeedbackEvent(
        model="resnet", request_id="a-1", metric=metric, value=1.0, receive_unix_ns=time.time_ns()
    )
    for name, value in fields.items():
        setattr(event, name, value)
    return event.SerializeToString()


async def test_feedback_events_are_checked_alone_written_once_per_idempotency_key_and_retained_like_calls(
    start_recorder: RecorderFactory, redis: Redis
) -> None:
    recorder = start_recorder("--retention-maxlen", "20")
    user = "carol-plain-user-id"
    framed = recorder_pb2.EncodedRecordBatch(
        sequence=7,
        records=[call_record("with-feedback").SerializeToString()],
        feedback=[
            feedback_event(idempotency_key="k1"),
            feedback_event(routing_key=user),  # a router must have replaced it by its HMAC
            feedback_event(metric="two words"),
            feedback_event(routing_key_hmac="ab" * 32, request_id=""),
            feedback_event(idempotency_key="k1"),  # the same event twice in one batch
            b"\x0a\x02\xff\xfe",  # model: bytes that are not UTF-8
            feedback_event(value=float("nan")),
        ],
    )
    (ack,) = await send(recorder.address, framed.SerializeToString())
    assert (ack.sequence, ack.written, ack.feedback_written, ack.feedback_duplicates) == (7, 1, 2, 1)
    reasons = {r.index: r.reason for r in ack.rejected_feedback}
    assert sorted(reasons) == [1, 2, 5, 6]
    assert reasons[1].startswith("routing_key:")
    assert reasons[2].startswith("metric:")
    assert "FeedbackEvent" in reasons[5]
    assert reasons[6].startswith("value:")
    stored = await xrange(redis, "splitstream:feedback:resnet")
    assert [(f[b"idempotency_key"], f[b"unit"]) for _, f in stored] == [(b"k1", b""), (b"", b"ab" * 32)]
    assert not any(user.encode() in item for item in await all_redis_bytes(redis))
    assert metric(recorder, "splitstream_recorder_feedback_written_total", model="resnet") == 2
    assert metric(recorder, "splitstream_recorder_feedback_duplicates_total", model="resnet") == 1
    assert metric(recorder, "splitstream_recorder_feedback_rejected_total") == 4

    # Resent (the router never saw the ack): the keyed event is not written again.
    (again,) = await send(recorder.address, framed.SerializeToString())
    assert (again.feedback_written, again.feedback_duplicates) == (1, 2)
    # Retention as for the call streams: about --retention-maxlen entries per model.
    many = recorder_pb2.EncodedRecordBatch(sequence=8, feedback=[feedback_event() for _ in range(200)])
    await send(recorder.address, many.SerializeToString())
    assert 20 <= await redis.xlen("splitstream:feedback:resnet") <= 20 + NODE_ENTRIES
