# ruff: noqa: RUF002  (the formulas are written with their Greek letters)
"""The Bayesian read-out of a comparison (``analyze --engine bayes``), the way GrowthBook's gbstats reads it.

Why a second engine: a p-value answers "how surprising is this under no change", which product owners
routinely misread as "the chance the new version is better". The Bayesian read-out states that chance, and the
expected loss of each choice, directly, at the price of a prior and of no frequentist error guarantee.

The method is gbstats' effect model (``EffectBayesianABTest``): the lift estimated by the frequentist code
(its delta-method variance, the control's noise included) is taken as a normal likelihood,
``lift̂ ~ N(lift, V)``, and combined with a normal prior on the lift:

- flat (improper, the default): the posterior is ``N(lift̂, V)``;
- proper ``N(m, s²)`` on the **relative** lift: posterior precision ``1/V + 1/s²``, mean
  ``(lift̂/V + m/s²) / (1/V + 1/s²)``. For the absolute lift the prior is scaled by the control's value
  (``m·|μc|``, ``s²·μc²``), as gbstats scales a relative prior.

With the posterior ``N(μ, σ²)`` of the lift in the metric's good direction (``-lift`` for a lower-is-better
metric), everything is closed form: chance to beat control ``Φ(μ/σ)``; expected loss of choosing the arm
``E[max(-lift, 0)] = σ φ(μ/σ) - μ Φ(-μ/σ)``; expected loss of staying with control
``E[max(lift, 0)] = σ φ(μ/σ) + μ Φ(μ/σ)``; the credible interval the posterior's central ``1 - α``.
gbstats reports the same two losses as ``risk`` (relative, on the lift's scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import scipy

from splitstream.analysis import statistics as st
from splitstream.analysis.defaults import DEFAULT_THRESHOLD as DEFAULT_THRESHOLD
from splitstream.analysis.defaults import ENGINES as ENGINES
from splitstream.analysis.defaults import Engine as Engine
from splitstream.analysis.statistics import Estimate


@dataclass(frozen=True, slots=True)
class Prior:
    """A normal prior on the relative lift (``mean`` 0.0 = no change; ``sd`` 0.3 = a lift of ±30 % is about one
    standard deviation away); ``sd`` None is the flat (improper) prior, gbstats' default."""

    mean: float = 0.0
    sd: float | None = None

    @property
    def proper(self) -> bool:
        return self.sd is not None

    def __str__(self) -> str:
        if self.sd is None:
            return "flat prior"
        return f"prior N({self.mean * 100:+g} %, sd {self.sd * 100:g} %) on the relative lift"


@dataclass(frozen=True, slots=True)
class Posterior:
    """A normal posterior of a lift (arm minus control, or arm / control - 1)."""

    mean: float
    sd: float

    def interval(self, alpha: float) -> tuple[float, float]:
        if self.sd == 0:
            return self.mean, self.mean
        low, high = scipy.stats.norm.ppf([alpha / 2, 1 - alpha / 2], self.mean, self.sd)
        return float(low), float(high)


@dataclass(frozen=True, slots=True)
class Reading:
    """What ``--engine bayes`` says of one metric and arm. Losses and the chance are on the relative lift, in
    the metric's good direction (a lower-is-better metric beats control by going down)."""

    relative: Posterior
    absolute: Posterior | None
    chance_to_beat: float
    #: Expected loss (relative) of choosing the arm, and of staying with the control.
    loss_choosing_arm: float
    loss_keeping_control: float


def normal_posterior(estimate: float, variance: float, prior_mean: float, prior_variance: float | None) -> Posterior:
    """The posterior of a lift from its normal likelihood ``N(estimate, variance)`` and a normal prior (None:
    flat). Zero variance with a flat prior is a point mass at the estimate."""
    if prior_variance is None:
        return Posterior(estimate, math.sqrt(variance) if variance > 0 else 0.0)
    if not variance > 0:
        return Posterior(estimate, 0.0)
    precision = 1 / variance + 1 / prior_variance
    mean = (estimate / variance + prior_mean / prior_variance) / precision
    return Posterior(mean, math.sqrt(1 / precision))


def chance_to_beat(mean: float, sd: float) -> float:
    """``P(lift > 0) = Φ(μ/σ)`` of a normal posterior of the lift in its good direction."""
    if sd == 0:
        return 1.0 if mean > 0 else 0.0 if mean < 0 else 0.5
    return float(scipy.stats.norm.cdf(mean / sd))


def expected_losses(mean: float, sd: float) -> tuple[float, float]:
    """``(E[max(-lift, 0)], E[max(lift, 0)])`` of ``lift ~ N(mean, sd²)`` in its good direction: the loss of
    choosing the arm (it is in fact worse) and of staying with the control (the arm was in fact better)."""
    if sd == 0:
        return max(-mean, 0.0), max(mean, 0.0)
    z = mean / sd
    density = float(scipy.stats.norm.pdf(z))
    choosing = sd * density - mean * float(scipy.stats.norm.cdf(-z))
    keeping = sd * density + mean * float(scipy.stats.norm.cdf(z))
    return max(choosing, 0.0), max(keeping, 0.0)


def read(control: Estimate, treatment: Estimate, prior: Prior, *, higher_is_better: bool = True) -> Reading | None:
    """The Bayesian reading of treatment against control; None where there is no relative lift to speak of (a
    control at 0, a value that is not finite), as gbstats returns no result for a baseline of 0."""
    # The delta method's variance of mt/mc, as the frequentist interval uses it (the control's noise included).
    relative_variance = st.relative_variance(control, treatment)
    if relative_variance is None:
        return None
    prior_variance = prior.sd**2 if prior.sd is not None else None
    relative = normal_posterior(treatment.value / control.value - 1, relative_variance, prior.mean, prior_variance)
    absolute_variance = control.variance + treatment.variance
    absolute = None
    if math.isfinite(absolute_variance):
        scale = abs(control.value)
        absolute = normal_posterior(
            treatment.value - control.value,
            absolute_variance,
            prior.mean * scale,
            prior_variance * scale * scale if prior_variance is not None else None,
        )
    sign = 1.0 if higher_is_better else -1.0
    good = sign * relative.mean
    choosing, keeping = expected_losses(good, relative.sd)
    return Reading(relative, absolute, chance_to_beat(good, relative.sd), choosing, keeping)


def verdict(chance: float, threshold: float) -> Literal["better", "worse", "inconclusive"]:
    """GrowthBook's reading of the chance to win: at or above the threshold better, at or below 1 - it worse."""
    if chance >= threshold:
        return "better"
    if chance <= 1 - threshold:
        return "worse"
    return "inconclusive"


def percent(fraction: float) -> str:
    """A chance or a loss as the line shows it: ``97.3 %``, ``0.02 %``, ``< 0.01 %``, ``> 99.9 %`` (never a
    rounded 100 % or 0 %, which a posterior never is)."""
    value = fraction * 100
    if 0 < value < 0.01:
        return "< 0.01 %"
    if 99.95 <= value < 100:
        return "> 99.9 %"
    return f"{value:.2f} %" if value < 1 else f"{value:.1f} %"


def check_query(engine: str, prior: Prior, threshold: float, sequential: bool, correction: str) -> None:
    """ValueError naming the flag for a Bayesian set-up that cannot be read. The p-value machinery (always-valid
    sequences, multiple-comparison corrections) has no meaning for a posterior, so asking for both is refused
    rather than silently ignored; so are Bayesian flags without the engine."""
    if engine not in ENGINES:
        raise ValueError(f"--engine: unknown engine {engine!r} (frequentist or bayes)")
    if not 0.5 < threshold < 1:
        raise ValueError(f"--bayes-threshold: a chance strictly between 0.5 and 1, got {threshold:g}")
    if not math.isfinite(prior.mean):
        raise ValueError(f"--prior-mean: a finite relative lift (0.05 for +5 %), got {prior.mean}")
    if prior.sd is not None and not (prior.sd > 0 and math.isfinite(prior.sd)):
        raise ValueError(f"--prior-sd: a positive finite standard deviation of the relative lift, got {prior.sd}")
    if engine != "bayes":
        if prior != Prior() or threshold != DEFAULT_THRESHOLD:
            raise ValueError("--prior-mean, --prior-sd and --bayes-threshold go with --engine bayes")
        return
    if sequential:
        raise ValueError("--sequential: always-valid p-values belong to --engine frequentist, not bayes")
    if correction != "none":
        raise ValueError(f"--correction {correction}: it corrects p-values, which --engine bayes does not read")
