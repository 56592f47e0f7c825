"""Recording through the router's write-ahead log and splitstream-shipper, on real router, worker, shipper,
recorder and redis-server processes: what each crash can lose (nothing a client got an answer for), the
log's cap, damaged and torn entries, a full disk, and one shipper for several routers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from splitstream.common import wal
from tests.harness import (
    InferClient,
    ServiceProcess,
    SteadyLoad,
    free_port,
    make_request,
    run_module,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.recording_stack import HMAC_KEY, MODEL, RecordingStack, shipper_metric, wait_recorder_tries
from tests.test_recording_faults import UNBATCHED
from tests.tmpfs import small_tmpfs

CALLS = 2000


def run_shipper(*args: str) -> subprocess.CompletedProcess[str]:
    """A shipper started from the command line to its end (these tests give it flags it must refuse), with a
    recorder address nobody serves and ports of its own."""
    recorder = f"127.0.0.1:{free_port()}"
    return run_module(
        "splitstream.shipper",
        *args,
        "--recorder",
        recorder,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
    )


def answered(load: SteadyLoad) -> set[str]:
    return {request_id for _, code, _, request_id in load.outcomes if code == "OK"}


def run_load(stack: RecordingStack, calls: int, *, during: object = None) -> SteadyLoad:
    """``calls`` calls (each its own request id) from 8 threads; ``during()`` runs once half are done."""
    load = SteadyLoad(stack.router.address, MODEL, threads=8)
    with load:
        if during is not None:
            load.wait_calls(calls // 2, timeout_s=120)
            during()  # type: ignore[operator]
        load.wait_calls(calls, timeout_s=120)
    return load


def shipper_pid(stack: RecordingStack) -> int:
    """The pid of the shipper shipping the stack's log (it holds the log's lock file)."""

    def pid() -> int | None:
        text = (stack.spool_dir / "shipper.lock").read_text() if (stack.spool_dir / "shipper.lock").exists() else ""
        return int(text) if text.strip() else None

    return wait_for(pid, timeout_s=30, what="the shipper to lock the log")


@pytest.mark.slow
def test_a_router_killed_under_load_loses_no_call_a_client_got_an_answer_for(tmp_path: Path) -> None:
    stack = RecordingStack(tmp_path)
    try:
        load = SteadyLoad(stack.router.address, MODEL, threads=8)
        with load:
            load.wait_calls(CALLS, timeout_s=120)
            stack.router.kill()  # SIGKILL while 8 callers are mid-call
        ids = answered(load)
        assert len(ids) >= CALLS
        stack.router = stack.start_router()  # its shipper resumes the log where the old one stopped
        records = stack.wait_recorded(ids, timeout_s=120)
        assert ids <= {r.request_id for r in records}
    finally:
        stack.close()


@pytest.mark.slow
def test_a_shipper_killed_under_load_loses_no_answered_call(tmp_path: Path) -> None:
    stack = RecordingStack(tmp_path)
    try:
        first = shipper_pid(stack)
        load = run_load(stack, CALLS, during=lambda: os.kill(first, signal.SIGKILL))
        ids = answered(load)
        assert len(ids) >= CALLS
        records = stack.wait_recorded(ids, timeout_s=120)  # the router started a new shipper
        assert ids <= {r.request_id for r in records}
        assert shipper_pid(stack) != first
        assert load.errors() == []  # a dead shipper costs the callers nothing
    finally:
        stack.close()


#: What a log directory holds: segments, the shipper's cursor, its lock and the router's. Anything else (a
#: ``*.seg`` spool and its ``cursor.slots``) would be a second copy of the calls on disk.
LOG_FILES = ("wal-*.log", "wal.cursor", "shipper.lock", "router.lock")


class DirectoryWatch:
    """Notes, every 10 ms while it runs, every file in a directory that is not the log's: the log is the
    spool, so an outage must write nothing else."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.others: set[str] = set()
        self.log_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            with contextlib.suppress(FileNotFoundError):
                for path in self.directory.iterdir():
                    if not any(path.match(pattern) for pattern in LOG_FILES):
                        self.others.add(path.name)
            self.log_bytes = max(self.log_bytes, log_size(self.directory))

    def __enter__(self) -> DirectoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def log_size(directory: Path) -> int:
    total = 0
    for path in directory.glob("wal-*.log"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def router_counter(stack: RecordingStack, name: str, **labels: str) -> float:
    samples = _samples(stack.router.metrics_port, f"splitstream_router_{name}")
    return sum(value for sample_labels, value in samples if labels.items() <= sample_labels.items())


@pytest.mark.slow
def test_calls_answered_while_the_recorder_is_stopped_are_kept_in_the_log_alone_and_all_shipped_once_it_starts(
    tmp_path: Path,
) -> None:
    # Small segments, so that shipped ones are deleted (the newest one, being appended to, never is).
    stack = RecordingStack(tmp_path, router_args=("--log-segment-bytes", "65536"))
    try:
        stack.recorder.kill()
        with DirectoryWatch(stack.spool_dir) as watch:
            load = run_load(stack, CALLS)
            ids = answered(load)
            assert len(ids) >= CALLS
            wait_for(
                lambda: router_counter(stack, "log_appended_total", kind="call") >= len(ids),
                timeout_s=30,
                what="every answered call to be logged",
            )
            wait_recorder_tries(stack, 2)
        # No second copy: nothing but the log (and the shipper's cursor and lock) was ever in the directory,
        # and the log kept every call (nothing deleted while the recorder was away).
        assert watch.others == set()
        assert watch.log_bytes == log_size(stack.spool_dir) > 0
        stack.restart_recorder()
        records = stack.wait_recorded(ids, timeout_s=120)
        assert ids <= {r.request_id for r in records}  # each once, after de-duplication by request id
        assert shipper_metric(stack, "records_dropped_total") == 0
        wait_for(
            lambda: log_size(stack.spool_dir) < watch.log_bytes / 4,
            timeout_s=30,
            what="the shipped segments to be deleted",
        )
    finally:
        stack.close()


@pytest.mark.slow
def test_a_shipper_killed_while_the_recorder_is_away_loses_nothing_once_both_are_back(tmp_path: Path) -> None:
    stack = RecordingStack(tmp_path)
    try:
        stack.recorder.kill()
        first = shipper_pid(stack)
        with DirectoryWatch(stack.spool_dir) as watch:
            load = run_load(stack, CALLS, during=lambda: os.kill(first, signal.SIGKILL))
            assert shipper_pid(stack) != first  # the router started another, which resumes from the cursor
            wait_recorder_tries(stack, 2)
        assert watch.others == set()
        ids = answered(load)
        assert len(ids) >= CALLS
        assert load.errors() == []
        stack.restart_recorder()
        records = stack.wait_recorded(ids, timeout_s=120)
        assert ids <= {r.request_id for r in records}  # at least once: each once after de-duplication
        assert stack.raw_count() >= len(ids)
    finally:
        stack.close()


@pytest.mark.slow
def test_a_log_at_its_cap_drops_the_newest_calls_counted_and_ships_the_oldest_in_order(tmp_path: Path) -> None:
    stack = RecordingStack(tmp_path, router_args=("--spool-max-bytes", "60000"))
    try:
        stack.recorder.kill()
        client = InferClient(stack.router.address)
        ids = [f"seq-{i:04d}" for i in range(600)]
        with DirectoryWatch(stack.spool_dir) as watch:
            for request_id in ids:
                client.infer(make_request(MODEL, np.ones((1, 4), np.float32)), metadata=[("x-request-id", request_id)])
            client.close()
            wait_recorder_tries(stack, 2)
        # The router's log filled to its cap and refused the newest calls, counted by reason; the shipper
        # copied nothing to a spool of its own, so it dropped nothing.
        log_full = router_counter(stack, "log_records_dropped_total", reason="log_full")
        logged = router_counter(stack, "log_appended_total", kind="call")
        assert log_full > 0
        assert logged + log_full == len(ids)
        assert watch.others == set()
        assert 54000 < log_size(stack.spool_dir) <= 60000
        assert shipper_metric(stack, "records_dropped_total") == 0
        stack.restart_recorder()
        kept = int(logged)
        records = stack.wait_recorded(set(ids[:kept]), timeout_s=60)
        in_stream = [r.request_id for r in records]
        assert in_stream == ids[:kept]  # the oldest kept, shipped in the order they were answered
        # With room again (segments shipped and deleted), calls are logged again.
        client = InferClient(stack.router.address)

        def logged_again() -> bool:
            client.infer(make_request(MODEL, np.ones((1, 4), np.float32)), metadata=[("x-request-id", "after")])
            return router_counter(stack, "log_appended_total", kind="call") > logged

        wait_for(logged_again, timeout_s=30, interval_s=0.5, what="the log to take calls again")
        client.close()
    finally:
        stack.close()


def _samples(port: int, name: str) -> list[tuple[dict[str, str], float]]:
    from tests.harness import metric_samples

    return metric_samples(scrape_metrics(port), name)


def _call_payload(request_id: str, request: bytes = b"request-bytes") -> bytes:
    return wal.encode_call(
        request_id=request_id,
        model=MODEL,
        version="v1",
        arm="v1",
        code=0,
        details="",
        endpoint="127.0.0.1:1",
        router_id="hand-written",
        principal="",
        receive_unix_ns=time.time_ns(),
        latency_ns=1000,
        flags=0,
        assignment=-1,
        shadows_expected=0,
        routing_key_hmac="",
        phase=b"",
        metadata=b"",
        stream=b"",
        request=request,
        response=b"response-bytes",
    )


def start_shipper(stack: RecordingStack, *log_dirs: Path, metrics_port: int) -> ServiceProcess:
    port = free_port()
    args = ["--recorder", f"127.0.0.1:{stack.recorder_port}", "--host", "127.0.0.1", "--port", str(port)]
    for directory in log_dirs:
        args += ["--log-dir", str(directory)]
    args += ["--metrics-port", str(metrics_port), "--record-batch-interval-ms", "20"]
    process = ServiceProcess(f"shipper-{port}", "splitstream.shipper", args, log_dir=stack.tmp, port=port)
    stack.stack.processes.append(process)
    return process.start()


@pytest.mark.slow
def test_damaged_and_torn_log_entries_are_skipped_and_counted_and_the_rest_shipped(tmp_path: Path) -> None:
    stack = RecordingStack(tmp_path, router_args=("--shipper", "external"))
    try:
        log_dir = tmp_path / "hand-log"
        writer = wal.WalWriter(log_dir, max_bytes=1 << 30, segment_bytes=1 << 20)
        for i in range(10):
            assert writer.append(wal.CALL, _call_payload(f"hand-{i}"))
        writer.close()
        (segment,) = log_dir.glob("wal-*.log")
        data = bytearray(segment.read_bytes())
        entry = len(data) // 10
        data[3 * entry + 40] ^= 0xFF  # a flipped bit in the fourth entry's payload
        torn = wal.frame(wal.CALL, _call_payload("hand-torn"))
        segment.write_bytes(bytes(data) + torn[: len(torn) // 2])  # the router killed mid-append
        writer = wal.WalWriter(log_dir, max_bytes=1 << 30, segment_bytes=1 << 20)  # a restarted router
        assert writer.append(wal.CALL, _call_payload("hand-10"))
        writer.append(wal.CALL, b"\x00" * 7)  # checks, but does not parse
        writer.close()
        stack.shipper_metrics_port = free_port()
        shipper = start_shipper(stack, log_dir, metrics_port=stack.shipper_metrics_port)
        expected = {f"hand-{i}" for i in range(11)} - {"hand-3"}
        records = stack.wait_recorded(expected)
        assert {r.request_id for r in records} == expected
        wait_for(
            lambda: shipper_metric(stack, "log_damaged_total", reason="torn") == 1,
            timeout_s=10,
            what="the torn tail to be counted",
        )
        assert shipper_metric(stack, "log_damaged_total", reason="damaged") >= 1
        assert shipper_metric(stack, "log_damaged_total", reason="undecodable") == 1
        # Each skipped range is logged with the segment and the offset where it starts: the fourth entry's.
        skipped = [json.loads(line) for line in shipper.log().splitlines() if "log range skipped" in line]
        assert any(
            e["reason"] == "damaged" and e["segment"] == str(segment) and e["offset"] == 3 * entry for e in skipped
        ), skipped
    finally:
        stack.close()


@pytest.mark.slow
def test_calls_are_answered_and_drops_counted_when_the_logs_disk_is_full(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "spool", "256k"):
        stack = RecordingStack(tmp_path, versions={"v1": {"scale": 2.0, "config": UNBATCHED}})
        try:
            stack.recorder.kill()  # the log only grows: the shipper's spool shares the full disk
            client = InferClient(stack.router.address)
            x = np.full((32, 4), 0.5, dtype=np.float32)
            errors = []

            def log_errors() -> float:
                return sum(
                    value
                    for labels, value in _samples(
                        stack.router.metrics_port, "splitstream_router_log_records_dropped_total"
                    )
                    if labels.get("reason") == "log_error"
                )

            calls = 0
            while log_errors() == 0:
                assert calls < 5000, "the log never filled its disk"
                calls += 1
                try:
                    client.infer(make_request(MODEL, x), metadata=[("x-request-id", f"full-{calls}")])
                except grpc.RpcError as error:
                    errors.append(error.code())
            for i in range(20):  # every call on the full disk answered, and its loss counted
                client.infer(make_request(MODEL, x), metadata=[("x-request-id", f"past-{i}")])
            client.close()
            assert errors == []
            assert log_errors() >= 20
        finally:
            stack.close()


@pytest.mark.slow
def test_one_external_shipper_ships_the_logs_of_several_routers(tmp_path: Path) -> None:
    stack = RecordingStack(tmp_path, router_args=("--shipper", "external"))
    try:
        second_dir = tmp_path / "spool-2"
        second = stack.stack.router(
            stack.registry,
            "--recorder",
            f"127.0.0.1:{stack.recorder_port}",
            "--hmac-key",
            HMAC_KEY,
            "--log-dir",
            str(second_dir),
            "--shipper",
            "external",
        )
        ids = set()
        for router, prefix in ((stack.router, "a"), (second, "b")):
            client = InferClient(router.address)
            for i in range(50):
                ids.add(f"{prefix}-{i}")
                client.infer(
                    make_request(MODEL, np.ones((1, 4), np.float32)), metadata=[("x-request-id", f"{prefix}-{i}")]
                )
            client.close()
        assert not stack.records()  # nobody ships until the host's shipper runs
        start_shipper(stack, stack.spool_dir, second_dir, metrics_port=free_port())
        records = stack.wait_recorded(ids)
        assert ids <= {r.request_id for r in records}
        assert len({r.router_id for r in records if r.request_id in ids}) == 2
    finally:
        stack.close()


def test_the_shipper_refuses_spool_max_bytes_with_exit_2_since_the_router_caps_the_log(tmp_path: Path) -> None:
    """The shipper took ``--spool-max-bytes`` and did nothing with it (the router's own flag caps the log, by
    refusing appends), so a cap set on an external shipper silently capped nothing. Now it is an unknown option:
    exit 2 and one line naming it, before anything is read or shipped."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / wal.segment_name(1)).write_bytes(wal.frame(wal.CALL, _call_payload("kept")))
    result = run_shipper("--log-dir", str(log_dir), "--spool-max-bytes", "1000")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["splitstream-shipper: error: unrecognized arguments: --spool-max-bytes 1000"], result.stderr
    assert sorted(path.name for path in log_dir.iterdir()) == [wal.segment_name(1)]  # nothing read, locked, moved


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--shadow-wait-s", "nan", "must be a finite number, got nan"),
        ("--shadow-wait-s", "inf", "must be a finite number, got inf"),
        ("--record-batch-interval-ms", "inf", "must be a finite number, got inf"),
        # Finite, but it held a quiet router's calls until a batch filled.
        ("--record-batch-interval-ms", "1e300", "at most 60000 (a minute), got 1e+300"),
        ("--flush-timeout-s", "inf", "must be a finite number, got inf"),
        ("--record-batch-max-bytes", "1000", "must be at least 65536 (64 KiB), got 1000"),
        # More records and events than the recorder takes in one batch: every full batch refused, then resent.
        ("--record-batch-size", "99999999999999999999", "at most 2048 (a batch carries as many events; the recorder"),
    ],
)
def test_the_shipper_refuses_a_value_that_cannot_work_with_exit_2_naming_the_flag(
    tmp_path: Path, flag: str, value: str, named: str
) -> None:
    """These started a shipper that misbehaved quietly: ``--shadow-wait-s nan`` shipped every call without its
    shadows, ``inf`` held records (or a SIGTERM's drain) for ever, and a batch cap of 1000 bytes dropped every
    record as too large even without its payloads."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / wal.segment_name(1)).write_bytes(wal.frame(wal.CALL, _call_payload("kept")))
    result = run_shipper("--log-dir", str(log_dir), flag, value)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"splitstream-shipper: error: {flag}: {named}"), result.stderr
    assert sorted(path.name for path in log_dir.iterdir()) == [wal.segment_name(1)]


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        # More records and events than the recorder takes in one batch.
        (
            ("--record-batch-size", "5000"),
            "--record-batch-size: at most 2048 (a batch carries as many events; the recorder takes 4096 a batch), "
            "got 5000",
        ),
        # Finite, so taken and handed to the child shipper, which held a quiet router's calls until a batch filled
        # (hours, or until the next SIGTERM's drain).
        (("--record-batch-interval-ms", "1e300"), "--record-batch-interval-ms: at most 60000 (a minute), got 1e+300"),
        # The child shipper refuses 0 (and nan): the router checks the record-batch flags as the shipper does.
        (("--record-batch-interval-ms", "0"), "--record-batch-interval-ms: must be positive, got 0.0"),
        # Under 64 KiB (with a stream cap under half of it): handed to the child shipper, which dropped every record
        # as too large.
        (
            ("--record-batch-max-bytes", "1000", "--record-stream-max-bytes", "100"),
            "--record-batch-max-bytes: must be at least 65536 (64 KiB), got 1000",
        ),
    ],
)
def test_the_router_refuses_a_recording_flag_its_child_shipper_could_not_work_with_exit_2(
    tmp_path: Path, flags: tuple[str, ...], line: str
) -> None:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": ["127.0.0.1:1"]}}})
    result = run_module(
        "splitstream.router", "--registry", f"file:{registry}", "--port", "0", "--metrics-port", "0",
        "--recorder", "127.0.0.1:1", "--hmac-key", "k", "--log-dir", str(tmp_path / "log"), *flags,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"splitstream-router: error: {line}"], result.stderr


def test_the_shipper_refuses_a_log_dir_given_twice_with_exit_2(tmp_path: Path) -> None:
    """A directory given twice (here ``log`` and ``log/``) made the shipper wait for ever on the lock it held
    itself: it said it was shipping and shipped nothing."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    result = run_shipper("--log-dir", str(log_dir), "--log-dir", f"{log_dir}/")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"splitstream-shipper: error: --log-dir: {log_dir}/ is the same directory as {log_dir}: give each log once"
    ], result.stderr


@pytest.mark.parametrize("program", ["shipper", "router"])
def test_an_empty_log_directory_is_refused_with_exit_2_not_taken_as_the_working_directory(
    tmp_path: Path, program: str
) -> None:
    """``--log-dir "$UNSET"`` (on a shipper or a router) was the working directory: the shipper shipped it and
    wrote its cursor and lock there, the router its segments."""
    work = tmp_path / "work"
    work.mkdir()
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": ["127.0.0.1:1"]}}})
    flag, args = {
        "shipper": ("--log-dir", ["--recorder", f"127.0.0.1:{free_port()}", "--host", "127.0.0.1", "--port", "0"]),
        "router": ("--log-dir", ["--registry", f"file:{registry}", "--port", "0", "--recorder", "127.0.0.1:1",
                                   "--hmac-key", "k"]),
    }[program]  # fmt: skip
    result = run_module(f"splitstream.{program}", *args, "--metrics-port", "0", flag, "", cwd=work)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"splitstream-{program}: error: {flag}: must name a directory, got an empty value"
    ], result.stderr
    assert list(work.iterdir()) == []


def test_a_shipper_that_cannot_lock_its_log_exits_2_instead_of_serving_and_shipping_nothing(tmp_path: Path) -> None:
    """The lock file could not be opened (here a directory in its place; as well a log directory the shipper may
    not write to): the tail's task died unseen while the shipper stayed up, healthy, shipping nothing."""
    log_dir = tmp_path / "log"
    (log_dir / "shipper.lock").mkdir(parents=True)
    (log_dir / wal.segment_name(1)).write_bytes(wal.frame(wal.CALL, _call_payload("kept")))
    result = run_shipper("--log-dir", str(log_dir))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1:] == [
        f"splitstream-shipper: error: --log-dir: Is a directory: {log_dir / 'shipper.lock'}"
    ], result.stderr
    assert (log_dir / wal.segment_name(1)).exists()  # nothing read past, nothing deleted


def test_a_log_dir_that_does_not_exist_is_refused_with_exit_2_not_created(tmp_path: Path) -> None:
    """A mistyped ``--log-dir`` was created, locked and shipped: the shipper served, healthy, shipping nothing while
    the router's real log grew. The router creates its log directory; the shipper only ships one that exists."""
    typo = tmp_path / "splitsream-spool"
    result = run_shipper("--log-dir", str(typo))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"splitstream-shipper: error: --log-dir {typo}: no such directory (give a router's --log-dir)"
    ], result.stderr
    assert not typo.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("processes", "flush_s"),
    [(1, "3600"), (2, "0.2")],
    ids=["1-process-read-at-scrape", "2-processes-synced-at-each-flush"],
)
def test_the_appended_counter_counts_every_logged_call_whether_scraped_from_one_process_or_from_children_files(
    tmp_path: Path, processes: int, flush_s: str
) -> None:
    """The router counts appends as plain integers (prometheus-client's ``Counter.inc`` was a ninth of an
    append) and adds them to ``splitstream_router_log_appended_total`` when it is read: a single router at its
    scrape (exact at once, however long its flush interval), a ``--processes`` child at each log flush (its
    parent's scrape reads the children's metric files, which only the counter writes)."""
    args = ("--log-flush-interval-s", flush_s) + (("--processes", str(processes)) if processes > 1 else ())
    stack = RecordingStack(tmp_path, router_args=args)
    try:
        before = router_counter(stack, "log_appended_total", kind="call")
        client = InferClient(stack.router.address)
        calls = 60
        for i in range(calls):
            client.infer(make_request(MODEL, np.ones((1, 4), np.float32)), metadata=[("x-request-id", f"count-{i}")])
        client.close()
        if processes == 1:
            assert router_counter(stack, "log_appended_total", kind="call") == before + calls
        else:
            wait_for(
                lambda: router_counter(stack, "log_appended_total", kind="call") == before + calls,
                timeout_s=10,
                what=f"the parent's scrape to count all {calls} appends",
            )
        time.sleep(0.5)  # a later flush or scrape adds nothing twice
        assert router_counter(stack, "log_appended_total", kind="call") == before + calls
        records = stack.wait_recorded({f"count-{i}" for i in range(calls)})
        assert len({r.request_id for r in records}) == calls
    finally:
        stack.close()


@pytest.mark.slow
def test_at_a_low_call_rate_the_shipper_reads_the_log_per_batch_interval_not_per_call(tmp_path: Path) -> None:
    """At 100 calls/s each read found one or two entries and cost the shipper a thread hop, a directory scan and
    an open: 470 µs of CPU per call, more than the router's own recording. New entries now wait in the log a
    quarter of the batch interval (50 ms at 200) to be read together; every call is still shipped."""
    stack = RecordingStack(tmp_path, router_args=("--record-batch-interval-ms", "200"))
    try:
        wait_for(lambda: shipper_metric(stack, "log_reads_total") > 0, timeout_s=10, what="the shipper's first read")
        client = InferClient(stack.router.address)
        before = shipper_metric(stack, "log_reads_total")
        started = time.monotonic()
        ids = [f"trickle-{i}" for i in range(100)]
        for i, request_id in enumerate(ids):  # about 50 calls/s, paced as a client's would be
            time.sleep(max(started + i * 0.02 - time.monotonic(), 0))
            client.infer(make_request(MODEL, np.ones((1, 4), np.float32)), metadata=[("x-request-id", request_id)])
        reads = shipper_metric(stack, "log_reads_total") - before
        window_s = time.monotonic() - started  # at least the window between the two counts
        client.close()
        # A read per 50 ms at most (the reads made every 0.25 s whatever comes are not due while these come),
        # not a second one at once that finds the log's end; every 20 ms, twice: about 180.
        assert 0 < reads <= window_s / 0.05 + 2, f"{reads} reads in {window_s:.2f} s"
        assert {r.request_id for r in stack.wait_recorded(set(ids))} >= set(ids)
    finally:
        stack.close()


@pytest.mark.slow
def test_an_idle_shipper_backs_off_its_reads_and_still_ships_the_next_call(tmp_path: Path) -> None:
    """Polled every 20 ms, a shipper with nothing to ship used 6 % of a core (one per router on a host). Caught
    up, it now backs off to a read every 0.25 s; the first call after the quiet spell is shipped all the same."""
    stack = RecordingStack(tmp_path)
    try:
        wait_for(lambda: shipper_metric(stack, "log_reads_total") > 0, timeout_s=10, what="the shipper's first read")
        time.sleep(1.5)  # 20 + 40 + 80 + 160 ms, then 250: backed off well before this
        started = time.monotonic()
        before = shipper_metric(stack, "log_reads_total")
        time.sleep(2.0)
        reads = shipper_metric(stack, "log_reads_total") - before
        window_s = time.monotonic() - started  # at least the window between the two counts
        assert 0 < reads <= window_s / 0.25 + 2, f"{reads} reads in {window_s:.2f} s"  # at 20 ms: about 100
        client = InferClient(stack.router.address)
        client.infer(make_request(MODEL, np.ones((1, 4), np.float32)), metadata=[("x-request-id", "after-quiet")])
        client.close()
        assert "after-quiet" in {r.request_id for r in stack.wait_recorded({"after-quiet"})}
    finally:
        stack.close()
