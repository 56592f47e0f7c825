"""Reading exposures (call records) and outcomes (feedback events) out of Redis into per-unit aggregates.

The streams are read in pages (XRANGE ... COUNT); each page becomes a handful of Arrow columns (only the
readable fields the analysis needs: the serialized record is decoded once per experiment phase, for its
weights) and is reduced at once with Arrow group-bys to one row per (phase, arm, unit, time bucket). The
per-page partial aggregates are merged again whenever they grow, so what stays in memory grows with the
number of units, not of calls. Two things grow with the data instead, and are kept as small as they can be:

- an 8-byte fingerprint per call, to drop calls the recorder stored twice (delivery is at least once);
- the feedback events themselves (they are de-duplicated by idempotency key, which needs them all) and,
  for the request ids those events name, the call's phase, arm and unit to join them on.

Feedback is read first, so only the calls some event names are kept for the join.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from redis.asyncio import Redis

from splitstream.common.records import CorruptEntry, UnsupportedSchema, decode_record, feedback_key, stream_key

#: Assignments that were randomized (the split on the routing key, or a random draw without one): the only
#: calls an A/B comparison may use. Pins, spills, retries and records older than the field are shown apart.
RANDOMIZED = (b"hash", b"random")
#: Time buckets the window is cut into, for the lift-over-time chart (the analysis is repeated at each end).
TIMELINE_POINTS = 20
#: Latency histogram: buckets 2 % wide from 1 µs (quantiles within ~1 % of the exact value), like the replayer's.
LATENCY_FLOOR_MS = 1e-3
LATENCY_GROWTH = 1.02
LATENCY_BUCKETS = 1 + int(math.log(3_600_000 / LATENCY_FLOOR_MS) / math.log(LATENCY_GROWTH))
#: Merge the per-page partial aggregates once they hold this many rows more than after the last merge.
_COMPACT_ROWS = 200_000
#: The fields of a feedback entry the analysis reads.
FEEDBACK_FIELDS = (b"metric", b"request_id", b"unit", b"value", b"event_ns", b"idempotency_key")
#: The readable fields of a call entry the analysis reads (the record only once per phase).
CALL_FIELDS = (b"request_id", b"time_ns", b"status", b"latency_ms", b"arm", b"assignment", b"phase", b"unit")
#: Prefix of the unit of a call without a routing key (its own unit): kept apart from HMACs (hex digits).
CALL_UNIT_PREFIX = b"call:"


@dataclass(frozen=True, slots=True)
class Window:
    """``[since_ns, until_ns)`` by the router's receive time (calls) and by event time (feedback)."""

    since_ns: int
    until_ns: int
    #: How long after ``until_ns`` a call's record or an event may reach Redis (spooled through an outage).
    max_lateness_ns: int = 3_600 * 10**9
    #: How far the routers' clocks may be ahead of Redis's (entry ids are Redis's clock).
    clock_skew_ns: int = 5 * 10**9

    def bucket_of(self, times_ns: npt.NDArray[np.int64]) -> npt.NDArray[np.int16]:
        span = max(self.until_ns - self.since_ns, 1)
        buckets = (times_ns - self.since_ns) * TIMELINE_POINTS // span
        return np.clip(buckets, 0, TIMELINE_POINTS - 1).astype(np.int16)

    def bucket_end_ns(self, bucket: int) -> int:
        return self.since_ns + (self.until_ns - self.since_ns) * (bucket + 1) // TIMELINE_POINTS


@dataclass(frozen=True, slots=True)
class PhaseInfo:
    """An experiment phase, read from one of its records: weights in percent (arms at 0 included), control."""

    id: str
    weights: dict[str, float]
    control: str


@dataclass(slots=True)
class Histogram:
    counts: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(LATENCY_BUCKETS, dtype=np.int64))
    calls: int = 0
    errors: int = 0

    def quantile_ms(self, q: float) -> float | None:
        if not self.calls:
            return None
        cumulative = np.cumsum(self.counts)
        bucket = int(np.searchsorted(cumulative, q * cumulative[-1]))
        return float(LATENCY_FLOOR_MS * LATENCY_GROWTH ** (bucket + 0.5))  # the bucket's geometric middle

    def cdf_points(self) -> list[tuple[float, float]]:
        """(upper bound ms, cumulative fraction) per non-empty bucket: what the report draws."""
        cumulative = np.cumsum(self.counts)
        total = cumulative[-1] if len(cumulative) else 0
        if not total:
            return []
        return [(bucket_upper_ms(int(b)), float(cumulative[b] / total)) for b in np.flatnonzero(self.counts)]


def bucket_upper_ms(bucket: int) -> float:
    """Bucket ``b`` holds latencies in ``[floor·g^b, floor·g^(b+1))``."""
    return float(LATENCY_FLOOR_MS * LATENCY_GROWTH ** (bucket + 1))


@dataclass(slots=True)
class Exposures:
    """The calls of a window, reduced.

    ``units``: one row per (phase, arm, unit, bucket) of randomized calls, columns ``phase``, ``arm``, ``unit``
    (binary), ``bucket`` (int16), ``calls`` (int64), ``first_ns`` (int64). ``other``: calls not randomized, per
    (phase, assignment, arm): ``calls``, ``errors``. ``latency``: histograms per (phase, arm, assignment class;
    ``randomized`` or the assignment's name). ``call_keys``: for the request ids feedback names, the call's
    ``request_id``, ``phase``, ``arm``, ``unit``, ``randomized``."""

    units: pa.Table
    other: pa.Table
    latency: dict[tuple[str, str, str], Histogram]
    phases: dict[str, PhaseInfo]
    call_keys: pa.Table
    entries_read: int = 0
    calls: int = 0
    duplicates: int = 0
    corrupt: int = 0


@dataclass(slots=True)
class Feedback:
    """The feedback events of a window for the metrics asked for, de-duplicated: columns ``metric`` (string),
    ``request_id``, ``unit`` (binary), ``value`` (float64), ``event_ns`` (int64)."""

    events: pa.Table
    entries_read: int = 0
    duplicates: int = 0
    corrupt: int = 0
    other_metrics: int = 0
    outside_window: int = 0


#: One stream entry as Redis sends it: its id and its fields as a flat list ``[name, value, name, value, ...]``.
RawPage = list[tuple[bytes, list[bytes]]]


def _unparsed(redis: Redis) -> Redis:
    """A client on ``redis``'s connection pool whose XRANGE replies are left as Redis sent them.

    redis-py turns each entry's fields into a dict (``pairs_to_dict``): measured at 3-5 µs an entry, more than
    all the analysis does with it. The columns are taken from the flat lists instead (:func:`page_columns`)."""
    client = Redis(connection_pool=redis.connection_pool)
    client.set_response_callback("XRANGE", _as_sent)
    return client


def _as_sent(response: object, **options: object) -> object:
    return response


async def read_pages(redis: Redis, key: str, *, start: str, end: str, page_size: int) -> AsyncIterator[RawPage]:
    """XRANGE ``key`` from ``start`` to ``end`` in pages of ``page_size`` entries, as Redis sent them."""
    client = _unparsed(redis)
    lower = start
    while True:
        page = cast(RawPage, await client.xrange(key, min=lower, max=end, count=page_size))
        if page:
            yield page
        if len(page) < page_size:
            return
        lower = "(" + bytes(page[-1][0]).decode()


def page_columns(page: RawPage, names: Sequence[bytes]) -> dict[bytes, list[bytes]]:
    """The values of ``names`` in every entry of the page, as lists (``b""`` where an entry lacks one).

    Entries written by one recorder version share one layout, so each field is taken by its position in
    the first entry, and the page is checked to hold that field's name at that position in every entry (a
    C-speed ``list.count``); a page of mixed layouts (a recorder upgrade, a hand-written entry) falls back
    to a dict per entry."""
    first = page[0][1]
    positions = {first[i]: i + 1 for i in range(0, len(first) - 1, 2)}
    out: dict[bytes, list[bytes]] = {}
    try:
        for name in names:
            at = positions.get(name)
            if at is None:
                raise LookupError(name)
            found = [fields[at - 1] for _, fields in page]
            if found.count(name) != len(found):
                raise LookupError(name)
            out[name] = [fields[at] for _, fields in page]
        return out
    except (LookupError, IndexError):
        entries = [dict(zip(fields[0::2], fields[1::2], strict=False)) for _, fields in page]
        return {name: [entry.get(name, b"") for entry in entries] for name in names}


def entry_field(fields: list[bytes], name: bytes) -> bytes | None:
    """One field of one entry (flat list), or None."""
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == name:
            return fields[i + 1]
    return None


def _bounds(window: Window) -> tuple[str, str]:
    start = max(window.since_ns - window.clock_skew_ns, 0) // 1_000_000
    end = (window.until_ns + window.max_lateness_ns + window.clock_skew_ns) // 1_000_000
    return str(start), str(end)


def _binary(values: list[bytes]) -> pa.Array:
    return pa.array(values, pa.binary())


def _integers(column: pa.Array) -> pa.Array:
    """Digits → int64; raises ArrowInvalid on anything else (the caller drops the bad rows one by one)."""
    return pc.cast(pc.cast(column, pa.string()), pa.int64())


# -- feedback ------------------------------------------------------------------------------


async def load_feedback(
    redis: Redis, model: str, window: Window, metrics: Sequence[str], *, page_size: int = 5_000
) -> Feedback:
    """Events of ``metrics`` with ``event_ns`` in the window, de-duplicated by (metric, idempotency key).
    Events without a key all count; entries that do not parse are counted in ``corrupt``, never fatal."""
    start, end = _bounds(window)
    wanted = pa.array([m.encode() for m in metrics], pa.binary())
    chunks: list[pa.Table] = []
    result = Feedback(events=_empty_events())
    async for page in read_pages(redis, feedback_key(model), start=start, end=end, page_size=page_size):
        result.entries_read += len(page)
        found = page_columns(page, FEEDBACK_FIELDS)
        table = pa.table({name.decode(): _binary(values) for name, values in found.items()})
        keep = pc.is_in(table["metric"], value_set=wanted)
        result.other_metrics += len(table) - pc.sum(keep).as_py() if len(table) else 0
        table = table.filter(keep)
        table, bad = _parse_feedback(table)
        result.corrupt += bad
        times = table["event_ns"]
        inside = pc.and_(pc.greater_equal(times, window.since_ns), pc.less(times, window.until_ns))
        result.outside_window += len(table) - (pc.sum(inside).as_py() or 0)
        chunks.append(table.filter(inside))
    if not chunks:
        return result
    events = pa.concat_tables(chunks)
    keyed = events.filter(pc.not_equal(events["idempotency_key"], b""))
    unkeyed = events.filter(pc.equal(events["idempotency_key"], b""))
    # The earliest entry of each key wins (use_threads=False keeps "first" in stream order).
    first = keyed.group_by(["metric", "idempotency_key"], use_threads=False).aggregate(
        [("request_id", "first"), ("unit", "first"), ("value", "first"), ("event_ns", "first")]
    )
    result.duplicates = len(keyed) - len(first)
    first = first.rename_columns(
        {"request_id_first": "request_id", "unit_first": "unit", "value_first": "value", "event_ns_first": "event_ns"}
    )
    columns = ["metric", "request_id", "unit", "value", "event_ns"]
    merged = pa.concat_tables([first.select(columns), unkeyed.select(columns)])
    result.events = merged.set_column(0, "metric", pc.cast(merged["metric"], pa.string()))
    return result


def _empty_events() -> pa.Table:
    return pa.table(
        {
            "metric": pa.array([], pa.string()),
            "request_id": pa.array([], pa.binary()),
            "unit": pa.array([], pa.binary()),
            "value": pa.array([], pa.float64()),
            "event_ns": pa.array([], pa.int64()),
        }
    )


def _parse_feedback(table: pa.Table) -> tuple[pa.Table, int]:
    """``value`` → float64 and ``event_ns`` → int64, the page at once; rows that do not parse (written by
    hand, not by a recorder) are found one by one only when the page as a whole fails, and dropped."""
    try:
        values = pc.cast(pc.cast(table["value"], pa.string()), pa.float64())
        times = _integers(table["event_ns"])
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        good = [_parses(v, t) for v, t in zip(table["value"].to_pylist(), table["event_ns"].to_pylist(), strict=True)]
        mask = pa.array(good, pa.bool_())
        kept, bad = _parse_feedback(table.filter(mask))
        return kept, bad + good.count(False)
    nonfinite = pc.invert(pc.is_finite(values))
    bad = pc.sum(nonfinite).as_py() or 0
    table = table.set_column(table.schema.get_field_index("value"), "value", values)
    table = table.set_column(table.schema.get_field_index("event_ns"), "event_ns", times)
    return (table.filter(pc.invert(nonfinite)) if bad else table), bad


def _parses(value: bytes, time_ns: bytes) -> bool:
    try:
        float(value)
        int(time_ns)
    except ValueError:
        return False
    return True


# -- exposures ----------------------------------------------------------------------------


class _SeenFingerprints:
    """The set of call fingerprints seen so far: sorted numpy runs merged like a log-structured tree, so
    membership is a few binary searches and inserting costs O(log n) copies per fingerprint overall."""

    def __init__(self) -> None:
        self.runs: list[npt.NDArray[np.uint64]] = []

    def contains(self, values: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        found = np.zeros(len(values), dtype=bool)
        for run in self.runs:
            at = np.searchsorted(run, values)
            found |= run[np.minimum(at, len(run) - 1)] == values
        return found

    def add(self, values: npt.NDArray[np.uint64]) -> None:
        self.runs.append(np.sort(values))
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            last = self.runs.pop()
            self.runs[-1] = np.sort(np.concatenate([self.runs[-1], last]))


def fingerprints(ids: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """A 64-bit hash of each id, computed column-wise: the ids as a fixed-width byte matrix, folded 8 bytes at
    a time with a multiply-xorshift mix (collisions: about 3e-8 for a million ids)."""
    if not ids:
        return np.zeros(0, dtype=np.uint64)
    raw = np.array(ids, dtype=bytes)
    width = max(raw.dtype.itemsize, 1)
    raw = raw.astype(f"S{width + (-width) % 8}")
    words = raw.view(np.uint64).reshape(len(ids), -1)
    hashed = np.full(len(ids), 0x9E3779B97F4A7C15, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in words.T:
            hashed = (hashed ^ column) * np.uint64(0xBF58476D1CE4E5B9)
            hashed ^= hashed >> np.uint64(31)
    return hashed


class _ExposureReader:
    def __init__(self, window: Window, *, per_call: bool, wanted_request_ids: pa.Array, randomized_only: bool) -> None:
        self.window = window
        self.per_call = per_call
        self.randomized_only = randomized_only
        self.wanted = np.sort(fingerprints(wanted_request_ids.to_pylist()))
        self.seen = _SeenFingerprints()
        self.partial_units: list[pa.Table] = []
        self.partial_rows = 0
        self.compacted_rows = 0
        self.partial_other: list[pa.Table] = []
        self.call_keys: list[pa.Table] = []
        self.latency: dict[tuple[str, str, str], Histogram] = {}
        self.phases: dict[str, PhaseInfo] = {}
        self.entries_read = 0
        self.calls = 0
        self.duplicates = 0
        self.corrupt = 0

    def add_page(self, page: RawPage) -> None:
        self.entries_read += len(page)
        found = page_columns(page, CALL_FIELDS)
        request_ids = found[b"request_id"]
        table = pa.table({name.decode(): _binary(values) for name, values in found.items()})
        table = table.append_column("row", pa.array(np.arange(len(page), dtype=np.int32)))
        prints_all = fingerprints(request_ids)
        table = self._parsed(table)
        times = table["time_ns"].to_numpy()
        inside = (times >= self.window.since_ns) & (times < self.window.until_ns)
        table = table.filter(pa.array(inside))
        if not len(table):
            return
        prints = prints_all[table["row"].to_numpy()]
        _, first_in_page = np.unique(prints, return_index=True)
        fresh = np.zeros(len(prints), dtype=bool)
        fresh[first_in_page] = True
        fresh &= ~self.seen.contains(prints)
        self.duplicates += int(len(prints) - fresh.sum())
        self.seen.add(prints[fresh])
        table = table.filter(pa.array(fresh))
        prints = prints[fresh]
        self.calls += len(table)
        self._note_phases(table, page)
        self._add_latency(table)
        randomized = pc.is_in(table["assignment"], value_set=pa.array(RANDOMIZED, pa.binary()))
        unit = table["unit"]
        call_unit = pc.binary_join_element_wise(pa.scalar(CALL_UNIT_PREFIX, pa.binary()), table["request_id"], b"")
        unit = call_unit if self.per_call else pc.if_else(pc.equal(unit, b""), call_unit, unit)
        table = table.set_column(table.schema.get_field_index("unit"), "unit", unit)
        if len(self.wanted):
            # Membership by fingerprint (binary search in a sorted array; pc.is_in would hash the whole set again
            # for every page); the join later matches the request ids themselves.
            at = np.minimum(np.searchsorted(self.wanted, prints), len(self.wanted) - 1)
            named = table.filter(pa.array(self.wanted[at] == prints))
            if len(named):
                self.call_keys.append(
                    named.select(["request_id", "phase", "arm", "unit"]).append_column(
                        "randomized", pc.is_in(named["assignment"], value_set=pa.array(RANDOMIZED, pa.binary()))
                    )
                )
        chosen = table.filter(randomized) if self.randomized_only else table
        if len(chosen):
            buckets = self.window.bucket_of(chosen["time_ns"].to_numpy())
            chosen = chosen.append_column("bucket", pa.array(buckets))
            grouped = chosen.group_by(["phase", "arm", "unit", "bucket"]).aggregate(
                [("row", "count"), ("time_ns", "min")]
            )
            self._add_units(grouped.rename_columns({"row_count": "calls", "time_ns_min": "first_ns"}))
        others = table.filter(pc.invert(randomized))
        if len(others) and self.randomized_only:
            failed = pc.cast(pc.not_equal(others["status"], b"OK"), pa.int64())
            others = others.append_column("failed", failed)
            self.partial_other.append(
                others.group_by(["phase", "assignment", "arm"])
                .aggregate([("row", "count"), ("failed", "sum")])
                .rename_columns({"row_count": "calls", "failed_sum": "errors"})
            )

    def _parsed(self, table: pa.Table) -> pa.Table:
        """time_ns → int64 and latency_ms → float64; entries that do not parse are counted and dropped."""
        try:
            times = _integers(table["time_ns"])
            latency = pc.cast(pc.cast(table["latency_ms"], pa.string()), pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            good = [
                _parses(lat, t)
                for lat, t in zip(table["latency_ms"].to_pylist(), table["time_ns"].to_pylist(), strict=True)
            ]
            self.corrupt += good.count(False)
            return self._parsed(table.filter(pa.array(good, pa.bool_())))
        table = table.set_column(table.schema.get_field_index("time_ns"), "time_ns", times)
        return table.set_column(table.schema.get_field_index("latency_ms"), "latency_ms", latency)

    def _note_phases(self, table: pa.Table, page: RawPage) -> None:
        """Decode one record per phase not seen yet: its ``phase`` holds the weights and the control."""
        encoded = pc.dictionary_encode(table["phase"]).combine_chunks()
        rows = table["row"].to_numpy()
        indices = encoded.indices.to_numpy()
        for code, raw in enumerate(encoded.dictionary.to_pylist()):
            name = raw.decode(errors="replace")
            if name in self.phases or not name:
                continue
            row = int(rows[int(np.argmax(indices == code))])
            try:
                record = decode_record(entry_field(page[row][1], b"record") or b"")
            except (UnsupportedSchema, CorruptEntry, ValueError, TypeError):
                continue
            except Exception:  # protobuf's DecodeError: try the next record of this phase
                continue
            weights = {version: float(weight) for version, weight in sorted(record.phase.weights.items())}
            self.phases[name] = PhaseInfo(name, weights, record.phase.control)

    def _add_latency(self, table: pa.Table) -> None:
        randomized = pc.is_in(table["assignment"], value_set=pa.array(RANDOMIZED, pa.binary())).to_numpy(
            zero_copy_only=False
        )
        labels = pc.if_else(pa.array(randomized), pa.scalar(b"randomized", pa.binary()), table["assignment"])
        key = pc.binary_join_element_wise(table["phase"], table["arm"], labels, b"\x1f")
        encoded = pc.dictionary_encode(key).combine_chunks()
        codes = encoded.indices.to_numpy()
        latency = np.maximum(table["latency_ms"].to_numpy(), LATENCY_FLOOR_MS)
        buckets = np.minimum(
            (np.log(latency / LATENCY_FLOOR_MS) / math.log(LATENCY_GROWTH)).astype(np.int64), LATENCY_BUCKETS - 1
        )
        failed = pc.not_equal(table["status"], b"OK").to_numpy(zero_copy_only=False)
        for code, raw in enumerate(encoded.dictionary.to_pylist()):
            phase, arm, label = (part.decode(errors="replace") for part in raw.split(b"\x1f"))
            mine = codes == code
            histogram = self.latency.setdefault((phase, arm, label), Histogram())
            histogram.counts += np.bincount(buckets[mine], minlength=LATENCY_BUCKETS)
            histogram.calls += int(mine.sum())
            histogram.errors += int(failed[mine].sum())

    def _add_units(self, grouped: pa.Table) -> None:
        self.partial_units.append(grouped.select(["phase", "arm", "unit", "bucket", "calls", "first_ns"]))
        self.partial_rows += len(grouped)
        if self.partial_rows > self.compacted_rows + _COMPACT_ROWS:
            merged = _merge_units(self.partial_units)
            self.partial_units = [merged]
            self.partial_rows = self.compacted_rows = len(merged)

    def result(self) -> Exposures:
        units = _merge_units(self.partial_units) if self.partial_units else _empty_units()
        other = (
            pa.concat_tables(self.partial_other)
            .group_by(["phase", "assignment", "arm"])
            .aggregate([("calls", "sum"), ("errors", "sum")])
            .rename_columns({"calls_sum": "calls", "errors_sum": "errors"})
            if self.partial_other
            else pa.table({"phase": [], "assignment": [], "arm": [], "calls": [], "errors": []})
        )
        keys = (
            pa.concat_tables(self.call_keys)
            if self.call_keys
            else pa.table(
                {
                    "request_id": pa.array([], pa.binary()),
                    "phase": pa.array([], pa.binary()),
                    "arm": pa.array([], pa.binary()),
                    "unit": pa.array([], pa.binary()),
                    "randomized": pa.array([], pa.bool_()),
                }
            )
        )
        return Exposures(
            units=units,
            other=_as_text(other, ("phase", "assignment", "arm")),
            latency=self.latency,
            phases=self.phases,
            call_keys=_as_text(keys, ("phase", "arm")),
            entries_read=self.entries_read,
            calls=self.calls,
            duplicates=self.duplicates,
            corrupt=self.corrupt,
        )


def _merge_units(tables: list[pa.Table]) -> pa.Table:
    merged = (
        pa.concat_tables(tables)
        .group_by(["phase", "arm", "unit", "bucket"])
        .aggregate([("calls", "sum"), ("first_ns", "min")])
        .rename_columns({"calls_sum": "calls", "first_ns_min": "first_ns"})
    )
    return _as_text(merged.select(["phase", "arm", "unit", "bucket", "calls", "first_ns"]), ("phase", "arm"))


def _empty_units() -> pa.Table:
    return pa.table(
        {
            "phase": pa.array([], pa.string()),
            "arm": pa.array([], pa.string()),
            "unit": pa.array([], pa.binary()),
            "bucket": pa.array([], pa.int16()),
            "calls": pa.array([], pa.int64()),
            "first_ns": pa.array([], pa.int64()),
        }
    )


def _as_text(table: pa.Table, names: Sequence[str]) -> pa.Table:
    """Readable fields written by recorders are UTF-8; casting the few low-cardinality ones makes them strings."""
    for name in names:
        index = table.schema.get_field_index(name)
        if table.schema.field(index).type == pa.binary():
            table = table.set_column(index, name, pc.cast(table[name], pa.string()))
    return table


async def load_exposures(
    redis: Redis,
    model: str,
    window: Window,
    *,
    per_call: bool,
    wanted_request_ids: pa.Array | None = None,
    page_size: int = 5_000,
    randomized_only: bool = True,
) -> Exposures:
    """The calls of ``model`` received in the window. ``per_call``: every call is its own unit (else the
    routing-key HMAC, and the call for calls without a key). ``wanted_request_ids``: the request ids
    feedback names, whose calls are kept for the join. ``randomized_only=False``: every call counts in ``units``
    (a CUPED pre-period, where the covariate is what a unit did, however it was routed)."""
    start, end = _bounds(window)
    reader = _ExposureReader(
        window,
        per_call=per_call,
        wanted_request_ids=wanted_request_ids if wanted_request_ids is not None else pa.array([], pa.binary()),
        randomized_only=randomized_only,
    )
    async for page in read_pages(redis, stream_key(model), start=start, end=end, page_size=page_size):
        reader.add_page(page)
    return reader.result()
