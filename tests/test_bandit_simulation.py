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
from scipy import integrate, stats

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


def simulate(*, drift_per_interval: float, seed: int, rates: np.ndarray = RATES) -> Runs:
    """Both arms' conversion moves by ``drift_per_interval`` each interval (the lift stays ``rates``' difference)."""
    rng = np.random.default_rng(seed)
    successes = np.zeros((SIMULATIONS, 2))
    units = np.zeros((SIMULATIONS, 2))
    lifts = np.zeros((SIMULATIONS, INTERVALS))
    variances = np.zeros((SIMULATIONS, INTERVALS))
    weights = np.full((SIMULATIONS, 2), 0.5)
    for t in range(INTERVALS):
        treated = rng.binomial(USERS_PER_INTERVAL, weights[:, 1])
        n = np.stack([USERS_PER_INTERVAL - treated, treated], axis=-1)
        s = rng.binomial(n, rates + drift_per_interval * t)
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


@pytest.fixture(scope="module")
def equal() -> Runs:
    """An A/A bandit: both arms convert at 0.10 and the weights wander with the posterior's draws."""
    return simulate(drift_per_interval=0.0, seed=20261208, rates=np.array([0.10, 0.10]))


def monte_carlo_z(values: np.ndarray, truth: float) -> float:
    return float((values.mean() - truth) / monte_carlo_se(values))


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


def test_the_read_out_of_equal_arms_finds_a_difference_at_its_alpha(equal: Runs) -> None:
    """The holdout's unbiased read-out as a test: equal arms declared different at 5 % in about 5 % of runs
    (2,000 runs: a Monte Carlo standard error of 0.49 points), although the weights chased noise each interval."""
    z = equal.stratified / equal.stratified_se
    false_positives = float(np.mean(np.abs(z) > stats.norm.ppf(0.975)))
    assert 0.035 < false_positives < 0.065, false_positives
    print(f"A/A false positives at 5 %: {false_positives:.2%}")


def test_pooling_every_phase_is_biased_when_the_base_rate_drifts(drifting: Runs) -> None:
    # The better arm's share rises as the rates rise, so its units come from the later, higher, phases.
    assert monte_carlo_z(drifting.pooled, TRUE_LIFT) > 10


def test_inverse_variance_weights_would_bias_the_read_out() -> None:
    inverse_variance_at_10_90()


def inverse_variance_at_10_90() -> tuple[float, float]:
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
    return float(inverse_variance.mean()), monte_carlo_se(inverse_variance)


def test_p_best_of_two_beta_posteriors_matches_the_integral_scipy_computes() -> None:
    # P(B > A) = ∫ f_B(x) F_A(x) dx for A ~ Beta(1 + 12, 1 + 88), B ~ Beta(1 + 18, 1 + 82).
    a, b = stats.beta(13, 89), stats.beta(19, 83)
    exact, _ = integrate.quad(lambda x: b.pdf(x) * a.cdf(x), 0, 1)
    means, samples = thompson.beta_draws([12, 18], [100, 100], 200_000, np.random.default_rng(1))
    p = thompson.p_best(samples)
    assert abs(p[1] - exact) < 4 * np.sqrt(exact * (1 - exact) / 200_000)
    assert p.sum() == pytest.approx(1.0)
    assert means == pytest.approx([13 / 102, 19 / 102])


def test_p_best_of_normal_posteriors_follows_the_direction() -> None:
    # P(B > A) = Φ((μ_B - μ_A) / sqrt(v_A + v_B)); lower is better reverses it.
    exact = stats.norm.cdf((5.2 - 5.0) / np.sqrt(0.01 + 0.02))
    _, samples = thompson.normal_draws([5.0, 5.2], [0.01, 0.02], 200_000, np.random.default_rng(2))
    higher, lower = thompson.p_best(samples), thompson.p_best(samples, higher_is_better=False)
    assert abs(higher[1] - exact) < 4 * np.sqrt(exact * (1 - exact) / 200_000)
    assert lower[1] == pytest.approx(1 - higher[1])


def test_weights_keep_the_holdout_and_the_floor_and_sum_to_100() -> None:
    # Three arms, one sure to be best: the holdout's 20 % is split evenly; the floor (5 %) lifts nobody here.
    # (86.67, 6.67, 6.67: the two percents left over go to the first two, in order)
    assert thompson.whole_percents(thompson.allocate([1.0, 0.0, 0.0], holdout=0.2, min_weight=0.05)) == [87, 7, 6]
    # No holdout: the floor of 10 % is taken from the best arm.
    assert thompson.whole_percents(thompson.allocate([0.98, 0.01, 0.01], holdout=0.0, min_weight=0.10)) == [80, 10, 10]
    weights = thompson.allocate(
        np.random.default_rng(3).dirichlet(np.ones(4), size=1_000), holdout=0.1, min_weight=0.08
    )
    assert np.allclose(weights.sum(axis=-1), 1)
    assert (weights >= 0.08 - 1e-9).all()
    assert all(sum(thompson.whole_percents(w)) == 100 for w in weights[:50])


def figures() -> None:
    """The figures docs/bandits.md quotes: ``python -m tests.test_bandit_simulation``."""
    z = stats.norm.ppf(0.975)
    for name, runs in (
        ("steady", simulate(drift_per_interval=0.0, seed=20261206)),
        ("drift +0.004/interval", simulate(drift_per_interval=0.004, seed=20261207)),
    ):
        covered = np.mean(np.abs(runs.stratified - TRUE_LIFT) <= z * runs.stratified_se)
        print(
            f"{name}: better arm's final weight {runs.final_share.mean():.3f} "
            f"(over 50 % in {np.mean(runs.final_share > 0.5):.1%} of runs); read-out {runs.stratified.mean():.5f} "
            f"(MC se {monte_carlo_se(runs.stratified):.5f}, 95 % CI "
            f"covers {covered:.1%}); pooled {runs.pooled.mean():.5f} (MC se {monte_carlo_se(runs.pooled):.5f})"
        )
    mean, se = inverse_variance_at_10_90()
    print(f"inverse-variance weights at a 10/90 split: {mean:.5f} (MC se {se:.5f})")


def monte_carlo_se(values: np.ndarray) -> float:
    return float(values.std(ddof=1) / np.sqrt(len(values)))


if __name__ == "__main__":
    figures()
