"""Where the analysis reads calls and feedback: Redis, the archive, or the archive below Redis.

Every source hands the readers (:mod:`splitstream.analysis.loading`) the same thing: pages of a stream's
readable fields as columns of bytes, as Redis stores them, so one reader serves all three and the numbers do
not depend on where the data came from. The archive's Parquet columns are turned into those bytes column by
column (Arrow casts); its files are read in a thread, an hour partition at a time.

A window that straddles both (``--archive``) reads the archive only below the oldest entry Redis still
holds (by stream id, which the archive keeps), then Redis: an entry is read from one place, and a call
archived and still in Redis is read once; the readers de-duplicate calls by request id all the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import pyarrow as pa
import pyarrow.compute as pc

from splitstream.analysis.loading import (
    CALL_FIELDS,
    FEEDBACK_FIELDS,
    CallPage,
    RawPage,
    Window,
    bounds,
    entry_field,
    page_columns,
    read_pages,
)
from splitstream.common.archive import Archive, ArchiveQuery, iter_calls, iter_feedback, read_calls
from splitstream.common.records import feedback_key, stream_key
from splitstream.common.redis_url import RedisClient

#: Archive call columns → the stream entry's field names.
_CALL_COLUMNS = {
    "request_id": b"request_id",
    "receive_time": b"time_ns",
    "status": b"status",
    "latency_ms": b"latency_ms",
    "arm": b"arm",
    "assignment": b"assignment",
    "phase": b"phase",
    "routing_key_hmac": b"unit",
    "principal": b"principal",
    "ttft_ms": b"ttft_ms",
    "tokens": b"tokens",
    "prompt_tokens": b"prompt_tokens",
    "completion_tokens": b"completion_tokens",
}
_FEEDBACK_COLUMNS = {
    "metric": b"metric",
    "request_id": b"request_id",
    "unit": b"unit",
    "value": b"value",
    "event_time": b"event_ns",
    "idempotency_key": b"idempotency_key",
}
#: The type of :attr:`CallPage.record`.
RecordOf = Callable[[int], Awaitable[bytes | None]]
assert set(_CALL_COLUMNS.values()) == set(CALL_FIELDS)
assert set(_FEEDBACK_COLUMNS.values()) == set(FEEDBACK_FIELDS)
#: A page of feedback entries as columns.
FeedbackPage = dict[bytes, list[bytes]]


@dataclass(frozen=True, slots=True)
class RedisSource:
    """The recorder's streams, read in pages (XRANGE)."""

    redis: RedisClient

    async def call_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[CallPage]:
        start, end = bounds(window)
        async for page in read_pages(self.redis, stream_key(model), start=start, end=end, page_size=page_size):
            yield CallPage(page_columns(page, CALL_FIELDS), _record_in(page))

    async def feedback_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[FeedbackPage]:
        start, end = bounds(window)
        async for page in read_pages(self.redis, feedback_key(model), start=start, end=end, page_size=page_size):
            yield page_columns(page, FEEDBACK_FIELDS)


def _record_in(page: RawPage) -> RecordOf:
    async def record(row: int) -> bytes | None:
        return entry_field(page[row][1], b"record")

    return record


@dataclass(frozen=True, slots=True)
class ArchiveSource:
    """The archive (``--source archive:URL``). ``below``: stream ids (``ms-seq``) per stream key under which
    rows are read, the rest being Redis's (see :class:`StraddlingSource`); absent: every row."""

    archive: Archive
    below: dict[str, str | None] | None = None
    #: ``--archive-engine``: ``duckdb`` aggregates the window in SQL where it can
    #: (:mod:`splitstream.analysis.sql.duckdb_engine`), ``python`` reads it in pages like Redis.
    engine: Literal["duckdb", "python"] = "duckdb"

    async def call_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[CallPage]:
        query = ArchiveQuery(model=model, since_ns=window.since_ns, until_ns=window.until_ns)
        columns = [*_CALL_COLUMNS, "stream_id"]
        parts = iter_calls(self.archive, query, columns=columns)  # a row group at a time, not an hour
        limit = self._limit(stream_key(model))
        while (table := await asyncio.to_thread(_next, parts)) is not None:
            table = _below(table, limit)
            for offset in range(0, table.num_rows, page_size):
                part = table.slice(offset, page_size)
                yield CallPage(_as_fields(part, _CALL_COLUMNS), self._record_in(model, part))

    async def feedback_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[FeedbackPage]:
        # Archived by the time Redis received them, like the entry ids Redis pages by.
        start, end = (int(bound) * 1_000_000 for bound in bounds(window))
        parts = iter_feedback(self.archive, model, start, end + 1_000_000)  # a row group at a time, not the window
        limit = self._limit(feedback_key(model))
        while (table := await asyncio.to_thread(_next, parts)) is not None:
            table = _below(table, limit)
            for offset in range(0, table.num_rows, page_size):
                yield _as_fields(table.slice(offset, page_size), _FEEDBACK_COLUMNS)

    def _limit(self, key: str) -> str | None:
        """The stream id to read below; None: no limit."""
        return None if self.below is None else self.below.get(key)

    def _record_in(self, model: str, part: pa.Table) -> RecordOf:
        async def record(row: int) -> bytes | None:
            request_id = part["request_id"][row].as_py()
            receive_ns = part["receive_time"].cast(pa.int64())[row].as_py()
            query = ArchiveQuery(model=model, since_ns=receive_ns, until_ns=receive_ns + 1)
            found = await asyncio.to_thread(read_calls, self.archive, query, columns=["request_id", "record"])
            rows = found.filter(pc.equal(found["request_id"], request_id))
            return cast(bytes, rows["record"][0].as_py()) if rows.num_rows else None

        return record


@dataclass(frozen=True, slots=True)
class AggregatesSource:
    """``--aggregates FILE``: the per-unit rows the aggregation query produced on another engine (Parquet or CSV)."""

    path: Path

    def call_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[CallPage]:
        raise NotImplementedError("aggregates carry per-unit rows, not calls")

    def feedback_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[FeedbackPage]:
        raise NotImplementedError("aggregates carry per-unit rows, not events")


@dataclass(frozen=True, slots=True)
class StraddlingSource:
    """``--archive URL`` beside Redis: per stream, the archive below Redis's oldest entry, then Redis."""

    redis: RedisClient
    archive: Archive

    async def call_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[CallPage]:
        key = stream_key(model)
        archived = ArchiveSource(self.archive, {key: await _oldest_id(self.redis, key)})
        async for page in archived.call_pages(model, window, page_size):
            yield page
        async for page in RedisSource(self.redis).call_pages(model, window, page_size):
            yield page

    async def feedback_pages(self, model: str, window: Window, page_size: int) -> AsyncIterator[FeedbackPage]:
        key = feedback_key(model)
        archived = ArchiveSource(self.archive, {key: await _oldest_id(self.redis, key)})
        async for page in archived.feedback_pages(model, window, page_size):
            yield page
        async for page in RedisSource(self.redis).feedback_pages(model, window, page_size):
            yield page


async def _oldest_id(redis: RedisClient, key: str) -> str | None:
    """The id of the oldest entry of ``key``; None when the stream is empty or absent (all is archived)."""
    entries = await redis.xrange(key, count=1)
    if not entries:
        return None
    raw = entries[0][0]
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _next(tables: Iterator[pa.Table]) -> pa.Table | None:
    return next(tables, None)


def _below(table: pa.Table, limit: str | None) -> pa.Table:
    """The rows whose stream id is below ``limit`` (None: every row, e.g. when Redis holds nothing)."""
    if limit is None or not table.num_rows:
        return table
    ms, _, seq = limit.partition("-")
    parts = pc.split_pattern(table["stream_id"], "-")
    row_ms = pc.cast(pc.list_element(parts, 0), pa.int64())
    row_seq = pc.cast(pc.list_element(parts, 1), pa.int64())
    earlier = pc.or_(pc.less(row_ms, int(ms)), pc.and_(pc.equal(row_ms, int(ms)), pc.less(row_seq, int(seq or 0))))
    return table.filter(earlier)


def _as_fields(table: pa.Table, names: dict[str, bytes]) -> dict[bytes, list[bytes]]:
    """Arrow columns as a stream entry's fields: text as its bytes, numbers as Redis holds them (times as
    integer nanoseconds), nulls as absent (``b""``)."""
    out: dict[bytes, list[bytes]] = {}
    for column, field in names.items():
        values = table[column]
        if pa.types.is_timestamp(values.type):
            values = values.cast(pa.int64())
        out[field] = pc.fill_null(values.cast(pa.string()).cast(pa.binary()), b"").to_pylist()
    return out
