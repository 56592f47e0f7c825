"""``--engine bayes`` applied to a finished analysis: every comparison's verdict read from its posterior.

A pass over the result rather than a branch inside the frequentist code, so the two engines share every
estimate (the same delta-method variances, CUPED included) and differ only in how they read them.
"""

from __future__ import annotations

from splitstream.analysis import bayes
from splitstream.analysis.model import (
    PER_CALL_LABEL,
    Analysis,
    BayesianReading,
    Interval,
    MetricComparison,
    MetricSpec,
)
from splitstream.analysis.statistics import Comparison


def apply(analysis: Analysis, prior: bayes.Prior, threshold: float) -> Analysis:
    """``analysis`` with each comparison's Bayesian reading and its verdict and line by it; the frequentist
    p-values and intervals stay in the comparison, beside it."""
    alpha = analysis.alpha
    return analysis.with_comparisons(
        lambda c: _read(c, prior, threshold, alpha),
        engine="bayes",
        prior_mean=prior.mean,
        prior_sd=prior.sd,
        bayes_threshold=threshold,
    )


def _read(comparison: MetricComparison, prior: bayes.Prior, threshold: float, alpha: float) -> MetricComparison:
    if comparison._basis is None:  # no data: its line already says so
        return comparison
    result, spec, _ = comparison._basis
    reading = bayes.read(result.control, result.treatment, prior, higher_is_better=spec.higher_is_better)
    suffix = f" {PER_CALL_LABEL}" if comparison.verdict_line.endswith(PER_CALL_LABEL) else ""
    if reading is None:
        line = (
            f"{comparison.arm} vs {comparison.control}: {spec.name}: no Bayesian reading: the control's value is "
            f"{result.control.value:g}, so there is no relative lift to put a prior on"
        )
        return comparison.model_copy(update={"verdict": "no data", "verdict_line": line + suffix})
    verdict = bayes.verdict(reading.chance_to_beat, threshold)
    line = _line(comparison.arm, comparison.control, spec, result, reading, prior, verdict, alpha)
    return comparison.model_copy(
        update={"bayes": _model(reading, alpha), "verdict": verdict, "verdict_line": line + suffix}
    )


def _line(
    arm: str,
    control: str,
    spec: MetricSpec,
    result: Comparison,
    reading: bayes.Reading,
    prior: bayes.Prior,
    verdict: str,
    alpha: float,
) -> str:
    """``v2 vs v1: click +3.1 % (95 % credible interval +1.2 .. +5.0 %, flat prior): v2 better: 97.3 % chance
    to beat control, expected loss 0.02 % (keeping v1: 3.05 %)``."""
    low, high = reading.relative.interval(alpha)
    level = f"{(1 - alpha) * 100:g} %"
    head = (
        f"{arm} vs {control}: {spec.name} {reading.relative.mean * 100:+.1f} % ({level} credible interval "
        f"{low * 100:+.1f} .. {high * 100:+.1f} %, {prior})"
    )
    chance = (
        f"{bayes.percent(reading.chance_to_beat)} chance to beat control, expected loss "
        f"{bayes.percent(reading.loss_choosing_arm)} (keeping {control}: {bayes.percent(reading.loss_keeping_control)})"
    )
    if verdict == "inconclusive":
        return f"{head}: inconclusive: {chance}"
    return f"{head}: {arm} {verdict}: {chance}"


def _model(reading: bayes.Reading, alpha: float) -> BayesianReading:
    low, high = reading.relative.interval(alpha)
    absolute = reading.absolute
    absolute_ci = Interval(low=None, high=None)
    if absolute is not None:
        a_low, a_high = absolute.interval(alpha)
        absolute_ci = Interval(low=a_low, high=a_high)
    return BayesianReading(
        relative_mean=reading.relative.mean,
        relative_sd=reading.relative.sd,
        relative_credible_interval=Interval(low=low, high=high),
        absolute_mean=absolute.mean if absolute else None,
        absolute_sd=absolute.sd if absolute else None,
        absolute_credible_interval=absolute_ci,
        chance_to_beat_control=reading.chance_to_beat,
        expected_loss_choosing_arm=reading.loss_choosing_arm,
        expected_loss_keeping_control=reading.loss_keeping_control,
    )
