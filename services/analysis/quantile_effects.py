"""A phase's quantile comparisons (:class:`QuantileComparison`), from the calls kept per unit row, their timeline,
and their part in a ``--correction``'s family.

Kept apart from :mod:`splitstream.analysis.analyze` so the per-phase code gains one call: the calls are
matched to the phase's units here (the crossover units, left out of the phase's table, drop out with them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy

from splitstream.analysis import quantiles as qt
from splitstream.analysis import statistics as st
from splitstream.analysis.loading import LATENCY_GROWTH, TIMELINE_POINTS, CallSamples, bucket_middle_ms
from splitstream.analysis.model import Correction, Interval, QuantileComparison, QuantileTimelinePoint
from splitstream.analysis.unit_buckets import UnitBucketCounts


def phase_quantiles(
    samples: CallSamples | None,
    *,
    rows: npt.NDArray[np.int64],
    unit_of_row: npt.NDArray[np.int64],
    arm_of_unit: npt.NDArray[np.int64],
    arm_names: Sequence[str],
    control: str,
    alpha: float,
    tuning_units: int,
    bucket_end_ns: Callable[[int], int] | None = None,
) -> list[QuantileComparison]:
    """Every arm against ``control`` at p50, p90 and p99 of latency, and of TTFT where both arms have calls with
    one. ``rows``/``unit_of_row``: the phase's rows of the unit index and the unit (of this phase) of each.
    ``bucket_end_ns``: the end of each time bucket of the window, for the timeline (None: no timeline, for a
    reader that looks only at the comparison as it stands, such as a rollout guard)."""
    if samples is None or control not in arm_names or not len(rows):
        return []
    control_code = list(arm_names).index(control)
    per_arm = {
        "latency": _by_arm(samples.latency, rows, unit_of_row, arm_of_unit),
        "ttft": _by_arm(samples.ttft, rows, unit_of_row, arm_of_unit),
    }
    empty = _ArmCalls(qt.CallValues.of([], [], []), np.zeros(0, np.int64))
    out = []
    for code, name in enumerate(arm_names):
        if code == control_code:
            continue
        for metric, arms in per_arm.items():
            control_calls, arm_calls = arms.get(control_code, empty), arms.get(code, empty)
            if metric == "ttft" and not (control_calls.calls.calls and arm_calls.calls.calls):
                continue  # no streams or HTTP calls with a first token: nothing to compare
            timelines = (
                _timelines(control_calls, arm_calls, alpha, tuning_units, bucket_end_ns)
                if bucket_end_ns is not None
                else {}
            )
            for q in qt.QUANTILES:
                effect = qt.compare(
                    control_calls.calls,
                    arm_calls.calls,
                    q,
                    alpha=alpha,
                    tuning_units=tuning_units,
                    resolution=LATENCY_GROWTH,
                )
                comparison = _comparison(metric, q, name, control, control_calls.calls, arm_calls.calls, effect)
                if bucket_end_ns is not None:
                    comparison = comparison.model_copy(update={"timeline": timelines[q]})
                if effect is not None and effect.log_ratio_variance is not None:
                    difference_se = math.sqrt(effect.control.std_error**2 + effect.treatment.std_error**2)
                    units = effect.control.units + effect.treatment.units
                    comparison._basis = (math.sqrt(effect.log_ratio_variance), difference_se, units)
                out.append(comparison)
    return out


@dataclass(frozen=True, slots=True)
class _ArmCalls:
    """An arm's calls, and the time bucket of each (row, bucket) pair's calls."""

    calls: qt.CallValues
    periods: npt.NDArray[np.int64]

    def until(self, period: int) -> qt.CallValues:
        """The calls of the time buckets up to ``period`` (units renumbered among those with a call by then)."""
        kept = self.periods <= period
        counts = self.calls.counts
        return qt.CallValues.of(
            self.calls.values[kept], self.calls.units[kept], None if counts is None else counts[kept]
        )


def _timelines(
    control: _ArmCalls,
    arm: _ArmCalls,
    alpha: float,
    tuning_units: int,
    bucket_end_ns: Callable[[int], int],
) -> dict[float, list[QuantileTimelinePoint]]:
    """Per quantile, the comparison on the calls up to the end of each time bucket, as the metrics' timeline has
    it. A bucket's calls so far are taken once for the three quantiles, one bucket at a time (not all held)."""
    points: dict[float, list[QuantileTimelinePoint]] = {q: [] for q in qt.QUANTILES}
    for period in range(TIMELINE_POINTS):
        control_calls, arm_calls = control.until(period), arm.until(period)
        if control_calls.unit_count < 2 or arm_calls.unit_count < 2:
            continue
        for q in qt.QUANTILES:
            effect = qt.compare(
                control_calls, arm_calls, q, alpha=alpha, tuning_units=tuning_units, resolution=LATENCY_GROWTH
            )
            if effect is None:
                continue
            points[q].append(
                QuantileTimelinePoint(
                    until_ns=bucket_end_ns(period),
                    units_control=control_calls.unit_count,
                    units_arm=arm_calls.unit_count,
                    **_effect_fields(effect),
                )
            )
    return points


def _by_arm(
    pairs: UnitBucketCounts,
    rows: npt.NDArray[np.int64],
    unit_of_row: npt.NDArray[np.int64],
    arm_of_unit: npt.NDArray[np.int64],
) -> dict[int, _ArmCalls]:
    """The phase's (row, bucket) pairs as each arm's calls: a bucket's middle as the value, weighted by its calls."""
    if not len(pairs.rows):
        return {}
    unit_at = np.full(int(max(rows.max(), pairs.rows.max())) + 1, -1, dtype=np.int64)
    unit_at[rows] = unit_of_row
    unit = unit_at[pairs.rows]
    mine = unit >= 0  # other phases' rows, and crossover units, are no unit of this phase
    unit, values, counts = unit[mine], bucket_middle_ms(pairs.buckets[mine]), pairs.counts[mine]
    periods = pairs.periods[mine]
    # In order of value, once: every quantile and time bucket then sorts calls already sorted.
    order = np.argsort(values, kind="stable")
    unit, values, counts, periods = unit[order], values[order], counts[order], periods[order]
    arm = arm_of_unit[unit]
    return {
        int(code): _ArmCalls(
            qt.CallValues.of(values[arm == code], unit[arm == code], counts[arm == code]), periods[arm == code]
        )
        for code in np.unique(arm)
    }


def _comparison(
    metric: str,
    q: float,
    arm: str,
    control: str,
    control_calls: qt.CallValues,
    arm_calls: qt.CallValues,
    effect: qt.QuantileEffect | None,
) -> QuantileComparison:
    none = Interval(low=None, high=None)
    base = {
        "metric": metric,
        "name": qt.quantile_name(q),
        "quantile": q,
        "arm": arm,
        "control": control,
        "control_calls": control_calls.calls,
        "arm_calls": arm_calls.calls,
        "control_units": control_calls.unit_count,
        "arm_units": arm_calls.unit_count,
        "method": qt.METHOD,
    }
    if effect is None:
        return QuantileComparison(
            **base,
            control_value=None,
            control_ci=none,
            arm_value=None,
            arm_ci=none,
            difference=None,
            difference_ci=none,
            ratio=None,
            ratio_ci=none,
            p_value=None,
        )
    c, t = effect.control, effect.treatment
    return QuantileComparison(
        **base,
        control_value=_num(c.value),
        control_ci=_interval(c.low, c.high),
        arm_value=_num(t.value),
        arm_ci=_interval(t.low, t.high),
        **_effect_fields(effect),
    )


def _effect_fields(effect: qt.QuantileEffect) -> dict[str, Any]:
    """What a comparison and a point of its timeline both say of an effect: difference, ratio, p-value."""
    return {
        "difference": _num(effect.difference),
        "difference_ci": _interval(*effect.difference_ci),
        "ratio": _num(effect.ratio),
        "ratio_ci": _interval(*effect.ratio_ci) if effect.ratio_ci else Interval(low=None, high=None),
        "p_value": _num(effect.p_value),
        "sequential_ratio_ci": _interval(*effect.sequential_ratio_ci) if effect.sequential_ratio_ci else None,
    }


def _num(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _interval(low: float, high: float) -> Interval:
    return Interval(low=_num(low), high=_num(high))


# -- multiple comparisons ------------------------------------------------------------------


def family_p_value(q: QuantileComparison, *, sequential: bool, alpha: float, tuning_units: int) -> float | None:
    """The p-value of ``ratio = 1`` that enters a correction's family: the fixed-horizon one, or with
    ``--sequential`` the mSPRT p-value of the log-ratio on its delta-method variance (as the metrics' verdicts
    read the always-valid one). None without an estimate (no interval: too few calls past the quantile)."""
    if q._basis is None or q.ratio is None or q.ratio <= 0:
        return None
    if not sequential:
        return q.p_value
    se_log, _, units = q._basis
    variance = se_log * se_log
    if not variance > 0:
        return None
    tau2 = float(st.mixing_variance(variance, units, alpha=alpha, tuning_units=tuning_units))
    return float(st.msprt_p_value(math.log(q.ratio), variance, tau2))


def adjusted(
    q: QuantileComparison, p: float, level: float, *, correction: Correction, sequential: bool, tuning_units: int
) -> QuantileComparison:
    """The comparison with its adjusted p-value and its intervals at the correction's ``level``: the ratio's
    ``exp(log r ± z₁₋level/2 · se)`` and the difference's ``d ± z · se`` (with ``--sequential``, the ratio's
    confidence sequence at ``level``; the difference has no sequence and gets none)."""
    assert q._basis is not None  # the family holds only comparisons with an estimate
    assert q.ratio is not None
    se_log, se_difference, units = q._basis
    log_ratio = math.log(q.ratio)
    difference_ci = None
    if sequential:
        variance = se_log * se_log
        tau2 = float(st.mixing_variance(variance, units, alpha=level, tuning_units=tuning_units))
        half = st.confidence_sequence_half_width(variance, tau2, alpha=level)
    else:
        z = float(scipy.stats.norm.ppf(1 - level / 2))
        half = z * se_log
        if q.difference is not None:
            difference_ci = _interval(q.difference - z * se_difference, q.difference + z * se_difference)
    ratio_ci = _interval(math.exp(log_ratio - half), math.exp(log_ratio + half)) if math.isfinite(half) else None
    return q.model_copy(
        update={
            "correction": correction,
            "adjusted_p_value": _num(p),
            "adjusted_ratio_ci": ratio_ci,
            "adjusted_difference_ci": difference_ci,
        }
    )
