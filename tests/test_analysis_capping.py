"""Capping (``revenue:sum:cap=P99``) end to end: a real redis-server holding calls and revenue written the way the
recorder writes them, analysed by the CLI as a user runs it.

One user in the control spends a thousand times the others: uncapped, that one value swamps a planted 20 % lift
(the test is inconclusive); capped at the pooled 99th percentile, the lift is found.
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

from tests.experiments import Call, Event, phase, write_calls, write_feedback
from tests.experiments import analyze_cli as cli
from tests.redis_server import RedisServer

HOUR_NS = 3_600 * 10**9
T0 = (time.time_ns() // 10**9 - 3 * 3_600) * 10**9
MODEL = "capshop"
USERS = 2_000
OUTLIER = 50_000.0


@dataclass
class Planted:
    redis: RedisServer
    #: Each user's revenue in all, by arm (what the analysis must cap and compare).
    revenue: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Planted]:
    rng = np.random.default_rng(21)
    calls: list[Call] = []
    events: list[Event] = []
    revenue: dict[str, list[float]] = {"v1": [], "v2": []}
    for i in range(USERS):
        arm = "v1" if i % 2 == 0 else "v2"
        t = int(T0 + rng.integers(0, HOUR_NS // 2))
        calls.append(Call(f"c{i}", t, arm, unit=f"{i:064x}"))
        amount = float(rng.exponential(10.0 if arm == "v1" else 12.0))  # v2: +20 %, planted
        if i == 0:
            amount = OUTLIER  # one control user with a thousand times the revenue
        events.append(Event("revenue", amount, t + 10**9, request_id=f"c{i}", idempotency_key=f"r{i}"))
        revenue[arm].append(amount)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    client = server.client()
    write_calls(client, MODEL, calls, phase({"v1": 50, "v2": 50}, "v1", salt="cap"))
    write_feedback(client, MODEL, events)
    client.close()
    try:
        yield Planted(server, {arm: np.array(values) for arm, values in revenue.items()})
    finally:
        server.stop()


def analysed(planted: Planted, out: Path, *metrics: str) -> tuple[str, dict[str, Any]]:
    flags = [flag for metric in metrics for flag in ("--metric", metric)]
    result = cli(
        MODEL, "--redis-url", planted.redis.url, "--since", str(T0 // 10**9), "--until", str((T0 + HOUR_NS) // 10**9),
        *flags, "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout, json.loads((out / "analysis.json").read_text())


@pytest.mark.slow
def test_an_outlier_hides_the_lift_until_revenue_is_capped_at_the_pooled_p99(planted: Planted, tmp_path: Path) -> None:
    _, uncapped = analysed(planted, tmp_path / "plain", "revenue:sum")
    [plain] = uncapped["phases"][0]["comparisons"]
    assert plain["verdict"] == "inconclusive", plain["verdict_line"]
    assert plain["cap"] is None

    stdout, capped = analysed(planted, tmp_path / "capped", "revenue:sum:cap=P99")
    [result] = capped["phases"][0]["comparisons"]
    assert result["verdict"] == "better", result["verdict_line"]
    # The cap: the 99th percentile of every user's revenue, both arms pooled (the value of the unit at that rank).
    pooled = np.sort(np.concatenate([planted.revenue["v1"], planted.revenue["v2"]]))
    expected_cap = pooled[int(np.floor(0.99 * (len(pooled) - 1)))]
    assert result["cap"] == pytest.approx(expected_cap)
    expected_units = {arm: int((values > expected_cap).sum()) for arm, values in planted.revenue.items()}
    assert result["capped_units"] == expected_units
    assert expected_units["v1"] >= 1  # the outlier among them
    # The compared means are those of the capped values, and the interval holds the planted +20 %.
    for arm, key in (("v1", "control_value"), ("v2", "arm_value")):
        assert result[key] == pytest.approx(np.minimum(planted.revenue[arm], expected_cap).mean())
    arms = {arm["arm"]: arm for arm in capped["phases"][0]["arms"]}
    assert arms["v1"]["metrics"]["revenue"]["capped_units"] == expected_units["v1"]
    assert arms["v2"]["metrics"]["revenue"]["cap"] == pytest.approx(expected_cap)
    assert capped["metrics"] == ["revenue:sum:cap=P99"]
    # The table says the cap and the units capped per arm; the page too.
    assert f"revenue capped at {expected_cap:.4g} (P99, pooled over the arms) per unit; units capped: " in stdout
    assert f"v1 {expected_units['v1']}, v2 {expected_units['v2']}" in stdout
    html = (tmp_path / "capped" / "analysis.html").read_text()
    assert f"capped at {expected_cap:.4g} per unit" in html


def test_a_fixed_cap_on_a_lower_is_better_mean_caps_each_users_total(planted: Planted, tmp_path: Path) -> None:
    _, analysis = analysed(planted, tmp_path / "fixed", "revenue:mean:lower:cap=100")
    [result] = analysis["phases"][0]["comparisons"]
    assert result["direction"] == "lower"
    assert result["cap"] == 100
    assert result["capped_units"] == {arm: int((v > 100).sum()) for arm, v in planted.revenue.items()}
    assert result["control_value"] == pytest.approx(np.minimum(planted.revenue["v1"], 100).mean())


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        ("click:rate:cap=P99", "a cap applies to a number per unit (kinds mean and sum), not to rate"),
        ("buy:conversion:cap=5", "not to conversion"),
        ("revenue:sum:cap=P99:lower", "the cap goes last"),
        ("revenue:sum:cap=Q99", "bad cap='Q99'"),
        ("revenue:sum:cap=P0", "a percentile is above 0"),
        ("revenue:sum:cap=inf", "the cap must be a finite number"),
    ],
)
def test_a_cap_where_none_can_apply_exits_2_with_one_line(metric: str, message: str) -> None:
    result = cli("m", "--metric", metric)
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if "error" in line]
    assert message in line, result.stderr
    assert "--metric" in line or "bad metric" in line


@pytest.mark.slow
def test_a_cap_with_more_than_six_digits_is_applied_as_written(planted: Planted, tmp_path: Path) -> None:
    """The spec keeps its cap as text: rounded to six digits, P99.99999 became P100 (no unit capped) and a fixed
    cap of 1234.567 became 1234.57."""
    _, percentile = analysed(planted, tmp_path / "percentile", "revenue:sum:cap=P99.99999")
    [by_rank] = percentile["phases"][0]["comparisons"]
    pooled = np.sort(np.concatenate([planted.revenue["v1"], planted.revenue["v2"]]))
    expected_cap = pooled[int(np.floor(0.9999999 * (len(pooled) - 1)))]
    assert expected_cap < OUTLIER
    assert by_rank["cap"] == pytest.approx(expected_cap)
    assert by_rank["capped_units"] == {"v1": 1, "v2": 0}  # the outlier, and no one else
    assert percentile["metrics"] == ["revenue:sum:cap=P99.99999"]
    _, fixed = analysed(planted, tmp_path / "fixed", "revenue:mean:cap=1234.567")
    [by_value] = fixed["phases"][0]["comparisons"]
    assert by_value["cap"] == 1234.567
    assert fixed["metrics"] == ["revenue:mean:cap=1234.567"]


@pytest.fixture(scope="module")
def huge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Planted]:
    """Revenue a float can hold but not square: every fifth user's is 1e300 (the rest 3)."""
    calls = [Call(f"c{i}", T0 + i * 10**9, "v1" if i % 2 == 0 else "v2", unit=f"{i:064x}") for i in range(400)]
    amounts = [1e300 if i % 5 == 4 else 3.0 for i in range(400)]
    events = [
        Event("revenue", amount, call.time_ns + 10**9, request_id=call.request_id, idempotency_key=f"h{i}")
        for i, (call, amount) in enumerate(zip(calls, amounts, strict=True))
    ]
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    client = server.client()
    write_calls(client, MODEL, calls, phase({"v1": 50, "v2": 50}, "v1", salt="huge"))
    write_feedback(client, MODEL, events)
    client.close()
    try:
        yield Planted(server, {arm: np.array(amounts[start::2]) for start, arm in ((0, "v1"), (1, "v2"))})
    finally:
        server.stop()


@pytest.mark.parametrize(
    "flags",
    [("revenue:sum:cap=P99",), ("revenue:sum", "--engine", "bayes"), ("revenue:mean", "--non-inferiority", "1%")],
)
def test_values_too_large_to_square_give_no_relative_lift_not_a_traceback(
    huge: Planted, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """The delta method squared the control's mean with ``**``, which raises OverflowError on a float past 1e154:
    the analysis died with a traceback. The relative lift is now absent, as for a control at 0."""
    metric, *more = flags
    result = cli(
        MODEL, "--redis-url", huge.redis.url, "--since", str(T0 // 10**9), "--until", str((T0 + HOUR_NS) // 10**9),
        "--metric", metric, *more, "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [comparison] = json.loads((tmp_path / "analysis.json").read_text())["phases"][0]["comparisons"]
    assert comparison["relative_lift"] is None
    assert comparison["control_value"] == pytest.approx(np.mean(huge.revenue["v1"]))


@pytest.mark.slow
def test_a_cap_below_every_value_leaves_no_variance_and_is_not_shown_non_inferior(
    planted: Planted, tmp_path: Path
) -> None:
    """A cap under every user's revenue makes each arm one number: a standard error of 0 read as certainty
    said "non-inferior" (p = 0) on no evidence at all. Now: not shown non-inferior, saying why."""
    cap = 0.0001
    assert min(values.min() for values in planted.revenue.values()) > cap  # every unit is capped
    for sequential in ((), ("--sequential",)):
        out = tmp_path / f"flat{len(sequential)}"
        result = cli(
            MODEL, "--redis-url", planted.redis.url, "--since", str(T0 // 10**9),
            "--until", str((T0 + HOUR_NS) // 10**9), "--metric", f"revenue:sum:cap={cap}", "--non-inferiority", "1%",
            *sequential, "--output-dir", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        [comparison] = json.loads((out / "analysis.json").read_text())["phases"][0]["comparisons"]
        assert comparison["control_value"] == comparison["arm_value"] == pytest.approx(cap)
        test = comparison["non_inferiority"]
        assert test["verdict"] == "not shown non-inferior", test["text"]
        assert test["p_value"] is None
        assert "no variance, every unit's value the same in both arms, capped at 0.0001" in test["text"]
        assert "not shown non-inferior (margin -1 % of v1: no variance" in result.stdout
