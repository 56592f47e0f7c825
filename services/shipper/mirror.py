r"""Ship logged calls to the recorder, losing nothing while there is room.

The shipper's tail (:mod:`splitstream.shipper.tail`) reads the routers' logs and
``offer()``\ s each call entry here, with the log position that is safe to commit
once it is delivered. A background task turns queued calls into CallRecords, batches
them by count, bytes or time and streams the batches to the recorder on one
long-lived ``Recorder/Record`` stream, keeping each batch until its ack arrives.
Every batch, once acknowledged or dropped (counted), is *settled* through
the :class:`Settlement` given, which is what lets the log's cursor move past it.

The log is the spool: nothing is written to disk a second time. When the recorder
is unreachable or refusing (e.g. its Redis is down), the batches it did not
acknowledge and everything queued are let go and the tail is *rewound*
(:meth:`Settlement.rewind`) to the oldest position not yet settled, so it reads
them from the log again once the stream is back, in the order they were logged.
While the recorder is slow (``max_unacked_batches`` in flight) no batch is cut:
the queue fills, the tail stops reading, and the log grows (up to the router's
cap). Delivery is at least once: a batch acknowledged after an older one that was
not is sent again after a rewind, and readers drop duplicates by request id.

A spool left by a shipper from before the log (``*.seg``/``*.spool`` in the first
log directory) is shipped first, oldest entry first, and removed once empty, so an
upgrade loses nothing.

Nothing may block the rest for ever. A batch is at most ``batch_max_bytes``; a
record larger than that alone keeps its exposure (metadata, status, timings) but
loses its largest payloads, named in the ``splitstream.payload-dropped`` tag. A
batch the recorder refuses as too large (RESOURCE_EXHAUSTED: its receive limit is
below our cap) lowers the cap to that limit and is split when resent, which also
drains a spool written before the cap existed. A batch refused as malformed is
dropped at once; one refused otherwise (INTERNAL, ...) ``max_refusals`` times is
resent in halves until the one record at fault is found and dropped. Records the
recorder rejects one by one are named in its ack.
Every such loss is counted in ``records_dropped{reason}``.

Outcome events (``FEEDBACK`` log entries) travel the same way: their own bounded queue, the
same batches (``EncodedRecordBatch.feedback``, after the batch's records), the same log
positions, acks and rewinds; their losses are counted in ``feedback_dropped{reason}`` (a damaged
legacy spool entry's events are not: its header counts records only).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.service_auth import token_metadata
from splitstream.common.tls import PLAINTEXT, ClientTls
from splitstream.common.wal import FALLBACK, HAS_RESPONSE, PINNED, RETRIED, CallEntry
from splitstream.shipper.batch_cutter import BATCH_OVERHEAD, RECORD_OVERHEAD, BatchCutter, batch_key, count_items
from splitstream.shipper.spool import Damage, Spool

log = structlog.get_logger()

SCHEMA_VERSION = 1
RECORD_METHOD = "/splitstream.v1.Recorder/Record"
#: Event-loop time the batch builder takes before it yields to calls (a record costs ~3-10 µs).
_SLICE_S = 50e-6
#: Final statuses that say the recorder (or the way to it) is down, not that it refuses this batch.
_OUTAGE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        # A wrong address or credentials refuse every batch alike: keep spooling until it is fixed.
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.OK,
    }
)


_DROP_REASONS = (
    "queue_full",
    "spool_corrupt",
    "rejected",
    "refused",
    "too_large",
    "unrecordable",
)


class Settlement(Protocol):
    """Where the mirror reports each batch it cut and, later, settled (acknowledged or dropped).

    ``cut`` gets the log positions of what is still queued (their entries are in no batch yet), so the
    position it records for the batch never passes them. ``rewind`` says the mirror let go of every batch
    not settled and of its queue (the recorder went away): they are to be read from the log again."""

    def cut(self, queued: list[Any]) -> int: ...

    def settle(self, ticket: int) -> None: ...

    def rewind(self) -> None: ...


class _NoSettlement:
    def cut(self, queued: list[Any]) -> int:
        return 0

    def settle(self, ticket: int) -> None:
        pass

    def rewind(self) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class MirrorSettings:
    recorder_address: str
    queue_size: int = 100_000
    batch_size: int = 256
    #: Largest batch sent. Keep it well below the recorder's receive limit (its ``--max-message-bytes``,
    #: 128 MiB by default), which refuses a larger batch whole; a record larger than this alone is sent
    #: without its largest payloads (tagged ``splitstream.payload-dropped``). 64 MiB: half the recorder's
    #: limit, and a call as large as the router takes (its own 64 MiB limit) with a small answer is
    #: still recorded whole; up to ``max_unacked_batches`` of them may be in flight.
    batch_max_bytes: int = 64 << 20
    batch_interval_s: float = 0.2
    max_unacked_batches: int = 8
    ack_timeout_s: float = 5.0
    flush_timeout_s: float = 5.0
    #: Bytes of serialized events the feedback queue holds at most (beside ``queue_size`` events): events are
    #: small (~100 bytes) but a request id may be 16 KiB, and 100,000 of those would be 1.6 GB.
    feedback_queue_max_bytes: int = 64 << 20
    #: Times the recorder may end the stream on the same oldest batch with a status that is no outage
    #: (INTERNAL, UNKNOWN, ...) before that batch is dropped and counted, so it cannot block the rest.
    max_refusals: int = 3
    #: TLS to the recorder; its files are read again for every new stream (a rotated client certificate).
    recorder_tls: ClientTls = PLAINTEXT
    #: Sent on the Record stream so a recorder that checks it takes our records ("": none sent).
    service_token: str = field(default="", repr=False)


@dataclass(slots=True)
class _Sent:
    sequence: int
    batch: bytes  # serialized RecordBatch without sequence (what the spool stores)
    records: int
    events: int
    #: Set on the last part of a spool entry: acknowledging it commits the entry.
    spool_position: tuple[int, int] | None
    from_spool: bool
    #: Set on the last part of a batch cut from the queue: its settlement ticket.
    ticket: int | None = None


class MirrorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches_sent = Counter(
            "splitstream_shipper_batches_sent",
            "Record batches acknowledged by the recorder",
            ["source"],
            registry=registry,
        )
        self.records_dropped = Counter(
            "splitstream_shipper_records_dropped",
            "Calls not recorded: queue_full, spool_corrupt (damaged entry of a spool left by an older shipper), "
            "rejected (the recorder refused the record or its batch as malformed), "
            "refused (a batch the recorder kept failing on), too_large (over batch_max_bytes even without payloads), "
            "unrecordable (a call the mirror could not turn into a record)",
            ["reason"],
            registry=registry,
        )
        self.payloads_dropped = Counter(
            "splitstream_shipper_payloads_dropped",
            "Records recorded without their largest payloads (tag splitstream.payload-dropped), by reason",
            ["reason"],
            registry=registry,
        )
        self.rewinds = Counter(
            "splitstream_shipper_rewinds",
            "Times the recorder went away with batches unacknowledged or queued, and the tail went back to "
            "read them from the log again",
            registry=registry,
        )
        self.spool_damage = Counter(
            "splitstream_shipper_spool_damaged_entries",
            "Damaged spool ranges skipped (their records, when known, count as dropped: spool_corrupt)",
            registry=registry,
        )
        self.stream_failures = Counter(
            "splitstream_shipper_recorder_stream_failures",
            "Streams to the recorder that failed (an outage, a refusal): each is retried after a backoff",
            registry=registry,
        )
        self.errors = Counter(
            "splitstream_shipper_errors",
            "Unexpected errors in the mirror's loop (logged; the loop restarts)",
            registry=registry,
        )
        self.queue_depth = Gauge("splitstream_shipper_queue_depth", "Calls waiting to be batched", registry=registry)
        self.spool_bytes = Gauge(
            "splitstream_shipper_spool_bytes",
            "Bytes not yet acknowledged in a spool left by a shipper from before the log",
            registry=registry,
        )
        self.feedback_dropped = Counter(
            "splitstream_shipper_feedback_dropped",
            "Outcome events accepted but not recorded: queue_full, rejected (by the "
            "recorder), refused, too_large (reasons as for records), ignored (by a recorder older than feedback)",
            ["reason"],
            registry=registry,
        )
        self.feedback_recorded = Counter(
            "splitstream_shipper_feedback_recorded",
            "Outcome events the recorder acknowledged: written, or duplicate (idempotency key seen before)",
            ["result"],
            registry=registry,
        )
        self.feedback_queue_depth = Gauge(
            "splitstream_shipper_feedback_queue_depth", "Outcome events waiting to be batched", registry=registry
        )
        for reason in _DROP_REASONS:
            self.records_dropped.labels(reason)
            self.feedback_dropped.labels(reason)
        self.feedback_dropped.labels("ignored")
        for result in ("written", "duplicate"):
            self.feedback_recorded.labels(result)


class RecordMirror:
    def __init__(
        self,
        settings: MirrorSettings,
        spool: Spool | None,
        registry: CollectorRegistry,
        settlement: Settlement | None = None,
    ) -> None:
        """``spool``: one left by a shipper from before the log, shipped before anything logged (None: none)."""
        self.settings = settings
        self.settlement: Settlement = settlement or _NoSettlement()
        self.spool = spool
        self.metrics = MirrorMetrics(registry)
        self.metrics.queue_depth.set_function(lambda: len(self._queue))
        self.metrics.spool_bytes.set_function(lambda: self._spool_bytes)
        self.metrics.feedback_queue_depth.set_function(lambda: len(self._feedback))
        if spool is not None:
            spool.on_damage = self._count_damage
        self._queue: collections.deque[CallEntry] = collections.deque()
        #: Serialized FeedbackEvents (routing keys already HMACs), bounded like the call queue, and the log
        #: position each came from.
        self._feedback: collections.deque[bytes] = collections.deque()
        self._feedback_positions: collections.deque[Any] = collections.deque()
        self._feedback_bytes = 0
        #: A record taken from the queue that did not fit in the last batch: it opens the next one.
        self._carry: bytes | None = None
        self._carry_position: Any = None
        self._building = False
        self._wake = asyncio.Event()
        #: Batches a recorder refused (no outage: INTERNAL, RESOURCE_EXHAUSTED, ...), sent again first, as they
        #: were cut, so that the refusal count and halving of the oldest one make progress.
        self._resend: collections.deque[_Sent] = collections.deque()
        #: Set by each ack: a mirror waiting for room in flight (or for a spool entry's ack) goes on.
        self._acked = asyncio.Event()
        self._closing = False
        self._stopping = asyncio.Event()
        self._spool_bytes = 0 if spool is None else spool.pending_bytes
        self._task: asyncio.Task[None] | None = None
        self._sequence = 0
        self._cutter = BatchCutter(
            settings.batch_max_bytes,
            on_payloads_dropped=self.metrics.payloads_dropped.labels("too_large").inc,
            on_too_large=self.metrics.records_dropped.labels("too_large").inc,
            on_event_too_large=self.metrics.feedback_dropped.labels("too_large").inc,
        )
        #: Serialized ``CallRecord.phase`` fields by phase id (see :meth:`_phase_field`).
        self._phases: dict[str, bytes] = {}
        #: (key of the oldest unacknowledged batch, times the recorder refused it).
        self._refusals: tuple[int, int] = (0, 0)
        self._told_ignored = False  # a recorder older than feedback: said once
        self._outage = False

    # -- the request path ------------------------------------------------------------------

    @property
    def outage(self) -> bool:
        """The recorder is away (or a legacy spool ships first): the tail reads only a batch ahead."""
        return self._outage or self.spool is not None

    def room(self) -> int:
        """How many more calls the queue takes now (the tail reads no more than that: the log waits)."""
        return 0 if self._closing else max(self.settings.queue_size - len(self._queue), 0)

    @property
    def idle(self) -> bool:
        """Nothing offered is outside a cut batch (queued, carried or in a batch being built)."""
        return not self._has_queued() and not self._building

    @property
    def queued(self) -> int:
        """Calls and events waiting to be batched."""
        return len(self._queue) + len(self._feedback)

    def offer(self, entry: CallEntry) -> None:
        """Queue a logged call for recording. O(1); never blocks; drops and counts when full."""
        if len(self._queue) >= self.settings.queue_size or self._closing:
            self.metrics.records_dropped.labels("queue_full").inc()
            return
        self._queue.append(entry)
        if len(self._queue) >= self.settings.batch_size:
            self._wake.set()

    @property
    def closing(self) -> bool:
        """Shutting down: nothing new is queued (what is queued goes to the recorder or stays in the log)."""
        return self._closing

    def feedback_room(self) -> int:
        """How many more events the feedback queue takes now (0 while closing)."""
        return 0 if self._closing else max(self.settings.queue_size - len(self._feedback), 0)

    def offer_feedback(self, events: Sequence[bytes], position: Any = None) -> bool:
        """Queue serialized events, all or none: False (counted: queue_full) when they do not all fit, in
        count or in bytes. O(len(events)); never blocks. The caller replaced every routing key by its HMAC."""
        size = sum(len(event) for event in events)
        if len(events) > self.feedback_room() or self._feedback_bytes + size > self.settings.feedback_queue_max_bytes:
            self.metrics.feedback_dropped.labels("queue_full").inc(len(events))
            return False
        self._feedback.extend(events)
        self._feedback_positions.extend([position] * len(events))
        self._feedback_bytes += size
        if len(self._feedback) >= self.settings.batch_size:
            self._wake.set()
        return True

    # -- background ------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="record-mirror")

    async def close(self) -> None:
        """Flush: queued calls go to the recorder (acknowledged) within ``flush_timeout_s``; what is not
        acknowledged stays in the log, before the cursor."""
        self._closing = True
        self._stopping.set()
        self._wake.set()
        if self._task is not None:
            await self._task
        if self.spool is not None:
            try:
                await asyncio.to_thread(self.spool.flush)
            except OSError as error:  # shutdown goes on: a stale cursor only resends acknowledged batches
                log.error("legacy spool cursor not written at shutdown", error=str(error)[:300])

    async def _run(self) -> None:
        """Keep :meth:`_stream` running whatever it raises: an exception escaping a background task ends
        it silently, and recording would stop for good (ARCHITECTURE, "Pitfalls")."""
        while True:
            try:
                await self._stream()
                return
            except Exception:
                self.metrics.errors.inc()
                log.exception("record mirror failed; restarting it")
                self._rewind()
                if self._closing:
                    return
                await asyncio.sleep(1.0)

    def _rewind(self) -> None:
        """Let go of the queue (and of every batch not settled, which the caller dropped): the tail reads
        them from the log again, so the log is the only copy kept while the recorder is away."""
        if self._has_queued() or self._building:
            self.metrics.rewinds.inc()
        self._resend.clear()
        self._queue.clear()
        self._carry = self._carry_position = None
        self._feedback.clear()
        self._feedback_positions.clear()
        self._feedback_bytes = 0
        self.settlement.rewind()

    async def _wait_ack(self) -> None:
        """Until an ack arrives (or ``batch_interval_s``: the loop checks the stream again). Cleared after the
        wait, not before: an ack that came while the batch was being written must not be waited for again."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._acked.wait(), self.settings.batch_interval_s)
        self._acked.clear()

    async def _stream(self) -> None:
        backoff_s = 0.1
        while True:
            channel = self.settings.recorder_tls.aio_channel(self.settings.recorder_address)
            # Batches are serialized once, so the stream takes raw bytes.
            stream = channel.stream_stream(RECORD_METHOD, response_deserializer=recorder_pb2.RecordAck.FromString)(
                metadata=token_metadata(self.settings.service_token)
            )
            unacked: collections.deque[_Sent] = collections.deque()
            reader = asyncio.create_task(self._read_acks(stream, unacked))
            failure: Exception | None = None
            try:
                while True:
                    if reader.done():
                        reader.result()  # raises the stream's error
                        raise ConnectionError("recorder closed the stream")
                    if self.spool is not None:  # an older shipper's spool goes first, one entry at a time
                        if self._closing:
                            await self._finish(stream, reader, unacked)
                            return
                        if not unacked:
                            entry = await asyncio.to_thread(self._peek_spool)
                            if entry is not None:
                                await self._send(stream, unacked, *entry[:3], None, entry[3])
                            else:
                                await self._spool_drained()
                                continue
                        await self._wait_ack()
                        continue
                    if len(unacked) >= self.settings.max_unacked_batches:
                        await self._wait_ack()  # the recorder is slow: the log waits, not a second copy
                        continue
                    if self._resend:
                        again = self._resend.popleft()
                        await self._send(stream, unacked, again.batch, again.records, again.events, again.ticket, None)
                        continue
                    taken = await self._next_batch()
                    if taken is None and self._closing and not self._has_queued():
                        await self._finish(stream, reader, unacked)
                        return
                    if taken is not None:
                        await self._send(stream, unacked, *taken, None)
                    backoff_s = 0.1
            except Exception as error:  # any failure of the stream (grpc raises several kinds) means: rewind
                failure = error
            finally:
                reader.cancel()
                await _reap(reader)
            code = await _final_code(stream)
            details = (await _final_details(stream)) if code is not None else ""
            self._log_failure(code, details, failure, len(unacked))
            if unacked:
                await self._handle_refusal(code, details, unacked)
            refused = [sent for sent in unacked if not sent.from_spool]  # a legacy spool's stay in it
            if refused and code is not None and code not in _OUTAGE_CODES:
                self._resend.extendleft(reversed(refused))
            else:
                # An outage: what the recorder did not acknowledge is let go, the log still holds it, and the
                # tail goes back to read it once the recorder is back.
                self._rewind()
            await channel.close(grace=None)
            if self._closing:
                return
            with contextlib.suppress(TimeoutError):  # the backoff, cut short by close()
                await asyncio.wait_for(self._stopping.wait(), backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)

    async def _spool_drained(self) -> None:
        """The legacy spool is shipped: remove it, so nothing of it is shipped again."""
        spool, self.spool = self.spool, None
        self._spool_bytes = 0
        self._cutter.forget()
        if spool is not None:
            try:
                await asyncio.to_thread(spool.remove)
                log.info("spool left by an older shipper shipped and removed", spool_dir=str(spool.directory))
            except OSError as error:
                log.error("shipped legacy spool not removed", error=str(error)[:300])

    def _log_failure(self, code: grpc.StatusCode | None, details: str, failure: Exception | None, unacked: int) -> None:
        """One warning per outage, naming the stream's own status (a write on a finished stream raises
        InvalidStateError "RPC already finished", which says nothing of why); retries log at DEBUG."""
        if code is not None:
            reason = f"{code.name}: {details}"
        elif failure is not None:
            reason = f"{type(failure).__name__}: {failure}"
        else:
            reason = "stream ended"
        emit = log.debug if self._outage else log.warning
        emit("recorder stream failed; the log keeps what it did not acknowledge", error=reason[:300], unacked=unacked)
        self._outage = True
        self.metrics.stream_failures.inc()

    async def _handle_refusal(
        self, code: grpc.StatusCode | None, details: str, unacked: collections.deque[_Sent]
    ) -> None:
        """Make sure no batch the recorder refuses can be resent for ever (see the module docstring)."""
        if code is None or code in _OUTAGE_CODES:
            return
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            # The recorder refuses the oldest unacknowledged batch as no RecordBatch: it would fail forever.
            await self._drop(unacked.popleft(), "rejected", details)
            return
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # Over the recorder's receive limit. gRPC names the limit ("larger than max (N vs. LIMIT)");
            # else the refused batch is one of those in flight, so halving the largest makes progress.
            largest = max(len(sent.batch) for sent in unacked)
            self._cutter.refused_as_too_large(details, largest)
            log.error(
                "recorder refused a batch as too large; sending smaller batches",
                details=details[:300],
                batch_bytes=largest,
                batch_max_bytes=self._cutter.max_bytes,
            )
        # Any other refusal (INTERNAL, UNKNOWN, ...; a large message is sometimes refused as INTERNAL)
        # may be the oldest batch's doing: after max_refusals it is cut in halves, each resent on its
        # own, down to the one record at fault, which alone is dropped.
        oldest = unacked[0]
        key = batch_key(oldest.batch)
        count = self._refusals[1] + 1 if self._refusals[0] == key else 1
        self._refusals = (key, count)
        if count < self.settings.max_refusals:
            return
        self._refusals = (0, 0)
        if oldest.records + oldest.events > 1:
            log.warning("recorder keeps refusing a batch; resending it in halves", records=oldest.records)
            self._cutter.halve(oldest.batch)
        else:
            await self._drop(unacked.popleft(), "refused", f"{code.name}: {details}")

    async def _drop(self, sent: _Sent, reason: str, details: str) -> None:
        log.error(
            "recorder refused a record batch; dropping it", reason=reason, records=sent.records, details=details[:300]
        )
        self.metrics.records_dropped.labels(reason).inc(sent.records)
        self.metrics.feedback_dropped.labels(reason).inc(sent.events)
        if sent.ticket is not None:
            self.settlement.settle(sent.ticket)
        if sent.from_spool:
            self._cutter.drop(sent.batch)  # a part of a spool entry: skip it when the entry is resent
        if sent.spool_position is not None and self.spool is not None:
            await asyncio.to_thread(self.spool.commit, sent.spool_position)
            self._spool_bytes = self.spool.pending_bytes

    def _peek_spool(self) -> tuple[bytes, int, int, tuple[int, int]] | None:
        """The oldest spooled entry, its record and event counts and the position past it. Run in a thread:
        counting parses the entry's framing, 20-30 ms for a 60 MiB entry, which on the event loop calls
        would wait for."""
        entry = None if self.spool is None else self.spool.peek()
        return None if entry is None else (entry[0], *count_items(entry[0]), entry[1])

    async def _send(
        self,
        stream: aio.StreamStreamCall,
        unacked: collections.deque[_Sent],
        batch: bytes,
        records: int,
        events: int,
        ticket: int | None,
        spool_position: tuple[int, int] | None,
    ) -> None:
        """Write one batch (cut in parts first if over the byte cap or refused before); the last part
        carries the spool position."""
        from_spool = spool_position is not None
        if self._cutter.as_is(batch):
            parts = [(batch, records, events)]
        else:
            parts = await asyncio.to_thread(self._cutter.parts, batch, records, events)
        if not parts and spool_position is not None and self.spool is not None:  # nothing left of this entry
            await asyncio.to_thread(self.spool.commit, spool_position)
            self._spool_bytes = self.spool.pending_bytes
            return
        if not parts and ticket is not None:
            self.settlement.settle(ticket)
            return
        # Every part is in ``unacked`` before the first write: if the stream fails meanwhile, they are
        # spooled again (queue batches) or stay in the spool, never lost between the two.
        sent = []
        for index, (part, count, event_count) in enumerate(parts):
            self._sequence += 1
            last = index == len(parts) - 1
            sent.append(
                _Sent(
                    self._sequence,
                    part,
                    count,
                    event_count,
                    spool_position if last else None,
                    from_spool,
                    ticket if last else None,
                )
            )
        unacked.extend(sent)
        for item in sent:
            if stream.done():  # writing would raise InvalidStateError, hiding the stream's own status
                raise ConnectionError("the recorder stream ended")
            await stream.write(_with_sequence(item.batch, item.sequence))

    def _count_damage(self, damage: Damage) -> None:
        """Called by the spool (in a reading thread) for each damaged range it skips."""
        self.metrics.spool_damage.inc()
        if damage.records:
            self.metrics.records_dropped.labels("spool_corrupt").inc(damage.records)

    async def _read_acks(self, stream: aio.StreamStreamCall, unacked: collections.deque[_Sent]) -> None:
        async for ack in stream:
            if not unacked or ack.sequence != unacked[0].sequence:
                raise ConnectionError(f"recorder acknowledged an unexpected batch {ack.sequence}")
            sent = unacked.popleft()
            if self._outage:
                log.info("recorder acknowledging again")
                self._outage = False
            self._refusals = (0, 0)
            if ack.rejected:
                self.metrics.records_dropped.labels("rejected").inc(len(ack.rejected))
                log.warning(
                    "recorder rejected records; the rest of their batch was written",
                    rejected=len(ack.rejected),
                    first=[f"{r.index} ({r.request_id[:100]!r}): {r.reason[:200]}" for r in ack.rejected[:3]],
                )
            if ack.rejected_feedback:
                self.metrics.feedback_dropped.labels("rejected").inc(len(ack.rejected_feedback))
                log.warning(
                    "recorder rejected feedback events; the rest of their batch was written",
                    rejected=len(ack.rejected_feedback),
                    first=[f"{r.index}: {r.reason[:200]}" for r in ack.rejected_feedback[:3]],
                )
            if ack.feedback_written:
                self.metrics.feedback_recorded.labels("written").inc(ack.feedback_written)
            if ack.feedback_duplicates:
                self.metrics.feedback_recorded.labels("duplicate").inc(ack.feedback_duplicates)
            self._count_ignored_feedback(sent, ack)
            if sent.ticket is not None:
                self.settlement.settle(sent.ticket)
            if sent.spool_position is not None and self.spool is not None:
                await asyncio.to_thread(self.spool.commit, sent.spool_position)
                self._spool_bytes = self.spool.pending_bytes
            self.metrics.batches_sent.labels("spool" if sent.from_spool else "queue").inc()
            if not unacked and not self._resend and self.spool is None:
                self._cutter.forget()  # no halved or dropped part can be sent again (cheap batches again)
            self._acked.set()

    def _count_ignored_feedback(self, sent: _Sent, ack: recorder_pb2.RecordAck) -> None:
        """A recorder built before feedback skips ``RecordBatch.feedback`` as an unknown field and acknowledges
        the batch: its events are gone. Resending cannot help (it would skip them again) and holding the log
        would stop the calls too, so they are counted (``ignored``) and the operator told, loudly, once."""
        accounted = ack.feedback_written + ack.feedback_duplicates + len(ack.rejected_feedback)
        if sent.events <= accounted:
            return
        self.metrics.feedback_dropped.labels("ignored").inc(sent.events - accounted)
        if not self._told_ignored:
            self._told_ignored = True
            log.error(
                "the recorder ignored feedback events: it predates feedback; upgrade recorders before routers",
                ignored=sent.events - accounted,
            )

    async def _finish(
        self, stream: aio.StreamStreamCall, reader: asyncio.Task[None], unacked: collections.deque[_Sent]
    ) -> None:
        """At shutdown: close our side, then wait (bounded) for the acks still owed."""
        await stream.done_writing()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reader), self.settings.flush_timeout_s)
        if unacked:
            raise ConnectionError("recorder did not acknowledge every batch before shutdown")

    def _has_queued(self) -> bool:
        return bool(self._queue) or self._carry is not None or bool(self._feedback)

    async def _next_batch(self) -> tuple[bytes, int, int, int] | None:
        """A serialized batch and its record and event counts once ``batch_size`` calls (or events) are
        queued or ``batch_interval_s`` passed."""
        if (
            len(self._queue) < self.settings.batch_size
            and len(self._feedback) < self.settings.batch_size
            and not self._closing
        ):
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.batch_interval_s)
        return await self._take_batch()

    async def _take_batch(self) -> tuple[bytes, int, int, int] | None:
        """Build the next batch (at most ``batch_size`` records and the byte cap) in slices of ~50 µs of
        event-loop time, so a call arriving meanwhile waits that long at most (a 256-record batch built
        and serialized in one go held calls up by over 1 ms).

        Each record is serialized as it is built and each slice framed on its own: serialized messages
        concatenate into one message, so the slices joined are the batch, with no copy of a record.
        Queued events (already serialized) follow the records, up to ``batch_size`` of them, while the
        byte cap allows."""
        if not self._has_queued():
            return None
        self._building = True
        try:
            return await self._build_batch()
        finally:
            self._building = False

    async def _build_batch(self) -> tuple[bytes, int, int, int] | None:
        slices: list[bytes] = []
        count = 0
        size = BATCH_OVERHEAD
        full = False
        while not full and count < self.settings.batch_size and (self._queue or self._carry is not None):
            if slices:
                await asyncio.sleep(0)
            records: list[bytes] = []
            started = time.perf_counter()
            while True:  # at least one record per slice, however slow the machine
                record, self._carry = self._carry, None
                if record is None:
                    entry = self._queue.popleft()
                    self._carry_position = entry.position
                    record = self._build(entry)
                    if record is not None and len(record) > self._cutter.record_limit:
                        record = await self._fit(record)
                if record is not None:
                    if count and self._cutter.overflows(size, record):
                        self._carry, full = record, True  # it opens the next batch
                        break
                    records.append(record)
                    size = size + len(record) + RECORD_OVERHEAD
                    count += 1
                if count >= self.settings.batch_size or not (self._queue or self._carry is not None):
                    break
                if time.perf_counter() - started >= _SLICE_S:
                    break
            if records:
                slices.append(recorder_pb2.EncodedRecordBatch(records=records).SerializeToString())
        events: list[bytes] = []
        while self._feedback and len(events) < self.settings.batch_size:
            event = self._feedback[0]
            if (count or events) and self._cutter.overflows(size, event):
                break
            events.append(self._feedback.popleft())
            self._feedback_positions.popleft()
            self._feedback_bytes -= len(event)
            size += len(event) + RECORD_OVERHEAD
        if events:
            slices.append(recorder_pb2.EncodedRecordBatch(feedback=events).SerializeToString())
        if not (count or events):
            return None
        # Every queued entry's position (entries of several logs interleave): the tail keeps the queue short.
        queued = [entry.position for entry in self._queue]
        if self._carry is not None:
            queued.append(self._carry_position)
        queued.extend(dict.fromkeys(self._feedback_positions))
        return b"".join(slices), count, len(events), self.settlement.cut(queued)

    def _build(self, entry: CallEntry) -> bytes | None:
        """One call as a serialized record; None (logged, counted: unrecordable) if it cannot be built, so
        one odd call never costs the calls batched with it."""
        try:
            return self._record(entry).SerializeToString() + entry.phase + entry.record_fields
        except Exception:
            log.exception("call not recordable; dropped", request_id=str(entry.request_id)[:200])
            self.metrics.records_dropped.labels("unrecordable").inc()
            return None

    async def _fit(self, record: bytes) -> bytes | None:
        """A record over the byte cap, fitted in a thread: parsing and re-serializing one of 70 MiB took
        223 ms, which on the event loop every call would have waited for."""
        try:
            return await asyncio.to_thread(self._cutter.fit, record)
        except Exception:
            log.exception("oversized call not recordable; dropped")
            self.metrics.records_dropped.labels("unrecordable").inc()
            return None

    def _record(self, entry: CallEntry) -> recorder_pb2.CallRecord:
        """The call's record but for its phase, which the router logged already serialized."""
        code = entry.code if isinstance(entry.code, int) else entry.code.value[0]
        record = recorder_pb2.CallRecord(
            schema_version=SCHEMA_VERSION,
            request_id=entry.request_id,
            receive_unix_ns=entry.receive_unix_ns,
            model=entry.model,
            version=entry.version,
            arm=entry.arm,
            status_code=code,
            status_message=entry.details,
            latency_ns=entry.latency_ns,
            endpoint=entry.endpoint,
            router_id=entry.router_id,
            fallback=bool(entry.flags & FALLBACK),
            pinned=bool(entry.flags & PINNED),
            retried=bool(entry.flags & RETRIED),
            principal=entry.principal,
            routing_key_hmac=entry.routing_key_hmac,
            assignment=max(entry.assignment, 0),
        )
        record.request.inline = entry.request
        record.request.size_bytes = len(entry.request)
        if entry.flags & HAS_RESPONSE and entry.response is not None:
            record.response.inline = entry.response
            record.response.size_bytes = len(entry.response)
        for shadow in entry.shadows:
            result = record.shadows.add(
                version=shadow.version,
                endpoint=shadow.endpoint,
                status_code=shadow.code.value[0],
                status_message=shadow.details,
                latency_ns=int(shadow.latency_s * 1e9),
            )
            if shadow.response is not None:
                result.response.inline = shadow.response
                result.response.size_bytes = len(shadow.response)
        record.metadata.update(entry.metadata)
        if entry.stream:
            record.stream.MergeFromString(entry.stream)
        return record


def _with_sequence(batch: bytes, sequence: int) -> bytes:
    # Serialized messages concatenate into one: the sequence prepended to the records is the whole batch.
    return recorder_pb2.EncodedRecordBatch(sequence=sequence).SerializeToString() + batch


async def _reap(task: asyncio.Task[None]) -> None:
    """Wait for a task we cancelled. Its own cancellation and errors are expected; ours must propagate
    (suppressing BaseException here once swallowed the mirror's own cancellation)."""
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:  # the stream's error: already handled through the stream's status
        pass


async def _final_code(stream: aio.StreamStreamCall) -> grpc.StatusCode | None:
    """The status the stream ended with, if it ended (a broken connection may leave it open)."""
    try:
        return await asyncio.wait_for(stream.code(), timeout=1.0)
    except (TimeoutError, aio.AioRpcError):
        return None


async def _final_details(stream: aio.StreamStreamCall) -> str:
    try:
        return await asyncio.wait_for(stream.details(), timeout=1.0) or ""
    except (TimeoutError, aio.AioRpcError):
        return ""
