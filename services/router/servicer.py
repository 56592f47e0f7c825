"""The router's gRPC edge: raw-bytes handlers for inference, typed ones for the rest.

ModelInfer (Open Inference Protocol) and splitstream.v1.Router/Infer share one
handler that receives the request as bytes (no deserializer), so tensors are
never decoded on the way through; the worker's response bytes go back as they
came. The other Open Inference Protocol methods answer for the router itself
(live/ready/server metadata) or ask a worker of the model (model metadata).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog
from grpc import aio

import splitstream
from splitstream.common.errors import SplitstreamError, status_of
from splitstream.common.handlers import typed_unary
from splitstream.common.headers import (
    REQUEST_ID_HEADER,
    VERSION_HEADER,
    echoed_request_id,
    from_header_value,
    header_value,
)
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import router_pb2
from splitstream.router.auth.call import CALL_HEAD, CALL_PRINCIPAL
from splitstream.router.core import UNKNOWN_MODEL, CallOutcome, RouterCore
from splitstream.router.metrics import RouterMetrics
from splitstream.router.streams import StreamProxy

log = structlog.get_logger()

_INFER_METHODS = frozenset({"/inference.GRPCInferenceService/ModelInfer", "/splitstream.v1.Router/Infer"})
#: Headers the core reads; everything else in the client's metadata is ignored.
_WANTED_HEADERS = frozenset({REQUEST_ID_HEADER, VERSION_HEADER})
#: Where :meth:`RouterServicer._headers` keeps the ``x-request-id`` value as the client sent it (for the
#: trailer), beside the decoded id the core reads; not a header name a client can send (upper case).
_SENT_ID = "X-SENT-REQUEST-ID"


class RouterServicer:
    def __init__(
        self, core: RouterCore, *, router_id: str, registry_description: str, streams: StreamProxy | None = None
    ) -> None:
        self.core = core
        self.streams = streams or StreamProxy(core)
        self.router_id = router_id
        self.registry_description = registry_description
        self.registry_error = ""
        self.ready = False
        #: Gets every finished call of a known model (shadows, then recording); None when both are off.
        self.after_answer: Callable[[CallOutcome, bytes, Sequence[tuple[str, str | bytes]]], None] | None = None
        #: The credentials reload (:meth:`CredentialReloader.reload_everywhere`), or None without authentication.
        self.reload: Callable[[], Awaitable[router_pb2.ReloadCredentialsResponse]] | None = None

    def interceptors(self) -> list[aio.ServerInterceptor]:
        """For the server this servicer is added to: they count what gRPC refuses before ``infer``, and
        make health and reflection parse their own requests (bytes that do not parse: INVALID_ARGUMENT)."""
        return [CountReceived(self.core.metrics)]

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        raw_infer = grpc.unary_unary_rpc_method_handler(self.infer)  # bytes in, bytes out
        return [
            grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService",
                {
                    "ModelInfer": raw_infer,
                    # Bytes both ways too: tokens are relayed as the worker sent them.
                    "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self.stream_infer),
                    "ServerLive": typed_unary(self.server_live, oip.ServerLiveRequest),
                    "ServerReady": typed_unary(self.server_ready, oip.ServerReadyRequest),
                    "ModelReady": typed_unary(self.model_ready, oip.ModelReadyRequest),
                    "ServerMetadata": typed_unary(self.server_metadata, oip.ServerMetadataRequest),
                    "ModelMetadata": typed_unary(self.model_metadata, oip.ModelMetadataRequest),
                },
            ),
            grpc.method_handlers_generic_handler(
                "splitstream.v1.Router",
                {
                    "Infer": raw_infer,
                    "Status": typed_unary(self.status, router_pb2.StatusRequest),
                    "ReloadCredentials": typed_unary(self.reload_credentials, router_pb2.ReloadCredentialsRequest),
                },
            ),
        ]

    async def infer(self, request: bytes, context: aio.ServicerContext[bytes, bytes]) -> bytes:
        """Every call ends with a status: a bug of ours is INTERNAL (never grpc's UNKNOWN with a Python
        class name), and trailers gRPC could refuse are never set (see :func:`_trailers`)."""
        metadata = context.invocation_metadata() or ()
        headers = self._headers(metadata)
        try:
            outcome = await self.core.infer(request, headers, context.time_remaining(), CALL_HEAD.get())
        except Exception:
            log.exception("router call failed")
            await context.abort(*status_of(RuntimeError()))
            raise AssertionError("unreachable: abort raises") from None
        outcome.principal = CALL_PRINCIPAL.get()
        if outcome.model != UNKNOWN_MODEL and self.after_answer is not None:
            self.after_answer(outcome, request, metadata)
        trailers = _trailers(outcome, headers.get(_SENT_ID))
        if outcome.response is not None:
            # Trailing, not initial, metadata: it rides with the status, while sending initial
            # metadata early costs an extra batch of operations (~0.1 ms a call, measured).
            context.set_trailing_metadata(trailers)
            return outcome.response
        await context.abort(outcome.code, outcome.details, trailing_metadata=trailers)
        raise AssertionError("unreachable: abort raises")

    async def stream_infer(self, requests: AsyncIterator[bytes], context: aio.ServicerContext[bytes, bytes]) -> None:
        """A token stream (see :mod:`splitstream.router.streams`). It ends like a unary call would: the
        routing errors with the same codes, the worker's status as it sent it, a bug of ours as INTERNAL;
        the trailers name the served version and the request id."""
        metadata = context.invocation_metadata() or ()
        headers = self._headers(metadata)
        try:
            outcome = await self.streams.relay(requests, context.write, headers, metadata, context.time_remaining())
        except Exception:
            log.exception("router stream failed")
            await context.abort(*status_of(RuntimeError()))
            raise AssertionError("unreachable: abort raises") from None
        if outcome is None:  # the client closed without a request: nothing to route, nothing to say
            return
        trailers = _trailers(outcome, headers.get(_SENT_ID))
        if outcome.code == grpc.StatusCode.OK:
            context.set_trailing_metadata(trailers)
            return
        await context.abort(outcome.code, outcome.details, trailing_metadata=trailers)

    def _headers(self, metadata: Sequence[tuple[str, str | bytes]]) -> dict[str, str]:
        """The headers the core reads. The request id is decoded (a header can only carry a non-ASCII id
        percent-encoded); routing keys and pins are kept as sent, since a key's bytes pick its bucket."""
        routing_headers = self.core.routing_key_headers
        headers: dict[str, str] = {}
        for key, value in metadata:
            if (key in _WANTED_HEADERS or key in routing_headers) and isinstance(value, str):
                headers[key] = value
        if REQUEST_ID_HEADER in headers:
            headers[_SENT_ID] = sent = headers[REQUEST_ID_HEADER]
            headers[REQUEST_ID_HEADER] = from_header_value(sent)
        return headers

    async def server_live(self, request: oip.ServerLiveRequest, context: Any) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=True)

    async def server_ready(self, request: oip.ServerReadyRequest, context: Any) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=self.ready)

    async def model_ready(self, request: oip.ModelReadyRequest, context: Any) -> oip.ModelReadyResponse:
        return oip.ModelReadyResponse(ready=self.ready and self.core.is_ready(request.name, request.version))

    async def server_metadata(self, request: oip.ServerMetadataRequest, context: Any) -> oip.ServerMetadataResponse:
        return oip.ServerMetadataResponse(name="splitstream-router", version=splitstream.__version__)

    async def model_metadata(
        self, request: oip.ModelMetadataRequest, context: aio.ServicerContext[Any, Any]
    ) -> oip.ModelMetadataResponse:
        """Ask a worker of the requested version (else the control) and list every version the router knows."""
        try:
            return await self.fetch_model_metadata(request.name, request.version, context.time_remaining())
        except SplitstreamError as error:
            await context.abort(*status_of(error))
            raise AssertionError("unreachable: abort raises") from error
        except aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
            raise AssertionError("unreachable: abort raises") from error

    async def fetch_model_metadata(self, name: str, version: str, timeout_s: float | None) -> oip.ModelMetadataResponse:
        """ModelMetadata's answer, for the gRPC method and the HTTP front door's KServe route alike: raises
        SplitstreamError (unknown model or version, no healthy endpoint) or the worker's AioRpcError."""
        endpoint, version, versions = self.core.metadata_endpoint(name, version)
        stub = endpoint.channel.unary_unary(
            "/inference.GRPCInferenceService/ModelMetadata",
            request_serializer=oip.ModelMetadataRequest.SerializeToString,
            response_deserializer=oip.ModelMetadataResponse.FromString,
        )
        response: oip.ModelMetadataResponse = await stub(
            oip.ModelMetadataRequest(name=name, version=version), timeout=timeout_s
        )
        del response.versions[:]
        response.versions.extend(versions)
        return response

    async def reload_credentials(
        self, request: router_pb2.ReloadCredentialsRequest, context: Any
    ) -> router_pb2.ReloadCredentialsResponse:
        """SIGHUP's reload, asked for over gRPC (the interceptor has checked the ``reload`` grant)."""
        if self.reload is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this router does not authenticate callers (no --auth-principals): it has no credentials to reload",
            )
            raise AssertionError("unreachable: abort raises")
        try:
            response = await self.reload()
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the credentials reload did not finish in 30 s")
            raise AssertionError("unreachable: abort raises") from None
        response.router_id = self.router_id
        return response

    async def status(self, request: router_pb2.StatusRequest, context: Any) -> router_pb2.StatusResponse:
        response = router_pb2.StatusResponse(
            router_id=self.router_id,
            registry=self.registry_description,
            registry_generation=self.core.generation,
            registry_applied_unix_ns=self.core.applied_unix_ns,
            registry_error=self.registry_error,
        )
        now = time.monotonic()
        for view in self.core.views(request.model):
            experiment = view.experiment
            status = response.models.add(model=view.model)
            status.experiment.salt = experiment.salt
            status.experiment.control = experiment.control
            status.experiment.routing_key_header = experiment.routing_key_header
            for arm in experiment.arms:
                status.experiment.arms.add(
                    version=arm.version,
                    weight=arm.weight,
                    bucket_start=arm.bucket_start,
                    bucket_end=arm.bucket_end,
                    spilling=arm.version in view.spilling,
                )
            for shadow in experiment.shadows:
                status.experiment.shadows.add(version=shadow.version, sample_rate=shadow.sample_rate)
            for version, pool in view.pools.items():
                pool_status = status.versions.add(version=version)
                for endpoint in pool.endpoints:
                    pool_status.endpoints.add(
                        address=endpoint.address,
                        health=int(endpoint.health),
                        outstanding=endpoint.outstanding,
                        ejected=endpoint.ejected,
                        ejected_for_s=max(endpoint.ejected_until - now, 0.0),
                        calls=endpoint.calls,
                        failures=endpoint.failures,
                    )
        if request.model and not response.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model '{request.model}'")
        return response


class CountReceived(aio.ServerInterceptor):
    """Counts inference calls as gRPC hands them over, before it reads their message.

    gRPC refuses some calls before any handler runs (a message over the size limit:
    RESOURCE_EXHAUSTED; a deadline already gone: DEADLINE_EXCEEDED), so they reach no
    counter of the handler's; an interceptor still sees them. What ``requests_total`` lacks
    against this count (less calls in flight) is what gRPC refused. The cost was within the
    noise of an echo call (~350 µs, client and server in one process, 3 rounds of 3000 calls, measured)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._received = metrics.received

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method in _INFER_METHODS:
            self._received.inc()
        return await continuation(handler_call_details)


def _trailers(outcome: CallOutcome, sent_id: str | None) -> tuple[tuple[str, str], ...]:
    """The response's trailers, every value through :func:`header_value`: gRPC core refuses a value that
    is not printable ASCII, and a refused trailer turns the answer into INTERNAL "Invalid metadata"; an id
    too long for a header is left out (the response's ``id`` field has it). An id the client sent as a
    header comes back as sent (it is valid metadata already), so ``a%41`` is echoed as ``a%41``."""
    trailers = echoed_request_id(sent_id, outcome.request_id)
    if outcome.version:
        trailers = ((VERSION_HEADER, header_value(outcome.version)), *trailers)
    return trailers
