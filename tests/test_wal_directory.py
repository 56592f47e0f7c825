"""What an operator (or a stray tool) may leave in a router's log directory, on real router, worker,
shipper, recorder and redis-server processes: files named almost like segments, a directory named like
one, a cursor left behind by segments deleted by hand. Nothing answered may be lost, damage is skipped
and counted, the shipper never stalls."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from splitstream.common import wal
from tests.harness import (
    InferClient,
    free_port,
    make_request,
    metric_samples,
    run_module,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.recording_stack import HMAC_KEY, MODEL, RecordingStack, shipper_metric
from tests.test_wal_recording import _call_payload, start_shipper

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow


def call(stack: RecordingStack, prefix: str, count: int) -> set[str]:
    """``count`` calls through the stack's router, each its own request id; their ids."""
    client = InferClient(stack.router.address)
    ids = set()
    for i in range(count):
        ids.add(f"{prefix}-{i}")
        client.infer(make_request(MODEL, np.ones((1, 4), np.float32)), metadata=[("x-request-id", f"{prefix}-{i}")])
    client.close()
    return ids


def test_a_foreign_file_named_almost_like_a_segment_costs_no_call(tmp_path: Path) -> None:
    """``wal-99.log`` (an operator's copy, a tool's output) was read as segment 99, newer than the router's:
    the shipper moved past the router's segment to it and deleted the segment the router was appending to,
    so every call after it was lost. Only names the router writes are segments."""
    stack = RecordingStack(tmp_path)
    try:
        stack.wait_recorded(call(stack, "before", 5))
        (stack.spool_dir / "wal-99.log").write_bytes(b"not a segment")
        (stack.spool_dir / "wal-0000.log").write_bytes(b"junk")
        stack.wait_recorded(call(stack, "after", 20))
        assert (stack.spool_dir / "wal-99.log").read_bytes() == b"not a segment"  # not ours: left alone
    finally:
        stack.close()


def test_a_directory_or_a_fifo_named_like_a_segment_is_left_alone_and_the_rest_shipped(tmp_path: Path) -> None:
    """Reading a directory named like a segment failed on every try (a FIFO blocked the reading thread for good):
    the shipper stalled there, the log filled up to its cap and the router dropped calls. Neither is a segment:
    both are left alone and the segments around them shipped and deleted."""
    stack = RecordingStack(tmp_path, router_args=("--shipper", "external"))
    try:
        log_dir = tmp_path / "hand-log"
        log_dir.mkdir()
        (log_dir / wal.segment_name(1)).write_bytes(wal.frame(wal.CALL, _call_payload("hand-1")))
        (log_dir / wal.segment_name(2)).mkdir()
        os.mkfifo(log_dir / wal.segment_name(3))
        (log_dir / wal.segment_name(4)).write_bytes(wal.frame(wal.CALL, _call_payload("hand-4")))
        (log_dir / wal.segment_name(5)).write_bytes(wal.frame(wal.CALL, _call_payload("hand-5")))
        start_shipper(stack, log_dir, metrics_port=free_port())
        stack.wait_recorded({"hand-1", "hand-4", "hand-5"})
        wait_for(
            lambda: not (log_dir / wal.segment_name(4)).exists(),
            timeout_s=10,
            what="the shipped segments before the newest to be deleted",
        )
        assert not (log_dir / wal.segment_name(1)).exists()
        assert (log_dir / wal.segment_name(2)).is_dir()
        assert stat.S_ISFIFO((log_dir / wal.segment_name(3)).stat().st_mode)
    finally:
        stack.close()


def test_calls_after_the_segments_were_deleted_by_hand_are_all_shipped(tmp_path: Path) -> None:
    """An operator freeing disk removed the stopped router's segments and left ``wal.cursor``: the restarted
    router numbered its new segment from 1 again, so the shipper read it from the old cursor's offset and
    skipped (as damage) every call before it. A new segment is numbered past the cursor's."""
    stack = RecordingStack(tmp_path)
    try:
        stack.wait_recorded(call(stack, "before", 20))
        wait_for(lambda: wal.read_cursor(stack.spool_dir), timeout_s=10, what="the cursor to be written")
        stack.router.stop()
        for segment in stack.spool_dir.glob("wal-*.log"):
            segment.unlink()
        stack.router = stack.start_router()
        stack.wait_recorded(call(stack, "after", 20))
        assert shipper_metric(stack, "log_damaged_total", reason="damaged") == 0
    finally:
        stack.close()


def test_a_foreign_file_named_almost_like_an_old_spool_segment_costs_no_call(tmp_path: Path) -> None:
    """``1.seg`` (or a directory ``00000001.seg``) in the log directory, which an old router's spool shares, was
    taken for the old spool's segment ``00000001.seg``: the shipper failed to start on it and, as a router's
    child, was restarted for ever while nothing was shipped."""
    stack = RecordingStack(tmp_path)
    try:
        stack.wait_recorded(call(stack, "before", 5))
        stack.router.stop()
        (stack.spool_dir / "1.seg").write_bytes(b"not a spool segment")
        (stack.spool_dir / "00000002.seg").mkdir()
        stack.router = stack.start_router()
        stack.wait_recorded(call(stack, "after", 20))
        assert (stack.spool_dir / "1.seg").read_bytes() == b"not a spool segment"
    finally:
        stack.close()


def test_a_second_router_on_the_same_log_directory_exits_2_and_the_first_loses_no_call(tmp_path: Path) -> None:
    """Two routers given one ``--log-dir`` (the default, for two routers started in one directory) each
    appended to a segment of their own; the shipper read the first router's as finished and deleted it, and
    every call that router answered afterwards was lost. The second router is refused."""
    stack = RecordingStack(tmp_path)
    try:
        stack.wait_recorded(call(stack, "before", 5))
        registry = tmp_path / "registry-2.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": ["127.0.0.1:1"]}}})
        second = run_module(
            "splitstream.router", "--registry", f"file:{registry}", "--port", "0", "--metrics-port", "0",
            "--recorder", f"127.0.0.1:{stack.recorder_port}", "--hmac-key", HMAC_KEY,
            "--log-dir", str(stack.spool_dir),
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert stack.router.process is not None
        assert second.stderr.strip().splitlines()[-1] == (
            f"splitstream-router: error: --log-dir {stack.spool_dir}: in use by another router "
            f"(pid {stack.router.process.pid}): give each router its own"
        )
        stack.wait_recorded(call(stack, "after", 20))
    finally:
        stack.close()


def test_damage_at_the_end_of_a_read_chunk_costs_only_the_damaged_entry(tmp_path: Path) -> None:
    """The reader looked for the next entry after a damaged one only in the 4 MiB it had read: damage near the end
    of that chunk in a finished segment counted everything after it as a torn tail, and those calls were lost."""
    stack = RecordingStack(tmp_path, router_args=("--shipper", "external"))
    try:
        log_dir = tmp_path / "hand-log"
        writer = wal.WalWriter(log_dir, max_bytes=1 << 30, segment_bytes=1 << 30)
        starts = []
        for i in range(600):  # about 10 KiB each: 6 MiB, past the reader's first 4 MiB read
            starts.append(wal.log_bytes(log_dir))
            assert writer.append(wal.CALL, _call_payload(f"chunk-{i}", request=bytes(10_000)))
        writer.close()
        damaged = max(i for i, start in enumerate(starts) if start < 4 << 20)  # the entry across 4 MiB
        segment = log_dir / wal.segment_name(1)
        data = bytearray(segment.read_bytes())
        data[starts[damaged]] ^= 0xFF  # its magic
        segment.write_bytes(bytes(data))
        writer = wal.WalWriter(log_dir, max_bytes=1 << 30, segment_bytes=1 << 30)  # a restarted router
        assert writer.append(wal.CALL, _call_payload("chunk-after"))
        writer.close()
        start_shipper(stack, log_dir, metrics_port=free_port())
        expected = {f"chunk-{i}" for i in range(600)} - {f"chunk-{damaged}"} | {"chunk-after"}
        records = stack.wait_recorded(expected, timeout_s=60)
        assert f"chunk-{damaged}" not in {r.request_id for r in records}
    finally:
        stack.close()


def test_a_segment_copied_in_numbered_above_the_live_one_costs_no_call_and_is_shipped(tmp_path: Path) -> None:
    """A correctly named segment numbered above the router's (an operator copying a stopped router's segment in to
    have it shipped) made the shipper take the router's segment for finished: it read on into the copy, then
    deleted the segment the router was still appending to, and every call after that was lost. A segment is
    finished once its router lets go of it; the copy is shipped after the router moves past it."""
    stack = RecordingStack(tmp_path)
    try:
        stack.wait_recorded(call(stack, "before", 5))
        (live,) = wal.segments(stack.spool_dir)
        copied = stack.spool_dir / wal.segment_name(live + 98)
        copied.write_bytes(wal.frame(wal.CALL, _call_payload("copied-1")))
        stack.wait_recorded(call(stack, "after", 20))
        assert (stack.spool_dir / wal.segment_name(live)).exists()
        stack.router.stop()
        stack.router = stack.start_router()  # a new router numbers its segment past the copy: the copy is finished
        stack.wait_recorded({"copied-1"} | call(stack, "restarted", 5))
        wait_for(lambda: not copied.exists(), timeout_s=10, what="the shipped copy to be deleted")
    finally:
        stack.close()


def test_a_router_restarted_with_another_spool_dir_says_the_old_log_holds_unshipped_calls(tmp_path: Path) -> None:
    """Calls logged while the recorder was away stayed in the old ``--log-dir`` once the router was restarted with
    another: nothing shipped them and nothing said so. The router names the stranded log (log line, metric); an
    external shipper given it ships every call."""
    stack = RecordingStack(tmp_path)
    try:
        stack.wait_recorded(call(stack, "before", 5))
        stack.recorder.stop()
        stranded = call(stack, "stranded", 10)
        old = stack.spool_dir
        stack.router.stop()
        stack.spool_dir = tmp_path / "spool-b"
        stack.router = stack.start_router()
        warnings = [line for line in stack.router.log().splitlines() if "holds unshipped calls" in line]
        assert warnings, stack.router.log()[-3000:]
        assert str(old) in warnings[-1]
        stranded_bytes = metric_samples(
            scrape_metrics(stack.router.metrics_port), "splitstream_router_log_stranded_bytes"
        )
        assert stranded_bytes
        assert stranded_bytes[0][1] > 0
        stack.restart_recorder()
        start_shipper(stack, old, metrics_port=free_port())
        stack.wait_recorded(stranded | call(stack, "after", 5))
    finally:
        stack.close()
