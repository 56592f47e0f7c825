"""Thompson sampling on experiment arms: posteriors, the probability each arm is best, and the weights it gives.

Pure numpy on arrays whose last axis is the arms, so one call serves the bandit's loop (one experiment) and
the tests' simulations (thousands of runs at once, a leading axis each).

- A ``conversion`` metric is a 0/1 value per unit: each arm's rate gets the conjugate Beta(1 + successes,
  1 + failures) posterior (a uniform prior).
- Other kinds (``rate``, ``mean``, ``sum``) are ratios or means over units whose value the analysis gives
  with its delta-method variance: the posterior is the normal approximation N(value, variance), which is
  what a flat prior gives once the central limit theorem holds.

An arm's weight is its probability of being best (largest, or smallest when lower is better), estimated by
drawing from every posterior ``draws`` times, after a fixed holdout split evenly over the arms so that every
phase compares every arm with the control, and a floor so no arm starves.

The unbiased read-out (:func:`stratified`) averages the per-phase lifts, each phase weighed by its units: each
phase ran at fixed weights, so its lift is a clean randomized comparison, whatever earlier phases did to the
weights. Pooling every unit of an arm over phases is not: the bandit's allocation follows its noise (an arm
that looked bad by chance is sampled less, so its low estimate is corrected less), and a drift in the base rate
over time meets a share that moves with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from splitstream.admin.constants import DEFAULT_DRAWS as DEFAULT_DRAWS

FloatArray = npt.NDArray[np.float64]


def beta_draws(
    successes: npt.ArrayLike, units: npt.ArrayLike, draws: int, rng: np.random.Generator
) -> tuple[FloatArray, FloatArray]:
    """Posterior means and ``draws`` samples (shape ``(..., draws, arms)``) of Beta(1 + s, 1 + n - s)."""
    s = np.asarray(successes, dtype=np.float64)
    n = np.asarray(units, dtype=np.float64)
    a, b = 1.0 + s, 1.0 + np.maximum(n - s, 0.0)
    samples = rng.beta(a[..., None, :], b[..., None, :], size=(*a.shape[:-1], draws, a.shape[-1]))
    return a / (a + b), samples


def normal_draws(
    means: npt.ArrayLike, variances: npt.ArrayLike, draws: int, rng: np.random.Generator
) -> tuple[FloatArray, FloatArray]:
    """Posterior means and ``draws`` samples (shape ``(..., draws, arms)``) of N(mean, variance)."""
    m = np.asarray(means, dtype=np.float64)
    sd = np.sqrt(np.maximum(np.asarray(variances, dtype=np.float64), 0.0))
    noise = rng.standard_normal((*m.shape[:-1], draws, m.shape[-1]))
    return m, m[..., None, :] + sd[..., None, :] * noise


def p_best(samples: FloatArray, *, higher_is_better: bool = True) -> FloatArray:
    """The share of draws in which each arm is best: shape ``(..., arms)`` from ``(..., draws, arms)``."""
    arms = samples.shape[-1]
    best = np.argmax(samples if higher_is_better else -samples, axis=-1)
    counts = (best[..., None] == np.arange(arms)).sum(axis=-2)
    return counts / samples.shape[-2]


def allocate(probabilities: npt.ArrayLike, *, holdout: float, min_weight: float) -> FloatArray:
    """Weights (fractions summing to 1 on the last axis): ``holdout / arms + (1 - holdout) * P(best)``, then
    raised to ``min_weight`` where below it, the arms above the floor giving up the difference in proportion."""
    p = np.asarray(probabilities, dtype=np.float64)
    arms = p.shape[-1]
    weights = holdout / arms + (1.0 - holdout) * p
    fixed = np.zeros(weights.shape, dtype=bool)
    for _ in range(arms):  # each round fixes at least one more arm at the floor, or ends
        low = fixed | (weights < min_weight - 1e-12)
        if (low == fixed).all():
            break
        fixed = low
        floor_mass = min_weight * fixed.sum(axis=-1, keepdims=True)
        free = np.where(fixed, 0.0, weights)
        free_mass = free.sum(axis=-1, keepdims=True)
        scale = np.divide(1.0 - floor_mass, free_mass, out=np.zeros_like(free_mass), where=free_mass > 0)
        weights = np.where(fixed, min_weight, free * scale)
    return weights


def whole_percents(weights: npt.ArrayLike) -> list[int]:
    """Fractions to whole percents summing to 100 (largest remainder), so a weight that barely moved is the
    same experiment phase rather than a new one holding a handful of units. A fraction at a whole-percent
    floor stays at least there (its floor is whole, so rounding down cannot cross it)."""
    exact = np.asarray(weights, dtype=np.float64) * 100
    down = np.floor(exact + 1e-9).astype(int)
    short = 100 - int(down.sum())
    order = np.argsort(-(exact - down), kind="stable")
    for index in order[:short]:
        down[index] += 1
    return [int(w) for w in down]


@dataclass(frozen=True)
class Pooled:
    """A lift combined over phases: estimate and standard error (None: no phase could be used)."""

    estimate: float | None
    std_error: float | None
    phases: int

    def interval(self, z: float) -> tuple[float, float] | None:
        if self.estimate is None or self.std_error is None:
            return None
        return self.estimate - z * self.std_error, self.estimate + z * self.std_error


def stratified(lifts: npt.ArrayLike, variances: npt.ArrayLike, units: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
    """Per-phase lifts (last axis: phases) averaged with each phase's share of the units, ``Σ (n_t/n) d_t``, with
    variance ``Σ (n_t/n)² v_t``. Phases whose lift or variance is not finite (an arm without units) are left out.

    A phase's units (all arms together) are the traffic that arrived, which no outcome moves, so the weights are
    independent of the lifts they weigh and the average is unbiased for the lift over the run's units. Inverse-
    variance weights are not: a binomial variance estimate is smallest where the rate came out low by chance, so
    an arm starved to a few units per phase gets its unlucky phases weighed most (in the simulation of
    ``tests/test_bandit_simulation.py``, a bias of +0.006 on a lift of 0.03)."""
    d = np.asarray(lifts, dtype=np.float64)
    v = np.asarray(variances, dtype=np.float64)
    n = np.asarray(units, dtype=np.float64)
    usable = np.isfinite(d) & np.isfinite(v) & (n > 0)
    w = np.where(usable, n, 0.0)
    total = w.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, w / total, np.nan)
        estimate = (share * np.where(usable, d, 0.0)).sum(axis=-1)
        variance = (share**2 * np.where(usable, v, 0.0)).sum(axis=-1)
    return estimate, variance


def combine(lifts: list[float], variances: list[float], units: list[int]) -> Pooled:
    """:func:`stratified` for one experiment, as the bandit's read-out prints it."""
    if not lifts:
        return Pooled(None, None, 0)
    estimate, variance = stratified(lifts, variances, units)
    if not math.isfinite(float(estimate)):
        return Pooled(None, None, 0)
    used = sum(
        1 for d, v, n in zip(lifts, variances, units, strict=True) if math.isfinite(d) and math.isfinite(v) and n
    )
    return Pooled(float(estimate), math.sqrt(float(variance)), used)
