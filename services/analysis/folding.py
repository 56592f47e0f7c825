"""Calls and feedback read side by side, the feedback folded into per-unit sums as it is read, so memory
follows the units, not the calls or events.

:func:`load` reads both streams in stream order at once. Each page of calls is added to a row per (phase,
arm, unit) (:class:`splitstream.analysis.loading.ExposureReader`); each page of de-duplicated events is
joined and added at once to its metric's matrices, one row per (phase, arm, unit) and one column per time
bucket: the sum of the values, the number of events and (proportions) the positive events. The matrices
grow with the rows as calls bring new units.

The join: an event naming a request id joins that call when dated from the clock skew before the call to
its join horizon after it (:meth:`Window.join_horizon_ns`: the attribution window, or the lateness
allowance if longer), and inside the window (up to the attribution window past its end); an event naming
only a unit joins the row that unit was last first-exposed in before the event. Each call is held for the
join (:class:`JoinIndex`: its request fingerprint, row and time, 20 bytes, and per proportion metric the
bucket of its first positive event, a byte) only while an event may still name it:

- a page of events is joined once the calls have been read past its latest event by the lateness allowance
  and clock skew (or to their end), so every call an event may name has been read: every entry reaches
  Redis within the lateness allowance of its time (:meth:`Window.settled_ns`);
- a call is let go once the events read have moved past its join horizon by as much (its first positive,
  if any, is then added to its row's positives): what is held is the calls of about the join horizon and
  twice the lateness allowance, whatever the length of the window.

Units seen in two arms of one phase (crossover) are known only once every call is read: their rows are
left out at the end, and the events they received are counted as crossover (an event naming only a unit
whose last phase before it is crossed is one of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from splitstream.analysis.arrays import RowCells, RowMatrix, head, row_totals
from splitstream.analysis.loading import (
    TIMELINE_POINTS,
    EventPage,
    ExposureReader,
    Exposures,
    Feedback,
    FeedbackReader,
    NewCalls,
    Source,
    UnitIndex,
    Window,
    mixed,
    split_rows,
    take_rows,
)
from splitstream.analysis.novelty import NoveltyFold, bucket_count
from splitstream.analysis.statistics import MetricKind
from splitstream.analysis.usage import Price, is_call_metric

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


def _dense(matrix: RowMatrix) -> npt.NDArray[Any]:
    """A matrix the page reader adds to (its folder's are dense; only the DuckDB engine's are by their cells)."""
    assert not isinstance(matrix, RowCells), "a folder of cells is complete: nothing is added to it"
    return matrix


@dataclass(frozen=True, slots=True)
class RowMetric:
    """One metric per row of ``Exposures.units`` and time bucket (not cumulated): sum of values, events, and
    positive events (each call once; proportions only: no rows for the other kinds)."""

    sums: RowMatrix
    counts: RowMatrix
    positives: RowMatrix


@dataclass(slots=True)
class _Run:
    """Calls of one time slice, sorted by request fingerprint, with their row, time and first positives."""

    keys: npt.NDArray[np.uint64]
    rows: npt.NDArray[np.int32]
    times: npt.NDArray[np.int64]
    first: list[npt.NDArray[np.int8]]

    def take(self, order: npt.NDArray[np.int64]) -> _Run:
        return _Run(
            self.keys[order], self.rows[order], self.times[order], [f[order] if len(f) else f for f in self.first]
        )


def _merged(older: _Run, newer: _Run) -> _Run:
    both = _Run(
        np.concatenate([older.keys, newer.keys]),
        np.concatenate([older.rows, newer.rows]),
        np.concatenate([older.times, newer.times]),
        [np.concatenate([a, b]) for a, b in zip(older.first, newer.first, strict=True)],
    )
    return both.take(np.argsort(both.keys, kind="stable"))


@dataclass(frozen=True, slots=True)
class _Hits:
    """Where a lookup found its requests: per run, the positions among the requests and in the run."""

    parts: list[tuple[_Run, npt.NDArray[np.int64], npt.NDArray[np.int64]]]


@dataclass(slots=True)
class JoinIndex:
    """The calls an event may still name, in generations by call time (a slice of ``slice_ns`` each, sorted
    runs merged like a log-structured tree), let go a generation at a time (:meth:`forget_before`)."""

    slice_ns: int
    proportions: tuple[bool, ...]
    generations: dict[int, list[_Run]] = field(default_factory=dict)
    held: int = 0
    #: The most calls held at once.
    peak: int = 0

    def add(self, calls: NewCalls) -> None:
        slices = calls.times // self.slice_ns
        for at in np.unique(slices).tolist():
            mine = np.flatnonzero(slices == at)
            run = _Run(
                calls.requests[mine],
                calls.rows[mine],
                calls.times[mine],
                [np.full(len(mine) if p else 0, _NONE, dtype=np.int8) for p in self.proportions],
            )
            runs = self.generations.setdefault(at, [])
            runs.append(run.take(np.argsort(run.keys, kind="stable")))
            while len(runs) > 1 and len(runs[-2].keys) <= 2 * len(runs[-1].keys):
                newer = runs.pop()
                runs[-1] = _merged(runs[-1], newer)
        self.held += len(calls.requests)
        self.peak = max(self.peak, self.held)

    def lookup(
        self, requests: npt.NDArray[np.uint64]
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64], npt.NDArray[np.int64], _Hits]:
        """Per request: found, the call's row and time, and where (for :meth:`note_positive`)."""
        found = np.zeros(len(requests), dtype=bool)
        rows = np.full(len(requests), -1, dtype=np.int64)
        times = np.zeros(len(requests), dtype=np.int64)
        parts = []
        for runs in self.generations.values():
            for run in runs:
                if not len(run.keys) or found.all():
                    continue
                pending = np.flatnonzero(~found)
                at = np.minimum(np.searchsorted(run.keys, requests[pending]), len(run.keys) - 1)
                hit = run.keys[at] == requests[pending]
                events, at = pending[hit], at[hit]
                found[events] = True
                rows[events] = run.rows[at]
                times[events] = run.times[at]
                parts.append((run, events, at.astype(np.int64)))
        return found, rows, times, _Hits(parts)

    @staticmethod
    def note_positive(code: int, hits: _Hits, positive: npt.NDArray[np.bool_], bucket: npt.NDArray[np.int64]) -> None:
        """Lower the first-positive bucket of the calls that ``positive`` events (among the looked-up) name."""
        for run, events, at in hits.parts:
            chosen = positive[events]
            np.minimum.at(run.first[code], at[chosen], bucket[events[chosen]].astype(np.int8))

    def forget_before(self, horizon_ns: int) -> list[_Run]:
        """Let go of the generations whose calls are all older than ``horizon_ns``; returns their runs."""
        gone = [at for at in self.generations if (at + 1) * self.slice_ns <= horizon_ns]
        return self._drop(gone)

    def drain(self) -> list[_Run]:
        return self._drop(list(self.generations))

    def _drop(self, slices: list[int]) -> list[_Run]:
        runs = [run for at in slices for run in self.generations.pop(at)]
        self.held -= sum(len(run.keys) for run in runs)
        return runs


class Folder:
    """Takes pages of events for one set of exposures (the whole window, a segment, a CUPED pre-period), read
    while its calls are (:func:`load`), and adds them to per-row matrices that grow with the rows."""

    def __init__(
        self,
        units: UnitIndex,
        kinds: Sequence[MetricKind],
        window: Window,
        *,
        per_call: bool,
        exclude_crossover: bool = True,
        unknown: int = 0,
        joining: bool = True,
        from_calls: Sequence[str | None] = (),
    ) -> None:
        self.units = units
        self.kinds = tuple(kinds)
        #: Per metric, the name of the call value it is measured on (a metric of the calls: ``ttft_ms``,
        #: ``cost``, ...), or None for a feedback metric.
        self.from_calls = tuple(from_calls) or (None,) * len(self.kinds)
        self.window = window
        self.per_call = per_call
        self.exclude_crossover = exclude_crossover
        self.joining = joining
        self.rows = 0
        self.capacity = 0
        # Dense while the pages are folded in; the DuckDB engine's folder holds its rows by their cells.
        self.sums: list[RowMatrix] = [np.zeros((0, TIMELINE_POINTS)) for _ in kinds]
        self.counts: list[RowMatrix] = [np.zeros((0, TIMELINE_POINTS), dtype=np.float32) for _ in kinds]
        self.positives: list[RowMatrix] = [np.zeros((0, TIMELINE_POINTS), dtype=np.float32) for _ in kinds]
        proportions = tuple(kind.counts_positive_calls for kind in kinds)
        span = window.join_horizon_ns() + window.settled_ns()
        self.index = JoinIndex(max(span // 8, 10**9), proportions)
        self.crossover = pa.table({"phase": pa.array([], pa.int16()), "unit": pa.array([], pa.uint64())})
        self.used = 0
        #: Events a set made after some events were read could not have joined (:class:`FeedbackReader`.sent).
        self.unknown = unknown
        self.not_randomized = 0
        self.crossed = 0
        #: The same calls and events by time since each unit's first exposure (:mod:`splitstream.analysis.novelty`).
        self.novelty: NoveltyFold | None = None

    def add_calls(self, calls: NewCalls | None) -> None:
        """Hold a page's calls for the events that may name them (none once the feedback is read), and add
        their own values of the metrics of the calls to their rows."""
        if calls is None:
            return
        if self.joining:
            self.index.add(calls)
        self._add_call_values(calls)
        if self.novelty is not None:
            self.novelty.add_calls(calls)

    def _add_call_values(self, calls: NewCalls) -> None:
        """A metric of the calls is folded as if each call with a value were an event of it at the call's
        time: its row's sum gains the value and its count one, so ``mean`` is per call and ``sum`` per unit."""
        if not any(self.from_calls):
            return
        self._grow()
        bucket = self.window.bucket_of(calls.times).astype(np.int64)
        for code, name in enumerate(self.from_calls):
            if name is None:
                continue
            values = calls.values[name]
            chosen = np.flatnonzero((calls.rows >= 0) & ~np.isnan(values))
            cells = calls.rows[chosen].astype(np.int64) * TIMELINE_POINTS + bucket[chosen]
            np.add.at(_dense(self.sums[code]).reshape(-1), cells, values[chosen])
            np.add.at(_dense(self.counts[code]).reshape(-1), cells, 1)

    def _grow(self) -> None:
        """As many rows as the units have (new units came with the calls read), the capacity doubled."""
        self.rows = self.units.size
        if self.rows <= self.capacity:
            return
        self.capacity = max(self.rows, 2 * self.capacity, 1024)
        for code, kind in enumerate(self.kinds):
            for matrices in (self.sums, self.counts, self.positives):
                if matrices is self.positives and not kind.counts_positive_calls:
                    continue
                grown = np.zeros((self.capacity, TIMELINE_POINTS), dtype=matrices[code].dtype)
                grown[: len(matrices[code])] = _dense(matrices[code])
                matrices[code] = grown

    def add(
        self,
        metric: npt.NDArray[np.int8],
        request: npt.NDArray[np.uint64],
        unit: npt.NDArray[np.uint64],
        value: npt.NDArray[np.float64],
        event_ns: npt.NDArray[np.int64],
    ) -> None:
        self._grow()
        bucket = self.window.bucket_of(event_ns).astype(np.int64)
        has_request = request != 0
        # By request id: among the calls held, dated from the clock skew before the event to its horizon.
        by_request = np.flatnonzero(has_request)
        found, row, call_ns, hits = self.index.lookup(request[by_request])
        dated = event_ns[by_request]
        found &= (dated >= call_ns - self.window.clock_skew_ns) & (dated < call_ns + self.window.join_horizon_ns())
        self.unknown += int((~found).sum())
        randomized = found & (row >= 0)
        self.not_randomized += int((found & (row < 0)).sum())
        events, row = by_request[randomized], row[randomized]
        # By unit: the row of the unit with the latest first exposure at or before the event.
        by_unit = np.flatnonzero(~has_request & (unit != 0))
        self.unknown += int((~has_request & (unit == 0)).sum())
        if self.per_call or not self.rows:
            self.unknown += len(by_unit)
            unit_events, unit_row = by_unit[:0], np.zeros(0, dtype=np.int64)
        else:
            joined, rows_found = self.units.unit_rows_at(unit[by_unit], event_ns[by_unit])
            unit_events, unit_row = by_unit[joined], rows_found[joined]
            self.unknown += len(by_unit) - len(unit_events)
        self.used += len(events) + len(unit_events)
        for code, kind in enumerate(self.kinds):
            mine = metric[events] == code
            theirs = metric[unit_events] == code
            rows = np.concatenate([row[mine], unit_row[theirs]])
            chosen = np.concatenate([events[mine], unit_events[theirs]])
            cells = rows * TIMELINE_POINTS + bucket[chosen]
            np.add.at(_dense(self.sums[code]).reshape(-1), cells, value[chosen])
            np.add.at(_dense(self.counts[code]).reshape(-1), cells, 1)
            if self.novelty is not None:
                self.novelty.add_events(code, rows, value[chosen], event_ns[chosen])
            if kind.counts_positive_calls:
                # A call counts once, in the bucket of its first positive event: noted on the call while held.
                positive = randomized & (metric[by_request] == code) & (value[by_request] > 0)
                self.index.note_positive(code, hits, positive, bucket[by_request])
                positive = theirs & (value[unit_events] > 0)
                cells = unit_row[positive] * TIMELINE_POINTS + bucket[unit_events[positive]]
                np.add.at(_dense(self.positives[code]).reshape(-1), cells, 1)

    def forget_before(self, horizon_ns: int) -> None:
        """Let go of the calls older than ``horizon_ns`` (no event to come may name them)."""
        self._fold(self.index.forget_before(horizon_ns))

    def stop_joining(self) -> None:
        """No more events: the calls held are let go, and the calls still to come are not held."""
        self.joining = False
        self._fold(self.index.drain())

    def _fold(self, runs: list[_Run]) -> None:
        """Add the first positives of calls let go to their rows."""
        self._grow()
        for code, kind in enumerate(self.kinds):
            if not kind.counts_positive_calls:
                continue
            for run in runs:
                first = run.first[code]
                calls = np.flatnonzero(first < _NONE)
                rows = run.rows[calls].astype(np.int64)
                np.add.at(
                    _dense(self.positives[code]).reshape(-1), rows * TIMELINE_POINTS + first[calls].astype(np.int64), 1
                )

    def finish(self, units: pa.Table) -> None:
        """Every call read: leave out the crossover units' rows, their events counted as crossover."""
        self.stop_joining()
        self._grow()
        if not self.exclude_crossover or not len(units):
            return
        self.crossover = crossover_units(units)
        if not len(self.crossover):
            return
        crossed = np.zeros(self.rows, dtype=bool)
        crossed[units["key"].to_numpy()] = among(units, self.crossover)
        events = sum(
            int(row_totals(head(counts, self.rows))[crossed].sum())
            for counts, name in zip(self.counts, self.from_calls, strict=True)
            if name is None  # the values of the calls are no events
        )
        self.crossed += events
        self.used -= events

    def metrics(self) -> list[RowMetric]:
        """The matrices, as many rows as there are (the calls' first positives added at :meth:`finish`)."""
        n = self.rows
        return [
            RowMetric(
                head(self.sums[code], n),
                head(self.counts[code], n),
                head(self.positives[code], n if kind.counts_positive_calls else 0),
            )
            for code, kind in enumerate(self.kinds)
        ]


@dataclass(slots=True)
class Loaded:
    """What :func:`load` read: the exposures (with their segments), the feedback's counts, the folders."""

    exposures: Exposures
    feedback: Feedback
    folder: Folder
    segments: dict[str, Folder]


async def load(
    source: Source,
    model: str,
    window: Window,
    kinds: Sequence[MetricKind],
    metrics: Sequence[str],
    *,
    per_call: bool,
    page_size: int = 5_000,
    randomized_only: bool = True,
    exclude_crossover: bool = True,
    segment: str | None = None,
    prices: dict[str, Price] | None = None,
    novelty_ns: int | None = None,
    call_samples: bool = True,
) -> Loaded:
    """The calls of ``model`` received in the window and its feedback, read side by side in stream order.

    ``per_call``: every call is its own unit (else the routing-key HMAC, and the call for calls without a key).
    ``randomized_only=False``: every call counts in the units (a CUPED pre-period, where the covariate is what
    a unit did, however it was routed), and ``exclude_crossover=False`` keeps units seen in two arms.
    ``segment``: a readable call field; the exposures' ``segments`` hold the same per value of it, and
    ``Loaded.segments`` their folders. Metrics of the calls (:data:`splitstream.analysis.usage.CALL_METRICS`)
    are measured on the calls, a call's cost by ``prices`` (per version). ``novelty_ns``: also fold by time since
    each unit's first exposure, in buckets this wide (:mod:`splitstream.analysis.novelty`). ``call_samples``:
    keep each unit's calls per latency bucket, for the quantile comparisons."""
    events = FeedbackReader(window, metrics)
    from_calls = [name if is_call_metric(name) else None for name in metrics]

    def joined(reader: ExposureReader) -> Folder:
        return Folder(
            reader.units,
            kinds,
            window,
            per_call=per_call,
            exclude_crossover=exclude_crossover,
            unknown=events.sent,
            joining=reading_feedback,
            from_calls=from_calls,
        )

    reading_feedback = True
    overall = ExposureReader(
        window, per_call=per_call, randomized_only=randomized_only, prices=prices, call_samples=call_samples
    )
    overall_folder = joined(overall)
    if novelty_ns:  # the whole window's units only (not a segment's, nor a CUPED pre-period's)
        buckets = bucket_count(window, novelty_ns)
        overall_folder.novelty = NoveltyFold(overall.units, kinds, from_calls, novelty_ns, buckets)
    parts: dict[bytes, tuple[ExposureReader, Folder]] = {}
    field_name = segment.encode() if segment else None
    calls = aiter(source.call_pages(model, window, page_size))

    async def read_calls() -> bool:
        """One page of calls into every reader; False once there are none left."""
        try:
            page = await anext(calls)
        except StopAsyncIteration:
            return False
        needed, new = overall.add_columns(page.columns)
        overall_folder.add_calls(new)
        for phase, row in needed.items():
            overall.note_record(phase, await page.record(row))
        if field_name is None:
            return True
        for value, rows in split_rows(page.columns[field_name]).items():
            if value not in parts:
                reader = ExposureReader(
                    window, per_call=per_call, randomized_only=randomized_only, prices=prices, call_samples=call_samples
                )
                parts[value] = reader, joined(reader)
            part, folder = parts[value]
            columns = page.columns if len(rows) == len(page.columns[field_name]) else take_rows(page.columns, rows)
            needed, new = part.add_columns(columns)
            folder.add_calls(new)
            for phase, row in needed.items():
                info = overall.phase_info.get(phase)
                if info is not None:
                    part.phase_info[phase] = info
                else:
                    part.note_record(phase, await page.record(rows[row]))
        return True

    settled = window.settled_ns()
    calls_left = True
    try:
        async for found in source.feedback_pages(model, window.feedback_reach(), page_size):
            page: EventPage | None = events.add_page(found)
            if page is None:
                continue
            folders = (overall_folder, *(f for _, f in parts.values()))
            # Events from this page on are dated after the events' cursor less the lateness allowance: calls
            # older than that by more than the join horizon cannot be named any more.
            horizon = events.cursor_ns - window.join_horizon_ns() - settled
            for folder in folders:
                folder.forget_before(horizon)
            # Every call an event of the page may name has been read once the calls' cursor is past its
            # latest event by the lateness allowance and skew (later calls are dated after the events).
            latest = int(page[4].max()) + settled + window.clock_skew_ns
            while calls_left and overall.cursor_ns <= latest:
                calls_left = await read_calls()
            for folder in (overall_folder, *(f for _, f in parts.values())):
                folder.add(*page)
            events.sent += len(page[0])
        reading_feedback = False
        for folder in (overall_folder, *(f for _, f in parts.values())):
            folder.stop_joining()
        while calls_left:
            calls_left = await read_calls()
    finally:
        close = getattr(calls, "aclose", None)
        if close is not None:
            await close()
    exposures = overall.result()
    overall_folder.finish(exposures.units)
    segment_folders: dict[str, Folder] = {}
    for value, (part, folder) in sorted(parts.items()):
        result = part.result()
        folder.finish(result.units)
        name = value.decode(errors="replace")
        exposures.segments[name] = result
        segment_folders[name] = folder
    return Loaded(exposures, events.result, overall_folder, segment_folders)
