"""Recording into a real Redis Cluster (``redis+cluster://``): what one Redis does, a cluster does too.

Three ``redis-server --cluster-enabled yes`` masters joined by ``redis-cli --cluster create`` (plus a
replica each for the failover test). The model's call stream, its feedback stream and its blobs land on
different masters, so every path that used to be one pipeline to one server now crosses nodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitstream.common.names import check_model_name
from splitstream.common.proto.splitstream.v1 import feedback_pb2, feedback_pb2_grpc
from splitstream.common.records import archive_mark_key, blob_key, feedback_key, feedback_seen_key, stream_key
from tests import launcher
from tests.experiments import Call, Event, phase, write_calls, write_feedback
from tests.harness import ROOT, InferClient, SteadyLoad, free_port, make_request, wait_for
from tests.recording_stack import MODEL, RecordingStack
from tests.redis_server import RedisClusterServers, RedisServer


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    with RedisClusterServers(tmp_path_factory.mktemp("cluster")) as servers:
        yield servers


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, cluster: RedisClusterServers) -> Iterator[RecordingStack]:
    # Every payload over 64 bytes becomes a blob: blobs and records on different masters.
    stack = RecordingStack(
        tmp_path_factory.mktemp("cluster-stack"), redis=cluster, recorder_args=("--blob-threshold-bytes", "64")
    )
    yield stack
    stack.close()


def run(module: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    return launcher.run(
        [sys.executable, "-m", module, *args], env=clean, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )


def cluster_of(stack: RecordingStack) -> RedisClusterServers:
    assert isinstance(stack.redis, RedisClusterServers)
    return stack.redis


def report(stack: RecordingStack, events: list[feedback_pb2.FeedbackEvent]) -> int:
    import grpc

    with grpc.insecure_channel(stack.router.address) as channel:
        reply = feedback_pb2_grpc.FeedbackStub(channel).Report(feedback_pb2.FeedbackReport(events=events), timeout=10)
    return int(reply.accepted)


def test_the_layout_keeps_each_scripts_keys_in_one_slot(cluster: RedisClusterServers) -> None:
    with cluster.client() as client:
        feedback = feedback_key(MODEL)
        assert client.keyslot(feedback_seen_key(MODEL, "purchase", "order-1")) == client.keyslot(feedback)
        calls = stream_key(MODEL)
        assert client.keyslot(archive_mark_key(calls)) == client.keyslot(calls)


@pytest.mark.slow
def test_a_window_recorded_into_a_cluster_replays_whole_with_its_blobs(stack: RecordingStack, tmp_path: Path) -> None:
    client = InferClient(stack.router.address)
    rng = np.random.default_rng(5)
    since = time.time_ns()
    sent = []
    for i in range(40):
        rows = 8 if i % 2 else 1  # 8 rows: 128-byte tensors, stored as blobs
        x = rng.uniform(0.5, 1.5, (rows, 4)).astype(np.float32)
        client.infer(make_request(MODEL, x), metadata=[("x-request-id", f"w-{i}")])
        sent.append(f"w-{i}")
    client.close()
    records = stack.wait_recorded(set(sent))
    blobs = {r.request.blob_sha256 for r in records if r.request.blob_sha256}
    assert len(blobs) >= 20
    # Blobs on other masters than the stream: "blob before its record" had to hold across nodes.
    masters = {cluster_of(stack).master_of(blob_key(digest)).port for digest in blobs}
    assert masters - {cluster_of(stack).master_of(stream_key(MODEL)).port}
    until = time.time_ns()
    result = run(
        "splitstream.replayer",
        "--redis-url", stack.redis.url, "--model", MODEL, "--output-dir", str(tmp_path),
        "--target", stack.router.address, "--speed", "max", "--no-progress",
        "--since", f"{since / 1e9:.9f}", "--until", f"{until / 1e9:.9f}",
        "--gate", "mismatch_rate<=0,status_change_rate<=0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r["request_id"] for r in results) == sorted(sent)
    assert {r["outcome"] for r in results} == {"match"}


def test_feedback_resent_with_one_idempotency_key_is_written_once_in_a_cluster(stack: RecordingStack) -> None:
    event = feedback_pb2.FeedbackEvent(
        model=MODEL, request_id="w-1", metric="purchase", value=3.0, idempotency_key="order-cluster"
    )
    other = feedback_pb2.FeedbackEvent(model=MODEL, request_id="w-2", metric="purchase", value=1.0)
    assert report(stack, [event, event, other]) == 3
    assert report(stack, [event]) == 1

    def purchases() -> list[Any] | None:
        with stack.redis.client() as client:
            found = [f for _, f in client.xrange(feedback_key(MODEL)) if f[b"metric"] == b"purchase"]
            seen = client.exists(feedback_seen_key(MODEL, "purchase", "order-cluster"))
        return found if len(found) >= 2 and seen else None

    found = wait_for(purchases, timeout_s=30, interval_s=0.2, what="the events to be recorded")
    time.sleep(0.5)  # the resent copies are acknowledged by now; nothing more may arrive
    with stack.redis.client() as client:
        found = [f for _, f in client.xrange(feedback_key(MODEL)) if f[b"metric"] == b"purchase"]
    assert sorted(f[b"request_id"] for f in found) == [b"w-1", b"w-2"]
    assert "CROSSSLOT" not in stack.recorder.log()


@pytest.mark.slow
def test_the_analysis_reads_a_cluster_as_it_reads_one_redis(cluster: RedisClusterServers, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    t0 = (time.time_ns() // 10**9 - 3 * 3600) * 10**9
    calls = []
    events = []
    for i in range(600):
        arm = "v1" if i % 2 == 0 else "v2"
        unit = hashlib.sha256(f"user-{i}".encode()).hexdigest()
        call = Call(f"c{i}", t0 + int(rng.integers(0, 3000 * 10**9)), arm, unit=unit)
        calls.append(call)
        if rng.random() < (0.1 if arm == "v1" else 0.2):
            events.append(
                Event("click", 1.0, call.time_ns + 10**9, request_id=call.request_id, idempotency_key=f"k{i}")
            )
    single = RedisServer(tmp_path / "single").start()
    try:
        for client in (single.client(), cluster.client()):
            with client:
                write_calls(client, "shop", calls, phase({"v1": 50, "v2": 50}, "v1"))  # type: ignore[arg-type]
                write_feedback(client, "shop", events)  # type: ignore[arg-type]
        outputs: list[tuple[str, Any]] = []
        for url in (single.url, cluster.url):
            out = tmp_path / f"out-{len(outputs)}"
            result = run(
                "splitstream.admin", "analyze", "shop", "--redis-url", url, "--metric", "click:proportion",
                "--since", str(t0 // 10**9), "--until", str(t0 // 10**9 + 3600), "--output-dir", str(out),
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            document = json.loads((out / "analysis.json").read_text())
            document.pop("generated_at", None)
            outputs.append((result.stdout, document))
        assert outputs[0] == outputs[1]
        assert "click" in outputs[0][0]
    finally:
        single.stop()


@pytest.mark.slow
def test_the_archiver_consumes_a_cluster_and_trim_archived_trims_only_what_it_holds(tmp_path: Path) -> None:
    import pyarrow.dataset as ds

    with RedisClusterServers(tmp_path / "cluster") as cluster:
        stack = RecordingStack(
            tmp_path / "stack", redis=cluster, recorder_args=("--retention-maxlen", "20", "--trim-archived")
        )
        archiver = None
        try:
            client = InferClient(stack.router.address)

            def send(prefix: str, count: int) -> set[str]:
                for i in range(count):
                    x = np.ones((1, 4), np.float32)
                    client.infer(make_request(MODEL, x), metadata=[("x-request-id", f"{prefix}-{i}")])
                return {f"{prefix}-{i}" for i in range(count)}

            before = send("before", 150)
            stack.wait_recorded(before)
            assert stack.raw_count() >= 150  # no archiver yet: retention trims nothing
            # The feedback stream too: the archiver reads streams of several slots (one XREADGROUP per slot).
            report(stack, [feedback_pb2.FeedbackEvent(model=MODEL, request_id="before-1", metric="m", value=1.0)])
            archive = (tmp_path / "archive").as_uri()
            archiver = start_archiver(tmp_path, cluster.url, archive)

            def archived(kind: str) -> set[str]:
                try:
                    table = ds.dataset(tmp_path / "archive" / kind, format="parquet", partitioning="hive").to_table()
                except (FileNotFoundError, OSError):
                    return set()
                return set(table["request_id"].to_pylist())

            wait_for(lambda: before <= archived("calls"), timeout_s=60, what="the calls archived")
            wait_for(lambda: "before-1" in archived("feedback"), timeout_s=60, what="the feedback archived")
            wait_for(
                lambda: cluster.client().get(archive_mark_key(stream_key(MODEL))) is not None,
                timeout_s=30,
                what="the archive mark",
            )
            after = send("after", 30)
            wait_for(lambda: stack.raw_count() < 100, timeout_s=30, what="the recorder to trim what is archived")
            in_redis = {r.request_id for r in stack.records()}
            assert before - in_redis  # trimmed ...
            assert before - in_redis <= archived("calls")  # ... and only what the archive holds
            wait_for(lambda: before | after <= in_redis | archived("calls") | {r.request_id for r in stack.records()},
                     timeout_s=30, what="every call in Redis or the archive")  # fmt: skip
            client.close()
        finally:
            if archiver is not None:
                archiver.stop()
            stack.close()


def start_archiver(tmp: Path, redis_url: str, archive: str) -> Any:
    from tests.harness import ServiceProcess

    port = free_port()
    args = [
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(free_port()), "--redis-url", redis_url,
        "--archive", archive, "--consumer", "a", "--flush-interval-s", "0.3", "--scan-interval-s", "0.3",
    ]  # fmt: skip
    return ServiceProcess(f"archiver-{port}", "splitstream.archiver", args, log_dir=tmp, port=port).start()


@pytest.mark.slow
def test_a_master_killed_under_load_loses_no_answered_call(tmp_path: Path) -> None:
    """SIGKILL the master holding the call stream mid-load: its replica is promoted, the recorder is
    NOT_SERVING meanwhile (the router keeps and resends its batches), and afterwards every call the router
    answered is in the stream, once after de-duplication by request id."""
    with RedisClusterServers(tmp_path / "cluster", replicas=1) as cluster:
        stack = RecordingStack(tmp_path / "stack", redis=cluster, recorder_args=("--redis-wait-replicas", "1"))
        try:
            with SteadyLoad(stack.router.address, MODEL, threads=2, pause_s=0.005) as load:
                load.wait_calls(100)
                master = cluster.master_of(stack_key := stream_key(MODEL))
                cluster.kill(master)
                load.wait_calls(50)
                cluster.wait_ok(timeout_s=60)
                assert cluster.master_of(stack_key).port != master.port  # the replica took over
                load.wait_calls(200)
            answered = {request_id for _, code, _, request_id in load.outcomes if code == "OK"}
            assert len(answered) >= 350
            records = stack.wait_recorded(answered, timeout_s=90)
            assert answered <= {r.request_id for r in records}  # records(): once per request id
            # The outage was seen as one: NOT_SERVING while the master was gone, the router kept the batches.
            assert "redis unreachable; not serving" in stack.recorder.log()
            assert "recorder acknowledging again" in stack.router.log()
        finally:
            stack.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://127.0.0.1:notaport", "is not host:port"),
        ("redis+cluster://127.0.0.1:7000/3", "only database 0"),
        ("redis+cluster://:cluster-secret@127.0.0.1:7000?bogus=1", "'bogus'"),
    ],
)
def test_a_cluster_url_that_cannot_work_is_refused_with_exit_2_and_one_line(url: str, message: str) -> None:
    result = run("splitstream.recorder", "--redis-url", url, "--port", str(free_port()), "--metrics-port", "0")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "cluster-secret" not in result.stderr


@pytest.mark.parametrize("model", ["a{b}", "x}y", "{tag"])
def test_a_model_name_with_a_brace_is_refused_since_it_would_move_its_keys_slot(model: str) -> None:
    with pytest.raises(ValueError, match="brace"):
        check_model_name(model)


async def test_with_wait_replicas_a_batch_no_replica_confirmed_is_not_acknowledged(tmp_path: Path) -> None:
    """One Redis without a replica: the batch is written, but ``--redis-wait-replicas 1`` cannot be met, so
    the write fails as unavailable (the router keeps the batch) and names why."""
    from splitstream.common.records import entry_fields
    from splitstream.common.redis_url import open_redis
    from splitstream.recorder.errors import StoreUnavailable
    from splitstream.recorder.writer import RedisWriter, StreamEntry, WriteBatch
    from tests.test_archive import synthetic_record

    server = RedisServer(tmp_path / "redis").start()
    redis = open_redis(server.url)
    writer = RedisWriter(
        redis, retention_maxlen=0, retention_age_s=0, blob_ttl_s=0, wait_replicas=1, wait_timeout_ms=100
    )
    try:
        batch = WriteBatch(entries=[StreamEntry(stream_key("synth"), entry_fields(synthetic_record(1, 0)))], blobs={})
        with pytest.raises(StoreUnavailable, match="only 0 of 1 replicas confirmed"):
            await writer.write(batch)
    finally:
        await redis.aclose()
        server.stop()


@pytest.mark.slow
def test_a_recorder_started_before_its_cluster_is_not_serving_then_serves_once_the_cluster_is_up(
    tmp_path: Path,
) -> None:
    """No node answers: redis-py's cluster client raises RedisClusterException, no RedisError, which
    killed the recorder's Redis watch (the recorder exited 1 with a traceback). Now it is Redis unreachable,
    as with one Redis: NOT_SERVING, then SERVING once the cluster is created."""
    from tests.harness import ServiceProcess, health_status

    cluster = RedisClusterServers(tmp_path / "cluster")  # ports chosen, nothing started yet
    port = free_port()
    recorder = ServiceProcess(
        f"recorder-{port}", "splitstream.recorder",
        ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--redis-url", cluster.url,
         "--redis-timeout-s", "1", "--health-interval-s", "0.5"],
        log_dir=tmp_path, port=port,
    )  # fmt: skip
    try:
        recorder.start(wait_serving=False)
        wait_for(lambda: "redis unreachable; not serving" in recorder.log(), timeout_s=30, what="NOT_SERVING")
        assert health_status(recorder.address) == 2  # NOT_SERVING
        cluster.start()
        wait_for(lambda: health_status(recorder.address) == 1, timeout_s=30, what="the recorder to serve")
        assert recorder.process is not None
        assert recorder.process.poll() is None
        assert "Traceback" not in recorder.log()
    finally:
        recorder.stop()
        cluster.stop()
