"""Worker endpoints and the per-version pools the router picks from.

A pool's members are gRPC workers (:class:`Endpoint`, below) or, for a version the registry declares
``openai``, OpenAI-compatible HTTP servers (``splitstream.router.upstreams``); both subclass
:class:`PoolMember`, so eligibility, the pick and the breaker are one code. For a gRPC worker:

An endpoint is eligible when its grpc.health.v1 status is SERVING (or not yet
known) and the circuit breaker has not ejected it. Health comes from a Watch
stream per endpoint, so a worker that starts draining (NOT_SERVING) leaves the
rotation within milliseconds, before it stops accepting calls; a worker whose
connection drops is marked unreachable at once.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Sequence

import grpc
import structlog
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitstream.common.headers import request_id_metadata
from splitstream.common.registry import OpenAIUpstream
from splitstream.common.tls import PLAINTEXT, ClientTls

log = structlog.get_logger()

INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


class Health(enum.IntEnum):
    """Mirrors splitstream.v1.EndpointStatus.Health."""

    UNKNOWN = 0
    SERVING = 1
    NOT_SERVING = 2
    UNREACHABLE = 3


class PoolMember:
    """What a pool needs of an endpoint, whatever protocol it speaks: its health, load and circuit breaker.

    :class:`Endpoint` (a gRPC worker) and ``splitstream.router.upstreams.OpenAIEndpoint`` (an
    OpenAI-compatible HTTP server) follow their health each in their own way and share the rest, so the
    split's spill to the control, the least-loaded pick and ejection work the same for both."""

    #: How to call an ``openai`` upstream; None for a gRPC worker.
    upstream: OpenAIUpstream | None = None

    def __init__(
        self,
        address: str,
        *,
        eject_after_failures: int,
        eject_duration_s: float,
        on_eject: Callable[[], None] | None = None,
        on_eligibility: Callable[[], None] | None = None,
    ) -> None:
        """``on_eligibility`` is called whenever :attr:`eligible` may have changed (health, an ejection
        starting, running out or cleared by a success), so whoever exports it sets it then: with
        ``--processes`` nothing is computed at scrape time (the parent reads what the children set)."""
        self.address = address
        #: Which reading of the client TLS files this endpoint's channel was made from (see RouterCore).
        self.credentials_generation = 0
        self._closed = False
        self.health = Health.UNKNOWN
        self.outstanding = 0
        self.calls = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.ejected_until = 0.0
        self._eject_after_failures = eject_after_failures
        self._eject_duration_s = eject_duration_s
        self._on_eject = on_eject
        self._on_eligibility = on_eligibility
        self._ejection_end: asyncio.TimerHandle | None = None
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def eligible(self) -> bool:
        if self.health in (Health.NOT_SERVING, Health.UNREACHABLE):
            return False
        return self.ejected_until == 0.0 or time.monotonic() >= self.ejected_until

    @property
    def ejected(self) -> bool:
        return self.ejected_until > time.monotonic()

    def transport_failed(self) -> None:
        """Count an UNAVAILABLE answer for the circuit breaker (and the ejection metric when it ejects)."""
        if self.failed() and self._on_eject is not None:
            self._on_eject()

    def succeeded(self) -> None:
        self.consecutive_failures = 0
        if self.ejected_until:  # rarely: a call sent before the ejection came back fine
            still_ejected = self.ejected
            self.ejected_until = 0.0
            if still_ejected:
                self._eligibility_changed()

    def failed(self) -> bool:
        """Count a transport failure; returns True when this failure ejects the endpoint."""
        self.failures += 1
        self.consecutive_failures += 1
        if self.consecutive_failures >= self._eject_after_failures and not self.ejected:
            self.ejected_until = time.monotonic() + self._eject_duration_s
            log.warning(
                "endpoint ejected",
                endpoint=self.address,
                failures=self.consecutive_failures,
                for_s=self._eject_duration_s,
            )
            self._eligibility_changed()
            self._watch_ejection_end()
            return True
        return False

    def _watch_ejection_end(self) -> None:
        """Tell ``on_eligibility`` when the ejection runs out: nothing else happens then (eligibility is
        read from the clock), so without this an exported "spilling" would stay 1 until the next event."""
        if self._on_eligibility is None or self._closed:
            return
        if self._ejection_end is not None:
            self._ejection_end.cancel()
        remaining_s = self.ejected_until - time.monotonic()
        self._ejection_end = asyncio.get_running_loop().call_later(max(remaining_s, 0.0), self._ejection_over)

    def _ejection_over(self) -> None:
        self._ejection_end = None
        if self.ejected:  # the timer fired a hair early, or the ejection was renewed: look again then
            self._watch_ejection_end()
        elif self.ejected_until:
            self._eligibility_changed()

    def _eligibility_changed(self) -> None:
        if self._on_eligibility is not None and not self._closed:
            self._on_eligibility()

    def start_health_watch(self) -> None:
        self._watch_task = asyncio.create_task(self._watch_health(), name=f"health-watch {self.address}")

    async def _watch_health(self) -> None:
        raise NotImplementedError

    def _health_is(self, health: Health) -> None:
        if health != self.health:
            log.info("endpoint health", endpoint=self.address, health=health.name)
            self.health = health
            if health is Health.SERVING:
                self.succeeded()
            self._eligibility_changed()

    def _set_unreachable(self) -> None:
        if self.health is not Health.UNREACHABLE:
            log.info("endpoint health", endpoint=self.address, health=Health.UNREACHABLE.name)
            self.health = Health.UNREACHABLE
            self._eligibility_changed()

    def _stop_watching(self) -> None:
        self._closed = True
        if self._ejection_end is not None:
            self._ejection_end.cancel()
        if self._watch_task is not None:
            self._watch_task.cancel()

    async def close(self, *, drain_timeout_s: float) -> None:
        """Stop watching; a subclass also lets calls in flight finish (at most ``drain_timeout_s``)."""
        self._stop_watching()


class Endpoint(PoolMember):
    """One gRPC worker address: its channel, followed by a grpc.health.v1 Watch."""

    def __init__(
        self,
        address: str,
        *,
        channel_options: Sequence[tuple[str, int | str]],
        tls: ClientTls = PLAINTEXT,
        eject_after_failures: int,
        eject_duration_s: float,
        on_eject: Callable[[], None] | None = None,
        on_eligibility: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            address,
            eject_after_failures=eject_after_failures,
            eject_duration_s=eject_duration_s,
            on_eject=on_eject,
            on_eligibility=on_eligibility,
        )
        self._tls = tls
        self._channel_options = tuple(channel_options)
        self.channel = tls.aio_channel(address, channel_options)
        # Raw bytes in and out: the router forwards request bytes without decoding tensors.
        self.infer = self.channel.unary_unary(INFER_METHOD)
        self.stream_infer = self.channel.stream_stream(STREAM_INFER_METHOD)

    async def call(self, request: bytes, *, timeout_s: float | None, request_id: str) -> bytes:
        """Forward ``request`` and keep the books every caller relies on: calls in flight (for the
        least-outstanding pick), call and failure counts, and the circuit breaker. Raises the
        worker's AioRpcError unchanged.

        The metadata is built here, from the id, and nowhere else: a client's id that is not printable
        ASCII in a header makes gRPC core refuse the call's start without ever finishing it, so the
        forward hung until the client's deadline (for ever without one). :func:`request_id_metadata`
        makes any id valid, and leaves out one too long for a header."""
        metadata = request_id_metadata(request_id)
        self.outstanding += 1
        self.calls += 1
        try:
            response: bytes = await self.infer(request, timeout=timeout_s, metadata=metadata)
        except aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self.transport_failed()
            raise
        finally:
            self.outstanding -= 1
        self.succeeded()
        return response

    async def _watch_health(self) -> None:
        """Follow the worker's health; fall back to polling Check where Watch is unimplemented."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        backoff_s = 0.05
        poll = False
        while True:
            try:
                if poll:
                    response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                    self._set_health(response.status)
                    await asyncio.sleep(1.0)
                    continue
                async for response in stub.Watch(health_pb2.HealthCheckRequest()):
                    self._set_health(response.status)
                    backoff_s = 0.05
            except aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    if poll:  # no health service at all: health stays UNKNOWN (eligible); the breaker guards
                        log.warning("endpoint has no grpc.health.v1 service", endpoint=self.address)
                        return
                    poll = True
                    continue
                self._set_unreachable()
            # The stream ended (worker stopped) or failed: wait for the channel to reconnect.
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)

    def _set_health(self, status: int) -> None:
        self._health_is(Health.SERVING if status == health_pb2.HealthCheckResponse.SERVING else Health.NOT_SERVING)

    async def renew_channel(self, *, ready_timeout_s: float) -> aio.Channel | None:
        """Replace the channel by one made from the client TLS files as they are now; the old channel,
        returned for the caller to close with a grace (calls in flight on it finish there), or None when
        nothing was replaced.

        The new channel must connect first (``ready_timeout_s``): a worker that does not accept the new
        certificate yet (its CA not rotated) keeps being served over the old connection, with no failed
        call, and the caller tries again later. A worker unreachable anyway gets the new channel at once:
        its next connection must use the new files."""
        fresh = self._tls.aio_channel(self.address, self._channel_options)
        if self.health is not Health.UNREACHABLE:
            try:
                await asyncio.wait_for(fresh.channel_ready(), ready_timeout_s)
            except (TimeoutError, aio.AioRpcError, aio.UsageError) as error:
                log.warning(
                    "endpoint refused the rotated client certificate; keeping the current channel",
                    endpoint=self.address,
                    error=type(error).__name__,
                )
                await fresh.close()
                return None
        if self._closed:  # removed or shut down meanwhile
            await fresh.close()
            return None
        old = self.channel
        self.channel = fresh
        self.infer = fresh.unary_unary(INFER_METHOD)
        self.stream_infer = fresh.stream_stream(STREAM_INFER_METHOD)
        if self._watch_task is not None:  # follow health on the channel calls now use
            self._watch_task.cancel()
            self.start_health_watch()
        log.info("endpoint channel renewed with the rotated client certificate", endpoint=self.address)
        return old

    async def close(self, *, drain_timeout_s: float) -> None:
        """Stop watching, then close the channel once calls in flight finish (at most ``drain_timeout_s``)."""
        self._stop_watching()
        await self.channel.close(grace=drain_timeout_s)


class VersionPool:
    """The endpoints serving one model version; picks by least outstanding requests.

    ``upstream`` is set for a version served by OpenAI-compatible HTTP servers: its members are then
    ``OpenAIEndpoint`` objects, which only the HTTP front door can call; gRPC callers ask :meth:`pick_grpc`."""

    def __init__(self, version: str, endpoints: Sequence[PoolMember], upstream: OpenAIUpstream | None = None) -> None:
        self.version = version
        self.endpoints = tuple(endpoints)
        self.upstream = upstream
        self._rotation = 0

    def pick_grpc(self, exclude: PoolMember | None = None) -> Endpoint | None:
        """:meth:`pick` for a gRPC call: None for a version whose endpoints are not gRPC workers."""
        endpoint = self.pick(exclude)
        return endpoint if isinstance(endpoint, Endpoint) else None

    def pick(self, exclude: PoolMember | None = None) -> PoolMember | None:
        """The eligible endpoint with the fewest calls in flight; ties rotate so load spreads."""
        endpoints = self.endpoints
        count = len(endpoints)
        if count == 0:
            return None
        self._rotation = (self._rotation + 1) % count
        best: PoolMember | None = None
        for offset in range(count):
            endpoint = endpoints[(self._rotation + offset) % count]
            if endpoint is exclude or not endpoint.eligible:
                continue
            if best is None or endpoint.outstanding < best.outstanding:
                best = endpoint
        return best

    def has_eligible(self) -> bool:
        return any(endpoint.eligible for endpoint in self.endpoints)
