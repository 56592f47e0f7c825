"""The router's log on a full disk while the recorder is down (the log is the spool: nothing else is written),
on real router, worker, shipper, recorder and redis-server processes, on a real 1 MiB tmpfs (the probe that found
the faults)."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import pytest
from redis.asyncio import Redis

from splitstream.common.records import decode_entry, read_entries
from tests.harness import InferClient, metric_samples, scrape_metrics, wait_for
from tests.recording_stack import MODEL, RecordingStack
from tests.test_recording_faults import UNBATCHED, call, mirror_metric
from tests.tmpfs import small_tmpfs

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow


def times_recorded(stack: RecordingStack) -> collections.Counter[str]:
    """How many entries each request id has in the stream: not de-duplicated, as readers would."""

    async def read() -> collections.Counter[str]:
        client = Redis.from_url(stack.redis.url)
        try:
            return collections.Counter([decode_entry(e).record.request_id async for e in read_entries(client, MODEL)])
        finally:
            await client.aclose()

    return asyncio.run(read())


def log_errors(stack: RecordingStack) -> float:
    """Calls the router answered but could not log (the disk refused the append)."""
    samples = metric_samples(scrape_metrics(stack.router.metrics_port), "splitstream_router_log_records_dropped_total")
    return sum(value for labels, value in samples if labels.get("reason") == "log_error")


def logged(stack: RecordingStack) -> float:
    """Calls the router appended to its log."""
    samples = metric_samples(scrape_metrics(stack.router.metrics_port), "splitstream_router_log_appended_total")
    return sum(value for labels, value in samples if labels.get("kind") == "call")


def dropped(stack: RecordingStack) -> dict[str, float]:
    samples = metric_samples(scrape_metrics(stack.shipper_metrics_port), "splitstream_shipper_records_dropped_total")
    return {labels["reason"]: value for labels, value in samples if value and "reason" in labels}


def test_calls_logged_onto_a_full_disk_arrive_exactly_once_across_restarts_and_are_counted_once(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "spool", "1m"):
        stack = RecordingStack(tmp_path, versions={"v1": {"scale": 2.0, "config": UNBATCHED}})
        try:
            stack.recorder.kill()
            client = InferClient(stack.router.address)
            ids: list[str] = []
            # 32 rows of 4 floats in and out: entries of about 1 KiB in the log, so the 1 MiB disk fills within
            # ~1000 calls.
            while log_errors(stack) == 0:
                assert len(ids) < 5000, "the log never filled its disk"
                ids.append(f"call-{len(ids):05d}")
                call(client, ids[-1], rows=32)
            for _ in range(20):  # more calls on the full disk, each answered, dropped and counted
                ids.append(f"call-{len(ids):05d}")
                call(client, ids[-1], rows=32)
            client.close()
            wait_for(
                lambda: logged(stack) + log_errors(stack) == len(ids),
                timeout_s=30,
                what="every call to be logged or dropped",
            )
            spooled = logged(stack)
            assert dropped(stack) == {}
            assert log_errors(stack) >= 20
            stack.router.stop()  # SIGTERM: the cursors are written at shutdown

            stack.restart_recorder()
            stack.router = stack.start_router()
            wait_for(lambda: sum(times_recorded(stack).values()) >= spooled, timeout_s=60, what="the log in Redis")
            wait_for(lambda: mirror_metric(stack, "log_pending_bytes") == 0, timeout_s=30, what="the cursor to move")
            assert dropped(stack) == {}  # none counted a second time (as spool_corrupt)
            assert mirror_metric(stack, "log_damaged_total") == 0  # no torn entry was left
            stack.router.stop()

            # A second restart: the cursors written on the full disk say everything was delivered.
            stack.router = stack.start_router()
            # (Read once the new shipper serves its metrics: its spool's size is known from its start.)
            assert wait_for(lambda: mirror_metric(stack, "log_pending_bytes") == 0, timeout_s=30, what="the shipper up")
            client = InferClient(stack.router.address)
            call(client, "after-restarts")  # recorded after anything the spool would resend
            client.close()
            stack.wait_recorded({"after-restarts"})
            recorded = times_recorded(stack)
            repeated = {rid: n for rid, n in recorded.items() if n > 1}
            assert repeated == {}, f"{len(repeated)} records stored more than once"
            assert len(set(recorded) & set(ids)) == spooled
            assert set(recorded) - set(ids) == {"after-restarts"}
            assert dropped(stack) == {}
            assert "cursor not written" not in stack.router.log()
        finally:
            stack.close()
