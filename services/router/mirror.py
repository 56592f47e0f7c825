"""Mirror finished calls to the recorder, off the hot path, losing nothing while there is room.

``offer()`` is what the request path calls after the client has its answer: an
O(1) append to a bounded deque that never blocks (a full queue drops the call and
counts it). A background task turns queued calls into CallRecords, batches them
by size or time and streams the batches to the recorder on one long-lived
``Recorder/Record`` stream, keeping each batch until its ack arrives.

When the recorder is unreachable, slow (too many batches unacknowledged) or
refusing (e.g. its Redis is down), batches go to the on-disk :class:`Spool`, and
while the spool holds anything every new batch goes there too, so batches reach
the recorder in the order they were made. Once the recorder acknowledges again,
the spool is sent oldest first. Delivery is at least once: a batch sent but not
acknowledged when the stream broke is spooled again, and readers drop
duplicates by request id.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import routing_key_hmac
from splitstream.router.core import CallOutcome
from splitstream.router.recorded_metadata import recorded_metadata
from splitstream.router.spool import Spool

log = structlog.get_logger()

SCHEMA_VERSION = 1
RECORD_METHOD = "/splitstream.v1.Recorder/Record"
#: Event-loop time the batch builder takes before it yields to calls (a record costs ~3-10 µs).
_SLICE_S = 50e-6


@dataclass(frozen=True, kw_only=True)
class MirrorSettings:
    recorder_address: str
    router_id: str
    hmac_key: bytes
    queue_size: int = 100_000
    batch_size: int = 256
    batch_interval_s: float = 0.2
    max_unacked_batches: int = 8
    ack_timeout_s: float = 5.0
    flush_timeout_s: float = 5.0
    #: Keep authorization, cookie, API-key headers in records (off: a replay would re-send someone's token).
    record_credential_headers: bool = False


@dataclass(slots=True)
class _Sent:
    sequence: int
    batch: bytes  # serialized RecordBatch without sequence (what the spool stores)
    spool_position: tuple[int, int] | None  # set when the batch came from the spool


class MirrorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches_sent = Counter(
            "splitstream_router_mirror_batches_sent",
            "Record batches acknowledged by the recorder",
            ["source"],
            registry=registry,
        )
        self.records_dropped = Counter(
            "splitstream_router_mirror_records_dropped", "Calls not recorded", ["reason"], registry=registry
        )
        self.records_spooled = Counter(
            "splitstream_router_mirror_records_spooled", "Records written to the spool", registry=registry
        )
        self.queue_depth = Gauge(
            "splitstream_router_mirror_queue_depth", "Calls waiting to be batched", registry=registry
        )
        self.spool_bytes = Gauge(
            "splitstream_router_mirror_spool_bytes", "Bytes in the spool not yet acknowledged", registry=registry
        )


class RecordMirror:
    def __init__(self, settings: MirrorSettings, spool: Spool, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.spool = spool
        self.metrics = MirrorMetrics(registry)
        self.metrics.queue_depth.set_function(lambda: len(self._queue))
        self.metrics.spool_bytes.set_function(lambda: self._spool_bytes)
        self._queue: collections.deque[tuple[CallOutcome, bytes, Sequence[tuple[str, str | bytes]]]] = (
            collections.deque()
        )
        self._wake = asyncio.Event()
        self._closing = False
        self._spool_bytes = spool.pending_bytes
        self._task: asyncio.Task[None] | None = None

    # -- the request path ------------------------------------------------------------------

    def offer(self, outcome: CallOutcome, request: bytes, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """Queue a finished call for recording. O(1); never blocks; drops and counts when full."""
        if len(self._queue) >= self.settings.queue_size or self._closing:
            self.metrics.records_dropped.labels("queue_full").inc()
            return
        self._queue.append((outcome, request, metadata))
        if len(self._queue) >= self.settings.batch_size:
            self._wake.set()

    # -- background ------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="record-mirror")

    async def close(self) -> None:
        """Flush: queued calls go to the recorder (acknowledged) or to the spool; then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        sequence = 0
        backoff_s = 0.1
        while True:
            channel = aio.insecure_channel(self.settings.recorder_address)
            # Batches are serialized once (the spool stores the same bytes), so the stream takes raw bytes.
            stream = channel.stream_stream(RECORD_METHOD, response_deserializer=recorder_pb2.RecordAck.FromString)()
            unacked: collections.deque[_Sent] = collections.deque()
            reader = asyncio.create_task(self._read_acks(stream, unacked))
            try:
                while True:
                    if reader.done():
                        reader.result()  # raises the stream's error
                        raise ConnectionError("recorder closed the stream")
                    batch = await self._next_batch()
                    if batch is None and self._closing and not self._queue:
                        await self._finish(stream, reader, unacked)
                        return
                    # Spool first while a backlog exists or the recorder is slow.
                    if batch is not None:
                        if not self.spool.empty() or len(unacked) >= self.settings.max_unacked_batches:
                            await self._to_spool(batch)
                        else:
                            sequence += 1
                            unacked.append(_Sent(sequence, batch, None))
                            await stream.write(_with_sequence(batch, sequence))
                    if not unacked and not self.spool.empty():
                        entry = await asyncio.to_thread(self.spool.peek)
                        if entry is not None:
                            sequence += 1
                            unacked.append(_Sent(sequence, entry[0], entry[1]))
                            await stream.write(_with_sequence(entry[0], sequence))
                    backoff_s = 0.1
            except Exception as error:  # any failure of the stream (grpc raises several kinds) means: spool
                log.warning(
                    "recorder stream failed; spooling",
                    error=f"{type(error).__name__}: {error}"[:300],
                    unacked=len(unacked),
                )
            finally:
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
            if unacked and await _final_code(stream) == grpc.StatusCode.INVALID_ARGUMENT:
                # The recorder refuses the oldest unacknowledged batch as malformed: sending it again would
                # fail forever and block everything behind it, so it is dropped (and counted) instead.
                await self._drop_rejected(unacked.popleft(), await stream.details())
            # Batches the recorder never acknowledged go to the spool (those from the spool are still there).
            for sent in unacked:
                if sent.spool_position is None:
                    await self._to_spool(sent.batch)
            await channel.close(grace=None)
            if self._closing:
                while (batch := await self._take_batch()) is not None:
                    await self._to_spool(batch)
                return
            await self._sleep_spooling(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)

    async def _drop_rejected(self, sent: _Sent, details: str) -> None:
        records = _count_records(sent.batch)
        log.error("recorder rejected a record batch as invalid; dropping it", records=records, details=details[:300])
        self.metrics.records_dropped.labels("rejected").inc(records)
        if sent.spool_position is not None:
            await asyncio.to_thread(self.spool.commit, sent.spool_position)
            self._spool_bytes = self.spool.pending_bytes

    async def _sleep_spooling(self, seconds: float) -> None:
        """Wait before reconnecting, moving queued calls to the spool meanwhile so the queue never fills."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while loop.time() < until and not self._closing:
            batch = await self._take_batch()
            if batch is not None:
                await self._to_spool(batch)
            else:
                await asyncio.sleep(min(self.settings.batch_interval_s, max(until - loop.time(), 0)))

    async def _read_acks(self, stream: aio.StreamStreamCall, unacked: collections.deque[_Sent]) -> None:
        async for ack in stream:
            if not unacked or ack.sequence != unacked[0].sequence:
                raise ConnectionError(f"recorder acknowledged an unexpected batch {ack.sequence}")
            sent = unacked.popleft()
            if sent.spool_position is not None:
                await asyncio.to_thread(self.spool.commit, sent.spool_position)
                self._spool_bytes = self.spool.pending_bytes
                self.metrics.batches_sent.labels("spool").inc()
            else:
                self.metrics.batches_sent.labels("queue").inc()
            if self._spool_bytes:  # a backlog waits for this ack: send its next batch now
                self._wake.set()

    async def _finish(
        self, stream: aio.StreamStreamCall, reader: asyncio.Task[None], unacked: collections.deque[_Sent]
    ) -> None:
        """At shutdown: close our side, then wait (bounded) for the acks still owed."""
        await stream.done_writing()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reader), self.settings.flush_timeout_s)
        if unacked:
            raise ConnectionError("recorder did not acknowledge every batch before shutdown")

    async def _next_batch(self) -> bytes | None:
        """A serialized batch once ``batch_size`` calls are queued or ``batch_interval_s`` passed."""
        if len(self._queue) < self.settings.batch_size and not self._closing:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.batch_interval_s)
        return await self._take_batch()

    async def _take_batch(self) -> bytes | None:
        """Build the next batch in slices of ~50 µs of event-loop time, so a call arriving meanwhile waits
        that long at most (a 256-record batch built and serialized in one go held calls up by over 1 ms).

        Each record is serialized as it is built and each slice framed on its own: serialized messages
        concatenate into one message, so the slices joined are the batch, with no copy of a record."""
        if not self._queue:
            return None
        slices: list[bytes] = []
        remaining = min(len(self._queue), self.settings.batch_size)
        while remaining and self._queue:
            if slices:
                await asyncio.sleep(0)
            records: list[bytes] = []
            started = time.perf_counter()
            while True:  # at least one record per slice, however slow the machine
                records.append(self._record(*self._queue.popleft()).SerializeToString())
                remaining -= 1
                if not (remaining and self._queue) or time.perf_counter() - started >= _SLICE_S:
                    break
            slices.append(recorder_pb2.EncodedRecordBatch(records=records).SerializeToString())
        return b"".join(slices)

    async def _to_spool(self, batch: bytes) -> None:
        if await asyncio.to_thread(self.spool.append, batch):
            self.metrics.records_spooled.inc(_count_records(batch))
        else:
            self.metrics.records_dropped.labels("spool_full").inc(_count_records(batch))
        self._spool_bytes = self.spool.pending_bytes

    def _record(
        self, outcome: CallOutcome, request: bytes, metadata: Sequence[tuple[str, str | bytes]]
    ) -> recorder_pb2.CallRecord:
        record = recorder_pb2.CallRecord(
            schema_version=SCHEMA_VERSION,
            request_id=outcome.request_id,
            receive_unix_ns=outcome.receive_unix_ns,
            model=outcome.model,
            version=outcome.version,
            arm=outcome.arm,
            status_code=outcome.code.value[0],
            status_message=outcome.details,
            latency_ns=int(outcome.latency_s * 1e9),
            endpoint=outcome.endpoint,
            router_id=self.settings.router_id,
            fallback=outcome.fallback,
            pinned=outcome.pinned,
            retried=outcome.retried,
        )
        record.request.inline = request
        record.request.size_bytes = len(request)
        if outcome.response is not None:
            record.response.inline = outcome.response
            record.response.size_bytes = len(outcome.response)
        for shadow in outcome.shadows:
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
        if outcome.routing_key is not None:
            record.routing_key_hmac = routing_key_hmac(self.settings.hmac_key, outcome.routing_key)
        record.metadata.update(
            recorded_metadata(
                metadata,
                routing_key_header=outcome.routing_key_header,
                keep_credentials=self.settings.record_credential_headers,
            )
        )
        return record


def _with_sequence(batch: bytes, sequence: int) -> bytes:
    # Serialized messages concatenate into one: the sequence prepended to the records is the whole batch.
    return recorder_pb2.EncodedRecordBatch(sequence=sequence).SerializeToString() + batch


async def _final_code(stream: aio.StreamStreamCall) -> grpc.StatusCode | None:
    """The status the stream ended with, if it ended (a broken connection may leave it open)."""
    try:
        return await asyncio.wait_for(stream.code(), timeout=1.0)
    except (TimeoutError, aio.AioRpcError):
        return None


def _count_records(batch: bytes) -> int:
    return len(recorder_pb2.EncodedRecordBatch.FromString(batch).records)  # records stay bytes: no parse
