"""The recorder's core: a serialized RecordBatch in, records in Redis, an acknowledgement out.

It knows nothing of gRPC: the servicer hands it bytes and maps its errors
(:class:`InvalidBatch`, :class:`StoreUnavailable`) to status codes. A bad record
is rejected alone (named in the ack), never its batch. The CPU part
(parse, check, redact, hash, serialize) runs in a small thread pool so the event
loop keeps answering health checks and other routers' streams meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

import structlog

# entry_fields imports token_usage (and with it NumPy) on its first call; imported here, at start, so the
# first batch does not pay for it.
from splitstream.common import token_usage  # noqa: F401
from splitstream.common.records import (
    entry_fields,
    feedback_entry_fields,
    feedback_key,
    feedback_seen_key,
    stream_key,
)
from splitstream.recorder.blobs import BlobCollector
from splitstream.recorder.errors import BatchTooLarge, InvalidBatch, StoreUnavailable
from splitstream.recorder.metrics import RecorderMetrics
from splitstream.recorder.redaction import Redactor
from splitstream.recorder.validation import Rejection, parse_batch
from splitstream.recorder.writer import FeedbackEntry, RedisWriter, StreamEntry, WriteBatch

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Ack:
    sequence: int
    written: int
    rejected: tuple[Rejection, ...] = ()
    feedback_written: int = 0
    feedback_duplicates: int = 0
    rejected_feedback: tuple[Rejection, ...] = ()


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    sequence: int
    write: WriteBatch
    records_by_model: dict[str, int]
    rejected: tuple[Rejection, ...] = field(default=())
    rejected_feedback: tuple[Rejection, ...] = field(default=())


class RecorderCore:
    def __init__(
        self,
        *,
        writer: RedisWriter,
        redactor: Redactor,
        blob_threshold_bytes: int,
        decode_requests: bool,
        decode_responses: bool,
        metrics: RecorderMetrics,
        executor: Executor,
    ) -> None:
        self.writer = writer
        self.redactor = redactor
        self.blob_threshold_bytes = blob_threshold_bytes
        self.decode_requests = decode_requests
        self.decode_responses = decode_responses
        self.metrics = metrics
        self._executor = executor
        metrics.redis_writable.set(1)
        writer.on_writable = lambda writable: metrics.redis_writable.set(1 if writable else 0)

    async def check(self, data: bytes) -> PreparedBatch:
        """Parse, check and redact one serialized RecordBatch, off the event loop; nothing is written yet.

        Raises :class:`InvalidBatch` only when the message is not a RecordBatch; bad records are set aside."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self.prepare, data)
        except (InvalidBatch, BatchTooLarge):
            self.metrics.batches.labels("invalid").inc()
            raise

    async def write(self, prepared: PreparedBatch) -> Ack:
        """Write a checked batch; return its ack once Redis confirmed every record and event.

        Raises :class:`StoreUnavailable` (the batch must not be acknowledged)."""
        if prepared.rejected:
            self.metrics.records_rejected.inc(len(prepared.rejected))
            log.warning(
                "records rejected; the rest of their batch is written",
                sequence=prepared.sequence,
                rejected=len(prepared.rejected),
                first=[f"{r.index} ({r.request_id!r}): {r.reason}"[:300] for r in prepared.rejected[:3]],
            )
        if prepared.rejected_feedback:
            self.metrics.feedback_rejected.inc(len(prepared.rejected_feedback))
            log.warning(
                "feedback events rejected; the rest of their batch is written",
                sequence=prepared.sequence,
                rejected=len(prepared.rejected_feedback),
                first=[f"{r.index}: {r.reason}"[:300] for r in prepared.rejected_feedback[:3]],
            )
        if not prepared.write.entries and not prepared.write.feedback:
            self.metrics.batches.labels("ok").inc()
            return Ack(prepared.sequence, 0, prepared.rejected, rejected_feedback=prepared.rejected_feedback)
        started = time.perf_counter()
        try:
            result = await self.writer.write(prepared.write)
        except StoreUnavailable:
            self.metrics.batches.labels("redis_error").inc()
            self.metrics.redis_errors.inc()
            raise
        self.metrics.write_seconds.observe(time.perf_counter() - started)
        self.metrics.batches.labels("ok").inc()
        for model, count in prepared.records_by_model.items():
            self.metrics.records_written.labels(model).inc(count)
        if result.blobs_written:
            self.metrics.blobs_written.inc(result.blobs_written)
        if result.trims_held:
            self.metrics.trims_held_by_archive.inc(result.trims_held)
        for model, count in result.feedback_written.items():
            self.metrics.feedback_written.labels(model).inc(count)
        for model, count in result.feedback_duplicates.items():
            self.metrics.feedback_duplicates.labels(model).inc(count)
        return Ack(
            prepared.sequence,
            result.records,
            prepared.rejected,
            feedback_written=sum(result.feedback_written.values()),
            feedback_duplicates=sum(result.feedback_duplicates.values()),
            rejected_feedback=prepared.rejected_feedback,
        )

    def prepare(self, data: bytes) -> PreparedBatch:
        """The CPU half (runs in the executor): every record is checked and redacted before anything is
        written; one that fails either is rejected alone."""
        parsed = parse_batch(data, decode_requests=self.decode_requests, decode_responses=self.decode_responses)
        rejected = list(parsed.rejected)
        collector = BlobCollector(self.blob_threshold_bytes)
        entries = []
        by_model: collections.Counter[str] = collections.Counter()
        for item in parsed.checked:
            record = item.record
            try:
                self.redactor.redact(
                    record,
                    item.request,
                    item.response,
                    item.shadow_responses,
                    item.stream_requests,
                    item.stream_responses,
                )
            except Exception as error:  # a record redaction cannot handle is not stored unredacted
                rejected.append(Rejection(item.index, record.request_id, f"redaction failed: {error!r}"[:300]))
                continue
            collector.externalize(record)
            entries.append(StreamEntry(stream_key(record.model), entry_fields(record)))
            by_model[record.model] += 1
        rejected.sort(key=lambda r: r.index)
        feedback = [
            FeedbackEntry(
                stream=feedback_key(item.event.model),
                fields=feedback_entry_fields(item.event),
                seen_key=feedback_seen_key(item.event.model, item.event.metric, item.event.idempotency_key)
                if item.event.idempotency_key
                else None,
                model=item.event.model,
            )
            for item in parsed.events
        ]
        return PreparedBatch(
            parsed.sequence,
            WriteBatch(entries, collector.blobs, feedback),
            dict(by_model),
            tuple(rejected),
            tuple(parsed.rejected_events),
        )
