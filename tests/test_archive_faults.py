"""Faults of splitstream-archive found from outside (SIGKILL at the worst moments): no process it started outlives
it. Real processes throughout: the archiver, its builder, redis-server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import wait_for
from tests.redis_server import RedisServer
from tests.test_archive import redis_server, start_archiver

__all__ = ["redis_server"]  # the fixture, used by name


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children...), from /proc's children lists."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except FileNotFoundError:
            continue
        for child in map(int, children):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie's parent has not reaped it yet: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def importing_pyarrow(pid: int) -> bool:
    try:
        return "libarrow" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


@pytest.fixture
def reap_left() -> Iterator[set[int]]:
    """Pids a test saw under an archiver: any still running at the end (the fault) are killed, not left."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        if running(pid):
            os.kill(pid, 9)


@pytest.mark.parametrize("round_", range(3))
def test_an_archiver_killed_while_its_builder_starts_leaves_no_process_behind(
    tmp_path: Path, redis_server: RedisServer, reap_left: set[int], round_: int
) -> None:
    """The archiver is SIGKILLed the moment its builder child exists (it is still importing: about 1.4 s here):
    the builder, and anything else the archiver started, is gone soon after, not left running under pid 1."""
    url = (tmp_path / "archive").as_uri()
    archiver = start_archiver(tmp_path, redis_server.url, url, "--builder", "process", wait=False)
    assert archiver.process is not None
    parent = archiver.process.pid
    try:
        # The builder is under way once a process below the archiver loads pyarrow (its imports, about a second
        # here): it has its start-up data by then and has not yet begun to watch its parent.
        def builder_started() -> set[int]:
            below = descendants(parent)
            return below if any(importing_pyarrow(pid) for pid in below) else set()

        started = wait_for(builder_started, timeout_s=60, interval_s=0.005, what="the builder to start")
    finally:
        archiver.kill()
    left = started | descendants(parent)
    reap_left.update(left)
    lines = {pid: command_line(pid) for pid in left}
    wait_for(
        lambda: not any(running(pid) for pid in left),
        timeout_s=15,
        what=f"the archiver's processes to exit: {lines}",
    )
    assert "leaked semaphore" not in archiver.log()
