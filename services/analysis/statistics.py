# ruff: noqa: RUF002  (the formulas are written with their Greek letters, as in the papers cited)
"""The statistics of an A/B comparison, as pure functions on per-unit numpy arrays.

Everything here works on one array per arm with one row per unit of analysis (a user, or a call),
so the same code serves the CLI, the rollout guard that calls :func:`compare` every minute, and
the simulations in the tests. Distributions and reference tests come from scipy; the formulas
that scipy has no function for are named with their source:

- Ratio metrics (events per exposure, value per event) use the **delta method** for the variance
  of a ratio of means over units (Deng, Knoblich & Lu 2018, "Applying the Delta Method in Metric
  Analytics", KDD; Kohavi, Tang & Xu 2020, ch. 18): ``Var(Ȳ/X̄) ≈ Var(l)/n`` with the linearised
  per-unit value ``l_i = (y_i - R x_i) / X̄``.
- **CUPED** (Deng, Xu, Kohavi & Walker 2013, WSDM): ``Y - θ (X_pre - mean X_pre)`` with
  ``θ = Cov(Y, X_pre) / Var(X_pre)`` pooled over the arms, applied to the linearised values so it
  serves ratio metrics too.
- **Always-valid inference**: the mixture sequential probability ratio test with a normal mixing
  distribution (Johari, Koomen, Pekelis & Walsh 2017/2022, "Always Valid Inference", Operations
  Research; the form Optimizely's Stats Engine uses). For an estimated difference ``Δ̂`` with
  variance ``V`` and mixing variance ``τ²``, ``Λ = sqrt(V/(V+τ²)) · exp(τ² Δ̂² / (2V(V+τ²)))``, the
  always-valid p-value is ``min(1, 1/Λ)`` (and its running minimum over looks), and the confidence
  sequence is ``Δ̂ ± sqrt(V(V+τ²)/τ² · (2 log(1/α) + log((V+τ²)/V)))``. With ``V = σ²/n`` this is
  the asymptotic confidence sequence of Waudby-Smith et al. (2023, "Time-uniform central limit
  theory and asymptotic confidence sequences", Annals of Statistics) in the form GrowthBook's gbstats
  computes it: ``τ² = ρ² V N`` with ``N`` the units in both arms and ``ρ`` tuned so the sequence is
  narrowest at ``N*`` units in total. The relative lift gets the same sequence on its delta-method
  variance.
- Power at the arms' actual sizes, by the normal approximation: the standard error of the difference
  is ``sqrt(σ_c²/n_c + σ_t²/n_t)``; the minimum detectable effect is ``(z_{1-α/2} + z_{power})`` times
  it, and the units needed in total at the current shares ``w`` are
  ``(z_{1-α/2} + z_{power})² (σ_c²/w_c + σ_t²/w_t) / Δ²``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np
import numpy.typing as npt
import scipy

from splitstream.analysis.defaults import DEFAULT_TUNING_UNITS as DEFAULT_TUNING_UNITS

FloatArray = npt.NDArray[np.float64]


def p_text(p: float | None) -> str:
    """A p-value as a table cell shows it: ``0.002``, ``< 0.001`` (below that the digits are noise), ``-``."""
    if p is None or math.isnan(p):
        return "-"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def p_clause(p: float | None) -> str:
    """A p-value in a sentence: ``p = 0.002``, or ``p < 0.001`` (not ``p = < 0.001``)."""
    text = p_text(p)
    return f"p {text}" if text.startswith("<") else f"p = {text}"


class MetricKind(StrEnum):
    """What a metric measures per unit; docs/analysis.md defines each precisely.

    ``proportion``, the name ``rate`` had before, is still read as ``rate``: GrowthBook and most readers take a
    proportion to be per user, which is ``conversion`` here."""

    #: Units with at least one event of value > 0, per unit (0 or 1 each): Welch's t-test on the 0/1 values.
    CONVERSION = "conversion"
    #: Calls with an event of value > 0 per exposure call: a ratio over units (delta method); per call, the
    #: two-proportion test.
    RATE = "rate"
    #: Mean value per event: a ratio over units (delta method).
    MEAN = "mean"
    #: Total value per unit, units without events counting 0: Welch's t-test.
    SUM = "sum"

    @classmethod
    def _missing_(cls, value: object) -> MetricKind | None:
        if isinstance(value, str):
            lowered = value.lower()
            if lowered == "proportion":
                return cls.RATE
            if lowered != value:
                return cls(lowered)
        return None

    @property
    def counts_positive_calls(self) -> bool:
        """Whether the metric is measured on the calls with a positive event (each counted once), not on values."""
        return self in (MetricKind.CONVERSION, MetricKind.RATE)


#: The kinds a metric may be given as: the kinds, and ``proportion`` (read as ``rate``).
KIND_NAMES = (*(kind.value for kind in MetricKind), "proportion")


@dataclass(frozen=True, slots=True)
class UnitValues:
    """One arm's per-unit numerator ``y`` and denominator ``x`` (``x`` is all ones for a per-unit mean).

    The metric's value for the arm is ``sum(y) / sum(x)``."""

    y: FloatArray
    x: FloatArray

    @property
    def units(self) -> int:
        return len(self.y)

    @staticmethod
    def of_means(y: npt.ArrayLike) -> UnitValues:
        values = np.asarray(y, dtype=np.float64)
        return UnitValues(values, np.ones_like(values))


@dataclass(frozen=True, slots=True)
class Estimate:
    """An arm's metric value, the variance of that value, and the units behind it."""

    value: float
    variance: float
    units: int

    @property
    def std_error(self) -> float:
        return math.sqrt(self.variance) if self.variance > 0 else 0.0

    def interval(self, alpha: float) -> tuple[float, float]:
        half = scipy.stats.norm.ppf(1 - alpha / 2) * self.std_error
        return self.value - half, self.value + half

    @property
    def unit_variance(self) -> float:
        """The per-unit variance ``σ²`` (``variance × units``), what power and sequential tuning need."""
        return self.variance * self.units


@dataclass(frozen=True, slots=True)
class Comparison:
    """Treatment against control for one metric: lifts with intervals and p-values."""

    control: Estimate
    treatment: Estimate
    absolute: float
    absolute_ci: tuple[float, float]
    relative: float | None
    relative_ci: tuple[float, float] | None
    p_value: float
    #: Welch's t-test, two-proportion z-test, or a z-test on delta-method variances.
    test: str
    #: Always-valid p-value and confidence sequence on the absolute difference (mSPRT), when asked for, and
    #: the confidence sequence of the relative lift (on its delta-method variance).
    sequential_p_value: float | None = None
    sequential_ci: tuple[float, float] | None = None
    sequential_relative_ci: tuple[float, float] | None = None


# -- per-arm estimates ---------------------------------------------------------------------


def linearized(values: UnitValues) -> tuple[float, FloatArray]:
    """The ratio ``R = Σy/Σx`` and the per-unit linearisation ``l_i = (y_i - R x_i) / x̄`` (delta method):
    ``Var(R) ≈ Var(l) / n``. For a per-unit mean (``x`` all ones) ``l`` is ``y`` minus its mean."""
    total_x = float(values.x.sum())
    if values.units == 0 or total_x == 0:
        return math.nan, np.zeros(values.units)
    ratio = float(values.y.sum()) / total_x
    mean_x = total_x / values.units
    return ratio, (values.y - ratio * values.x) / mean_x


def estimate(values: UnitValues) -> Estimate:
    """The arm's ``Σy/Σx`` with its delta-method variance (the plain ``s²/n`` when ``x`` is all ones)."""
    ratio, lin = linearized(values)
    n = values.units
    variance = float(lin.var(ddof=1)) / n if n > 1 else math.nan
    return Estimate(ratio, variance, n)


def cuped_estimates(
    control: UnitValues, treatment: UnitValues, control_pre: UnitValues, treatment_pre: UnitValues
) -> tuple[Estimate, Estimate, float]:
    """Both arms' estimates adjusted by CUPED with a pre-period covariate per unit (the same rows, in the
    same order, as the in-period values). Returns the two estimates and ``θ``.

    ``θ = Cov(l, l_pre) / Var(l_pre)`` over both arms pooled (Deng et al. 2013), on the delta-method
    linearisations so ratio metrics are adjusted the same way as sums; the adjusted value is
    ``R - θ (l̄_pre,arm - l̄_pre,all)`` and its variance ``Var(l - θ l_pre) / n``."""
    lin = [linearized(v) for v in (control, treatment)]
    pre_lin: list[FloatArray] = []
    for values in (control_pre, treatment_pre):
        # Pre-period values linearised around the pooled pre-period ratio, so arms share one centre.
        pre_lin.append(values.y - values.x * _pooled_ratio(control_pre, treatment_pre))
    all_l = np.concatenate([lin[0][1], lin[1][1]])
    all_pre = np.concatenate(pre_lin)
    pre_var = float(all_pre.var(ddof=1)) if len(all_pre) > 1 else 0.0
    theta = float(np.cov(all_l, all_pre, ddof=1)[0, 1]) / pre_var if pre_var > 0 else 0.0
    pre_mean = float(all_pre.mean()) if len(all_pre) else 0.0
    estimates = []
    for (ratio, l_arm), pre_arm in zip(lin, pre_lin, strict=True):
        n = len(l_arm)
        # θ is a regression slope of l on the covariate, so θ·covariate is on l's (the ratio's) scale already.
        adjusted = l_arm - theta * (pre_arm - pre_mean)
        shift = float(adjusted.mean()) if n else 0.0
        variance = float(adjusted.var(ddof=1)) / n if n > 1 else math.nan
        estimates.append(Estimate(ratio + shift, variance, n))
    return estimates[0], estimates[1], theta


def _pooled_ratio(a: UnitValues, b: UnitValues) -> float:
    total_x = float(a.x.sum() + b.x.sum())
    return float(a.y.sum() + b.y.sum()) / total_x if total_x else 0.0


# -- comparisons ---------------------------------------------------------------------------


def compare(
    control: Estimate,
    treatment: Estimate,
    *,
    alpha: float = 0.05,
    test: str = "welch",
    sequential: bool = False,
    tuning_units: int = DEFAULT_TUNING_UNITS,
) -> Comparison:
    """Treatment minus control. ``test``: ``welch`` (Welch's t-test with Welch–Satterthwaite degrees of
    freedom, for per-unit means) or ``z`` (normal, for delta-method ratios). Relative lift is
    ``treatment/control - 1`` with a delta-method interval (None when the control's value is 0).
    ``tuning_units``: the units in both arms at which the confidence sequence is narrowest."""
    diff = treatment.value - control.value
    var = treatment.variance + control.variance
    se = math.sqrt(var) if var > 0 else 0.0
    if test == "welch":
        df = welch_df(control, treatment)
        critical = (
            float(scipy.stats.t.ppf(1 - alpha / 2, df))
            if math.isfinite(df)
            else float(scipy.stats.norm.ppf(1 - alpha / 2))
        )
        p = _two_sided_p(diff, se, df)
    else:
        critical = float(scipy.stats.norm.ppf(1 - alpha / 2))
        p = _two_sided_p(diff, se, math.inf)
    absolute_ci = (diff - critical * se, diff + critical * se)
    relative, relative_ci = relative_lift(control, treatment, critical)
    result = Comparison(control, treatment, diff, absolute_ci, relative, relative_ci, p, test)
    return with_sequential(result, alpha=alpha, tuning_units=tuning_units) if sequential else result


def with_sequential(result: Comparison, *, alpha: float, tuning_units: int = DEFAULT_TUNING_UNITS) -> Comparison:
    """``result`` with the mSPRT p-value and the confidence sequences of its absolute and relative lifts, on the
    unpooled variance of the difference (so a two-proportion comparison gets them too)."""
    control, treatment = result.control, result.treatment
    variance = control.variance + treatment.variance
    total = control.units + treatment.units
    tau2 = float(mixing_variance(variance, total, alpha=alpha, tuning_units=tuning_units))
    half = confidence_sequence_half_width(variance, tau2, alpha=alpha)
    relative_ci: tuple[float, float] | None = None
    rel_variance = relative_variance(control, treatment)
    if result.relative is not None and rel_variance is not None:
        relative_tau2 = float(mixing_variance(rel_variance, total, alpha=alpha, tuning_units=tuning_units))
        relative_half = confidence_sequence_half_width(rel_variance, relative_tau2, alpha=alpha)
        relative_ci = (result.relative - relative_half, result.relative + relative_half)
    return replace(
        result,
        sequential_p_value=msprt_p_value(result.absolute, variance, tau2),
        sequential_ci=(result.absolute - half, result.absolute + half),
        sequential_relative_ci=relative_ci,
    )


def welch_df(control: Estimate, treatment: Estimate) -> float:
    """Welch–Satterthwaite degrees of freedom from the two variances of the means."""
    vc, vt = control.variance, treatment.variance
    denominator = 0.0
    if control.units > 1:
        denominator += vc**2 / (control.units - 1)
    if treatment.units > 1:
        denominator += vt**2 / (treatment.units - 1)
    return (vc + vt) ** 2 / denominator if denominator > 0 else math.inf


def _two_sided_p(diff: float, se: float, df: float) -> float:
    if not se > 0 or not math.isfinite(diff):
        return 1.0 if diff == 0 or not math.isfinite(diff) else 0.0
    statistic = abs(diff) / se
    tail = scipy.stats.t.sf(statistic, df) if math.isfinite(df) else scipy.stats.norm.sf(statistic)
    return float(min(1.0, 2 * tail))


def relative_lift(
    control: Estimate, treatment: Estimate, critical: float
) -> tuple[float | None, tuple[float, float] | None]:
    """``μt/μc - 1`` and its interval, ``Var ≈ Var_t/μc² + μt² Var_c/μc⁴`` (delta method, independent arms)."""
    var = relative_variance(control, treatment)
    if var is None:
        return None, None
    lift = treatment.value / control.value - 1
    half = critical * math.sqrt(var) if var > 0 else 0.0
    return lift, (lift - half, lift + half)


def relative_variance(control: Estimate, treatment: Estimate) -> float | None:
    """``Var(μt/μc) ≈ Var_t/μc² + μt² Var_c/μc⁴`` (delta method, independent arms); None when μc is 0, or where
    the values are so large that the variance is not a finite float (products, not ``**``, which raises)."""
    mc, mt = control.value, treatment.value
    if not mc or not math.isfinite(mc) or not math.isfinite(mt):
        return None
    mc2 = mc * mc
    variance = treatment.variance / mc2 + (mt * mt / mc2) * (control.variance / mc2)
    return variance if math.isfinite(variance) else None


def two_proportions(
    control_successes: int, control_trials: int, treatment_successes: int, treatment_trials: int, *, alpha: float = 0.05
) -> Comparison:
    """The two-proportion z-test (pooled variance for the p-value, as statsmodels' ``proportions_ztest``)
    with an unpooled Wald interval for the difference: the test for a binary outcome per call."""
    control = _proportion(control_successes, control_trials)
    treatment = _proportion(treatment_successes, treatment_trials)
    pooled = (control_successes + treatment_successes) / max(control_trials + treatment_trials, 1)
    se_pooled = math.sqrt(pooled * (1 - pooled) * (1 / max(control_trials, 1) + 1 / max(treatment_trials, 1)))
    diff = treatment.value - control.value
    p = _two_sided_p(diff, se_pooled, math.inf)
    critical = float(scipy.stats.norm.ppf(1 - alpha / 2))
    se = math.sqrt(control.variance + treatment.variance)
    relative, relative_ci = relative_lift(control, treatment, critical)
    return Comparison(
        control,
        treatment,
        diff,
        (diff - critical * se, diff + critical * se),
        relative,
        relative_ci,
        p,
        "two-proportion z",
    )


def _proportion(successes: int, trials: int) -> Estimate:
    rate = successes / trials if trials else math.nan
    variance = rate * (1 - rate) / trials if trials else math.nan
    return Estimate(rate, variance, trials)


# -- always-valid inference ------------------------------------------------------------------


def mixing_variance(
    variance: float | FloatArray,
    total_units: float | FloatArray,
    *,
    alpha: float,
    tuning_units: int = DEFAULT_TUNING_UNITS,
) -> float | FloatArray:
    """``τ² = ρ² V N`` with ``ρ² = (-2 log α + log(-2 log α + 1)) / N*`` (Waudby-Smith et al. 2023, the ρ that
    makes the sequence tightest at ``N*`` units), as GrowthBook's gbstats computes it: ``V`` is the variance of
    the estimated difference and ``N`` the units in both arms, so ``V N`` is the difference's variance per unit
    whatever the split, and ``N*`` counts units in total."""
    two_log = -2 * math.log(alpha)
    rho2 = (two_log + math.log(two_log + 1)) / max(tuning_units, 1)
    return rho2 * variance * total_units


def msprt_p_value(diff: float | FloatArray, variance: float | FloatArray, tau2: float | FloatArray) -> float:
    """The mSPRT p-value at one look, ``min(1, 1/Λ)`` (Johari et al. 2017, normal mixture). An always-valid p-value
    sequence is the running minimum of this over looks (:func:`running_msprt_p_values`)."""
    value = np.asarray(msprt_p_values(np.asarray(diff), np.asarray(variance), np.asarray(tau2)))
    return float(value)


def msprt_p_values(diff: FloatArray, variance: FloatArray, tau2: FloatArray | float) -> FloatArray:
    """Vectorised :func:`msprt_p_value` (log space, so huge Λ never overflows)."""
    v = np.asarray(variance, dtype=np.float64)
    t = np.broadcast_to(np.asarray(tau2, dtype=np.float64), v.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_lambda = 0.5 * np.log(v / (v + t)) + t * np.asarray(diff) ** 2 / (2 * v * (v + t))
    p = np.exp(-np.where(np.isfinite(log_lambda), log_lambda, 0.0))
    return np.asarray(np.minimum(1.0, p), dtype=np.float64)


def running_msprt_p_values(diffs: FloatArray, variances: FloatArray, tau2: FloatArray | float) -> FloatArray:
    """Always-valid p-values over a sequence of looks (last axis): the running minimum of :func:`msprt_p_values`."""
    return np.asarray(np.minimum.accumulate(msprt_p_values(diffs, variances, tau2), axis=-1), dtype=np.float64)


def confidence_sequence_half_width(variance: float, tau2: float, *, alpha: float) -> float:
    """Half-width of the mixture confidence sequence: ``sqrt(V(V+τ²)/τ² · (2 log(1/α) + log((V+τ²)/V)))``."""
    if not variance > 0 or not tau2 > 0:
        return math.inf if not variance > 0 else 0.0
    return math.sqrt(
        variance * (variance + tau2) / tau2 * (2 * math.log(1 / alpha) + math.log((variance + tau2) / variance))
    )


# -- multiple comparisons --------------------------------------------------------------------


def adjusted_p_values(p_values: npt.ArrayLike, method: str) -> FloatArray:
    """p-values adjusted for testing them all: ``holm`` (Holm 1979, step-down Bonferroni: controls the chance of
    any false positive) or ``bh`` (Benjamini–Hochberg 1995, scipy's ``false_discovery_control``: controls the
    expected share of false positives among those declared). Holm is written out: scipy has no function for it,
    and the step-down is three array operations (statsmodels' ``multipletests`` checks it in the tests)."""
    p = np.asarray(p_values, dtype=np.float64)
    if not len(p):
        return p
    if method == "bh":
        return np.asarray(scipy.stats.false_discovery_control(p, method="bh"), dtype=np.float64)
    if method != "holm":
        raise ValueError(f"unknown correction {method!r} (holm or bh)")
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order])
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(stepped, 1.0)
    return adjusted


def corrected_alpha(adjusted: FloatArray, method: str, alpha: float) -> float:
    """The level for intervals that match the adjusted p-values: Bonferroni's ``α/m`` for Holm (simultaneous
    coverage), and for BH the false-coverage-rate level ``α R/m`` of Benjamini & Yekutieli (2005), ``R`` the
    hypotheses BH rejects (``α/m`` when it rejects none)."""
    m = len(adjusted)
    if not m:
        return alpha
    if method == "bh":
        return alpha * max(int((adjusted < alpha).sum()), 1) / m
    return alpha / m


# -- sample ratio mismatch and power ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SampleRatio:
    observed: dict[str, int]
    expected: dict[str, float]
    chi2: float
    p_value: float
    flagged: bool


def sample_ratio_mismatch(
    observed: dict[str, int], weights: dict[str, float], *, threshold: float = 0.001
) -> SampleRatio | None:
    """Pearson's chi-square of the units per arm against the configured weights (scipy's ``chisquare``),
    arms at weight 0 left out; flagged below ``threshold`` (0.001, the usual SRM bar: a real mismatch gives
    p-values far smaller, and a looser bar raises false alarms on every minute's check). None when fewer than
    two arms carry weight or no unit was seen."""
    arms = [arm for arm, weight in weights.items() if weight > 0]
    counts = np.array([observed.get(arm, 0) for arm in arms], dtype=np.float64)
    total = counts.sum()
    if len(arms) < 2 or total == 0:
        return None
    shares = np.array([weights[arm] for arm in arms]) / sum(weights[arm] for arm in arms)
    expected = shares * total
    result = scipy.stats.chisquare(counts, expected)
    p = float(result.pvalue)
    return SampleRatio(
        {arm: int(c) for arm, c in zip(arms, counts, strict=True)},
        {arm: float(e) for arm, e in zip(arms, expected, strict=True)},
        float(result.statistic),
        p,
        p < threshold,
    )


def power(
    effect: float,
    unit_variance_control: float,
    unit_variance_treatment: float,
    units_control: float,
    units_treatment: float,
    *,
    alpha: float,
) -> float:
    """The probability a two-sided test at ``alpha`` detects ``effect`` with the arms' sizes as given (normal)."""
    se = math.sqrt(unit_variance_control / units_control + unit_variance_treatment / units_treatment)
    if not se > 0:
        return 1.0
    z = scipy.stats.norm.ppf(1 - alpha / 2)
    shift = abs(effect) / se
    return float(scipy.stats.norm.sf(z - shift) + scipy.stats.norm.cdf(-z - shift))


def minimum_detectable_effect(
    unit_variance_control: float,
    unit_variance_treatment: float,
    units_control: float,
    units_treatment: float,
    *,
    alpha: float,
    power: float = 0.8,
) -> float:
    """The smallest absolute effect a two-sided test at ``alpha`` detects with ``power`` at these arm sizes:
    what the data can show, where power at the observed effect would only restate the p-value."""
    se = math.sqrt(unit_variance_control / units_control + unit_variance_treatment / units_treatment)
    return float((scipy.stats.norm.ppf(1 - alpha / 2) + scipy.stats.norm.ppf(power)) * se)


def units_needed(
    effect: float,
    unit_variance_control: float,
    unit_variance_treatment: float,
    *,
    control_share: float,
    alpha: float,
    power: float = 0.8,
) -> float | None:
    """Units in both arms together for a two-sided test at ``alpha`` to detect ``effect`` with ``power`` when a
    ``control_share`` of them go to control (the split as it runs); None for no effect or a one-arm split."""
    if not effect or not math.isfinite(effect) or not 0 < control_share < 1:
        return None
    z = scipy.stats.norm.ppf(1 - alpha / 2) + scipy.stats.norm.ppf(power)
    spread = unit_variance_control / control_share + unit_variance_treatment / (1 - control_share)
    return float(z**2 * spread / effect**2)
