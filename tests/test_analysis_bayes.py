"""``analyze --engine bayes``: the closed forms against Monte Carlo draws and GrowthBook's published gbstats
numbers, the rate at which an A/A experiment reads "better" (simulated), and the CLI on real processes (a
redis-server holding the shop experiment of ``tests/test_analysis.py``, v2 planted with more clicks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from splitstream.analysis import bayes
from splitstream.analysis.statistics import Estimate, UnitValues, estimate
from tests.test_analysis import SHOP, Shop, cli, shop, window_flags

__all__ = ["shop"]  # the module-scoped fixture, imported for the CLI tests below

#: A/A experiments simulated, and units per arm in each.
AA_SIMULATIONS = 4_000
AA_UNITS = 500


def test_chance_and_expected_losses_match_monte_carlo_draws_of_the_posterior() -> None:
    rng = np.random.default_rng(7)
    for mean, sd in ((0.02, 0.01), (-0.005, 0.02), (0.0, 0.03), (0.1, 0.04)):
        draws = rng.normal(mean, sd, 2_000_000)
        chance = bayes.chance_to_beat(mean, sd)
        choosing, keeping = bayes.expected_losses(mean, sd)
        assert chance == pytest.approx(float((draws > 0).mean()), abs=2e-3)
        # Monte Carlo error of a mean of max(., 0) over 2e6 draws is about sd / 1400.
        assert choosing == pytest.approx(float(np.maximum(-draws, 0).mean()), abs=sd / 300)
        assert keeping == pytest.approx(float(np.maximum(draws, 0).mean()), abs=sd / 300)
        assert keeping - choosing == pytest.approx(mean, abs=1e-12)  # E[max(X,0)] - E[max(-X,0)] = E[X]


def _growthbook_norm_example() -> tuple[Estimate, Estimate]:
    """gbstats' ``TestNorm`` (packages/stats/tests/bayesian/test_tests.py): control sum 100, sum of squares
    1002.25, n 10; treatment 105, 1111.5, 10. Built here from units with exactly those sums."""
    control = np.array([10.75, 9.25, 10.75, 9.25, *[10.0] * 6])
    treatment = np.array([12.0, 9.0, 12.0, 9.0, *[10.5] * 6])
    assert (control.sum(), (control**2).sum()) == (100, 1002.25)
    assert (treatment.sum(), (treatment**2).sum()) == (105, 1111.5)
    return estimate(UnitValues.of_means(control)), estimate(UnitValues.of_means(treatment))


def test_the_flat_prior_reproduces_growthbooks_published_gaussian_example() -> None:
    control, treatment = _growthbook_norm_example()
    reading = bayes.read(control, treatment, bayes.Prior())
    assert reading is not None
    # gbstats: expected 0.05, stddev 0.03572, ci (-0.02, 0.12), chanceToWin 0.91923, risk [0.05131, 0.00131]
    assert round(reading.relative.mean, 5) == 0.05
    assert round(reading.relative.sd, 5) == 0.03572
    assert tuple(round(x, 5) for x in reading.relative.interval(0.05)) == (-0.02, 0.12)
    assert round(reading.chance_to_beat, 5) == 0.91923
    assert round(reading.loss_keeping_control, 5) == 0.05131
    assert round(reading.loss_choosing_arm, 5) == 0.00131


def test_a_proper_prior_reproduces_growthbooks_informative_example() -> None:
    control, treatment = _growthbook_norm_example()
    # gbstats' GaussianPrior(mean=0.1, variance=0.1, proper=True) on the relative lift.
    reading = bayes.read(control, treatment, bayes.Prior(mean=0.1, sd=math.sqrt(0.1)))
    assert reading is not None
    # gbstats: expected 0.05063, stddev 0.03549, ci (-0.01893, 0.12019), chanceToWin 0.92315,
    # risk [0.05186, 0.00123]
    assert round(reading.relative.mean, 5) == 0.05063
    assert round(reading.relative.sd, 5) == 0.03549
    assert tuple(round(x, 5) for x in reading.relative.interval(0.05)) == (-0.01893, 0.12019)
    assert round(reading.chance_to_beat, 5) == 0.92315
    assert round(reading.loss_keeping_control, 5) == 0.05186
    assert round(reading.loss_choosing_arm, 5) == 0.00123
    # The absolute lift's prior is the relative one scaled by the control's value (10): N(1, 10).
    assert reading.absolute is not None
    expected = bayes.normal_posterior(0.5, control.variance + treatment.variance, 1.0, 10.0)
    assert reading.absolute.mean == pytest.approx(expected.mean)


def test_a_lower_is_better_metric_beats_control_by_going_down() -> None:
    control, treatment = _growthbook_norm_example()
    up = bayes.read(control, treatment, bayes.Prior())
    down = bayes.read(control, treatment, bayes.Prior(), higher_is_better=False)
    assert up is not None
    assert down is not None
    assert down.chance_to_beat == pytest.approx(1 - up.chance_to_beat)
    assert (down.loss_choosing_arm, down.loss_keeping_control) == pytest.approx(
        (up.loss_keeping_control, up.loss_choosing_arm)
    )
    assert bayes.verdict(down.chance_to_beat, 0.9) == "worse"


def test_a_control_at_zero_has_no_reading() -> None:
    assert bayes.read(Estimate(0.0, 0.0, 10), Estimate(0.1, 0.001, 10), bayes.Prior()) is None


def aa_better_rate(prior: bayes.Prior, threshold: float, seed: int) -> tuple[float, float]:
    """Share of simulated A/A experiments (skewed per-unit revenue, both arms alike) read "better" and "worse"."""
    rng = np.random.default_rng(seed)
    values = rng.exponential(20.0, (AA_SIMULATIONS, 2, AA_UNITS))
    means = values.mean(axis=2)
    variances = values.var(axis=2, ddof=1) / AA_UNITS
    verdicts = [
        bayes.verdict(reading.chance_to_beat, threshold)
        for reading in (
            bayes.read(Estimate(m[0], v[0], AA_UNITS), Estimate(m[1], v[1], AA_UNITS), prior)
            for m, v in zip(means, variances, strict=True)
        )
        if reading is not None
    ]
    return verdicts.count("better") / len(verdicts), verdicts.count("worse") / len(verdicts)


def test_an_aa_experiment_reads_better_about_one_time_in_twenty_at_the_default_threshold() -> None:
    # With a flat prior the chance to beat control is Phi(z): uniform under A/A, so "better" at 0.95 comes up
    # about 5 % of the time (and "worse" as often). Not a guarantee: it holds for one look, not for many.
    better, worse = aa_better_rate(bayes.Prior(), 0.95, seed=3)
    assert better == pytest.approx(0.05, abs=0.012)  # ±3.5 simulation standard errors
    assert worse == pytest.approx(0.05, abs=0.012)
    # A proper prior centred on no change shrinks the lift toward 0: fewer A/A "wins".
    shrunk, _ = aa_better_rate(bayes.Prior(0.0, 0.01), 0.95, seed=3)
    assert shrunk < better


@pytest.mark.slow
def test_the_cli_reads_a_planted_lift_as_better_with_its_bayesian_fields(shop: Shop, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = cli(
        SHOP, "--redis-url", shop.redis.url, *window_flags(), "--metric", "click:rate",
        "--metric", "satisfaction:mean", "--engine", "bayes", "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    click_line = next(line for line in result.stdout.splitlines() if "v2 vs v1: click" in line)
    assert "95 % credible interval" in click_line, click_line
    assert "flat prior" in click_line
    assert ": v2 better: " in click_line
    assert "chance to beat control, expected loss" in click_line
    assert "Bayesian (flat prior; better at 95 % chance to beat control)" in result.stdout
    document = json.loads((out / "analysis.json").read_text())
    assert document["engine"] == "bayes"
    assert document["prior_sd"] is None
    assert document["bayes_threshold"] == 0.95
    [phase] = document["phases"]
    click = next(c for c in phase["comparisons"] if c["metric"] == "click")
    b = click["bayes"]
    assert click["verdict"] == "better"
    assert b["chance_to_beat_control"] >= 0.95
    assert b["expected_loss_choosing_arm"] < b["expected_loss_keeping_control"]
    low, high = b["relative_credible_interval"]["low"], b["relative_credible_interval"]["high"]
    assert low < b["relative_mean"] < high
    assert low < 0.5 < high  # planted: 15 % clicked against 10 %
    assert b["absolute_credible_interval"]["low"] > 0
    assert click["p_value"] is not None  # the frequentist reading stays beside it
    # Satisfaction has no planted difference: not "better" at 95 %.
    satisfaction = next(c for c in phase["comparisons"] if c["metric"] == "satisfaction")
    assert satisfaction["verdict"] in ("inconclusive", "worse")
    html = (out / "analysis.html").read_text()
    assert "class='bayes'" in html
    assert "chance to beat control" in html


@pytest.mark.slow
def test_a_proper_prior_is_recorded_and_pulls_the_lift_toward_its_mean(shop: Shop, tmp_path: Path) -> None:
    flat, tight = tmp_path / "flat", tmp_path / "tight"
    for out, extra in ((flat, []), (tight, ["--prior-mean", "0", "--prior-sd", "0.05"])):
        result = cli(SHOP, "--redis-url", shop.redis.url, *window_flags(), "--metric", "click:rate",
                     "--engine", "bayes", "--output-dir", str(out), *extra)  # fmt: skip
        assert result.returncode == 0, result.stderr
    documents = [json.loads((out / "analysis.json").read_text()) for out in (flat, tight)]
    assert (documents[1]["prior_mean"], documents[1]["prior_sd"]) == (0.0, 0.05)
    lifts = [d["phases"][0]["comparisons"][0]["bayes"]["relative_mean"] for d in documents]
    assert 0 < lifts[1] < lifts[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine", "bayes", "--prior-sd", "0"], "--prior-sd: a positive finite standard deviation"),
        (["--engine", "bayes", "--bayes-threshold", "0.4"], "--bayes-threshold: a chance strictly between"),
        (["--engine", "bayes", "--prior-mean", "nan"], "--prior-mean: must be a finite number"),
        (["--engine", "bayes", "--sequential"], "--sequential: always-valid p-values belong to"),
        (["--engine", "bayes", "--correction", "holm"], "--correction holm: it corrects p-values"),
        (["--prior-sd", "0.3"], "go with --engine bayes"),
        (["--engine", "bayesian"], "invalid choice: 'bayesian'"),
    ],
    ids=["zero-sd", "low-threshold", "nan-mean", "sequential", "correction", "prior-without-engine", "bad-engine"],
)
def test_bad_bayesian_flags_exit_2_with_one_line(flags: list[str], message: str) -> None:
    result = cli(SHOP, "--redis-url", "redis://127.0.0.1:1/0", "--since", "-4h", "--metric", "click:rate", *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
