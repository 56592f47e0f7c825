"""The typed result of an analysis: what ``analysis.json`` holds, what the report draws, what a rollout guard reads.

Rates are fractions (0.031, not 3.1); relative lifts too. Times are unix nanoseconds. Numbers that could not
be computed (no unit in an arm, a control at 0) are null.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from splitstream.analysis.capping import CapRule
from splitstream.analysis.defaults import SEGMENT_FIELDS as SEGMENT_FIELDS
from splitstream.analysis.statistics import KIND_NAMES, Comparison, MetricKind
from splitstream.analysis.usage import CALL_METRICS

Unit = Literal["user", "call"]
#: ``--correction``: none, Holm's step-down (family-wise error) or Benjamini-Hochberg (false discovery rate).
Correction = Literal["none", "holm", "bh"]
Verdict = Literal["better", "worse", "inconclusive", "no data"]
#: Ends every verdict line of an analysis by ``--unit call`` of traffic split by user (its intervals are too narrow).
PER_CALL_LABEL = "[--unit call on traffic split by user: intervals too narrow]"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


#: Which way a metric is better: ``higher`` (clicks, revenue: the default) or ``lower`` (latency, wait, refunds).
Direction = Literal["higher", "lower"]
DIRECTIONS: tuple[Direction, ...] = ("higher", "lower")
METRIC_SYNTAX = (
    "NAME:KIND[:DIRECTION][:cap=CAP], KIND conversion, rate, mean or sum, DIRECTION higher (default) or lower, "
    "CAP (mean and sum) a percentile P99 or a value 250"
)


class MetricSpec(_Model):
    """``click:rate`` or ``wait_s:mean:lower``: a metric name as feedback reports it, how it is measured
    per unit, and which way is better (a verdict says "better" or "worse" by it)."""

    name: str
    kind: MetricKind
    direction: Direction = "higher"
    #: ``:cap=P99`` or ``:cap=250``: per-unit values capped above before the test (:mod:`splitstream.analysis.capping`).
    cap: str | None = None

    @staticmethod
    def parse(text: str, *, default_kind: MetricKind | None = None) -> MetricSpec:
        """The one reader of a metric's spec, for ``analyze --metric`` and ``rollout --guard`` alike (a guard's
        ``revenue:mean:cap=P99:lift>=-1%`` reads its metric here, cap included). ``default_kind``: the kind of a
        name given without one (a guard's ``click`` is ``click:rate``); None: a kind must be given. ValueError
        saying what is wrong."""
        spec, cap = split_cap(text)
        parsed = MetricSpec._parse(spec, default_kind)
        if cap is None:
            return parsed
        if parsed.kind not in (MetricKind.MEAN, MetricKind.SUM):
            raise ValueError(
                f"bad metric {text!r}: a cap applies to a number per unit (kinds mean and sum), not to {parsed.kind}"
            )
        try:
            rule = CapRule.parse(cap)
        except ValueError as error:
            raise ValueError(f"bad metric {text!r}: {error}") from None
        return parsed.model_copy(update={"cap": str(rule)})

    @property
    def cap_rule(self) -> CapRule | None:
        return CapRule.parse(self.cap) if self.cap is not None else None

    @staticmethod
    def _parse(text: str, default_kind: MetricKind | None) -> MetricSpec:
        given = written_direction(text)
        body = text.strip().rpartition(":")[0] if given is not None else text.strip()
        if body in CALL_METRICS:  # a metric of the calls (ttft_ms, cost, ...): per call unless a kind is given
            body = f"{body}:{MetricKind.MEAN.value}"
        name, sep, kind = body.rpartition(":")
        kinds = [k.value for k in MetricKind]
        if default_kind is not None and (not name or kind.lower() not in KIND_NAMES):
            # A metric name may hold colons, but a last part a letter or two off a kind or a direction is a
            # typo: taken as part of the name, the guard would wait for a metric no feedback ever names.
            if name and difflib.get_close_matches(kind.lower(), [*KIND_NAMES, *DIRECTIONS], n=1, cutoff=0.6):
                raise ValueError(
                    f"{kind!r} is neither a kind ({', '.join(kinds)}) nor a direction (higher, lower, after the "
                    f"kind); for a metric named {body!r}, give its kind: {body}:rate"
                )
            name, sep, kind = body, ":", default_kind.value
        direction: Direction = given or (CALL_METRICS[name][1] if name in CALL_METRICS else "higher")
        if not sep or not name:
            example = "e.g. click:rate, buy:conversion, wait_s:mean:lower"
            raise ValueError(f"bad metric {text!r} (expected {METRIC_SYNTAX}; {example})")
        try:
            return MetricSpec(name=name, kind=MetricKind(kind.lower()), direction=direction)
        except ValueError:
            raise ValueError(
                f"bad metric {text!r}: unknown kind {kind!r} (one of {', '.join(kinds)}; a direction, higher or "
                "lower, goes last)"
            ) from None

    @property
    def higher_is_better(self) -> bool:
        return self.direction == "higher"

    def __str__(self) -> str:
        suffix = "" if self.direction == "higher" else f":{self.direction}"
        cap = "" if self.cap is None else f":cap={self.cap}"
        return f"{self.name}:{self.kind.value}{suffix}{cap}"


def written_direction(text: str) -> Direction | None:
    """The direction a spec writes out after its kind (``wait_s:mean:lower``, cap left off), None where it
    writes none."""
    head, sep, last = split_cap(text)[0].strip().rpartition(":")
    if sep and head and last.lower() in DIRECTIONS:
        return "lower" if last.lower() == "lower" else "higher"
    return None


def split_cap(text: str) -> tuple[str, str | None]:
    """``revenue:sum:cap=P99`` as (``revenue:sum``, ``P99``). The cap goes last, after the direction: a ``cap=``
    anywhere else is refused rather than read as part of the name."""
    head, sep, last = text.strip().rpartition(":")
    if sep and last.lower().startswith("cap="):
        if "cap=" in head.lower():
            raise ValueError(f"bad metric {text!r}: one cap per metric ({METRIC_SYNTAX})")
        return head, last[4:]
    if "cap=" in text.lower():
        raise ValueError(f"bad metric {text!r}: the cap goes last, e.g. wait_s:mean:lower:cap=P99 ({METRIC_SYNTAX})")
    return text, None


class Interval(_Model):
    low: float | None
    high: float | None


class ArmMetric(_Model):
    """An arm's value of one metric (a rate, a mean per event, or a total per unit) with its interval."""

    value: float | None
    ci: Interval
    #: Feedback events of this metric attributed to the arm's units (a metric of the calls: the calls with a
    #: value of it).
    events: int
    #: ``:cap=``: the cap applied to each unit's value (the same for every arm of the phase), and how many of
    #: this arm's units it lowered. The value and interval above are of the capped values.
    cap: float | None = None
    capped_units: int = 0


class ArmSummary(_Model):
    arm: str
    weight: float | None
    units: int
    calls: int
    #: Randomized calls that failed (status not OK), of all the arm's randomized calls in the phase.
    errors: int
    error_rate: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    metrics: dict[str, ArmMetric]
    #: (latency ms, cumulative fraction) points of the arm's randomized calls, for the report's CDF.
    latency_cdf: list[tuple[float, float]] = Field(default_factory=list)
    #: Token streams among the calls (each stream one call: its latency is the stream's duration), the time to
    #: first token (calls that got one: streams, HTTP calls), tokens (responses) in all, and tokens / stream seconds.
    streams: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tokens: int = 0
    tokens_per_s: float | None = None
    #: Generations among the calls (calls whose completion tokens are known: a ``usage``, a stream's usage
    #: outputs, or its responses carrying text), their tokens in and out, and how many of them have no known
    #: prompt tokens (a stream whose model reports no usage: its prompt is not counted, never guessed).
    generations: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_in_per_call: float | None = None
    tokens_out_per_call: float | None = None
    prompt_tokens_unknown: int = 0
    #: ``--price`` of the arm's version (``v1=0.15/1M-in,0.60/1M-out``; None: not priced, so no cost), the
    #: generations it prices (tokens in and out known), their cost in all and per call, in the price's unit.
    price: str | None = None
    costed_calls: int = 0
    cost: float | None = None
    cost_per_call: float | None = None


class TimelinePoint(_Model):
    """The comparison as it stood at the end of one of the window's time buckets (the data up to then)."""

    until_ns: int
    units_control: int
    units_arm: int
    absolute: float | None
    absolute_ci: Interval
    relative: float | None
    relative_ci: Interval
    p_value: float | None
    sequential_p_value: float | None = None
    sequential_ci: Interval | None = None
    sequential_relative_ci: Interval | None = None


class BayesianReading(_Model):
    """``--engine bayes``: the posterior of the lift (gbstats' effect model: a normal likelihood from the
    delta-method variance, the analysis' prior on the relative lift) and what GrowthBook reads off it. The chance
    and the losses are on the relative lift in the metric's good direction (down for ``lower``)."""

    relative_mean: float
    relative_sd: float
    relative_credible_interval: Interval
    absolute_mean: float | None
    absolute_sd: float | None
    absolute_credible_interval: Interval
    chance_to_beat_control: float
    #: Expected relative loss of choosing the arm (were it worse), and of staying with the control (were the
    #: arm better): gbstats' ``risk``.
    expected_loss_choosing_arm: float
    expected_loss_keeping_control: float


class NonInferiority(_Model):
    """``--non-inferiority``: the one-sided test of the lift against the margin (docs/analysis.md)."""

    #: The margin on the lift's scale, signed: below 0 for a higher-is-better metric (the lift may fall this
    #: far), above 0 for a lower-is-better one; a fraction when ``relative``.
    margin: float
    relative: bool
    #: Always-valid (``--sequential``): the bound is the confidence sequence's edge, the p-value the mSPRT's.
    sequential: bool
    #: The one-sided p-value of H0 "the lift is at or past the margin" (unadjusted).
    p_value: float | None
    #: The one-sided 1 - alpha bound on the metric's bad side (lower for higher-is-better): non-inferior when it
    #: clears the margin. ``far_bound``: the one on the other side: inferior when even it is past the margin.
    bound: float | None
    far_bound: float | None
    #: ``--correction``: the p-value adjusted over the family of non-inferiority tests, and the bound at the
    #: matching level (what the verdict used).
    adjusted_p_value: float | None = None
    adjusted_bound: float | None = None
    verdict: Literal["non-inferior", "inferior", "not shown non-inferior"]
    text: str


class NoveltyPoint(_Model):
    """The comparison over the units active in one bucket of time since their first exposure (``--novelty-bucket``),
    on their calls and events of that bucket alone."""

    bucket: int
    #: The bucket's start, in seconds after each unit's first exposure.
    since_first_s: float
    units_control: int
    units_arm: int
    control_value: float | None
    arm_value: float | None
    absolute: float | None
    absolute_ci: Interval
    relative: float | None
    relative_ci: Interval
    p_value: float | None


class MetricComparison(_Model):
    metric: str
    kind: MetricKind
    #: Which way is better (``--metric NAME:KIND:lower``): the verdict's "better" or "worse" follows it; the
    #: lifts are arm minus control whatever the direction.
    direction: Direction = "higher"
    arm: str
    control: str
    #: ``welch`` (Welch's t-test), ``z`` (delta-method ratio, normal), ``two-proportion z``.
    test: str
    control_value: float | None
    arm_value: float | None
    absolute_lift: float | None
    absolute_ci: Interval
    relative_lift: float | None
    relative_ci: Interval
    p_value: float | None
    #: Always-valid (mSPRT) p-value and confidence sequence on the absolute lift, with ``--sequential``, and the
    #: confidence sequence of the relative lift (delta method).
    sequential_p_value: float | None = None
    sequential_ci: Interval | None = None
    sequential_relative_ci: Interval | None = None
    #: CUPED: θ, and the interval's width without the adjustment (to show what it bought).
    cuped_theta: float | None = None
    unadjusted_ci: Interval | None = None
    #: ``:cap=``: the cap applied to every unit's value before the test, and the units it lowered per arm.
    cap: float | None = None
    capped_units: dict[str, int] = Field(default_factory=dict)
    #: The smallest absolute lift (and relative, to the control's value) a test at alpha detects with 80 % power
    #: at the arms' sizes; at ``--planned-units`` in total split as now, when given.
    minimum_detectable_effect: float | None = None
    minimum_detectable_relative_effect: float | None = None
    planned_minimum_detectable_effect: float | None = None
    #: Units in both arms the observed lift would need for 80 % power at the current split, and how many more.
    units_needed: float | None = None
    more_units_needed: int | None = None
    #: ``--correction``: the method, the p-value adjusted over the family (every comparison of the analysis), and
    #: the interval at the matching level (the sequence's, with ``--sequential``): what the verdict used.
    correction: Correction = "none"
    adjusted_p_value: float | None = None
    adjusted_ci: Interval | None = None
    adjusted_relative_ci: Interval | None = None
    verdict: Verdict
    verdict_line: str
    timeline: list[TimelinePoint] = Field(default_factory=list)
    #: ``--engine bayes``: the Bayesian reading, which then gives the verdict (the p-value and intervals above
    #: are still the frequentist ones, shown beside it); None otherwise or without a relative lift.
    bayes: BayesianReading | None = None
    #: ``--non-inferiority``: the test against the margin (its clause ends the verdict line).
    non_inferiority: NonInferiority | None = None
    #: The comparison per bucket of time since each unit's first exposure (buckets with 2 units per arm or more).
    novelty: list[NoveltyPoint] = Field(default_factory=list)
    #: The comparison's estimates and metric, kept (not written) so a correction can recompute its intervals.
    _basis: tuple[Comparison, MetricSpec, int | None] | None = PrivateAttr(default=None)


class SampleRatioMismatch(_Model):
    """Pearson's chi-square of randomized units per arm against the phase's weights (arms at 0 left out)."""

    observed: dict[str, int]
    expected: dict[str, float]
    chi2: float
    p_value: float
    flagged: bool


class QuantileTimelinePoint(_Model):
    """A quantile comparison as it stood at the end of one of the window's time buckets (the calls up to then)."""

    until_ns: int
    units_control: int
    units_arm: int
    difference: float | None
    difference_ci: Interval
    ratio: float | None
    ratio_ci: Interval
    p_value: float | None
    sequential_ratio_ci: Interval | None = None


class QuantileComparison(_Model):
    """One quantile (p50, p90, p99) of latency or TTFT, treatment against control, over the phase's randomized
    calls pooled per arm, with intervals clustered by unit (:mod:`splitstream.analysis.quantiles`)."""

    metric: Literal["latency", "ttft"]
    #: ``p50``, ``p90``, ``p99``, and the same as a fraction.
    name: str
    quantile: float
    arm: str
    control: str
    #: Milliseconds; each arm's interval of its own quantile.
    control_value: float | None
    control_ci: Interval
    arm_value: float | None
    arm_ci: Interval
    control_calls: int
    arm_calls: int
    control_units: int
    arm_units: int
    #: Arm minus control, ms.
    difference: float | None
    difference_ci: Interval
    #: Arm over control, its interval (log scale) and the p-value of ``ratio = 1``.
    ratio: float | None
    ratio_ci: Interval
    p_value: float | None
    #: The always-valid confidence sequence of the ratio (mSPRT on the log-ratio): what a rollout guard reads.
    sequential_ratio_ci: Interval | None = None
    method: str
    #: ``--correction``: the method, the p-value of ``ratio = 1`` adjusted over the family (the metrics' comparisons
    #: and these), and the ratio's and the difference's intervals at the matching level (with ``--sequential``,
    #: the ratio's confidence sequence at that level, and the p-value the mSPRT's).
    correction: Correction = "none"
    adjusted_p_value: float | None = None
    adjusted_ratio_ci: Interval | None = None
    adjusted_difference_ci: Interval | None = None
    #: The comparison at the end of each time bucket of the window (buckets where both arms had calls).
    timeline: list[QuantileTimelinePoint] = Field(default_factory=list)
    #: The standard errors of the log-ratio and of the difference, and the units of both arms, kept (not written)
    #: so a correction can recompute the intervals at its level.
    _basis: tuple[float, float, int] | None = PrivateAttr(default=None)


class PhaseResult(_Model):
    id: str
    control: str
    weights: dict[str, float]
    first_ns: int
    units: int
    #: Units that were randomized into two arms or more in this phase: excluded from every count here.
    crossover_units: int
    srm: SampleRatioMismatch | None
    arms: list[ArmSummary]
    comparisons: list[MetricComparison]
    #: p50, p90 and p99 of latency (and TTFT, where calls have one) per arm against the control.
    quantiles: list[QuantileComparison] = Field(default_factory=list)


class NonRandomizedCalls(_Model):
    """Calls routed by a pin, a spill to the control, a retry on the control, or of unknown assignment:
    counted and shown, never compared."""

    phase: str
    assignment: str
    arm: str
    calls: int
    errors: int
    error_rate: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None


class CallCounts(_Model):
    entries_read: int
    #: Calls received in the window, once each.
    calls: int
    randomized: int
    not_randomized: int
    duplicates: int
    corrupt: int
    #: The most calls held at once for feedback to join (calls are let go once no event may name them any
    #: more): about the calls of the join horizon and twice the lateness allowance, not of the window.
    held_for_join_peak: int = 0


class FeedbackCounts(_Model):
    entries_read: int
    #: Events joined to a randomized unit and counted.
    used: int
    #: Later copies of an event, by (metric, idempotency key).
    duplicates: int
    #: Events whose request id is no call of the window (or dated outside the call's attribution window: past
    #: it by more than the attribution window or the lateness allowance, or before it by more than the clock
    #: skew), or whose unit had no randomized call before it.
    unknown: int
    #: Events of pinned, spilled or retried calls.
    not_randomized: int
    #: Events of units seen in two arms of one phase.
    crossover: int
    #: Events of the metrics asked for but dated outside the window (for events naming a call: before it, or
    #: past its end by more than the attribution window).
    outside_window: int
    #: Events of other metrics.
    other_metrics: int
    corrupt: int


class Segment(_Model):
    """The analysis restricted to the calls whose segment field (``principal``) has ``value``: a call is in the
    segment of its own value, so a unit seen under two values is in both, with the calls of each."""

    value: str
    calls: CallCounts
    feedback: FeedbackCounts
    phases: list[PhaseResult]
    non_randomized: list[NonRandomizedCalls]
    verdicts: list[str]


class Analysis(_Model):
    model: str
    since_ns: int
    until_ns: int
    #: Events naming a call of the window count up to ``until_ns + attribution_ns`` (``--attribution-window``).
    attribution_ns: int = 0
    unit: Unit
    alpha: float
    sequential: bool
    cuped_since_ns: int | None = None
    cuped_until_ns: int | None = None
    metrics: list[str]
    calls: CallCounts
    feedback: FeedbackCounts
    phases: list[PhaseResult]
    non_randomized: list[NonRandomizedCalls]
    verdicts: list[str]
    #: ``--segment``: the field, the analysis per value of it (empty value: calls without one), and the
    #: units (per phase) randomized in two segments or more (counted in each).
    segment_field: str | None = None
    segments: list[Segment] = Field(default_factory=list)
    units_in_several_segments: int = 0
    #: ``--unit call`` on calls the router split by routing key: why the intervals are too narrow (None otherwise).
    unit_warning: str | None = None
    #: ``--correction`` and how many comparisons it adjusted over (metrics x arms x phases, x segments).
    correction: Correction = "none"
    family_size: int = 0
    #: Of the family, the latency and TTFT quantile comparisons (each arm's p50, p90, p99 against the control).
    quantiles_in_family: int = 0
    #: ``--engine``: which reading gives the verdicts; with ``bayes``, the prior on the relative lift (sd None:
    #: flat) and the chance to beat control at which an arm is better (at 1 - it, worse).
    engine: Literal["frequentist", "bayes"] = "frequentist"
    prior_mean: float | None = None
    prior_sd: float | None = None
    bayes_threshold: float | None = None
    #: ``--non-inferiority``: the margin as given (``1 %``, or absolute ``0.002``); None without the flag.
    non_inferiority_margin: str | None = None
    #: ``--novelty-bucket``: the width of the buckets of time since first exposure (``novelty`` per comparison).
    novelty_bucket_ns: int | None = None

    def every_comparison(self) -> list[MetricComparison]:
        """The comparisons of every phase, then of each segment's phases."""
        parts = [self.phases, *(segment.phases for segment in self.segments)]
        return [c for phases in parts for phase in phases for c in phase.comparisons]

    def every_quantile(self) -> list[QuantileComparison]:
        """The quantile comparisons of every phase, then of each segment's phases."""
        parts = [self.phases, *(segment.phases for segment in self.segments)]
        return [q for phases in parts for phase in phases for q in phase.quantiles]

    def with_comparisons(
        self,
        redo: Callable[[MetricComparison], MetricComparison],
        redo_quantile: Callable[[QuantileComparison], QuantileComparison] | None = None,
        **update: object,
    ) -> Analysis:
        """A copy with every comparison (of each phase, and of each segment's phases) replaced by ``redo`` of it
        (and every quantile comparison by ``redo_quantile``, when given), the verdict lines gathered again from
        them, and ``update``'s fields set: how a correction, an engine or a non-inferiority test rewrites an
        analysis."""

        def phases_of(phases: list[PhaseResult]) -> list[PhaseResult]:
            return [
                phase.model_copy(
                    update={
                        "comparisons": [redo(c) for c in phase.comparisons],
                        "quantiles": [redo_quantile(q) for q in phase.quantiles] if redo_quantile else phase.quantiles,
                    }
                )
                for phase in phases
            ]

        def lines(phases: list[PhaseResult]) -> list[str]:
            return [c.verdict_line for phase in phases for c in phase.comparisons]

        phases = phases_of(self.phases)
        segments = [
            segment.model_copy(update={"phases": (redone := phases_of(segment.phases)), "verdicts": lines(redone)})
            for segment in self.segments
        ]
        return self.model_copy(update={"phases": phases, "segments": segments, "verdicts": lines(phases), **update})
