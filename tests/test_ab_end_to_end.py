"""A/B verdicts end to end on real processes: redis-server, a recorder, workers v1 and v2, a recording router.

Simulated users with sticky routing keys call through the router and report clicks through
``splitstream.v1.Feedback/Report`` (by request id and by routing key), clicking with a probability that
depends on the version that served them (read from the answer's ``model_version``). Then the real CLI:
``splitstream analyze`` finds a planted lift with a clean split; ``splitstream rollout --guard`` rolls back a
version that harms clicks, stops on a broken split (sample ratio mismatch), and ends a step early on a
significant win with ``--promote-on-win``. Each scenario uses its own salt and users, so its experiment
phases are its own.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from splitstream.common.charts import CANDIDATE_COLOR, REFERENCE_COLOR
from splitstream.common.experiment import Experiment
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from splitstream.common.proto.splitstream.v1 import feedback_pb2, feedback_pb2_grpc
from tests import launcher
from tests.browser import needs_chromium, pixels_of, screenshot
from tests.harness import ROOT, make_request, router_status, wait_for, write_registry
from tests.recording_stack import MODEL, RecordingStack

Event = feedback_pb2.FeedbackEvent
#: Worker threads of the simulated users (each with its own channel).
THREADS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingStack]:
    stack = RecordingStack(
        tmp_path_factory.mktemp("ab"),
        versions={"v1": {"scale": 2.0}, "v2": {"scale": 2.0}},
        experiment={"salt": "start", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
    )
    yield stack
    stack.close()


def set_experiment(stack: RecordingStack, salt: str, weights: dict[str, float]) -> None:
    """Write the registry's experiment and wait until the router routes by it (its Status shows the salt)."""
    registry = yaml.safe_load(stack.registry.read_text())["models"]
    registry[MODEL]["experiment"] = {
        "salt": salt,
        "control": "v1",
        "arms": [{"version": v, "weight": w} for v, w in weights.items()],
    }
    write_registry(stack.registry, registry)
    wait_for(
        lambda: router_status(stack.router, MODEL).models[0].experiment.salt == salt,
        timeout_s=30,
        interval_s=0.2,
        what=f"the router to follow experiment {salt}",
    )


def call(stack: RecordingStack, user: str, request_id: str, channel: grpc.Channel | None = None) -> tuple[str, str]:
    """One call as ``user``; returns (the version that served it, its request id)."""
    own = channel is None
    channel = channel or grpc.insecure_channel(stack.router.address)
    try:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(
            make_request(MODEL, np.ones((1, 4), np.float32)),
            metadata=[("x-routing-key", user), ("x-request-id", request_id)],
            timeout=10,
        )
        return str(response.model_version), request_id
    finally:
        if own:
            channel.close()


class Users:
    """Simulated users: each makes two calls and reports a click for each, clicking with ``clicks[version]``
    probability. The first call's click names its request id, the second's the user's routing key.
    ``skip(user)`` leaves a user out entirely (a broken traffic generator)."""

    def __init__(
        self,
        stack: RecordingStack,
        prefix: str,
        clicks: dict[str, float],
        *,
        seed: int,
        skip: Callable[[str], bool] = lambda user: False,
    ) -> None:
        self.stack = stack
        self.prefix = prefix
        self.clicks = clicks
        self.seed = seed
        self.skip = skip
        self.served: dict[str, int] = {}
        self.lock = threading.Lock()

    def one(self, number: int, channel: grpc.Channel) -> None:
        user = f"{self.prefix}-user-{number}"
        if self.skip(user):
            return
        chance = random.Random(self.seed * 1_000_003 + number)
        events = []
        for n in range(2):
            version, request_id = call(self.stack, user, f"{user}-call-{n}", channel)
            with self.lock:
                self.served[version] = self.served.get(version, 0) + 1
            clicked = 1.0 if chance.random() < self.clicks[version] else 0.0
            if n == 0:
                events.append(Event(model=MODEL, request_id=request_id, metric="click", value=clicked))
            elif clicked:
                events.append(Event(model=MODEL, routing_key=user, metric="click", value=clicked))
        reply = feedback_pb2_grpc.FeedbackStub(channel).Report(feedback_pb2.FeedbackReport(events=events), timeout=10)
        assert list(reply.rejected) == []

    def run(self, count: int, *, stop: threading.Event | None = None, start: int = 0) -> int:
        """``count`` users (or until ``stop`` is set); returns how many were started."""
        next_user = [start]
        lock = threading.Lock()

        def worker() -> None:
            with grpc.insecure_channel(self.stack.router.address) as channel:
                while not (stop is not None and stop.is_set()):
                    with lock:
                        number = next_user[0]
                        if number >= start + count:
                            return
                        next_user[0] += 1
                    self.one(number, channel)

        with ThreadPoolExecutor(THREADS) as pool:
            for future in [pool.submit(worker) for _ in range(THREADS)]:
                future.result()
        return next_user[0] - start


def admin(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return launcher.run(
        [sys.executable, "-m", "splitstream.admin", *args],
        env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
        cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def rollout_with_traffic(stack: RecordingStack, users: Users, *flags: str) -> subprocess.CompletedProcess[str]:
    """``splitstream rollout MODEL v2`` on the file registry while ``users`` keep arriving."""
    stop = threading.Event()
    traffic = threading.Thread(target=lambda: users.run(100_000, stop=stop))
    traffic.start()
    try:
        return admin(
            "--registry", f"file:{stack.registry}", "rollout", MODEL, "v2",
            "--metrics", f"127.0.0.1:{stack.router.metrics_port}", "--redis-url", stack.redis.url,
            "--check-every", "1s", "--max-p99-ratio", "100", "--min-calls", "10", *flags,
        )  # fmt: skip
    finally:
        stop.set()
        traffic.join()


def weights(stack: RecordingStack) -> dict[str, float]:
    experiment = yaml.safe_load(stack.registry.read_text())["models"][MODEL]["experiment"]
    return {arm["version"]: arm["weight"] for arm in experiment["arms"]}


@dataclass(frozen=True)
class LiftRun:
    result: subprocess.CompletedProcess[str]
    out: Path
    since: float


@pytest.fixture(scope="module")
def lift_run(stack: RecordingStack, tmp_path_factory: pytest.TempPathFactory) -> LiftRun:
    """300 users at 50/50, v2's answers clicked twice as often, then ``splitstream analyze`` on them."""
    set_experiment(stack, "lift", {"v1": 50, "v2": 50})
    since = time.time()
    users = Users(stack, "lift", {"v1": 0.3, "v2": 0.6}, seed=1)
    users.run(300)
    assert set(users.served) == {"v1", "v2"}
    time.sleep(1.0)  # the last record and feedback batches reach Redis
    out = tmp_path_factory.mktemp("analysis")
    result = admin(
        "analyze", MODEL, "--redis-url", stack.redis.url, "--since", f"{since:.3f}", "--metric", "click:proportion",
        "--output-dir", str(out),
    )  # fmt: skip
    return LiftRun(result, out, since)


@pytest.mark.slow
def test_the_analysis_finds_the_planted_click_lift_of_v2_and_a_clean_split(lift_run: LiftRun) -> None:
    result = lift_run.result
    assert result.returncode == 0, result.stderr
    assert "v2 better" in result.stdout
    analysis = json.loads((lift_run.out / "analysis.json").read_text())
    (phase,) = [p for p in analysis["phases"] if p["weights"] == {"v1": 50.0, "v2": 50.0}]
    (comparison,) = phase["comparisons"]
    assert comparison["arm"] == "v2"
    assert comparison["verdict"] == "better"
    assert comparison["absolute_ci"]["low"] > 0  # the interval excludes 0, on the right side
    # The planted lift: 0.6 against 0.3 clicks per call.
    assert comparison["absolute_ci"]["low"] < 0.3 < comparison["absolute_ci"]["high"]
    assert phase["srm"] is not None
    assert not phase["srm"]["flagged"]
    assert sum(arm["units"] for arm in phase["arms"]) == 300
    assert analysis["feedback"]["unknown"] == 0


def test_the_same_clicks_read_as_lower_is_better_make_v2_worse(stack: RecordingStack, lift_run: LiftRun) -> None:
    # Whatever is measured to be kept low (complaints, waiting): v2's doubling of it is a harm, not a win.
    assert lift_run.result.returncode == 0, lift_run.result.stderr
    result = admin(
        "analyze", MODEL, "--redis-url", stack.redis.url, "--since", f"{lift_run.since:.3f}",
        "--metric", "click:proportion:lower", "--output-dir", str(lift_run.out / "lower"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "v2 worse" in result.stdout
    analysis = json.loads((lift_run.out / "lower" / "analysis.json").read_text())
    (phase,) = [p for p in analysis["phases"] if p["weights"] == {"v1": 50.0, "v2": 50.0}]
    (comparison,) = phase["comparisons"]
    assert (comparison["direction"], comparison["verdict"]) == ("lower", "worse")
    assert comparison["absolute_ci"]["low"] > 0  # the same lift, the other verdict


@needs_chromium
def test_the_analysis_page_renders_offline_in_headless_chromium_with_its_charts_drawn(
    lift_run: LiftRun, tmp_path: Path
) -> None:
    assert lift_run.result.returncode == 0, lift_run.result.stderr
    image = screenshot(lift_run.out / "analysis.html", tmp_path / "analysis.png")
    # The SRM bars draw the expected units in the reference colour and the observed ones in the candidate's
    # (the latency CDF draws v1 and v2 in the same two): thousands of pixels each, where the legends' swatches
    # alone make a few hundred and a page whose SVG did not render has none.
    assert pixels_of(image, REFERENCE_COLOR) > 5_000
    assert pixels_of(image, CANDIDATE_COLOR) > 5_000


@pytest.mark.slow
def test_a_rollout_guarded_by_clicks_rolls_back_a_version_that_significantly_harms_them(
    stack: RecordingStack,
) -> None:
    set_experiment(stack, "harm", {"v1": 100, "v2": 0})
    users = Users(stack, "harm", {"v1": 0.6, "v2": 0.15}, seed=2)
    result = rollout_with_traffic(stack, users, "--steps", "50,100", "--interval", "120s", "--guard", "click:lift>=-5%")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "ROLLED BACK" in result.stdout
    assert "v2 harms click" in result.stdout
    checks = [line for line in result.stdout.splitlines() if line.strip().startswith("check ")]
    assert checks
    assert "always-valid CI" in checks[-1]
    assert "step 2/2" not in result.stdout
    assert weights(stack) == {"v1": 100, "v2": 0}


@pytest.mark.slow
def test_a_broken_split_trips_the_sample_ratio_guard_and_the_rollout_rolls_back(stack: RecordingStack) -> None:
    set_experiment(stack, "srm", {"v1": 100, "v2": 0})
    at_50 = Experiment.build(model=MODEL, salt="srm", control="v1", arms=[("v1", 50), ("v2", 50)])
    # A traffic generator that loses three in five of the users the split sends to v2.
    losing = random.Random(3)
    lost = {f"srm-user-{n}" for n in range(100_000) if losing.random() < 0.6}
    users = Users(
        stack, "srm", {"v1": 0.4, "v2": 0.4}, seed=3, skip=lambda user: at_50.assign(user) == "v2" and user in lost
    )
    result = rollout_with_traffic(stack, users, "--steps", "50", "--interval", "120s", "--guard", "click:lift>=-50%")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "sample ratio mismatch" in result.stdout
    assert weights(stack) == {"v1": 100, "v2": 0}


@pytest.mark.slow
def test_promote_on_win_ends_the_step_early_when_v2_significantly_lifts_clicks(stack: RecordingStack) -> None:
    set_experiment(stack, "win", {"v1": 100, "v2": 0})
    users = Users(stack, "win", {"v1": 0.2, "v2": 0.7}, seed=4)
    result = rollout_with_traffic(
        stack, users, "--steps", "50", "--interval", "10m", "--guard", "click:lift>=-1%", "--promote-on-win"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "significant win: advancing early" in result.stdout
    assert weights(stack) == {"v1": 50, "v2": 50}


@pytest.mark.slow
def test_a_guard_whose_sequence_clears_its_bound_says_non_inferior_at_each_check(stack: RecordingStack) -> None:
    # v2 clicked as often as v1: no win, but soon the always-valid lower edge is above -50 %: sequential
    # non-inferiority, what ``analyze --sequential --non-inferiority 50%`` would say on the same phase.
    set_experiment(stack, "same", {"v1": 100, "v2": 0})
    users = Users(stack, "same", {"v1": 0.5, "v2": 0.5}, seed=5)
    result = rollout_with_traffic(stack, users, "--steps", "50", "--interval", "20s", "--guard", "click:lift>=-50%")
    assert result.returncode == 0, result.stdout + result.stderr
    checks = [line for line in result.stdout.splitlines() if line.strip().startswith("check ")]
    assert any(line.endswith("bound >= -50.0 %: non-inferior") for line in checks), checks
    assert weights(stack) == {"v1": 50, "v2": 50}


class Spenders(Users):
    """Users who report revenue instead of clicks, the same in both arms: 1 to 7 per user, and every 40th user
    a whale spending 5,000 (one whale swings an arm's mean per user by more than the whole lift a guard allows)."""

    def one(self, number: int, channel: grpc.Channel) -> None:
        user = f"{self.prefix}-user-{number}"
        version, request_id = call(self.stack, user, f"{user}-call-0", channel)
        with self.lock:
            self.served[version] = self.served.get(version, 0) + 1
        spent = 5000.0 if number % 40 == 39 else float(1 + number % 7)
        event = Event(model=MODEL, request_id=request_id, metric="revenue", value=spent)
        reply = feedback_pb2_grpc.FeedbackStub(channel).Report(feedback_pb2.FeedbackReport(events=[event]), timeout=10)
        assert list(reply.rejected) == []


@pytest.mark.slow
def test_a_guard_on_capped_revenue_judges_the_capped_values_and_holds_an_equal_version(stack: RecordingStack) -> None:
    """``revenue:sum:cap=P90`` in ``--guard`` is read as ``analyze --metric`` reads it (one parser): the whales
    are capped at the units' 90th percentile, the sequence narrows, and the equal version is judged
    non-inferior. (Before, the guard took ``revenue:sum:cap=P90`` for a metric's name, no event ever named it,
    and the step ended not judged: rolled back.)"""
    set_experiment(stack, "capped", {"v1": 100, "v2": 0})
    users = Spenders(stack, "capped", {}, seed=7)
    result = rollout_with_traffic(
        stack, users, "--steps", "50", "--interval", "20s", "--guard", "revenue:sum:cap=P90:lift>=-25%",
        "--guard-min-units", "20",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    checks = [line for line in result.stdout.splitlines() if line.strip().startswith("check ")]
    judged = [line for line in checks if "revenue capped at P90 lift " in line]
    assert judged, checks
    assert any(line.endswith("bound >= -25.0 %: non-inferior") for line in judged), checks
    assert weights(stack) == {"v1": 50, "v2": 50}
