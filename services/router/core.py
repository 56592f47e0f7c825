"""The routing core: one call in, one outcome out.

It knows nothing of the server side of gRPC (no servicer context): the servicer
hands it the request bytes, the few headers that matter and the time left, and
turns the returned :class:`CallOutcome` into the answer. The outcome carries
everything a recorder needs, so mirroring a call is a hand-off, not a second
code path.

Path of one call: read the request head (model, version, id) without decoding
tensors → pick the version (pin, or sticky split, or control when the arm has no
healthy endpoint) → least-loaded endpoint → forward the bytes; on UNAVAILABLE
retry once on another endpoint of that version (else the control, unless the
call was pinned).

The routing table is the core's own: the servicer (model readiness and
metadata, Status) and the shadow runner ask the core's methods which endpoint
or version to use, and never read the table themselves.

Request ids: the core holds the original string (``CallOutcome.request_id``,
which is what gets recorded): the request's ``id`` field as sent, or the
``x-request-id`` header decoded with ``from_header_value`` (the header can
only carry the encoded form of a non-ASCII id). Wherever an id goes into
metadata (the forward, shadows, the trailers) it is encoded with
``header_value``, so a client that sent the encoded form gets the same value
back, and ``header_value(record.request_id)`` is what a replay should send.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc import aio

from splitstream.common.errors import InvalidInput, ModelNotFound, ModelNotReady, SplitstreamError, WrongProtocol
from splitstream.common.experiment import Experiment, Phase, Shadow
from splitstream.common.headers import REQUEST_ID_HEADER, VERSION_HEADER
from splitstream.common.logs import debug_enabled
from splitstream.common.proto.splitstream.v1 import router_pb2
from splitstream.common.registry import OpenAIUpstream, RegistryState
from splitstream.common.tls import PLAINTEXT, ClientFilesWatch, ClientTls
from splitstream.router.metrics import RouterMetrics
from splitstream.router.pools import Endpoint, PoolMember, VersionPool
from splitstream.router.routing import EMPTY_TABLE, Assignment, ModelRoutes, Route, RoutingTable

if TYPE_CHECKING:
    from splitstream.router.upstreams import UpstreamHttp

log = structlog.get_logger()

#: The model label of calls whose model is not served (bounded metric cardinality; never recorded).
UNKNOWN_MODEL = "_unknown"
_SERVER_FAILURES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


@dataclass(slots=True)
class CallOutcome:
    """What happened to one call. ``response`` is set exactly when ``code`` is OK."""

    request_id: str
    model: str
    code: grpc.StatusCode
    details: str
    response: bytes | None
    version: str = ""
    arm: str = ""
    endpoint: str = ""
    fallback: bool = False
    retried: bool = False
    pinned: bool = False
    receive_unix_ns: int = 0
    latency_s: float = 0.0
    #: The experiment in force when the call was routed (None: the model is not served).
    phase: Phase | None = None
    #: How the arm was chosen; None when the call was refused before an arm was (bad pin, no endpoint).
    assignment: Assignment | None = None
    # Kept for the recorder, which stores only the key's HMAC and never the header: set as soon as the
    # model is known, so a call refused at routing (bad pin, no endpoint) is recorded without it too.
    routing_key: str | None = None
    routing_key_header: str = ""
    shadows: list[Any] = field(default_factory=list)  # ShadowOutcome, filled after the client's answer
    #: A ModelStreamInfer stream's messages (``splitstream.router.streams.StreamTrace``); None for unary calls.
    stream: Any = None
    #: The authenticated caller's name ("" when the router does not authenticate callers); never a credential.
    principal: str = ""


@dataclass(frozen=True, slots=True)
class ModelView:
    """One model as Status shows it: its experiment, each version's endpoints, and the arms spilling now
    (no eligible endpoint, so their traffic goes to the control, or fails when the arm is the control)."""

    model: str
    experiment: Experiment
    pools: Mapping[str, VersionPool]
    spilling: frozenset[str]


@dataclass(frozen=True, kw_only=True)
class EndpointSettings:
    channel_options: tuple[tuple[str, int | str], ...]
    eject_after_failures: int
    eject_duration_s: float
    drain_timeout_s: float
    #: TLS to every worker (arms and shadows alike): one setting for all of a router's upstreams.
    tls: ClientTls = PLAINTEXT


class RouterCore:
    def __init__(self, *, settings: EndpointSettings, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        #: Private: the servicer, the shadow runner and main ask the methods below instead of reading it.
        self._table: RoutingTable = EMPTY_TABLE
        #: The routing-key header names the current experiments use (servicers read only these).
        self.routing_key_headers: frozenset[str] = frozenset()
        self.generation = 0
        self.applied_unix_ns = 0
        self._closing: set[asyncio.Task[None]] = set()
        #: Bumped each time the upstream client TLS files change; endpoints below it get a new channel.
        self.credentials_generation = 0
        self._warned_at: dict[tuple[str, str, grpc.StatusCode], float] = {}
        #: Whether an export of the arms' spilling state is scheduled (events coalesce into one).
        self._arms_pending = False
        #: The one HTTP client session of every ``openai`` upstream (health checks and the front door's calls);
        #: made with the first such endpoint, so a router without any never imports aiohttp.
        self._upstream_http: UpstreamHttp | None = None

    # -- calls -----------------------------------------------------------------------------

    async def infer(
        self,
        request: bytes,
        headers: Mapping[str, str],
        timeout_s: float | None,
        head: router_pb2.InferRequestHead | None = None,
    ) -> CallOutcome:
        """``head``: the request's head when the caller parsed it already (authorization reads the model),
        so a large request is not parsed twice."""
        receive_unix_ns = time.time_ns()
        started = time.perf_counter()
        try:
            outcome = await self._infer(request, headers, timeout_s, head)
        except asyncio.CancelledError:  # the client went away; the worker call was cancelled with it
            self.metrics.answered("_cancelled", "", grpc.StatusCode.CANCELLED.name, time.perf_counter() - started)
            raise
        outcome.receive_unix_ns = receive_unix_ns
        outcome.latency_s = time.perf_counter() - started
        self.metrics.answered(outcome.model, outcome.version, outcome.code.name, outcome.latency_s)
        self.log_call(outcome)
        return outcome

    def log_call(self, outcome: CallOutcome) -> None:
        """DEBUG for every call (and token stream); WARNING for server-side failures, at most once a second
        per kind."""
        if debug_enabled():
            log.debug(
                "call",
                request_id=outcome.request_id,
                model=outcome.model,
                version=outcome.version,
                status=outcome.code.name,
                latency_ms=round(outcome.latency_s * 1000, 3),
            )
        if outcome.code in _SERVER_FAILURES:
            kind = (outcome.model, outcome.version, outcome.code)
            now = time.monotonic()
            if now - self._warned_at.get(kind, 0.0) >= 1.0:
                self._warned_at[kind] = now
                log.warning(
                    "call failed",
                    request_id=outcome.request_id,
                    model=outcome.model,
                    version=outcome.version,
                    endpoint=outcome.endpoint,
                    status=outcome.code.name,
                    details=outcome.details,
                )

    async def _infer(
        self,
        request: bytes,
        headers: Mapping[str, str],
        timeout_s: float | None,
        head: router_pb2.InferRequestHead | None,
    ) -> CallOutcome:
        outcome = CallOutcome(headers.get(REQUEST_ID_HEADER, ""), UNKNOWN_MODEL, grpc.StatusCode.OK, "", None)
        try:
            routes, route = self.route(outcome, request, headers, head)
        except SplitstreamError as error:
            outcome.code, outcome.details = error.code, str(error)
            return outcome
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        endpoint = route.pool.pick_grpc()
        if endpoint is None:
            return self.unavailable(outcome, route)
        failure = await self._forward(outcome, endpoint, request, deadline)
        if failure is None or failure.code() != grpc.StatusCode.UNAVAILABLE:
            return outcome
        retry = self.retry_target(routes, route, endpoint)
        if retry is None or not isinstance(retry[1], Endpoint):  # no retry on an openai control over gRPC
            return outcome
        route, endpoint = retry[0], retry[1]
        self.metrics.retries.labels(outcome.model, outcome.version).inc()
        outcome.retried = True
        outcome.version = route.version
        outcome.fallback = route.fallback
        outcome.assignment = route.assignment  # RETRY when it went to the control; the split's otherwise
        await self._forward(outcome, endpoint, request, deadline)
        return outcome

    def route(
        self,
        outcome: CallOutcome,
        request: bytes,
        headers: Mapping[str, str],
        head: router_pb2.InferRequestHead | None = None,
        *,
        http: bool = False,
    ) -> tuple[ModelRoutes, Route]:
        """Read the request head (no tensors decoded) and pick the version: pin, sticky split, or the
        control when the arm has no eligible endpoint. Fills ``outcome`` (id, model, key, version, arm)
        as far as it gets; raises SplitstreamError (InvalidInput, ModelNotFound, ModelNotReady) with the
        id always set. Unary calls and the first request of a token stream route alike.

        A version served by an ``openai`` HTTP upstream is refused (WrongProtocol) unless ``http``: only
        the HTTP front door can pass a request through to it."""
        try:
            head = head or _read_head(request)
            outcome.request_id = outcome.request_id or head.id
            routes = self._table.model(head.model_name)
            outcome.model = head.model_name
            outcome.phase = routes.experiment.phase
            outcome.routing_key_header = routes.experiment.routing_key_header
            outcome.routing_key = headers.get(outcome.routing_key_header)
            pinned = _pinned_version(headers.get(VERSION_HEADER), head.model_version)
            if pinned:  # a pin refused (no such version) is still no randomized exposure
                outcome.assignment = Assignment.PIN
            route = routes.route(routing_key=outcome.routing_key, pinned_version=pinned)
        finally:
            outcome.request_id = outcome.request_id or uuid.uuid4().hex
        if route.fallback:
            self.metrics.fallbacks.labels(outcome.model, route.arm, route.version).inc()
        outcome.version, outcome.arm = route.version, route.arm
        outcome.fallback, outcome.pinned = route.fallback, route.pinned
        outcome.assignment = route.assignment
        if route.pool.upstream is not None and not http:
            raise WrongProtocol(
                f"model '{outcome.model}' version '{route.version}' is served by an OpenAI-compatible HTTP "
                "upstream; call it over the router's HTTP port (POST /v1/chat/completions or /v1/completions)"
            )
        return routes, route

    async def _forward(
        self,
        outcome: CallOutcome,
        endpoint: Endpoint,
        request: bytes,
        deadline: float | None,
    ) -> aio.AioRpcError | None:
        """Send the bytes to ``endpoint``; fill ``outcome``; return the error, if any."""
        outcome.endpoint = endpoint.address
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        self.metrics.in_flight.inc()
        try:
            outcome.response = await endpoint.call(request, timeout_s=timeout, request_id=outcome.request_id)
        except aio.AioRpcError as error:
            outcome.code = error.code()
            outcome.details = error.details() or ""
            outcome.response = None
            return error
        finally:
            self.metrics.in_flight.dec()
        outcome.code = grpc.StatusCode.OK
        outcome.details = ""
        return None

    @staticmethod
    def retry_target(routes: ModelRoutes, route: Route, failed: PoolMember) -> tuple[Route, PoolMember] | None:
        """Another endpoint of the version, else an endpoint of the control (unless pinned); the caller
        checks that it speaks its protocol (the control of a model may be an ``openai`` upstream)."""
        other = route.pool.pick(exclude=failed)
        if other is not None:
            return route, other
        fallback = routes.fallback_after_failure(route)
        if fallback is None:
            return None
        endpoint = fallback.pool.pick()
        return None if endpoint is None else (fallback, endpoint)

    @staticmethod
    def unavailable(outcome: CallOutcome, route: Route) -> CallOutcome:
        error = ModelNotReady(f"model '{outcome.model}' version '{route.version}' has no healthy endpoint")
        outcome.code, outcome.details = error.code, str(error)
        return outcome

    # -- what the servicer and the shadow runner ask (they never read the table) ----------

    def model_names(self) -> list[str]:
        return sorted(self._table.models)

    def serves(self, model: str) -> bool:
        return model in self._table.models

    def is_ready(self, model: str, version: str = "") -> bool:
        """ModelReady: whether ``version`` (empty: the control) has an endpoint to serve it now."""
        routes = self._table.models.get(model)
        if routes is None:
            return False
        pool = routes.pools.get(version or routes.experiment.control)
        return pool is not None and pool.has_eligible()

    def metadata_endpoint(self, model: str, version: str = "") -> tuple[Endpoint, str, list[str]]:
        """Where to ask ModelMetadata: an endpoint of ``version`` (empty: the control), that version, and
        every version the router knows for the model. Raises ModelNotFound / ModelNotReady."""
        routes = self._table.model(model)
        version = version or routes.experiment.control
        pool = routes.pools.get(version)
        if pool is None:
            raise ModelNotFound(f"model '{model}' has no version '{version}'")
        if pool.upstream is not None:
            raise WrongProtocol(f"model '{model}' version '{version}' is an OpenAI-compatible HTTP upstream")
        endpoint = pool.pick_grpc()
        if endpoint is None:
            raise ModelNotReady(f"model '{model}' version '{version}' has no healthy endpoint")
        return endpoint, version, sorted(routes.pools)

    def shadows_of(self, model: str) -> Sequence[Shadow]:
        """The model's shadow versions and sample rates (none for a model no longer served)."""
        routes = self._table.models.get(model)
        return () if routes is None else routes.experiment.shadows

    def shadow_endpoint(self, model: str, version: str) -> Endpoint | None:
        """The least-loaded eligible endpoint of a shadow version, if it has one now."""
        routes = self._table.models.get(model)
        pool = None if routes is None else routes.pools.get(version)
        return None if pool is None else pool.pick_grpc()

    def views(self, model: str = "") -> list[ModelView]:
        """Every model (or the one named), by name, for Status."""
        return [
            ModelView(name, routes.experiment, routes.pools, frozenset(_spilling(routes)))
            for name, routes in sorted(self._table.models.items())
            if not model or name == model
        ]

    def arm_spilling(self) -> dict[tuple[str, str], bool]:
        """``{(model, arm version): spilling}`` for every arm now."""
        arms = {}
        for name, routes in self._table.models.items():
            spilling = _spilling(routes)
            for arm in routes.experiment.arms:
                arms[name, arm.version] = arm.version in spilling
        return arms

    def _eligibility_changed(self) -> None:
        """An endpoint's eligibility may have changed: export the arms' state once this burst of events is
        over (a worker stopping turns each of its endpoints unreachable, one callback each)."""
        if not self._arms_pending:
            self._arms_pending = True
            asyncio.get_running_loop().call_soon(self._export_arms)

    def _export_arms(self) -> None:
        self._arms_pending = False
        self.metrics.set_arms(self.arm_spilling())

    # -- registry --------------------------------------------------------------------------

    def apply(self, state: RegistryState) -> None:
        """Swap in a table for ``state``, keeping endpoints (and their connections) that remain."""
        old = self._table.endpoints
        endpoints: dict[tuple[str, str, str], PoolMember] = {}
        models: dict[str, ModelRoutes] = {}
        for model, entry in state.models.items():
            pools: dict[str, VersionPool] = {}
            versions = dict.fromkeys([*entry.experiment.versions, *entry.endpoints])
            for version in versions:
                members = []
                upstream = entry.upstreams.get(version)
                for address in entry.endpoints.get(version, ()):
                    key = (model, version, address)
                    endpoint = old.get(key)
                    if endpoint is None or endpoint.upstream != upstream:  # new, or its settings changed
                        endpoint = self._new_endpoint(model, version, address, upstream)
                    endpoints[key] = endpoint
                    members.append(endpoint)
                pools[version] = VersionPool(version, members, upstream)
            models[model] = ModelRoutes(experiment=entry.experiment, pools=pools)
        self.routing_key_headers = frozenset(routes.experiment.routing_key_header for routes in models.values())
        self._table = RoutingTable(models=models, endpoints=endpoints)
        self.generation += 1
        self.applied_unix_ns = time.time_ns()
        for key, endpoint in old.items():
            if endpoints.get(key) is not endpoint:
                self._close_later(endpoint)
        self.metrics.set_arms(self.arm_spilling())

    def _new_endpoint(self, model: str, version: str, address: str, upstream: OpenAIUpstream | None) -> PoolMember:
        if upstream is not None:
            from splitstream.router.upstreams import OpenAIEndpoint, UpstreamHttp  # aiohttp: on first use

            if self._upstream_http is None:
                self._upstream_http = UpstreamHttp()
            member = OpenAIEndpoint(
                address,
                upstream,
                self._upstream_http,
                eject_after_failures=self.settings.eject_after_failures,
                eject_duration_s=self.settings.eject_duration_s,
                on_eject=self.metrics.ejections.labels(model, version, address).inc,
                on_eligibility=self._eligibility_changed,
            )
            member.start_health_watch()
            return member
        endpoint = Endpoint(
            address,
            channel_options=self.settings.channel_options,
            tls=self.settings.tls,
            eject_after_failures=self.settings.eject_after_failures,
            eject_duration_s=self.settings.eject_duration_s,
            on_eject=self.metrics.ejections.labels(model, version, address).inc,
            on_eligibility=self._eligibility_changed,
        )
        endpoint.credentials_generation = self.credentials_generation
        endpoint.start_health_watch()
        return endpoint

    async def follow_upstream_credentials(self, *, poll_s: float, ready_timeout_s: float = 5.0) -> None:
        """Until cancelled: when the ``--upstream-tls-*`` files change, give every worker endpoint a channel
        made from them and drain its old one (gRPC Python has no dynamic channel credentials, so a channel
        left open would present the old client certificate at its next reconnect, which a worker trusting
        only the new CA refuses). Endpoints that could not switch yet are retried at each poll."""
        watch = ClientFilesWatch(self.settings.tls)
        if not watch.watching:
            return
        while True:
            await asyncio.sleep(poll_s)
            if watch.changed():
                self.credentials_generation += 1
                self.metrics.upstream_tls_reloads.inc()
            stale = [
                e
                for e in self._table.endpoints.values()
                if isinstance(e, Endpoint) and e.credentials_generation < self.credentials_generation
            ]
            if stale:
                await asyncio.gather(*(self._renew(endpoint, ready_timeout_s) for endpoint in stale))

    async def _renew(self, endpoint: Endpoint, ready_timeout_s: float) -> None:  # gRPC endpoints only
        generation = self.credentials_generation
        try:
            old = await endpoint.renew_channel(ready_timeout_s=ready_timeout_s)
        except Exception:  # one endpoint's surprise must not stop the others' renewal
            log.exception("endpoint channel renewal failed", endpoint=endpoint.address)
            self.metrics.upstream_channel_renewals.labels("error").inc()
            return
        if old is None:
            self.metrics.upstream_channel_renewals.labels("deferred").inc()
            return
        endpoint.credentials_generation = generation
        self.metrics.upstream_channel_renewals.labels("ok").inc()
        task = asyncio.create_task(old.close(grace=self.settings.drain_timeout_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _close_later(self, endpoint: PoolMember) -> None:
        """Close a removed endpoint once its calls in flight are done; the task is tracked, not fired and forgotten."""
        task = asyncio.create_task(endpoint.close(drain_timeout_s=self.settings.drain_timeout_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every endpoint (after in-flight calls) and wait for earlier closes."""
        for endpoint in self._table.endpoints.values():
            self._close_later(endpoint)
        self._table = EMPTY_TABLE
        self.metrics.set_arms({})
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._upstream_http is not None:
            await self._upstream_http.close()


def _spilling(routes: ModelRoutes) -> set[str]:
    """The arms with no eligible endpoint now (an arm without a pool has none)."""
    pools = routes.pools
    return {
        arm.version
        for arm in routes.experiment.arms
        if (pool := pools.get(arm.version)) is None or not pool.has_eligible()
    }


def _read_head(request: bytes) -> router_pb2.InferRequestHead:
    try:
        return router_pb2.InferRequestHead.FromString(request)
    except DecodeError:
        raise InvalidInput("request is not a valid inference.ModelInferRequest") from None


def _pinned_version(header: str | None, model_version: str) -> str | None:
    if header and model_version and header != model_version:
        raise InvalidInput(f"{VERSION_HEADER} '{header}' conflicts with the request's model_version '{model_version}'")
    return header or model_version or None
