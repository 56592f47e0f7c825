"""The canary judge of ``splitstream rollout --judge``: Kayenta's NetflixACAJudge on the step's metric series.

Why beside the ratio guards: a p99 ratio compares one number per step, so a version a little slower on every
call passes it, and one noisy interval trips it. The judge compares the *distributions* of a metric over the
step's intervals, control against canary, with a Mann-Whitney U test, and scores the step over every metric
at once, as Spinnaker's automated canary analysis (Kayenta) does. What follows is Kayenta's method (its
``MannWhitneyClassifier``, ``WeightedSumScorer`` and ``ThresholdScoreClassifier``), re-expressed here:

- **Values.** Per metric, one value per check interval and version: from the routers' counters between two
  reads, its p50 or p99 latency, or its error rate (and, for a quantile guard such as
  ``latency:p90:ratio<=1.1``, that quantile of the interval's calls: ``latency_p90``, ``ttft_p90``); for the
  metric of an outcome ``--guard``, from the analysis the guard reads, what the metric's total grew by over what
  its denominator grew by since the last check. An
  interval with nothing to measure has no value (NaN), and NaN values are removed, Kayenta's default
  ``nanStrategy``.
- **Classification.** No value left on a side: *NoData*. Both sides the same values, or one value everywhere:
  *Pass*. Otherwise the two-sided Mann-Whitney interval of the location shift (canary minus control) at
  ``confidence`` (Kayenta: 0.98): the normal approximation with the ties and continuity corrections,
  inverted for the shift (as R's ``wilcox.test(conf.int = TRUE)`` and Kayenta's ``MannWhitney`` do), its
  point estimate the shift at which the statistic is 0 (Hodges-Lehmann-like). With the tolerance
  ``t`` (Kayenta: 0.25), *High* when the interval's low end exceeds ``t·|estimate|`` and the canary's mean is
  at least the control's (Kayenta's mean-ratio effect size, allowed increase 1.0; ignored when it cannot be
  computed), *Low* the mirror image, else *Pass*. Where both sides hold a single repeated value each,
  Kayenta adds Gaussian noise of 1e-5 times the value before ranking; so does this (seeded).
- **Direction.** Latency and errors are better low, so *High* fails them; *Low* is shown and counts as a
  pass (Kayenta's ``direction: increase``). A guard's metric fails on the side its guard calls harm.
- **Score.** Each metric is its own group, of the weight given (percent) or an equal share of what the given
  weights leave. A group scores 100 on a pass, 0 on a failure; a *NoData* group counts 100, but when half of
  the metrics or more have no data the score is 0 (Kayenta's ``NODATA_THRESHOLD``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import scipy

from splitstream.admin import metrics
from splitstream.admin.constants import DEFAULT_CONFIDENCE as DEFAULT_CONFIDENCE
from splitstream.admin.constants import DEFAULT_MARGINAL as DEFAULT_MARGINAL
from splitstream.admin.constants import DEFAULT_METRICS as DEFAULT_METRICS
from splitstream.admin.constants import DEFAULT_PASS as DEFAULT_PASS
from splitstream.admin.constants import DEFAULT_TOLERANCE as DEFAULT_TOLERANCE
from splitstream.admin.constants import JUDGE_METRICS as JUDGE_METRICS
from splitstream.analysis.model import Analysis, ArmSummary
from splitstream.analysis.statistics import MetricKind
from splitstream.common.feedback import METRIC_PATTERN

Classification = Literal["Pass", "High", "Low", "NoData"]
Decision = Literal["pass", "marginal", "fail"]
#: Kayenta's WeightedSumScorer: this share (percent) of the metrics with no data or more fails the canary.
NODATA_THRESHOLD = 50.0


@dataclass(frozen=True, slots=True)
class JudgeMetric:
    """``--judge-metric NAME[=WEIGHT]``: a metric the judge compares, with its weight in percent (None: an equal
    share of what the weights given leave)."""

    name: str
    weight: float | None = None

    @staticmethod
    def parse(text: str) -> JudgeMetric:
        """``latency_p99`` or ``click=30``. Any metric name is taken here; the rollout checks it is one of
        :data:`JUDGE_METRICS` or of its ``--guard`` metrics."""
        name, sep, weight_text = text.strip().partition("=")
        name = name.strip()
        if not METRIC_PATTERN.fullmatch(name):  # a feedback metric's name, as the router takes it
            raise ValueError(f"bad metric {name!r} (NAME or NAME=WEIGHT; NAME one of {', '.join(JUDGE_METRICS)} or "
                             "a --guard metric)")  # fmt: skip
        if not sep:
            return JudgeMetric(name)
        try:
            weight = float(weight_text.strip().removesuffix("%"))
        except ValueError:
            raise ValueError(f"{text!r}: the weight must be a number of percent, got {weight_text!r}") from None
        if not 0 < weight <= 100:
            raise ValueError(f"{text!r}: the weight must be within (0, 100], got {weight_text!r}")
        return JudgeMetric(name, weight)


def weights(chosen: Sequence[JudgeMetric]) -> dict[str, float]:
    """Each metric's weight in percent: as given, the rest shared equally by the others (Kayenta's groups
    without a weight). ValueError when the weights cannot add up to 100."""
    names = [m.name for m in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"a metric is given twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    given = sum(m.weight for m in chosen if m.weight is not None)
    free = [m for m in chosen if m.weight is None]
    if given > 100 + 1e-9 or (not free and abs(given - 100) > 1e-6):
        raise ValueError(f"the weights must add up to 100, got {given:g}")
    share = (100 - given) / len(free) if free else 0.0
    return {m.name: m.weight if m.weight is not None else share for m in chosen}


@dataclass(frozen=True, kw_only=True)
class JudgeConfig:
    """``--judge`` and its flags; ValueError naming the flag for settings that cannot judge anything."""

    #: ``--judge-metric``s; None: :data:`DEFAULT_METRICS` and every ``--guard`` metric, equally weighted.
    metrics: tuple[JudgeMetric, ...] | None = None
    pass_score: float = DEFAULT_PASS
    marginal_score: float = DEFAULT_MARGINAL
    confidence: float = DEFAULT_CONFIDENCE
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        if self.metrics is not None:
            if not self.metrics:
                raise ValueError("--judge-metric: give at least one metric")
            try:
                weights(self.metrics)
            except ValueError as error:
                raise ValueError(f"--judge-metric: {error}") from None
        if not 0 <= self.marginal_score <= self.pass_score <= 100:
            raise ValueError(
                f"--judge-pass and --judge-marginal: need 0 <= marginal <= pass <= 100, got pass "
                f"{self.pass_score:g} and marginal {self.marginal_score:g}"
            )
        if not 0.5 < self.confidence < 1:
            raise ValueError(f"--judge-confidence: must be between 0.5 and 1, got {self.confidence:g}")
        if not 0 <= self.tolerance < math.inf:
            raise ValueError(f"--judge-tolerance: must be a finite number >= 0, got {self.tolerance:g}")

    def chosen(self, guard_metrics: Sequence[str] = ()) -> tuple[JudgeMetric, ...]:
        """The metrics judged: as given, or the defaults and the guards' metrics. ValueError for a name that is
        neither a router metric nor a guard's."""
        if self.metrics is None:
            # A quantile guard on latency p99 is judged as latency_p99, one of the defaults: once.
            return tuple(JudgeMetric(name) for name in dict.fromkeys((*DEFAULT_METRICS, *guard_metrics)))
        for metric in self.metrics:
            if metric.name not in JUDGE_METRICS and metric.name not in guard_metrics:
                raise ValueError(
                    f"--judge-metric: unknown metric {metric.name!r} (one of {', '.join(JUDGE_METRICS)}, or the "
                    f"metric of a --guard{': ' + ', '.join(guard_metrics) if guard_metrics else ''})"
                )
        return self.metrics

    def judge(self, series: Series) -> Judgement:
        return series.judge(weights(series.chosen), confidence=self.confidence, tolerance=self.tolerance)

    def decide(self, judgement: Judgement) -> Decision:
        return decide(judgement, self.pass_score, self.marginal_score)


@dataclass(frozen=True, slots=True)
class ShiftInterval:
    """The Mann-Whitney interval of the location shift (canary minus control) and its point estimate."""

    low: float
    high: float
    estimate: float


@dataclass(frozen=True, slots=True)
class MetricResult:
    name: str
    classification: Classification
    weight: float
    control_points: int
    canary_points: int
    shift: ShiftInterval | None = None
    #: The canary's mean over the control's (Kayenta's "deviation"), None when it cannot be computed.
    mean_ratio: float | None = None
    #: scipy's two-sided Mann-Whitney p-value, shown for reference (the classification reads the interval).
    p_value: float | None = None
    #: Which classification fails the metric: High for what is better low (latency, errors, a ``lift<=``
    #: guard), Low for what is better high (a ``lift>=`` guard: clicks).
    fails_on: Classification = "High"

    @property
    def failed(self) -> bool:
        return self.classification == self.fails_on

    def text(self) -> str:
        if self.classification == "NoData":
            return f"{self.name} NoData ({self.control_points} vs {self.canary_points} intervals)"
        extra = ""
        if self.mean_ratio is not None and math.isfinite(self.mean_ratio):
            extra = f" x{self.mean_ratio:.2f}"
        return f"{self.name} {self.classification}{extra}"


@dataclass(frozen=True, slots=True)
class Judgement:
    score: float
    results: tuple[MetricResult, ...]
    #: Why the score is 0 whatever the metrics say (too many without data), or None.
    reason: str | None = None

    def text(self) -> str:
        parts = ", ".join(r.text() for r in self.results)
        why = f"; {self.reason}" if self.reason else ""
        return f"judge score {self.score:.0f} ({parts}{why})"


def _finite(values: Sequence[float]) -> npt.NDArray[np.float64]:
    array = np.asarray(values, dtype=np.float64)
    return array[np.isfinite(array)]


def shift_interval(canary: npt.ArrayLike, control: npt.ArrayLike, confidence: float) -> ShiftInterval:
    """The shift ``mu`` with ``canary - mu`` and ``control`` alike, and the interval of those not rejected at
    ``confidence``: the roots of the Wilcoxon z statistic (ties and continuity corrected) in ``mu``."""
    x = np.asarray(canary, dtype=np.float64)
    y = np.asarray(control, dtype=np.float64)
    nx, ny = len(x), len(y)

    def z(mu: float, quantile: float) -> float:
        ranks = scipy.stats.rankdata(np.concatenate([x - mu, y]))
        dz = float(ranks[:nx].sum()) - nx * (nx + 1) / 2 - nx * ny / 2
        _, counts = np.unique(ranks, return_counts=True)
        ties = float((counts**3 - counts).sum())
        sigma = math.sqrt(nx * ny / 12 * ((nx + ny + 1) - ties / ((nx + ny) * (nx + ny - 1))))
        if sigma == 0:
            raise ValueError("every observation is tied: no interval")
        return (dz - 0.5 * float(np.sign(dz))) / sigma - quantile

    low_mu, high_mu = float(x.min() - y.max()), float(x.max() - y.min())

    def root(quantile: float) -> float:
        at_low, at_high = z(low_mu, quantile), z(high_mu, quantile)
        if at_low <= 0:
            return low_mu
        if at_high >= 0:
            return high_mu
        return float(scipy.optimize.brentq(z, low_mu, high_mu, args=(quantile,), xtol=1e-12))

    q = float(scipy.stats.norm.ppf(1 - (1 - confidence) / 2))
    return ShiftInterval(low=root(q), high=root(-q), estimate=root(0.0))


def classify(
    name: str,
    control: Sequence[float],
    canary: Sequence[float],
    *,
    weight: float = 100.0,
    confidence: float = DEFAULT_CONFIDENCE,
    tolerance: float = DEFAULT_TOLERANCE,
    fails_on: Classification = "High",
) -> MetricResult:
    """One metric's classification, as Kayenta's MannWhitneyClassifier with ``direction: either`` (the score
    decides which side fails)."""
    x, y = _finite(canary), _finite(control)
    if len(x) == 0 or len(y) == 0:
        return MetricResult(name, "NoData", weight, len(y), len(x), fails_on=fails_on)
    if np.array_equal(np.sort(x), np.sort(y)) or len(np.unique(np.concatenate([x, y]))) == 1:
        return MetricResult(name, "Pass", weight, len(y), len(x), mean_ratio=_ratio(x, y), fails_on=fails_on)
    if len(np.unique(x)) == 1 and len(np.unique(y)) == 1:  # Kayenta's noise for degenerate samples
        rng = np.random.default_rng(0)
        x = x + rng.normal(0.0, abs(x[0]) * 1e-5, len(x))
        y = y + rng.normal(0.0, abs(y[0]) * 1e-5, len(y))
    shift = shift_interval(x, y, confidence)
    ratio = _ratio(x, y)
    bound = tolerance * abs(shift.estimate)
    high = shift.low > bound and (ratio is None or ratio >= 1.0)
    low = shift.high < -bound and (ratio is None or ratio <= 1.0)
    p_value = float(scipy.stats.mannwhitneyu(x, y, alternative="two-sided").pvalue)
    label: Classification = "High" if high else "Low" if low else "Pass"
    return MetricResult(name, label, weight, len(y), len(x), shift, ratio, p_value, fails_on)


def _ratio(canary: npt.NDArray[np.float64], control: npt.NDArray[np.float64]) -> float | None:
    base = float(control.mean())
    if base == 0:
        return None
    return float(canary.mean()) / base


def score(results: Sequence[MetricResult]) -> Judgement:
    """Kayenta's weighted sum: each metric a group of its weight; NoData counts as a pass unless half the metrics
    or more have none, which scores 0."""
    nodata = sum(r.classification == "NoData" for r in results)
    if results and nodata * 100 / len(results) >= NODATA_THRESHOLD:
        return Judgement(0.0, tuple(results), f"{nodata} of {len(results)} metrics have no data")
    total = sum(r.weight * (0.0 if r.failed else 1.0) for r in results)
    return Judgement(round(total, 2), tuple(results))


def decide(judgement: Judgement, pass_threshold: float, marginal_threshold: float) -> Decision:
    """Kayenta's ThresholdScoreClassifier: at or above pass, pass; at or above marginal, marginal; else fail."""
    if judgement.score >= pass_threshold:
        return "pass"
    if judgement.score >= marginal_threshold:
        return "marginal"
    return "fail"


#: A quantile the routers' histograms give per interval: ``latency_p50`` and ``latency_p99`` (the defaults), and the
#: metric of a quantile guard (``--guard 'ttft:p90:ratio<=1.2'`` is judged as ``ttft_p90``).
_ROUTER_QUANTILE = re.compile(r"(latency|ttft)_p(50|90|99)")


def router_metric(name: str) -> bool:
    """Whether the judge reads ``name`` off the routers' counters (else it is an outcome metric of a guard)."""
    return name == "error_rate" or _ROUTER_QUANTILE.fullmatch(name) is not None


def interval_values(name: str, counts: metrics.VersionCounts) -> float:
    """One interval's value of a judge metric for one version; NaN when the version answered nothing in it.
    Latency is the routers' histogram of unary calls, TTFT theirs of first tokens (streams), in seconds."""
    if name == "error_rate":
        return counts.errors / counts.calls if counts.calls > 0 else math.nan
    match = _ROUTER_QUANTILE.fullmatch(name)
    assert match is not None, name
    histogram = counts.buckets if match[1] == "latency" else counts.ttft
    if metrics.observations(histogram) <= 0:
        return math.nan
    value = metrics.quantile(histogram, int(match[2]) / 100)
    return math.nan if value is None else value


@dataclass(frozen=True, slots=True)
class OutcomeSpec:
    """A ``--guard`` metric the judge compares: how the analysis measures it, and which side fails it."""

    kind: MetricKind
    fails_on: Classification


class Series:
    """The step's per-interval values of each judge metric, per version (control and canary): router metrics
    from the counters between two reads, outcome metrics from the analysis between two checks."""

    def __init__(self, chosen: Sequence[JudgeMetric], outcomes: dict[str, OutcomeSpec] | None = None) -> None:
        self.chosen = tuple(chosen)
        self.outcomes = {m.name: (outcomes or {})[m.name] for m in chosen if m.name in (outcomes or {})}
        self.control: dict[str, list[float]] = {m.name: [] for m in chosen}
        self.canary: dict[str, list[float]] = {m.name: [] for m in chosen}
        #: Per outcome metric and side, the (numerator, denominator) the last analysis gave.
        self._totals: dict[tuple[str, str], tuple[float, float]] = {}

    @property
    def intervals(self) -> int:
        return max((len(v) for v in self.canary.values()), default=0)

    def add(self, control: metrics.VersionCounts, canary: metrics.VersionCounts) -> None:
        for metric in self.chosen:
            if router_metric(metric.name):
                self.control[metric.name].append(interval_values(metric.name, control))
                self.canary[metric.name].append(interval_values(metric.name, canary))

    def add_outcomes(self, analysis: Analysis, phase: str, control: str, canary: str) -> None:
        """The outcome metrics' values since the previous check: what the arm's totals grew by over what its
        units (or calls, or events: the metric's denominator) grew by."""
        arms = {a.arm: a for p in analysis.phases if p.id == phase for a in p.arms}
        for name, spec in self.outcomes.items():
            for side, version, values in (("control", control, self.control), ("canary", canary, self.canary)):
                totals = _totals(arms.get(version), name, spec.kind)
                before = self._totals.get((name, side), (0.0, 0.0))
                if totals is None:
                    values[name].append(math.nan)
                    continue
                self._totals[(name, side)] = totals
                grown = totals[1] - before[1]
                values[name].append((totals[0] - before[0]) / grown if grown > 0 else math.nan)

    def judge(self, weights_by_name: dict[str, float], *, confidence: float, tolerance: float) -> Judgement:
        return score(
            [
                classify(
                    m.name,
                    self.control[m.name],
                    self.canary[m.name],
                    weight=weights_by_name[m.name],
                    confidence=confidence,
                    tolerance=tolerance,
                    fails_on=self.outcomes[m.name].fails_on if m.name in self.outcomes else "High",
                )
                for m in self.chosen
            ]
        )


def _totals(arm: ArmSummary | None, name: str, kind: MetricKind) -> tuple[float, float] | None:
    """An arm's cumulative (numerator, denominator) of an outcome metric: the value is their ratio."""
    if arm is None:
        return None
    metric = arm.metrics.get(name)
    if metric is None or metric.value is None:
        return None
    denominator = {MetricKind.RATE: arm.calls, MetricKind.MEAN: metric.events}.get(kind, arm.units)
    return metric.value * denominator, float(denominator)
