"""The recorder's gRPC edge: ``splitstream.v1.Recorder/Record``, a raw-bytes bidi stream.

The method is registered without a request deserializer: the core parses each
batch itself, so a message that is not a RecordBatch at all gets the same
INVALID_ARGUMENT (naming the problem), instead of grpc's generic deserialization
failure, and a record that does not parse is rejected alone.

Per stream, batches are written and acknowledged in order, one at a time; the next
batch is read and checked while the current one is in Redis. A bad record is
rejected alone and named in its batch's ack. A failed batch (not a RecordBatch at
all: INVALID_ARGUMENT; Redis: UNAVAILABLE) ends the stream with its status and no
ack, after the batches before it were acknowledged; the router reconnects and resends (or spools)
what was not acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import Enum
from typing import Any, TypeVar

import grpc
import structlog
from grpc import aio

from splitstream.common.errors import SplitstreamError, status_of
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.recorder.core import PreparedBatch, RecorderCore
from splitstream.recorder.errors import StoreUnavailable
from splitstream.recorder.metrics import RecorderMetrics
from splitstream.recorder.validation import MAX_ACK_REASON, MAX_ACK_REQUEST_ID, Rejection

SERVICE = "splitstream.v1.Recorder"
SHUTTING_DOWN = "recorder is shutting down; resend unacknowledged batches to another recorder or later"


class _End(Enum):
    EOF = "the router closed its side"
    DRAINING = "the recorder is shutting down"


T = TypeVar("T")


class RecorderServicer:
    def __init__(
        self, core: RecorderCore, *, metrics: RecorderMetrics, on_store_error: Callable[[], None] = lambda: None
    ) -> None:
        self.core = core
        self.metrics = metrics
        self._on_store_error = on_store_error
        self._log = structlog.get_logger()
        self._drain: asyncio.Future[None] | None = None

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        record = grpc.stream_stream_rpc_method_handler(
            self.record, response_serializer=recorder_pb2.RecordAck.SerializeToString
        )
        return [grpc.method_handlers_generic_handler(SERVICE, {"Record": record})]

    def drain(self) -> None:
        """Stop taking batches: a stream waiting for its next batch ends now with UNAVAILABLE; one writing a
        batch finishes it, acks it, then ends the same way. Calls already ended are unaffected."""
        drain = self._drain_future()
        if not drain.done():
            drain.set_result(None)

    async def record(self, _requests: AsyncIterator[bytes], context: aio.ServicerContext[bytes, Any]) -> None:
        peer = context.peer()
        self.metrics.streams.inc()
        self._log.info("record stream opened", peer=peer)
        upcoming = asyncio.ensure_future(self._receive(context))
        try:
            while True:
                prepared = await self._settle(upcoming, context, peer)
                if prepared is _End.EOF:
                    self._log.info("record stream closed by the router", peer=peer)
                    return
                if prepared is _End.DRAINING:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
                    return
                # Read and check the next batch while Redis writes this one: the CPU half of batch
                # N+1 overlaps Redis's work on batch N. Acks still go out in order, one per batch.
                upcoming = asyncio.ensure_future(self._receive(context))
                ack = await self._settle(self.core.write(prepared), context, peer)
                await context.write(
                    recorder_pb2.RecordAck(
                        sequence=ack.sequence,
                        written=ack.written,
                        rejected=[_rejected(r) for r in ack.rejected],
                        feedback_written=ack.feedback_written,
                        feedback_duplicates=ack.feedback_duplicates,
                        rejected_feedback=[_rejected(r) for r in ack.rejected_feedback],
                    )
                )
        finally:
            if upcoming.done() and not upcoming.cancelled():
                upcoming.exception()  # the stream already ended on an earlier batch's failure
            upcoming.cancel()
            self.metrics.streams.dec()

    async def _receive(self, context: aio.ServicerContext[bytes, Any]) -> PreparedBatch | _End:
        """The next batch, read and checked (raises InvalidBatch); or why there is none."""
        data = await self._next_batch(context)
        if isinstance(data, _End):
            return data
        return await self.core.check(data)

    async def _settle(self, work: Awaitable[T], context: aio.ServicerContext[bytes, Any], peer: str) -> T:
        """Await ``work``; a failure ends the stream with its status (unknown errors: INTERNAL, logged)."""
        try:
            return await work
        except SplitstreamError as error:
            await self._fail(context, error, peer)
        except Exception:
            self._log.exception("record batch failed unexpectedly", peer=peer)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
        raise AssertionError("unreachable: abort raises")

    async def _next_batch(self, context: aio.ServicerContext[bytes, Any]) -> bytes | _End:
        """The next batch's bytes, or why there is none (the router closed its side, or we are draining)."""
        drain = self._drain_future()
        if drain.done():
            return _End.DRAINING
        read = asyncio.ensure_future(context.read())
        try:
            await asyncio.wait((read, drain), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            read.cancel()  # the stream is ending: leave no read behind
            raise
        if not read.done():
            # A batch that has not fully arrived is not ours yet: the router keeps it until acked.
            read.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await read
            return _End.DRAINING
        message = read.result()
        if message is aio.EOF:
            return _End.EOF
        return bytes(message)

    async def _fail(self, context: aio.ServicerContext[bytes, Any], error: SplitstreamError, peer: str) -> None:
        code, details = status_of(error)
        if isinstance(error, StoreUnavailable):
            self._on_store_error()
            self._log.warning("batch not written: redis unavailable", peer=peer, error=details)
        else:
            self._log.warning("batch rejected", peer=peer, error=details)
        await context.abort(code, details)

    def _drain_future(self) -> asyncio.Future[None]:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_future()
        return self._drain


def _rejected(rejection: Rejection) -> recorder_pb2.RejectedRecord:
    """A rejection as the ack names it: a request id or reason of any length is cut (the index says which)."""
    return recorder_pb2.RejectedRecord(
        index=rejection.index,
        request_id=rejection.request_id[:MAX_ACK_REQUEST_ID],
        reason=rejection.reason[:MAX_ACK_REASON],
    )
