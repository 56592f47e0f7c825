"""A phase's quantile comparisons (:class:`QuantileComparison`), from the calls kept per unit row.

Kept apart from :mod:`splitstream.analysis.analyze` so the per-phase code gains one call: the calls are
matched to the phase's units here (the crossover units, left out of the phase's table, drop out with them)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from splitstream.analysis import quantiles as qt
from splitstream.analysis.loading import LATENCY_GROWTH, CallSamples, bucket_middle_ms
from splitstream.analysis.model import Interval, QuantileComparison
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
) -> list[QuantileComparison]:
    """Every arm against ``control`` at p50, p90 and p99 of latency, and of TTFT where both arms have calls with
    one. ``rows``/``unit_of_row``: the phase's rows of the unit index and the unit (of this phase) of each."""
    if samples is None or control not in arm_names or not len(rows):
        return []
    control_code = list(arm_names).index(control)
    per_arm = {
        "latency": _by_arm(samples.latency, rows, unit_of_row, arm_of_unit),
        "ttft": _by_arm(samples.ttft, rows, unit_of_row, arm_of_unit),
    }
    empty = qt.CallValues.of([], [], [])
    out = []
    for code, name in enumerate(arm_names):
        if code == control_code:
            continue
        for metric, arms in per_arm.items():
            control_calls, arm_calls = arms.get(control_code, empty), arms.get(code, empty)
            if metric == "ttft" and not (control_calls.calls and arm_calls.calls):
                continue  # no streams or HTTP calls with a first token: nothing to compare
            for q in qt.QUANTILES:
                effect = qt.compare(
                    control_calls, arm_calls, q, alpha=alpha, tuning_units=tuning_units, resolution=LATENCY_GROWTH
                )
                out.append(_comparison(metric, q, name, control, control_calls, arm_calls, effect))
    return out


def _by_arm(
    pairs: UnitBucketCounts,
    rows: npt.NDArray[np.int64],
    unit_of_row: npt.NDArray[np.int64],
    arm_of_unit: npt.NDArray[np.int64],
) -> dict[int, qt.CallValues]:
    """The phase's (row, bucket) pairs as each arm's calls: a bucket's middle as the value, weighted by its calls."""
    if not len(pairs.rows):
        return {}
    unit_at = np.full(int(max(rows.max(), pairs.rows.max())) + 1, -1, dtype=np.int64)
    unit_at[rows] = unit_of_row
    unit = unit_at[pairs.rows]
    mine = unit >= 0  # other phases' rows, and crossover units, are no unit of this phase
    unit, values, counts = unit[mine], bucket_middle_ms(pairs.buckets[mine]), pairs.counts[mine]
    arm = arm_of_unit[unit]
    return {
        int(code): qt.CallValues.of(values[arm == code], unit[arm == code], counts[arm == code])
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
        difference=_num(effect.difference),
        difference_ci=_interval(*effect.difference_ci),
        ratio=_num(effect.ratio),
        ratio_ci=_interval(*effect.ratio_ci) if effect.ratio_ci else none,
        p_value=_num(effect.p_value),
        sequential_ratio_ci=_interval(*effect.sequential_ratio_ci) if effect.sequential_ratio_ci else None,
    )


def _num(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _interval(low: float, high: float) -> Interval:
    return Interval(low=_num(low), high=_num(high))
