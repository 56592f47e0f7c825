"""``splitstream rollout --guard`` judging outcomes recorded into a real Redis Cluster.

Router, workers v1 and v2 and a recorder writing into three ``--cluster-enabled`` masters; simulated users
call through the router and report clicks; the rollout reads the calls and the feedback from the cluster
(``redis+cluster://``) at every check. The model's call stream and its feedback stream live on different
masters, so a guard reading with a one-Redis client would be answered MOVED for one of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitstream.common.records import feedback_key, stream_key
from tests.harness import free_port
from tests.recording_stack import MODEL, RecordingStack
from tests.redis_server import RedisClusterServers
from tests.test_ab_end_to_end import Users, admin, rollout_with_traffic, set_experiment, weights

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingStack]:
    with RedisClusterServers(tmp_path_factory.mktemp("cluster")) as cluster:
        calls_master = cluster.master_of(stream_key(MODEL))
        if cluster.master_of(feedback_key(MODEL)).port == calls_master.port:  # both hash to one master's range
            cluster.move_slot(feedback_key(MODEL), next(m for m in cluster.masters if m.port != calls_master.port))
        stack = RecordingStack(
            tmp_path_factory.mktemp("rollout"),
            redis=cluster,
            versions={"v1": {"scale": 2.0}, "v2": {"scale": 2.0}},
            experiment={"salt": "start", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
        )
        try:
            yield stack
        finally:
            stack.close()


def test_the_calls_and_the_feedback_a_guard_reads_are_on_different_masters(stack: RecordingStack) -> None:
    assert isinstance(stack.redis, RedisClusterServers)
    assert stack.redis.master_of(stream_key(MODEL)).port != stack.redis.master_of(feedback_key(MODEL)).port


def test_a_guarded_rollout_reads_a_cluster_and_rolls_back_a_version_that_harms_clicks(stack: RecordingStack) -> None:
    set_experiment(stack, "cluster-harm", {"v1": 100, "v2": 0})
    users = Users(stack, "cluster-harm", {"v1": 0.6, "v2": 0.15}, seed=12)
    result = rollout_with_traffic(stack, users, "--steps", "50,100", "--interval", "120s", "--guard", "click:lift>=-5%")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "ROLLED BACK" in result.stdout
    assert "v2 harms click" in result.stdout  # judged from the cluster's calls and feedback
    checks = [line for line in result.stdout.splitlines() if line.strip().startswith("check ")]
    assert checks
    assert "always-valid CI" in checks[-1]
    assert "Redis at" not in result.stdout  # a one-Redis client rolls back too, on "Redis at ... failed" (MOVED)
    assert "step 2/2" not in result.stdout
    assert weights(stack) == {"v1": 100, "v2": 0}


def test_a_guard_whose_cluster_is_unreachable_exits_1_with_one_line_before_changing_anything(
    stack: RecordingStack,
) -> None:
    """redis-py says "Redis Cluster cannot be connected" with an exception that is no RedisError: it
    ended the rollout with a traceback instead of the line one Redis gets."""
    set_experiment(stack, "cluster-gone", {"v1": 100, "v2": 0})
    before = stack.registry.read_bytes()
    result = admin(
        "--registry", f"file:{stack.registry}", "rollout", MODEL, "v2",
        "--metrics", f"127.0.0.1:{stack.router.metrics_port}", "--guard", "click:lift>=-1%",
        "--redis-url", f"redis+cluster://:guard-pw-secret@127.0.0.1:{free_port()},127.0.0.1:{free_port()}",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "is unreachable" in result.stderr
    assert "nothing changed" in result.stderr
    assert "guard-pw-secret" not in result.stdout + result.stderr
    assert stack.registry.read_bytes() == before
