"""Faults of splitstream-archive found from outside (SIGKILL at the worst moments): no process it started outlives
it, and no temporary file or unfinished upload a crashed write left stays in the archive. Real processes
throughout: the archiver, its builder, redis-server, a moto S3 server, the files."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
import pytest

from splitstream.common.archive import CALLS, ArchiveQuery, file_name, open_archive, partition_dir, read_calls
from splitstream.common.records import ARCHIVE_GROUP, archive_group_key, entry_fields, stream_key
from tests import launcher
from tests.harness import wait_for
from tests.redis_server import RedisServer
from tests.s3_server import S3_ENV, S3Server
from tests.test_archive import (
    SYNTHETIC,
    alive,
    archived_everything,
    local_archive,
    metric,
    raw_rows,
    running_archiver,
    start_archiver,
    synthetic_record,
    write_synthetic,
)
from tests.tmpfs import small_tmpfs


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
        if alive(pid):
            os.kill(pid, 9)


@pytest.mark.parametrize("round_", range(3))
def test_an_archiver_killed_while_its_builder_starts_leaves_no_process_behind(
    tmp_path: Path, redis_server: RedisServer, reap_left: set[int], round_: int
) -> None:
    """The archiver is SIGKILLed the moment its builder child exists (it is still importing: about 1.4 s here):
    the builder, and anything else the archiver started, is gone soon after, not left running under pid 1."""
    archiver = start_archiver(tmp_path, redis_server.url, local_archive(tmp_path), "--builder", "process", wait=False)
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
        lambda: not any(alive(pid) for pid in left),
        timeout_s=15,
        what=f"the archiver's processes to exit: {lines}",
    )
    assert "leaked semaphore" not in archiver.log()


@pytest.mark.slow
def test_a_temporary_file_a_crashed_write_left_is_removed_at_start_and_a_fresh_one_kept(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A write killed mid-file leaves its hidden temporary file; the next archiver removes it once it is older
    than --claim-idle-s (its writer is dead by then: its entries were claimed), and keeps a newer one (another
    live archiver's write in progress)."""
    client = redis_server.client()
    archive = tmp_path / "archive"
    partition = archive / "calls" / f"model={SYNTHETIC}" / "date=2026-12-01" / "hour=07"
    partition.mkdir(parents=True)
    stale = partition / f".1764572400000-0_1764572400999-0.parquet.{uuid.uuid4().hex}.tmp"
    fresh = partition / f".1764572401000-0_1764572401999-0.parquet.{uuid.uuid4().hex}.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"PAR1" + b"\0" * 1000)  # half a file
    old = time.time() - 3600
    os.utime(stale, (old, old))
    with running_archiver(tmp_path, redis_server.url, "--claim-idle-s", "60") as archiver:
        wait_for(lambda: not stale.exists(), timeout_s=30, what="the stale temporary file to be removed")
        ids = write_synthetic(client, 0, 50, start_ns=time.time_ns())
        wait_for(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="the calls")
    assert fresh.exists()
    assert sorted(raw_rows(archive.as_uri())["request_id"].to_pylist()) == sorted(ids)
    assert "removed temporary files and uploads that crashed writes left" in archiver.log()


@pytest.mark.slow
def test_an_unfinished_multipart_upload_a_crashed_write_left_is_aborted_at_start(
    tmp_path: Path, redis_server: RedisServer, s3: S3Server
) -> None:
    """On S3 a write killed mid-upload leaves an open multipart upload (its parts kept, and billed, for ever);
    the next archiver aborts those under its archive's prefix older than --claim-idle-s, and no other."""
    store = boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        region_name=S3_ENV["AWS_REGION"],
        aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
    )
    key = f"crash/calls/model={SYNTHETIC}/date=2026-12-01/hour=07/1764572400000-0_1764572400999-0.parquet"
    upload = store.create_multipart_upload(Bucket="archive", Key=key)["UploadId"]
    store.upload_part(Bucket="archive", Key=key, UploadId=upload, PartNumber=1, Body=b"PAR1" + b"\0" * 1000)
    elsewhere = store.create_multipart_upload(Bucket="archive", Key="other/file.parquet")["UploadId"]
    created = time.monotonic()

    def open_uploads() -> set[str]:
        return {u["UploadId"] for u in store.list_multipart_uploads(Bucket="archive").get("Uploads", [])}

    assert open_uploads() == {upload, elsewhere}
    # moto stamps an upload with the time it was made, so the bound is made short rather than the upload old.
    args = ("--s3-endpoint", s3.endpoint, "--flush-interval-s", "0.1", "--claim-idle-s", "0.5")
    wait_for(lambda: time.monotonic() - created > 1.0, timeout_s=5, what="the upload to be past --claim-idle-s")
    with running_archiver(tmp_path, redis_server.url, *args, archive="s3://archive/crash"):
        wait_for(lambda: upload not in open_uploads(), timeout_s=30, what="the stale upload to be aborted")
    assert open_uploads() == {elsewhere}  # not under the archive's prefix: not the archiver's to abort


def test_an_archiver_refused_by_its_consumer_group_removes_nothing_from_the_archive_it_was_given(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The group names the archive it writes to; an archiver given another archive exits 2 before it touches
    that one: its temporary files are another group's (or another deployment's) business."""
    client = redis_server.client()
    client.set(archive_group_key(ARCHIVE_GROUP), "local:/somewhere/else")
    archive = tmp_path / "archive"
    partition = archive / "calls" / f"model={SYNTHETIC}" / "date=2026-12-01" / "hour=07"
    partition.mkdir(parents=True)
    stale = partition / f".1764572400000-0_1764572400999-0.parquet.{uuid.uuid4().hex}.tmp"
    stale.write_bytes(b"PAR1")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    archiver = start_archiver(tmp_path, redis_server.url, archive.as_uri(), wait=False)
    assert archiver.wait(timeout_s=60) == 2, archiver.log()
    assert stale.exists()


@pytest.mark.slow
def test_what_the_builder_process_prints_on_stdout_does_not_break_its_answers(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The builder answers on a pipe of its own: a line on its stdout (here from a ``sitecustomize`` that prints as
    the interpreter starts, as a library's print or a start-up hook would) goes to the log, and every call is
    archived. Its answers used to share stdout, and such a line was read as the length of an answer."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text("print('a line a start-up hook printed on stdout', flush=True)\n")
    path = os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH", "")]))
    client = redis_server.client()
    ids = write_synthetic(client, 0, 50, start_ns=time.time_ns())
    with running_archiver(tmp_path, redis_server.url, "--builder", "process", env={"PYTHONPATH": path}) as archiver:
        wait_for(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="the calls")
        assert metric(archiver, "splitstream_archive_upload_errors_total") == 0
    assert sorted(raw_rows(local_archive(tmp_path))["request_id"].to_pylist()) == sorted(ids)
    assert archiver.log().count("a line a start-up hook printed on stdout") >= 2  # the archiver's and its builder's


def temporary_files(root: Path) -> list[Path]:
    return [Path(directory, name) for directory, _, names in os.walk(root) for name in names if name.endswith(".tmp")]


@pytest.mark.slow
def test_a_local_write_that_fails_after_its_temporary_file_leaves_none_behind(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The file's final name is taken by a directory, so each write fails at its rename, its temporary file whole:
    the failed write removes it (retried writes used to leave one each, until the next archiver's start), and once
    the name is free the call is archived."""
    client = redis_server.client()
    receive_ns = time.time_ns()
    record = synthetic_record(0, receive_ns)
    added = client.xadd(stream_key(SYNTHETIC), entry_fields(record))
    stream_id = added.decode() if isinstance(added, bytes) else str(added)
    partition = tmp_path / "archive" / partition_dir(CALLS, SYNTHETIC, receive_ns)
    taken = partition / file_name(stream_id, stream_id)
    taken.mkdir(parents=True)
    with running_archiver(tmp_path, redis_server.url) as archiver:
        wait_for(
            lambda: metric(archiver, "splitstream_archive_upload_errors_total") >= 3, timeout_s=60, what="failed writes"
        )
        assert temporary_files(tmp_path / "archive") == []
        taken.rmdir()
        wait_for(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="the call")
    assert raw_rows(local_archive(tmp_path))["request_id"].to_pylist() == [record.request_id]
    assert temporary_files(tmp_path / "archive") == []


@pytest.mark.slow
def test_a_local_write_that_fills_the_disk_leaves_no_temporary_file(tmp_path: Path, redis_server: RedisServer) -> None:
    """A disk that fills mid-file (a 64 KiB tmpfs, calls of incompressible payloads): each failed write removes its
    partial temporary file, rather than leave the little room there was taken by it. Needs root (mount)."""
    client = redis_server.client()
    pipe = client.pipeline(transaction=False)
    for i in range(20):
        record = synthetic_record(i, time.time_ns())
        record.request.inline = os.urandom(8 * 1024)
        pipe.xadd(stream_key(SYNTHETIC), entry_fields(record))
    pipe.execute()
    with small_tmpfs(tmp_path / "archive", "64k") as archive, running_archiver(tmp_path, redis_server.url) as archiver:
        wait_for(
            lambda: metric(archiver, "splitstream_archive_upload_errors_total") >= 3,
            timeout_s=60,
            what="writes failing on the full disk",
        )
        assert temporary_files(archive) == []
        assert not archived_everything(client, stream_key(SYNTHETIC))


def test_a_stream_whose_name_is_not_utf8_is_skipped_once_and_every_other_stream_archived(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Redis keys are bytes: a call stream named with bytes that are not UTF-8 (written by hand, or by another
    program) names no model. It is skipped, logged once and counted; the archiver used to die at the name
    (a UnicodeDecodeError out of its scan), so no stream was archived."""
    client = redis_server.client()
    odd = stream_key("odd").encode() + b"\xff\xfe"
    client.xadd(odd, entry_fields(synthetic_record(0, time.time_ns())))
    ids = write_synthetic(client, 0, 50, start_ns=time.time_ns())
    with running_archiver(tmp_path, redis_server.url) as archiver:
        wait_for(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="the good stream")
        wait_for(lambda: metric(archiver, "splitstream_archive_skipped_streams_total") == 1, timeout_s=10)
        # The scan runs every 0.3 s: the ones while more calls are archived must not count the stream again.
        more = write_synthetic(client, 50, 10, start_ns=time.time_ns())
        wait_for(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="more calls")
        assert metric(archiver, "splitstream_archive_skipped_streams_total") == 1
        assert archiver.process is not None
        assert archiver.process.poll() is None
    assert sorted(raw_rows(local_archive(tmp_path))["request_id"].to_pylist()) == sorted(ids + more)
    skipped = [line for line in archiver.log().splitlines() if "not UTF-8" in line]
    assert len(skipped) == 1
    assert "odd\\\\xff\\\\xfe" in skipped[0]  # escaped: the line is JSON, and says which bytes
    assert "Traceback" not in archiver.log()
    assert client.xlen(odd) == 1  # left as it is


def test_stream_names_with_control_characters_are_archived_under_escaped_paths_and_logged_safely(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Model names from stream names may hold any character: every directory the archive gets is printable
    (control characters, DEL, C1 controls and line separators percent-encoded), every log line is one JSON
    object, and each model's calls read back under its own name."""
    client = redis_server.client()
    models = ["a\nb", "tab\there", "del\x7f", "esc\x1b[31mred", "c1\x85next", "line\u2028sep", "bidi\u202eevil"]
    ids: dict[str, list[str]] = {}
    for index, model in enumerate(models):
        records = [synthetic_record(index * 10 + i, time.time_ns()) for i in range(3)]
        for record in records:
            record.model = model
            client.xadd(stream_key(model), entry_fields(record))
        ids[model] = [record.request_id for record in records]
    with running_archiver(tmp_path, redis_server.url, "--log-level", "DEBUG") as archiver:
        for model in models:
            wait_for(lambda m=model: archived_everything(client, stream_key(m)), timeout_s=60, what=repr(model))
    archive = open_archive(local_archive(tmp_path))
    for model in models:
        table = read_calls(archive, ArchiveQuery(model=model, since_ns=0, until_ns=time.time_ns() + 3600 * 10**9))
        assert sorted(table["request_id"].to_pylist()) == ids[model]
    for _, names, files in os.walk(tmp_path / "archive"):
        for name in [*names, *files]:
            assert name.isprintable(), repr(name)
    for line in archiver.log().splitlines():
        if line.strip():
            json.loads(line)
            assert line.isprintable(), repr(line)
    assert "Traceback" not in archiver.log()


@contextmanager
def unremovable(path: Path) -> Iterator[None]:
    """``path`` made impossible to remove: immutable (``chattr +i``) for root, which ignores permissions, else its
    directory read-only. Skips the test where neither works."""
    if os.geteuid() == 0:
        made = launcher.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot make a file immutable here: {made.stderr.strip()[:200]}")
        try:
            yield
        finally:
            launcher.run(["chattr", "-i", str(path)], check=False)
        return
    mode = path.parent.stat().st_mode
    path.parent.chmod(0o555)
    try:
        yield
    finally:
        path.parent.chmod(mode)


@pytest.mark.slow
def test_a_stale_temporary_file_that_cannot_be_removed_is_logged_and_the_others_are_removed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """At start, a crashed write's temporary file that cannot be removed (permissions, an immutable file) is
    logged by name and left; the cleanup goes on to the others (the calls' files are cleaned before the
    feedback's, so it used to stop at the first and leave all of these) and the archiver archives."""
    client = redis_server.client()
    archive = tmp_path / "archive"
    stuck_dir = archive / "calls" / f"model={SYNTHETIC}" / "date=2026-12-01" / "hour=07"
    stuck_dir.mkdir(parents=True)
    stuck = stuck_dir / f".1764572400000-0_1764572400999-0.parquet.{uuid.uuid4().hex}.tmp"
    others = []
    for hour in ("07", "08"):
        directory = archive / "feedback" / f"model={SYNTHETIC}" / "date=2026-12-01" / f"hour={hour}"
        directory.mkdir(parents=True)
        others.append(directory / f".1764572400000-0_1764572400999-0.parquet.{uuid.uuid4().hex}.tmp")
    old = time.time() - 3600
    for path in (stuck, *others):
        path.write_bytes(b"PAR1")
        os.utime(path, (old, old))
    with unremovable(stuck):
        with running_archiver(tmp_path, redis_server.url, "--claim-idle-s", "60") as archiver:
            wait_for(lambda: not any(path.exists() for path in others), timeout_s=30, what="the others removed")
            ids = write_synthetic(client, 0, 50, start_ns=time.time_ns())
            wait_for(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="the calls")
        assert stuck.exists()
    log = archiver.log()
    assert stuck.name in log
    assert sorted(raw_rows(archive.as_uri())["request_id"].to_pylist()) == sorted(ids)
