"""Reading exposures (call records) and outcomes (feedback events) out of Redis into per-unit aggregates.

The streams are read in pages (XRANGE ... COUNT) and each page becomes numpy/Arrow columns of only the
readable fields the analysis needs (the serialized record is decoded once per experiment phase, for its
weights). Text that repeats becomes numbers: units and request ids 64-bit fingerprints, phases, arms and
assignments small codes. Each page's calls are added at once (numpy) to a dense row per (phase, arm, unit)
holding the calls per twentieth of the window, and each page of feedback is folded at once into per-row
sums (:mod:`splitstream.analysis.folding`, which reads both streams side by side), so the aggregates grow
with the number of units, not of calls or events.

What is kept per call or event is kept only while a later entry may still need it, in generations by time
(:class:`RecentFingerprints`): entries reach Redis in stream-id order, each within ``max_lateness_ns`` (and
the clock skew) of its own time, so once the entries read have moved that far past a time, no copy of a
call or event of that time can come any more and its generation is let go whole.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from operator import itemgetter
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from splitstream.analysis.arrays import RowMatrix
from splitstream.analysis.unit_buckets import UnitBucketCounts, UnitBuckets
from splitstream.analysis.usage import CALL_METRICS, Price
from splitstream.common.records import decode_record
from splitstream.common.redis_url import RedisClient

#: Assignments that were randomized (the split on the routing key, or a random draw without one): the only
#: calls an A/B comparison may use. Pins, spills, retries and records older than the field are shown apart.
RANDOMIZED = (b"hash", b"random")
#: Time buckets the window is cut into, for the lift-over-time chart (the analysis is repeated at each end).
TIMELINE_POINTS = 20
#: Latency histogram: buckets 2 % wide from 1 µs (quantiles within ~1 % of the exact value), like the replayer's.
LATENCY_FLOOR_MS = 1e-3
LATENCY_GROWTH = 1.02
LATENCY_BUCKETS = 1 + int(math.log(3_600_000 / LATENCY_FLOOR_MS) / math.log(LATENCY_GROWTH))
#: The fields of a feedback entry the analysis reads.
FEEDBACK_FIELDS = (b"metric", b"request_id", b"unit", b"value", b"event_ns", b"idempotency_key")
#: The readable fields of a call entry the analysis reads (the record only once per phase). ``principal``,
#: ``ttft_ms``, ``tokens``, ``prompt_tokens`` and ``completion_tokens`` are newer: entries without them read as
#: empty (no principal, not a stream, tokens unknown).
CALL_FIELDS = (
    b"request_id",
    b"time_ns",
    b"status",
    b"latency_ms",
    b"arm",
    b"assignment",
    b"phase",
    b"unit",
    b"principal",
    b"ttft_ms",
    b"tokens",
    b"prompt_tokens",
    b"completion_tokens",
)


@dataclass(frozen=True, slots=True)
class CallPage:
    """A page of call entries as columns of :data:`CALL_FIELDS` (bytes, ``b""`` where absent), and how to get
    the serialized record of one of its rows (read once per experiment phase, for its weights)."""

    columns: dict[bytes, list[bytes]]
    record: Callable[[int], Awaitable[bytes | None]]


class Source(Protocol):
    """Where the calls and the feedback of a model come from: Redis, the archive, or both
    (:mod:`splitstream.analysis.sources`). Pages are in stream order; the readers de-duplicate."""

    def call_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[CallPage]: ...

    def feedback_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[dict[bytes, list[bytes]]]: ...


@dataclass(frozen=True, slots=True)
class Window:
    """``[since_ns, until_ns)`` by the router's receive time (calls) and by event time (feedback)."""

    since_ns: int
    until_ns: int
    #: How long after ``until_ns`` a call's record or an event may reach Redis (spooled through an outage).
    max_lateness_ns: int = 3_600 * 10**9
    #: How far the routers' clocks may be ahead of Redis's (entry ids are Redis's clock).
    clock_skew_ns: int = 5 * 10**9
    #: How long after ``until_ns`` an event naming a call of the window still counts for it (a click an hour
    #: after the answer is the answer's). Events naming only a unit are dated inside the window: they have no
    #: call to tie them to it.
    attribution_ns: int = 0

    def join_horizon_ns(self) -> int:
        """How long after a call an event naming it may be dated and still count for it: the attribution window,
        or the lateness allowance when that is longer (an answer's click may come as late as its record may).
        Bounds how long a call is held for the join (:mod:`splitstream.analysis.folding`)."""
        return max(self.attribution_ns, self.max_lateness_ns)

    def settled_ns(self) -> int:
        """How far behind the stream's robust cursor (:func:`page_cursor`) an entry may still be dated: entries
        come in id order, each reaching Redis within the lateness allowance and clock skew of its time."""
        return self.max_lateness_ns + 2 * self.clock_skew_ns

    def feedback_reach(self) -> Window:
        """The window feedback is read in: this one, its end moved out by the attribution window."""
        return replace(self, until_ns=self.until_ns + self.attribution_ns, attribution_ns=0)

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
class Names:
    """Small integer codes for the few distinct values of a text field (phases, arms, assignments), so the
    per-unit tables hold an int16 where they would hold a string on every row."""

    names: list[str] = field(default_factory=list)
    codes: dict[bytes, int] = field(default_factory=dict)

    def encode(self, values: list[bytes]) -> npt.NDArray[np.int16]:
        encoded = pc.dictionary_encode(pa.array(values, pa.binary()))
        mapping = np.array([self.code(raw) for raw in encoded.dictionary.to_pylist()], dtype=np.int16)
        return mapping[encoded.indices.to_numpy()] if len(mapping) else np.zeros(0, dtype=np.int16)

    def code(self, raw: bytes) -> int:
        code = self.codes.get(raw)
        if code is None:
            code = self.codes[raw] = len(self.names)
            self.names.append(raw.decode(errors="replace"))
        return code


@dataclass(slots=True)
class StreamStats:
    """Token streams of one group of calls: how many, their time to first token, tokens and seconds in all."""

    streams: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)

    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass(slots=True)
class UsageStats:
    """Generations of one group of calls (calls whose completion tokens are known): tokens in and out, the
    calls among them whose prompt tokens are unknown, and the cost of those a price applies to."""

    generations: int = 0
    tokens_out: int = 0
    prompt_known: int = 0
    tokens_in: int = 0
    costed: int = 0
    cost: float = 0.0


@dataclass(slots=True)
class Exposures:
    """The calls of a window, reduced. Units and request ids are 64-bit fingerprints (:func:`fingerprints`),
    phases and arms codes into ``phases.names`` and ``arms.names``.

    ``units``: one row per (phase, arm, unit) of randomized calls: ``phase``, ``arm`` (int16), ``unit`` (uint64),
    ``calls`` (int64), ``first_ns`` (int64) and ``key`` (int64), the row of ``bucket_calls`` that holds its calls
    per time bucket (int32, one column per bucket of the window). ``other``: calls not randomized, per
    (phase, assignment, arm) names: ``calls``, ``errors``. ``latency``: histograms per (phase, arm, assignment
    class: ``randomized`` or the assignment's name). Nothing per call: the join with feedback holds calls only
    while events may still name them (:mod:`splitstream.analysis.folding`)."""

    units: pa.Table
    bucket_calls: RowMatrix
    other: list[tuple[str, str, str, int, int]]
    latency: dict[tuple[str, str, str], Histogram]
    phase_info: dict[str, PhaseInfo]
    phases: Names
    arms: Names
    entries_read: int = 0
    calls: int = 0
    duplicates: int = 0
    corrupt: int = 0
    #: Token streams per (phase, arm, assignment class), as ``latency`` (the TTFT of every call that has one).
    streams: dict[tuple[str, str, str], StreamStats] = field(default_factory=dict)
    #: Tokens and cost per (phase, arm, assignment class), as ``latency``.
    usage: dict[tuple[str, str, str], UsageStats] = field(default_factory=dict)
    #: With a segment field: the same, per value of the field (a call in the segment of its own value).
    segments: dict[str, Exposures] = field(default_factory=dict)
    #: Randomized calls, and those among them that carried a routing key: split by user, not call by call.
    randomized_calls: int = 0
    keyed_calls: int = 0
    #: Randomized calls per (row of ``units``, latency bucket), and those with a TTFT per (row, TTFT bucket), for
    #: the quantile comparisons (:mod:`splitstream.analysis.quantiles`): their clustered interval needs each
    #: unit's calls (:mod:`splitstream.analysis.unit_buckets`).
    call_samples: CallSamples | None = None


@dataclass(frozen=True, slots=True)
class CallSamples:
    latency: UnitBucketCounts
    ttft: UnitBucketCounts


def bucket_middle_ms(buckets: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """A bucket's geometric middle, the value :meth:`Histogram.quantile_ms` gives it too."""
    return np.asarray(LATENCY_FLOOR_MS * LATENCY_GROWTH ** (buckets + 0.5), dtype=np.float64)


@dataclass(slots=True)
class Feedback:
    """What reading the feedback of a window met (the events themselves went to the sinks as they came)."""

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


def read_pages(redis: RedisClient, key: str, *, start: str, end: str, page_size: int) -> AsyncGenerator[RawPage, None]:
    """XRANGE ``key`` from ``start`` to ``end`` in pages of ``page_size`` entries, as Redis sent them.

    The next page is asked for before this one is handed over (:func:`_read_ahead`), so redis-server (another
    process, another core) builds and sends it while the caller converts this one."""
    if isinstance(redis, RedisCluster):
        # A cluster client's reply callbacks are shared by all its users: the fields come back as dicts here,
        # and are flattened again (the decode cost the single-Redis path avoids).
        cluster = redis

        async def cluster_page(lower: str) -> RawPage:
            parsed = cast(
                list[tuple[bytes, dict[bytes, bytes]]], await cluster.xrange(key, min=lower, max=end, count=page_size)
            )
            return [(raw_id, [part for item in fields.items() for part in item]) for raw_id, fields in parsed]

        fetch: Callable[[str], Awaitable[RawPage]] = cluster_page
    else:
        client = _unparsed(redis)

        async def page(lower: str) -> RawPage:
            return cast(RawPage, await client.xrange(key, min=lower, max=end, count=page_size))

        fetch = page
    return _read_ahead(fetch, start, page_size)


#: Turns of the event loop a read-ahead task gets before the page it follows is handed over: redis-py awaits
#: several times (the pool, the connection's health, the write) before a command is on the socket. Measured:
#: with one turn the XRANGE left only once the caller was back, so nothing overlapped (an analysis 2.3 s);
#: with three or more it is sent at once (1.7 s). The spare turns cost microseconds.
_TURNS_TO_SEND = 8


async def _read_ahead(
    fetch: Callable[[str], Awaitable[RawPage]], start: str, page_size: int
) -> AsyncGenerator[RawPage, None]:
    """The pages ``fetch`` returns from ``start`` on, each asked for (a task, given :data:`_TURNS_TO_SEND`
    turns of the event loop to send its command) as soon as the previous one is in, before that one is
    yielded: one page ahead, no more, so memory stays at two pages. An error reading a page is raised where
    that page is asked for, as without the read-ahead; a caller that stops early (``aclose``) cancels the
    page in flight and waits for it."""
    pending = asyncio.ensure_future(fetch(start))
    try:
        while True:
            found = await pending
            if len(found) < page_size:
                if found:
                    yield found
                return
            pending = asyncio.ensure_future(fetch("(" + bytes(found[-1][0]).decode()))
            for _ in range(_TURNS_TO_SEND):  # the task's first turns write the XRANGE to the socket
                await asyncio.sleep(0)
            yield found
    finally:
        if not pending.done():
            pending.cancel()
            await asyncio.wait([pending])  # over when the cancelled read has let go of its connection
        if not pending.cancelled():
            pending.exception()  # seen: a failed read nobody asked for is not logged as never retrieved


def page_columns(page: RawPage, names: Sequence[bytes]) -> dict[bytes, list[bytes]]:
    """The values of ``names`` in every entry of the page, as lists (``b""`` where an entry lacks one).

    Entries written by one recorder version share one layout, so when every entry has the first one's
    length, the page's fields are laid end to end in one list and each field is a strided slice of it, its
    name checked by the slice beside it holding only that name (``list.count``): all at C speed, no Python
    code per entry. A page of mixed layouts (a recorder upgrade, a hand-written entry) falls back to a dict
    per entry. (Measured: about two thirds of the CPU of a list comprehension per field and its name.)"""
    first = page[0][1]
    width = len(first)
    positions = {first[i]: i + 1 for i in range(0, width - 1, 2)}
    entries = list(map(itemgetter(1), page))
    count = len(entries)
    if list(map(len, entries)).count(width) == count:
        flat = list(chain.from_iterable(entries))
        out: dict[bytes, list[bytes]] = {}
        for name in names:
            at = positions.get(name)
            if at is None:  # a field newer than the recorder that wrote the page: empty throughout
                out[name] = [b""] * count
            elif flat[at - 1 :: width].count(name) == count:
                out[name] = flat[at::width]
            else:
                break
        else:
            return out
    by_name = [dict(zip(fields[0::2], fields[1::2], strict=False)) for fields in entries]
    return {name: [entry.get(name, b"") for entry in by_name] for name in names}


def entry_field(fields: list[bytes], name: bytes) -> bytes | None:
    """One field of one entry (flat list), or None."""
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == name:
            return fields[i + 1]
    return None


def bounds(window: Window) -> tuple[str, str]:
    """The stream id range (ms) that may hold the window's entries: clock skew before, lateness after."""
    start = max(window.since_ns - window.clock_skew_ns, 0) // 1_000_000
    end = (window.until_ns + window.max_lateness_ns + window.clock_skew_ns) // 1_000_000
    return str(start), str(end)


def _numbers(values: list[bytes], kind: pa.DataType) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
    """Text → numbers, the column at once; where the column does not parse as a whole (an entry written by
    hand), value by value. Returns the numbers and which parsed (and are finite)."""
    try:
        parsed = pc.cast(pa.array(values, pa.binary()), kind).to_numpy()  # Arrow parses the bytes as text
        good = np.isfinite(parsed) if kind == pa.float64() else np.ones(len(values), dtype=bool)
        return parsed, good
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        python_type = float if kind == pa.float64() else int
        numbers: list[float | int] = []
        ok: list[bool] = []
        for value in values:
            try:
                number = python_type(value)
                ok.append(math.isfinite(number))
            except (ValueError, OverflowError):
                number = 0
                ok.append(False)
            numbers.append(number if ok[-1] else 0)
        return np.array(numbers, dtype=kind.to_pandas_dtype()), np.array(ok, dtype=bool)


class _SeenFingerprints:
    """The set of fingerprints seen so far: sorted numpy runs merged like a log-structured tree, so
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
        if not len(values):
            return
        self.runs.append(np.sort(values))
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            last = self.runs.pop()
            self.runs[-1] = np.sort(np.concatenate([self.runs[-1], last]))


class RecentFingerprints:
    """Fingerprints seen lately, in generations by the time of what they stand for (a slice of ``slice_ns``
    each, a :class:`_SeenFingerprints`), so that the fingerprints of a time no copy can come for any more are
    let go a generation at a time (:meth:`forget_before`): memory follows the lateness allowance, not the
    stream's length."""

    def __init__(self, slice_ns: int) -> None:
        self.slice_ns = max(int(slice_ns), 1)
        self.generations: dict[int, _SeenFingerprints] = {}

    def first_time(self, values: npt.NDArray[np.uint64], times: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Which of ``values`` (0: no key, always kept) were not seen before, nor earlier in ``values``; notes
        them in the generation of their time."""
        keyed = values != 0
        fresh = ~keyed
        if not keyed.any():
            return fresh
        where = np.flatnonzero(keyed)
        # Looked up sorted (as np.unique gives them): binary searches for ascending values walk the runs in
        # order, about twice as fast as the page's order.
        distinct, first = np.unique(values[where], return_index=True)
        seen = np.zeros(len(distinct), dtype=bool)
        for generation in self.generations.values():
            seen |= generation.contains(distinct)
        candidates = where[first[~seen]]
        fresh[candidates] = True
        slices = np.asarray(times[candidates], dtype=np.int64) // self.slice_ns
        for at in np.unique(slices).tolist():
            self.generations.setdefault(at, _SeenFingerprints()).add(values[candidates[slices == at]])
        return fresh

    def forget_before(self, horizon_ns: int) -> None:
        """Let go of every generation whose times all lie before ``horizon_ns``."""
        for at in [at for at in self.generations if (at + 1) * self.slice_ns <= horizon_ns]:
            del self.generations[at]

    def held(self) -> int:
        return sum(len(run) for generation in self.generations.values() for run in generation.runs)


def page_cursor(times: npt.NDArray[np.int64], cursor_ns: int) -> int:
    """The stream's read position in time, moved on by a page whose entries are dated ``times``: the most the
    median of a page has reached. Pages come in stream-id order and every entry reaches Redis within the
    lateness allowance of its time, so an entry read later is dated no earlier than the cursor less
    :meth:`Window.settled_ns`; the median, not the maximum, so that one entry dated far ahead (a wrong
    clock) cannot move it."""
    if not len(times):
        return cursor_ns
    return max(cursor_ns, int(np.median(times)))


_MIX = np.uint64(0xBF58476D1CE4E5B9)


def fingerprints(values: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """A 64-bit hash of each value, computed column-wise: the values as a fixed-width byte matrix, each folded
    over its own 8-byte words (whatever the column's width) with a multiply-xorshift mix (collisions: about 3e-8
    among a million values). Empty values give 0, and only they do: 0 means "none"."""
    if not values:
        return np.zeros(0, dtype=np.uint64)
    raw = np.array(values, dtype=bytes)
    width = max(raw.dtype.itemsize, 1)
    raw = raw.astype(f"S{width + (-width) % 8}")
    words = raw.view(np.uint64).reshape(len(values), -1)
    lengths = np.char.str_len(raw)
    # Each value folds only its own words: a value's fingerprint must not depend on the longest value of the
    # column it came in (a page of calls and a page of feedback are of different widths).
    own_words = (lengths + 7) // 8
    hashed = np.full(len(values), 0x9E3779B97F4A7C15, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for index, column in enumerate(words.T):
            mixed_in = (hashed ^ column) * _MIX
            mixed_in ^= mixed_in >> np.uint64(31)
            hashed = np.where(own_words > index, mixed_in, hashed)
    hashed[hashed == 0] = 1
    hashed[lengths == 0] = 0
    return hashed


def mixed(values: npt.NDArray[np.uint64], salt: int) -> npt.NDArray[np.uint64]:
    """Another fingerprint derived from ``values`` (the unit of a call from its request id; a metric's key
    from its idempotency key's): a bijection of the uint64s, so distinct values stay distinct. 0 stays 0."""
    with np.errstate(over="ignore"):
        out = (values ^ np.uint64(salt)) * _MIX
        out ^= out >> np.uint64(29)
    out[out == 0] = 1
    out[values == 0] = 0
    return out


# -- feedback ------------------------------------------------------------------------------


#: The start of a stream's cursor, before any page (:func:`page_cursor`).
NO_CURSOR = -(2**62)

#: A page of de-duplicated events as the sinks take them: metric code, request and unit fingerprints, value,
#: event time.
EventPage = tuple[
    npt.NDArray[np.int8], npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.float64], npt.NDArray[np.int64]
]


class FeedbackReader:
    """Turns pages of feedback entries into :data:`EventPage` s: events of ``metrics`` with ``event_ns`` in the
    window (those naming a call: up to its attribution window past the end), de-duplicated by (metric,
    idempotency key), the first delivery in stream order counting. Events without a key all count; entries
    that do not parse are counted in ``corrupt``, never fatal.

    The idempotency keys are kept only while a copy may still come (copies reach Redis within the lateness
    allowance of the event's time): 8 bytes per keyed event of the last ``max_lateness`` or so."""

    def __init__(self, window: Window, metrics: Sequence[str]) -> None:
        self.window = window
        self.metrics = len(metrics)
        self.codes = Names()
        for name in metrics:
            # A metric of the calls (ttft_ms, cost, ...) is not read from feedback: its code goes to a name no
            # event can carry (metric names are [A-Za-z0-9_.:-]), so events of that name count as other metrics.
            self.codes.code(b"\x00" + name.encode() if name in CALL_METRICS else name.encode())
        self.seen = RecentFingerprints(window.settled_ns() // 4)
        self.result = Feedback()
        #: Events the sinks have taken so far (one made later counts them as unknown: it could have joined none).
        self.sent = 0
        self.cursor_ns = NO_CURSOR

    def add_page(self, found: dict[bytes, list[bytes]]) -> EventPage | None:
        """The page's events to fold, or None when none is left."""
        window, result = self.window, self.result
        result.entries_read += len(found[b"metric"])
        metric = self.codes.encode(found[b"metric"])  # other metrics get codes past the ones asked for
        keep = metric < self.metrics
        result.other_metrics += int((~keep).sum())
        values, good_value = _numbers(found[b"value"], pa.float64())
        times, good_time = _numbers(found[b"event_ns"], pa.int64())
        self.cursor_ns = page_cursor(times[good_time], self.cursor_ns)
        self.seen.forget_before(self.cursor_ns - window.settled_ns())
        good = good_value & good_time
        result.corrupt += int((keep & ~good).sum())
        keep &= good
        requests = fingerprints(found[b"request_id"])
        # Events naming a call count up to the attribution window past the end (joined only to calls inside).
        end = np.where(requests != 0, window.until_ns + window.attribution_ns, window.until_ns)
        inside = (times >= window.since_ns) & (times < end)
        result.outside_window += int((keep & ~inside).sum())
        keep &= inside
        rows = np.flatnonzero(keep)
        if not len(rows):
            return None
        keys = mixed(fingerprints(found[b"idempotency_key"])[rows], 0)
        with np.errstate(over="ignore"):
            keys = np.where(keys != 0, keys ^ (metric[rows].astype(np.uint64) + np.uint64(1)) * _MIX, 0)
        fresh = self.seen.first_time(keys.astype(np.uint64), times[rows].astype(np.int64))
        result.duplicates += int((~fresh).sum())
        rows = rows[fresh]
        if not len(rows):
            return None
        return (
            metric[rows].astype(np.int8),
            requests[rows],
            fingerprints(found[b"unit"])[rows],
            values[rows].astype(np.float64),
            times[rows].astype(np.int64),
        )


# -- exposures ----------------------------------------------------------------------------

#: Salt of the unit of a call without a routing key (derived from its request id's fingerprint).
CALL_UNIT_SALT = 0x63616C6C  # "call"


@dataclass(frozen=True, slots=True)
class NewCalls:
    """The calls a page added (once each), for the join: request fingerprints, their row of the reader's
    :class:`UnitIndex` (-1: not randomized), and their times."""

    requests: npt.NDArray[np.uint64]
    rows: npt.NDArray[np.int32]
    times: npt.NDArray[np.int64]
    #: Per metric of the calls (:data:`splitstream.analysis.usage.CALL_METRICS`), each call's value (NaN: none).
    values: dict[str, npt.NDArray[np.float64]] = field(default_factory=dict)


class ExposureReader:
    """Adds pages of calls to per-(phase, arm, unit) rows and the other tallies; :meth:`result` is the
    :class:`Exposures`. Request fingerprints are kept to drop calls stored twice only while a copy may still
    come (within the lateness allowance of the call's time: :class:`RecentFingerprints`)."""

    def __init__(
        self,
        window: Window,
        *,
        per_call: bool,
        randomized_only: bool,
        prices: dict[str, Price] | None = None,
        call_samples: bool = True,
    ) -> None:
        """``call_samples``: keep each unit's calls per latency and TTFT bucket (what the quantile comparisons
        need; a CUPED pre-period or a caller without them need not pay for them)."""
        self.window = window
        #: ``--price`` per version: the cost of a call of that arm.
        self.prices = prices or {}
        self.per_call = per_call
        self.randomized_only = randomized_only
        self.seen = RecentFingerprints(window.settled_ns() // 4)
        #: How far the calls read have come (:func:`page_cursor`).
        self.cursor_ns = NO_CURSOR
        self.phases = Names()
        self.arms = Names()
        self.assignments = Names()
        self.randomized_codes = np.array([self.assignments.code(a) for a in RANDOMIZED], dtype=np.int16)
        self.units = UnitIndex()
        self.other: dict[tuple[int, int, int], list[int]] = {}
        self.latency: dict[tuple[int, int, int], Histogram] = {}
        self.streams: dict[tuple[int, int, int], StreamStats] = {}
        self.usage: dict[tuple[int, int, int], UsageStats] = {}
        self.phase_info: dict[str, PhaseInfo] = {}
        self.entries_read = 0
        self.calls = 0
        self.duplicates = 0
        self.corrupt = 0
        self.randomized_calls = 0
        self.keyed_calls = 0
        self._by_unit = (UnitBuckets(), UnitBuckets()) if call_samples else None

    def add_columns(self, found: dict[bytes, list[bytes]]) -> tuple[dict[str, int], NewCalls | None]:
        """Add a page's calls; returns the phases met for the first time, each with a row of the page whose
        record holds its weights and control (:meth:`note_record`), and the calls added (None: none)."""
        self.entries_read += len(found[b"request_id"])
        times, good_time = _numbers(found[b"time_ns"], pa.int64())
        latency, good_latency = _numbers(found[b"latency_ms"], pa.float64())
        self.cursor_ns = page_cursor(times[good_time], self.cursor_ns)
        self.seen.forget_before(self.cursor_ns - self.window.settled_ns())
        good = good_time & good_latency
        self.corrupt += int((~good).sum())
        rows = np.flatnonzero(good & (times >= self.window.since_ns) & (times < self.window.until_ns))
        if not len(rows):
            return {}, None
        requests = fingerprints(found[b"request_id"])[rows]
        fresh = self.seen.first_time(requests, times[rows].astype(np.int64))
        self.duplicates += int((~fresh).sum())
        rows, requests = rows[fresh], requests[fresh]
        if not len(rows):
            return {}, None
        self.calls += len(rows)
        phase = self.phases.encode(found[b"phase"])[rows]
        arm = self.arms.encode(found[b"arm"])[rows]
        assignment = self.assignments.encode(found[b"assignment"])[rows]
        failed = pc.not_equal(pa.array(found[b"status"], pa.binary()), b"OK").to_numpy(zero_copy_only=False)[rows]
        times, latency = times[rows].astype(np.int64), latency[rows].astype(np.float64)
        randomized = np.isin(assignment, self.randomized_codes)
        label = np.where(randomized, -1, assignment)
        self._add_latency(phase, arm, label, latency, failed)
        self._add_streams(found, rows, phase, arm, label, latency)
        values = self._call_values(found, rows, arm)
        self._add_usage(values, phase, arm, label)
        unit = fingerprints(found[b"unit"])[rows]
        self.randomized_calls += int(randomized.sum())
        self.keyed_calls += int((randomized & (unit != 0)).sum())
        own = mixed(requests, CALL_UNIT_SALT)
        unit = own if self.per_call else np.where(unit == 0, own, unit)
        chosen = randomized if self.randomized_only else np.ones(len(rows), dtype=bool)
        call_rows = np.full(len(rows), -1, dtype=np.int32)
        if chosen.any():
            call_rows[chosen] = self.units.add(
                phase[chosen], arm[chosen], unit[chosen], self.window.bucket_of(times[chosen]), times[chosen]
            )
            if self._by_unit is not None:
                latency_by_unit, ttft_by_unit = self._by_unit
                sampled = chosen & randomized
                period = self.window.bucket_of(times)
                latency_by_unit.add(call_rows[sampled], _latency_buckets(latency[sampled]), period[sampled])
                timed = sampled & ~np.isnan(values["ttft_ms"])
                ttft_by_unit.add(call_rows[timed], _latency_buckets(values["ttft_ms"][timed]), period[timed])
        if self.randomized_only and not randomized.all():
            for p, a, s, f in zip(
                phase[~randomized], assignment[~randomized], arm[~randomized], failed[~randomized], strict=True
            ):
                counts = self.other.setdefault((int(p), int(a), int(s)), [0, 0])
                counts[0] += 1
                counts[1] += int(f)
        return self._phases_to_note(phase, rows), NewCalls(requests, call_rows, times, values)

    def _phases_to_note(self, phase: npt.NDArray[np.int16], rows: npt.NDArray[np.int64]) -> dict[str, int]:
        needed: dict[str, int] = {}
        for code in np.unique(phase):
            name = self.phases.names[int(code)]
            if name and name not in self.phase_info:
                needed[name] = int(rows[int(np.argmax(phase == code))])
        return needed

    def note_record(self, phase: str, data: bytes | None) -> None:
        """A record of ``phase``: its ``phase`` holds the weights and the control."""
        if phase in self.phase_info or not data:
            return
        try:
            record = decode_record(data)
        except Exception:  # UnsupportedSchema, protobuf's DecodeError: another record of the phase will do
            return
        weights = {version: float(weight) for version, weight in sorted(record.phase.weights.items())}
        self.phase_info[phase] = PhaseInfo(phase, weights, record.phase.control)

    def _add_streams(
        self,
        found: dict[bytes, list[bytes]],
        rows: npt.NDArray[np.int64],
        phase: npt.NDArray[np.int16],
        arm: npt.NDArray[np.int16],
        label: npt.NDArray[np.int64],
        duration_ms: npt.NDArray[np.float64],
    ) -> None:
        """Token streams (calls with a ``tokens`` field): count, tokens and seconds per group; the TTFT histogram
        of every call with a ``ttft_ms``."""
        tokens, is_stream = _optional_numbers(found[b"tokens"], pa.int64())
        ttft, has_ttft = _optional_numbers(found[b"ttft_ms"], pa.float64())
        if not is_stream.any() and not has_ttft.any():
            return
        tokens, is_stream, ttft, has_ttft = tokens[rows], is_stream[rows], ttft[rows], has_ttft[rows]
        groups = _group_keys(phase, arm, label)
        # TTFT of every call that has one: a gRPC stream's first response, an HTTP call's first token.
        for key in np.unique(groups[is_stream | has_ttft]).tolist():
            mine = is_stream & (groups == key)
            p, a, lab = _group_of(key)
            stats = self.streams.setdefault((p, a, lab), StreamStats())
            stats.streams += int(mine.sum())
            stats.tokens += int(tokens[mine].sum())
            stats.seconds += float(duration_ms[mine].sum()) / 1e3
            first = ttft[(groups == key) & has_ttft]
            stats.ttft.calls += len(first)
            stats.ttft.counts += np.bincount(_latency_buckets(first), minlength=LATENCY_BUCKETS)

    def _call_values(
        self, found: dict[bytes, list[bytes]], rows: npt.NDArray[np.int64], arm: npt.NDArray[np.int16]
    ) -> dict[str, npt.NDArray[np.float64]]:
        """Each call's value of every metric of the calls (NaN where it has none): tokens in and out, TTFT,
        and the cost its arm's price gives it (NaN without a price, or without both token counts)."""
        values = {}
        for name, field_name in (("tokens_in", b"prompt_tokens"), ("tokens_out", b"completion_tokens")):
            numbers, present = _optional_numbers(found[field_name], pa.int64())
            values[name] = np.where(present[rows], numbers[rows].astype(np.float64), np.nan)
        ttft, has_ttft = _optional_numbers(found[b"ttft_ms"], pa.float64())
        values["ttft_ms"] = np.where(has_ttft[rows], ttft[rows], np.nan)
        prices = [self.prices.get(name) for name in self.arms.names]
        per_in = np.array([p.per_token_in if p else np.nan for p in prices], dtype=np.float64)
        per_out = np.array([p.per_token_out if p else np.nan for p in prices], dtype=np.float64)
        codes = arm.astype(np.int64)
        values["cost"] = values["tokens_in"] * per_in[codes] + values["tokens_out"] * per_out[codes]
        return values

    def _add_usage(
        self,
        values: dict[str, npt.NDArray[np.float64]],
        phase: npt.NDArray[np.int16],
        arm: npt.NDArray[np.int16],
        label: npt.NDArray[np.int64],
    ) -> None:
        """Generations (completion tokens known): tokens in and out, and cost, per group."""
        generated = ~np.isnan(values["tokens_out"])
        if not generated.any():
            return
        groups = _group_keys(phase, arm, label)
        for key in np.unique(groups[generated]).tolist():
            mine = generated & (groups == key)
            stats = self.usage.setdefault(_group_of(key), UsageStats())
            stats.generations += int(mine.sum())
            stats.tokens_out += int(values["tokens_out"][mine].sum())
            prompt = mine & ~np.isnan(values["tokens_in"])
            stats.prompt_known += int(prompt.sum())
            stats.tokens_in += int(values["tokens_in"][prompt].sum())
            costed = mine & ~np.isnan(values["cost"])
            stats.costed += int(costed.sum())
            stats.cost += float(values["cost"][costed].sum())

    def _add_latency(
        self,
        phase: npt.NDArray[np.int16],
        arm: npt.NDArray[np.int16],
        label: npt.NDArray[np.int64],
        latency_ms: npt.NDArray[np.float64],
        failed: npt.NDArray[np.bool_],
    ) -> None:
        buckets = _latency_buckets(latency_ms)
        groups = _group_keys(phase, arm, label)
        keys, inverse = np.unique(groups, return_inverse=True)
        inverse = inverse.reshape(-1)
        for index, key in enumerate(keys.tolist()):
            mine = inverse == index
            p, a, lab = _group_of(key)
            histogram = self.latency.setdefault((p, a, lab), Histogram())
            histogram.counts += np.bincount(buckets[mine], minlength=LATENCY_BUCKETS)
            histogram.calls += int(mine.sum())
            histogram.errors += int(failed[mine].sum())

    def result(self) -> Exposures:
        def label(code: int) -> str:
            return "randomized" if code < 0 else self.assignments.names[code]

        return Exposures(
            units=self.units.table(),
            bucket_calls=self.units.calls[: self.units.size],
            other=[
                (self.phases.names[p], self.assignments.names[a], self.arms.names[s], calls, errors)
                for (p, a, s), (calls, errors) in sorted(self.other.items())
            ],
            latency={
                (self.phases.names[p], self.arms.names[a], label(lab)): h for (p, a, lab), h in self.latency.items()
            },
            streams={
                (self.phases.names[p], self.arms.names[a], label(lab)): s for (p, a, lab), s in self.streams.items()
            },
            usage={(self.phases.names[p], self.arms.names[a], label(lab)): u for (p, a, lab), u in self.usage.items()},
            phase_info=self.phase_info,
            phases=self.phases,
            arms=self.arms,
            entries_read=self.entries_read,
            calls=self.calls,
            duplicates=self.duplicates,
            corrupt=self.corrupt,
            randomized_calls=self.randomized_calls,
            keyed_calls=self.keyed_calls,
            call_samples=CallSamples(*(b.result() for b in self._by_unit)) if self._by_unit is not None else None,
        )


def _group_keys(
    phase: npt.NDArray[np.int16], arm: npt.NDArray[np.int16], label: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """One int64 per (phase, arm, label), so that one ``np.unique`` groups the calls: codes are int16,
    the label -1 (randomized) or an assignment code."""
    return (phase.astype(np.int64) << 32) | (arm.astype(np.int64) << 16) | (label.astype(np.int64) + 1)


def _group_of(key: int) -> tuple[int, int, int]:
    """The (phase, arm, label) a :func:`_group_keys` key stands for."""
    return key >> 32, (key >> 16) & 0xFFFF, (key & 0xFFFF) - 1


def _latency_buckets(latency_ms: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    return np.minimum(
        (np.log(np.maximum(latency_ms, LATENCY_FLOOR_MS) / LATENCY_FLOOR_MS) / math.log(LATENCY_GROWTH)).astype(
            np.int64
        ),
        LATENCY_BUCKETS - 1,
    )


def _optional_numbers(values: list[bytes], kind: pa.DataType) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
    """A field most entries leave empty (token-stream fields of unary calls): the numbers and which are there."""
    numbers = np.zeros(len(values), dtype=kind.to_pandas_dtype())
    if values.count(b"") == len(values):  # C speed: the common page of unary calls
        return numbers, np.zeros(len(values), dtype=bool)
    present = np.fromiter((bool(v) for v in values), dtype=bool, count=len(values))
    if present.any():
        where = np.flatnonzero(present)
        parsed, good = _numbers([values[i] for i in where], kind)
        numbers[where] = np.where(good, parsed, 0)
        present[where] = good
    return numbers, present


class UnitIndex:
    """A dense row per (phase, arm, unit) seen, and its calls per time bucket in a numpy matrix.

    Rows are found by a 64-bit key (the unit's fingerprint mixed with the phase and arm codes) in a sorted array
    (binary search; new keys inserted per page), so the calls of a page land in their rows with one ``np.add.at``:
    memory is a few dozen bytes and one row of ``TIMELINE_POINTS`` int32 per (phase, arm, unit), whatever the
    number of calls."""

    def __init__(self) -> None:
        self.sorted_keys = np.zeros(0, dtype=np.uint64)
        self.sorted_rows = np.zeros(0, dtype=np.int64)
        # The rows again by unit alone, for events that name only a unit (:meth:`unit_rows_at`).
        self.by_unit = np.zeros(0, dtype=np.uint64)
        self.by_unit_rows = np.zeros(0, dtype=np.int64)
        self.size = 0
        self.phase = np.zeros(1024, dtype=np.int16)
        self.arm = np.zeros(1024, dtype=np.int16)
        self.unit = np.zeros(1024, dtype=np.uint64)
        self.first_ns = np.zeros(1024, dtype=np.int64)
        self.calls = np.zeros((1024, TIMELINE_POINTS), dtype=np.int32)

    def add(
        self,
        phase: npt.NDArray[np.int16],
        arm: npt.NDArray[np.int16],
        unit: npt.NDArray[np.uint64],
        bucket: npt.NDArray[np.int16],
        times: npt.NDArray[np.int64],
    ) -> npt.NDArray[np.int64]:
        """Adds the calls; returns each one's row."""
        keys = mixed(unit, 0) ^ ((phase.astype(np.uint64) << np.uint64(48)) | (arm.astype(np.uint64) << np.uint64(32)))
        unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        at = np.asarray(np.searchsorted(self.sorted_keys, unique), dtype=np.int64)
        known = np.asarray(at < len(self.sorted_keys), dtype=bool)
        known[known] = self.sorted_keys[at[known]] == unique[known]
        rows = np.empty(len(unique), dtype=np.int64)
        rows[known] = self.sorted_rows[at[known]]
        new = np.flatnonzero(~known)
        if len(new):
            fresh = np.arange(self.size, self.size + len(new), dtype=np.int64)
            rows[new] = fresh
            self._grow(self.size + len(new))
            source = first[new]
            self.phase[fresh], self.arm[fresh], self.unit[fresh] = phase[source], arm[source], unit[source]
            self.first_ns[fresh] = np.iinfo(np.int64).max
            self.size += len(new)
            self.sorted_keys = np.insert(self.sorted_keys, at[new], unique[new])
            self.sorted_rows = np.insert(self.sorted_rows, at[new], fresh)
            order = np.argsort(self.unit[fresh], kind="stable")
            new_units = self.unit[fresh][order]
            where = np.searchsorted(self.by_unit, new_units, side="right")
            self.by_unit = np.insert(self.by_unit, where, new_units)
            self.by_unit_rows = np.insert(self.by_unit_rows, where, fresh[order])
        row_of = rows[inverse.reshape(-1)]
        np.add.at(self.calls, (row_of, bucket.astype(np.int64)), 1)
        np.minimum.at(self.first_ns, row_of, times)
        return row_of

    def unit_rows_at(
        self, unit: npt.NDArray[np.uint64], event_ns: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
        """For events naming only a unit: whether each finds a row, and the row: of the unit's rows (one per
        phase and arm) the one first exposed last at or before the event (the later row on a tie)."""
        low = np.searchsorted(self.by_unit, unit, side="left")
        high = np.searchsorted(self.by_unit, unit, side="right")
        best_row = np.full(len(unit), -1, dtype=np.int64)
        best_first = np.full(len(unit), np.iinfo(np.int64).min, dtype=np.int64)
        step = 0
        while True:
            live = np.flatnonzero(low + step < high)
            if not len(live):
                break
            rows = self.by_unit_rows[low[live] + step]
            first = self.first_ns[rows]
            better = (first <= event_ns[live]) & (
                (first > best_first[live]) | ((first == best_first[live]) & (rows > best_row[live]))
            )
            best_row[live[better]] = rows[better]
            best_first[live[better]] = first[better]
            step += 1
        return best_row >= 0, best_row

    def _grow(self, needed: int) -> None:
        if needed <= len(self.phase):
            return
        capacity = max(needed, 2 * len(self.phase))
        for name in ("phase", "arm", "unit", "first_ns", "calls"):
            old = getattr(self, name)
            grown = np.zeros((capacity, *old.shape[1:]), dtype=old.dtype)
            grown[: len(old)] = old
            setattr(self, name, grown)

    def table(self) -> pa.Table:
        n = self.size
        return pa.table(
            {
                "phase": pa.array(self.phase[:n], pa.int16()),
                "arm": pa.array(self.arm[:n], pa.int16()),
                "unit": pa.array(self.unit[:n], pa.uint64()),
                "calls": pa.array(self.calls[:n].sum(axis=1, dtype=np.int64), pa.int64()),
                "first_ns": pa.array(self.first_ns[:n], pa.int64()),
                "key": pa.array(np.arange(n, dtype=np.int64), pa.int64()),
            }
        )


def split_rows(values: list[bytes]) -> dict[bytes, list[int]]:
    """Row indexes per distinct value."""
    groups: dict[bytes, list[int]] = {}
    for index, value in enumerate(values):
        groups.setdefault(value, []).append(index)
    return groups


def take_rows(columns: dict[bytes, list[bytes]], rows: list[int]) -> dict[bytes, list[bytes]]:
    return {name: [values[i] for i in rows] for name, values in columns.items()}
