"""Which recorded calls a replay sends, and in what order.

A call belongs to the window by the time the router *received* it (``time_ns``), not by
its stream id: stream ids are the time Redis wrote the entry, and a record the router
spooled during a recorder or Redis outage reaches Redis minutes later. So each model's
stream is scanned, in pages, over stream ids
``[since - clock_skew, until + max_lateness + clock_skew]`` and filtered on ``time_ns``.
A record that arrived later than ``max_lateness`` after it was received is not seen.

Ordering by receive time with bounded memory: a late record shows up in the stream after
calls the router received later, so calls wait in a :class:`ReorderBuffer` (a heap keyed by
receive time) until the scan has passed ``receive + max_lateness``; after that no entry
still to come can be older. Exact order therefore holds up to ``max_lateness`` of traffic in
memory; the buffer's capacity (calls, and bytes of records) caps that, and past it the
oldest call is released early and any older call found afterwards is sent out of order
(counted as ``out_of_order``, never dropped). On-time calls arrive nearly sorted, so early
release keeps their order; only a late call older than what already left goes out of order.
``--max-lateness 0`` releases calls as they are read (fast start, no late records); a larger
capacity buys exact order for busier windows with memory.

Calls can also come from the archive (:mod:`splitstream.common.archive`): ``--source archive:URL``
reads the whole window there (partition pruning: only the hours it overlaps are listed and opened;
receive time, version, status and principal pushed down to Parquet, so row groups they exclude are not read);
with an archive configured beside Redis, the part of a window older than the stream's oldest entry
(trimmed by retention) is read from the archive and the rest from Redis, merged in receive-time
order: each stream entry from one of them (by its stream id), a request id the archive gave never
taken again from Redis.

Delivery is at least once, so the same request id can appear twice; a second copy reaches
Redis within the lateness window of the first, so :class:`RecentIds` remembers ids for that
long (and at most a capacity's worth) and drops repeats.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import xxhash

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import (
    CorruptEntry,
    RawEntry,
    UnsupportedSchema,
    decode_entry,
    decode_record,
    dropped_payloads,
    entry_text,
    entry_time_ns,
    read_entries,
    status_code,
    stream_id_at,
    stream_id_ms,
    stream_key,
)
from splitstream.common.redis_url import RedisClient
from splitstream.replayer.summary import SelectionSummary

T = TypeVar("T")

if TYPE_CHECKING:
    # pyarrow, through the archive's module: a replay with no archive does without (a quarter of its start).
    import pyarrow as pa

    from splitstream.common.archive import Archive


@dataclass(frozen=True, slots=True)
class StatusFilter:
    """Which recorded statuses to replay: OK calls, failed calls, and/or particular codes."""

    ok: bool = False
    any_error: bool = False
    codes: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, text: str) -> StatusFilter:
        """``"ok"``, ``"error"``, ``"INVALID_ARGUMENT,UNAVAILABLE"``, ``"3,14"`` or a mix (comma-separated).
        Raises ValueError naming the part it cannot read."""
        ok = any_error = False
        codes: set[int] = set()
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            if part.lower() == "ok":
                ok = True
            elif part.lower() in ("error", "errors"):
                any_error = True
            else:
                codes.add(status_code(part))
        if not (ok or any_error or codes):
            raise ValueError(f"empty status filter {text!r}")
        return cls(ok=ok, any_error=any_error, codes=frozenset(codes))

    def matches(self, code: int) -> bool:
        return (code == 0 and self.ok) or (code != 0 and self.any_error) or code in self.codes


@dataclass(frozen=True, kw_only=True)
class Selection:
    """What to read: a receive-time window ``[since_ns, until_ns)`` of some models, and filters.

    Empty ``versions``/``routing_key_hmacs``/``principals`` and ``statuses=None`` mean "any"."""

    models: tuple[str, ...]
    since_ns: int
    until_ns: int
    versions: frozenset[str] = frozenset()
    statuses: StatusFilter | None = None
    routing_key_hmacs: frozenset[str] = frozenset()
    #: Authenticated callers' names (``CallRecord.principal``); empty: any caller, unauthenticated ones too.
    principals: frozenset[str] = frozenset()
    sample: float = 1.0
    sample_seed: int = 0
    limit: int | None = None
    max_lateness_ns: int = 3_600_000_000_000
    clock_skew_ns: int = 5_000_000_000
    reorder_capacity: int = 100_000
    reorder_max_bytes: int = 256 * 1024 * 1024
    page_size: int = 200

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model is needed")
        if self.until_ns <= self.since_ns:
            raise ValueError("--until must be after --since")
        if not 0.0 < self.sample <= 1.0:
            raise ValueError("--sample must be a fraction in (0, 1]")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be at least 1")
        if self.max_lateness_ns < 0 or self.clock_skew_ns < 0:
            raise ValueError("--max-lateness and --clock-skew must not be negative")
        if self.reorder_capacity < 1 or self.page_size < 1 or self.reorder_max_bytes < 1:
            raise ValueError("--reorder-buffer, --reorder-buffer-mb and --page-size must be positive")

    @property
    def scan_start(self) -> str:
        """First stream id to read: a record is written at or after it is received (up to clock skew)."""
        return stream_id_at(max(self.since_ns - self.clock_skew_ns, 0))

    @property
    def scan_end(self) -> str:
        """Last stream id to read: a call received before ``until`` may reach Redis up to ``max_lateness`` later."""
        return stream_id_at(self.until_ns + self.max_lateness_ns + self.clock_skew_ns)

    def sampled(self, request_id: str) -> bool:
        """A fixed choice per request id (xxh3 with the seed), so two runs with one seed replay the same calls."""
        if self.sample >= 1.0:
            return True
        return xxhash.xxh3_64_intdigest(request_id.encode(), seed=self.sample_seed) < self.sample * 2.0**64


@dataclass(frozen=True, slots=True)
class SelectedCall:
    model: str
    stream_id: str
    receive_ns: int
    record: recorder_pb2.CallRecord


@dataclass(slots=True)
class SelectionStats:
    """What the scan met; goes into the summary so a user can tell "no traffic" from "all filtered"."""

    scanned: int = 0
    in_window: int = 0
    selected: int = 0
    duplicates: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    released_early: int = 0
    out_of_order: int = 0
    max_buffered: int = 0

    def summary(self) -> SelectionSummary:
        return SelectionSummary(
            scanned=self.scanned,
            in_window=self.in_window,
            selected=self.selected,
            duplicates=self.duplicates,
            skipped=dict(sorted(self.skipped.items())),
            released_early=self.released_early,
            out_of_order=self.out_of_order,
            max_buffered=self.max_buffered,
        )


class ReorderBuffer(Generic[T]):
    """Releases items in receive-time order once no item still to be read can be older.

    ``push`` what the scan admits; ``release(position_ns)`` after each entry read at stream
    position ``position_ns`` yields every item received before ``position_ns - horizon_ns``
    (entries further on were written at or after ``position_ns`` and received at most
    ``horizon_ns`` before they were written). Past ``capacity`` items, the oldest is released
    early, and so past ``max_bytes`` of items (each pushed with its size); an item older than one
    already released is still released (counted as out of order).
    """

    def __init__(self, *, horizon_ns: int, capacity: int, max_bytes: int = 1 << 62) -> None:
        self.horizon_ns = horizon_ns
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._heap: list[tuple[int, int, int, T]] = []
        self._sequence = 0
        self._last_released_ns: int | None = None
        self.released_early = 0
        self.out_of_order = 0
        self.max_buffered = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, receive_ns: int, item: T, size: int = 0) -> Iterator[T]:
        """Add ``item``; yields what had to be released early to stay within capacity."""
        heapq.heappush(self._heap, (receive_ns, self._sequence, size, item))
        self._sequence += 1
        self.bytes += size
        self.max_buffered = max(self.max_buffered, len(self._heap))
        while len(self._heap) > self.capacity or (self.bytes > self.max_bytes and len(self._heap) > 1):
            self.released_early += 1
            yield self._pop()

    def release(self, position_ns: int) -> Iterator[T]:
        watermark = position_ns - self.horizon_ns
        while self._heap and self._heap[0][0] < watermark:
            yield self._pop()

    def drain(self) -> Iterator[T]:
        """Everything left, oldest first (the scan is over: nothing older can come)."""
        while self._heap:
            yield self._pop()

    def _pop(self) -> T:
        receive_ns, _, size, item = heapq.heappop(self._heap)
        self.bytes -= size
        if self._last_released_ns is not None and receive_ns < self._last_released_ns:
            self.out_of_order += 1
        else:
            self._last_released_ns = receive_ns
        return item


class RecentIds:
    """Request ids seen within ``horizon_ns`` of stream time (and at most ``capacity`` of them).

    A duplicate is a resend of a batch the recorder had written but not acknowledged, so it is
    written within the lateness window of the first copy; older ids can be forgotten."""

    def __init__(self, *, horizon_ns: int, capacity: int) -> None:
        self.horizon_ns = horizon_ns
        self.capacity = capacity
        self._seen: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def seen_before(self, request_id: str, position_ns: int) -> bool:
        """Whether ``request_id`` was seen; remembers it either way."""
        horizon = position_ns - self.horizon_ns
        while self._seen and (len(self._seen) >= self.capacity or next(iter(self._seen.values())) < horizon):
            self._seen.popitem(last=False)
        if request_id in self._seen:
            return True
        self._seen[request_id] = position_ns
        return False


def admit(entry: RawEntry, selection: Selection, stats: SelectionStats) -> SelectedCall | None:
    """The call in ``entry`` if the selection wants it. Cheap fields first (``time_ns``, ``version``,
    ``status``, sampling on ``request_id``), the protobuf decode only for survivors. Raises
    :class:`CorruptEntry` or :class:`UnsupportedSchema` for an entry that is not a readable record."""
    receive_ns = entry_time_ns(entry)
    if not selection.since_ns <= receive_ns < selection.until_ns:
        return None
    stats.in_window += 1
    version = entry_text(entry, "version")
    if selection.versions and version not in selection.versions:
        return None
    status = entry_text(entry, "status")
    if selection.statuses is not None and status:
        try:
            code = status_code(status)
        except ValueError:
            raise CorruptEntry(f"entry {entry.stream_id}: unknown status {status!r}") from None
        if not selection.statuses.matches(code):
            return None
    principal = entry_text(entry, "principal")
    if selection.principals and principal and principal not in selection.principals:
        return None
    request_id = entry_text(entry, "request_id")
    if request_id and not selection.sampled(request_id):
        return None
    record = decode_entry(entry).record
    # A request left out for size is named in the record's tags: a call the replay counts as not
    # replayed, not a corrupt entry.
    if not record.request_id or not (record.HasField("request") or "request" in dropped_payloads(record)):
        raise CorruptEntry(f"entry {entry.stream_id}: record has no request id or no request payload")
    if not request_id and not selection.sampled(record.request_id):
        return None
    if selection.statuses is not None and not status and not selection.statuses.matches(record.status_code):
        return None
    if selection.routing_key_hmacs and record.routing_key_hmac not in selection.routing_key_hmacs:
        return None
    if selection.principals and record.principal not in selection.principals:
        return None
    return SelectedCall(model=record.model, stream_id=entry.stream_id, receive_ns=receive_ns, record=record)


async def model_calls(
    redis: RedisClient, model: str, selection: Selection, stats: SelectionStats
) -> AsyncGenerator[SelectedCall, None]:
    """One model's selected calls, de-duplicated, in receive-time order (see the module docstring)."""
    horizon = selection.max_lateness_ns + selection.clock_skew_ns
    buffer: ReorderBuffer[SelectedCall] = ReorderBuffer(
        horizon_ns=horizon, capacity=selection.reorder_capacity, max_bytes=selection.reorder_max_bytes
    )
    recent = RecentIds(horizon_ns=horizon, capacity=max(4 * selection.reorder_capacity, 100_000))
    try:
        async for entry in read_entries(
            redis, model, start=selection.scan_start, end=selection.scan_end, page_size=selection.page_size
        ):
            stats.scanned += 1
            position_ns = stream_id_ms(entry.stream_id) * 1_000_000
            try:
                call = admit(entry, selection, stats)
            except CorruptEntry:
                stats.skipped["corrupt"] += 1
                call = None
            except UnsupportedSchema:
                stats.skipped["unsupported_schema"] += 1
                call = None
            if call is not None:
                if recent.seen_before(call.record.request_id, position_ns):
                    stats.duplicates += 1
                else:
                    for early in buffer.push(call.receive_ns, call, len(entry.fields.get(b"record", b""))):
                        yield early
            for ready in buffer.release(position_ns):
                yield ready
        for ready in buffer.drain():
            yield ready
    finally:
        stats.released_early += buffer.released_early
        stats.out_of_order += buffer.out_of_order
        stats.max_buffered = max(stats.max_buffered, buffer.max_buffered)


def _id_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def _archived_selection(
    table: pa.Table,
    model: str,
    selection: Selection,
    stats: SelectionStats,
    before_id: tuple[int, int] | None = None,
) -> list[SelectedCall]:
    """The selected calls of one part of the archive (rows de-duplicated and in receive-time order); with
    ``before_id``, only rows of stream entries older than that id (the others are read from Redis)."""
    statuses = selection.statuses
    calls: list[SelectedCall] = []
    receive = table["receive_time"].cast("int64").to_pylist()
    for stream_id, receive_ns, data in zip(
        table["stream_id"].to_pylist(), receive, table["record"].to_pylist(), strict=True
    ):
        if before_id is not None and _id_key(stream_id) >= before_id:
            continue
        stats.scanned += 1
        stats.in_window += 1
        try:
            record = decode_record(data)
        except UnsupportedSchema:
            stats.skipped["unsupported_schema"] += 1
            continue
        except Exception:  # protobuf's DecodeError: archived as the raw bytes Redis held
            stats.skipped["corrupt"] += 1
            continue
        if not record.request_id or not (record.HasField("request") or "request" in dropped_payloads(record)):
            stats.skipped["corrupt"] += 1
            continue
        if not selection.sampled(record.request_id):
            continue
        if statuses is not None and not statuses.matches(record.status_code):
            continue
        if selection.routing_key_hmacs and record.routing_key_hmac not in selection.routing_key_hmacs:
            continue
        if selection.principals and record.principal not in selection.principals:
            continue
        calls.append(SelectedCall(model=model, stream_id=stream_id, receive_ns=receive_ns, record=record))
    return calls


async def archive_model_calls(
    archive: Archive,
    model: str,
    selection: Selection,
    stats: SelectionStats,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    before_id: str | None = None,
) -> AsyncGenerator[SelectedCall, None]:
    """``model``'s selected calls received in ``[since_ns, until_ns)`` (default: the selection's window)
    from the archive, de-duplicated, in receive-time order, read a part (a row group) at a time (in a
    thread), so neither a long window nor a busy hour sits in memory at once. With ``before_id``, only
    those of stream entries older than that stream id."""
    from splitstream.common.archive import ArchiveQuery, iter_calls  # loaded already: the archive was opened

    before = _id_key(before_id) if before_id is not None else None
    statuses = selection.statuses
    pushed: frozenset[int] | None = None
    if statuses is not None and not statuses.any_error:
        pushed = statuses.codes | ({0} if statuses.ok else frozenset())
    # Every filter the columns can answer goes to the Parquet reader: row groups it excludes are never read.
    query = ArchiveQuery(
        model=model,
        since_ns=selection.since_ns if since_ns is None else since_ns,
        until_ns=selection.until_ns if until_ns is None else until_ns,
        versions=selection.versions,
        status_codes=pushed,
        failed_only=statuses is not None and statuses.any_error and not statuses.ok,
        principals=selection.principals,
    )
    hours = iter_calls(archive, query, columns=["stream_id", "receive_time", "record"])

    def next_hour() -> list[SelectedCall] | None:
        table = next(hours, None)
        return None if table is None else _archived_selection(table, model, selection, stats, before)

    while (calls := await asyncio.to_thread(next_hour)) is not None:
        for call in calls:
            yield call


async def straddling_model_calls(
    redis: RedisClient, archive: Archive, model: str, selection: Selection, stats: SelectionStats
) -> AsyncGenerator[SelectedCall, None]:
    """Redis, with the part of the window older than the stream's oldest entry read from the archive.

    Entries retention removed were written before the oldest one left, so received before its id's time
    (plus clock skew): the archive is read up to there, and Redis for the whole window, the two merged
    in receive-time order. Each stream entry is taken from one of them: from the archive only the rows of
    entries older than Redis's oldest (archived rows keep their stream id), the rest from Redis. Receive
    times alone cannot split them (a receive time and the id Redis gave differ by up to the clock skew, a
    late record's by more): split by receive time, the entries of Redis's first ``clock_skew`` would be
    read from both, each then dropped as a duplicate. A call still in both (one request recorded twice) shares
    its receive time in both, so the archive's copy comes first and the Redis copy is dropped; the ids are
    remembered for the last ``max_lateness + clock_skew`` before the boundary, where Redis's calls can be."""
    oldest = cast(list[tuple[bytes, Any]], await redis.xrange(stream_key(model), min="-", max="+", count=1))
    oldest_id = oldest[0][0].decode() if oldest else None
    boundary_ns = stream_id_ms(oldest_id) * 1_000_000 + selection.clock_skew_ns if oldest_id else selection.until_ns
    horizon_ns = boundary_ns - selection.max_lateness_ns - selection.clock_skew_ns
    older = (
        archive_model_calls(
            archive, model, selection, stats, until_ns=min(selection.until_ns, boundary_ns), before_id=oldest_id
        )
        if selection.since_ns < boundary_ns
        else None
    )
    recent = model_calls(redis, model, selection, stats)
    archived_ids: set[str] = set()
    try:
        head = await anext(older, None) if older is not None else None
        call = await anext(recent, None)
        while head is not None or call is not None:
            if head is not None and (call is None or head.receive_ns <= call.receive_ns):
                if head.receive_ns >= horizon_ns:
                    archived_ids.add(head.record.request_id)
                yield head
                head = await anext(older, None) if older is not None else None
                continue
            assert call is not None
            if call.record.request_id in archived_ids:
                stats.duplicates += 1
            else:
                yield call
            call = await anext(recent, None)
    finally:
        await recent.aclose()
        if older is not None:
            await older.aclose()


async def select_calls(
    redis: RedisClient | None,
    selection: Selection,
    stats: SelectionStats,
    *,
    archive: Archive | None = None,
    archive_only: bool = False,
) -> AsyncGenerator[SelectedCall, None]:
    """Every model's selected calls merged in receive-time order, up to ``selection.limit``: from Redis,
    from the archive alone (``archive_only``), or from Redis with the archive behind it (``archive``)."""

    def source_of(model: str) -> AsyncGenerator[SelectedCall, None]:
        if archive is not None and (archive_only or redis is None):
            return archive_model_calls(archive, model, selection, stats)
        assert redis is not None
        if archive is not None:
            return straddling_model_calls(redis, archive, model, selection, stats)
        return model_calls(redis, model, selection, stats)

    sources = [source_of(model) for model in selection.models]
    heads: list[tuple[int, int, SelectedCall]] = []
    try:
        for index, source in enumerate(sources):
            first = await anext(source, None)
            if first is not None:
                heads.append((first.receive_ns, index, first))
        heapq.heapify(heads)
        while heads:
            if selection.limit is not None and stats.selected >= selection.limit:
                return
            _, index, call = heapq.heappop(heads)
            stats.selected += 1
            yield call
            following = await anext(sources[index], None)
            if following is not None:
                heapq.heappush(heads, (following.receive_ns, index, following))
    finally:
        for source in sources:
            await source.aclose()
