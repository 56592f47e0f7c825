"""The archive loop: read the streams as a consumer group, write Parquet, acknowledge, raise the mark.

Delivery, step by step, and why nothing is lost or kept twice:

1. Every call and feedback stream is read with ``XREADGROUP`` in the group ``splitstream-archive``
   (created at id 0: a new archive starts from the oldest entry Redis still holds). Several archivers
   share the work; each entry goes to one of them and stays *pending* for it until acknowledged.
2. Entries wait in a per-stream buffer until it holds ``max_file_rows`` entries or ``max_file_bytes``,
   or its oldest entry has waited ``flush_interval_s``. The buffer becomes one file per hour partition,
   named after the first and last stream id it holds.
3. The buffer's files are built and written by a child process (:mod:`splitstream.archiver.builder`)
   while the loop reads on. Only after every file of the buffer is written (an object store's upload
   complete) are its entries acknowledged (``XACK``). A crash before that leaves them pending: the
   same archiver, restarted under the same ``--consumer`` name, reads its own pending entries first
   and writes the same files under the same names again; any other archiver takes them over
   (``XAUTOCLAIM``) once they have been idle ``claim_idle_s``, and writes them under its own
   batching, so a reader may meet a request id twice: readers de-duplicate by request id.
4. After acknowledging, the stream's mark (``splitstream:archived:{<stream>}``) is raised by a script
   that reads the group's state inside Redis: the oldest pending entry, or past the last delivered
   one when none is pending. Computed from the group, not from this archiver's own progress, so with
   several archivers it is never past an entry another one holds; the script only ever raises it.

A failed write is counted and retried with backoff, and nothing new is read meanwhile: Redis holds the
backlog (and with ``--trim-archived`` the recorder keeps it). On SIGTERM the loop stops reading,
the buffered entries are written and acknowledged, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, cast

import pyarrow as pa
import pyarrow.fs as pafs
import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from splitstream.archiver.builder import Builder, UploadFailed, pack_entries
from splitstream.archiver.config import ArchiverSettings
from splitstream.archiver.metrics import ArchiverMetrics
from splitstream.archiver.tables import Entry, id_key
from splitstream.common.archive import Archive, partition_dir
from splitstream.common.records import (
    FEEDBACK_PREFIX,
    LUA_ID_LESS,
    STREAM_PREFIX,
    archive_mark_key,
    blob_key,
    stream_id_ms,
)
from splitstream.common.redis_url import RedisClient

#: KEYS: the stream, its mark. ARGV: the group. Raises the mark to the group's low-water mark (oldest
#: pending id, else the id after the last delivered); returns the mark, or false without the group.
#: How long the drain waits for the XREADGROUP a SIGTERM interrupted (its block is at most 1 s).
_DRAIN_READ_WAIT_S = 3.0
_RAISE_MARK = (
    LUA_ID_LESS
    + """
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return false end
local last = nil
for _, g in ipairs(groups) do
  local name, delivered
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] end
    if g[i] == 'last-delivered-id' then delivered = g[i + 1] end
  end
  if name == ARGV[1] then last = delivered end
end
if not last then return false end
local mark
local pending = redis.call('XPENDING', KEYS[1], ARGV[1])
if pending[1] > 0 then
  mark = pending[2]
else
  local ms, seq = parse_id(last)
  mark = string.format('%d-%d', ms, seq + 1)
end
local current = redis.call('GET', KEYS[2])
if current and not id_less(current, mark) then return current end
redis.call('SET', KEYS[2], mark)
return mark
"""
)


@dataclass(slots=True)
class Batch:
    """Entries as one read returned them: packed for the builder process (:func:`pack_entries`), or
    the pairs themselves for a builder thread; their stream ids, to acknowledge them; about their bytes."""

    data: bytes | list[Any]
    ids: list[bytes]
    size: int


@dataclass(slots=True)
class Buffer:
    """A stream's entries read and not yet on their way to a file, kept as the reads' packed
    :class:`Batch`\\ es: no object per entry field waits here (nor for the garbage collector to walk)."""

    #: Pack each read (for a builder process); False: keep the pairs as read (a builder thread).
    packed: bool = True
    batches: list[Batch] = field(default_factory=list)
    count: int = 0
    size: int = 0  # bytes
    since: float = 0.0  # monotonic time the oldest entry was read
    #: False once entries older than some already held were added (claimed): the builder sorts them.
    ordered: bool = True

    def add(self, pairs: Sequence[Any]) -> None:
        """``(stream id, [name, value, ...])`` pairs (bytes), as Redis's reply holds them."""
        if not pairs:
            return
        if not self.count:
            self.since = time.monotonic()
        self.put([self.batch(pairs)])

    def batch(self, pairs: Sequence[Any]) -> Batch:
        ids = [pair[0] for pair in pairs]
        if self.packed:
            data = pack_entries(pairs)
            return Batch(data, ids, len(data))
        size = sum(map(len, chain.from_iterable([pair[1] for pair in pairs]))) + 64 * len(pairs)
        return Batch(list(pairs), ids, size)

    def put(self, batches: list[Batch], *, front: bool = False) -> None:
        if front:
            self.batches[:0] = batches
        else:
            self.batches.extend(batches)
        self.count += sum(len(batch.ids) for batch in batches)
        self.size += sum(batch.size for batch in batches)

    def take(self) -> list[Batch]:
        batches, self.batches, self.count, self.size = self.batches, [], 0, 0
        self.since = time.monotonic()
        return batches

    def ids(self) -> set[bytes]:
        return {stream_id for batch in self.batches for stream_id in batch.ids}


def entry_pairs(entries: Sequence[Entry]) -> list[tuple[bytes, list[bytes]]]:
    return [(entry.stream_id.encode(), entry.flat) for entry in entries]


def stream_model(stream: str) -> tuple[str, str]:
    """``splitstream:calls:m`` → ``("calls", "m")``; ``splitstream:feedback:m`` → ``("feedback", "m")``."""
    if stream.startswith(STREAM_PREFIX):
        return "calls", stream.removeprefix(STREAM_PREFIX)
    return "feedback", stream.removeprefix(FEEDBACK_PREFIX)


class Archiver:
    def __init__(
        self, redis: RedisClient, archive: Archive, settings: ArchiverSettings, metrics: ArchiverMetrics
    ) -> None:
        self.redis = redis
        self.archive = archive
        self.settings = settings
        self.metrics = metrics
        self.log = structlog.get_logger()
        self.buffers: dict[str, Buffer] = {}
        #: Streams whose name is not UTF-8 (not archived), each logged and counted once.
        self._skipped: set[bytes] = set()
        self._raise_mark = redis.register_script(_RAISE_MARK)
        #: XREADGROUP replies as Redis sent them (fields as flat lists, no dict per entry); a cluster
        #: client's callbacks are shared by all its users, so it keeps its dicts.
        self._reader: Any = redis
        if not isinstance(redis, RedisCluster):
            self._reader = Redis(connection_pool=redis.connection_pool)
            self._reader.set_response_callback("XREADGROUP", _as_sent)
        self._next_scan = 0.0
        self._next_claim = 0.0
        self._retry_s = 0.0
        #: Decodes, builds and writes the files in a child process (see :mod:`splitstream.archiver.builder`).
        self.builder = Builder(archive, in_process=settings.builder_process)
        #: The file being written in the background while the next one's entries are read (at most one).
        self._flushing: asyncio.Task[None] | None = None
        self._in_flight: set[bytes] = set()
        #: The XREADGROUP in progress (kept so the drain can take its reply).
        self._reading: asyncio.Future[Any] | None = None

    # -- the loop --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the file-building process (else the first file waits for it)."""
        await self.builder.start()

    async def close(self, *, abandon: bool = False) -> None:
        """Stop the file-building process (after :meth:`drain`); with ``abandon`` (the drain ran out of
        time) at once, its write left unfinished: none of its entries was acknowledged."""
        if abandon:
            self.builder.abandon()
            if self._flushing is not None:  # fails with the killed child: expected, not worth a traceback
                self._flushing.add_done_callback(lambda task: task.cancelled() or task.exception())
        else:
            await self.builder.close()

    def unwritten(self) -> int:
        """Entries read and not yet acknowledged: buffered, or in the write under way."""
        return sum(buffer.count for buffer in self.buffers.values()) + len(self._in_flight)

    async def run(self) -> None:
        """Archive until cancelled; Redis and store failures are counted, logged and retried."""
        with contextlib.suppress(UploadFailed):
            await self.start()  # a child that cannot start is started again (and counted) by the first write
        this = asyncio.current_task()
        while True:
            # A cancellation (SIGTERM) can be lost on Python 3.11: asyncio.wait_for, which redis-py sends
            # each command under, returns the command's result instead of raising when the cancel comes
            # as the command completes; this loop then ran on, the shutdown never reached the drain, and
            # the process was killed at its deadline. The request still counts, so it is honoured here.
            if this is not None and this.cancelling():
                raise asyncio.CancelledError
            try:
                await self.step()
                self._retry_s = 0.0
            except (RedisError, OSError) as error:
                self.metrics.redis_errors.inc()
                await self._back_off("redis failed", error)
            except UploadFailed as error:
                self.metrics.upload_errors.inc()
                await self._back_off("archive write failed", error)

    async def _back_off(self, event: str, error: BaseException) -> None:
        self._retry_s = min(max(self._retry_s * 2, 0.5), self.settings.retry_max_s)
        self.log.warning(event, error=str(error)[:300], retry_in_s=self._retry_s)
        await asyncio.sleep(self._retry_s)

    async def step(self) -> None:
        now = time.monotonic()
        if now >= self._next_scan:
            new = await self.discover()
            if new:
                await self.read_own_pending(new)
            await self.update_lag()
            self._next_scan = now + self.settings.scan_interval_s
        if now >= self._next_claim:
            await self.claim_stale()
            self._next_claim = now + max(self.settings.claim_idle_s / 4, 0.2)
        if self._flushing is not None and self._flushing.done():
            await self._settle()  # a failed write raises here (its entries are back in their buffer)
        if await self.flush(due_only=True, wait=False):
            return  # the next step reads (a caller watching the mark sees each file's progress first)
        if not self.buffers:
            await asyncio.sleep(min(self.settings.scan_interval_s, 1.0))
            return
        await self.read_new()

    async def drain(self) -> None:
        """On SIGTERM: finish the write in progress, write and acknowledge what is buffered. A store that
        fails now leaves the entries pending: the next archiver writes them."""
        reading, self._reading = self._reading, None
        if reading is not None:  # the read a SIGTERM interrupted: its entries are ours, pending in Redis
            # Bounded: a read stuck on its socket must not hold the drain; its entries then stay pending
            # under this consumer (read again when it starts, or claimed by another archiver).
            with contextlib.suppress(RedisError, OSError):  # TimeoutError is an OSError
                self._buffer_reply(await asyncio.wait_for(reading, _DRAIN_READ_WAIT_S))
        with contextlib.suppress(UploadFailed, RedisError, OSError):
            await self._settle()  # a failure put its entries back in their buffer: written below
        try:
            await self.flush(due_only=False)
        except (UploadFailed, RedisError, OSError) as error:
            self.log.warning("could not write the buffered entries on shutdown; they stay pending", error=str(error))

    # -- reading ---------------------------------------------------------------------------

    async def discover(self) -> list[str]:
        """Find the call and feedback streams (SCAN) and create the group on new ones (at id 0); the new ones."""
        new = []
        for prefix in (STREAM_PREFIX, FEEDBACK_PREFIX):
            async for raw in self.redis.scan_iter(match=prefix + "*", count=1000, _type="stream"):
                stream = self._stream_name(raw)
                if stream is None or stream in self.buffers:
                    continue
                if self.settings.models and stream_model(stream)[1] not in self.settings.models:
                    continue
                try:
                    await self.redis.xgroup_create(stream, self.settings.group, id="0")
                except ResponseError as error:
                    if "BUSYGROUP" not in str(error):
                        raise
                self.buffers[stream] = Buffer(packed=self.settings.builder_process)
                new.append(stream)
        return new

    def _stream_name(self, raw: bytes | str) -> str | None:
        """The stream's name, or None for one that is not UTF-8: Redis keys are bytes, and such a key (written by
        hand, or by another program) names no model, nor a path in the archive. It is left alone, logged and counted
        once, and every other stream archived (its name used to end the archiver at each scan, and so all
        archiving)."""
        if isinstance(raw, str):
            return raw
        try:
            return raw.decode()
        except UnicodeDecodeError:
            if raw not in self._skipped:
                self._skipped.add(raw)
                self.metrics.skipped_streams.inc()
                self.log.warning(
                    "a stream whose name is not UTF-8 is not archived",
                    stream=raw.decode("utf-8", errors="backslashreplace"),
                )
            return None

    async def read_own_pending(self, streams: Sequence[str]) -> None:
        """Entries this consumer read before a crash and never acknowledged, first, in id order. A file
        whose upload completed before the crash (but whose entries were never acknowledged) starts at
        the oldest of them: it is found by that name and its entries are written again as one file, so
        the object is replaced rather than copied; the rest go on to files as usual."""
        for stream in streams:
            pending: list[Entry] = []
            cursor = "0"
            while True:
                reply = await self._reader.xreadgroup(
                    self.settings.group, self.settings.consumer, {stream: cursor}, count=self.settings.read_count
                )
                entries = [entry for _, read in self._entries(reply) for entry in read]
                if not entries:
                    break
                pending.extend(entries)
                cursor = entries[-1].stream_id
            if pending:
                self.log.info("re-archiving entries left pending by this consumer", stream=stream, entries=len(pending))
            while pending:
                last = await asyncio.to_thread(self._uploaded_file_end, stream, pending[0])
                if last is None:
                    break
                end = id_key(last)
                batch = [entry for entry in pending if id_key(entry.stream_id) <= end]
                self.log.info("rewriting a file uploaded but not acknowledged", stream=stream, entries=len(batch))
                await self._write_batches(stream, [self.buffers[stream].batch(entry_pairs(batch))], True)
                pending = pending[len(batch) :]
            self.buffers[stream].add(entry_pairs(pending))

    def _uploaded_file_end(self, stream: str, first: Entry) -> str | None:
        """The last stream id of an archived file that starts at ``first`` (an upload a crash left
        unacknowledged), or None. One listing of ``first``'s partition. Blocking."""
        kind, model = stream_model(stream)
        field = b"time_ns" if kind == "calls" else b"receive_ns"
        try:
            receive_ns = int(first.fields.get(field, b""))
        except ValueError:
            receive_ns = stream_id_ms(first.stream_id) * 1_000_000
        directory = self.archive.path(partition_dir(kind, model, receive_ns))
        prefix = f"{first.stream_id}_"
        try:
            infos = self.archive.filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        except (OSError, pa.ArrowException) as error:
            raise UploadFailed(f"{directory} cannot be listed: {error}") from error
        for info in infos:
            if info.base_name.startswith(prefix) and info.base_name.endswith(".parquet"):
                return info.base_name.removeprefix(prefix).removesuffix(".parquet")
        return None

    async def read_new(self) -> None:
        room = min(self.settings.max_file_rows - b.count for b in self.buffers.values())
        count = max(1, min(self.settings.read_count, room))
        waiting = [b.since for b in self.buffers.values() if b.count]
        block_s = 0.05 if self._flushing is not None else 1.0  # soon back to see the write in flight end
        if waiting:
            block_s = max(0.0, min(block_s, min(waiting) + self.settings.flush_interval_s - time.monotonic()))
        # Shielded: a SIGTERM during the read lets the reply arrive and be buffered (the drain waits for it
        # and writes it), rather than leave what Redis delivered pending until this consumer starts again.
        self._reading = asyncio.ensure_future(
            self._read_streams(list(self.buffers), count=count, block_ms=max(1, int(block_s * 1000)))
        )
        try:
            reply = await asyncio.shield(self._reading)
        except ResponseError as error:
            if "NOGROUP" in str(error):  # a stream deleted (or its group destroyed): forget it, find it again
                await self._forget_lost_streams()
                return
            raise
        self._reading = None
        self._buffer_reply(reply)

    def _buffer_reply(self, reply: Any) -> None:
        for stream, pairs in self._pairs(reply):
            if stream in self.buffers:
                self.buffers[stream].add(pairs)
        self.metrics.buffered.set(self.unwritten())

    async def _read_streams(self, streams: list[str], *, count: int, block_ms: int) -> Any:
        """One XREADGROUP of every stream; on a cluster, one per slot, concurrently (a command's keys must
        share a slot), their replies joined. COUNT is per stream either way."""
        if not isinstance(self.redis, RedisCluster):
            return await self._reader.xreadgroup(
                self.settings.group, self.settings.consumer, dict.fromkeys(streams, ">"), count=count, block=block_ms
            )
        by_slot: dict[int, list[str]] = {}
        for stream in streams:
            by_slot.setdefault(self.redis.keyslot(stream), []).append(stream)
        replies = await asyncio.gather(
            *(
                self.redis.xreadgroup(
                    self.settings.group, self.settings.consumer, dict.fromkeys(group, ">"), count=count, block=block_ms
                )
                for group in by_slot.values()
            )
        )
        return [item for reply in replies for item in cast(list[Any], reply or [])]

    async def _forget_lost_streams(self) -> None:
        """Streams whose group is gone (the stream deleted, or the group destroyed by hand) leave the
        read; their buffered entries cannot be acknowledged any more and are dropped (a stream recreated
        later, or a group created again, is found by the next scan and read from its start)."""
        for stream in list(self.buffers):
            groups = []
            with contextlib.suppress(ResponseError):
                groups = cast(list[dict[Any, Any]], await self.redis.xinfo_groups(stream))
            if not any(_text(g.get("name", b"")) == self.settings.group for g in groups):
                del self.buffers[stream]
        self._next_scan = 0.0

    async def claim_stale(self) -> None:
        """Take over entries another archiver read and left unacknowledged for ``claim_idle_s`` (it died)."""
        idle_ms = int(self.settings.claim_idle_s * 1000)
        for stream in list(self.buffers):
            start = "0-0"
            while True:
                reply = cast(
                    list[Any],
                    await self.redis.xautoclaim(
                        stream,
                        self.settings.group,
                        self.settings.consumer,
                        idle_ms,
                        start_id=start,
                        count=self.settings.read_count,
                    ),
                )
                start = _text(reply[0])
                claimed = [(raw_id, fields) for raw_id, fields in reply[1] if fields is not None]
                buffer = self.buffers[stream]
                known = buffer.ids() | self._in_flight
                # Our own entries are claimed back to us too: only the others are new.
                new = [
                    Entry.from_dict(_text(raw_id), fields) for raw_id, fields in claimed if _bytes(raw_id) not in known
                ]
                if new:  # older than what was read already: the builder sorts (files hold stream id order)
                    buffer.add(entry_pairs(new))
                    buffer.ordered = False
                    self.metrics.claimed.inc(len(new))
                deleted = reply[2] if len(reply) > 2 else []
                if deleted:  # trimmed away while pending: nothing left to archive
                    await self.redis.xack(stream, self.settings.group, *deleted)
                if start in ("0-0", "0"):
                    break

    def _pairs(self, reply: Any) -> list[tuple[str, list[Any]]]:
        """Each stream's ``(id, [name, value, ...])`` pairs in an XREADGROUP reply, as Redis sent them
        (an entry deleted while pending comes back empty: left out)."""
        if isinstance(self.redis, RedisCluster):  # the fields as dicts (a cluster's callbacks are shared)
            return [(stream, entry_pairs(entries)) for stream, entries in self._entries(reply)]
        streams = reply.items() if isinstance(reply, dict) else reply or []  # RESP3 sends a map, RESP2 pairs
        return [(_text(raw_stream), [pair for pair in items if pair[1]]) for raw_stream, items in streams]

    def _entries(self, reply: Any) -> list[tuple[str, list[Entry]]]:
        """Each stream's entries in an XREADGROUP reply (an entry deleted while pending comes back empty)."""
        out = []
        streams = reply.items() if isinstance(reply, dict) else reply or []  # RESP3 sends a map, RESP2 pairs
        for raw_stream, items in streams:
            if isinstance(self.redis, RedisCluster):  # the fields as dicts (a cluster's callbacks are shared)
                entries = [Entry.from_dict(_text(raw_id), fields) for raw_id, fields in items if fields]
            else:
                entries = [Entry(raw_id.decode(), fields) for raw_id, fields in items if fields]
            out.append((_text(raw_stream), entries))
        return out

    # -- writing ---------------------------------------------------------------------------

    def _due(self, buffer: Buffer, *, rows_only: bool = False) -> bool:
        if not buffer.count:
            return False
        if buffer.count >= self.settings.max_file_rows or buffer.size >= self.settings.max_file_bytes:
            return True
        return not rows_only and time.monotonic() - buffer.since >= self.settings.flush_interval_s

    async def flush(self, *, due_only: bool, rows_only: bool = False, wait: bool = True) -> int:
        """Start writing the buffers that are due (all with ``due_only`` False), one file set at a time;
        with ``wait``, return once the last is written. How many were started.

        The write runs in the background while the loop reads the next entries (decoding, Parquet and
        the upload in the builder process). Raises the failure of a write (UploadFailed, RedisError)
        when it is awaited."""
        started = 0
        for stream, buffer in list(self.buffers.items()):
            if buffer.count and (not due_only or self._due(buffer, rows_only=rows_only)):
                await self._settle()
                ordered = buffer.ordered
                batches = buffer.take()
                buffer.ordered = True
                self._in_flight = {stream_id for batch in batches for stream_id in batch.ids}
                self._flushing = asyncio.ensure_future(self._flush(stream, buffer, batches, ordered))
                started += 1
        if wait:
            await self._settle()
        return started

    async def _settle(self) -> None:
        """Wait for the write in flight. Shielded: a SIGTERM mid-upload lets the upload and its
        acknowledgement finish (the drain waits for it)."""
        task = self._flushing
        if task is None:
            return
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._flushing = None
                self._in_flight = set()

    async def _flush(self, stream: str, buffer: Buffer, batches: list[Batch], ordered: bool) -> None:
        try:
            await self._write_batches(stream, batches, ordered)
        except BaseException:
            # Back to the front of the buffer (entries read since are newer): written again, same names.
            buffer.put(batches, front=True)
            buffer.ordered = buffer.ordered and ordered
            raise

    async def _write_batches(self, stream: str, batches: list[Batch], ordered: bool) -> None:
        """Write the entries' files (in the builder process), then acknowledge them and raise the mark."""
        kind, model = stream_model(stream)
        data = [batch.data for batch in batches]
        built = await self.builder.write(kind, model, data, ordered, None)
        if built.blobs:  # records that reference blobs: fetched here (the builder has no Redis), written with them
            built = await self.builder.write(kind, model, data, ordered, await self._blobs(built.blobs))
        ids = [stream_id for batch in batches for stream_id in batch.ids]  # bytes: redis-py passes them as they are
        for start in range(0, len(ids), 1000):
            await self.redis.xack(stream, self.settings.group, *ids[start : start + 1000])
        await self._raise_mark(keys=[stream, archive_mark_key(stream)], args=[self.settings.group])
        self.metrics.records.labels(model, kind).inc(len(ids))
        self.metrics.bytes.labels(model, kind).inc(built.bytes)
        self.metrics.files.labels(model, kind).inc(built.files)
        if built.missing_blobs:
            self.metrics.missing_blobs.inc(built.missing_blobs)
        if built.corrupt:
            self.metrics.corrupt.inc(built.corrupt)
        self.metrics.buffered.set(sum(b.count for b in self.buffers.values()))
        self.log.debug("archived", stream=stream, entries=len(ids), files=built.files, bytes=built.bytes)

    async def _blobs(self, digests: Sequence[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for start in range(0, len(digests), 100):
            chunk = digests[start : start + 100]
            keys = [blob_key(digest) for digest in chunk]
            # A cluster refuses one MGET over several slots; blobs hash anywhere, so it is asked per slot.
            fetch = self.redis.mget_nonatomic if isinstance(self.redis, RedisCluster) else self.redis.mget
            values = cast(list[bytes | None], await fetch(keys))
            found.update({digest: value for digest, value in zip(chunk, values, strict=True) if value is not None})
        return found

    # -- lag -------------------------------------------------------------------------------

    async def update_lag(self) -> None:
        """Entries and seconds the archive is behind each stream (the group's lag and pending entries)."""
        for stream in list(self.buffers):
            try:
                groups = cast(list[dict[Any, Any]], await self.redis.xinfo_groups(stream))
            except ResponseError:
                continue
            group = next((g for g in groups if _text(g.get("name", b"")) == self.settings.group), None)
            if group is None:
                continue
            behind = int(group.get("lag") or 0) + int(group.get("pending") or 0)
            self.metrics.lag_entries.labels(stream).set(behind)
            seconds = 0.0
            mark = await self.redis.get(archive_mark_key(stream))
            if behind:
                first = await self.redis.xrange(stream, min=_text(mark) if mark else "-", count=1)
                if first:
                    seconds = max(0.0, time.time() - stream_id_ms(_text(first[0][0])) / 1000)
            self.metrics.lag_seconds.labels(stream).set(seconds)


def _as_sent(response: object, **options: object) -> object:
    return response


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
