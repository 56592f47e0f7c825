"""``splitstream analyze --non-inferiority`` end to end: a real redis-server holding calls and feedback written the
way the recorder writes them, analysed by the CLI as a user runs it, each figure checked against scipy on the
values the test planted.

A migration experiment: v2 is meant to be as good as v1, not better. Revenue is planted equal (non-inferior at a
2 % margin), the wait 30 % longer (inferior: lower is better, so its margin lies above), and a rare tip too
sparse to show anything (not shown non-inferior).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from tests.experiments import Call, Event, phase, write_calls, write_feedback
from tests.experiments import analyze_cli as cli
from tests.redis_server import RedisServer

HOUR_NS = 3_600 * 10**9
T0 = (time.time_ns() // 10**9 - 3 * 3_600) * 10**9
MODEL = "migration"
USERS = 4_000
METRICS = ("revenue:sum", "wait_s:sum:lower", "tip:sum")


@dataclass
class Planted:
    redis: RedisServer
    #: Per metric and arm, every user's total (zeros for users without an event).
    totals: dict[str, dict[str, np.ndarray]]


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Planted]:
    rng = np.random.default_rng(31)
    calls: list[Call] = []
    events: list[Event] = []
    totals: dict[str, dict[str, list[float]]] = {m.split(":")[0]: {"v1": [], "v2": []} for m in METRICS}
    for i in range(USERS):
        arm = "v1" if i % 2 == 0 else "v2"
        t = int(T0 + rng.integers(0, HOUR_NS // 2))
        calls.append(Call(f"c{i}", t, arm, unit=f"{i:064x}"))
        values = {
            "revenue": float(rng.normal(50.0, 5.0)),  # equal in both arms
            "wait_s": float(rng.normal(2.0 if arm == "v1" else 2.6, 0.5)),  # v2 waits 30 % longer
            "tip": float(rng.exponential(400.0)) if rng.random() < 0.005 else 0.0,  # rare and spread: shows nothing
        }
        for metric, value in values.items():
            totals[metric][arm].append(value)
            if value:
                events.append(Event(metric, value, t + 10**9, request_id=f"c{i}", idempotency_key=f"{metric}-{i}"))
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    client = server.client()
    write_calls(client, MODEL, calls, phase({"v1": 50, "v2": 50}, "v1", salt="ni"))
    write_feedback(client, MODEL, events)
    client.close()
    try:
        yield Planted(server, {m: {a: np.array(v) for a, v in arms.items()} for m, arms in totals.items()})
    finally:
        server.stop()


def analysed(planted: Planted, out: Path, *flags: str) -> tuple[str, dict[str, dict[str, Any]]]:
    metrics = [flag for metric in METRICS for flag in ("--metric", metric)]
    result = cli(
        MODEL, "--redis-url", planted.redis.url, "--since", str(T0 // 10**9), "--until", str((T0 + HOUR_NS) // 10**9),
        *metrics, *flags, "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    analysis = json.loads((out / "analysis.json").read_text())
    return result.stdout, {c["metric"]: c for c in analysis["phases"][0]["comparisons"]}


@pytest.mark.slow
def test_each_metric_is_tested_one_sided_against_the_margin_on_its_bad_side(planted: Planted, tmp_path: Path) -> None:
    stdout, comparisons = analysed(planted, tmp_path / "ni", "--non-inferiority", "0.5")
    revenue, wait, tip = (comparisons[m]["non_inferiority"] for m in ("revenue", "wait_s", "tip"))
    assert revenue["verdict"] == "non-inferior", revenue
    assert wait["verdict"] == "inferior", wait
    assert tip["verdict"] == "not shown non-inferior", tip
    # Against scipy: Welch's one-sided test on the data shifted by the margin (higher is better: +0.5 to v2;
    # wait is lower-is-better, so its margin is above: H0 v2 - v1 >= +0.5).
    for metric, ni, higher in (("revenue", revenue, True), ("wait_s", wait, False), ("tip", tip, True)):
        v1, v2 = planted.totals[metric]["v1"], planted.totals[metric]["v2"]
        shifted = v2 + 0.5 if higher else v2 - 0.5
        reference = stats.ttest_ind(shifted, v1, equal_var=False, alternative="greater" if higher else "less")
        assert ni["p_value"] == pytest.approx(reference.pvalue, rel=1e-6, abs=1e-12)
        interval = reference.confidence_interval(0.95)
        assert ni["bound"] == pytest.approx(interval.low - 0.5 if higher else interval.high + 0.5, rel=1e-6)
        assert ni["margin"] == (-0.5 if higher else 0.5)
        assert ni["relative"] is False
    assert "; non-inferior (within -0.5 of v1: one-sided 95 % lower bound " in comparisons["revenue"]["verdict_line"]
    assert "; inferior (past +0.5 of v1: one-sided 95 % lower bound +" in comparisons["wait_s"]["verdict_line"]
    assert "; not shown non-inferior (margin -0.5 of v1" in comparisons["tip"]["verdict_line"]
    assert comparisons["revenue"]["verdict_line"] in stdout
    html = (tmp_path / "ni" / "analysis.html").read_text()
    assert "revenue: v2 vs v1 non-inferior (within -0.5 of v1" in html


@pytest.mark.slow
def test_a_relative_margin_and_its_always_valid_form_and_holm(planted: Planted, tmp_path: Path) -> None:
    _, plain = analysed(planted, tmp_path / "relative", "--non-inferiority", "2%")
    revenue = plain["revenue"]["non_inferiority"]
    v1, v2 = planted.totals["revenue"]["v1"], planted.totals["revenue"]["v2"]
    mc, mt = v1.mean(), v2.mean()
    se = np.sqrt(v2.var(ddof=1) / len(v2) / mc**2 + mt**2 * v1.var(ddof=1) / len(v1) / mc**4)  # delta method
    assert revenue["p_value"] == pytest.approx(stats.norm.sf((mt / mc - 1 + 0.02) / se), rel=1e-6)
    assert revenue["bound"] == pytest.approx(mt / mc - 1 - stats.norm.ppf(0.95) * se, rel=1e-6)
    assert revenue["margin"] == pytest.approx(-0.02)
    assert revenue["verdict"] == "non-inferior"

    _, sequential = analysed(planted, tmp_path / "sequential", "--non-inferiority", "2%", "--sequential")
    always = sequential["revenue"]["non_inferiority"]
    assert always["sequential"] is True
    assert always["bound"] == pytest.approx(sequential["revenue"]["sequential_relative_ci"]["low"])
    assert always["bound"] < revenue["bound"]  # the sequence is wider than the fixed-horizon bound
    assert "always-valid one-sided 95 % lower bound" in sequential["revenue"]["verdict_line"]

    _, holm = analysed(planted, tmp_path / "holm", "--non-inferiority", "2%", "--correction", "holm")
    p = [holm[m]["non_inferiority"]["p_value"] for m in ("revenue", "wait_s", "tip")]
    expected = multipletests(p, method="holm")[1]
    adjusted = [holm[m]["non_inferiority"]["adjusted_p_value"] for m in ("revenue", "wait_s", "tip")]
    assert adjusted == pytest.approx(list(expected), rel=1e-9)
    assert "Holm-adjusted one-sided" in holm["revenue"]["verdict_line"]


@pytest.mark.parametrize(
    ("margin", "message"),
    [("abc", "--non-inferiority: bad margin 'abc'"), ("0%", "it must be above 0"), ("1e999", "it must be above 0")],
)
def test_a_bad_margin_exits_2_with_one_line_naming_the_flag(margin: str, message: str) -> None:
    result = cli("m", "--since", "-1h", "--metric", "click:rate", "--non-inferiority", margin)
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if "error" in line]
    assert message in line, result.stderr
