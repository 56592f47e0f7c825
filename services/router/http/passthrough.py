"""Pass-through to ``openai`` upstreams: a chat or completions request whose routed version is served by an
OpenAI-compatible HTTP server goes to it unchanged, and its answer comes back as it was sent.

- The body is forwarded as received; only ``model`` is rewritten when the registry names the upstream's
  own model name. The answer's status, ``Content-Type`` and body are relayed; an SSE stream is written to
  the client event by event as the upstream sends it (only a partial event waits for its end, so a
  failure never leaves half an event before the error event).
- Before the client got a byte, a refused or broken connection, or a 502/503 answer, is retried once on
  another endpoint of the version, else on the control unless pinned (:class:`Spill` when the control is a
  gRPC worker: the front door translates then), as a gRPC call is retried.
- After that, a failure ends the client's stream with one ``data: {"error": ...}`` event, as for a worker
  of ours; the stream always ends, never hangs.
- A client that goes away cancels the handler, and the upstream's connection is closed with it (the
  upstream sees its client go). Once ``data: [DONE]`` went out the answer is whole: the upstream's
  connection is closed then (nothing follows it in OpenAI's protocol), and a client that leaves at once
  is still a 200 (:func:`~.sse.end_stream`).
- An upstream silent for the idle timeout (``--upstream-idle-timeout-s``) before its first byte is a 504
  (not retried: it may be generating, and a second wait doubles the client's); after it, the stream ends
  with a 504 error event. An upstream refusing its own credentials (401/403) is a 502 naming the
  upstream: the client's credentials were fine.
- A stream counts in the router's stream metrics (TTFT, gap, responses, duration, outcome), per version,
  as a translated one does.

Recording hook: :meth:`PassThrough.forward` has the body as received (``body``) and writes every event
the client gets in :meth:`_Relay._write` (whole answers in :meth:`_Relay.whole`); a recorder taps there.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import grpc
import structlog
from aiohttp import web

from splitstream.common.headers import VERSION_HEADER, header_value
from splitstream.router.core import CallOutcome, RouterCore
from splitstream.router.http.call import CALL, Call
from splitstream.router.http.errors import ApiError
from splitstream.router.http.recording import stream_response
from splitstream.router.http.sse import end_stream
from splitstream.router.metrics import StreamChildren
from splitstream.router.pools import PoolMember
from splitstream.router.routing import ModelRoutes, Route
from splitstream.router.upstreams import CONNECT_TIMEOUT_S, ApiKeyUnavailable, OpenAIEndpoint

log = structlog.get_logger()

#: Upstream answers retried elsewhere when nothing reached the client yet: the gateway's own "try again".
_RETRIED_STATUSES = frozenset({502, 503})
#: Hop-by-hop and framing headers never relayed (aiohttp frames the client's answer itself).
_RELAYED_HEADERS = ("Content-Type", "Cache-Control")
#: The last event of an OpenAI stream.
_DONE = b"data: [DONE]"
#: An upstream refusing the credentials the registry gave the router for it.
_CREDENTIALS_REFUSED = frozenset({401, 403})


class Spill(Exception):
    """Nothing reached the client and the retry goes to the control, a gRPC worker: the front door
    translates the request for it (``route``), as a gRPC call spills."""

    def __init__(self, route: Route) -> None:
        super().__init__(route.version)
        self.route = route


class PassThrough:
    """Forwards one request to an ``openai`` upstream of its routed version; ``ttft`` observes a streamed
    answer's first event (the front door's histogram); ``idle_timeout_s`` is how long the upstream may send
    nothing."""

    def __init__(self, core: RouterCore, ttft: Callable[[Call, str], None], *, idle_timeout_s: float = 300.0) -> None:
        self.core = core
        self.ttft = ttft
        self.idle_timeout_s = idle_timeout_s
        # Connecting is bounded by the session; waiting for the answer and each piece of it, here.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=idle_timeout_s)

    async def forward(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        data: dict[str, Any],
        outcome: CallOutcome,
        routes: ModelRoutes,
        route: Route,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Answer ``request`` from the upstream (``path``: ``chat/completions`` or ``completions``).

        ``headers`` are the ones every answer carries (request id); the served version is added here.
        Raises ApiError before any byte was written, Spill to hand the request to a gRPC control."""
        started_ns = time.monotonic_ns()
        relay = _Relay(self, request, outcome, headers)
        try:
            return await self._forward(relay, path, body, data, routes, route)
        except asyncio.CancelledError:
            if not relay.complete:  # gone after the last event: it had its whole answer
                outcome.code, outcome.details = grpc.StatusCode.CANCELLED, "the client went away"
            raise
        finally:
            outcome.latency_s = (time.monotonic_ns() - started_ns) / 1e9
            relay.stream_ended()
            self.core.log_call(outcome)

    async def _forward(
        self, relay: _Relay, path: str, body: bytes, data: dict[str, Any], routes: ModelRoutes, route: Route
    ) -> web.StreamResponse:
        outcome = relay.outcome
        endpoint = route.pool.pick()
        if endpoint is None:
            self.core.unavailable(outcome, route)
            raise ApiError(503, outcome.details, type="server_error", code="unavailable")
        while True:
            assert isinstance(endpoint, OpenAIEndpoint)  # the caller routed to an openai version
            outcome.version, outcome.endpoint = route.version, endpoint.address
            try:
                failure = await relay.attempt(endpoint, path, _payload(body, data, endpoint))
            except ApiError:  # not retried: another try would fail alike, or wait as long again
                relay.call.served(outcome.version)
                raise
            if failure is None:
                return relay.answer()
            retry = None if outcome.retried else self.core.retry_target(routes, route, endpoint)
            if retry is None:
                relay.call.served(outcome.version)
                raise failure
            self.core.metrics.retries.labels(outcome.model, outcome.version).inc()
            outcome.retried = True
            route, endpoint = retry
            outcome.version, outcome.fallback, outcome.assignment = route.version, route.fallback, route.assignment
            if not isinstance(endpoint, OpenAIEndpoint):
                raise Spill(route)


def _payload(body: bytes, data: dict[str, Any], endpoint: OpenAIEndpoint) -> bytes:
    """The body as the client sent it, or with ``model`` set to the upstream's own name for the model."""
    name = endpoint.upstream.model
    if name is None or data.get("model") == name:
        return body
    return json.dumps({**data, "model": name}, separators=(",", ":")).encode()


class _Relay:
    """One request's answer from an upstream: the upstream's response while it is being relayed, and the
    client's response once a byte went out (then no retry)."""

    def __init__(self, owner: PassThrough, request: web.Request, outcome: CallOutcome, headers: dict[str, str]):
        self.owner = owner
        self.request = request
        self.call = request[CALL]
        self.outcome = outcome
        self.headers = headers
        self.answered: web.StreamResponse | None = None
        self.sse: web.StreamResponse | None = None
        #: The stream's last event went out: the client has its whole answer.
        self.complete = False
        #: The served version's stream metrics while a stream is relayed; when the last event went out.
        self.metrics: StreamChildren | None = None
        self.events = 0
        self.started_ns = time.monotonic_ns()
        self.last_ns = 0

    async def attempt(self, endpoint: OpenAIEndpoint, path: str, payload: bytes) -> ApiError | None:
        """Call ``endpoint``; None once the client has its answer (or a stream that began and ended, even
        with an error event), else the failure to retry or answer with."""
        outcome = self.outcome
        try:
            headers = {"Content-Type": "application/json", **await endpoint.headers()}
        except ApiKeyUnavailable as error:
            outcome.code, outcome.details = grpc.StatusCode.UNAVAILABLE, str(error)
            return ApiError(502, f"upstream {endpoint.address}: {error}", type="server_error")
        request_id = self.headers.get("x-request-id")
        if request_id:
            headers["x-request-id"] = request_id
        url = f"{endpoint.base_url}/{path}"
        endpoint.outstanding += 1
        endpoint.calls += 1
        try:
            try:
                upstream = await endpoint.http.session.post(
                    url, data=payload, headers=headers, timeout=self.owner.timeout
                )
            except aiohttp.ServerTimeoutError:
                raise self._stalled(endpoint, "before answering") from None
            except (aiohttp.ClientError, TimeoutError) as error:
                endpoint.transport_failed()
                outcome.code, outcome.details = grpc.StatusCode.UNAVAILABLE, f"{endpoint.address}: {error}"
                return ApiError(502, f"upstream {endpoint.address} is unreachable: {error}", type="server_error")
            try:
                return await self._relay(endpoint, upstream)
            finally:
                upstream.close()  # a no-op after a full read; else the upstream sees its client go
        finally:
            endpoint.outstanding -= 1

    async def _relay(self, endpoint: PoolMember, upstream: aiohttp.ClientResponse) -> ApiError | None:
        outcome = self.outcome
        if upstream.status in _RETRIED_STATUSES:
            endpoint.transport_failed()
            text = await _text(upstream)
            outcome.code, outcome.details = grpc.StatusCode.UNAVAILABLE, f"upstream answered {upstream.status}"
            return _relayed_error(upstream.status, text)
        if upstream.status in _CREDENTIALS_REFUSED:
            await _text(upstream)
            problem = f"upstream {endpoint.address} refused the router's credentials for it ({upstream.status})"
            outcome.code, outcome.details = grpc.StatusCode.INTERNAL, problem
            self.call.status = 502
            # Not the client's 401/403: its own credentials were accepted. The operator fixes the registry's key.
            raise ApiError(502, f"{problem}: the API key the registry names for it is wrong", type="server_error")
        content_type = upstream.headers.get("Content-Type", "")
        if not content_type.startswith("text/event-stream"):
            try:
                body = await upstream.read()
            except aiohttp.ServerTimeoutError:
                raise self._stalled(endpoint, "in the middle of its answer") from None
            except (aiohttp.ClientError, TimeoutError) as error:
                endpoint.transport_failed()
                outcome.code, outcome.details = grpc.StatusCode.UNAVAILABLE, f"{endpoint.address}: {error}"
                return ApiError(502, f"upstream {endpoint.address} broke off its answer: {error}", type="server_error")
            self._settle(endpoint, upstream.status)
            self.answered = self.whole(upstream, body)
            return None
        # Recorded as the front door's own streams are: each event as the client was sent it.
        self.sse = stream_response(self.request, status=upstream.status, headers=self._headers(upstream))
        await self.sse.prepare(self.request)
        self.call.served(outcome.version)
        self.metrics = self.owner.core.metrics.stream_children(outcome.model, outcome.version)
        self.metrics.active.inc()
        pending = b""
        try:
            async for chunk in upstream.content.iter_any():
                if not pending and chunk.endswith(b"\n\n"):  # whole events, as servers write them: no search
                    events = chunk
                else:
                    pending += chunk
                    end = _complete(pending)
                    if not end:
                        continue
                    events, pending = pending[:end], pending[end:]
                await self._write(events)
                if events.rstrip().endswith(_DONE):  # the answer is whole: nothing follows [DONE]
                    break
        except aiohttp.ServerTimeoutError:
            stalled = self._stalled(endpoint, "in the middle of its stream")
            await self._error_event(stalled)
        except (aiohttp.ClientError, TimeoutError) as error:
            endpoint.transport_failed()
            failure = ApiError(502, f"upstream {endpoint.address} broke off the stream: {error}", type="server_error")
            outcome.code, outcome.details = grpc.StatusCode.UNAVAILABLE, failure.message
            await self._error_event(failure)
        else:
            if pending:
                await self._write(pending)
            self._settle(endpoint, upstream.status)
        self.complete = True
        await end_stream(self.request, self.sse)
        self.answered = self.sse
        return None

    def _stalled(self, endpoint: PoolMember, when: str) -> ApiError:
        """The upstream sent nothing for the idle timeout: a 504, and a failure of the endpoint's."""
        endpoint.transport_failed()
        idle = self.owner.idle_timeout_s
        problem = f"upstream {endpoint.address} sent nothing for {idle:g} s {when} (--upstream-idle-timeout-s)"
        self.outcome.code, self.outcome.details = grpc.StatusCode.DEADLINE_EXCEEDED, problem
        self.call.status = 504
        return ApiError(504, problem, type="server_error", code="deadline_exceeded")

    async def _error_event(self, failure: ApiError) -> None:
        """End a stream that began with ``failure``, as the front door ends a worker's: one error event."""
        self.call.status = failure.status
        await self._write(f"data: {json.dumps(failure.body(), separators=(',', ':'))}\n\n".encode())

    def stream_ended(self) -> None:
        """Count a relayed stream in the router's stream metrics, under its version and gRPC status."""
        children = self.metrics
        if children is None:
            return
        self.metrics = None
        outcome = self.outcome
        children.active.dec()
        self.owner.core.metrics.stream_ended(children, outcome.model, outcome.version, outcome.code.name)
        children.seconds.observe((time.monotonic_ns() - self.started_ns) / 1e9)
        children.responses.observe(self.events)

    def _settle(self, endpoint: PoolMember, status: int) -> None:
        """The upstream answered whole: its status is the call's (a 4xx is the client's, not a failure)."""
        endpoint.succeeded()
        self.call.status = status
        outcome = self.outcome
        if status < 400:
            outcome.code, outcome.details = grpc.StatusCode.OK, ""
        else:
            outcome.code = grpc.StatusCode.INVALID_ARGUMENT if status < 500 else grpc.StatusCode.INTERNAL
            outcome.details = f"upstream answered {status}"

    def _headers(self, upstream: aiohttp.ClientResponse) -> dict[str, str]:
        relayed = {name: upstream.headers[name] for name in _RELAYED_HEADERS if name in upstream.headers}
        return {**relayed, **self.headers, VERSION_HEADER: header_value(self.outcome.version)}

    def whole(self, upstream: aiohttp.ClientResponse, body: bytes) -> web.Response:
        """A whole (not streamed) answer, relayed as the upstream sent it."""
        self.call.served(self.outcome.version)
        return web.Response(status=upstream.status, body=body, headers=self._headers(upstream))

    async def _write(self, data: bytes) -> None:
        """Every byte of a streamed answer goes through here, in order."""
        assert self.sse is not None
        call = self.call
        if not call.ttft:
            call.ttft = True
            self.owner.ttft(call, self.outcome.version)
        if self.metrics is not None:
            now = time.monotonic_ns()
            if self.events:
                self.metrics.gap.observe((now - self.last_ns) / 1e9)
            else:
                self.metrics.ttft.observe((now - self.started_ns) / 1e9)
            # JSON text holds no raw line break; an event's CRLF end holds no LF LF.
            self.events += data.count(b"\n\n") + data.count(b"\r\n\r\n")
            self.last_ns = now
        try:
            await self.sse.write(data)
        except ConnectionError:  # the client went away between two events: as a cancel (499)
            raise asyncio.CancelledError from None

    def answer(self) -> web.StreamResponse:
        assert self.answered is not None
        return self.answered


def _complete(data: bytes) -> int:
    """How many bytes at the start of ``data`` are whole SSE events (0: none yet)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    end = lf + 2 if lf >= 0 else 0
    return crlf + 4 if crlf >= 0 and crlf + 4 > end else end


async def _text(upstream: aiohttp.ClientResponse) -> bytes:
    try:
        return await upstream.read()
    except (aiohttp.ClientError, TimeoutError):
        return b""


def _relayed_error(status: int, body: bytes) -> ApiError:
    """An upstream's 502/503 as the client gets it when no retry is left: its error message if it sent
    OpenAI's error object, else a generic one."""
    try:
        error = json.loads(body)["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        message = f"the upstream answered {status}"
    return ApiError(status, message, type="server_error")
