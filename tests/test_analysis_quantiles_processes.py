"""Quantile effects and the quantile guard on real processes: redis-server, a recorder, a router and three
stand-ins for Triton's decoupled models, v1 and v3 waiting 2 ms before each token, v2 40 ms (so v2 is slower
at every quantile of latency and TTFT). ``analyze`` shows the clustered quantile comparisons; a rollout of v2
guarded by ``latency:p99:ratio<=1.10`` (or ``ttft:p50:ratio<=1.2``) rolls back, one of v3 (as fast as
v1) holds."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from statsmodels.stats.multitest import multipletests

from tests.harness import ServiceProcess, Stack
from tests.recording_stack import MODEL, RecordingStack
from tests.test_analysis_tokens import admin, current_weights, set_weights
from tests.test_analysis_ttft import streams
from tests.triton_decoupled import start_standin

DELAY_MS = {"v1": "2", "v2": "40", "v3": "2"}


def standin(stack: Stack, version: str) -> ServiceProcess:
    return start_standin(stack, MODEL, version, "--delay-ms", DELAY_MS[version])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingStack]:
    recording = RecordingStack(
        tmp_path_factory.mktemp("quantiles"),
        versions={"v1": {}, "v2": {}, "v3": {}},
        experiment={"salt": "quantiles", "control": "v1", "arms": [{"version": "v1", "weight": 50},
                                                                   {"version": "v2", "weight": 50}]},
        worker=standin,
    )  # fmt: skip
    yield recording
    recording.close()


def rollout(stack: RecordingStack, version: str, interval: str, guard: str, *flags: str) -> tuple[str, int]:
    """A rollout of ``version`` to 50 % under ``guard`` while users stream; its output and exit code. The
    router's own p99 guard is set out of reach, so only the quantile guard can judge."""
    set_weights(stack, f"rollout-{version}", {"v1": 100, version: 0})
    stop = threading.Event()
    traffic = threading.Thread(target=lambda: streams(stack, f"rollout-{version}", 100_000, {}, stop))
    traffic.start()
    try:
        result = admin(
            "--registry", f"file:{stack.registry}", "rollout", MODEL, version, "--steps", "50", "--interval", interval,
            "--metrics", f"127.0.0.1:{stack.router.metrics_port}", "--redis-url", stack.redis.url,
            "--check-every", "1s", "--max-p99-ratio", "1000", "--min-calls", "5", "--guard-min-units", "20",
            "--guard", guard, *flags,
        )  # fmt: skip
    finally:
        stop.set()
        traffic.join()
    return result.stdout + result.stderr, result.returncode


@pytest.mark.slow
def test_analyze_compares_latency_and_ttft_quantiles_with_clustered_intervals(
    stack: RecordingStack, tmp_path: Path
) -> None:
    since = time.time()
    streams(stack, "analyze", 60, {})
    stack.wait_recorded({f"analyze-{n}" for n in range(60)})
    result = admin("analyze", MODEL, "--redis-url", stack.redis.url, "--since", f"{since:.3f}", "--metric", "ttft_ms",
                   "--output-dir", str(tmp_path))  # fmt: skip
    assert result.returncode == 0, result.stderr
    (phase,) = json.loads((tmp_path / "analysis.json").read_text())["phases"]
    found = {(q["metric"], q["name"]): q for q in phase["quantiles"]}
    assert set(found) == {(m, q) for m in ("latency", "ttft") for q in ("p50", "p90", "p99")}
    arms = {arm["arm"]: arm for arm in phase["arms"]}
    for (metric, name), q in found.items():
        assert (q["arm"], q["control"]) == ("v2", "v1")
        assert q["control_calls"] == arms["v1"]["calls"]
        assert q["arm_calls"] == arms["v2"]["calls"]
        assert q["ratio"] == pytest.approx(q["arm_value"] / q["control_value"])
        assert q["difference"] == pytest.approx(q["arm_value"] - q["control_value"])
        assert q["method"].startswith("delta method, clustered by unit")
        if name == "p50":  # 40 ms a token against 2: the ratio is far from 1 and its interval says so
            assert q["ratio_ci"]["low"] > 2, (metric, q)
            assert q["p_value"] < 0.001
        if name == "p99":  # 30 calls an arm: nothing past the p99 to bound it, so no interval rather than a false one
            assert (q["ratio_ci"], q["p_value"], q["sequential_ratio_ci"]) == ({"low": None, "high": None}, None, None)
    assert found["ttft", "p50"]["arm_value"] >= 40 > found["ttft", "p50"]["control_value"]
    # The same 2 % latency buckets as the arms' table: the quantiles agree with it.
    for version, side in (("v1", "control_value"), ("v2", "arm_value")):
        assert found["latency", "p50"][side] == pytest.approx(arms[version]["latency_p50_ms"])
        assert found["latency", "p99"][side] == pytest.approx(arms[version]["latency_p99_ms"])
        assert found["ttft", "p50"][side] == pytest.approx(arms[version]["ttft_p50_ms"])
    assert "quantiles of the calls pooled per arm, intervals clustered by unit" in result.stdout
    assert "Latency quantiles" in (tmp_path / "analysis.html").read_text()


@pytest.mark.slow
def test_quantiles_have_a_timeline_and_are_adjusted_with_the_metrics_by_holm(
    stack: RecordingStack, tmp_path: Path
) -> None:
    """The quantile comparisons get what the metrics' comparisons get: a lift-over-time timeline (analysis.json
    and a chart of analysis.html) and a place in ``--correction``'s family, with adjusted p-values and ratio
    intervals (checked against statsmodels' Holm over the same p-values)."""
    set_weights(stack, "timeline", {"v1": 50, "v2": 50})
    since = time.time()
    streams(stack, "timeline", 60, {})
    stack.wait_recorded({f"timeline-{n}" for n in range(60)})
    result = admin("analyze", MODEL, "--redis-url", stack.redis.url, "--since", f"{since:.3f}", "--metric", "ttft_ms",
                   "--correction", "holm", "--output-dir", str(tmp_path))  # fmt: skip
    assert result.returncode == 0, result.stderr
    analysis = json.loads((tmp_path / "analysis.json").read_text())
    (phase,) = analysis["phases"]
    judged = [q for q in phase["quantiles"] if q["p_value"] is not None]
    assert {(q["metric"], q["name"]) for q in judged} >= {("latency", "p50"), ("ttft", "p50")}
    (metric,) = phase["comparisons"]
    assert (analysis["family_size"], analysis["quantiles_in_family"]) == (1 + len(judged), len(judged))
    expected = multipletests([metric["p_value"]] + [q["p_value"] for q in judged], method="holm")[1]
    assert metric["adjusted_p_value"] == pytest.approx(expected[0], rel=1e-9)
    for q, reference in zip(judged, expected[1:], strict=True):
        assert q["correction"] == "holm"
        assert q["adjusted_p_value"] == pytest.approx(reference, rel=1e-9)
        adjusted, plain = q["adjusted_ratio_ci"], q["ratio_ci"]
        assert adjusted["low"] < plain["low"] <= q["ratio"] <= plain["high"] < adjusted["high"]
        # The timeline: the comparison on the calls up to each bucket's end, the last one on all of them.
        timeline = q["timeline"]
        assert timeline, q
        assert [p["until_ns"] for p in timeline] == sorted(p["until_ns"] for p in timeline)
        assert timeline[-1]["ratio"] == pytest.approx(q["ratio"])
        assert timeline[-1]["ratio_ci"] == pytest.approx(q["ratio_ci"])
        assert timeline[-1]["units_arm"] == q["arm_units"]
    assert "HOLM-ADJ. RATIO CI" in result.stdout
    assert f"{len(judged)} of them latency and TTFT quantiles" in result.stdout
    html = (tmp_path / "analysis.html").read_text()
    assert "latency p50: v2 / v1 (ratio), cumulative" in html
    assert "ttft p50: v2 / v1 (ratio), cumulative" in html


@pytest.mark.slow
def test_a_rollout_guarded_by_the_p99_ratio_rolls_back_a_slower_version(stack: RecordingStack) -> None:
    output, code = rollout(stack, "v2", "120s", "latency:p99:ratio<=1.10")
    assert code == 3, output
    assert "v2 harms latency p99 ratio" in output
    assert "(guard latency:p99:ratio<=1.10)" in output
    assert current_weights(stack) == {"v1": 100, "v2": 0}


@pytest.mark.slow
def test_a_rollout_of_a_version_as_fast_as_the_control_holds_under_the_p99_ratio_guard(stack: RecordingStack) -> None:
    output, code = rollout(stack, "v3", "30s", "latency:p99:ratio<=1.25")
    assert code == 0, output
    judged = [line for line in output.splitlines() if "latency p99 ratio" in line]
    assert judged, output  # an interval came (enough calls past the p99), and its lower end stayed under 1.25
    assert all(line.endswith("bound <= 1.250x: open") for line in judged), output
    assert "every guard held" in output
    assert current_weights(stack) == {"v1": 50, "v3": 50}


@pytest.mark.slow
def test_a_rollout_guarded_by_the_ttft_p50_ratio_rolls_back_a_version_slower_to_its_first_token(
    stack: RecordingStack,
) -> None:
    output, code = rollout(stack, "v2", "120s", "ttft:p50:ratio<=1.2")
    assert code == 3, output
    assert "v2 harms ttft p50 ratio" in output
    assert "(guard ttft:p50:ratio<=1.2)" in output
    assert current_weights(stack) == {"v1": 100, "v2": 0}


@pytest.mark.slow
def test_the_canary_judge_compares_a_quantile_guards_quantile_per_interval_and_rolls_back(
    stack: RecordingStack,
) -> None:
    """``--judge`` with ``--guard 'ttft:p90:ratio<=100'``: the guard's quantile is a judged metric (``ttft_p90``,
    per check interval and version, as Kayenta compares it), not left out. v2's first token comes several
    times later: High over the intervals, score 50, rolled back by the judge while the guard's loose bound holds.
    (Before, a quantile guard's metric was filtered out of the judge: ``--judge-metric ttft_p90`` exited 2.)"""
    output, code = rollout(stack, "v2", "8s", "ttft:p90:ratio<=100", "--judge", "--judge-metric", "ttft_p90=50",
                           "--judge-metric", "error_rate")  # fmt: skip
    assert code == 3, output
    judged = [line for line in output.splitlines() if line.startswith("  judge score ")]
    assert judged, output
    assert "ttft_p90 High x" in judged[-1]
    assert "error_rate Pass" in judged[-1]
    assert "ROLLED BACK: v2 judge score 50 " in output
    assert "v2 harms" not in output  # the guard itself held
    assert current_weights(stack) == {"v1": 100, "v2": 0}
