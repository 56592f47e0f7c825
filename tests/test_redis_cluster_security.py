"""A Redis Cluster over TLS with least-privilege ACL users: recorder, replayer and analysis reach it.

Three masters listening on TLS only (client connections, the cluster bus and replication), the default
user behind a password, and the documented ACL users: docs/security.md's lines plus docs/scaling.md's
Redis Cluster additions, set on every node. The recorder writes as ``splitstream-recorder``, the replayer and
``splitstream analyze`` read as ``splitstream-reader``, each named in a ``rediss+cluster://`` URL. A
recorder given the read-only user cannot write: it says so (NOT_SERVING, NOPERM in its log) and the router
keeps every batch, so nothing is lost once the recorder runs as the right user.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from splitstream.common.proto.splitstream.v1 import feedback_pb2, feedback_pb2_grpc
from splitstream.common.records import archive_mark_key, feedback_key, stream_key
from tests.certs import Pki
from tests.harness import ROOT, InferClient, ServiceProcess, free_port, health_status, make_request, wait_for
from tests.recording_stack import MODEL, RecordingStack, shipper_metric
from tests.redis_server import RedisClusterServers, RedisTls
from tests.test_redis_cluster import run
from tests.test_tls import ARCHIVER_ACL, READER_ACL, RECORDER_ACL

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow

SERVING, NOT_SERVING = 1, 2


def readme_cluster_acl(user: str) -> str:
    """docs/scaling.md's ``ACL SETUSER`` additions for ``user`` (Redis Cluster; the tests apply the
    documented lines, so the documentation cannot drift from what works)."""
    for line in (ROOT / "docs" / "scaling.md").read_text().splitlines():
        if line.startswith("redis-cli ") and f" ACL SETUSER {user} " in line:
            return " ".join(shlex.split(line.partition(" ACL SETUSER ")[2]))
    raise AssertionError(f"docs/scaling.md has no Redis Cluster ACL SETUSER line for {user}")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[RedisClusterServers]:
    server = pki.issue("redis")
    users = [RECORDER_ACL, READER_ACL, ARCHIVER_ACL]
    users += [
        readme_cluster_acl(user) for user in ("splitstream-recorder", "splitstream-reader", "splitstream-archiver")
    ]
    tls = RedisTls(server.cert, server.key, pki.ca)
    with RedisClusterServers(tmp_path_factory.mktemp("cluster"), tls=tls, password="admin-pw", users=users) as servers:
        yield servers


def request_ids(cluster: RedisClusterServers) -> set[str]:
    with cluster.client() as client:
        return {fields[b"request_id"].decode() for _, fields in client.xrange(stream_key(MODEL))}


def call(stack: RecordingStack, prefix: str, count: int) -> set[str]:
    client = InferClient(stack.router.address)
    try:
        for i in range(count):
            rows = 8 if i % 2 else 1  # 8 rows: a blob, on another master than the stream
            client.infer(
                make_request(MODEL, np.ones((rows, 4), np.float32)), metadata=[("x-request-id", f"{prefix}-{i}")]
            )
    finally:
        client.close()
    return {f"{prefix}-{i}" for i in range(count)}


def test_the_recorder_writes_and_the_replayer_and_analysis_read_a_tls_cluster_as_their_acl_users(
    cluster: RedisClusterServers, pki: Pki, tmp_path: Path
) -> None:
    ca = ("--redis-tls-ca", str(pki.ca))
    recorder_url = cluster.url_for("splitstream-recorder", "recorder-pw")
    reader_url = cluster.url_for("splitstream-reader", "reader-pw")
    assert recorder_url.startswith("rediss+cluster://splitstream-recorder:recorder-pw@")
    stack = RecordingStack(
        tmp_path / "stack",
        redis=cluster,
        recorder_args=("--redis-url", recorder_url, *ca, "--blob-threshold-bytes", "64"),
    )
    try:
        since = time.time()
        sent = call(stack, "tls", 20)
        with grpc.insecure_channel(stack.router.address) as channel:
            event = feedback_pb2.FeedbackEvent(model=MODEL, request_id="tls-1", metric="click", value=1.0)
            report = feedback_pb2.FeedbackReport(events=[event])
            assert feedback_pb2_grpc.FeedbackStub(channel).Report(report, timeout=10).accepted == 1
        wait_for(lambda: sent <= request_ids(cluster), timeout_s=30, interval_s=0.2, what="the calls recorded")
        with cluster.client() as client:
            wait_for(lambda: client.xlen(feedback_key(MODEL)), timeout_s=30, what="the click recorded")
        assert health_status(stack.recorder.address) == SERVING

        replayed = run(
            "splitstream.replayer", "--redis-url", reader_url, *ca, "--model", MODEL,
            "--output-dir", str(tmp_path / "replay"), "--target", stack.router.address, "--speed", "max",
            "--no-progress", "--since", f"{since:.3f}", "--gate", "mismatch_rate<=0,status_change_rate<=0",
        )  # fmt: skip
        assert replayed.returncode == 0, replayed.stderr
        results = [json.loads(line) for line in (tmp_path / "replay" / "results.jsonl").read_text().splitlines()]
        assert {r["request_id"] for r in results} >= sent  # blobs read back as the reader too

        analysed = run(
            "splitstream.admin", "analyze", MODEL, "--redis-url", reader_url, *ca, "--since", f"{since:.3f}",
            "--metric", "click:proportion", "--output-dir", str(tmp_path / "analysis"),
        )  # fmt: skip
        assert analysed.returncode == 0, analysed.stderr
        document = json.loads((tmp_path / "analysis" / "analysis.json").read_text())
        assert sum(arm["calls"] for arm in document["phases"][0]["arms"]) >= len(sent)
        for output in (replayed.stdout + replayed.stderr, analysed.stdout + analysed.stderr, stack.recorder.log()):
            assert "reader-pw" not in output
            assert "recorder-pw" not in output

        # Without the CA, the cluster's certificate is refused: TLS is on the way to every node.
        refused = run(
            "splitstream.admin", "analyze", MODEL, "--redis-url", reader_url, "--since", "-1h",
            "--metric", "click:proportion", "--output-dir", str(tmp_path / "refused"),
        )  # fmt: skip
        assert refused.returncode == 1
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert "certificate" in refused.stderr.lower(), refused.stderr
    finally:
        stack.stack.close()  # the cluster is the module's


def test_a_recorder_whose_user_may_not_write_is_not_serving_and_the_router_keeps_every_call(
    cluster: RedisClusterServers, pki: Pki, tmp_path: Path
) -> None:
    ca = ("--redis-tls-ca", str(pki.ca))
    stack = RecordingStack(
        tmp_path / "stack",
        redis=cluster,
        recorder_args=("--redis-url", cluster.url_for("splitstream-reader", "reader-pw"), *ca),
    )
    try:
        sent = call(stack, "noperm", 30)
        wait_for(
            lambda: health_status(stack.recorder.address) == NOT_SERVING,
            timeout_s=30,
            what="the recorder to say it cannot write",
        )
        assert "redis refuses writes: NoPermissionError" in stack.recorder.log()  # and names the command
        assert not sent & request_ids(cluster)
        # The log is the spool: what the recorder could not write waits in it, past the shipper's cursor.
        wait_for(
            lambda: (
                "the log keeps what it did not acknowledge" in stack.router.log()
                and shipper_metric(stack, "log_pending_bytes") > 0
            ),
            timeout_s=30,
            what="the shipper to keep the calls in the log",
        )
        assert shipper_metric(stack, "records_dropped_total") == 0

        # The right user: every call the read-only one could not write is recorded now.
        stack.recorder.stop()
        stack.recorder_args = ("--redis-url", cluster.url_for("splitstream-recorder", "recorder-pw"), *ca)
        stack.restart_recorder()
        wait_for(lambda: sent <= request_ids(cluster), timeout_s=60, interval_s=0.3, what="every call recorded")
        assert shipper_metric(stack, "records_dropped_total") == 0
    finally:
        stack.stack.close()


def test_the_archiver_consumes_a_tls_cluster_with_blobs_as_its_acl_user(
    cluster: RedisClusterServers, pki: Pki, tmp_path: Path
) -> None:
    ca = ("--redis-tls-ca", str(pki.ca))
    stack = RecordingStack(
        tmp_path / "stack",
        redis=cluster,
        recorder_args=(
            "--redis-url", cluster.url_for("splitstream-recorder", "recorder-pw"), *ca, "--blob-threshold-bytes", "64",
        ),
    )  # fmt: skip
    try:
        sent = call(stack, "archive", 10)
        with grpc.insecure_channel(stack.router.address) as channel:
            event = feedback_pb2.FeedbackEvent(model=MODEL, request_id="archive-1", metric="click", value=1.0)
            feedback_pb2_grpc.FeedbackStub(channel).Report(feedback_pb2.FeedbackReport(events=[event]), timeout=10)
        wait_for(lambda: sent <= request_ids(cluster), timeout_s=30, interval_s=0.2, what="the calls recorded")
        port = free_port()
        archiver = ServiceProcess(
            f"archiver-{port}", "splitstream.archiver",
            ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", *ca,
             "--redis-url", cluster.url_for("splitstream-archiver", "archiver-pw"),
             "--archive", (tmp_path / "archive").as_uri(), "--consumer", "a",
             "--flush-interval-s", "0.3", "--scan-interval-s", "0.3"],
            log_dir=tmp_path, port=port,
        )  # fmt: skip
        stack.stack.processes.append(archiver)
        archiver.start()

        # The mark raised after each flush (its script SETs the mark: the archiver's user needs +set).
        def archived() -> bool:
            with cluster.client() as client:
                marked = client.get(archive_mark_key(stream_key(MODEL))) is not None
            return marked and bool(list((tmp_path / "archive" / "feedback").rglob("*.parquet")))

        wait_for(archived, timeout_s=30, interval_s=0.3, what="the calls and the feedback archived, the mark raised")
        assert "redis failed" not in archiver.log()
        assert "archiver-pw" not in archiver.log()
    finally:
        stack.stack.close()
