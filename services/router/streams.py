"""Token streams through the router: ``ModelStreamInfer`` relayed as bytes to one model version.

A stream is routed once, on its first request: the same head read and the same
sticky split (routing-key header, pin by header or ``model_version``) as a unary
call, then the least-loaded endpoint of that version. Every later request of the
stream goes to that same worker stream, so one conversation never straddles two
versions. A later request that names another model, or pins another version, is
not forwarded: the client gets an in-stream ``error_message`` for it (Triton's
convention for a failed request of a decoupled stream) and the stream goes on.

Bytes pass through both ways; nothing is decoded but request heads. Responses are
relayed in the order the worker sent them, and their timing is the router's own:

- a stream starts when the router has the first request;
- TTFT runs from then to relaying the first response (handing it to gRPC for the
  client); the gaps are between two responses relayed;
- the duration runs to the final status.

Failures: a worker that fails before any response was relayed (UNAVAILABLE) is
tried once more on another endpoint of the version (else the control, unless
pinned), with every request so far resent. Once a response went out there is no
retry: the client's stream ends with the worker's status and details. A client
that cancels (or whose deadline passes) cancels the worker's stream; the worker's
own deadline is the client's.

Recording: :class:`StreamTrace` keeps each request and response with its index
and offset from the start, up to a byte cap per stream (later messages are counted,
not kept, and the record is flagged ``truncated``); the mirror turns it into the
record's ``StreamCall`` in its background task, off the relay path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc import aio

from splitstream.common.errors import SplitstreamError
from splitstream.common.headers import REQUEST_ID_HEADER, request_id_metadata
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2, router_pb2
from splitstream.router.auth.call import CALL_PRINCIPAL
from splitstream.router.core import UNKNOWN_MODEL, CallOutcome, RouterCore
from splitstream.router.metrics import StreamChildren
from splitstream.router.pools import Endpoint
from splitstream.router.routing import ModelRoutes, Route

log = structlog.get_logger()

#: Default of ``--record-stream-max-bytes``: a 4k-token answer of ~1 KiB responses fits whole.
DEFAULT_RECORD_STREAM_MAX_BYTES = 4 << 20

Write = Callable[[bytes], Awaitable[None]]
Metadata = Sequence[tuple[str, str | bytes]]
OnEnd = Callable[[CallOutcome, bytes, Metadata], None]
#: A stream routed by its caller: the outcome filled by ``RouterCore.route``, the model's routes and the route.
Routed = tuple[CallOutcome, ModelRoutes, Route]


class StreamTrace:
    """A stream's requests and responses with their place and time, kept up to ``max_bytes`` of payload.

    Once a message does not fit, it and every later one are counted, not kept (so what is kept is a
    prefix of the stream) and ``truncated`` is set. Appending is O(1) on the relay path; the protobuf
    is built by :meth:`fill`, in the mirror's background task."""

    __slots__ = (
        "first_response_ns",
        "kept_bytes",
        "max_bytes",
        "requests",
        "requests_total",
        "responses",
        "responses_total",
        "truncated",
    )

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.requests: list[tuple[int, int, bytes]] = []  # (index, offset_ns, payload)
        self.responses: list[tuple[int, int, bytes]] = []
        self.requests_total = 0
        self.responses_total = 0
        #: Offset of the first response (TTFT); 0 while none came.
        self.first_response_ns = 0
        self.kept_bytes = 0
        self.truncated = False

    def request(self, offset_ns: int, payload: bytes) -> None:
        index = self.requests_total
        self.requests_total += 1
        if self._keeps(payload):
            self.requests.append((index, offset_ns, payload))

    def response(self, offset_ns: int, payload: bytes) -> None:
        index = self.responses_total
        self.responses_total += 1
        if index == 0:
            offset_ns = self.first_response_ns = max(offset_ns, 1)  # 0 means "no response"
        if self._keeps(payload):
            self.responses.append((index, offset_ns, payload))

    def _keeps(self, payload: bytes) -> bool:
        if self.truncated:
            return False
        if self.kept_bytes + len(payload) > self.max_bytes:
            self.truncated = True
            return False
        self.kept_bytes += len(payload)
        return True

    def fill(self, call: recorder_pb2.StreamCall) -> None:
        """Write the trace into a record's ``stream`` field."""
        for kept, messages in ((self.requests, call.requests), (self.responses, call.responses)):
            for index, offset_ns, payload in kept:
                message = messages.add(index=index, offset_ns=offset_ns)
                message.payload.inline = payload
                message.payload.size_bytes = len(payload)
        call.first_response_ns = self.first_response_ns
        call.responses_total = self.responses_total
        call.truncated = self.truncated


class StreamProxy:
    """Relays ``ModelStreamInfer`` streams; knows the gRPC client side (worker streams), not the server's:
    the servicer hands it the client's requests, a ``write`` for responses and the headers, and turns
    the returned outcome into the final status."""

    def __init__(self, core: RouterCore, *, record_max_bytes: int = DEFAULT_RECORD_STREAM_MAX_BYTES) -> None:
        self.core = core
        self.record_max_bytes = record_max_bytes
        #: Gets every ended stream of a known model, for recording; None when recording is off.
        self.on_end: OnEnd | None = None

    async def relay(
        self,
        requests: AsyncIterator[bytes],
        write: Write,
        headers: Mapping[str, str],
        metadata: Metadata,
        timeout_s: float | None,
        *,
        on_start: Callable[[CallOutcome], None] | None = None,
        routed: Routed | None = None,
        idle_timeout_s: float | None = None,
    ) -> CallOutcome | None:
        """Relay one stream to its end; returns its outcome (``code`` OK or the status to end with), or None
        for a stream that ended without any request. Raises CancelledError when the client went away
        (the worker's stream is cancelled and the stream recorded as CANCELLED first).

        ``on_start`` gets the outcome as the stream starts, filled in as it goes (the HTTP front door reads
        the served version from it when it writes its response headers, at the first response).
        ``routed``: the outcome and route of a stream its caller routed already (the HTTP front door routes
        first, to know whether the version is a gRPC worker or an ``openai`` upstream), so it is not routed
        twice (a random split could land elsewhere the second time). ``idle_timeout_s``: how long the worker may
        send nothing before its first response or between two, before the stream ends DEADLINE_EXCEEDED (the
        HTTP front door's clients have no gRPC deadline to end a stalled worker's stream; None: no limit)."""
        first = await anext(aiter(requests), None)
        if first is None:
            return None
        relay = _Relay(self, first, requests, write, headers, timeout_s, routed, idle_timeout_s)
        if on_start is not None:
            on_start(relay.outcome)
        try:
            await relay.run()
        except asyncio.CancelledError:
            relay.cancelled()
            raise
        except Exception:  # a bug of ours: the servicer ends the stream INTERNAL, and so says the record
            relay.outcome.code, relay.outcome.details = grpc.StatusCode.INTERNAL, "internal error"
            raise
        finally:
            relay.end()
            if relay.outcome.model != UNKNOWN_MODEL and self.on_end is not None:
                self.on_end(relay.outcome, first, metadata)
        return relay.outcome


class _RequestLog:
    """The client's requests in arrival order, for one worker stream at a time.

    Kept from the first until a response has been relayed (a retry on another endpoint resends them
    all), then each is let go once forwarded."""

    def __init__(self) -> None:
        self._items: list[bytes] = []
        self._base = 0
        self.ended = False
        self.keep = True
        self._changed = asyncio.Event()

    @property
    def size(self) -> int:
        return self._base + len(self._items)

    def append(self, payload: bytes) -> None:
        self._items.append(payload)
        self._changed.set()

    def end(self) -> None:
        self.ended = True
        self._changed.set()

    def get(self, position: int) -> bytes:
        return self._items[position - self._base]

    def forwarded(self, position: int) -> None:
        if not self.keep and position > self._base:
            del self._items[: position - self._base]
            self._base = position

    async def changed(self) -> None:
        self._changed.clear()
        await self._changed.wait()


class _Relay:
    """One stream's state from its first request to its final status."""

    def __init__(
        self,
        proxy: StreamProxy,
        first: bytes,
        requests: AsyncIterator[bytes],
        write: Write,
        headers: Mapping[str, str],
        timeout_s: float | None,
        routed: Routed | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.started_ns = time.monotonic_ns()
        self.idle_timeout_s = idle_timeout_s
        self.proxy = proxy
        self.metrics = proxy.core.metrics
        self.first = first
        self.requests = requests
        self._write = write
        self.headers = headers
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        request_id = headers.get(REQUEST_ID_HEADER, "")
        self.routed = routed
        if routed is not None:
            self.outcome = routed[0]
            self.outcome.receive_unix_ns = self.outcome.receive_unix_ns or time.time_ns()
        else:
            self.outcome = CallOutcome(
                request_id,
                UNKNOWN_MODEL,
                grpc.StatusCode.OK,
                "",
                None,
                receive_unix_ns=time.time_ns(),
                principal=CALL_PRINCIPAL.get(),  # set by the auth interceptor in this task ("" when auth is off)
            )
        self.trace = StreamTrace(proxy.record_max_bytes)
        self.outcome.stream = self.trace
        self.trace.request(0, first)
        self.log = _RequestLog()
        self.log.append(first)
        self.write_lock = asyncio.Lock()
        self.relayed = 0
        self.last_ns = 0
        self.active: StreamChildren | None = None  # the metrics of the version the stream is open on
        self.pinned_version = ""

    # -- the stream ------------------------------------------------------------------------

    async def run(self) -> None:
        outcome = self.outcome
        if self.routed is not None:
            _, routes, route = self.routed
        else:
            try:
                routes, route = self.proxy.core.route(outcome, self.first, self.headers)
            except SplitstreamError as error:
                outcome.code, outcome.details = error.code, str(error)
                return
        self.pinned_version = route.version if route.pinned else ""
        endpoint = route.pool.pick_grpc()
        if endpoint is None:
            self.proxy.core.unavailable(outcome, route)
            return
        self._activate(route.version)
        reader = asyncio.create_task(self._read_client())
        try:
            while True:
                failure = await self._attempt(endpoint)
                if failure is None:
                    return
                if self.relayed or outcome.retried or failure.code() != grpc.StatusCode.UNAVAILABLE:
                    return  # after a token nothing is resent: the client gets the worker's status
                retry = self._retry(routes, route, endpoint)
                if retry is None:
                    return
                route, endpoint = retry
        finally:
            reader.cancel()
            await _reap(reader)

    def _retry(self, routes: ModelRoutes, route: Route, failed: Endpoint) -> tuple[Route, Endpoint] | None:
        retry = self.proxy.core.retry_target(routes, route, failed)
        if retry is None or not isinstance(retry[1], Endpoint):  # an openai control is no retry for a gRPC stream
            return None
        outcome = self.outcome
        self.metrics.retries.labels(outcome.model, outcome.version).inc()
        outcome.retried = True
        outcome.version, outcome.fallback = retry[0].version, retry[0].fallback
        outcome.assignment = retry[0].assignment  # RETRY when it went to the control
        self._activate(outcome.version)
        return retry[0], retry[1]

    async def _attempt(self, endpoint: Endpoint) -> aio.AioRpcError | None:
        """One worker stream: forward the requests, relay the responses; the error it ended with, if any."""
        outcome = self.outcome
        outcome.endpoint = endpoint.address
        timeout = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
        call = endpoint.stream_infer(timeout=timeout, metadata=request_id_metadata(outcome.request_id))
        endpoint.outstanding += 1
        endpoint.calls += 1
        forwarder = asyncio.create_task(self._forward(call))
        loop = asyncio.get_running_loop()
        idle = self.idle_timeout_s
        try:
            async with asyncio.timeout_at(None if idle is None else loop.time() + idle) as quiet:
                async for response in call:
                    await self._relay(response)
                    if idle is not None:
                        quiet.reschedule(loop.time() + idle)
        except TimeoutError:
            # Not retried, even before a response: the request may be generating still, and a stall is no refusal.
            outcome.code = grpc.StatusCode.DEADLINE_EXCEEDED
            outcome.details = (
                f"the worker at {endpoint.address} sent nothing for {idle:g} s (--upstream-idle-timeout-s)"
            )
            return None
        except aio.AioRpcError as error:
            outcome.code, outcome.details = error.code(), error.details() or ""
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                endpoint.transport_failed()
            return error
        finally:
            endpoint.outstanding -= 1
            call.cancel()  # a no-op once it ended; else the worker sees the client's cancel
            forwarder.cancel()
            await _reap(forwarder)
        endpoint.succeeded()
        outcome.code, outcome.details = grpc.StatusCode.OK, ""
        return None

    async def _relay(self, response: bytes) -> None:
        now = time.monotonic_ns()
        assert self.active is not None  # responses come only from a routed stream
        if self.relayed:
            self.active.gap.observe((now - self.last_ns) / 1e9)
        else:
            self.active.ttft.observe((now - self.started_ns) / 1e9)
            self.log.keep = False  # no retry after a response: what was forwarded can go
        self.relayed += 1
        self.last_ns = now
        self.trace.response(now - self.started_ns, response)
        async with self.write_lock:
            await self._write(response)

    async def _forward(self, call: aio.StreamStreamCall) -> None:
        """Write the client's requests to the worker as they come, then half-close. A failed write ends
        it quietly: the worker stream's status says why, in :meth:`_attempt`."""
        position = 0
        log = self.log
        try:
            while True:
                while position < log.size:
                    await call.write(log.get(position))
                    position += 1
                    log.forwarded(position)
                if log.ended:
                    await call.done_writing()
                    return
                await log.changed()
        except (aio.AioRpcError, asyncio.InvalidStateError):
            return

    async def _read_client(self) -> None:
        """Take the client's later requests: forward those for the stream's model and version; answer any
        other with an in-stream error (the stream is bound to one worker of one version)."""
        try:
            await self._take_requests()
        finally:
            self.log.end()  # whatever ended the client's side, the worker's is half-closed

    async def _take_requests(self) -> None:
        try:
            async for request in self.requests:
                self.trace.request(time.monotonic_ns() - self.started_ns, request)
                problem, request_id = self._misfit(request)
                if not problem:
                    self.log.append(request)
                    continue
                error = oip.ModelStreamInferResponse(error_message=problem)
                error.infer_response.id = request_id
                error.infer_response.model_name = self.outcome.model
                payload = error.SerializeToString()
                self.trace.response(time.monotonic_ns() - self.started_ns, payload)
                async with self.write_lock:
                    await self._write(payload)
        except aio.AioRpcError:  # the client's side broke: the handler is being cancelled too
            pass

    def _misfit(self, request: bytes) -> tuple[str, str]:
        """Why a later request cannot go on this stream ('' if it can), and its id."""
        try:
            head = router_pb2.InferRequestHead.FromString(request)
        except DecodeError:
            return "request is not a valid inference.ModelInferRequest", ""
        outcome = self.outcome
        if head.model_name != outcome.model:
            return (
                f"this stream serves model '{outcome.model}'; a request for '{head.model_name}' needs its own stream",
                head.id,
            )
        if head.model_version and head.model_version != outcome.version:
            pinned = f"pinned to version '{self.pinned_version}'" if self.pinned_version else "routed"
            return (
                f"this stream is {pinned} to '{outcome.model}' version '{outcome.version}'; a request for "
                f"version '{head.model_version}' needs its own stream",
                head.id,
            )
        return "", head.id

    # -- the end ---------------------------------------------------------------------------

    def _activate(self, version: str) -> None:
        """Count the stream as open on ``version`` (moving it from the version it was open on, if any)."""
        if self.active is not None:
            self.active.active.dec()
        self.active = self.metrics.stream_children(self.outcome.model, version)
        self.active.active.inc()

    def cancelled(self) -> None:
        outcome = self.outcome
        if self.deadline is not None and time.monotonic() >= self.deadline:
            outcome.code, outcome.details = grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed"
        else:
            outcome.code, outcome.details = grpc.StatusCode.CANCELLED, "the client cancelled the stream"

    def end(self) -> None:
        outcome = self.outcome
        duration_s = (time.monotonic_ns() - self.started_ns) / 1e9
        outcome.latency_s = duration_s
        model, version = outcome.model, outcome.version
        if self.active is None:  # refused before it was routed: counted, nothing to time
            self.metrics.streams.labels(model, version, outcome.code.name).inc()
        else:
            self.active.active.dec()
            self.metrics.stream_ended(self.active, model, version, outcome.code.name)
            self.active.seconds.observe(duration_s)
            self.active.responses.observe(self.relayed)
        self.proxy.core.log_call(outcome)


async def _reap(task: asyncio.Task[None]) -> None:
    """Wait for a task we cancelled; its cancellation and errors are expected, ours must propagate."""
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:
        log.exception("stream helper task failed")
