"""The router's HTTP front door: OpenAI's chat and completions API over the router's own routing (and
KServe v2 REST with Triton's extensions, registered from :mod:`.kserve`).

One aiohttp server on the router's event loop, beside the gRPC server (``--http-port``, same
``--host``, the same TLS files, followed through rotation: :mod:`.tls`). Each generation request is
checked (:mod:`.openai_api`), turned into one ``ModelStreamInfer`` request and handed to the router's
:class:`~splitstream.router.streams.StreamProxy`: the same sticky split, pin, health-aware pools, retry
before the first token and stream metrics as a gRPC token stream. Nothing here routes.

- The routing key is the experiment's routing-key header if the request has it, else the body's
  ``user``, else none (a random split by weight); ``x-splitstream-version`` pins a version.
- Responses carry ``x-splitstream-version`` (the version that served) and ``x-request-id`` (the
  client's, else generated; the completion's ``id`` is built from it).
- Streams are relayed as the worker answers, one SSE event per worker response, never buffered.
- Errors are OpenAI's error object (:mod:`.errors`). A failure after an SSE stream began (the worker
  broke off, or reported an error) ends the stream with one ``data: {"error": ...}`` event and no
  ``data: [DONE]``, as vLLM and OpenAI's own streams do.
- A client that goes away cancels the handler (aiohttp's ``handler_cancellation``), and with it the
  worker's stream.
- Recording (with ``--recorder``): each generation that reached routing is one record in the router's log,
  appended when its answer has been written (:mod:`.recording`: the HTTP exchange beside the worker stream);
  ``POST /v1/feedback`` takes an outcome event for a call (:mod:`.feedback`) into the same log as
  ``splitstream.v1.Feedback/Report`` does.

Stopping (:meth:`HttpFrontDoor.stop`): the listening socket closes, requests and streams in flight get
the shutdown grace to end, then connections close. The router runs it beside the gRPC server's stop.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from splitstream.common.errors import ConfigError, SplitstreamError
from splitstream.common.headers import (
    REQUEST_ID_HEADER,
    VERSION_HEADER,
    echoed_request_id,
    from_header_value,
    header_value,
)
from splitstream.common.proto.splitstream.v1 import router_pb2
from splitstream.common.runtime import bind_problem, process_index
from splitstream.common.tls import ServerTls
from splitstream.router.auth.gate import Gate
from splitstream.router.config import DEFAULT_HTTP_BODY_TIMEOUT_S, DEFAULT_UPSTREAM_IDLE_TIMEOUT_S
from splitstream.router.core import UNKNOWN_MODEL, CallOutcome, RouterCore
from splitstream.router.http.auth import HttpGuard, authorize_model, may_see
from splitstream.router.http.body import BODY_TIMEOUT_S, read_body
from splitstream.router.http.call import CALL, Call
from splitstream.router.http.errors import CLIENT_CLOSED, ApiError, from_status, internal, model_not_found
from splitstream.router.http.feedback import HttpFeedback
from splitstream.router.http.headers import header_text
from splitstream.router.http.kserve import ROUTES as KSERVE_ROUTES
from splitstream.router.http.kserve import KServeRoutes, kserve_error
from splitstream.router.http.openai_api import (
    CHAT,
    COMPLETION,
    Generation,
    Shapes,
    StopFilter,
    parse_body,
    parse_generation,
    read_response,
    usage,
)
from splitstream.router.http.passthrough import PassThrough, Spill
from splitstream.router.http.recording import HttpExchange, recorded_headers, stream_response
from splitstream.router.http.sse import end_stream
from splitstream.router.http.tls import RotatingContext
from splitstream.router.metrics import TTFT_BUCKETS_S
from splitstream.router.servicer import RouterServicer
from splitstream.router.streams import DEFAULT_RECORD_STREAM_MAX_BYTES, StreamProxy

if TYPE_CHECKING:
    from splitstream.router.feedback import FeedbackService
    from splitstream.router.recording import CallLog

log = structlog.get_logger()

#: The route label of a request no route matched (bounded metric cardinality).
OTHER_ROUTE = "other"


class HttpMetrics:
    """The front door's metrics, in the router's registry, named as the router's are."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "splitstream_router_http_requests",
            "HTTP requests answered, by model, served version, route and HTTP status (a stream that failed after "
            "it began: the status of its error event; a client that went away: 499)",
            ["model", "version", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "splitstream_router_http_request_seconds",
            "Time from receiving an HTTP request to the end of its answer (a stream's last event)",
            ["model", "version", "route"],
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.ttft = Histogram(
            "splitstream_router_http_ttft_seconds",
            "Streamed requests: time from receiving the request to writing its first token's event",
            ["model", "version", "route"],
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        #: The children of ``requests`` and ``latency`` by their labels: ``labels()`` checks and looks up its
        #: arguments on every call (most of the cost of counting a call); this holds no label set the metrics
        #: do not hold already, and the front door never removes one.
        self._ended: dict[tuple[str, str, str, int], tuple[Any, Any]] = {}
        self._ttft: dict[tuple[str, str, str], Any] = {}

    def ended(self, model: str, version: str, route: str, status: int, seconds: float) -> None:
        """Count an answered request and its duration."""
        key = (model, version, route, status)
        children = self._ended.get(key)
        if children is None:
            children = self._ended[key] = (
                self.requests.labels(model, version, route, str(status)),
                self.latency.labels(model, version, route),
            )
        children[0].inc()
        children[1].observe(seconds)

    def first_token(self, model: str, version: str, route: str, seconds: float) -> None:
        """Time a stream's first token (cached as :meth:`ended`'s)."""
        key = (model, version, route)
        child = self._ttft.get(key)
        if child is None:
            child = self._ttft[key] = self.ttft.labels(model, version, route)
        child.observe(seconds)


class HttpFrontDoor:
    """The aiohttp application and server; ``core`` routes, ``streams`` relays (a proxy of its own, whose
    streams are not recorded as gRPC streams: the front door records each call whole, HTTP exchange and all,
    into ``recording``, the router's log; None when the router records nothing)."""

    def __init__(
        self,
        core: RouterCore,
        registry: CollectorRegistry,
        *,
        max_body_bytes: int,
        shutdown_grace_s: float,
        recording: CallLog | None = None,
        feedback: FeedbackService | None = None,
        record_max_bytes: int = DEFAULT_RECORD_STREAM_MAX_BYTES,
        gate: Gate | None = None,
        servicer: RouterServicer | None = None,
        upstream_idle_timeout_s: float = DEFAULT_UPSTREAM_IDLE_TIMEOUT_S,
        body_timeout_s: float = DEFAULT_HTTP_BODY_TIMEOUT_S,
    ) -> None:
        self.core = core
        #: The gRPC servicer: KServe's health and metadata answer as it does, its ``after_answer`` records.
        self.servicer = servicer
        self.streams = StreamProxy(core, record_max_bytes=record_max_bytes)
        self.metrics = HttpMetrics(registry)
        self.passthrough = PassThrough(core, self._observe_ttft, idle_timeout_s=upstream_idle_timeout_s)
        #: How long a generating worker may send nothing in a translated call (``--upstream-idle-timeout-s``).
        self.idle_timeout_s = upstream_idle_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.recording = recording
        self.record_max_bytes = record_max_bytes
        # With --auth-principals every route is checked by default (http/auth.py), inside the edge's errors.
        guard = [HttpGuard(gate).middleware] if gate is not None else []
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._edge, *guard])
        self.app[BODY_TIMEOUT_S] = body_timeout_s
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_get("/v1/models/{model}", self.get_model)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.feedback: HttpFeedback | None = None
        if feedback is not None:
            self.feedback = HttpFeedback(feedback, core.model_names)
            self.app.router.add_post("/v1/feedback", self.feedback.post)
        KServeRoutes(self).register(self.app)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int, tls: ServerTls | None) -> int:
        """Listen on ``host:port`` (0 picks a port; returns the port bound); ConfigError when it cannot."""
        shared = process_index() is not None  # a --processes child: the port is its siblings' and parent's too
        problem = bind_problem(host, port, reuse_port=shared)
        if problem:
            raise ConfigError(f"cannot listen for HTTP on {host}:{port} (--host/--http-port): {problem}")
        self.runner = web.AppRunner(
            self.app,
            handle_signals=False,  # the runtime owns SIGTERM and drains in order
            shutdown_timeout=self.shutdown_grace_s,
            handler_cancellation=True,  # a client that goes away cancels its worker stream
            access_log=None,  # per-request lines are metrics here, as on gRPC
        )
        await self.runner.setup()
        context = RotatingContext(tls).context if tls is not None else None
        site = web.TCPSite(self.runner, host, port, ssl_context=context, reuse_port=shared)
        try:
            await site.start()
        except OSError as error:
            await self.runner.cleanup()
            self.runner = None
            raise ConfigError(
                f"cannot listen for HTTP on {host}:{port} (--host/--http-port): {error.strerror or error}"
            ) from None
        server = site._server  # aiohttp keeps the asyncio server private; its socket says the port bound
        assert isinstance(server, asyncio.Server)
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stop accepting; requests and streams in flight get the shutdown grace, then are cancelled.

        Never raises: a failure is logged, so the router's teardown after it (shadows, the log, the
        shipper, the worker channels) always runs."""
        if self.runner is None:
            return
        try:
            await self.runner.cleanup()
        except Exception:
            log.exception("HTTP server stop failed")
        self.runner = None

    # -- the edge: errors and metrics for every route ------------------------------------------

    @web.middleware
    async def _edge(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
        started = time.monotonic()
        info = request.match_info.route.resource
        route = info.canonical if info is not None else OTHER_ROUTE
        call = request[CALL] = Call(started, route)
        if self.recording is not None:
            call.receive_unix_ns = time.time_ns()
        status = 500
        response: web.StreamResponse | None = None
        try:
            response = await handler(request)
            status = response.status if call.status is None else call.status
            return response
        except ApiError as error:  # a handler's, or the auth middleware's refusal: in the route's shape
            status = error.status
            response = self._error_response(request, kserve_error(error) if _is_kserve(request) else error)
            return response
        except web.HTTPException as error:  # aiohttp's: unknown route, wrong method, body too large
            status = error.status
            refusal = _from_http(error)
            return self._error_response(request, kserve_error(refusal) if _is_kserve(request) else refusal)
        except asyncio.CancelledError:
            # Gone after the stream's last event: it had its whole answer, and that is what is counted.
            status = (200 if call.status is None else call.status) if call.complete else CLIENT_CLOSED
            outcome = call.outcome  # routed before the client went away: counted under its version
            if outcome is not None:
                call.label_version = outcome.version
            raise
        except Exception:
            log.exception("HTTP request failed", path=request.path)
            status = 500
            return self._error_response(request, kserve_error(internal()) if _is_kserve(request) else internal())
        finally:
            self.metrics.ended(call.model, call.label_version, route, status, time.monotonic() - started)
            if call.exchange is not None:
                self._record(request, call, status, response)

    def recorded(self, request: web.Request, api: str) -> HttpExchange | None:
        """The recording of this call, kept on its :class:`Call` (None when the router records nothing)."""
        if self.recording is None:
            return None
        call = request[CALL]
        started_ns = int(call.started * 1e9)  # time.monotonic(), as the metrics time the call
        exchange = call.exchange = HttpExchange(
            request.method, request.path_qs, api, max_bytes=self.record_max_bytes, started_ns=started_ns
        )
        return exchange

    def _record(self, request: web.Request, call: Call, status: int, response: web.StreamResponse | None) -> None:
        """Append the ended call to the router's log: one append, no network (a log that refuses it counts the
        call as dropped). Only calls that reached routing (their model known) are recorded, as gRPC streams."""
        outcome = call.outcome
        exchange = call.exchange
        if exchange is None or self.recording is None or outcome is None or outcome.model == UNKNOWN_MODEL:
            return
        if isinstance(response, web.Response) and isinstance(response.body, bytes):
            exchange.answered(response.body, response.content_type)
        if exchange.usage is None:  # passed through to an upstream: what its answer reported
            exchange.usage = exchange.reported_usage()
        if self.feedback is not None:  # a feedback body may name the call by its id alone
            self.feedback.recent.note(outcome.request_id, outcome.model)
        outcome.receive_unix_ns = call.receive_unix_ns
        outcome.latency_s = time.monotonic() - call.started
        recording = self.recording
        try:
            fields = exchange.serialize(status, self._mask_user)
        except Exception:
            log.exception("HTTP call not recordable; dropped", request_id=outcome.request_id[:200])
            recording.metrics.records_dropped.labels("unrecordable").inc()
            return
        recording.offer_http(outcome, call.worker_request, recorded_headers(request.headers), fields)

    def _mask_user(self, user: str) -> str:
        """What a recorded body's ``user`` (a routing key) is stored as."""
        assert self.recording is not None
        return "hmac:" + self.recording.routing_key_hmac(user)

    @staticmethod
    def _error_response(request: web.Request, error: ApiError) -> web.Response:
        headers = dict(error.headers)
        call = request.get(CALL)  # None: refused before the edge began (aiohttp's own refusals come through it too)
        if call is not None and call.request_id is not None:
            headers.update(_id_header(call))
        if call is not None and call.version:
            headers[VERSION_HEADER] = header_value(call.version)
        return web.json_response(error.body(), status=error.status, headers=headers)

    # -- models ---------------------------------------------------------------------------------

    async def list_models(self, request: web.Request) -> web.Response:
        names = [name for name in self.core.model_names() if may_see(request, name)]
        return web.json_response({"object": "list", "data": [self._model(name) for name in names]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if not self.core.serves(name):
            raise model_not_found(f"The model '{name}' does not exist")
        request[CALL].model = name
        return web.json_response(self._model(name))

    def _model(self, name: str) -> dict[str, Any]:
        created = self.core.applied_unix_ns // 1_000_000_000
        return {"id": name, "object": "model", "created": created, "owned_by": "splitstream"}

    # -- generations ----------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETION)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        """Route the request, then pass it through to an ``openai`` upstream unchanged, or translate it for
        our generating workers. Routed once, here: a random split must not land elsewhere when the
        translated relay starts."""
        call = request[CALL]
        sent_id = header_text(request, REQUEST_ID_HEADER) or ""
        call.sent_id = sent_id or None
        request_id = call.request_id or (from_header_value(sent_id) if sent_id else uuid.uuid4().hex)
        call.request_id = request_id
        exchange = self.recorded(request, kind)
        body = await read_body(request)
        data = parse_body(body)
        if exchange is not None:
            exchange.received(body, request.headers.get("Content-Type", ""), data)
        model = data.get("model")
        if isinstance(model, str) and model:
            authorize_model(request, model)  # before saying whether the model exists
        if not isinstance(model, str) or not model or not self.core.serves(model):
            if (refusal := _refusal(kind, data)) is not None:
                raise refusal
            served = ", ".join(self.core.model_names()) or "none"
            raise model_not_found(f"The model '{model}' does not exist (served: {served})")
        call.model = model
        user = data.get("user") if isinstance(data.get("user"), str) else None
        headers = self._routing_headers(request, user, request_id)
        outcome = CallOutcome(
            request_id,
            model,
            grpc.StatusCode.OK,
            "",
            None,
            receive_unix_ns=time.time_ns(),
            principal=call.principal,  # recorded as a gRPC call's (auth's middleware set it)
        )
        try:
            routes, route = self.core.route(
                outcome, b"", headers, router_pb2.InferRequestHead(model_name=model, id=request_id), http=True
            )
        except SplitstreamError as error:
            if (refusal := _refusal(kind, data)) is not None:
                raise refusal from None
            # Counted and logged as a stream refused at routing, as the relay did when it routed.
            outcome.code, outcome.details = error.code, str(error)
            self.core.metrics.streams.labels(model, outcome.version, outcome.code.name).inc()
            self.core.log_call(outcome)
            call.served(outcome.version)
            raise from_status(error.code, str(error)) from None
        if route.pool.upstream is not None:
            path = "chat/completions" if kind == CHAT else "completions"
            call.outcome = outcome  # recorded and counted by it, as a translated call by its relay's
            try:
                return await self.passthrough.forward(
                    request, path, body, data, outcome, routes, route, _id_header(call)
                )
            except Spill as spill:  # the upstreams failed before a byte: the control is our worker
                route = spill.route
        generation = parse_generation(kind, data)  # 400 naming the field our workers cannot take
        answer = _Answer(request, generation, Shapes.of(generation, request_id), self.metrics, exchange)
        worker_request = call.worker_request = generation.inference_request(request_id)
        relayed = await self.streams.relay(
            _one(worker_request),
            answer.write,
            headers,
            (),
            None,
            on_start=answer.bind,
            routed=(outcome, routes, route),
            idle_timeout_s=self.idle_timeout_s,
        )
        assert relayed is not None  # one request was sent
        return await answer.finish(relayed)

    def _observe_ttft(self, call: Call, version: str) -> None:
        self.metrics.first_token(call.model, version, call.route, time.monotonic() - call.started)

    def _routing_headers(self, request: web.Request, user: str | None, request_id: str) -> dict[str, str]:
        """What the core reads: the experiments' routing-key headers (the body's ``user`` where the header is
        absent), the pin and the request id; the core picks the model's own routing-key header."""
        headers = {REQUEST_ID_HEADER: request_id}
        for name in self.core.routing_key_headers:
            key = header_text(request, name)
            key = user if key is None else key
            if key is not None:
                headers[name] = key
        pin = header_text(request, VERSION_HEADER)
        if pin:
            headers[VERSION_HEADER] = pin
        return headers


class _Answer:
    """One generation's answer, built as the worker's responses arrive: an SSE stream opened at the first
    one (``stream``: true), or the text gathered for one JSON object."""

    def __init__(
        self,
        request: web.Request,
        generation: Generation,
        shapes: Shapes,
        metrics: HttpMetrics,
        exchange: HttpExchange | None = None,
    ) -> None:
        self.request = request
        self.call = request[CALL]
        self.exchange = exchange
        self.generation = generation
        self.shapes = shapes
        self.metrics = metrics
        self.outcome: CallOutcome | None = None
        self.sse: web.StreamResponse | None = None
        self.error: ApiError | None = None
        self.texts: list[str] = []
        self.stop = StopFilter(generation.stop)
        self.final = False
        self.tokens = 0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.gone = False

    def bind(self, outcome: CallOutcome) -> None:
        self.outcome = self.call.outcome = outcome

    @property
    def version(self) -> str:
        return self.outcome.version if self.outcome is not None else ""

    async def write(self, payload: bytes) -> None:
        """One worker response (the relay calls this, one at a time, as each arrives)."""
        if self.gone:
            return
        piece = read_response(payload)
        if isinstance(piece, ApiError):
            self.error = self.error or piece
            return
        if self.final or self.error is not None:
            return
        if piece.text:
            self.tokens += 1
        text = self.stop.feed(piece.text)
        if piece.final:
            text += self.stop.end()
            self.final = True
            self.prompt_tokens, self.completion_tokens = piece.prompt_tokens, piece.completion_tokens
            if self.exchange is not None:
                reported = self.usage
                self.exchange.usage = (reported["prompt_tokens"], reported["completion_tokens"])
        if not self.generation.stream:
            self.texts.append(text)
            return
        try:
            await self._send(text)
        except ConnectionError:
            # The client went away between two tokens: stop the worker's stream as a cancel would.
            self.gone = True
            task = asyncio.current_task()
            if task is not None:
                task.cancel()

    async def _send(self, text: str) -> None:
        shapes, include_usage = self.shapes, self.generation.include_usage
        if self.sse is None:
            self.sse = await self._open()
            if shapes.kind == CHAT:
                await self._event(shapes.chunk(role=True, usage=include_usage))
        if text:
            await self._event(shapes.chunk(text=text, usage=include_usage))
            call = self.call
            if not call.ttft:
                call.ttft = True
                self.metrics.first_token(
                    self.generation.model, self.version, call.route, time.monotonic() - call.started
                )
        if self.final:
            await self._event(shapes.chunk(finish_reason=self.finish_reason, usage=include_usage))
            if include_usage:
                await self._event(shapes.usage_chunk(self.usage))

    async def _open(self) -> web.StreamResponse:
        self.call.served(self.version)
        response = stream_response(
            self.request,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                VERSION_HEADER: header_value(self.version),
                **_id_header(self.call),
            },
        )
        await response.prepare(self.request)
        return response

    async def _event(self, data: dict[str, Any] | str) -> None:
        assert self.sse is not None
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        await self.sse.write(f"data: {text}\n\n".encode())

    @property
    def finish_reason(self) -> str:
        """``length`` when the generation used all of ``max_tokens``, else ``stop`` (a stop word or end token)."""
        produced = self.completion_tokens if self.completion_tokens is not None else self.tokens
        return "length" if produced >= self.generation.max_tokens else "stop"

    @property
    def usage(self) -> dict[str, int]:
        prompt = self.prompt_tokens if self.prompt_tokens is not None else len(self.generation.prompt.encode())
        return usage(prompt, self.completion_tokens if self.completion_tokens is not None else self.tokens)

    async def finish(self, outcome: CallOutcome) -> web.StreamResponse:
        """The answer once the worker's stream ended with ``outcome``."""
        self.outcome = outcome
        self.call.served(outcome.version)
        failure = None if outcome.code == grpc.StatusCode.OK else from_status(outcome.code, outcome.details)
        failure = failure or self.error
        if failure is None and not self.final:
            failure = ApiError(502, "the model's stream ended without a final response", type="server_error")
        if self.sse is not None:
            if failure is not None:
                self.call.status = failure.status
                await self._event(failure.body())
            else:
                await self._event("[DONE]")
            await end_stream(self.request, self.sse)
            return self.sse
        if failure is not None:
            raise failure
        if self.generation.stream:  # an answer without any token still streams, as the client asked
            self.sse = await self._open()
            await self._send("")
            await self._event("[DONE]")
            await end_stream(self.request, self.sse)
            return self.sse
        body = self.shapes.whole("".join(self.texts), self.finish_reason, self.usage)
        return web.json_response(body, headers={VERSION_HEADER: header_value(outcome.version), **_id_header(self.call)})


def _refusal(kind: str, data: dict[str, Any]) -> ApiError | None:
    """The 400 a translated answer would get for this body, if any: answered before a 404 or a routing error, so
    that a client learns what is wrong with its request first. Checked only where it is answered or the answer
    is translated, never for a pass-through: an upstream takes fields (tools, ...) our workers do not, so the
    check would be work spent on every passed-through call for nothing."""
    try:
        parse_generation(kind, data)
    except ApiError as error:
        return error
    return None


async def _one(request: bytes) -> AsyncIterator[bytes]:
    yield request


def _id_header(call: Call) -> dict[str, str]:
    """The ``x-request-id`` answered, as the gRPC edge answers it (:func:`echoed_request_id`)."""
    assert call.request_id is not None
    return dict(echoed_request_id(call.sent_id, call.request_id))


def _is_kserve(request: web.Request) -> bool:
    """KServe's routes (and unknown paths under /v2) answer errors in KServe's shape."""
    return request.path == "/v2" or request.path.startswith("/v2/")


def _from_http(error: web.HTTPException) -> ApiError:
    """aiohttp's own refusals in OpenAI's shape."""
    if isinstance(error, web.HTTPRequestEntityTooLarge):
        return ApiError(413, f"the request body is too large: {error.text}", code="request_too_large")
    if isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        return ApiError(
            405, f"method {error.method} is not allowed here (allowed: {allowed})", code="method_not_allowed"
        )
    if isinstance(error, web.HTTPNotFound):
        served = ", ".join(["/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/feedback", *KSERVE_ROUTES])
        return ApiError(404, f"no such route (served: {served})", code="not_found")
    return ApiError(error.status, error.reason, code=None)
