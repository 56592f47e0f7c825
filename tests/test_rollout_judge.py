"""``splitstream rollout --judge``: Kayenta's Mann-Whitney classification checked on a hand-computed example, its
scoring and thresholds, and the judge on real processes (two workers, a router, the rollout CLI under load): a
canary made slower (its batcher waits 40 ms for company) scores low and is rolled back, an equal one passes."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from splitstream.admin import judge
from tests import launcher
from tests.harness import ROOT, ServiceProcess, SteadyLoad, running_stack, write_registry
from tests.models import add_version

MODEL = "affine"
#: The slow canary's batcher holds every call up to 40 ms waiting for a batch of 64 that never fills.
SLOW = {"max_batch_size": 64, "dynamic_batching": {"max_queue_delay_us": 40_000}}


# -- the classifier, by hand -------------------------------------------------------------------------------


def test_the_shift_interval_and_classification_match_a_hand_computed_example() -> None:
    # Control 1..10, canary 6.5..15.5 (a shift of 5.5). The 100 differences canary - control are 5.5 + k,
    # k = -9..9, k occurring 10 - |k| times. The normal approximation of the rank-sum statistic (sigma =
    # sqrt(10*10*21/12) = 13.23, z at 0.98 = 2.326, continuity 0.5) puts the interval's ends at the j-th smallest
    # and largest difference, j = floor(100/2 + 0.5 - 2.326 * 13.23) = 19: k = -4 (cumulative counts 1, 3, 6, 10,
    # 15, 21) and k = +4, i.e. 1.5 .. 9.5; the estimate is the median difference, 5.5.
    control = np.arange(1.0, 11.0)
    sigma = math.sqrt(10 * 10 * 21 / 12)
    assert math.floor(50 + 0.5 - 2.3263 * sigma) == 19
    result = judge.classify("latency", control, control + 5.5)
    assert result.shift is not None
    assert result.shift.low == pytest.approx(1.5, abs=1e-9)
    assert result.shift.high == pytest.approx(9.5, abs=1e-9)
    assert result.shift.estimate == pytest.approx(5.5, abs=1e-9)
    # Tolerance 0.25: the low end 1.5 clears 0.25 x 5.5 = 1.375, and the canary's mean is 2x the control's: High.
    assert result.classification == "High"
    assert result.mean_ratio == pytest.approx(2.0)
    # A shift of 4.5: the interval 0.5 .. 8.5 is clear of 0 but not of 0.25 x 4.5 = 1.125: Pass (Kayenta's
    # tolerance asks the shift to be clearly a fraction of itself, not just non-zero).
    assert judge.classify("latency", control, control + 4.5).classification == "Pass"
    assert judge.classify("latency", control, control - 5.5).classification == "Low"
    # scipy's Mann-Whitney agrees the shifted samples differ (its p-value is reported beside the label).
    assert result.p_value is not None
    assert result.p_value < 0.01


def test_missing_and_identical_data_are_handled_as_kayenta_does() -> None:
    nan = math.nan
    # NaN values removed (an interval in which a version answered nothing); none left: NoData.
    assert judge.classify("error_rate", [nan, nan], [0.1, 0.2]).classification == "NoData"
    assert judge.classify("error_rate", [0.0, 0.0, 0.0], [0.0, 0.0]).classification == "Pass"  # one value everywhere
    assert judge.classify("latency", [1.0, 2.0, nan], [2.0, 1.0]).classification == "Pass"  # the same values
    # Both sides a single value each: Kayenta adds tiny noise and ranks; a clear rise is High.
    assert judge.classify("latency", [1.0] * 8, [2.0] * 8).classification == "High"


#: Simulated equal control and canary pairs, and intervals per side in each.
AA_PAIRS = 300
AA_INTERVALS = 30


def aa_high_rate(seed: int = 5) -> float:
    """Share of simulated equal pairs (lognormal per-interval latencies, both sides alike) classified High."""
    rng = np.random.default_rng(seed)
    samples = rng.lognormal(math.log(0.005), 0.3, (AA_PAIRS, 2, AA_INTERVALS))
    labels = [judge.classify("latency", control, canary).classification for control, canary in samples]
    return labels.count("High") / AA_PAIRS


@pytest.mark.slow
def test_an_equal_canary_is_rarely_classified_high() -> None:
    # The two-sided 98 % interval leaves 1 % in the High tail; the tolerance (clear 0.25 of the estimate, not
    # just 0) makes it rarer still.
    assert aa_high_rate() <= 0.02


def test_the_score_weighs_each_metric_and_too_many_without_data_fail_it() -> None:
    def result(name: str, label: judge.Classification, weight: float) -> judge.MetricResult:
        return judge.MetricResult(name, label, weight, 10, 10)

    chosen = [judge.JudgeMetric.parse("latency_p99=50"), judge.JudgeMetric("latency_p50"),
              judge.JudgeMetric("error_rate")]  # fmt: skip
    weights = judge.weights(chosen)
    assert weights == {"latency_p99": 50, "latency_p50": 25, "error_rate": 25}
    high_p99 = judge.score([result("latency_p99", "High", 50), result("latency_p50", "Pass", 25),
                            result("error_rate", "Low", 25)])  # fmt: skip
    assert high_p99.score == 50  # Low is the good side for these metrics: it passes
    one_nodata = judge.score([result("a", "NoData", 25), result("b", "Pass", 25), result("c", "High", 25),
                              result("d", "Pass", 25)])  # fmt: skip
    assert one_nodata.score == 75  # NoData counts as a pass...
    half_nodata = judge.score([result("a", "NoData", 50), result("b", "Pass", 50)])
    assert half_nodata.score == 0  # ...unless half the metrics or more have none
    assert half_nodata.reason is not None
    config = judge.JudgeConfig()
    assert [config.decide(judge.Judgement(s, ())) for s in (100, 95, 94.99, 75, 74.99)] == [
        "pass", "pass", "marginal", "marginal", "fail",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="add up to 100"):
        judge.weights([judge.JudgeMetric("latency_p50", 60), judge.JudgeMetric("error_rate", 60)])


def test_a_quantile_guard_on_a_default_metric_is_judged_once() -> None:
    """``--guard 'latency:p99:ratio<=1.1' --judge``: the guard's metric is latency_p99, one of the defaults; named
    twice, the weights could not be shared out and the judge failed at the end of the step."""
    chosen = judge.JudgeConfig().chosen(["latency_p99", "ttft_p90", "click"])
    assert [m.name for m in chosen] == ["latency_p50", "latency_p99", "error_rate", "ttft_p90", "click"]
    assert judge.weights(chosen) == {m.name: 20 for m in chosen}


# -- on real processes -------------------------------------------------------------------------------------


@dataclass
class Canary:
    registry: Path
    router: ServiceProcess


@contextlib.contextmanager
def deployed(tmp_path: Path, *, slow: bool) -> Iterator[Canary]:
    """v1 and v2 workers behind a router, v1 taking all the traffic; v2 slowed down when asked."""
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0)
    add_version(repository, MODEL, "v2", scale=3.0, config=SLOW if slow else None)
    with running_stack(tmp_path) as stack:
        workers = {v: stack.worker(repository, MODEL, v) for v in ("v1", "v2")}
        registry = tmp_path / "registry.yaml"
        experiment = {"salt": "judge", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
        write_registry(registry, {MODEL: {"endpoints": {v: [w.address] for v, w in workers.items()},
                                          "experiment": experiment}})  # fmt: skip
        yield Canary(registry, stack.router(registry))


@pytest.fixture(scope="module")
def slow_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Canary]:
    """One slowed-down canary deployment for the tests that roll it back (started once: a stack takes seconds)."""
    with deployed(tmp_path_factory.mktemp("slow-canary"), slow=True) as canary:
        yield canary


@pytest.fixture
def slow_canary(slow_deployment: Canary) -> Canary:
    """The shared slow deployment with its starting experiment back (v1 taking all the traffic, no v2 arm)."""
    registry = yaml.safe_load(slow_deployment.registry.read_text())["models"]
    registry[MODEL]["experiment"] = {"salt": "judge", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
    write_registry(slow_deployment.registry, registry)
    return slow_deployment


def rollout(canary: Canary, *flags: str) -> subprocess.CompletedProcess[str]:
    """A one-step rollout to 50 % judged over 5 s of 0.5 s intervals; the ratio guard loose, so only the judge
    can stop it."""
    with SteadyLoad(canary.router.address, MODEL, threads=4, key_prefix="judge") as load:
        load.wait_calls(50)
        return launcher.run(
            [sys.executable, "-m", "splitstream.admin", "--registry", f"file:{canary.registry}", "rollout", MODEL,
             "v2", "--steps", "50", "--interval", "5s", "--check-every", "0.5s", "--min-calls", "10",
             "--max-p99-ratio", "1000", "--metrics", f"127.0.0.1:{canary.router.metrics_port}", "--judge", *flags],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip


def weights_of(canary: Canary) -> dict[str, float]:
    arms = yaml.safe_load(canary.registry.read_text())["models"][MODEL]["experiment"]["arms"]
    return {a["version"]: a["weight"] for a in arms}


def judge_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    lines = [line for line in result.stdout.splitlines() if line.startswith("  judge score ")]
    assert lines, result.stdout + result.stderr
    return lines


def score_of(line: str) -> float:
    return float(line.split("judge score ")[1].split()[0])


@pytest.mark.slow
def test_an_equal_canary_passes_with_a_high_score(tmp_path: Path) -> None:
    with deployed(tmp_path, slow=False) as canary:
        result = rollout(canary)
        assert result.returncode == 0, result.stdout + result.stderr
        [line] = judge_lines(result)
        assert score_of(line) >= judge.DEFAULT_PASS, line
        assert "latency_p50 Pass" in line
        assert line.endswith(": pass"), line
        assert "holds at 50 %" in result.stdout
        assert weights_of(canary) == {"v1": 50, "v2": 50}


@pytest.mark.slow
def test_a_slower_canary_scores_low_and_is_rolled_back(slow_canary: Canary) -> None:
    canary = slow_canary
    result = rollout(canary)
    assert result.returncode == 3, result.stdout + result.stderr
    [line] = judge_lines(result)
    assert score_of(line) < judge.DEFAULT_MARGINAL, line
    assert "latency_p50 High" in line
    # (its p99 is High too on a quiet machine; per-interval p99s of a loaded one are too noisy to insist)
    assert "error_rate Pass" in line
    assert "ROLLED BACK: v2 judge score" in result.stdout
    assert "below --judge-marginal 75" in result.stdout
    assert weights_of(canary) == {"v1": 100, "v2": 0}


@pytest.mark.slow
def test_a_marginal_score_holds_the_step_one_more_interval_then_rolls_back(slow_canary: Canary) -> None:
    # Latency weighs 20 %: the slow canary scores 80, between --judge-marginal 75 and --judge-pass 95.
    canary = slow_canary
    result = rollout(canary, "--judge-metric", "latency_p50=20", "--judge-metric", "error_rate")
    assert result.returncode == 3, result.stdout + result.stderr
    first, second = judge_lines(result)
    assert score_of(first) == score_of(second) == 80
    assert first.endswith(": marginal")
    assert second.endswith(": marginal")
    assert "holding the step one more interval" in result.stdout
    points = [int(line.split(" over ")[1].split()[0]) for line in (first, second)]
    assert points[1] > points[0]  # judged again over the held interval too
    assert "still below --judge-pass 95 after holding the step one more interval" in result.stdout
    assert weights_of(canary) == {"v1": 100, "v2": 0}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--judge", "--judge-metric", "latency_p95"], "--judge-metric: unknown metric 'latency_p95'"),
        (["--judge", "--judge-metric", "latency_p50=70", "--judge-metric", "error_rate=70"], "add up to 100"),
        (["--judge", "--judge-pass", "70"], "need 0 <= marginal <= pass <= 100"),
        (["--judge", "--judge-confidence", "1.5"], "--judge-confidence: must be between 0.5 and 1"),
        (["--judge-metric", "error_rate"], "go with --judge"),
        (["--judge", "--judge-metric", "click"], "unknown metric 'click' (one of latency_p50"),
        (["--judge", "--judge-metric", "latency_p50=nan"], "the weight must be within (0, 100], got 'nan'"),
        (["--judge", "--judge-metric", "latency_p50=-10"], "the weight must be within (0, 100], got '-10'"),
        (["--judge", "--judge-metric", "latency_p50=inf%"], "the weight must be within (0, 100], got 'inf%'"),
        (["--judge", "--judge-pass", "nan"], "need 0 <= marginal <= pass <= 100"),
        (["--judge", "--judge-confidence", "nan"], "--judge-confidence: must be between 0.5 and 1"),
        (["--judge", "--judge-tolerance", "nan"], "--judge-tolerance: must be a finite number >= 0"),
    ],
    ids=[
        "unknown-metric",
        "weights-over-100",
        "pass-below-marginal",
        "confidence",
        "metric-without-judge",
        "outcome-without-guard",
        "weight-nan",
        "weight-negative",
        "weight-infinite",
        "pass-nan",
        "confidence-nan",
        "tolerance-nan",
    ],
)
def test_bad_judge_flags_exit_2_with_one_line_and_change_nothing(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    registry = tmp_path / "registry.yaml"
    experiment = {"salt": "judge", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
    write_registry(registry, {MODEL: {"endpoints": {"v1": ["127.0.0.1:1"], "v2": ["127.0.0.1:2"]},
                                      "experiment": experiment}})  # fmt: skip
    before = registry.read_text()
    result = launcher.run(
        [sys.executable, "-m", "splitstream.admin", "--registry", f"file:{registry}", "rollout", MODEL, "v2",
         "--metrics", "127.0.0.1:1", *flags],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert registry.read_text() == before
