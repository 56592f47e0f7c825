"""Quantile treatment effects: the clustered delta-method interval against scipy's bootstrap over users, A/A
false-positive rates of the clustered and the naive per-call interval, the always-valid sequence under repeated
looks, and the ``--guard METRIC:QUANTILE:ratio<=BOUND`` syntax (bad input exits 2 naming the flag)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from splitstream.admin.main import main
from splitstream.admin.quantile_guards import QuantileGuard
from splitstream.analysis import quantiles as qt
from splitstream.analysis.unit_buckets import UnitBuckets
from tests.harness import write_registry


def clustered_arm(rng: np.random.Generator, users: int, *, slowdown: float = 1.0) -> qt.CallValues:
    """Users with 1 to ~40 calls (geometric, mean 8) and a random effect of their own on the log latency: the
    correlation within a user that makes a per-call interval too narrow."""
    counts = rng.geometric(1 / 8, users)
    effect = rng.normal(0, 0.5, users)
    unit = np.repeat(np.arange(users), counts)
    latency = slowdown * np.exp(3 + effect[unit] + rng.normal(0, 0.5, len(unit)))
    return qt.CallValues(latency, unit)


@pytest.mark.parametrize("q", [0.5, 0.9])
def test_the_clustered_standard_error_agrees_with_scipys_bootstrap_over_users(q: float) -> None:
    rng = np.random.default_rng(7)
    arm = clustered_arm(rng, 200)
    order = np.argsort(arm.units, kind="stable")
    starts = np.searchsorted(arm.units[order], np.arange(arm.unit_count + 1))
    by_user = [arm.values[order][starts[i] : starts[i + 1]] for i in range(arm.unit_count)]

    def pooled_quantile(users: np.ndarray) -> float:
        return float(np.quantile(np.concatenate([by_user[int(u)] for u in users]), q, method="inverted_cdf"))

    boot = stats.bootstrap(
        (np.arange(arm.unit_count),), pooled_quantile, vectorized=False, n_resamples=1500, random_state=rng
    )
    ours = qt.estimate(arm, q)
    assert ours is not None
    assert ours.value == pytest.approx(pooled_quantile(np.arange(arm.unit_count)))
    assert ours.std_error == pytest.approx(boot.standard_error, rel=0.25)
    # The per-call interval ignores the users: far narrower than the bootstrap over them.
    naive = qt.estimate(arm, q, clustered=False)
    assert naive is not None
    assert naive.std_error < 0.7 * boot.standard_error


def test_calls_counted_per_unit_and_bucket_give_the_quantile_and_interval_of_the_calls_one_by_one() -> None:
    """What the analysis keeps (a unit's calls per latency bucket, merged across pages) changes nothing."""
    rng = np.random.default_rng(2)
    arm = clustered_arm(rng, 500)
    values = np.round(arm.values)  # coarse, so units repeat a value and pairs merge
    pairs = UnitBuckets(merge_after=500)  # merged every few pages, as a long window's are
    for page in np.array_split(np.arange(len(values)), 20):
        pairs.add(arm.units[page], values[page].astype(np.int64), np.zeros(len(page), np.int64))
    merged = pairs.result()
    assert int(merged.counts.sum()) == len(values)
    assert len(merged.rows) == len(np.unique(arm.units * 10_000 + values))
    weighted = qt.CallValues.of(merged.buckets.astype(float), merged.rows, merged.counts)
    one_by_one = qt.CallValues(values, arm.units)
    for q in qt.QUANTILES:
        assert qt.estimate(weighted, q) == qt.estimate(one_by_one, q)


def test_a_p99_of_few_calls_has_no_interval_rather_than_a_false_one() -> None:
    """30 calls: the p99 is the largest, and nothing past it bounds it; an interval of 0 width would trip a guard
    on noise."""
    rng = np.random.default_rng(4)
    control = qt.CallValues(rng.lognormal(3, 0.5, 30), np.arange(30))
    treatment = qt.CallValues(rng.lognormal(3, 0.5, 30), np.arange(30))
    estimate = qt.estimate(control, 0.99)
    assert estimate is not None
    assert estimate.value == control.values.max()
    assert np.isnan(estimate.high)
    effect = qt.compare(control, treatment, 0.99)
    assert effect is not None
    assert (effect.ratio_ci, effect.p_value, effect.sequential_ratio_ci) == (None, None, None)
    assert qt.compare(control, treatment, 0.5).ratio_ci is not None  # type: ignore[union-attr]


@pytest.mark.slow
def test_an_aa_test_of_the_ratio_holds_alpha_clustered_and_not_per_call() -> None:
    """1,000 A/A experiments of 300 users per arm at p50, p90 and p99 (the figures of docs/analysis.md). A p99
    without an interval (too few calls past it: p + z sigma > 1) rejects nothing, as a guard leaves it unjudged."""
    rng = np.random.default_rng(11)
    simulations = 1000
    rejected = {(q, clustered): 0 for q in qt.QUANTILES for clustered in (True, False)}
    unbounded = 0
    for _ in range(simulations):
        control, treatment = clustered_arm(rng, 300), clustered_arm(rng, 300)
        for q in qt.QUANTILES:
            for clustered in (True, False):
                effect = qt.compare(control, treatment, q, clustered=clustered)
                assert effect is not None
                if effect.p_value is None:
                    unbounded += 1
                    continue
                rejected[q, clustered] += effect.p_value < 0.05
    rates = {key: count / simulations for key, count in rejected.items()}
    print(rates, f"{unbounded} without an interval")
    assert unbounded < 0.05 * simulations
    for q in qt.QUANTILES:
        assert 0.03 <= rates[q, True] <= 0.07, rates
        assert rates[q, False] > 0.12, rates


def test_a_real_slowdown_is_found_with_its_ratio_inside_the_interval() -> None:
    rng = np.random.default_rng(3)
    control, treatment = clustered_arm(rng, 2000), clustered_arm(rng, 2000, slowdown=1.3)
    for q in qt.QUANTILES:
        effect = qt.compare(control, treatment, q)
        assert effect is not None
        assert effect.ratio_ci is not None
        assert effect.sequential_ratio_ci is not None
        assert effect.ratio_ci[0] < 1.3 < effect.ratio_ci[1]
        assert effect.p_value is not None
        assert effect.p_value < 0.05
        # The always-valid sequence is wider than the fixed-horizon interval it replaces at repeated looks.
        assert effect.sequential_ratio_ci[0] < effect.ratio_ci[0]
        assert effect.sequential_ratio_ci[1] > effect.ratio_ci[1]
        difference = effect.treatment.value - effect.control.value
        assert effect.difference_ci[0] < difference < effect.difference_ci[1]


@pytest.mark.slow
def test_under_repeated_looks_the_sequence_keeps_the_guards_false_trips_rare_and_the_fixed_interval_does_not() -> None:
    """400 A/A rollouts, each looked at 10 times as users arrive: how often the guard ``p90 ratio <= 1.0`` would
    trip at some look (the lower end past 1) with the always-valid sequence, and with the fixed-horizon interval."""
    rng = np.random.default_rng(5)
    simulations, looks, users = 400, 10, 400
    tripped_sequential = tripped_fixed = 0
    for _ in range(simulations):
        control, treatment = clustered_arm(rng, users), clustered_arm(rng, users)
        sequential = fixed = False
        for look in range(1, looks + 1):
            seen = users * look // looks
            effect = qt.compare(
                qt.CallValues(control.values[control.units < seen], control.units[control.units < seen]),
                qt.CallValues(treatment.values[treatment.units < seen], treatment.units[treatment.units < seen]),
                0.9,
                tuning_units=users,
            )
            assert effect is not None
            if effect.ratio_ci is None or effect.sequential_ratio_ci is None:
                continue  # too few calls past the p90 at this look: not judged, as the guard does
            fixed |= effect.ratio_ci[0] > 1.0
            sequential |= effect.sequential_ratio_ci[0] > 1.0
        tripped_sequential += sequential
        tripped_fixed += fixed
    sequential_rate, fixed_rate = tripped_sequential / simulations, tripped_fixed / simulations
    print(f"sequential {sequential_rate:.3f}, fixed-horizon {fixed_rate:.3f}")
    assert sequential_rate <= 0.05
    assert fixed_rate > 0.05
    assert fixed_rate > 2 * sequential_rate


def test_the_delta_method_on_100k_calls_takes_milliseconds() -> None:
    rng = np.random.default_rng(1)
    control, treatment = clustered_arm(rng, 6250), clustered_arm(rng, 6250)
    assert len(control.values) + len(treatment.values) > 90_000
    started = time.perf_counter()
    for q in qt.QUANTILES:
        qt.compare(control, treatment, q)
    assert time.perf_counter() - started < 0.5


# -- the guard's syntax -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "metric", "quantile", "bound"),
    [
        ("latency:p99:ratio<=1.10", "latency", "p99", 1.10),
        ("ttft:p50:ratio<=1.2", "ttft", "p50", 1.2),
        ("Latency:P90:ratio <= 2", "latency", "p90", 2.0),
    ],
)
def test_a_quantile_guard_names_its_metric_quantile_and_bound(
    text: str, metric: str, quantile: str, bound: float
) -> None:
    guard = QuantileGuard.parse(text)
    assert (guard.metric, guard.quantile, guard.bound) == (metric, quantile, bound)


@pytest.mark.parametrize(
    ("guard", "message"),
    [
        ("latency:p95:ratio<=1.1", "the quantile is p50, p90 or p99, not 'p95'"),
        ("tokens:p99:ratio<=1.1", "a ratio guard is on latency or ttft"),
        ("latency:p99:ratio>=0.9", "bounded from above with ratio<=BOUND"),
        ("latency:p99:ratio<=0", "the bound must be a ratio above 0"),
        ("latency:p99:ratio<=fast", "the bound 'fast' is not a number"),
        ("latency:ratio<=1.1", "expected METRIC:QUANTILE:ratio<=BOUND"),
    ],
)
def test_a_bad_quantile_guard_exits_2_with_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], guard: str, message: str
) -> None:
    registry = tmp_path / "registry.yaml"
    write_registry(
        registry,
        {
            "m": {
                "endpoints": {"v1": ["127.0.0.1:1"], "v2": ["127.0.0.1:2"]},
                "experiment": {"salt": "s", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
            }
        },
    )
    before = registry.read_bytes()
    argv = ["--registry", f"file:{registry}", "rollout", "m", "v2", "--metrics", "127.0.0.1:1", "--guard", guard]
    try:
        code = main(argv)
    except SystemExit as usage_error:
        code = usage_error.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert "--guard" in err, err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1
    assert registry.read_bytes() == before
