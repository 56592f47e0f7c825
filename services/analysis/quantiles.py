# ruff: noqa: RUF002, RUF003  (the formulas are written with their Greek letters, as in the paper cited)
"""Quantile treatment effects (p50, p90, p99 of latency and TTFT) with intervals that respect users.

A quantile of an arm is taken over its calls pooled, but the calls of one user are correlated (one user's
long prompts, one slow region), so the calls are not independent draws and the textbook order-statistic
interval is too narrow. The interval here is the **delta method for quantiles** of Deng, Knoblich & Lu
(2018, "Applying the Delta Method in Metric Analytics", KDD, section 4 "quantile metrics"; what Microsoft's ExP
runs), with the user as the unit:

- the estimate ``ξ̂_p`` is the arm's empirical ``p``-quantile of its calls;
- ``F̂(ξ̂_p) = Σ_i S_i / Σ_i N_i`` with ``N_i`` the calls of unit ``i`` and ``S_i`` those at or below ``ξ̂_p`` is a
  ratio of per-unit sums, so its variance is the delta method's ``σ_p² = Var(l)/n`` with ``l_i = (S_i - F̂ N_i)/N̄``
  over the ``n`` units (the call-level ``p(1-p)/N`` times the design effect of the clustering), floored at
  ``p(1-p)/N`` (at the sample's extremes the empirical ``Var(l)`` is 0);
- the ``1-α`` interval of ``ξ_p`` is ``[L, U] = [ξ̂_{p - z σ_p}, ξ̂_{p + z σ_p}]`` (Woodruff's outer interval: no
  density of the latency has to be estimated; none where ``p ± z σ_p`` leaves (0, 1): too few calls past the
  quantile), and the standard error of ``ξ̂_p`` is ``(U - L)/2z``, of ``log ξ̂_p`` ``(log U - log L)/2z``;
- treatment against control (independent arms): the difference ``ξ_t - ξ_c`` with ``se = sqrt(se_t² + se_c²)``;
  the ratio on the log scale, ``se(log ξ_t/ξ_c) = sqrt(se_log,t² + se_log,c²)``, its interval
  ``exp(log r ± z se)`` and the p-value of ``ratio = 1`` from ``|log r| / se``;
- the always-valid (mSPRT) confidence sequence of the log-ratio on that variance
  (:func:`splitstream.analysis.statistics.confidence_sequence_half_width`), for the rollout guard that looks
  every few seconds.

Why not the cluster bootstrap: both agree (tests/test_analysis_quantiles.py checks this against scipy's
bootstrap over users), but the delta method needs one sort and two ``bincount`` per arm and quantile, where
even a vectorised bootstrap of 2,000 resamples costs a (resamples × units) weight matrix and a weighted
quantile per resample; docs/analysis.md gives both timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import scipy

from splitstream.analysis.arrays import dense_codes
from splitstream.analysis.statistics import DEFAULT_TUNING_UNITS, confidence_sequence_half_width, mixing_variance

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: The quantiles compared, and the metrics of the calls they are taken of.
QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)
QUANTILE_NAMES: dict[str, float] = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
QUANTILE_METRICS: tuple[str, ...] = ("latency", "ttft")
METHOD = "delta method, clustered by unit (Deng, Knoblich & Lu 2018)"


def quantile_name(q: float) -> str:
    return f"p{q * 100:g}"


@dataclass(frozen=True, slots=True)
class CallValues:
    """One arm's calls: values (latency or TTFT, ms), the unit of each (``0 .. units-1``), and how many calls
    each stands for (``None``: one each; the analysis passes a unit's calls per latency bucket)."""

    values: FloatArray
    units: IntArray
    counts: FloatArray | None = None

    @staticmethod
    def of(values: npt.ArrayLike, units: npt.ArrayLike, counts: npt.ArrayLike | None = None) -> CallValues:
        """Units renumbered ``0 .. n-1`` (any labels in; a unit without a call is no unit)."""
        v = np.asarray(values, dtype=np.float64)
        weights = None if counts is None else np.asarray(counts, dtype=np.float64)
        return CallValues(v, dense_codes(np.asarray(units)), weights)

    @property
    def unit_count(self) -> int:
        return int(self.units.max()) + 1 if len(self.units) else 0

    @property
    def weights(self) -> FloatArray:
        return np.ones(len(self.values)) if self.counts is None else self.counts

    @property
    def calls(self) -> int:
        return len(self.values) if self.counts is None else int(self.counts.sum())


@dataclass(frozen=True, slots=True)
class QuantileEstimate:
    """An arm's quantile, its interval, and the standard error the comparison uses."""

    value: float
    #: NaN where ``p ∓ zσ`` falls outside (0, 1): too few calls past the quantile to bound it on that side.
    low: float
    high: float
    #: ``(high - low) / 2z``, and the same on the log scale (what the ratio uses); NaN without both ends.
    std_error: float
    log_std_error: float
    calls: int
    units: int


@dataclass(frozen=True, slots=True)
class QuantileEffect:
    """Treatment against control at one quantile."""

    control: QuantileEstimate
    treatment: QuantileEstimate
    difference: float
    difference_ci: tuple[float, float]
    ratio: float | None
    ratio_ci: tuple[float, float] | None
    p_value: float | None
    #: The variance of ``log ratio`` and the always-valid sequence of the ratio (None without a ratio).
    log_ratio_variance: float | None
    sequential_ratio_ci: tuple[float, float] | None


def _order_statistic(ordered: FloatArray, cumulative: FloatArray, p: float) -> float:
    """The empirical ``p``-quantile (inverse of the empirical CDF: the smallest value with ``F̂ ≥ p``); the
    tolerance keeps ``0.9 × 100`` (90.00000000000001 in floating point) at the 90th call."""
    total = cumulative[-1]
    index = int(np.searchsorted(cumulative, p * total - 1e-9 * total, side="left"))
    return float(ordered[min(index, len(ordered) - 1)])


def estimate(
    calls: CallValues, p: float, *, alpha: float = 0.05, clustered: bool = True, resolution: float = 1.0
) -> QuantileEstimate | None:
    """The arm's ``p``-quantile with the delta-method interval (``clustered=False``: each call its own unit, the
    naive interval, kept to show in the docs how much too narrow it is). None without calls.

    ``resolution``: the ratio between neighbouring values the calls can take (1.02 for the analysis's latency
    buckets): the interval reaches half a step past its order statistics, so that a quantile whose interval
    falls in one bucket still has the bucket's width, not a standard error of 0."""
    values, weights = calls.values, calls.weights
    n_calls = calls.calls
    if not n_calls:
        return None
    if calls.counts is None:
        ordered, cumulative = np.sort(values), np.arange(1.0, n_calls + 1)
    else:
        # Stable: the timeline passes calls already in order (:mod:`quantile_effects`), which a stable sort
        # only checks; ties in any order give the same quantiles, the weights being whole calls.
        order = np.argsort(values, kind="stable")
        ordered, cumulative = values[order], np.cumsum(weights[order])
    xi = _order_statistic(ordered, cumulative, p)
    # Independent calls: p(1-p)/N, with p itself (at the sample's extremes the empirical F̂ says 0 or 1, and a
    # variance of 0: the p99 of 30 calls would be known exactly). Users' calls are correlated, mostly positively,
    # so the clustered variance replaces it only where larger: never narrower than calls that were independent.
    sigma = math.sqrt(p * (1 - p) / n_calls)
    units = n_calls
    if clustered:
        units = calls.unit_count
        per_unit = np.bincount(calls.units, weights=weights, minlength=units)
        below = np.bincount(calls.units, weights=weights * (values <= xi), minlength=units)
        share = float(below.sum()) / n_calls  # F̂(ξ̂), p itself but for ties at ξ̂
        lin = (below - share * per_unit) / per_unit.mean()
        sigma = max(sigma, math.sqrt(float(lin.var(ddof=1)) / units)) if units > 1 else math.nan
    z = float(scipy.stats.norm.ppf(1 - alpha / 2))
    if not math.isfinite(sigma):
        return QuantileEstimate(xi, math.nan, math.nan, math.nan, math.nan, n_calls, units)
    # Past the smallest or largest call the empirical CDF says nothing: p99 of 50 calls has no upper bound.
    half_step = math.sqrt(resolution)
    low = _order_statistic(ordered, cumulative, p - z * sigma) / half_step if p - z * sigma >= 0 else math.nan
    high = _order_statistic(ordered, cumulative, p + z * sigma) * half_step if p + z * sigma <= 1 else math.nan
    std_error = (high - low) / (2 * z)
    log_std_error = math.log(high / low) / (2 * z) if low > 0 else math.nan
    return QuantileEstimate(xi, low, high, std_error, log_std_error, n_calls, units)


def compare(
    control: CallValues,
    treatment: CallValues,
    p: float,
    *,
    alpha: float = 0.05,
    clustered: bool = True,
    tuning_units: int = DEFAULT_TUNING_UNITS,
    resolution: float = 1.0,
) -> QuantileEffect | None:
    """Treatment against control at the ``p``-quantile; None when an arm has no call. The ratio's variance is
    taken on the log scale (the interval of ``log ξ`` is the log of the interval of ``ξ``: quantiles commute
    with monotone maps), where a latency's long right tail makes the interval of ``ξ`` itself lopsided."""
    c = estimate(control, p, alpha=alpha, clustered=clustered, resolution=resolution)
    t = estimate(treatment, p, alpha=alpha, clustered=clustered, resolution=resolution)
    if c is None or t is None:
        return None
    z = float(scipy.stats.norm.ppf(1 - alpha / 2))
    difference = t.value - c.value
    se = math.sqrt(t.std_error**2 + c.std_error**2)
    difference_ci = (difference - z * se, difference + z * se)
    if not (c.value > 0 and t.value > 0):
        return QuantileEffect(c, t, difference, difference_ci, None, None, None, None, None)
    log_ratio = math.log(t.value / c.value)
    variance = t.log_std_error**2 + c.log_std_error**2
    if not math.isfinite(variance):
        return QuantileEffect(c, t, difference, difference_ci, t.value / c.value, None, None, None, None)
    se_log = math.sqrt(variance)
    ratio_ci = (math.exp(log_ratio - z * se_log), math.exp(log_ratio + z * se_log))
    if se_log > 0:
        p_value = float(min(1.0, 2 * scipy.stats.norm.sf(abs(log_ratio) / se_log)))
    else:
        p_value = 1.0 if log_ratio == 0 else 0.0
    tau2 = float(mixing_variance(variance, c.units + t.units, alpha=alpha, tuning_units=tuning_units))
    half = confidence_sequence_half_width(variance, tau2, alpha=alpha)
    sequential = (math.exp(log_ratio - half), math.exp(log_ratio + half)) if math.isfinite(half) else None
    return QuantileEffect(c, t, difference, difference_ci, math.exp(log_ratio), ratio_ci, p_value, variance, sequential)
