"""Novelty: the effect by time since each unit's first exposure, to see an effect that fades (or grows).

Users click on what is new; a lift measured over the whole window mixes their first day, when the new version is
a novelty, with the days after. Here each unit's calls and events are also folded by the bucket they fall in
counted from the unit's first randomized call in the phase (``--novelty-bucket``, one day by default: bucket
``d`` holds ``[first + d·width, first + (d+1)·width)``), and each metric is compared per bucket over the units
active in it (a call in that bucket) on their calls and events of that bucket alone. A lift of +30 % in bucket 0
and +1 % from bucket 2 on is a novelty effect; the overall lift overstates what will last.

Per row of the loader's :class:`splitstream.analysis.loading.UnitIndex` and bucket: calls, and per metric the
sum of values, the events and the positive events (``rate``: positive events of the bucket, at most its calls).
A unit's first exposure is its first call read (calls come in stream order, so a call reaching Redis late may
leave a unit's buckets a bucket off). Buckets past :data:`MAX_BUCKETS` are not shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from splitstream.analysis import capping
from splitstream.analysis import statistics as st
from splitstream.analysis.arrays import RowMatrix, selected_row_sums
from splitstream.analysis.loading import NewCalls, UnitIndex, Window
from splitstream.analysis.model import Interval, NoveltyPoint

FloatArray = npt.NDArray[np.float64]
#: The most buckets kept: a month of days (memory: per unit row and metric, 16 bytes a bucket).
MAX_BUCKETS = 31
DEFAULT_BUCKET_NS = 86_400 * 10**9


def bucket_count(window: Window, width_ns: int) -> int:
    """Buckets that may hold anything: from a first exposure at the window's start to the last event counted."""
    reach = window.until_ns - window.since_ns + window.attribution_ns
    return int(min(MAX_BUCKETS, reach // width_ns + 1))


class NoveltyFold:
    """Calls and events per (unit row, bucket since the row's first call), grown with the rows: dense matrices
    as the page reader folds them, or their nonzero cells (:class:`RowCells`) as the DuckDB engine reads them."""

    def __init__(
        self,
        units: UnitIndex,
        kinds: Sequence[st.MetricKind],
        from_calls: Sequence[str | None],
        width_ns: int,
        buckets: int,
    ) -> None:
        self.units = units
        self.kinds = tuple(kinds)
        self.from_calls = tuple(from_calls)
        self.width_ns = width_ns
        self.buckets = buckets
        self.capacity = 0
        self.calls: RowMatrix = np.zeros((0, buckets), dtype=np.float32)
        self.sums: list[RowMatrix] = [np.zeros((0, buckets)) for _ in kinds]
        self.counts: list[RowMatrix] = [np.zeros((0, buckets), dtype=np.float32) for _ in kinds]
        self.positives: list[RowMatrix] = [
            np.zeros((0, buckets) if k.counts_positive_calls else (0, 0), dtype=np.float32) for k in kinds
        ]

    def _grow(self) -> None:
        rows = self.units.size
        if rows <= self.capacity:
            return
        capacity = max(rows, 2 * self.capacity, 1024)

        def grown(old: RowMatrix) -> npt.NDArray[Any]:
            new = np.zeros((capacity, old.shape[1]), dtype=old.dtype)
            new[: len(old)] = _dense(old)
            return new

        self.calls = grown(self.calls)
        self.sums = [grown(m) for m in self.sums]
        self.counts = [grown(m) for m in self.counts]
        self.positives = [grown(m) for m in self.positives]
        self.capacity = capacity

    def _cells(
        self, rows: npt.NDArray[np.int64], times: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
        """Which of these (row, time) fall in a kept bucket, and their flat cell indexes."""
        since = (times - self.units.first_ns[rows]) // self.width_ns
        bucket = np.maximum(since, 0)  # an event dated a little before its call (clock skew): the first bucket
        kept = bucket < self.buckets
        return kept, rows[kept] * self.buckets + bucket[kept]

    def add_calls(self, calls: NewCalls) -> None:
        self._grow()
        randomized = np.flatnonzero(calls.rows >= 0)
        rows = calls.rows[randomized].astype(np.int64)
        kept, cells = self._cells(rows, calls.times[randomized])
        np.add.at(_dense(self.calls).reshape(-1), cells, 1)
        for code, name in enumerate(self.from_calls):
            if name is None:
                continue
            values = calls.values[name][randomized][kept]
            present = ~np.isnan(values)
            np.add.at(_dense(self.sums[code]).reshape(-1), cells[present], values[present])
            np.add.at(_dense(self.counts[code]).reshape(-1), cells[present], 1)

    def add_events(
        self, code: int, rows: npt.NDArray[np.int64], values: FloatArray, times: npt.NDArray[np.int64]
    ) -> None:
        self._grow()
        kept, cells = self._cells(rows.astype(np.int64), times)
        values = values[kept]
        np.add.at(_dense(self.sums[code]).reshape(-1), cells, values)
        np.add.at(_dense(self.counts[code]).reshape(-1), cells, 1)
        if self.kinds[code].counts_positive_calls:
            np.add.at(_dense(self.positives[code]).reshape(-1), cells[values > 0], 1)


def _dense(matrix: RowMatrix) -> npt.NDArray[Any]:
    """The page reader's matrix, which it grows and adds to (the DuckDB engine's cells are read, never added to)."""
    assert isinstance(matrix, np.ndarray)
    return matrix


def novelty_points(
    fold: NoveltyFold,
    code: int,
    *,
    folder_rows: npt.NDArray[np.int64],
    unit_of_row: npt.NDArray[np.int64],
    units: int,
    control_rows: npt.NDArray[np.bool_],
    arm_rows: npt.NDArray[np.bool_],
    cap: float | None,
    alpha: float,
) -> list[NoveltyPoint]:
    """The comparison of one metric per bucket, over the units of the phase (rows of its matrix: ``folder_rows``
    of the fold laid out as ``unit_of_row``) with a call in the bucket."""
    kind = fold.kinds[code]

    def per_unit(matrix: RowMatrix) -> FloatArray:
        if not len(matrix) or not units:
            return np.zeros((units, fold.buckets))
        return selected_row_sums((units, fold.buckets), unit_of_row, matrix, folder_rows)

    fold._grow()
    calls, sums, counts = per_unit(fold.calls), per_unit(fold.sums[code]), per_unit(fold.counts[code])
    positives = per_unit(fold.positives[code]) if kind.counts_positive_calls else counts
    test = "welch" if kind in (st.MetricKind.SUM, st.MetricKind.CONVERSION) else "z"
    points = []
    for bucket in range(fold.buckets):
        active = calls[:, bucket] > 0
        chosen = [rows & active for rows in (control_rows, arm_rows)]
        if min(int(rows.sum()) for rows in chosen) < 2:
            continue
        values = [_values(kind, rows, bucket, calls, sums, counts, positives, cap) for rows in chosen]
        if kind is st.MetricKind.MEAN and not all(v.x.sum() > 0 for v in values):
            continue
        result = st.compare(st.estimate(values[0]), st.estimate(values[1]), alpha=alpha, test=test)
        points.append(
            NoveltyPoint(
                bucket=bucket,
                since_first_s=bucket * fold.width_ns / 1e9,
                units_control=int(chosen[0].sum()),
                units_arm=int(chosen[1].sum()),
                control_value=_num(result.control.value),
                arm_value=_num(result.treatment.value),
                absolute=_num(result.absolute),
                absolute_ci=Interval(low=_num(result.absolute_ci[0]), high=_num(result.absolute_ci[1])),
                relative=_num(result.relative),
                relative_ci=Interval(low=_num(result.relative_ci[0]), high=_num(result.relative_ci[1]))
                if result.relative_ci
                else Interval(low=None, high=None),
                p_value=_num(result.p_value),
            )
        )
    return points


def _values(
    kind: st.MetricKind,
    rows: npt.NDArray[np.bool_],
    bucket: int,
    calls: FloatArray,
    sums: FloatArray,
    counts: FloatArray,
    positives: FloatArray,
    cap: float | None,
) -> st.UnitValues:
    if kind is st.MetricKind.SUM:
        return st.UnitValues.of_means(capping.capped(sums[rows, bucket], cap))
    if kind is st.MetricKind.MEAN:
        return st.UnitValues(capping.capped(sums[rows, bucket], cap), counts[rows, bucket])
    if kind is st.MetricKind.CONVERSION:
        return st.UnitValues.of_means((positives[rows, bucket] > 0).astype(np.float64))
    exposures = calls[rows, bucket]
    return st.UnitValues(np.minimum(positives[rows, bucket], exposures), exposures)


def _num(value: float | None) -> float | None:
    return None if value is None or not np.isfinite(value) else float(value)
