"""The router's record mirror, in process: how batches are built from queued calls."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.router import mirror as mirror_module
from splitstream.router.core import CallOutcome
from splitstream.router.mirror import MirrorSettings, RecordMirror
from splitstream.router.spool import Spool


def mirror_with_calls(tmp_path: Path, calls: int) -> RecordMirror:
    settings = MirrorSettings(recorder_address="127.0.0.1:1", router_id="router-a", hmac_key=b"key")
    mirror = RecordMirror(settings, Spool(tmp_path, max_bytes=1 << 20), CollectorRegistry())
    for index in range(calls):
        outcome = CallOutcome(
            request_id=f"call-{index}",
            model="affine",
            code=grpc.StatusCode.OK,
            details="",
            response=b"response-%d" % index,
            version="v1",
            receive_unix_ns=time.time_ns(),
        )
        mirror.offer(outcome, b"request-%d" % index, (("x-tenant", "t1"),))
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
    assert mirror_module._count_records(batches[2]) == 88


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
