"""``splitstream bandit`` on real processes: redis-server, a recorder, workers v1 and v2, a recording router.

The simulated users of the A/B end-to-end tests (:class:`tests.test_ab_end_to_end.Users`) call through the
router and report clicks through ``splitstream.v1.Feedback/Report``, clicking with a probability that depends
on the version that served them. The real CLI then runs for a few 1-second intervals: weight moves onto the
version that converts better; a broken split (sample ratio mismatch) and SIGINT put the starting weights back;
a second bandit or rollout of the model is refused while one holds the lock; bad flags exit 2 with one line.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from splitstream.admin import lock
from splitstream.common.experiment import Experiment
from tests import launcher
from tests.harness import ROOT, wait_for, write_registry
from tests.models import add_faulty_version
from tests.recording_stack import MODEL, RecordingStack
from tests.test_ab_end_to_end import Users, admin, set_experiment, weights


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingStack]:
    stack = RecordingStack(
        tmp_path_factory.mktemp("bandit"),
        versions={"v1": {"scale": 2.0}, "v2": {"scale": 2.0}},
        experiment={"salt": "start", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
    )
    try:
        # v3 fails every call the users make (a real onnxruntime error on their inputs): the error guard's case.
        add_faulty_version(stack.tmp / "models", MODEL, "v3", scale=2.0)
        worker = stack.stack.worker(stack.tmp / "models", MODEL, "v3")
        registry = yaml.safe_load(stack.registry.read_text())["models"]
        registry[MODEL]["endpoints"]["v3"] = [worker.address]
        write_registry(stack.registry, registry)
        yield stack
    finally:
        stack.close()


class TolerantUsers(Users):
    """Users who go on after a call fails (reporting nothing for that user)."""

    def one(self, number: int, channel: grpc.Channel) -> None:
        with contextlib.suppress(grpc.RpcError):
            super().one(number, channel)


class Traffic:
    """``users`` arriving in a thread for as long as the ``with`` lasts."""

    def __init__(self, users: Users) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: users.run(100_000, stop=self.stop))

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def bandit_flags(stack: RecordingStack, *flags: str) -> list[str]:
    return [
        "--registry", f"file:{stack.registry}", "bandit", MODEL, "--redis-url", stack.redis.url,
        "--metric", "click:conversion", "--interval", "1s", *flags,
    ]  # fmt: skip


def current_experiment(registry: Path) -> Experiment:
    return Experiment.from_mapping(MODEL, yaml.safe_load(registry.read_text())["models"][MODEL]["experiment"])


@pytest.mark.slow
def test_the_bandit_moves_most_traffic_onto_the_version_that_converts_better(stack: RecordingStack) -> None:
    set_experiment(stack, "bandit-win", {"v1": 50, "v2": 50})
    users = Users(stack, "win", {"v1": 0.1, "v2": 0.6}, seed=11)
    with Traffic(users):
        result = admin(
            *bandit_flags(stack, "--max-steps", "6", "--holdout", "20%", "--min-weight", "5%", "--seed", "1")
        )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    intervals = [line for line in lines if line.startswith("interval ")]
    assert len(intervals) == 6
    assert "P(best)" in intervals[-1]
    final = weights(stack)
    # The holdout's 10 % stays on v1 whatever the posteriors say; most of the rest goes to v2.
    assert final["v2"] >= 70, result.stdout
    assert final["v1"] >= 10
    assert "ended after --max-steps 6" in result.stdout
    (read_out,) = [line for line in lines if line.startswith("read-out: v2 - v1 click:conversion")]
    assert read_out.split()[5].startswith("+"), read_out  # v2 converts better: a positive lift
    # The per-phase analysis is one command away.
    assert any(line.startswith(f"each phase: splitstream analyze {MODEL} --since ") for line in lines)


@pytest.mark.slow
def test_a_per_call_rate_where_lower_is_better_moves_traffic_onto_the_version_clicked_less(
    stack: RecordingStack,
) -> None:
    # The same clicks read as something to keep low (complaints): the normal posterior of the per-call rate,
    # the smaller draw best. --duration ends it, keeping the weights.
    set_experiment(stack, "bandit-lower", {"v1": 50, "v2": 50})
    users = Users(stack, "lower", {"v1": 0.1, "v2": 0.6}, seed=15)
    with Traffic(users):
        result = admin(*bandit_flags(stack, "--metric", "click:rate:lower", "--duration", "5s", "--seed", "2"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ended after --duration 5s" in result.stdout
    assert weights(stack)["v1"] >= 70, result.stdout
    (read_out,) = [line for line in result.stdout.splitlines() if line.startswith("read-out: v2 - v1 click:rate:lower")]
    assert read_out.split()[5].startswith("+"), read_out  # the lift is v2 minus v1 whatever the direction


@pytest.mark.slow
def test_a_broken_split_trips_the_sample_ratio_guard_and_the_starting_weights_come_back(
    stack: RecordingStack,
) -> None:
    set_experiment(stack, "bandit-srm", {"v1": 70, "v2": 30})
    # A traffic generator that loses three in five of the users the split (as it stands) sends to v2.
    losing = random.Random(3)
    lost = {f"srm-user-{n}" for n in range(100_000) if losing.random() < 0.6}
    users = Users(
        stack,
        "srm",
        {"v1": 0.3, "v2": 0.3},
        seed=12,
        skip=lambda user: user in lost and current_experiment(stack.registry).assign(user) == "v2",
    )
    with Traffic(users):
        result = admin(*bandit_flags(stack, "--max-steps", "60"))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "sample ratio mismatch in the current phase" in result.stdout
    assert "REVERTED" in result.stdout
    assert weights(stack) == {"v1": 70, "v2": 30}


@pytest.mark.slow
def test_an_arm_failing_its_calls_trips_the_error_guard_and_the_starting_weights_come_back(
    stack: RecordingStack,
) -> None:
    set_experiment(stack, "bandit-errors", {"v1": 80, "v3": 20})
    users = TolerantUsers(stack, "errors", {"v1": 0.3, "v3": 0.3}, seed=14)
    with Traffic(users):
        result = admin(*bandit_flags(stack, "--max-steps", "60", "--max-error-rate", "5%", "--min-calls", "10"))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "REVERTED: v3 error rate 100.00 %" in result.stdout
    assert "exceeds --max-error-rate 5.00 %" in result.stdout
    assert weights(stack) == {"v1": 80, "v3": 20}


@pytest.mark.slow
def test_sigint_reverts_to_the_starting_weights_and_a_rollout_meanwhile_is_refused(stack: RecordingStack) -> None:
    set_experiment(stack, "bandit-int", {"v1": 60, "v2": 40})
    users = Users(stack, "int", {"v1": 0.1, "v2": 0.6}, seed=13)
    with Traffic(users):
        process = launcher.Popen(
            [sys.executable, "-m", "splitstream.admin", *bandit_flags(stack)],
            env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            # The bandit's first weights (an even split: nothing is known yet) are written, then it is stopped.
            wait_for(lambda: weights(stack) == {"v1": 50, "v2": 50}, timeout_s=30, what="the bandit's first weights")
            # It holds the model's rollout lock: a rollout now would fight it over the weights.
            refused = admin(
                "--registry", f"file:{stack.registry}", "rollout", MODEL, "v2", "--metrics", "127.0.0.1:1"
            )  # fmt: skip
            assert refused.returncode == 2, refused.stdout + refused.stderr
            assert "already has a rollout running (rollout of bandit by pid" in refused.stderr
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 3, out + err
    assert "REVERTED: interrupted" in out
    assert weights(stack) == {"v1": 60, "v2": 40}


def test_a_bandit_is_refused_while_a_rollout_of_the_model_holds_its_lock(stack: RecordingStack) -> None:
    set_experiment(stack, "bandit-lock", {"v1": 50, "v2": 50})
    with lock.FileLock(stack.registry, MODEL, lock.holder("v2")):
        result = admin(*bandit_flags(stack, "--max-steps", "1"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "already has a rollout running (rollout of v2" in result.stderr
    assert weights(stack) == {"v1": 50, "v2": 50}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--holdout", "120%"), "--holdout: a share within [0, 100 %), got 120 %"),
        (("--min-weight", "2.5%"), "--min-weight: a whole percent"),
        (("--min-weight", "60%"), "--min-weight: 2 arms at 60 % each make more than 100 %"),
        (("--max-steps", "0"), "--max-steps: must be at least 1"),
        (("--interval", "0s"), "--interval"),
        (("--metric", "click"), "bad metric 'click'"),
        (("--draws", "10"), "--draws: at least 100"),
        (("--interval", "nan"), "--interval: bad duration 'nan'"),
        (("--interval", "inf"), "--interval: bad duration 'inf'"),
        (("--holdout", "100%"), "--holdout: a share within [0, 100 %)"),
        (("--holdout", "nan"), "--holdout: a share within [0, 100 %), got nan %"),
        (("--min-weight", "nan%"), "--min-weight: a whole percent"),
        (("--max-error-rate", "nan"), "--max-error-rate: a fraction within 0..1"),
        (("--alpha", "nan"), "--alpha: must be between 0 and 1"),
        (("--duration=-5s",), "--duration: bad duration '-5s'"),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(
    stack: RecordingStack, flags: tuple[str, ...], message: str
) -> None:
    set_experiment(stack, "bandit-flags", {"v1": 50, "v2": 50})
    before = stack.registry.read_text()
    result = admin(*bandit_flags(stack, *flags))
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr
    assert stack.registry.read_text() == before


def test_the_bandit_needs_the_recorders_redis(stack: RecordingStack) -> None:
    result = launcher.run(
        [sys.executable, "-m", "splitstream.admin", "--registry", f"file:{stack.registry}", "bandit", MODEL,
         "--metric", "click:conversion"],
        env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "splitstream: error: --redis-url: needed, the recorder's Redis (calls and feedback are read there)"
    )
