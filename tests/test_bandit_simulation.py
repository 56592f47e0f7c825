"""Thompson sampling of ``splitstream bandit`` simulated: thousands of runs at once, vectorised.

Two arms convert at 0.10 (the control) and 0.13; each interval 1,000 users arrive and are split by the weights
the bandit set from the feedback so far (the module's own posterior draws, P(best), holdout and floor). The
bandit's read-out (each phase's lift, averaged with the phase's units) must be unbiased for the true lift,
within its Monte Carlo error; the naive estimate pooling every unit of an arm over all phases is not when the
base rate drifts, as it does over a day, because the share of the better arm drifts with it. The figures are
in docs/bandits.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from scipy import stats

from splitstream.admin import thompson

SIMULATIONS = 2_000
INTERVALS = 15
USERS_PER_INTERVAL = 1_000
RATES = np.array([0.10, 0.13])
TRUE_LIFT = 0.03
HOLDOUT = 0.20
MIN_WEIGHT = 0.05
#: Posterior draws per interval and run (the CLI takes 10,000; P(best) then moves by a percent or so).
DRAWS = 200


@dataclass(frozen=True)
class Runs:
    final_share: np.ndarray  # the better arm's weight set after the last interval, per run
    stratified: np.ndarray  # the read-out per run
    stratified_se: np.ndarray
    pooled: np.ndarray  # every unit of an arm over all phases, per run


def simulate(*, drift_per_interval: float, seed: int) -> Runs:
    """Both arms' conversion moves by ``drift_per_interval`` each interval (the lift stays 0.03)."""
    rng = np.random.default_rng(seed)
    successes = np.zeros((SIMULATIONS, 2))
    units = np.zeros((SIMULATIONS, 2))
    lifts = np.zeros((SIMULATIONS, INTERVALS))
    variances = np.zeros((SIMULATIONS, INTERVALS))
    weights = np.full((SIMULATIONS, 2), 0.5)
    for t in range(INTERVALS):
        treated = rng.binomial(USERS_PER_INTERVAL, weights[:, 1])
        n = np.stack([USERS_PER_INTERVAL - treated, treated], axis=-1)
        s = rng.binomial(n, RATES + drift_per_interval * t)
        successes += s
        units += n
        p = s / np.maximum(n, 1)
        lifts[:, t] = p[:, 1] - p[:, 0]
        # The analysis's per-phase variance of a conversion lift (Welch on 0/1 values, ddof 1).
        variances[:, t] = (p * (1 - p) / np.maximum(n - 1, 1)).sum(axis=-1)
        _, samples = thompson.beta_draws(successes, units, DRAWS, rng)
        weights = thompson.allocate(thompson.p_best(samples), holdout=HOLDOUT, min_weight=MIN_WEIGHT)
    estimate, variance = thompson.stratified(lifts, variances, np.full(lifts.shape, USERS_PER_INTERVAL))
    pooled = successes[:, 1] / units[:, 1] - successes[:, 0] / units[:, 0]
    return Runs(weights[:, 1], estimate, np.sqrt(variance), pooled)


@pytest.fixture(scope="module")
def steady() -> Runs:
    return simulate(drift_per_interval=0.0, seed=20261206)


@pytest.fixture(scope="module")
def drifting() -> Runs:
    return simulate(drift_per_interval=0.004, seed=20261207)


def monte_carlo_z(values: np.ndarray, truth: float) -> float:
    return float((values.mean() - truth) / (values.std(ddof=1) / np.sqrt(len(values))))


def test_most_traffic_ends_on_the_arm_that_converts_better(steady: Runs) -> None:
    # The ceiling is 1 - holdout/2 = 90 %; every run gets most of the way there.
    assert steady.final_share.mean() > 0.85
    assert np.mean(steady.final_share > 0.5) > 0.99


def test_the_per_phase_read_out_is_unbiased_for_the_lift(steady: Runs, drifting: Runs) -> None:
    for runs in (steady, drifting):
        assert abs(monte_carlo_z(runs.stratified, TRUE_LIFT)) < 3.5
        # Its standard error is honest too: the 95 % interval covers the true lift about 95 % of the time.
        covered = np.abs(runs.stratified - TRUE_LIFT) <= stats.norm.ppf(0.975) * runs.stratified_se
        assert 0.93 < covered.mean() < 0.97


def test_pooling_every_phase_is_biased_when_the_base_rate_drifts(drifting: Runs) -> None:
    # The better arm's share rises as the rates rise, so its units come from the later, higher, phases.
    assert monte_carlo_z(drifting.pooled, TRUE_LIFT) > 10


def test_inverse_variance_weights_would_bias_the_read_out(steady: Runs) -> None:
    """Why the read-out weighs phases by units: estimated binomial variances are smallest where a starved
    arm's rate came out low by chance, so inverse-variance weights favour the phases with the largest lifts."""
    rng = np.random.default_rng(7)
    n = np.array([100, 900])  # the 10/90 split the bandit settles at
    s = rng.binomial(np.broadcast_to(n, (SIMULATIONS, INTERVALS, 2)), RATES)
    p = s / n
    lifts = p[..., 1] - p[..., 0]
    variances = (p * (1 - p) / (n - 1)).sum(axis=-1)
    inverse_variance = (lifts / variances).sum(axis=-1) / (1 / variances).sum(axis=-1)
    by_units, _ = thompson.stratified(lifts, variances, np.full(lifts.shape, n.sum()))
    assert monte_carlo_z(inverse_variance, TRUE_LIFT) > 10
    assert abs(monte_carlo_z(by_units, TRUE_LIFT)) < 3.5
