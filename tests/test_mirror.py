"""The router's record mirror, in process: how batches are built from queued calls and cut when refused,
and (against a real recorder and redis-server) that one odd call costs no other record."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from splitstream.common import wal
from splitstream.common.proto.splitstream.v1 import feedback_pb2, recorder_pb2
from splitstream.common.records import PAYLOAD_DROPPED_TAG
from splitstream.shipper import mirror as mirror_module
from splitstream.shipper.batch_cutter import BATCH_OVERHEAD, BatchCutter, count_records, frame
from splitstream.shipper.mirror import MirrorSettings, RecordMirror
from splitstream.shipper.spool import Spool
from tests.harness import ServiceProcess, free_port
from tests.records import read_records
from tests.redis_server import RedisServer


def mirror_with_calls(tmp_path: Path, calls: int) -> RecordMirror:
    settings = MirrorSettings(recorder_address="127.0.0.1:1")
    mirror = RecordMirror(settings, Spool(tmp_path), CollectorRegistry())
    for index in range(calls):
        mirror.offer(
            entry(
                f"call-{index}",
                request=b"request-%d" % index,
                response=b"response-%d" % index,
                metadata={"x-tenant": "t1"},
            )
        )
    return mirror


def test_batches_built_in_slices_parse_as_one_record_batch_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mirror_module, "_SLICE_S", 0.0)  # one record per slice: the most joins
    mirror = mirror_with_calls(tmp_path, 600)

    async def take_all() -> list[bytes]:
        batches = []
        while (taken := await mirror._take_batch()) is not None:
            batches.append(taken[0])
        return batches

    batches = asyncio.run(take_all())
    parsed = [recorder_pb2.RecordBatch.FromString(mirror_module._with_sequence(b, n)) for n, b in enumerate(batches, 1)]
    assert [len(batch.records) for batch in parsed] == [256, 256, 88]
    assert [batch.sequence for batch in parsed] == [1, 2, 3]
    records = [record for batch in parsed for record in batch.records]
    assert [r.request_id for r in records] == [f"call-{i}" for i in range(600)]
    assert records[599].request.inline == b"request-599"
    assert records[599].response.inline == b"response-599"
    assert dict(records[0].metadata) == {"x-tenant": "t1"}
    assert count_records(batches[2]) == 88


def test_building_a_batch_lets_calls_run_between_slices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mirror_module, "_SLICE_S", 0.0)
    mirror = mirror_with_calls(tmp_path, 50)
    turns = 0

    async def call_handler_stand_in(stop: asyncio.Event) -> None:
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(0)

    async def build() -> None:
        stop = asyncio.Event()
        other = asyncio.create_task(call_handler_stand_in(stop))
        await asyncio.sleep(0)
        before = turns
        assert await mirror._take_batch() is not None
        during = turns - before
        stop.set()
        await other
        assert during >= 49, f"the event loop ran other tasks only {during} times while 50 records were built"

    asyncio.run(build())


# --- the mirror in process against a real recorder and redis-server ---------------------------------


@dataclass(frozen=True)
class Backend:
    recorder_address: str
    redis_url: str


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Backend]:
    """A real redis-server and recorder on free ports."""
    redis = RedisServer(tmp_path / "redis").start()
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(free_port())]
    recorder = ServiceProcess(
        "recorder",
        "splitstream.recorder",
        [*args, "--redis-url", redis.url],
        log_dir=tmp_path,
        port=port,
        env={"SPLITSTREAM_HMAC_KEY": "key"},
    ).start()
    yield Backend(recorder.address, redis.url)
    recorder.stop()
    redis.stop()


def entry(
    request_id: str,
    *,
    request: bytes = b"request",
    response: bytes = b"response",
    metadata: dict[str, str] | None = None,
    stream: bytes = b"",
) -> wal.CallEntry:
    """A call as the shipper reads it from a router's log."""
    return wal.CallEntry(
        kind=wal.CALL,
        request_id=request_id,
        model="affine",
        version="v1",
        arm="v1",
        code=grpc.StatusCode.OK,
        details="",
        endpoint="",
        router_id="r",
        principal="",
        receive_unix_ns=time.time_ns(),
        latency_ns=1_000_000,
        flags=wal.HAS_RESPONSE,
        assignment=-1,
        shadows_expected=0,
        routing_key_hmac="",
        phase=b"",
        metadata=metadata or {},
        stream=stream,
        request=request,
        response=response,
    )


async def stored_ids(redis_url: str) -> list[str]:
    client = Redis.from_url(redis_url)
    try:
        return [item.record.request_id async for item in read_records(client, "affine")]
    finally:
        await client.aclose()


async def wait_stored(redis_url: str, expected: list[str], timeout_s: float = 20.0) -> list[str]:
    """What the stream holds once it is ``expected`` or ``timeout_s`` passed (polled every 50 ms)."""
    for _ in range(int(timeout_s / 0.05)):
        found = await stored_ids(redis_url)
        if found == expected:
            break
        await asyncio.sleep(0.05)
    return found


async def test_a_call_that_cannot_be_recorded_is_dropped_alone_and_the_mirror_goes_on(
    tmp_path: Path, backend: Backend
) -> None:
    settings = MirrorSettings(recorder_address=backend.recorder_address, batch_interval_s=0.05)
    registry = CollectorRegistry()
    mirror = RecordMirror(settings, Spool(tmp_path / "spool"), registry)
    for i in range(10):
        if i == 5:  # a stream field that does not parse: building its record raises
            mirror.offer(entry("odd", stream=b"\xff\xff\xff"))
        mirror.offer(entry(f"first-{i}"))
    mirror.start()
    url = backend.redis_url
    first = [f"first-{i}" for i in range(10)]
    assert await wait_stored(url, first) == first
    mirror.offer(entry("later"))
    assert await wait_stored(url, [*first, "later"]) == [*first, "later"]
    await mirror.close()
    assert registry.get_sample_value("splitstream_shipper_records_dropped_total", {"reason": "unrecordable"}) == 1


def call_records(n: int, size: int = 10) -> list[bytes]:
    records = []
    for i in range(n):
        record = recorder_pb2.CallRecord(schema_version=1, request_id=f"call-{i}", model="affine")
        record.request.inline = b"x" * size
        records.append(record.SerializeToString())
    return records


def ids_of(parts: list[tuple[bytes, int, int]]) -> list[str]:
    return [
        recorder_pb2.CallRecord.FromString(raw).request_id
        for part, _, _ in parts
        for raw in recorder_pb2.EncodedRecordBatch.FromString(part).records
    ]


def test_a_batch_refused_repeatedly_is_resent_in_halves_down_to_the_record_at_fault() -> None:
    cutter = BatchCutter(1 << 20)
    batch = frame(call_records(8))
    assert cutter.as_is(batch)
    assert cutter.parts(batch) == [(batch, 8, 0)]
    cutter.halve(batch)
    assert not cutter.as_is(batch)
    halves = cutter.parts(batch)
    assert [n for _, n, _ in halves] == [4, 4]
    # The half holding the bad record is refused in turn: it is halved again; the other half stays whole.
    cutter.halve(halves[0][0])
    quarters = cutter.parts(batch)
    assert [n for _, n, _ in quarters] == [2, 2, 4]
    assert ids_of(quarters) == [f"call-{i}" for i in range(8)]
    # A part dropped (after its one record was refused) is skipped when the spool entry is resent.
    cutter.drop(quarters[0][0])
    assert ids_of(cutter.parts(batch)) == [f"call-{i}" for i in range(2, 8)]
    cutter.forget()
    assert cutter.parts(batch) == [(batch, 8, 0)]


def test_a_batch_over_the_cap_is_cut_under_it_and_a_record_over_it_alone_loses_its_largest_payload() -> None:
    counted: list[str] = []
    cutter = BatchCutter(
        4096, on_payloads_dropped=lambda: counted.append("payload"), on_too_large=lambda: counted.append("record")
    )
    big = recorder_pb2.CallRecord(schema_version=1, request_id="big", model="affine")
    big.request.inline = b"q" * 100
    big.response.inline = b"r" * 6000
    batch = frame([*call_records(3, 1000), big.SerializeToString(), *call_records(2, 1000)])
    parts = cutter.parts(batch)
    assert all(len(part) + BATCH_OVERHEAD <= 4096 for part, _, _ in parts)
    assert ids_of(parts) == ["call-0", "call-1", "call-2", "big", "call-0", "call-1"]
    (kept,) = [
        recorder_pb2.CallRecord.FromString(raw)
        for part, _, _ in parts
        for raw in recorder_pb2.EncodedRecordBatch.FromString(part).records
        if b"big" in raw
    ]
    assert kept.tags[PAYLOAD_DROPPED_TAG] == "response:6000"
    assert kept.request.inline == b"q" * 100
    assert counted == ["payload"]
    # A recorder that says its limit is lower: the cap follows it (with room for framing), never below 64 KiB.
    cutter.refused_as_too_large("SERVER: Received message larger than max (9000000 vs. 4194304)", 9_000_000)
    assert cutter.max_bytes == 4096  # already lower
    wide = BatchCutter(64 << 20)
    wide.refused_as_too_large("SERVER: Received message larger than max (9000000 vs. 4194304)", 9_000_000)
    assert 4_000_000 < wide.max_bytes < 4194304
    wide.refused_as_too_large("Internal error", 2_000_000)  # no limit named: half the largest in flight
    assert wide.max_bytes == 1_000_000


async def test_reaping_the_ack_reader_never_swallows_the_mirrors_own_cancellation() -> None:
    reaping = asyncio.Event()

    async def slow_to_stop() -> None:  # an ack reader still finishing a commit when it is cancelled
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            reaping.set()
            await asyncio.sleep(0.5)
            raise

    async def mirror_loop() -> str:
        reader = asyncio.create_task(slow_to_stop())
        await asyncio.sleep(0)
        reader.cancel()
        await mirror_module._reap(reader)
        return "went on"  # what suppressing BaseException did: the loop carried on, cancelled or not

    loop_task = asyncio.create_task(mirror_loop())
    await reaping.wait()
    loop_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop_task


def test_outcome_events_in_a_batch_are_halved_and_cut_with_its_records_and_counted_apart() -> None:
    events = [
        feedback_pb2.FeedbackEvent(
            model="affine", request_id=f"call-{i}", metric="click", value=1.0
        ).SerializeToString()
        for i in range(4)
    ]
    batch = frame(call_records(2), events)
    cutter = BatchCutter(1 << 20)
    assert cutter.parts(batch) == [(batch, 2, 4)]
    cutter.halve(batch)
    halves = cutter.parts(batch)
    assert [(r, e) for _, r, e in halves] == [(2, 1), (0, 3)]
    small = BatchCutter(4096)
    parts = small.parts(frame(call_records(3, 1000), events))
    assert sum(r for _, r, _ in parts) == 3
    assert sum(e for _, _, e in parts) == 4
    assert all(len(part) + BATCH_OVERHEAD <= 4096 for part, _, _ in parts)
    assert [
        feedback_pb2.FeedbackEvent.FromString(raw).request_id
        for part, _, _ in parts
        for raw in recorder_pb2.EncodedRecordBatch.FromString(part).feedback
    ] == [f"call-{i}" for i in range(4)]
