"""Feedback folded into per-unit sums as it is read, so memory follows the units, not the events.

The calls of the window are read first (:func:`splitstream.analysis.loading.load_exposures`): a row per
(phase, arm, unit) and, per call, its request fingerprint and row (12 bytes). Each page of de-duplicated
events is then joined and added at once to its metric's matrices, one row per (phase, arm, unit) and one
column per time bucket: the sum of the values, the number of events and (proportions) the positive events.
Nothing of an event is kept but, for a positive event naming a call, the earliest bucket in which that call
had one (a call counts once however many positives name it): one byte per call and proportion metric.

The join (as before the events were folded): an event naming a request id joins that call; an event naming
only a unit joins the row of the phase that unit was last first-exposed in before the event. Units seen in
two arms of one phase (crossover) are left out: their rows get no event (those naming their calls are
counted as crossover), and events naming only the unit join its other phases, if any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from splitstream.analysis.loading import TIMELINE_POINTS, Exposures, Window, mixed
from splitstream.analysis.statistics import MetricKind

FloatArray = npt.NDArray[np.float64]
#: "No positive event yet" in the per-call first-positive bucket.
_NONE = np.int8(TIMELINE_POINTS)


def pair_keys(table: pa.Table) -> npt.NDArray[np.uint64]:
    """One 64-bit key per row's (phase, unit)."""
    phase = table["phase"].to_numpy().astype(np.uint64)
    return mixed(table["unit"].to_numpy(), 0) ^ (phase << np.uint64(48))


def among(table: pa.Table, pairs: pa.Table) -> npt.NDArray[np.bool_]:
    """Whether each row's (phase, unit) is one of ``pairs`` (a sorted-array membership test, no hash join)."""
    if not len(pairs) or not len(table):
        return np.zeros(len(table), dtype=bool)
    return np.isin(pair_keys(table), pair_keys(pairs))


def crossover_units(units: pa.Table) -> pa.Table:
    """(phase, unit) pairs randomized into more than one arm."""
    arms = units.group_by(["phase", "unit"]).aggregate([("arm", "count_distinct")])
    return arms.filter(pc.greater(arms["arm_count_distinct"], 1)).select(["phase", "unit"])


@dataclass(frozen=True, slots=True)
class RowMetric:
    """One metric per row of ``Exposures.units`` and time bucket (not cumulated): sum of values, events, and
    positive events (each call once; proportions only: no rows for the other kinds)."""

    sums: FloatArray
    counts: npt.NDArray[np.float32]
    positives: npt.NDArray[np.float32]


class Folder:
    """Takes pages of events (:class:`splitstream.analysis.loading.FeedbackSink`) for one set of exposures
    (the whole window, a segment, a CUPED pre-period) and adds them to per-row matrices."""

    def __init__(
        self,
        exposures: Exposures,
        kinds: Sequence[MetricKind],
        window: Window,
        *,
        per_call: bool,
        exclude_crossover: bool = True,
    ) -> None:
        self.exposures = exposures
        self.kinds = tuple(kinds)
        self.window = window
        self.per_call = per_call
        units = exposures.units
        self.rows = len(units)
        self.crossover = crossover_units(units if exclude_crossover else units.slice(0, 0))
        self.crossed_row = np.zeros(self.rows, dtype=bool)
        if len(self.crossover):
            self.crossed_row[units["key"].to_numpy()] = among(units, self.crossover)
        self.sums = [np.zeros((self.rows, TIMELINE_POINTS)) for _ in kinds]
        self.counts = [np.zeros((self.rows, TIMELINE_POINTS), dtype=np.float32) for _ in kinds]
        self.positives = [
            np.zeros((self.rows, TIMELINE_POINTS), dtype=np.float32)
            if kind is MetricKind.PROPORTION
            else np.zeros((0, TIMELINE_POINTS), dtype=np.float32)
            for kind in kinds
        ]
        calls = len(exposures.call_requests)
        self.first_positive = [
            np.full(calls if kind is MetricKind.PROPORTION else 0, _NONE, dtype=np.int8) for kind in kinds
        ]
        # Rows an event naming only a unit may join: not crossed, sorted by (unit, first exposure).
        row_keys = units["key"].to_numpy()
        open_rows = row_keys[~self.crossed_row[row_keys]] if len(row_keys) else row_keys
        row_unit = np.zeros(self.rows, dtype=np.uint64)
        row_first = np.zeros(self.rows, dtype=np.int64)
        if len(row_keys):
            row_unit[row_keys] = units["unit"].to_numpy()
            row_first[row_keys] = units["first_ns"].to_numpy()
        order = np.lexsort((row_first[open_rows], row_unit[open_rows]))
        self.unit_rows = open_rows[order]
        self.unit_of_rows = row_unit[self.unit_rows]
        self.first_of_rows = row_first[self.unit_rows]
        self.used = 0
        self.unknown = 0
        self.not_randomized = 0
        self.crossed = 0

    def add(
        self,
        metric: npt.NDArray[np.int8],
        request: npt.NDArray[np.uint64],
        unit: npt.NDArray[np.uint64],
        value: npt.NDArray[np.float64],
        event_ns: npt.NDArray[np.int64],
    ) -> None:
        bucket = self.window.bucket_of(event_ns).astype(np.int64)
        has_request = request != 0
        # By request id: a binary search among the calls' sorted fingerprints.
        by_request = np.flatnonzero(has_request)
        calls = self.exposures.call_requests
        at = np.minimum(np.searchsorted(calls, request[by_request]), max(len(calls) - 1, 0))
        found = calls[at] == request[by_request] if len(calls) else np.zeros(len(by_request), dtype=bool)
        self.unknown += int((~found).sum())
        call = at[found]
        events = by_request[found]
        row = self.exposures.call_rows[call].astype(np.int64)
        randomized = row >= 0
        self.not_randomized += int((~randomized).sum())
        call, events, row = call[randomized], events[randomized], row[randomized]
        crossed = self.crossed_row[row]
        self.crossed += int(crossed.sum())
        call, events, row = call[~crossed], events[~crossed], row[~crossed]
        # By unit: the row of the unit with the latest first exposure at or before the event.
        by_unit = np.flatnonzero(~has_request & (unit != 0))
        self.unknown += int((~has_request & (unit == 0)).sum())
        if self.per_call or not len(self.unit_rows):
            self.unknown += len(by_unit)
            unit_events, unit_row = by_unit[:0], np.zeros(0, dtype=np.int64)
        else:
            unit_events, unit_row = self._unit_rows(by_unit, unit[by_unit], event_ns[by_unit])
            self.unknown += len(by_unit) - len(unit_events)
        self.used += len(events) + len(unit_events)
        for code, kind in enumerate(self.kinds):
            mine = metric[events] == code
            theirs = metric[unit_events] == code
            rows = np.concatenate([row[mine], unit_row[theirs]])
            chosen = np.concatenate([events[mine], unit_events[theirs]])
            cells = rows * TIMELINE_POINTS + bucket[chosen]
            np.add.at(self.sums[code].reshape(-1), cells, value[chosen])
            np.add.at(self.counts[code].reshape(-1), cells, 1)
            if kind is MetricKind.PROPORTION:
                positive = mine & (value[events] > 0)
                np.minimum.at(self.first_positive[code], call[positive], bucket[events[positive]].astype(np.int8))
                positive = theirs & (value[unit_events] > 0)
                cells = unit_row[positive] * TIMELINE_POINTS + bucket[unit_events[positive]]
                np.add.at(self.positives[code].reshape(-1), cells, 1)

    def _unit_rows(
        self, events: npt.NDArray[np.int64], unit: npt.NDArray[np.uint64], event_ns: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The events (of ``events``) that find a row, and the rows: each starts at its unit's last row (by
        first exposure) and steps back past rows first exposed after it (a unit has a row per phase)."""
        row_unit, row_first = self.unit_of_rows, self.first_of_rows
        at = np.searchsorted(row_unit, unit, side="right").astype(np.int64) - 1
        chosen = np.zeros(len(unit), dtype=bool)
        pending = (at >= 0) & (row_unit[np.maximum(at, 0)] == unit)
        while pending.any():
            good = pending & (row_first[np.maximum(at, 0)] <= event_ns)
            chosen |= good
            at = np.where(pending & ~good, at - 1, at)
            pending &= ~good & (at >= 0)
            pending &= row_unit[np.maximum(at, 0)] == unit
        return events[chosen], self.unit_rows[at[chosen]].astype(np.int64)

    def metrics(self) -> list[RowMetric]:
        """The matrices, the calls' first positives added (once each); the per-call state is let go."""
        out = []
        for code, kind in enumerate(self.kinds):
            positives = self.positives[code]
            if kind is MetricKind.PROPORTION:
                first = self.first_positive[code]
                calls = np.flatnonzero(first < _NONE)
                rows = self.exposures.call_rows[calls].astype(np.int64)
                np.add.at(positives.reshape(-1), rows * TIMELINE_POINTS + first[calls].astype(np.int64), 1)
                self.first_positive[code] = first[:0]
            out.append(RowMetric(self.sums[code], self.counts[code], positives))
        return out
