"""``splitstream-archive --processes N``: N archivers under one supervising parent, each its own consumer
in the group. Real processes throughout: the parent, its children, redis-server, the Parquet files."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from splitstream.common.archive import ArchiveQuery, open_archive, read_calls
from splitstream.common.records import ARCHIVE_GROUP, stream_key
from tests import launcher
from tests.harness import ROOT
from tests.harness import wait_for as wait_until
from tests.redis_server import RedisServer
from tests.test_archive import (
    HOUR_NS,
    SYNTHETIC,
    SyntheticLoad,
    archive_all,
    archived_everything,
    local_archive,
    metric,
    raw_rows,
    running_archiver,
    write_synthetic,
)
from tests.test_processes import alive, child_pids


def consumers(client: object, stream: str) -> set[str]:
    """The consumers ``XINFO CONSUMERS`` lists in the archive group."""
    rows = client.xinfo_consumers(stream, ARCHIVE_GROUP)  # type: ignore[attr-defined]
    return {row["name"].decode() if isinstance(row["name"], bytes) else row["name"] for row in rows}


def archived_ids(url: str) -> list[str]:
    """Request ids as a reader sees them (de-duplicated by request id)."""
    table = read_calls(open_archive(url), ArchiveQuery(model=SYNTHETIC, since_ns=0, until_ns=time.time_ns() + HOUR_NS))
    return list(table["request_id"].to_pylist())


@pytest.mark.slow
def test_two_processes_archive_every_call_once_as_two_consumers_and_sigterm_leaves_no_child(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    url = local_archive(tmp_path)
    with running_archiver(tmp_path, redis_server.url, "--processes", "2", "--read-count", "25") as archiver:
        ids: list[str] = []

        def both_children_read() -> bool:
            """Calls go on (2,000 at least) until each child has read: the parent serves once one child does,
            and on a loaded machine the other starts a second later, by which time the first could have
            archived every call alone."""
            ids.extend(write_synthetic(client, len(ids), 100, start_ns=time.time_ns()))
            return len(ids) >= 2000 and consumers(client, stream_key(SYNTHETIC)) == {"a-0", "a-1"}

        wait_until(both_children_read, timeout_s=60, interval_s=0.02, what="both children to read")
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=90, what="two children")
        # One scrape of the parent: the children's counts added up.
        wait_until(lambda: metric(archiver, "splitstream_archive_records_total") == len(ids), timeout_s=30)
        pids = set(child_pids(archiver).values())
        assert len(pids) == 2
        archiver.signal(signal.SIGTERM)
        assert archiver.wait(timeout_s=60) == 0
        wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s=10, what="the children to be gone")
    archived = archived_ids(url)
    assert len(archived) == len(set(archived)) == len(ids)
    assert set(archived) == set(ids)


@pytest.mark.slow
def test_a_child_killed_under_load_is_restarted_as_the_same_consumer_and_nothing_is_missing(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    stream = stream_key(SYNTHETIC)
    url = local_archive(tmp_path)
    with (
        SyntheticLoad(redis_server) as load,
        running_archiver(tmp_path, redis_server.url, "--processes", "2", "--max-file-rows", "400") as archiver,
    ):
        wait_until(lambda: metric(archiver, "splitstream_archive_files_total") >= 3, timeout_s=60, what="some files")
        wait_until(lambda: len(child_pids(archiver)) == 2, timeout_s=30, what="both children")
        # Both are consumers before one is killed (on a loaded machine child 0 may start when child 1 has read
        # everything so far), so a restart under another name would show as a third.
        wait_until(lambda: consumers(client, stream) == {"a-0", "a-1"}, timeout_s=60, what="both children to read")
        victim = child_pids(archiver)[0]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: child_pids(archiver)[0] != victim, timeout_s=30, what="child 0 restarted")
        time.sleep(1.0)
        load.stop()
        wait_until(lambda: archived_everything(client, stream), timeout_s=90, what="the restarted child")
        assert consumers(client, stream) == {"a-0", "a-1"}  # the restart resumed as a-0, no new name
        assert metric(archiver, "splitstream_archiver_process_restarts_total") == 1
    assert client.xpending(stream, ARCHIVE_GROUP)["pending"] == 0
    archived = archived_ids(url)
    assert len(archived) == len(set(archived))
    assert set(archived) == set(load.written), f"missing {len(set(load.written) - set(archived))}"
    assert set(raw_rows(url)["request_id"].to_pylist()) == set(load.written)


def acknowledged_but_not_archived(client: object, stream: str, url: str) -> set[str]:
    """Stream ids the group has acknowledged (delivered, no longer pending) that no archive file holds."""
    group = next(g for g in client.xinfo_groups(stream) if g["name"] in (ARCHIVE_GROUP, ARCHIVE_GROUP.encode()))  # type: ignore[attr-defined]
    delivered = [raw_id.decode() for raw_id, _ in client.xrange(stream, max=group["last-delivered-id"])]  # type: ignore[attr-defined]
    pending = client.xpending_range(stream, ARCHIVE_GROUP, min="-", max="+", count=len(delivered) + 1)  # type: ignore[attr-defined]
    held = {row["message_id"].decode() for row in pending}
    archived = (
        set(raw_rows(url, columns=["stream_id"])["stream_id"].to_pylist()) if len(delivered) > len(held) else set()
    )
    return {stream_id for stream_id in delivered if stream_id not in held} - archived


@pytest.mark.slow
def test_sigterm_under_load_with_two_processes_and_builder_processes_exits_0_having_acked_only_what_is_written(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """SIGTERM to ``--processes 2 --builder process`` (each child with its file-building process), six
    times: five while calls stream in, once just after they stopped (every entry delivered, both children
    waiting in a blocking XREADGROUP). Each time every child drains and the parent exits 0, and every entry
    the group counts as acknowledged is in a file; a last archiver then leaves nothing missing.

    The fault this catches: on Python 3.11 the cancel a SIGTERM sends the archive loop was lost now and
    then (``asyncio.wait_for``, which redis-py sends each command under, returns the result of a command
    that completes as the cancel arrives), so the loop ran on, the drain never started and the parent
    killed the child at its deadline (here 22 s) and exited 1. A short ``--scan-interval-s`` keeps the loop
    sending commands, so a SIGTERM meets one often (failed in the first round before the fix)."""
    client = redis_server.client()
    stream = stream_key(SYNTHETIC)
    url = local_archive(tmp_path)
    args: tuple[str, ...] = ("--processes", "2", "--builder", "process", "--max-file-rows", "300")
    args += ("--shutdown-grace-s", "2", "--scan-interval-s", "0.01")
    with SyntheticLoad(redis_server) as load:
        for round_ in range(6):
            with running_archiver(tmp_path, redis_server.url, *args) as archiver:
                wait_until(
                    lambda process=archiver: metric(process, "splitstream_archive_files_total") >= 2, timeout_s=60
                )
                if round_ == 5:
                    load.stop()
                    wait_until(lambda: client.xinfo_groups(stream)[0]["lag"] == 0, timeout_s=60, what="all delivered")
                archiver.signal(signal.SIGTERM)
                assert archiver.wait(timeout_s=90) == 0, f"round {round_ + 1}"
            assert not acknowledged_but_not_archived(client, stream, url), f"round {round_ + 1}"
    archive_all(tmp_path, redis_server, stream=stream, timeout_s=90, what="the rest archived")
    archived = archived_ids(url)
    assert len(archived) == len(set(archived))
    assert set(archived) == set(load.written)


@pytest.mark.parametrize("value", ["0", "abc"])
def test_a_bad_processes_value_exits_2_with_one_line(value: str) -> None:
    done = launcher.run(
        [sys.executable, "-m", "splitstream.archiver", "--port", "0", "--processes", value],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--processes" in lines[0]
