# ruff: noqa: RUF002  (the formulas are written with their Greek letters)
"""Non-inferiority: is the new arm no worse than the control by more than a margin (``--non-inferiority 1%``)?

A migration to a cheaper model, a refactor, a new runtime: the aim is not a win but the assurance that nothing
got worse by more than an amount one can live with. "Inconclusive" against zero says nothing of that; the test
against the margin does. For a metric where higher is better and a margin ``m`` (relative to the control's value
with ``%``, else absolute in the metric's unit), the hypotheses are ``H0: Δ ≤ -m`` against ``H1: Δ > -m``, one
sided at α; for a lower-is-better metric the margin is above: ``H0: Δ ≥ m``.

- Fixed horizon: ``t = (Δ̂ + m) / se`` (``(m - Δ̂) / se`` for lower), the p-value from Welch's t (Welch's
  degrees of freedom) for the per-unit means and from the normal for the delta-method ratios; the bound is the
  one-sided ``1 - α`` bound ``Δ̂ - t₁₋α · se`` (``+`` for lower). For a relative margin, ``Δ̂`` is the relative
  lift and ``se`` its delta-method standard error, normal. Non-inferior when the bound clears the margin (the
  p-value is then below α), inferior when even the bound on the other side (``Δ̂ + t₁₋α · se``) is past it.
- ``--sequential``: the bad-side edge of the two-sided always-valid confidence sequence at α (the mixture
  sequence of :func:`splitstream.analysis.statistics.confidence_sequence_half_width`), and the mSPRT p-value
  of ``Δ̂ + m`` (1 when ``Δ̂`` is past the margin): one side of a two-sided sequence errs at most α, so the
  test is valid at α at every look (conservative: about α/2). The rollout guards judge exactly this.
- No variance (every unit of both arms has the same value: a cap below all of them, say): "not shown
  non-inferior", with that reason. A standard error of 0 is no certainty but no information; the test is left
  out of a correction's family.
- ``--correction``: the non-inferiority p-values of every comparison adjusted as one family, by the same method
  as the two-sided ones, and the bounds taken at the matching level (α/m for Holm, α·R/m for BH).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import scipy

from splitstream.analysis import statistics as st
from splitstream.analysis.model import Analysis, MetricComparison, NonInferiority

_MARGIN = re.compile(r"^\s*-?(\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?\s*(%?)\s*$")
MARGIN_SYNTAX = "a relative margin with % (1%) or an absolute one in the metric's unit (0.002)"


@dataclass(frozen=True, slots=True)
class Margin:
    """How much worse than the control is still acceptable: ``size`` (a fraction when ``relative``)."""

    size: float
    relative: bool

    @staticmethod
    def parse(text: str) -> Margin:
        """``1%`` or ``0.002`` (a leading minus is taken as the same margin: it lies on the bad side whatever the
        sign); ValueError saying what is wrong."""
        match = _MARGIN.match(text)
        if match is None:
            raise ValueError(f"bad margin {text!r} (expected {MARGIN_SYNTAX})")
        relative = match.group(2) == "%"
        size = abs(float(text.strip().rstrip("%").strip()))
        if not math.isfinite(size) or size <= 0:
            raise ValueError(f"bad margin {text!r}: it must be above 0 and finite ({MARGIN_SYNTAX})")
        return Margin(size / 100 if relative else size, relative)

    def text(self, higher_is_better: bool) -> str:
        sign = "-" if higher_is_better else "+"
        return f"{sign}{self.size * 100:.4g} %" if self.relative else f"{sign}{self.size:.4g}"


@dataclass(frozen=True, slots=True)
class MarginTest:
    """The one-sided test of a comparison against its margin; ``margin`` is signed, on the lift's scale."""

    margin: float
    p_value: float
    #: The one-sided bound on the metric's bad side (lower for higher-is-better) and the one on the other side.
    bound: float
    far_bound: float
    #: Neither arm's values vary (a cap below every unit's value makes each arm one number): the test has no
    #: evidence either way, and its se of 0 would otherwise read as certainty (p = 0, "non-inferior").
    no_variance: bool = False


def margin_test(
    result: st.Comparison,
    margin: Margin,
    *,
    higher_is_better: bool,
    alpha: float,
    sequential: bool,
    tuning_units: int = st.DEFAULT_TUNING_UNITS,
) -> MarginTest | None:
    """None when the lift cannot be measured (no variance, a control at 0 for a relative margin)."""
    control, treatment = result.control, result.treatment
    if margin.relative:
        variance = st.relative_variance(control, treatment)
        estimate = result.relative
        df = math.inf
    else:
        variance = control.variance + treatment.variance
        estimate = result.absolute
        df = st.welch_df(control, treatment) if result.test == "welch" else math.inf
    if estimate is None or variance is None or not math.isfinite(variance) or not math.isfinite(estimate):
        return None
    m = -margin.size if higher_is_better else margin.size
    if variance <= 0:
        return MarginTest(m, math.nan, estimate, estimate, no_variance=True)
    sign = 1.0 if higher_is_better else -1.0  # the good side
    distance = sign * (estimate - m)  # how far inside the acceptable side the estimate lies
    if sequential:
        tau2 = float(
            st.mixing_variance(variance, control.units + treatment.units, alpha=alpha, tuning_units=tuning_units)
        )
        half = st.confidence_sequence_half_width(variance, tau2, alpha=alpha)
        p = st.msprt_p_value(distance, variance, tau2) if distance > 0 else 1.0
    else:
        se = math.sqrt(variance)
        dist = scipy.stats.t if math.isfinite(df) else scipy.stats.norm
        args = (df,) if math.isfinite(df) else ()
        half = float(dist.ppf(1 - alpha, *args)) * se
        p = float(dist.sf(distance / se, *args))
    return MarginTest(m, float(p), estimate - sign * half, estimate + sign * half)


def annotated(analysis: Analysis, margin: Margin, *, alpha: float, sequential: bool, tuning_units: int) -> Analysis:
    """Every comparison with its non-inferiority test and the clause added to its verdict line; with a
    correction, the non-inferiority p-values adjusted as their own family (same method as the analysis's)."""

    def test(c: MetricComparison, level: float) -> MarginTest | None:
        assert c._basis is not None
        return margin_test(
            c._basis[0],
            margin,
            higher_is_better=c.direction == "higher",
            alpha=level,
            sequential=sequential,
            tuning_units=tuning_units,
        )

    tests = {
        id(c): (c, found)
        for c in analysis.every_comparison()
        if c._basis is not None and (found := test(c, alpha)) is not None
    }
    adjusted: dict[int, tuple[float, MarginTest]] = {}
    correction = analysis.correction
    keys = [key for key, (_, found) in tests.items() if not found.no_variance]  # (no p-value to adjust)
    if correction != "none" and keys:
        p = st.adjusted_p_values([tests[k][1].p_value for k in keys], correction)
        level = st.corrected_alpha(p, correction, alpha)
        for key, value in zip(keys, p, strict=True):
            again = test(tests[key][0], level)
            if again is not None:
                adjusted[key] = (float(value), again)

    def redo(c: MetricComparison) -> MetricComparison:
        if id(c) not in tests:
            return c
        result = _result(c, margin, tests[id(c)][1], adjusted.get(id(c)), alpha, sequential, correction)
        return c.model_copy(update={"non_inferiority": result, "verdict_line": f"{c.verdict_line}; {result.text}"})

    return analysis.with_comparisons(redo, non_inferiority_margin=margin.text(True).lstrip("-"))


def _result(
    c: MetricComparison,
    margin: Margin,
    test: MarginTest,
    adjusted: tuple[float, MarginTest] | None,
    alpha: float,
    sequential: bool,
    correction: str,
) -> NonInferiority:
    higher = c.direction == "higher"
    p, judged = (adjusted[0], adjusted[1]) if adjusted is not None else (test.p_value, test)

    def shown(value: float) -> str:
        return f"{value * 100:+.2f} %" if margin.relative else f"{value:+.4g}"

    clears = judged.bound > judged.margin if higher else judged.bound < judged.margin
    past = judged.far_bound < judged.margin if higher else judged.far_bound > judged.margin
    side, far_side = ("lower", "upper") if higher else ("upper", "lower")
    level = f"{(1 - alpha) * 100:g} %"
    kind = "always-valid " if sequential else ""
    label = "Holm-adjusted " if correction == "holm" else "BH-adjusted " if correction == "bh" else ""
    p_text = f"{'adjusted ' if adjusted else ''}{st.p_clause(p)}"
    margin_text = margin.text(higher)
    if test.no_variance:
        capped = f", capped at {c.cap:.4g}" if c.cap is not None else ""
        return NonInferiority(
            margin=test.margin,
            relative=margin.relative,
            sequential=sequential,
            p_value=None,
            bound=None,
            far_bound=None,
            verdict="not shown non-inferior",
            text=(
                f"not shown non-inferior (margin {margin_text} of {c.control}: no variance, every unit's value the "
                f"same in both arms{capped}; no evidence either way)"
            ),
        )
    if p < alpha and clears:
        verdict = "non-inferior"
        text = (
            f"non-inferior (within {margin_text} of {c.control}: {label}{kind}one-sided {level} {side} bound "
            f"{shown(judged.bound)}, {p_text})"
        )
    elif past:
        verdict = "inferior"
        text = (
            f"inferior (past {margin_text} of {c.control}: {label}{kind}one-sided {level} {far_side} bound "
            f"{shown(judged.far_bound)})"
        )
    else:
        verdict = "not shown non-inferior"
        text = (
            f"not shown non-inferior (margin {margin_text} of {c.control}: {label}{kind}one-sided {level} {side} "
            f"bound {shown(judged.bound)}, {p_text})"
        )
    return NonInferiority(
        margin=test.margin,
        relative=margin.relative,
        sequential=sequential,
        p_value=_num(test.p_value),
        bound=_num(test.bound),
        far_bound=_num(test.far_bound),
        adjusted_p_value=_num(adjusted[0]) if adjusted else None,
        adjusted_bound=_num(adjusted[1].bound) if adjusted else None,
        verdict=verdict,
        text=text,
    )


def _num(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None
