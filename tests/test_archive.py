"""The archive: splitstream-archive writes the streams as Parquet (a directory, or a real S3 API server);
replay and analysis read it back; a crash, a dead archiver or a store outage loses and duplicates nothing."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from redis.asyncio import Redis

from splitstream.common.archive import (
    CALL_SCHEMA,
    ENTRY_COLUMNS,
    ArchiveError,
    ArchiveQuery,
    iter_calls,
    iter_feedback,
    open_archive,
    read_calls,
    read_feedback,
    readable_calls,
    readable_feedback,
    stored_records,
)
from splitstream.common.proto.splitstream.v1 import feedback_pb2, recorder_pb2
from splitstream.common.records import (
    ARCHIVE_GROUP,
    archive_mark_key,
    blob_key,
    entry_fields,
    feedback_entry_fields,
    feedback_key,
    stream_key,
)
from splitstream.replayer.selection import Selection, SelectionStats, select_calls
from tests import launcher
from tests.doc_examples import block as doc_block
from tests.harness import (
    ROOT,
    InferClient,
    ServiceProcess,
    Stack,
    free_port,
    listen_args,
    make_request,
    metric_samples,
    scrape_metrics,
    stop_all,
)
from tests.harness import wait_for as wait_until
from tests.models import add_version
from tests.recording_stack import MODEL, RecordingStack
from tests.redis_server import RedisServer
from tests.s3_server import S3_ENV, S3Server

SYNTHETIC = "synth"
HOUR_NS = 3600 * 10**9


def start_archiver(
    tmp: Path,
    redis_url: str,
    archive: str,
    *extra: str,
    consumer: str = "a",
    wait: bool = True,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    port = free_port()
    args = [
        *listen_args(port),
        "--redis-url",
        redis_url,
        "--archive",
        archive,
        "--consumer",
        consumer,
        "--flush-interval-s",
        "0.3",
        "--claim-idle-s",
        "30",
        "--scan-interval-s",
        "0.3",
        *extra,
    ]
    process = ServiceProcess(
        f"archiver-{consumer}-{port}",
        "splitstream.archiver",
        args,
        log_dir=tmp,
        port=port,
        env={**S3_ENV, **(env or {})},
    )
    return process.start(wait_serving=wait)


def local_archive(tmp_path: Path) -> str:
    """The URL of the test's archive directory, ``tmp_path/archive``."""
    return (tmp_path / "archive").as_uri()


@contextlib.contextmanager
def running_archiver(
    tmp_path: Path,
    redis_url: str,
    *extra: str,
    archive: str = "",
    consumer: str = "a",
    env: dict[str, str] | None = None,
) -> Iterator[ServiceProcess]:
    """An archiver (:func:`start_archiver`) writing to ``archive`` (by default :func:`local_archive`), stopped
    at exit."""
    archiver = start_archiver(
        tmp_path, redis_url, archive or local_archive(tmp_path), *extra, consumer=consumer, env=env
    )
    try:
        yield archiver
    finally:
        archiver.stop()


@contextlib.contextmanager
def running_archivers(
    tmp_path: Path, redis_url: str, *extra: str, consumers: tuple[str, ...] = ("one", "two")
) -> Iterator[list[ServiceProcess]]:
    """Archivers sharing the group (one per consumer name) writing to :func:`local_archive`, all stopped at exit."""
    archivers: list[ServiceProcess] = []
    try:
        for consumer in consumers:
            archivers.append(start_archiver(tmp_path, redis_url, local_archive(tmp_path), *extra, consumer=consumer))
        yield archivers
    finally:
        stop_all(archivers)


def archive_all(
    tmp_path: Path,
    redis_server: RedisServer,
    *extra: str,
    archive: str = "",
    stream: str = "",
    timeout_s: float = 60,
    what: str = "",
) -> str:
    """Run an archiver until ``stream`` (by default the synthetic model's) is archived to its end (within
    ``timeout_s``), stop it, and return the archive's URL (by default :func:`local_archive`)."""
    stream = stream or stream_key(SYNTHETIC)
    archive = archive or local_archive(tmp_path)
    client = redis_server.client()
    try:
        with running_archiver(tmp_path, redis_server.url, *extra, archive=archive):
            wait_until(
                lambda: archived_everything(client, stream), timeout_s=timeout_s, what=what or f"{stream} archived"
            )
    finally:
        client.close()
    return archive


def synthetic_record(i: int, receive_ns: int, *, payload_bytes: int = 40) -> recorder_pb2.CallRecord:
    record = recorder_pb2.CallRecord(
        schema_version=1,
        request_id=f"r-{i}",
        receive_unix_ns=receive_ns,
        model=SYNTHETIC,
        version="v1" if i % 3 else "v2",
        arm="v1" if i % 3 else "v2",
        status_code=0 if i % 5 else 14,
        latency_ns=1_000_000 + i,
        principal=f"tenant-{i % 2}",
    )
    record.tags["team"] = "search"
    record.request.inline = bytes([i % 251]) * payload_bytes
    record.request.size_bytes = payload_bytes
    return record


def write_synthetic(client: Any, first: int, count: int, *, start_ns: int, gap_ns: int = 1_000_000) -> list[str]:
    """XADD ``count`` records as the recorder lays them out, every third request stored as a blob."""
    pipe = client.pipeline(transaction=False)
    ids = []
    for i in range(first, first + count):
        record = synthetic_record(i, start_ns + (i - first) * gap_ns)
        if i % 3 == 0:
            body = record.request.inline
            digest = hashlib.sha256(body).hexdigest()
            pipe.set(blob_key(digest), body)
            record.request.blob_sha256 = digest
        pipe.xadd(stream_key(SYNTHETIC), entry_fields(record))
        ids.append(record.request_id)
    pipe.execute()
    return ids


class SyntheticLoad:
    """Calls written to the synthetic model's stream from a thread (50 every 10 ms) until :meth:`stop`;
    :attr:`written` holds their request ids."""

    def __init__(self, redis_server: RedisServer) -> None:
        self.written: list[str] = []
        self._server = redis_server
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        writer = self._server.client()
        index = 0
        while not self._stopping.is_set():
            self.written.extend(write_synthetic(writer, index, 50, start_ns=time.time_ns()))
            index += 50
            time.sleep(0.01)
        writer.close()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def __enter__(self) -> SyntheticLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def raw_rows(archive_url: str, endpoint: str = "", kind: str = "calls", columns: list[str] | None = None) -> pa.Table:
    """Every row of every file, duplicates included (what a careless reader would see); ``columns``: only
    those (a test that checks ids need not read every payload again)."""
    archive = open_archive(archive_url, endpoint=endpoint)
    base = archive.path(kind)
    try:
        dataset = ds.dataset(base, filesystem=archive.filesystem, format="parquet", partitioning="hive")
        return dataset.to_table(columns=columns)
    except (FileNotFoundError, pa.ArrowInvalid):
        return pa.table({name: pa.array([], pa.string()) for name in columns or ["request_id"]})


def archived_everything(client: Any, stream: str) -> bool:
    """The archive mark is past the stream's last entry: every entry is in a file."""
    last = client.xrevrange(stream, count=1)
    mark = client.get(archive_mark_key(stream))
    if not last or mark is None:
        return False
    last_ms, last_seq = (int(part) for part in last[0][0].decode().split("-"))
    mark_ms, mark_seq = (int(part) for part in mark.decode().split("-"))
    return (mark_ms, mark_seq) > (last_ms, last_seq)


def metric(process: ServiceProcess, name: str) -> float:
    return sum(value for _, value in metric_samples(scrape_metrics(process.metrics_port), name))


@pytest.fixture
def own_s3(tmp_path: Path) -> Iterator[S3Server]:
    """An S3 server of the test's own, with an ``archive`` bucket: for a test that stops or pauses it."""
    server = S3Server(tmp_path / "s3").start()
    server.create_bucket("archive")
    yield server
    server.stop()


# -- end to end: record, archive, replay from both -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("store", ["directory", "s3"])
def test_a_recorded_window_replays_from_the_archive_as_from_redis_even_after_redis_is_flushed(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    stack = RecordingStack(tmp_path, recorder_args=("--blob-threshold-bytes", "16"))  # every payload a blob
    s3: S3Server | None = request.getfixturevalue("s3") if store == "s3" else None
    endpoint_args: tuple[str, ...] = ()
    if s3 is not None:
        url, endpoint_args = "s3://archive/recorded", ("--s3-endpoint", s3.endpoint)
    else:
        url = local_archive(tmp_path)
    try:
        client = InferClient(stack.router.address)
        rng = np.random.default_rng(3)
        since = time.time_ns()
        ids = set()
        for i in range(24):
            request_id = f"call-{i}"
            features = 5 if i % 8 == 7 else 4  # a few bad inputs: recorded failures replay as failures
            with contextlib.suppress(grpc.RpcError):
                client.infer(
                    make_request(MODEL, rng.uniform(0, 1, (1, features)).astype(np.float32)),
                    metadata=[("x-request-id", request_id)],
                )
            ids.add(request_id)
        until = time.time_ns()
        client.close()
        stack.wait_recorded(ids)
        window = ["--since", f"{since / 1e9:.9f}", "--until", f"{until / 1e9:.9f}"]

        def replay(out: Path, *args: str) -> dict[str, str]:
            done = launcher.run(
                [
                    sys.executable,
                    "-m",
                    "splitstream.replayer",
                    "--redis-url",
                    stack.redis.url,
                    "--model",
                    MODEL,
                    "--target",
                    stack.router.address,
                    "--speed",
                    "max",
                    "--no-progress",
                    "--output-dir",
                    str(out),
                    *window,
                    *list(args),
                ],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=ROOT,
                check=False,
                env={**os.environ, **S3_ENV},
            )
            assert done.returncode == 0, done.stderr
            import json

            lines = (out / "results.jsonl").read_text().splitlines()
            return {row["request_id"]: row["outcome"] for row in map(json.loads, lines)}

        from_redis = replay(tmp_path / "from-redis")
        with running_archiver(tmp_path, stack.redis.url, *endpoint_args, archive=url):
            redis = stack.redis.client()
            wait_until(
                lambda: archived_everything(redis, stream_key(MODEL)), timeout_s=60, what="the archive to catch up"
            )

            # The files: partitioned model=/date=/hour=, zstd, readable columns beside the record.
            os.environ.update(S3_ENV)
            archive = open_archive(url, endpoint=s3.endpoint if s3 else "")
            listing = archive.filesystem.get_file_info(pafs.FileSelector(archive.base, recursive=True))
            files = sorted(info.path for info in listing if info.path.endswith(".parquet"))
            assert files
            assert all(
                re.search(r"/calls/model=affine/date=\d{4}-\d\d-\d\d/hour=\d\d/[\d-]+_[\d-]+\.parquet$", f)
                for f in files
            )
            parquet = pq.ParquetFile(archive.filesystem.open_input_file(files[0]))
            metadata = parquet.metadata
            assert metadata.row_group(0).column(0).compression == "ZSTD"
            assert metadata.metadata[b"splitstream.archive_schema"] == b"1"
            columns = set(parquet.schema_arrow.names)
            assert {
                "request_id",
                "receive_time",
                "version",
                "arm",
                "assignment",
                "phase",
                "status",
                "latency_ms",
            } <= columns
            assert {"routing_key_hmac", "principal", "tags", "record"} <= columns
            assert parquet.schema_arrow.field("record").type == pa.binary()

            # Redis forgets everything, blobs included: the archive stands alone.
            redis.flushall()
            redis.close()
            archived = read_calls(archive, ArchiveQuery(model=MODEL, since_ns=since, until_ns=until))
            assert set(archived["request_id"].to_pylist()) == ids
            for stored in stored_records(archived):
                assert stored.record.request.WhichOneof("body") == "inline"
                assert len(stored.record.request.inline) == stored.record.request.size_bytes
            from_archive = replay(tmp_path / "from-archive", "--source", f"archive:{url}", *endpoint_args)
            assert from_archive == from_redis
            # The default source with the archive configured behind Redis: a window older than anything in
            # Redis (here Redis holds nothing at all) comes from the archive.
            assert replay(tmp_path / "behind-redis", "--archive", url, *endpoint_args) == from_redis
            assert set(from_archive) == ids
            assert "match" in from_archive.values()
            assert "error" not in from_archive.values()
    finally:
        stack.close()


# -- S3 ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_calls_and_feedback_archived_to_an_s3_server_read_back_whole(
    tmp_path: Path, redis_server: RedisServer, s3: S3Server
) -> None:
    client = redis_server.client()
    start = time.time_ns() - 2 * HOUR_NS  # two hours ago: files land in two or three hour partitions
    ids = write_synthetic(client, 0, 300, start_ns=start, gap_ns=HOUR_NS // 150)
    event = feedback_pb2.FeedbackEvent(
        request_id="r-1", routing_key_hmac="u", metric="click", value=1.0, receive_unix_ns=start
    )
    client.xadd(feedback_key(SYNTHETIC), feedback_entry_fields(event))  # type: ignore[arg-type]
    url = "s3://archive/splitstream"
    with running_archiver(tmp_path, redis_server.url, "--s3-endpoint", s3.endpoint, archive=url) as archiver:
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="calls archived")
        wait_until(lambda: archived_everything(client, feedback_key(SYNTHETIC)), timeout_s=60, what="events archived")
        assert metric(archiver, "splitstream_archive_records_total") == 301
        assert metric(archiver, "splitstream_archive_upload_errors_total") == 0
    os.environ.update(S3_ENV)
    archive = open_archive(url, endpoint=s3.endpoint)
    keys = [
        info.path for info in archive.filesystem.get_file_info(pafs.FileSelector("archive/splitstream", recursive=True))
    ]
    hours = {key.split("/hour=")[1][:2] for key in keys if key.endswith(".parquet") and "/calls/" in key}
    assert len(hours) >= 2
    table = read_calls(archive, ArchiveQuery(model=SYNTHETIC, since_ns=start, until_ns=time.time_ns()))
    assert table["request_id"].to_pylist() == ids  # in receive-time order
    # Read part by part (a month's window never sits in memory at once): the same rows in the same order,
    # no part straddling two hour partitions.
    query = ArchiveQuery(model=SYNTHETIC, since_ns=start, until_ns=time.time_ns())
    parts = list(iter_calls(archive, query, columns=["request_id", "receive_time"]))
    part_hours = [{t // HOUR_NS for t in part["receive_time"].cast(pa.int64()).to_pylist()} for part in parts]
    assert all(len(hours_of_part) == 1 for hours_of_part in part_hours)
    assert len(set().union(*part_hours)) == len(hours)
    assert [i for part in parts for i in part["request_id"].to_pylist()] == ids
    assert set(table["principal"].to_pylist()) == {"tenant-0", "tenant-1"}
    records = stored_records(table)
    assert all(stored.record.request.inline == bytes([i % 251]) * 40 for i, stored in enumerate(records))
    # Push-down filters: only v2's failed calls, in the first hour.
    failed = read_calls(
        archive,
        ArchiveQuery(
            model=SYNTHETIC,
            since_ns=start,
            until_ns=start + HOUR_NS,
            versions=frozenset({"v2"}),
            status_codes=frozenset({14}),
        ),
    )
    expected = [f"r-{i}" for i in range(150) if i % 3 == 0 and i % 5 == 0]
    assert failed["request_id"].to_pylist() == expected
    # Partition pruning: a window opens only the hours it overlaps (an unreadable file elsewhere is never read).
    with archive.filesystem.open_output_stream(
        "archive/splitstream/calls/model=synth/date=2001-01-01/hour=00/x.parquet"
    ) as bad:
        bad.write(b"not parquet")
    assert read_calls(archive, ArchiveQuery(model=SYNTHETIC, since_ns=start, until_ns=time.time_ns())).num_rows == 300
    with pytest.raises(ArchiveError, match="cannot be read"):
        read_calls(archive, ArchiveQuery(model=SYNTHETIC, since_ns=978307200 * 10**9, until_ns=978310800 * 10**9))
    # A file a newer splitstream wrote is refused, not misread.
    newer = CALL_SCHEMA.with_metadata({b"splitstream.archive_schema": b"2"})
    path = "archive/splitstream/calls/model=synth/date=2001-01-02/hour=00/1-0_1-0.parquet"
    with archive.filesystem.open_output_stream(path) as sink:
        pq.write_table(newer.empty_table(), sink)
    with pytest.raises(ArchiveError, match="archive schema 2; this reader knows up to 1"):
        read_calls(archive, ArchiveQuery(model=SYNTHETIC, since_ns=978393600 * 10**9, until_ns=978397200 * 10**9))
    feedback = read_feedback(archive, SYNTHETIC, start - HOUR_NS, time.time_ns())
    assert feedback["request_id"].to_pylist() == ["r-1"]
    assert feedback["metric"].to_pylist() == ["click"]
    # What the analysis reads: the columns of a stream entry, from the archive.
    columns = readable_calls(archive, ArchiveQuery(model=SYNTHETIC, since_ns=start, until_ns=time.time_ns()))
    assert columns.column_names[: len(ENTRY_COLUMNS)] == list(ENTRY_COLUMNS)
    assert columns["time_ns"].to_pylist() == [start + i * (HOUR_NS // 150) for i in range(300)]
    assert set(columns["tokens"].to_pylist()) == {None}  # unary calls
    # A file written before the token-stream columns existed still reads, with nulls there.
    old_schema = pa.schema([f for f in CALL_SCHEMA if f.name not in ("ttft_ms", "tokens")], CALL_SCHEMA.metadata)
    old_row = {name: None for name in old_schema.names} | {
        "request_id": "old-1",
        "receive_time": 978480000 * 10**9,
        "latency_ms": 2.0,
        "stream_id": "1-0",
    }
    old_path = "archive/splitstream/calls/model=synth/date=2001-01-03/hour=00/1-0_1-0.parquet"
    with archive.filesystem.open_output_stream(old_path) as sink:
        pq.write_table(pa.Table.from_pylist([old_row], old_schema), sink)
    old = readable_calls(archive, ArchiveQuery(model=SYNTHETIC, since_ns=978480000 * 10**9, until_ns=978483600 * 10**9))
    assert (old["request_id"].to_pylist(), old["ttft_ms"].to_pylist(), old["tokens"].to_pylist()) == (
        ["old-1"],
        [None],
        [None],
    )
    assert readable_feedback(archive, SYNTHETIC, start - HOUR_NS, time.time_ns())["receive_ns"].to_pylist() == [start]


@pytest.mark.slow
def test_upload_errors_are_counted_and_retried_until_the_store_is_back(
    tmp_path: Path, redis_server: RedisServer, own_s3: S3Server
) -> None:
    client = redis_server.client()
    with running_archiver(
        tmp_path, redis_server.url, "--s3-endpoint", own_s3.endpoint, archive="s3://archive/x"
    ) as archiver:
        write_synthetic(client, 0, 50, start_ns=time.time_ns())
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="first batch")
        own_s3.stop()
        ids = write_synthetic(client, 50, 100, start_ns=time.time_ns())
        wait_until(
            lambda: metric(archiver, "splitstream_archive_upload_errors_total") >= 2, timeout_s=60, what="upload errors"
        )
        assert not archived_everything(client, stream_key(SYNTHETIC))  # nothing acknowledged while failing
        wait_until(lambda: metric(archiver, "splitstream_archive_lag_entries") == 100, timeout_s=30, what="lag")
        assert metric(archiver, "splitstream_archive_lag_seconds") > 0
        own_s3.start()
        own_s3.create_bucket("archive")  # moto forgets its buckets on restart
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=90, what="the retry")
        wait_until(lambda: metric(archiver, "splitstream_archive_lag_entries") == 0, timeout_s=30, what="no lag")
    archive = open_archive("s3://archive/x", endpoint=own_s3.endpoint)
    table = read_calls(archive, ArchiveQuery(model=SYNTHETIC, since_ns=0, until_ns=time.time_ns() + HOUR_NS))
    assert set(ids) <= set(table["request_id"].to_pylist())


@pytest.mark.slow
def test_a_bad_archive_url_or_a_missing_bucket_exits_2_with_one_line(
    tmp_path: Path, redis_server: RedisServer, s3: S3Server
) -> None:
    cases = [
        (["--archive", "s3:///no-bucket"], "names no bucket"),
        (["--archive", "s3://missing/prefix", "--s3-endpoint", s3.endpoint], "bucket 'missing' does not exist"),
        (["--archive", "s3://archive/p", "--s3-endpoint", "ftp://x"], "S3 endpoint"),
        (["--archive", "s3://archive/p?colour=red"], "unknown option 'colour'"),
        (["--archive", "nosuchscheme://x/y"], "archive URL"),
        (["--archive", "file:///dev/null/archive"], "archive"),
        # An endpoint's path was dropped without a word (the store then answered for another root), and an
        # endpoint given with a local archive was ignored (the files went to a directory, not the store).
        (["--archive", "s3://archive/p", "--s3-endpoint", f"{s3.endpoint}/tenant"], "no path"),
        (["--archive", str(tmp_path / "local"), "--s3-endpoint", s3.endpoint], "s3:// archives only"),
    ]
    strict = S3Server(tmp_path / "strict-s3", check_credentials=True).start()
    cases.append((["--archive", "s3://archive/p", "--s3-endpoint", strict.endpoint], "ACCESS_DENIED"))
    try:
        for args, expected in cases:
            done = launcher.run(
                [
                    sys.executable,
                    "-m",
                    "splitstream.archiver",
                    "--port",
                    "0",
                    "--metrics-port",
                    "0",
                    "--redis-url",
                    redis_server.url,
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
                check=False,
                env={**os.environ, **S3_ENV},
            )
            assert done.returncode == 2, (args, done.stderr)
            last = done.stderr.strip().splitlines()[-1]
            assert last.startswith("splitstream-archive: error:"), done.stderr
            assert expected in last, (args, last)
        # The replayer says the same about an archive it is to read, and names a model it holds no calls of
        # (it replayed an empty window, exit 0: a misspelt model looked like a quiet hour).
        (tmp_path / "empty").mkdir()
        for source, expected in (
            (["--source", f"archive:{tmp_path / 'none'}"], "is not a directory"),
            (["--source", "archive:s3:///x"], "no bucket"),
            (["--source", f"archive:{tmp_path / 'empty'}"], "unknown model 'm': no calls of it in the archive"),
            (
                ["--archive", str(tmp_path / "empty")],
                "no stream splitstream:calls:m in Redis (recorded models: none) nor",
            ),
        ):
            replay = [sys.executable, "-m", "splitstream.replayer", "--redis-url", redis_server.url, "--model", "m"]
            replay += ["--since", "-1h", "--target", "127.0.0.1:1", *source]
            done = launcher.run(replay, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
            assert done.returncode == 2, done.stderr
            assert expected in done.stderr.strip().splitlines()[-1], done.stderr
    finally:
        strict.stop()


@pytest.mark.slow
def test_without_archive_flag_the_default_directory_is_archived_to(tmp_path: Path, redis_server: RedisServer) -> None:
    # The default was file://./splitstream-archive, which the archive URL parser refuses (a file URL's host):
    # the archiver with no --archive exited 2 at once.
    client = redis_server.client()
    write_synthetic(client, 0, 10, start_ns=time.time_ns())
    with open(tmp_path / "archiver.log", "wb") as log:
        archiver = launcher.Popen(
            [sys.executable, "-m", "splitstream.archiver", "--port", "0", "--metrics-port", "0",
             "--redis-url", redis_server.url, "--flush-interval-s", "0.3", "--scan-interval-s", "0.3"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    try:
        wait_until(
            lambda: archiver.poll() is not None or archived_everything(client, stream_key(SYNTHETIC)),
            timeout_s=60,
            what="the archive",
        )
        assert archiver.poll() is None, (tmp_path / "archiver.log").read_text()
    finally:
        archiver.terminate()
        archiver.wait(timeout=30)
    archive = tmp_path / "splitstream-archive"
    assert len(raw_rows(archive.as_uri())) == 10
    assert list(archive.glob("calls/model=synth/date=*/hour=*/*.parquet"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--claim-idle-s", "1e16"], "--claim-idle-s: at most 315360000"),
        (["--claim-idle-s", "1e308"], "--claim-idle-s: at most 315360000"),
        (["--flush-interval-s", "nan"], "--flush-interval-s: must be a positive number"),
        (["--max-file-rows", "0"], "--max-file-rows: must be at least 1"),
        (["--flush-interval-s", "60", "--claim-idle-s", "30"], "must exceed --flush-interval-s"),
    ],
    ids=["claim-past-redis", "claim-past-float", "flush-nan", "no-rows", "claim-before-flush"],
)
def test_bad_numeric_flags_exit_2_with_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    # --claim-idle-s past what Redis takes (int64 ms) was accepted: every claim then failed and nothing was
    # archived, the archiver retrying forever (here: waiting for a Redis that is not there); 1e308 a traceback.
    done = launcher.run(
        [sys.executable, "-m", "splitstream.archiver", "--port", "0", "--metrics-port", "0",
         "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--archive", str(tmp_path / "archive"), *flags],
        capture_output=True, text=True, timeout=30, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0]


# -- sharing, crashes, dead archivers ---------------------------------------------------------------


@pytest.mark.slow
def test_two_archivers_share_a_stream_and_write_every_entry_once(tmp_path: Path, redis_server: RedisServer) -> None:
    client = redis_server.client()
    url = local_archive(tmp_path)
    with running_archivers(tmp_path, redis_server.url, "--read-count", "25") as archivers:
        ids: list[str] = []
        for batch in range(20):
            ids += write_synthetic(client, batch * 100, 100, start_ns=time.time_ns())
            time.sleep(0.02)
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=90, what="both archivers")
        counts = [metric(p, "splitstream_archive_records_total") for p in archivers]
    assert sum(counts) == 2000
    rows = raw_rows(url)["request_id"].to_pylist()
    assert sorted(rows) == sorted(ids)  # every entry once, before any de-duplication


def builder_pids(archiver: ServiceProcess) -> list[int]:
    """The archiver's file-building child (its one child process)."""
    assert archiver.process is not None
    pid = archiver.process.pid
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    """Alive and not a zombie (a zombie's parent has not reaped it yet: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_killed_builder_process_is_replaced_and_a_killed_archiver_leaves_no_builder_behind(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Files are built and written in a child process: if it dies, the write in hand fails, is counted and
    retried with a new child; if the archiver dies (SIGKILL), the child does not write on as an orphan."""
    client = redis_server.client()
    url = local_archive(tmp_path)
    with running_archiver(tmp_path, redis_server.url) as archiver:
        ids = write_synthetic(client, 0, 100, start_ns=time.time_ns())
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="the first files")
        (builder,) = builder_pids(archiver)
        os.kill(builder, signal.SIGKILL)
        ids += write_synthetic(client, 100, 100, start_ns=time.time_ns())
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="a new builder")
        assert metric(archiver, "splitstream_archive_upload_errors_total") >= 1
        (replacement,) = builder_pids(archiver)
        assert replacement != builder
        archiver.kill()
        wait_until(lambda: not alive(replacement), timeout_s=10, what="the orphaned builder to exit")
    assert sorted(raw_rows(url)["request_id"].to_pylist()) == sorted(ids)


@pytest.mark.slow
def test_with_the_builder_thread_no_child_is_started_and_every_call_is_archived(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """``--builder thread`` (a one-core host): the same files, blobs inlined, built in the archiver's own process."""
    client = redis_server.client()
    url = local_archive(tmp_path)
    with running_archiver(tmp_path, redis_server.url, "--builder", "thread") as archiver:
        ids = write_synthetic(client, 0, 100, start_ns=time.time_ns())
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="the files")
        assert builder_pids(archiver) == []
    table = read_calls(open_archive(url), ArchiveQuery(model=SYNTHETIC, since_ns=0, until_ns=time.time_ns()))
    assert table["request_id"].to_pylist() == ids
    assert all(stored.record.request.inline == bytes([i % 251]) * 40 for i, stored in enumerate(stored_records(table)))


def archive_with_two_consumers(
    tmp_path: Path, redis_server: RedisServer, stream: str, write: Callable[[int], None]
) -> tuple[str, Path]:
    """Two archivers (small reads and files, so their files overlap in receive time) archive what ``write``
    puts in ``stream`` over 12 batches; then one file is copied, as a claimed batch re-archived. The
    archive's URL and the copied file."""
    client = redis_server.client()
    archive_dir = tmp_path / "archive"
    url = archive_dir.as_uri()
    with running_archivers(tmp_path, redis_server.url, "--read-count", "10", "--max-file-rows", "40"):
        for batch in range(12):
            write(batch)
            time.sleep(0.05)
        wait_until(lambda: archived_everything(client, stream), timeout_s=90, what="both archivers")
    files = sorted(archive_dir.rglob("*.parquet"))
    assert len(files) > 10
    copy = files[len(files) // 2]
    (copy.parent / f"copy-{copy.name}").write_bytes(copy.read_bytes())
    return url, copy


@pytest.mark.slow
def test_a_window_is_read_in_bounded_parts_in_receive_time_order_across_overlapping_files(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two archivers' files overlap in receive time, and a re-archived file repeats rows: the streaming
    reader still yields every call once, in receive-time order, a part at a time (never the hour whole)."""
    client = redis_server.client()
    start = time.time_ns() - 10**9
    ids: list[str] = []

    def write(batch: int) -> None:  # receive times rise with the index across batches
        ids.extend(write_synthetic(client, batch * 50, 50, start_ns=start + batch * 50 * 1000, gap_ns=1000))

    url, copy = archive_with_two_consumers(tmp_path, redis_server, stream_key(SYNTHETIC), write)
    query = ArchiveQuery(model=SYNTHETIC, since_ns=start, until_ns=start + 10**9)
    parts = list(iter_calls(open_archive(url), query, columns=["request_id", "receive_time"]))
    assert len(parts) > 5
    assert max(part.num_rows for part in parts) <= 80  # a file's rows and what overlaps them, not the window
    assert [i for part in parts for i in part["request_id"].to_pylist()] == ids
    assert raw_rows(url).num_rows == len(ids) + pq.read_metadata(copy).num_rows


@pytest.mark.slow
def test_feedback_is_read_in_bounded_parts_in_receive_time_order_across_overlapping_files(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """As for calls: two archivers' feedback files overlap in receive time, and a re-archived file repeats
    events; the streaming reader yields every event once (by stream id), in receive-time order, a part
    at a time (never the hour whole), the same rows as the whole-window read."""
    client = redis_server.client()
    start = time.time_ns() - 10**9
    stream_ids: list[str] = []

    def write(batch: int) -> None:  # receive times rise with the index across batches
        for n in range(batch * 50, batch * 50 + 50):
            event = feedback_pb2.FeedbackEvent(
                request_id=f"r-{n}", routing_key_hmac=f"u-{n % 7}", metric="click", value=n,
                receive_unix_ns=start + n * 1000,
            )  # fmt: skip
            added = client.xadd(feedback_key(SYNTHETIC), feedback_entry_fields(event))  # type: ignore[arg-type]
            stream_ids.append(added.decode() if isinstance(added, bytes) else str(added))

    url, copy = archive_with_two_consumers(tmp_path, redis_server, feedback_key(SYNTHETIC), write)
    archive = open_archive(url)
    parts = list(iter_feedback(archive, SYNTHETIC, start, start + 10**9))
    assert len(parts) > 5
    assert max(part.num_rows for part in parts) <= 80  # a file's rows and what overlaps them, not the window
    assert [v for part in parts for v in part["value"].to_pylist()] == [float(n) for n in range(600)]
    assert [i for part in parts for i in part["stream_id"].to_pylist()] == stream_ids
    assert read_feedback(archive, SYNTHETIC, start, start + 10**9).equals(pa.concat_tables(parts))
    assert raw_rows(url, kind="feedback").num_rows == 600 + pq.read_metadata(copy).num_rows


@pytest.mark.slow
def test_an_archiver_killed_mid_upload_under_load_restarts_and_archives_every_call_exactly_once(
    tmp_path: Path, redis_server: RedisServer, s3: S3Server
) -> None:
    client = redis_server.client()
    url = "s3://archive/crash"
    args = ("--s3-endpoint", s3.endpoint, "--max-file-rows", "400")
    with SyntheticLoad(redis_server) as load:
        with running_archiver(tmp_path, redis_server.url, *args, archive=url) as archiver:
            wait_until(
                lambda: metric(archiver, "splitstream_archive_files_total") >= 3, timeout_s=60, what="some files"
            )
            # Kill it while it holds entries it has read and not acknowledged (a file on its way).
            wait_until(lambda: client.xpending(stream_key(SYNTHETIC), ARCHIVE_GROUP)["pending"] > 0, timeout_s=30)
            archiver.kill()
        pending = client.xpending(stream_key(SYNTHETIC), ARCHIVE_GROUP)["pending"]
        with running_archiver(tmp_path, redis_server.url, *args, archive=url):
            time.sleep(1.0)
            load.stop()
            wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=90, what="the restart")
    assert pending > 0
    table = read_calls(
        open_archive(url, endpoint=s3.endpoint),
        ArchiveQuery(model=SYNTHETIC, since_ns=0, until_ns=time.time_ns() + HOUR_NS),
    )
    archived = table["request_id"].to_pylist()
    assert len(archived) == len(set(archived))
    assert set(archived) == set(load.written), f"missing {len(set(load.written) - set(archived))}"
    # Restarted under the same name, it rewrote what it had uploaded and not acknowledged under the same
    # names: not a row twice even before de-duplication.
    raw = raw_rows(url, s3.endpoint)["request_id"].to_pylist()
    assert sorted(raw) == sorted(load.written)


@pytest.mark.slow
def test_entries_a_dead_archiver_left_pending_are_claimed_and_archived(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    ids = write_synthetic(client, 0, 120, start_ns=time.time_ns())
    stream = stream_key(SYNTHETIC)
    client.xgroup_create(stream, ARCHIVE_GROUP, id="0")
    # A consumer that reads and dies before writing its file: its entries stay pending under its name.
    client.xreadgroup(ARCHIVE_GROUP, "dead", {stream: ">"}, count=80)
    assert client.xpending(stream, ARCHIVE_GROUP)["pending"] == 80
    url = local_archive(tmp_path)
    with running_archiver(tmp_path, redis_server.url, "--claim-idle-s", "1.5", consumer="alive") as archiver:
        wait_until(lambda: archived_everything(client, stream), timeout_s=60, what="the claim")
        assert metric(archiver, "splitstream_archive_claimed_total") == 80
    assert client.xpending(stream, ARCHIVE_GROUP)["pending"] == 0
    assert sorted(raw_rows(url)["request_id"].to_pylist()) == sorted(ids)


@pytest.mark.slow
def test_sigterm_writes_and_acknowledges_the_buffered_entries_then_exits_0(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    url = local_archive(tmp_path)
    with running_archiver(
        tmp_path, redis_server.url, "--flush-interval-s", "600", "--claim-idle-s", "1200"
    ) as archiver:
        ids = write_synthetic(client, 0, 70, start_ns=time.time_ns())
        wait_until(lambda: metric(archiver, "splitstream_archive_buffered_entries") == 70, timeout_s=30)
        assert raw_rows(url).num_rows == 0
        archiver.signal(signal.SIGTERM)
        assert archiver.wait() == 0
    assert sorted(raw_rows(url)["request_id"].to_pylist()) == sorted(ids)
    assert client.xpending(stream_key(SYNTHETIC), ARCHIVE_GROUP)["pending"] == 0


@pytest.mark.slow
def test_sigterm_while_the_store_hangs_stops_within_the_shutdown_grace_leaving_the_entries_pending(
    tmp_path: Path, redis_server: RedisServer, own_s3: S3Server
) -> None:
    """An operator's SIGTERM must not wait out a store that no longer answers (each try on its own timeouts
    and retries: three minutes): ``--shutdown-grace-s`` bounds the drain, and what was not written stays
    pending in Redis for the next archiver."""
    client = redis_server.client()
    args = ("--s3-endpoint", own_s3.endpoint, "--shutdown-grace-s", "3")
    with running_archiver(tmp_path, redis_server.url, *args, archive="s3://archive/x") as archiver:
        assert own_s3.process is not None
        try:
            write_synthetic(client, 0, 20, start_ns=time.time_ns())
            wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="the first file")
            own_s3.process.send_signal(signal.SIGSTOP)  # the store's socket still accepts; nothing answers
            write_synthetic(client, 20, 40, start_ns=time.time_ns())
            # Read: whether its file's upload has begun or the drain begins it, the write meets the hung store.
            wait_until(lambda: metric(archiver, "splitstream_archive_buffered_entries") == 40, timeout_s=30)
            archiver.signal(signal.SIGTERM)
            assert archiver.wait(timeout_s=30) == 0
        finally:
            own_s3.process.send_signal(signal.SIGCONT)
    assert client.xpending(stream_key(SYNTHETIC), ARCHIVE_GROUP)["pending"] == 40
    assert "stay pending" in archiver.log()
    assert "Traceback" not in archiver.log()


# -- retention and straddling windows ---------------------------------------------------------------


@pytest.mark.slow
def test_trim_archived_keeps_every_unarchived_call_and_trims_once_archived(tmp_path: Path) -> None:
    stack = RecordingStack(tmp_path, recorder_args=("--retention-maxlen", "20", "--trim-archived"))
    try:
        client = InferClient(stack.router.address)

        def send(prefix: str, count: int) -> set[str]:
            sent = set()
            for i in range(count):
                request_id = f"{prefix}-{i}"
                client.infer(make_request(MODEL, np.ones((1, 4), np.float32)), metadata=[("x-request-id", request_id)])
                sent.add(request_id)
            return sent

        before = send("before", 250)
        stack.wait_recorded(before)
        assert stack.raw_count() >= 250  # no archiver yet: retention trims nothing
        url = local_archive(tmp_path)
        with running_archiver(tmp_path, stack.redis.url):
            redis = stack.redis.client()
            wait_until(lambda: archived_everything(redis, stream_key(MODEL)), timeout_s=60, what="the archive")
            after = send("after", 30)
            wait_until(lambda: stack.raw_count() < 200, timeout_s=30, what="the recorder to trim what is archived")

            def kept() -> set[str]:
                """Every call id Redis or the archive holds."""
                return {r.request_id for r in stack.records()} | set(raw_rows(url)["request_id"].to_pylist())

            # The last calls reach Redis a batch interval after their answers; then nothing is missing anywhere.
            wait_until(lambda: before | after <= kept(), timeout_s=30, what="every call in Redis or the archive")
            in_redis = {r.request_id for r in stack.records()}
            assert len(before - in_redis) > 50  # trimmed, and only because they were archived
            assert before - in_redis <= set(raw_rows(url)["request_id"].to_pylist())
            assert metric(stack.recorder, "splitstream_recorder_trims_held_by_archive_total") > 0
            client.close()
    finally:
        stack.close()


@pytest.mark.slow
def test_a_window_straddling_the_archive_and_redis_is_read_from_both_without_repeats(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    start = time.time_ns()
    ids = write_synthetic(client, 0, 100, start_ns=start)
    url = archive_all(tmp_path, redis_server)
    entries: Any = client.xrange(stream_key(SYNTHETIC))
    client.xtrim(stream_key(SYNTHETIC), minid=entries[60][0])  # retention took the first 60
    ids += write_synthetic(client, 100, 20, start_ns=time.time_ns() - 50_000_000)  # new calls, not archived yet

    stats = SelectionStats()

    async def read() -> list[str]:
        redis = Redis.from_url(redis_server.url)
        selection = Selection(
            models=(SYNTHETIC,),
            since_ns=start - 1,
            until_ns=time.time_ns() + 1,
            max_lateness_ns=10**9,
            clock_skew_ns=10**9,
        )
        calls = [c.record.request_id async for c in select_calls(redis, selection, stats, archive=open_archive(url))]
        await redis.aclose()
        return calls

    calls = asyncio.run(read())
    assert calls == ids  # each once, in receive-time order
    # Each of the 120 entries read from one source: the archive's rows of those Redis no longer holds, Redis
    # the rest, though 46 of those are archived too and received within the boundary's clock-skew margin
    # (XTRIM's approximate trim keeps a few more than 60 in Redis).
    assert (stats.scanned, stats.duplicates) == (120, 0)


def analyzed_calls(out: Path, model: str, *source: str) -> object:
    """``splitstream-admin analyze`` of ``model`` over the hours around now from ``source``: the calls it counts."""
    done = launcher.run(
        [sys.executable, "-m", "splitstream.admin", "analyze", model, *source,
         "--since", "-1h", "--until", "+1h", "--metric", "click:proportion", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False, env={**os.environ, **S3_ENV},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads((out / "analysis.json").read_text())["calls"]["calls"]


@pytest.mark.slow
def test_a_model_whose_name_is_too_long_for_a_directory_is_archived_and_read_back_and_holds_no_other_back(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # A valid model name (200 characters at most) may take 800 bytes; a directory name takes 255. Its file
    # failed on every retry (ENAMETOOLONG), and as a failed write holds the archiver's reading, no other
    # model was archived either.
    long_name = "模型" * 45  # 90 characters, 270 bytes
    client = redis_server.client()
    now = time.time_ns()
    for model in (long_name, "plain"):
        for i in range(5):
            record = synthetic_record(i, now + i)
            record.model = model
            client.xadd(stream_key(model), entry_fields(record))  # type: ignore[arg-type]
    url = local_archive(tmp_path)
    with running_archiver(tmp_path, redis_server.url):
        client.xadd(stream_key("later"), entry_fields(synthetic_record(9, time.time_ns())))  # type: ignore[arg-type]
        for model in ("later", "plain", long_name):
            wait_until(lambda m=model: archived_everything(client, stream_key(m)), timeout_s=60, what=model)
    assert analyzed_calls(tmp_path / "analysis", long_name, "--source", f"archive:{url}") == 5


@pytest.mark.slow
def test_an_object_stores_files_under_a_long_models_uncut_name_are_still_read(
    tmp_path: Path, redis_server: RedisServer, s3: S3Server
) -> None:
    # An object store took the uncut name before names were cut to fit a directory: files already there stay
    # readable (and are read beside the ones written since, in the same hours).
    long_name = "模型" * 45
    client = redis_server.client()
    now = time.time_ns()
    for i in range(4):
        record = synthetic_record(i, now + i)
        record.model = long_name
        client.xadd(stream_key(long_name), entry_fields(record))  # type: ignore[arg-type]
    archive_all(
        tmp_path, redis_server, "--s3-endpoint", s3.endpoint, archive="s3://archive/x", stream=stream_key(long_name)
    )
    store = s3.filesystem()
    files = [i.path for i in store.get_file_info(pafs.FileSelector("archive/x", recursive=True)) if i.is_file]
    assert len(files) == 1
    cut_dir = files[0].split("/")[3]
    assert cut_dir.startswith("model=")
    assert "%~" in cut_dir
    store.move(files[0], files[0].replace(cut_dir, f"model={long_name}"))  # where an older archiver put it
    source = ("--source", "archive:s3://archive/x", "--s3-endpoint", s3.endpoint)
    assert analyzed_calls(tmp_path / "analysis", long_name, *source) == 4


@pytest.mark.slow
def test_a_replay_window_open_to_the_year_9999_reads_every_archived_call(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # The time flags take instants up to 9999-12-31; the archive's receive times end in 2262 (int64 ns), and a
    # window reaching past that was an OverflowError traceback at the first file (and the hours it spans were
    # each named, 70 million of them from 1970).
    client = redis_server.client()
    ids = write_synthetic(client, 0, 30, start_ns=time.time_ns())
    url = archive_all(tmp_path, redis_server)
    add_version(tmp_path / "models", SYNTHETIC, "v1", scale=2.0)
    stack = Stack(tmp_path)
    try:
        worker = stack.worker(tmp_path / "models", SYNTHETIC, "v1")
        for name, source in (("alone", ["--source", f"archive:{url}"]), ("behind", ["--archive", url])):
            done = launcher.run(
                [sys.executable, "-m", "splitstream.replayer", "--redis-url", redis_server.url, "--model", SYNTHETIC,
                 "--target", worker.address, "--speed", "max", "--no-progress", "--output-dir", str(tmp_path / name),
                 "--since", "0", "--until", "9999-12-31T00:00:00Z", *source],
                capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
            )  # fmt: skip
            assert done.returncode == 0, (name, done.stderr)
            rows = (tmp_path / name / "results.jsonl").read_text().splitlines()
            assert sorted(json.loads(row)["request_id"] for row in rows) == sorted(ids), name
    finally:
        stack.close()


@pytest.mark.slow
def test_an_archive_file_that_fails_mid_replay_exits_2_naming_it_with_the_partial_results_written(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A damaged file is a broken run, not a Ctrl-C (130) and not a verdict (1): exit 2, one line naming it,
    and what was replayed before it kept in results.jsonl and the summary."""
    client = redis_server.client()
    now = time.time_ns()
    early = write_synthetic(client, 0, 20, start_ns=now - 3 * HOUR_NS)
    write_synthetic(client, 20, 20, start_ns=now - HOUR_NS)
    url = archive_all(tmp_path, redis_server)
    files = sorted((tmp_path / "archive").rglob("*.parquet"))
    assert len(files) == 2  # one per hour partition, the later one damaged
    damaged = files[-1]
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    add_version(tmp_path / "models", SYNTHETIC, "v1", scale=2.0)
    stack = Stack(tmp_path)
    try:
        worker = stack.worker(tmp_path / "models", SYNTHETIC, "v1")
        done = launcher.run(
            [sys.executable, "-m", "splitstream.replayer", "--model", SYNTHETIC, "--source", f"archive:{url}",
             "--target", worker.address, "--speed", "max", "--no-progress", "--output-dir", str(tmp_path / "out"),
             "--since", str((now - 4 * HOUR_NS) // 10**9)],
            capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
        )  # fmt: skip
    finally:
        stack.close()
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("splitstream-replay: error:")]
    assert len(errors) == 1, done.stderr
    assert damaged.name in errors[0]
    assert "Traceback" not in done.stderr
    rows = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert {json.loads(row)["request_id"] for row in rows} <= set(early)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["counts"]["completed"] == len(rows)


@pytest.mark.slow
def test_the_docs_duckdb_query_counts_each_call_and_click_once_per_version(
    tmp_path: Path, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/archive.md's worked SQL, as it stands on the page, over what a real archiver wrote: calls and
    clicks some of which were delivered twice, in the week the query names and in the week after."""
    pytest.importorskip("duckdb")
    client = redis_server.client()
    week = 1_790_985_600 * 10**9  # 2026-10-03T00:00:00Z, inside the query's dates
    write_synthetic(client, 0, 60, start_ns=week + 10 * HOUR_NS, gap_ns=10**9)
    write_synthetic(client, 60, 9, start_ns=week + 7 * 24 * HOUR_NS)  # the week after: not counted
    # Delivered twice: five calls (resent records, new entries) and two clicks (resent events).
    pipe = client.pipeline(transaction=False)
    for i in range(0, 50, 10):
        pipe.xadd(stream_key(SYNTHETIC), entry_fields(synthetic_record(i, week + 10 * HOUR_NS + i * 10**9)))
    clicked = [i for i in range(60) if i % 4 == 0]
    for n, i in enumerate([*clicked, clicked[0], clicked[1]]):
        event = feedback_pb2.FeedbackEvent(request_id=f"r-{i}", metric="click", value=1.0, idempotency_key=f"c-{i}")
        event.event_unix_ns = event.receive_unix_ns = week + 10 * HOUR_NS + i * 10**9 + 10**9 + n
        pipe.xadd(feedback_key(SYNTHETIC), feedback_entry_fields(event))
    pipe.execute()
    with running_archiver(tmp_path, redis_server.url):
        for key in (stream_key(SYNTHETIC), feedback_key(SYNTHETIC)):
            wait_until(lambda key=key: archived_everything(client, key), timeout_s=60, what=key)  # type: ignore[misc]
    client.close()
    code = doc_block("archive.md", "sql").text
    for old, new in (
        ("'splitstream-archive/", f"'{tmp_path}/archive/"),
        ("model = 'resnet'", f"model = '{SYNTHETIC}'"),
    ):
        assert old in code, f"docs/archive.md's SQL no longer holds {old!r}: update this test"
        code = code.replace(old, new)
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/archive.md", "exec"), namespace)
    assert "click_rate" in capsys.readouterr().out  # what .show() printed
    rows = namespace["by_version"].fetchall()
    expected = []
    for version in ("v1", "v2"):
        calls = [i for i in range(60) if ("v1" if i % 3 else "v2") == version]
        failed = [i for i in calls if i % 5 == 0]
        clicks = [i for i in calls if i % 4 == 0]
        expected.append((version, len(calls), len(failed) / len(calls), len(clicks) / len(calls)))
    assert [(v, n) for v, n, *_ in rows] == [(v, n) for v, n, *_ in expected]
    for row, want in zip(rows, expected, strict=True):
        assert row[2:] == pytest.approx(want[2:])


@pytest.mark.parametrize("retention", ["count", "age"])
async def test_the_recorders_trim_never_passes_the_archive_mark(tmp_path: Path, retention: str) -> None:
    """The writer's --trim-archived, in process against a real redis-server with small stream nodes (so
    approximate trimming shows): no mark, nothing trimmed; a mark, trimmed up to it and never past."""
    from splitstream.recorder.writer import RedisWriter, StreamEntry, WriteBatch

    server = RedisServer(tmp_path / "redis", config=("--stream-node-max-entries", "5")).start()
    redis: Any = Redis.from_url(server.url)  # binary replies; redis-py's stubs cannot say so
    now_s = [time.time()]
    writer = RedisWriter(
        redis,
        retention_maxlen=10 if retention == "count" else 0,
        retention_age_s=1.0 if retention == "age" else 0.0,
        blob_ttl_s=0,
        trim_archived=True,
        clock=lambda: now_s[0],
    )
    stream = stream_key(SYNTHETIC)
    try:

        async def write(first: int, count: int) -> None:
            records = [synthetic_record(i, time.time_ns()) for i in range(first, first + count)]
            entries = [StreamEntry(stream, entry_fields(record)) for record in records]
            await writer.write(WriteBatch(entries=entries, blobs={}))

        await write(0, 100)
        now_s[0] += 60  # every entry is past the age retention too
        result = await writer.write(
            WriteBatch(entries=[StreamEntry(stream, entry_fields(synthetic_record(100, 0)))], blobs={})
        )
        assert await redis.xlen(stream) == 101  # nothing archived: nothing trimmed
        assert result.trims_held == 1
        ids = [entry_id.decode() for entry_id, _ in await redis.xrange(stream)]
        await redis.set(archive_mark_key(stream), ids[60])  # entries 0..59 archived
        await write(101, 1)
        kept = [entry_id.decode() for entry_id, _ in await redis.xrange(stream)]
        assert ids[60:] == kept[: len(ids) - 60]  # the unarchived ones all kept
        assert len(kept) < 102 - 50  # and (approximately: whole nodes) the archived ones trimmed
        await redis.set(archive_mark_key(stream), "99999999999999-0")  # everything archived
        await write(102, 1)
        remaining = await redis.xlen(stream)
        assert (remaining <= 15) if retention == "count" else (remaining <= 5)
    finally:
        await redis.aclose()
        server.stop()


@pytest.mark.slow
def test_an_entry_whose_record_does_not_decode_is_archived_as_it_is_and_counted(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    now = time.time_ns()
    write_synthetic(client, 0, 5, start_ns=now)
    garbage = dict(entry_fields(synthetic_record(99, now + 10_000_000)))
    garbage["record"] = b"\xff\xff not a CallRecord"
    client.xadd(stream_key(SYNTHETIC), garbage)  # type: ignore[arg-type]
    write_synthetic(client, 5, 5, start_ns=now + 20_000_000)
    url = local_archive(tmp_path)
    with running_archiver(tmp_path, redis_server.url) as archiver:
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60)
        assert metric(archiver, "splitstream_archive_corrupt_entries_total") == 1
    rows = raw_rows(url).sort_by("receive_time")
    assert rows["request_id"].to_pylist() == [f"r-{i}" for i in range(5)] + ["r-99"] + [f"r-{i}" for i in range(5, 10)]
    bad = rows.filter(pa.compute.equal(rows["request_id"], "r-99")).drop_columns(["receive_time"]).to_pylist()[0]
    assert bad["record"] == b"\xff\xff not a CallRecord"
    assert (bad["version"], bad["status"], bad["status_code"]) == ("v2", "OK", 0)
    # A replay from the archive skips it as corrupt, as one from Redis does.
    selection = Selection(models=(SYNTHETIC,), since_ns=now - 1, until_ns=time.time_ns())
    stats = SelectionStats()

    async def read() -> list[str]:
        return [c.record.request_id async for c in select_calls(None, selection, stats, archive=open_archive(url))]

    assert asyncio.run(read()) == [f"r-{i}" for i in range(10)]
    assert stats.skipped["corrupt"] == 1


@pytest.mark.slow
def test_times_past_int64_in_an_entrys_fields_are_archived_at_the_stream_ids_time_and_the_archiver_lives_on(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # Anything with Redis may write a stream; one such entry failed its file on every retry (an OverflowError,
    # not an upload error) and killed the archiver at each restart: nothing after it was ever archived.
    client = redis_server.client()
    now = time.time_ns()
    write_synthetic(client, 0, 3, start_ns=now)
    odd = dict(entry_fields(synthetic_record(99, now)))
    odd["time_ns"] = str(2**64)
    odd_id = cast(bytes, client.xadd(stream_key(SYNTHETIC), odd)).decode()  # type: ignore[arg-type]
    write_synthetic(client, 3, 3, start_ns=now)
    event: dict[str, str | bytes] = {"request_id": "r-1", "unit": "u", "metric": "click", "value": "1"}
    event |= {"idempotency_key": "", "event_ns": str(2**64), "receive_ns": str(-(2**64))}
    client.xadd(feedback_key(SYNTHETIC), event)  # type: ignore[arg-type]
    url = local_archive(tmp_path)
    with running_archiver(tmp_path, redis_server.url) as archiver:
        for stream in (stream_key(SYNTHETIC), feedback_key(SYNTHETIC)):
            wait_until(lambda s=stream: archived_everything(client, s), timeout_s=60, what=f"{stream} archived")
        assert archiver.process is not None
        assert archiver.process.poll() is None, archiver.log()
    rows = raw_rows(url)
    assert sorted(rows["request_id"].to_pylist()) == sorted([f"r-{i}" for i in range(6)] + ["r-99"])
    odd_row = rows.filter(pa.compute.equal(rows["request_id"], "r-99"))
    assert odd_row["receive_time"].cast(pa.int64()).to_pylist() == [int(odd_id.split("-")[0]) * 1_000_000]
    events = raw_rows(url, kind="feedback")
    assert events["request_id"].to_pylist() == ["r-1"]
    assert events["event_time"] == events["receive_time"]  # both unreadable: the stream id's time


@pytest.mark.slow
def test_plain_records_are_archived_as_their_bytes_and_blob_references_inlined_in_one_file(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Most records reference no blob and carry no tags: they are archived unparsed, their columns from the
    entry's fields. Beside them in one batch: a record with a blob reference (inlined), a tagged one, a
    token stream, and one written before entries said whether they hold blobs (parsed to find out)."""
    client = redis_server.client()
    now = time.time_ns()
    sent: dict[str, bytes] = {}  # request id -> the record bytes in Redis
    pipe = client.pipeline(transaction=False)
    for i in range(12):
        record = synthetic_record(i, now + i * 1_000_000)
        del record.tags["team"]
        if i == 3:  # a blob reference, as the recorder writes one over its threshold
            digest = hashlib.sha256(record.request.inline).hexdigest()
            pipe.set(blob_key(digest), record.request.inline)
            record.request.blob_sha256 = digest
        if i == 5:
            record.tags["team"] = "search"
        if i == 7:
            record.stream.first_response_ns, record.stream.responses_total = 12_500_000, 7
        if i in (3, 4):  # a generation's usage: from the entry's fields (4), and from the parsed record (3)
            record.usage.prompt_tokens, record.usage.completion_tokens = 10 + i, 20 + i
        fields = entry_fields(record)
        if i == 9:  # an older recorder's entry, its request a blob
            digest = hashlib.sha256(b"old" + record.request.inline).hexdigest()
            pipe.set(blob_key(digest), b"old" + record.request.inline)
            record.request.blob_sha256 = digest
            fields = entry_fields(record)
            del fields["blobs"], fields["tags"]
        sent[record.request_id] = bytes(cast(bytes, fields["record"]))
        pipe.xadd(stream_key(SYNTHETIC), fields)  # type: ignore[arg-type]
    pipe.execute()
    url = local_archive(tmp_path)
    with running_archiver(tmp_path, redis_server.url) as archiver:
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60)
        assert metric(archiver, "splitstream_archive_missing_blobs_total") == 0
    rows = {row["request_id"]: row for row in raw_rows(url).to_pylist()}
    assert sorted(rows) == sorted(sent)
    for request_id, row in rows.items():
        i = int(request_id.removeprefix("r-"))
        record = recorder_pb2.CallRecord.FromString(row["record"])
        if i in (3, 9):  # the blob inlined, its size unchanged; nothing else changed
            expected = synthetic_record(i, now + i * 1_000_000)
            del expected.tags["team"]
            if i == 3:
                expected.usage.prompt_tokens, expected.usage.completion_tokens = 13, 23
            if i == 9:
                expected.request.inline = b"old" + expected.request.inline
            assert record.request.WhichOneof("body") == "inline"
            assert record.request.inline == expected.request.inline
        else:  # the very bytes Redis held
            assert row["record"] == sent[request_id]
        assert row["principal"] == f"tenant-{i % 2}"
        assert row["version"] == ("v1" if i % 3 else "v2")
        assert row["status"] == ("OK" if i % 5 else "UNAVAILABLE")
        assert row["tags"] == ([("team", "search")] if i == 5 else [])
        assert (row["streamed"], row["ttft_ms"], row["tokens"]) == ((True, 12.5, 7) if i == 7 else (False, None, None))
        usage = (10 + i, 20 + i) if i in (3, 4) else (None, None)
        assert (row["prompt_tokens"], row["completion_tokens"]) == usage


@pytest.mark.slow
def test_a_file_uploaded_but_never_acknowledged_is_rewritten_under_its_name_after_a_crash(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The narrowest crash: the file is in the archive, the XACK never reached Redis. Redis's CLIENT PAUSE
    holds the acknowledgement (a write) while the upload completes; the archiver is killed then."""
    client = redis_server.client()
    archive_dir = tmp_path / "archive"
    args = ("--flush-interval-s", "1", "--claim-idle-s", "60")
    with running_archiver(tmp_path, redis_server.url, *args) as archiver:
        ids = write_synthetic(client, 0, 40, start_ns=time.time_ns())
        wait_until(lambda: metric(archiver, "splitstream_archive_buffered_entries") == 40, timeout_s=30)
        client.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
        try:
            wait_until(lambda: list(archive_dir.rglob("*.parquet")), timeout_s=30, what="the upload")
            first_upload = sorted(path.name for path in archive_dir.rglob("*.parquet"))
            archiver.kill()
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
    assert client.xpending(stream_key(SYNTHETIC), ARCHIVE_GROUP)["pending"] == 40  # never acknowledged
    with running_archiver(tmp_path, redis_server.url, *args) as archiver:
        ids += write_synthetic(client, 40, 10, start_ns=time.time_ns())
        wait_until(lambda: archived_everything(client, stream_key(SYNTHETIC)), timeout_s=60, what="the restart")
        assert "rewriting a file uploaded but not acknowledged" in archiver.log()
    files = sorted(path.name for path in archive_dir.rglob("*.parquet"))
    assert set(first_upload) <= set(files)  # the same object, rewritten
    assert sorted(raw_rows(archive_dir.as_uri())["request_id"].to_pylist()) == sorted(ids)  # no row twice
