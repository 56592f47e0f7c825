"""``analyze``: from a model's recorded calls and feedback to verdicts, per experiment phase and arm.

The steps, each a column operation: read the calls, counting randomized ones per (phase, arm, unit) and time
bucket and the others apart; read the feedback, de-duplicate it and fold each page into per-(phase, arm,
unit) sums at once (:mod:`splitstream.analysis.folding`: by request id to its call, else to the phase its
unit was last exposed in before the event), leaving out units seen in two arms of one phase (crossover);
per phase, lay the units out as rows of numpy matrices (one column per time bucket, cumulated), and compare
every arm with the control at the end of each bucket. The last bucket's comparison is the result; the
earlier ones are the lift-over-time chart.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace
from functools import partial
from types import ModuleType

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from splitstream.analysis import bayes, bayes_readout, capping, quantile_effects
from splitstream.analysis import statistics as st
from splitstream.analysis.arrays import RowMatrix, selected_row_sums
from splitstream.analysis.folding import Folder, Loaded, RowMetric, among, load
from splitstream.analysis.loading import (
    TIMELINE_POINTS,
    CallSamples,
    Exposures,
    Feedback,
    Histogram,
    PhaseInfo,
    Source,
    StreamStats,
    UsageStats,
    Window,
    fingerprints,
    mixed,
)
from splitstream.analysis.model import (
    PER_CALL_LABEL,
    SEGMENT_FIELDS,
    Analysis,
    ArmMetric,
    ArmSummary,
    CallCounts,
    Correction,
    FeedbackCounts,
    Interval,
    MetricComparison,
    MetricSpec,
    NonRandomizedCalls,
    PhaseResult,
    QuantileComparison,
    SampleRatioMismatch,
    Segment,
    TimelinePoint,
    Unit,
    Verdict,
)
from splitstream.analysis.noninferiority import Margin, annotated
from splitstream.analysis.novelty import DEFAULT_BUCKET_NS, NoveltyFold, novelty_points
from splitstream.analysis.quantile_effects import phase_quantiles
from splitstream.analysis.sources import AggregatesSource, ArchiveSource, RedisSource
from splitstream.analysis.usage import CALL_METRICS, Price, is_call_metric
from splitstream.common.redis_url import RedisClient

FloatArray = npt.NDArray[np.float64]
#: Power the "more units needed" estimate aims at.
TARGET_POWER = 0.8


#: ``--novelty-bucket``'s widest: its buckets are counted in int64 nanoseconds (and one this wide holds any window).
LONGEST_NOVELTY_BUCKET_NS = 100 * 366 * 86_400 * 10**9


@dataclass(frozen=True, kw_only=True)
class Query:
    """What to analyse. ``pre_window``: the CUPED pre-period (the same metrics, per unit), or None."""

    model: str
    window: Window
    metrics: tuple[MetricSpec, ...]
    unit: Unit = "user"
    alpha: float = 0.05
    sequential: bool = False
    pre_window: Window | None = None
    #: Units in both arms at which the confidence sequence is narrowest (``--sequential-tuning``).
    tuning_units: int = st.DEFAULT_TUNING_UNITS
    #: Units planned in total (``--planned-units``): the minimum detectable effect is also given at that size.
    planned_units: int | None = None
    page_size: int = 5_000
    #: A readable call field to segment by (``principal``): the comparison again per value of it.
    segment: str | None = None
    #: ``--price`` per version: each call's cost (metric ``cost``, and per arm in the report).
    prices: dict[str, Price] = field(default_factory=dict)
    #: ``--correction``: adjust p-values and intervals over every comparison of the analysis.
    correction: Correction = "none"
    #: ``--engine``: ``bayes`` reads each verdict from the lift's posterior (:mod:`splitstream.analysis.bayes`)
    #: under ``prior``, better at a chance to beat control of ``bayes_threshold``.
    engine: bayes.Engine = "frequentist"
    prior: bayes.Prior = field(default_factory=bayes.Prior)
    bayes_threshold: float = bayes.DEFAULT_THRESHOLD
    #: ``--non-inferiority``: test every comparison against this margin too (one-sided).
    non_inferiority: Margin | None = None
    #: ``--novelty-bucket``: the comparison also per bucket of time since each unit's first exposure (None: not).
    novelty_bucket_ns: int | None = DEFAULT_BUCKET_NS
    #: Compare latency and TTFT quantiles per arm (``phases[].quantiles``); False spares keeping each unit's calls
    #: per latency bucket, for a reader that needs none (a rollout with no quantile guard).
    quantiles: bool = True
    #: The quantile comparisons' timeline (each a comparison per time bucket); False for a reader that needs only
    #: the comparison as it stands (a rollout's quantile guard, checked every second).
    quantile_timeline: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be between 0 and 1 (exclusive), got {self.alpha}")
        if not self.metrics:
            raise ValueError("give at least one metric (NAME:KIND, e.g. click:rate)")
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"a metric is named twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
        for metric in self.metrics:
            if is_call_metric(metric.name) and metric.kind.counts_positive_calls:
                raise ValueError(
                    f"metric {metric.name!r} is measured on the calls ({CALL_METRICS[metric.name][0]}): its kind is "
                    f"mean (per call) or sum (per {'user' if self.unit == 'user' else 'call'}), not {metric.kind}"
                )
        if self.window.until_ns <= self.window.since_ns:
            raise ValueError("the window's end must be after its start")
        if self.pre_window is not None and self.unit == "call":
            raise ValueError("CUPED needs units that come back (--unit user): a call has no pre-period")
        if self.segment is not None and self.segment not in SEGMENT_FIELDS:
            raise ValueError(f"cannot segment by {self.segment!r} (fields: {', '.join(SEGMENT_FIELDS)})")
        if self.correction not in ("none", "holm", "bh"):
            raise ValueError(f"unknown correction {self.correction!r} (none, holm or bh)")
        if self.tuning_units < 1:
            raise ValueError(f"the sequential tuning must be at least 1 unit, got {self.tuning_units}")
        if self.planned_units is not None and self.planned_units < 2:
            raise ValueError(f"the planned units must be at least 2 (one per arm), got {self.planned_units}")
        if self.novelty_bucket_ns is not None and not 0 < self.novelty_bucket_ns <= LONGEST_NOVELTY_BUCKET_NS:
            raise ValueError(
                f"the novelty bucket must be longer than 0 and at most 100 years, got {self.novelty_bucket_ns} ns"
            )
        if self.pre_window is not None and self.pre_window.until_ns <= self.pre_window.since_ns:
            raise ValueError("the CUPED pre-period's end must be after its start")
        bayes.check_query(self.engine, self.prior, self.bayes_threshold, self.sequential, self.correction)


async def analyze(source: RedisClient | Source, query: Query) -> Analysis:
    """Read the window from Redis (or another :class:`Source`: the archive, both) and analyse it. Raises
    RedisError/OSError when Redis fails mid-way, ArchiveError when the archive does."""
    return _non_inferior(query, await _analyzed(source, query))


async def _analyzed(source: RedisClient | Source, query: Query) -> Analysis:
    if isinstance(source, Redis | RedisCluster):
        source = RedisSource(source)
    loaded = await _load(source, query)
    exposures, feedback, overall, parts = loaded.exposures, loaded.feedback, loaded.folder, loaded.segments
    pre: _PreValues | None = None
    if query.pre_window is not None:
        pre = await _load_pre_values(source, query, query.pre_window)
    analysis = summarize(query, exposures, feedback, overall, pre)
    if query.segment is None:
        return _engine(query, _corrected(query, analysis))
    segments = []
    for value, part in exposures.segments.items():
        result = summarize(query, part, feedback, parts[value], pre)
        segments.append(
            Segment(
                value=value,
                calls=result.calls,
                feedback=result.feedback,
                phases=result.phases,
                non_randomized=result.non_randomized,
                verdicts=result.verdicts,
            )
        )
    return _engine(
        query,
        _corrected(
            query,
            analysis.model_copy(
                update={
                    "segment_field": query.segment,
                    "segments": segments,
                    "units_in_several_segments": _units_in_several(exposures),
                }
            ),
        ),
    )


def sql_archive(source: Source, query: Query) -> ArchiveSource | None:
    """The archive to aggregate in SQL (DuckDB), or None where the reader's pages serve: the Python engine
    asked for, an archive read below Redis (``--archive``), or ``--segment`` (not in the SQL yet)."""
    if not isinstance(source, ArchiveSource) or source.engine != "duckdb" or source.below is not None:
        return None
    return source if query.segment is None else None


def _duckdb_engine() -> ModuleType:
    """The DuckDB engine, imported when a source needs it: DuckDB, sqlglot and pandas are a second of start-up
    that an analysis of Redis, and every rollout guard's read, did without."""
    from splitstream.analysis.sql import duckdb_engine

    return duckdb_engine


async def _load(source: Source, query: Query) -> Loaded:
    per_call = query.unit == "call"
    kinds = [m.kind for m in query.metrics]
    names = [m.name for m in query.metrics]
    if isinstance(source, AggregatesSource):
        return await asyncio.to_thread(
            _duckdb_engine().load_aggregates, source.path, query.window, kinds, names, per_call=per_call
        )
    archived = sql_archive(source, query)
    if archived is not None:
        return await asyncio.to_thread(
            partial(
                _duckdb_engine().load_archive,
                archived.archive,
                query.model,
                query.window,
                kinds,
                names,
                per_call=per_call,
                prices=query.prices,
                novelty_ns=query.novelty_bucket_ns,
                call_samples=query.quantiles,
            )
        )
    # Calls and feedback side by side, the feedback folded into the units page by page (nothing per event is
    # kept; a call only while an event may still name it).
    return await load(
        source,
        query.model,
        query.window,
        kinds,
        names,
        per_call=per_call,
        page_size=query.page_size,
        segment=query.segment,
        prices=query.prices,
        novelty_ns=query.novelty_bucket_ns,
        call_samples=query.quantiles,
    )


def _engine(query: Query, analysis: Analysis) -> Analysis:
    """The verdicts by ``--engine``: as they are (frequentist), or read from the posterior (bayes)."""
    if query.engine != "bayes":
        return analysis
    return bayes_readout.apply(analysis, query.prior, query.bayes_threshold)


def _non_inferior(query: Query, analysis: Analysis) -> Analysis:
    if query.non_inferiority is None:
        return analysis
    return annotated(
        analysis,
        query.non_inferiority,
        alpha=query.alpha,
        sequential=query.sequential,
        tuning_units=query.tuning_units,
    )


# -- multiple comparisons ------------------------------------------------------------------

#: How a verdict line names the adjustment of its interval and p-value.
CORRECTION_LABELS = {"holm": "Holm-adjusted", "bh": "BH-adjusted"}


def _corrected(query: Query, analysis: Analysis) -> Analysis:
    """Every comparison of the analysis (each metric and arm, in each phase and segment) adjusted as one family:
    its p-value by Holm or Benjamini-Hochberg, its interval recomputed at the level that matches (Bonferroni's
    for Holm, the false-coverage-rate level for BH), and its verdict judged on both."""
    if query.correction == "none":
        return analysis
    family = [c for c in analysis.every_comparison() if _p_of(query, c) is not None]
    # The latency and TTFT quantiles are hypotheses of the analysis too (a guard or a reader acts on them).
    quantile_p = {id(q): _quantile_p(query, q) for q in analysis.every_quantile()}
    quantiles = [q for q in analysis.every_quantile() if quantile_p[id(q)] is not None]
    if not family and not quantiles:
        return analysis.model_copy(update={"correction": query.correction})
    p_values = [_p_of(query, c) for c in family] + [quantile_p[id(q)] for q in quantiles]
    adjusted = st.adjusted_p_values(p_values, query.correction)
    level = st.corrected_alpha(adjusted, query.correction, query.alpha)
    done = {id(c): _adjusted(query, c, float(p), level) for c, p in zip(family, adjusted, strict=False)}
    done_quantiles = {
        id(q): quantile_effects.adjusted(
            q,
            float(p),
            level,
            correction=query.correction,
            sequential=query.sequential,
            tuning_units=query.tuning_units,
        )
        for q, p in zip(quantiles, adjusted[len(family) :], strict=True)
    }
    return analysis.with_comparisons(
        lambda c: done.get(id(c), c),
        lambda q: done_quantiles.get(id(q), q),
        correction=query.correction,
        family_size=len(family) + len(quantiles),
        quantiles_in_family=len(quantiles),
    )


def _quantile_p(query: Query, q: QuantileComparison) -> float | None:
    return quantile_effects.family_p_value(
        q, sequential=query.sequential, alpha=query.alpha, tuning_units=query.tuning_units
    )


def _p_of(query: Query, comparison: MetricComparison) -> float | None:
    """The p-value the verdict reads: the always-valid one with ``--sequential``."""
    if comparison._basis is None:
        return None
    return comparison.sequential_p_value if query.sequential else comparison.p_value


def _adjusted(query: Query, comparison: MetricComparison, p: float, level: float) -> MetricComparison:
    assert comparison._basis is not None  # the family holds only comparisons with their estimates
    result, spec, more = comparison._basis
    test = "welch" if result.test == "welch" else "z"  # a two-proportion test's interval is the unpooled z one
    again = st.compare(
        result.control,
        result.treatment,
        alpha=level,
        test=test,
        sequential=query.sequential,
        tuning_units=query.tuning_units,
    )
    again = replace(again, sequential_p_value=p) if query.sequential else replace(again, p_value=p)
    verdict, line = _verdict(
        query, spec, comparison.control, comparison.arm, again, more, adjusted=CORRECTION_LABELS[query.correction]
    )
    if query.unit == "call" and comparison.verdict_line.endswith(PER_CALL_LABEL):
        line = f"{line} {PER_CALL_LABEL}"
    interval = again.sequential_ci if query.sequential else again.absolute_ci
    relative = again.sequential_relative_ci if query.sequential else again.relative_ci
    return comparison.model_copy(
        update={
            "correction": query.correction,
            "adjusted_p_value": _num(p),
            "adjusted_ci": _interval(*interval) if interval else None,
            "adjusted_relative_ci": _interval(*relative) if relative else None,
            "verdict": verdict,
            "verdict_line": line,
        }
    )


def _units_in_several(exposures: Exposures) -> int:
    """Units (per phase) with randomized calls in two segments or more. Each segment codes phases in the order
    it met them, so phases are compared by name."""
    keys = []
    for part in exposures.segments.values():
        if not len(part.units):
            continue
        phase_keys = fingerprints([name.encode() for name in part.phases.names])
        phase_of_row = phase_keys[part.units["phase"].to_numpy().astype(np.int64)]
        keys.append(pa.array(np.unique(mixed(part.units["unit"].to_numpy(), 0) ^ phase_of_row)))
    if len(keys) < 2:
        return 0
    counts = pc.value_counts(pa.concat_arrays(keys))
    return int(pc.sum(pc.greater(counts.field("counts"), 1)).as_py() or 0)


def summarize(
    query: Query, exposures: Exposures, feedback: Feedback, folder: Folder, pre: _PreValues | None = None
) -> Analysis:
    """The analysis of loaded data (no I/O): what :func:`analyze` returns. ``folder`` holds the feedback
    folded into ``exposures``' rows."""
    crossover = folder.crossover
    units = exposures.units.filter(pa.array(~among(exposures.units, crossover))) if len(crossover) else exposures.units
    metrics = folder.metrics()
    order = _phase_order(units)
    phases = []
    for code in order:
        name = exposures.phases.names[code]
        info = exposures.phase_info.get(name) or PhaseInfo(name, {}, "")
        phases.append(
            _analyse_phase(
                query,
                info,
                units.filter(pc.equal(units["phase"], code)) if len(order) > 1 else units,
                metrics,
                bucket_calls=exposures.bucket_calls,
                arm_names=exposures.arms.names,
                crossover_units=int(pc.sum(pc.equal(crossover["phase"], code)).as_py() or 0),
                latency=exposures.latency,
                streams=exposures.streams,
                usage=exposures.usage,
                prices=query.prices,
                pre=pre,
                novelty=folder.novelty,
                samples=exposures.call_samples,
            )
        )
    non_randomized = _non_randomized(exposures)
    randomized_calls = int(pc.sum(exposures.units["calls"]).as_py() or 0)
    warning = _unit_warning(query, exposures)
    if warning:
        phases = [_labelled(phase, PER_CALL_LABEL) for phase in phases]
    return Analysis(
        model=query.model,
        since_ns=query.window.since_ns,
        until_ns=query.window.until_ns,
        attribution_ns=query.window.attribution_ns,
        unit=query.unit,
        alpha=query.alpha,
        sequential=query.sequential,
        cuped_since_ns=query.pre_window.since_ns if query.pre_window else None,
        cuped_until_ns=query.pre_window.until_ns if query.pre_window else None,
        metrics=[str(m) for m in query.metrics],
        calls=CallCounts(
            entries_read=exposures.entries_read,
            calls=exposures.calls,
            randomized=randomized_calls,
            not_randomized=exposures.calls - randomized_calls,
            duplicates=exposures.duplicates,
            corrupt=exposures.corrupt,
            held_for_join_peak=folder.index.peak,
        ),
        feedback=FeedbackCounts(
            entries_read=feedback.entries_read,
            used=folder.used,
            duplicates=feedback.duplicates,
            unknown=folder.unknown,
            not_randomized=folder.not_randomized,
            crossover=folder.crossed,
            outside_window=feedback.outside_window,
            other_metrics=feedback.other_metrics,
            corrupt=feedback.corrupt,
        ),
        phases=phases,
        non_randomized=non_randomized,
        verdicts=[c.verdict_line for p in phases for c in p.comparisons],
        unit_warning=warning,
        novelty_bucket_ns=query.novelty_bucket_ns,
    )


def _unit_warning(query: Query, exposures: Exposures) -> str | None:
    """``--unit call`` treats calls as independent. Where the router split by routing key, a user's calls
    share an arm and their outcomes are correlated, so per-call intervals are too narrow and p-values too small:
    say so, with how many calls were split that way."""
    if query.unit != "call" or not exposures.keyed_calls:
        return None
    return (
        f"--unit call: {exposures.keyed_calls:,} of {exposures.randomized_calls:,} randomized calls were split by "
        "their routing key (a user's calls share an arm), so treating calls as independent overstates precision; "
        "use --unit user, or --unit call only on calls sent without a routing key"
    )


def _labelled(phase: PhaseResult, label: str) -> PhaseResult:
    comparisons = [c.model_copy(update={"verdict_line": f"{c.verdict_line} {label}"}) for c in phase.comparisons]
    return phase.model_copy(update={"comparisons": comparisons})


def _phase_order(units: pa.Table) -> list[int]:
    """Phase codes, the earliest first."""
    if not len(units):
        return []
    first = units.group_by("phase").aggregate([("first_ns", "min")]).sort_by("first_ns_min")
    return [int(p) for p in first["phase"].to_pylist()]


# -- per phase -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _UnitMatrix:
    """A phase's units as rows: their arm, the bucket of their first call, and per-bucket cumulated counts."""

    keys: pa.Array
    arm_names: list[str]
    arm_of: npt.NDArray[np.int64]
    first_bucket: npt.NDArray[np.int64]
    calls: FloatArray  # (units, buckets), cumulated over buckets
    #: The rows of ``Exposures.units`` laid out here, and the unit (row of this matrix) of each.
    rows: npt.NDArray[np.int64]
    unit_of_row: npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class _MetricMatrix:
    """One metric per unit: each unit's totals of its sums, events and positive calls, and those of them the
    comparisons read bucket by bucket (:data:`_OVER_TIME`) cumulated over the time buckets, (units, buckets);
    the others are (units, 0). A million units' matrix is 160 MB: a rate's sums and events, read only as totals,
    were two of them held through the phase's comparisons."""

    sums: FloatArray
    counts: FloatArray
    positives: FloatArray
    sum_totals: FloatArray
    count_totals: FloatArray
    positive_totals: FloatArray


#: What a comparison of each kind of metric reads per time bucket (:func:`_unit_values`): sums, counts, positives.
_OVER_TIME: dict[st.MetricKind, tuple[bool, bool, bool]] = {
    st.MetricKind.SUM: (True, False, False),
    st.MetricKind.MEAN: (True, True, False),
    st.MetricKind.CONVERSION: (False, False, True),
    st.MetricKind.RATE: (False, False, True),
}


def _unit_matrix(units: pa.Table, bucket_calls: RowMatrix, arm_names: list[str]) -> _UnitMatrix:
    """Rows of ``units`` (keyed rows of ``bucket_calls``) as one row per unit; rows of one unit (the pre-period's
    several phases and arms) are added up."""
    keys, index = np.unique(units["unit"].to_numpy(), return_inverse=True)
    index = index.reshape(-1).astype(np.int64)
    n = len(keys)
    arm_codes = units["arm"].to_numpy().astype(np.int64)
    present = np.unique(arm_codes)
    arm_of = np.zeros(n, dtype=np.int64)
    arm_of[index] = np.searchsorted(present, arm_codes)
    rows = units["key"].to_numpy().astype(np.int64)
    per_bucket = selected_row_sums((n, TIMELINE_POINTS), index, bucket_calls, rows)
    first = np.where(per_bucket.any(axis=1), np.argmax(per_bucket > 0, axis=1), TIMELINE_POINTS)
    calls = np.cumsum(per_bucket, axis=1, out=per_bucket)  # in place: no second units x buckets matrix
    arms = [arm_names[int(c)] for c in present]
    return _UnitMatrix(pa.array(keys, pa.uint64()), arms, arm_of, first, calls, rows, index)


def _metric_matrix(matrix: _UnitMatrix, metric: RowMetric, kind: st.MetricKind | None = None) -> _MetricMatrix:
    """One metric's per-row sums laid out per unit of the matrix (a unit's rows added up), cumulated over the
    time buckets: the parts a comparison of ``kind`` reads bucket by bucket kept whole, of the others (of all
    three without ``kind``) each unit's total alone."""
    n = len(matrix.keys)
    over_time = _OVER_TIME[kind] if kind is not None else (False, False, False)

    def per_unit(values: RowMatrix, keep: bool) -> tuple[FloatArray, FloatArray]:
        if not len(values) or not n:
            # Left untouched (no cumulated zeros written): a metric without positive calls has no memory here.
            return np.zeros((n, TIMELINE_POINTS if keep else 0)), np.zeros(n)
        out = selected_row_sums((n, TIMELINE_POINTS), matrix.unit_of_row, values, matrix.rows)
        np.cumsum(out, axis=1, out=out)  # in place: no second units x buckets matrix
        totals = out[:, TIMELINE_POINTS - 1].copy()
        return (out if keep else np.zeros((n, 0))), totals

    keep_sums, keep_counts, keep_positives = over_time
    sums, sum_totals = per_unit(metric.sums, keep_sums)
    counts, count_totals = per_unit(metric.counts, keep_counts)
    positives, positive_totals = per_unit(metric.positives, keep_positives)
    return _MetricMatrix(sums, counts, positives, sum_totals, count_totals, positive_totals)


def _cap(spec: MetricSpec, metric: _MetricMatrix) -> float | None:
    """The phase's cap of a capped metric, over the pooled units of every arm: each unit's total (``sum``: units
    without events too, as they are compared; ``mean``: units with an event, the ratio's other units add nothing)."""
    rule = spec.cap_rule
    if rule is None:
        return None
    totals = metric.sum_totals
    if spec.kind is st.MetricKind.MEAN:
        totals = totals[metric.count_totals > 0]
    return capping.cap_value(rule, totals)


def _unit_values(
    kind: st.MetricKind,
    metric: _MetricMatrix,
    calls: FloatArray,
    rows: npt.NDArray[np.bool_],
    bucket: int,
    cap: float | None = None,
) -> st.UnitValues:
    if kind is st.MetricKind.SUM:
        return st.UnitValues.of_means(capping.capped(metric.sums[rows, bucket], cap))
    if kind is st.MetricKind.MEAN:
        return st.UnitValues(capping.capped(metric.sums[rows, bucket], cap), metric.counts[rows, bucket])
    if kind is st.MetricKind.CONVERSION:
        return st.UnitValues.of_means(metric.positives[rows, bucket] > 0)
    exposures = calls[rows, bucket]
    return st.UnitValues(np.minimum(metric.positives[rows, bucket], exposures), exposures)


def _analyse_phase(
    query: Query,
    info: PhaseInfo,
    units: pa.Table,
    metrics: list[RowMetric],
    *,
    bucket_calls: RowMatrix,
    arm_names: list[str],
    crossover_units: int,
    latency: dict[tuple[str, str, str], Histogram],
    streams: dict[tuple[str, str, str], StreamStats],
    usage: dict[tuple[str, str, str], UsageStats],
    prices: dict[str, Price],
    pre: _PreValues | None,
    novelty: NoveltyFold | None = None,
    samples: CallSamples | None = None,
) -> PhaseResult:
    matrix = _unit_matrix(units, bucket_calls, arm_names)
    last = TIMELINE_POINTS - 1
    arm_rows = {arm: matrix.arm_of == code for code, arm in enumerate(matrix.arm_names)}
    observed = {arm: int(rows.sum()) for arm, rows in arm_rows.items()}
    srm = st.sample_ratio_mismatch(observed, info.weights) if info.weights else None
    ordered = sorted(matrix.arm_names, key=lambda a: (a != info.control, a))
    arm_metrics: dict[str, dict[str, ArmMetric]] = {arm: {} for arm in ordered}
    by_arm: dict[str, list[MetricComparison]] = {arm: [] for arm in ordered}
    # One metric at a time: its per-unit matrices are the largest things the analysis holds.
    for code, spec in enumerate(query.metrics):
        metric = _metric_matrix(matrix, metrics[code], spec.kind)
        cap = _cap(spec, metric)
        for arm in ordered:
            rows = arm_rows[arm]
            values = _unit_values(spec.kind, metric, matrix.calls, rows, last, cap)
            estimate = st.estimate(values)
            low, high = estimate.interval(query.alpha) if values.units > 1 else (math.nan, math.nan)
            count = int(metric.count_totals[rows].sum())
            arm_metrics[arm][spec.name] = ArmMetric(
                value=_num(estimate.value),
                ci=_interval(low, high),
                events=count,
                cap=cap,
                capped_units=capping.units_capped(metric.sum_totals[rows], cap),
            )
            if info.control in arm_rows and arm != info.control:
                comparison = _comparison(query, spec, info.control, arm, matrix, metric, arm_rows, pre, cap)
                if cap is not None:
                    capped = {a: arm_metrics[a][spec.name].capped_units for a in (info.control, arm)}
                    comparison = comparison.model_copy(update={"cap": cap, "capped_units": capped})
                if novelty is not None:
                    points = novelty_points(
                        novelty,
                        code,
                        folder_rows=matrix.rows,
                        unit_of_row=matrix.unit_of_row,
                        units=len(matrix.keys),
                        control_rows=arm_rows[info.control],
                        arm_rows=rows,
                        cap=cap,
                        alpha=query.alpha,
                    )
                    comparison = comparison.model_copy(update={"novelty": points})
                by_arm[arm].append(comparison)
        del metric
    arms = []
    for arm in ordered:
        rows = arm_rows[arm]
        histogram = latency.get((info.id, arm, "randomized"), Histogram())
        stream = streams.get((info.id, arm, "randomized"), StreamStats())
        tokens = usage.get((info.id, arm, "randomized"), UsageStats())
        price = prices.get(arm)
        arms.append(
            ArmSummary(
                arm=arm,
                weight=info.weights.get(arm),
                units=int(rows.sum()),
                calls=int(matrix.calls[rows, last].sum()),
                errors=histogram.errors,
                error_rate=histogram.errors / histogram.calls if histogram.calls else None,
                latency_p50_ms=histogram.quantile_ms(0.5),
                latency_p99_ms=histogram.quantile_ms(0.99),
                metrics=arm_metrics[arm],
                latency_cdf=histogram.cdf_points(),
                streams=stream.streams,
                ttft_p50_ms=stream.ttft.quantile_ms(0.5),
                ttft_p99_ms=stream.ttft.quantile_ms(0.99),
                tokens=stream.tokens,
                tokens_per_s=stream.tokens_per_s(),
                generations=tokens.generations,
                tokens_in=tokens.tokens_in,
                tokens_out=tokens.tokens_out,
                tokens_in_per_call=tokens.tokens_in / tokens.prompt_known if tokens.prompt_known else None,
                tokens_out_per_call=tokens.tokens_out / tokens.generations if tokens.generations else None,
                prompt_tokens_unknown=tokens.generations - tokens.prompt_known,
                price=price.text if price else None,
                costed_calls=tokens.costed,
                cost=tokens.cost if price and tokens.costed else None,
                cost_per_call=tokens.cost / tokens.costed if price and tokens.costed else None,
            )
        )
    comparisons = [c for arm in ordered for c in by_arm[arm]]
    return PhaseResult(
        id=info.id,
        control=info.control,
        weights=info.weights,
        first_ns=int(pc.min(units["first_ns"]).as_py() or 0),
        units=len(matrix.keys),
        crossover_units=crossover_units,
        srm=SampleRatioMismatch(
            observed=srm.observed, expected=srm.expected, chi2=srm.chi2, p_value=srm.p_value, flagged=srm.flagged
        )
        if srm
        else None,
        arms=arms,
        comparisons=comparisons,
        quantiles=phase_quantiles(
            samples,
            rows=matrix.rows,
            unit_of_row=matrix.unit_of_row,
            arm_of_unit=matrix.arm_of,
            arm_names=matrix.arm_names,
            control=info.control,
            alpha=query.alpha,
            tuning_units=query.tuning_units,
            bucket_end_ns=query.window.bucket_end_ns if query.quantile_timeline else None,
        ),
    )


def _compare_at(
    query: Query,
    spec: MetricSpec,
    control_values: st.UnitValues,
    arm_values: st.UnitValues,
    covariates: tuple[st.UnitValues, st.UnitValues] | None,
) -> tuple[st.Comparison, float | None, st.Comparison | None]:
    """The comparison (CUPED-adjusted when covariates are given), θ, and the unadjusted one."""
    if query.unit == "call" and spec.kind.counts_positive_calls:
        # A call is its own unit: converted or not, so a conversion and a rate are the same 0/1 per call.
        result = st.two_proportions(
            int(control_values.y.sum()),
            control_values.units,
            int(arm_values.y.sum()),
            arm_values.units,
            alpha=query.alpha,
        )
        if query.sequential:
            result = st.with_sequential(result, alpha=query.alpha, tuning_units=query.tuning_units)
        return result, None, None
    test = "welch" if spec.kind in (st.MetricKind.SUM, st.MetricKind.CONVERSION) else "z"
    plain = st.compare(
        st.estimate(control_values),
        st.estimate(arm_values),
        alpha=query.alpha,
        test=test,
        sequential=query.sequential,
        tuning_units=query.tuning_units,
    )
    if covariates is None:
        return plain, None, None
    control, arm, theta = st.cuped_estimates(control_values, arm_values, *covariates)
    adjusted = st.compare(
        control, arm, alpha=query.alpha, test=test, sequential=query.sequential, tuning_units=query.tuning_units
    )
    return adjusted, theta, plain


def _comparison(
    query: Query,
    spec: MetricSpec,
    control: str,
    arm: str,
    matrix: _UnitMatrix,
    metric: _MetricMatrix,
    arm_rows: dict[str, npt.NDArray[np.bool_]],
    pre: _PreValues | None,
    cap: float | None = None,
) -> MetricComparison:
    timeline = []
    final: tuple[st.Comparison, float | None, st.Comparison | None] | None = None
    for bucket in range(TIMELINE_POINTS):
        started = matrix.first_bucket <= bucket
        control_rows = arm_rows[control] & started
        treatment_rows = arm_rows[arm] & started
        if control_rows.sum() < 2 or treatment_rows.sum() < 2:
            continue
        control_values = _unit_values(spec.kind, metric, matrix.calls, control_rows, bucket, cap)
        arm_values = _unit_values(spec.kind, metric, matrix.calls, treatment_rows, bucket, cap)
        covariates = (
            (pre.values(spec, matrix.keys, control_rows), pre.values(spec, matrix.keys, treatment_rows))
            if pre is not None
            else None
        )
        result = _compare_at(query, spec, control_values, arm_values, covariates)
        point = result[0]
        timeline.append(
            TimelinePoint(
                until_ns=query.window.bucket_end_ns(bucket),
                units_control=int(control_rows.sum()),
                units_arm=int(treatment_rows.sum()),
                absolute=_num(point.absolute),
                absolute_ci=_interval(*point.absolute_ci),
                relative=_num(point.relative),
                relative_ci=_interval(*point.relative_ci) if point.relative_ci else _interval(None, None),
                p_value=_num(point.p_value),
                sequential_p_value=_num(point.sequential_p_value),
                sequential_ci=_interval(*point.sequential_ci) if point.sequential_ci else None,
                sequential_relative_ci=_interval(*point.sequential_relative_ci)
                if point.sequential_relative_ci
                else None,
            )
        )
        if bucket == TIMELINE_POINTS - 1:
            final = result
    if final is None:
        line = f"{arm} vs {control}: {spec.name}: no data (fewer than 2 units in an arm)"
        return MetricComparison(
            metric=spec.name,
            kind=spec.kind,
            direction=spec.direction,
            arm=arm,
            control=control,
            test="",
            control_value=None,
            arm_value=None,
            absolute_lift=None,
            absolute_ci=_interval(None, None),
            relative_lift=None,
            relative_ci=_interval(None, None),
            p_value=None,
            verdict="no data",
            verdict_line=line,
            timeline=timeline,
        )
    result, theta, plain = final
    sizing = _sizing(query, result)
    verdict, line = _verdict(query, spec, control, arm, result, sizing.more_units_needed)
    comparison = MetricComparison(
        metric=spec.name,
        kind=spec.kind,
        direction=spec.direction,
        arm=arm,
        control=control,
        test=result.test,
        control_value=_num(result.control.value),
        arm_value=_num(result.treatment.value),
        absolute_lift=_num(result.absolute),
        absolute_ci=_interval(*result.absolute_ci),
        relative_lift=_num(result.relative),
        relative_ci=_interval(*result.relative_ci) if result.relative_ci else _interval(None, None),
        p_value=_num(result.p_value),
        sequential_p_value=_num(result.sequential_p_value),
        sequential_ci=_interval(*result.sequential_ci) if result.sequential_ci else None,
        sequential_relative_ci=_interval(*result.sequential_relative_ci) if result.sequential_relative_ci else None,
        cuped_theta=theta,
        unadjusted_ci=_interval(*plain.absolute_ci) if plain is not None else None,
        minimum_detectable_effect=sizing.mde,
        minimum_detectable_relative_effect=sizing.mde_relative,
        planned_minimum_detectable_effect=sizing.planned_mde,
        units_needed=sizing.units_needed,
        more_units_needed=sizing.more_units_needed,
        verdict=verdict,
        verdict_line=line,
        timeline=timeline,
    )
    comparison._basis = (result, spec, sizing.more_units_needed)
    return comparison


@dataclass(frozen=True, slots=True)
class _Sizing:
    mde: float | None = None
    mde_relative: float | None = None
    planned_mde: float | None = None
    units_needed: float | None = None
    more_units_needed: int | None = None


def _sizing(query: Query, result: st.Comparison) -> _Sizing:
    """What the arms' actual sizes can detect, and how many units in total the observed effect would need at the
    split as it runs (an uneven split needs more than twice its smaller arm)."""
    control, treatment = result.control, result.treatment
    if not (math.isfinite(control.variance) and math.isfinite(treatment.variance)):
        return _Sizing()
    if min(control.units, treatment.units) < 2:
        return _Sizing()
    variances = (control.unit_variance, treatment.unit_variance)
    mde = st.minimum_detectable_effect(
        *variances, control.units, treatment.units, alpha=query.alpha, power=TARGET_POWER
    )
    total = control.units + treatment.units
    share = control.units / total
    planned = None
    if query.planned_units is not None:
        planned_control = query.planned_units * share
        planned = st.minimum_detectable_effect(
            *variances, planned_control, query.planned_units - planned_control, alpha=query.alpha, power=TARGET_POWER
        )
    needed = st.units_needed(result.absolute, *variances, control_share=share, alpha=query.alpha, power=TARGET_POWER)
    base = control.value
    return _Sizing(
        mde=_num(mde),
        mde_relative=_num(mde / abs(base)) if base and math.isfinite(base) else None,
        planned_mde=_num(planned),
        units_needed=_num(needed),
        more_units_needed=max(0, math.ceil(needed - total)) if needed is not None and math.isfinite(needed) else None,
    )


def _verdict(
    query: Query,
    spec: MetricSpec,
    control: str,
    arm: str,
    result: st.Comparison,
    more: int | None,
    *,
    adjusted: str | None = None,
) -> tuple[Verdict, str]:
    """``v2 vs v1: click +3.1 % (95 % CI +1.2 .. +5.0 %), p = 0.002: v2 better``: better when the lift goes the
    metric's way (up, or down for ``lower``), worse when it goes the other. ``adjusted`` names a correction
    whose p-value and interval ``result`` carries (``Holm-adjusted 95 % CI ..., adjusted p = ...``)."""
    level = f"{(1 - query.alpha) * 100:g} %"
    if query.sequential and result.sequential_ci is not None and result.sequential_p_value is not None:
        low, high = result.sequential_ci
        p = result.sequential_p_value
        label = f"always-valid {level} CI"
    else:
        low, high = result.absolute_ci
        p = result.p_value
        label = f"{level} CI"
    if adjusted:
        label = f"{adjusted} {label}"
    relative_ci = result.sequential_relative_ci if query.sequential else result.relative_ci
    if result.relative is not None and relative_ci is not None:
        rel_low, rel_high = relative_ci  # by the delta method, the control's variance included
        effect = f"{spec.name} {result.relative * 100:+.1f} % ({label} {rel_low * 100:+.1f} .. {rel_high * 100:+.1f} %)"
    else:
        effect = f"{spec.name} {result.absolute:+.4g} ({label} {low:+.4g} .. {high:+.4g})"
    head = f"{arm} vs {control}: {effect}, {'adjusted ' if adjusted else ''}{st.p_clause(p)}"
    if p < query.alpha and (low > 0 or high < 0):
        verdict: Verdict = "better" if (result.absolute > 0) == spec.higher_is_better else "worse"
        return verdict, f"{head}: {arm} {verdict}"
    noun = "users" if query.unit == "user" else "calls"
    if more:
        return (
            "inconclusive",
            f"{head}: inconclusive: at this effect size about {more:,} more {noun} in total are needed "
            f"at the current split",
        )
    if result.absolute == 0:
        return "inconclusive", f"{head}: inconclusive: no difference measured"
    return "inconclusive", f"{head}: inconclusive: the interval still includes no change; keep collecting"


def _non_randomized(exposures: Exposures) -> list[NonRandomizedCalls]:
    rows = []
    for phase, assignment, arm, calls, errors in sorted(exposures.other):
        histogram = exposures.latency.get((phase, arm, assignment), Histogram())
        rows.append(
            NonRandomizedCalls(
                phase=phase,
                assignment=assignment or "unspecified",
                arm=arm,
                calls=calls,
                errors=errors,
                error_rate=errors / calls if calls else None,
                latency_p50_ms=histogram.quantile_ms(0.5),
                latency_p99_ms=histogram.quantile_ms(0.99),
            )
        )
    return rows


def _num(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _interval(low: float | None, high: float | None) -> Interval:
    return Interval(low=_num(low), high=_num(high))


# -- CUPED pre-period ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _PreValues:
    """Per unit, over the whole pre-period whatever the phase or arm: calls, and per metric the sum, count and
    positive calls of its events. Units absent from the pre-period get zeros (the covariate's mean does the rest)."""

    keys: pa.Array
    calls: FloatArray
    metrics: dict[str, _MetricMatrix]

    def values(self, spec: MetricSpec, keys: pa.Array, rows: npt.NDArray[np.bool_]) -> st.UnitValues:
        positions = pc.index_in(pc.filter(keys, pa.array(rows)), value_set=self.keys)
        found = pc.is_valid(positions).to_numpy(zero_copy_only=False)
        at = pc.fill_null(positions, 0).to_numpy().astype(np.int64)
        metric = self.metrics[spec.name]

        def per_unit(totals: FloatArray) -> FloatArray:
            # An empty pre-period has no row to read, not even the one a unit it lacks would point at.
            return np.where(found, totals[at], 0.0) if len(totals) else np.zeros(len(at))

        calls = per_unit(self.calls[:, TIMELINE_POINTS - 1] if len(self.calls) else np.zeros(0))
        sums = per_unit(metric.sum_totals)
        if spec.kind is st.MetricKind.SUM:
            return st.UnitValues.of_means(sums)
        if spec.kind is st.MetricKind.MEAN:
            return st.UnitValues(sums, per_unit(metric.count_totals))
        positives = per_unit(metric.positive_totals)
        if spec.kind is st.MetricKind.CONVERSION:
            return st.UnitValues.of_means(positives > 0)
        return st.UnitValues(np.minimum(positives, calls), calls)


async def _load_pre_values(source: Source, query: Query, window: Window) -> _PreValues:
    # No crossover: the pre-period is a covariate per unit (every call of it, however routed), not a comparison.
    archived = sql_archive(source, query)
    if archived is not None:
        loaded = await asyncio.to_thread(
            partial(
                _duckdb_engine().load_archive,
                archived.archive,
                query.model,
                window,
                [m.kind for m in query.metrics],
                [m.name for m in query.metrics],
                per_call=False,
                randomized_only=False,
                exclude_crossover=False,
                prices=query.prices,
                call_samples=False,
            )
        )
    else:
        loaded = await _load_pre_pages(source, query, window)
    exposures = loaded.exposures
    # One pseudo-phase and arm: the unit's rows of every phase and arm are added up.
    units = exposures.units.set_column(0, "phase", pa.array(np.zeros(len(exposures.units), dtype=np.int16)))
    units = units.set_column(1, "arm", pa.array(np.zeros(len(units), dtype=np.int16)))
    matrix = _unit_matrix(units, exposures.bucket_calls, ["all"])
    rows = loaded.folder.metrics()
    metrics = {m.name: _metric_matrix(matrix, row) for m, row in zip(query.metrics, rows, strict=True)}
    return _PreValues(matrix.keys, matrix.calls, metrics)


async def _load_pre_pages(source: Source, query: Query, window: Window) -> Loaded:
    return await load(
        source,
        query.model,
        window,
        [m.kind for m in query.metrics],
        [m.name for m in query.metrics],
        per_call=False,
        page_size=query.page_size,
        randomized_only=False,
        exclude_crossover=False,
        prices=query.prices,
        call_samples=False,  # a covariate per unit: no quantile of it is compared
    )
