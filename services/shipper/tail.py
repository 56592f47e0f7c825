"""Tail the routers' logs into the mirror, joining shadows to their calls, and move each log's cursor.

The cursor of a log may only pass an entry once the entry is *settled*: its record acknowledged
by the recorder, or dropped and counted. So each batch the mirror
cuts gets a ticket holding, per log, the position before the oldest entry not in that batch or an
earlier one (entries still queued in the mirror, calls waiting for their shadows); once every
ticket up to one is settled, its positions are written as the logs' cursors and the segments
wholly behind them deleted. A shipper killed (or stopped) at any point restarts from the cursors: what was
settled but not yet committed is shipped again (readers drop duplicates by request id), nothing
is skipped.

The log is the spool. When the recorder goes away the mirror lets go of what it held and calls
:meth:`Tail.rewind`: the tail goes back to the last settled position and, while the outage lasts,
reads only a batch ahead (what the mirror tries when it reconnects). So the log grows (up to the
router's cap, past which the router drops new calls and counts them), its segments are kept until
every entry in them is settled, and it ships in order once the recorder is back.

A call logged with shadows waits here for its ``SHADOWS`` entry (appended when the shadows end)
at most ``shadow_wait_s`` after it was read, and at most ``max_held`` calls wait at once; past
either it is shipped without them (counted). A ``SHADOWS`` entry whose call already left (or was
shipped before a restart) is counted and dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import functools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitstream.common.errors import ConfigError
from splitstream.common.wal import (
    CALL,
    FEEDBACK,
    HTTP,
    SHADOWS,
    SHIPPER_LOCK_FILE,
    STREAM,
    CallEntry,
    Position,
    WalReader,
    decode_call,
    decode_feedback,
    decode_shadows,
    segment_name,
)
from splitstream.shipper.mirror import RecordMirror

log = structlog.get_logger()

#: Calls queued in the mirror at most: the log is the buffer, the queue only feeds the batches.
QUEUE_DEPTH = 4096
#: How often settled positions are written as cursors.
COMMIT_INTERVAL_S = 0.1
#: New log bytes that are read at once rather than left to wait for more (about a full batch of small calls).
READ_NOW_BYTES = 1 << 20
#: New log bytes read on the event loop rather than in a thread (a peek saw no more than this).
READ_INLINE_BYTES = 1 << 20


class TailMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.entries = Counter(
            "splitstream_shipper_log_entries", "Log entries read, by kind", ["kind"], registry=registry
        )
        self.damaged = Counter(
            "splitstream_shipper_log_damaged",
            "Log ranges skipped: damaged (bad framing or checksum), torn (an append cut short by a crash), "
            "undecodable (an entry that checks but does not parse)",
            ["reason"],
            registry=registry,
        )
        self.damaged_bytes = Counter(
            "splitstream_shipper_log_damaged_bytes", "Bytes of the log skipped as damaged or torn", registry=registry
        )
        self.shadows = Counter(
            "splitstream_shipper_shadows",
            "Shadow outcomes: joined (to their call), missing (call shipped without them), orphaned (call gone)",
            ["result"],
            registry=registry,
        )
        self.reads = Counter(
            "splitstream_shipper_log_reads",
            "Passes over the logs for new entries: new entries are seen by a stat every 20 ms and read once they "
            "waited a quarter of --record-batch-interval-ms (at most 0.25 s) or add up to 1 MiB; caught up, one "
            "every 0.25 s",
            registry=registry,
        )
        self.held = Gauge("splitstream_shipper_calls_waiting_for_shadows", "Calls held for shadows", registry=registry)
        self.pending = Gauge(
            "splitstream_shipper_log_pending_bytes", "Log bytes past the cursors (not yet settled)", registry=registry
        )
        for kind in ("call", "stream", "shadows", "feedback", "http"):
            self.entries.labels(kind)
        for reason in ("damaged", "torn", "undecodable"):
            self.damaged.labels(reason)
        for result in ("joined", "missing", "orphaned"):
            self.shadows.labels(result)


_KIND_NAMES = {CALL: "call", STREAM: "stream", SHADOWS: "shadows", FEEDBACK: "feedback", HTTP: "http"}


class Tail:
    def __init__(
        self,
        directories: Sequence[str | Path],
        mirror: RecordMirror,
        registry: CollectorRegistry,
        *,
        shadow_wait_s: float = 10.0,
        max_held: int = 10_000,
        poll_s: float = 0.02,
        idle_poll_s: float = 0.25,
        linger_s: float | None = None,
        read_entries: int = 1024,
    ) -> None:
        self.metrics = TailMetrics(registry)
        self.readers = [WalReader(d, on_damage=functools.partial(self._damaged, d)) for d in directories]
        self.mirror = mirror
        mirror.settlement = self
        self.shadow_wait_s = shadow_wait_s
        self.max_held = max_held
        self.poll_s = poll_s
        #: The longest wait between reads while every log is caught up: reading every 20 ms cost an idle shipper
        #: 6 % of a core (59 ms of CPU a second, measured), one per router on a host. Between reads a peek (two
        #: stats) every ``poll_s`` sees new entries; this read catches what a peek cannot see.
        self.idle_poll_s = idle_poll_s
        #: How long new entries wait in the log to be read with those that follow (see :meth:`_due`): a quarter of
        #: the mirror's batch interval, which bounds how long a batch waits to fill, and at most ``idle_poll_s``.
        self.linger_s = min(mirror.settings.batch_interval_s / 4, idle_poll_s) if linger_s is None else linger_s
        #: Whether the last read found every log at its end (rather than stopped for want of room).
        self._caught_up = False
        #: When a read is due whatever the peeks say, and since when peeked entries wait to be read (None: none).
        self._read_by = 0.0
        self._waiting_since: float | None = None
        #: Per log: what its last peek saw (None: not peeked since the last read, or a read must look).
        self._peeked: list[int | None] = [None] * len(directories)
        self.read_entries = read_entries
        #: Per log: the position past the last entry handed on (read in a thread, handed on here).
        self._consumed: list[Position] = [reader.committed for reader in self.readers]
        #: Calls waiting for their shadows, oldest first: (log, request id) → (entry, deadline).
        self._held: collections.OrderedDict[tuple[int, str], tuple[CallEntry, float]] = collections.OrderedDict()
        #: Cut batches not yet known settled, oldest first: [ticket, positions, settled].
        self._tickets: collections.deque[list[Any]] = collections.deque()
        self._next_ticket = 0
        self._settled: list[Position] | None = None
        #: The newest settled positions (committed or not): where a rewind goes back to.
        self._settled_upto: list[Position] = [reader.committed for reader in self.readers]
        #: Bumped by each rewind: a read in flight meanwhile is thrown away.
        self._generation = 0
        self._closing = False
        self._locks: list[int] = []
        self._lock_files: list[int] = []
        self.metrics.held.set_function(lambda: len(self._held))
        self.metrics.pending.set_function(lambda: sum(r.pending_bytes() for r in self.readers))

    def _damaged(self, directory: str | Path, reason: str, size: int, where: Position) -> None:
        self.metrics.damaged.labels(reason).inc()
        self.metrics.damaged_bytes.inc(size)
        log.warning(
            "log range skipped",
            reason=reason,
            bytes=size,
            segment=str(Path(directory) / segment_name(where[0])),
            offset=where[1],
        )

    # -- settlement (called by the mirror) -------------------------------------------------------

    def _safe(self) -> list[Position]:
        positions = list(self._consumed)
        for (index, _), (entry, _) in self._held.items():
            positions[index] = min(positions[index], entry.position[1])
        return positions

    def cut(self, queued: list[Any]) -> int:
        positions = self._safe()
        for item in queued:
            if item is not None:
                index, position = item
                positions[index] = min(positions[index], position)
        self._next_ticket += 1
        self._tickets.append([self._next_ticket, positions, False])
        return self._next_ticket

    def settle(self, ticket: int) -> None:
        for item in self._tickets:
            if item[0] == ticket:
                item[2] = True
                break
        while self._tickets and self._tickets[0][2]:
            self._settled = self._settled_upto = self._tickets.popleft()[1]

    def rewind(self) -> None:
        """The mirror let go of every batch not settled and of its queue: read them from the log again, from
        the last settled positions. Calls waiting for their shadows are read again too (they are after it)."""
        self._generation += 1
        self._tickets.clear()
        self._held.clear()
        self._consumed = list(self._settled_upto)
        for reader, position in zip(self.readers, self._settled_upto, strict=True):
            reader.position = position
        self._read_by = 0.0  # read again at once, not after a linger
        self._peeked = [None] * len(self.readers)

    # -- the loop --------------------------------------------------------------------------------

    def open_locks(self) -> None:
        """Open every log's ``shipper.lock`` (not yet taken): one that cannot be opened is a configuration error,
        found before the shipper says it serves, so that a router's child refuses its start, not its first read."""
        for reader in self.readers:
            try:
                self._lock_files.append(os.open(reader.directory / SHIPPER_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600))
            except OSError as error:  # a directory named so, a directory the shipper may not write to
                raise ConfigError(f"--log-dir: {error.strerror or error}: {error.filename}") from None

    async def _lock(self) -> None:
        """Take every log's ``shipper.lock`` (holding our pid), waiting while another shipper holds one: the
        child of a restarted router waits for the old child to finish its drain."""
        if not self._lock_files:
            self.open_locks()
        for reader, fd in zip(self.readers, self._lock_files, strict=True):
            waited = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if self._closing:  # stopped while another shipper ships: nothing of this log is ours
                        return
                    if not waited:
                        log.info("another shipper ships this log; waiting", log_dir=str(reader.directory))
                        waited = True
                    await asyncio.sleep(0.2)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._locks.append(fd)

    async def run(self) -> None:
        await self._lock()
        committer = asyncio.create_task(self._commit_loop())
        try:
            while not self._closing:
                read = 0
                if self._due():
                    try:
                        read = await self._read_once()
                    except Exception:
                        log.exception("log tail failed; retrying")
                        await asyncio.sleep(1.0)
                self._expire()
                if read and not self._caught_up:  # a backlog, and room for it: read on at once
                    await asyncio.sleep(0)
                else:
                    await asyncio.sleep(self.poll_s)
        finally:
            committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await committer

    def _due(self) -> bool:
        """Whether to read the logs now. A read found one or two entries at a low call rate, and each cost the
        shipper a thread hop, a directory scan and an open (half its CPU at 100 calls/s, measured); the mirror cuts
        a batch only every ``--record-batch-interval-ms`` anyway. So new entries are first seen by
        :meth:`WalReader.peek` (two stats) and read once they have waited ``linger_s`` or add up to
        ``READ_NOW_BYTES``; a read every ``idle_poll_s`` whatever the peeks say catches what they cannot see."""
        now = time.monotonic()
        if not self._caught_up:
            return True
        waiting = 0
        for index, reader in enumerate(self.readers):
            pending = self._peeked[index] = reader.peek()
            if pending is None:
                return True
            waiting += pending
        if now >= self._read_by:
            return True
        if not waiting:
            self._waiting_since = None
            return False
        if self._waiting_since is None:
            self._waiting_since = now
        return waiting >= READ_NOW_BYTES or now - self._waiting_since >= self.linger_s

    async def _read_once(self) -> int:
        """Entries handed on from every log; sets whether each log was read to its end."""
        self.metrics.reads.inc()
        self._waiting_since = None
        self._read_by = time.monotonic() + self.idle_poll_s
        total = 0
        caught_up = True
        for index, reader in enumerate(self.readers):
            # While the recorder is away only a batch is read ahead: the log holds the rest, read once it is back.
            depth = self.mirror.settings.batch_size if self.mirror.outage else QUEUE_DEPTH
            room = depth - self.mirror.queued
            if room <= 0 or self.mirror.closing:
                caught_up = False
                break
            generation = self._generation
            peeked, self._peeked[index] = self._peeked[index], None
            wanted = min(room, self.read_entries)
            if peeked is not None and peeked <= READ_INLINE_BYTES:
                # A few entries of a page-cache file: read here, as cheap as handing the read to a thread.
                entries = reader.read(wanted)
            else:
                entries = await asyncio.to_thread(reader.read, wanted)
            if generation != self._generation:  # rewound while reading: these are read again
                reader.position = self._consumed[index]
                caught_up = False
                break
            if len(entries) >= wanted:  # fewer: the read reached the log's end (reading again at once found none)
                caught_up = False
            for entry in entries:
                if not self._hand_on(index, entry.kind, entry.payload, entry.start):
                    reader.position = entry.start  # no room now: read it again next time
                    caught_up = False
                    break
                self._consumed[index] = entry.end
                total += 1
            else:  # all handed on: past them too what the read skipped (damage, the end of older segments)
                self._consumed[index] = max(self._consumed[index], reader.position)
        self._caught_up = caught_up
        return total

    def _hand_on(self, index: int, kind: int, payload: bytes, start: Position) -> bool:
        self.metrics.entries.labels(_KIND_NAMES.get(kind, "call")).inc()
        try:
            if kind in (CALL, STREAM, HTTP):
                call = decode_call(kind, payload)
                call.position = (index, start)
                if call.shadows_expected:
                    self._hold(index, call)
                else:
                    self.mirror.offer(call)
            elif kind == SHADOWS:
                request_id, shadows = decode_shadows(payload)
                held = self._held.pop((index, request_id), None)
                if held is None:
                    self.metrics.shadows.labels("orphaned").inc()
                else:
                    held[0].shadows = shadows
                    self.metrics.shadows.labels("joined").inc()
                    self.mirror.offer(held[0])
            elif kind == FEEDBACK:
                events = decode_feedback(payload)
                if len(events) > self.mirror.feedback_room():
                    self.metrics.entries.labels("feedback").inc(-1)
                    return False
                self.mirror.offer_feedback(events, (index, start))
        except (ValueError, UnicodeDecodeError) as error:
            self.metrics.damaged.labels("undecodable").inc()
            log.warning("log entry does not parse; skipped", error=str(error)[:200], kind=kind)
        return True

    def _hold(self, index: int, call: CallEntry) -> None:
        key = (index, call.request_id)
        if key in self._held:  # the same id twice (a client reusing ids): ship the first as it is
            self._release(key)
        self._held[key] = (call, time.monotonic() + self.shadow_wait_s)
        while len(self._held) > self.max_held:
            self._release(next(iter(self._held)))

    def _release(self, key: tuple[int, str]) -> None:
        call, _ = self._held.pop(key)
        self.metrics.shadows.labels("missing").inc()
        self.mirror.offer(call)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._held:
            key, (_, deadline) = next(iter(self._held.items()))
            if deadline > now:
                break
            self._release(key)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(COMMIT_INTERVAL_S)
            await self.commit()

    async def commit(self) -> None:
        if not self._tickets and not self._held and self.mirror.idle:
            # Nothing in flight: what was read is settled, entries or not (damage skipped, an older segment
            # ended), so the cursor moves on and the segments behind it go even while no call comes.
            self._settled = self._settled_upto = self._safe()
        settled, self._settled = self._settled, None
        if settled is None or all(p <= r.committed for p, r in zip(settled, self.readers, strict=True)):
            return  # nothing new to write: no thread woken ten times a second for nothing
        try:
            await asyncio.to_thread(self._commit, settled)
        except OSError as error:  # a stale cursor only ships settled entries again
            log.error("log cursor not written", error=str(error)[:300])

    def _commit(self, positions: list[Position]) -> None:
        for reader, position in zip(self.readers, positions, strict=True):
            reader.commit(position)

    async def close(self) -> None:
        """Stop reading. Calls still waiting for their shadows stay in the log (the cursor stays before them):
        the next shipper reads them again, with their shadows."""
        self._closing = True

    async def read_rest(self) -> int:
        """Once the loop has stopped: read the logs to their end and hand on what the loop had not read yet.

        A router SIGTERMs its shipper after its last call is logged, and the loop reads only every few
        milliseconds up to a linger: stopped with no drain delay, a router's last calls stayed in its log
        until its next start. Readers start again from what was handed on, so a read the loop's cancel cut
        short is read again rather than skipped. Returns the entries handed on; stops when the logs end or
        the mirror has no room (the rest stays in the log, its cursor before it)."""
        if len(self._locks) < len(self.readers):  # stopped while another shipper held a log: not ours to read
            return 0
        for index, reader in enumerate(self.readers):
            reader.position = self._consumed[index]
            self._peeked[index] = None
        total = 0
        while True:
            read = await self._read_once()
            total += read
            if self._caught_up or not read:
                return total
