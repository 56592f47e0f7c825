"""Caller authentication and authorization at the router's edge: one server interceptor.

Credentials, read from the call's metadata (Triton and KServe clients can set headers):

- ``x-api-key: <key>``: an API key whose SHA-256 the principals document lists;
- ``authorization: Bearer <jwt>``: a JWT verified against the JWKS (:mod:`.jwks`), whose principal
  claim names an entry of the principals document (its grants).

A call carrying both is refused (which one should win is a guess the router does not make). What
each method needs:

==============================================================  =========================================
method                                                          needs
==============================================================  =========================================
``ModelInfer``, ``splitstream.v1.Router/Infer``                 the request's model; ``pin`` when the call
                                                                pins a version (header or model_version)
``ModelStreamInfer``                                            the same, for every request of the stream
``ModelMetadata``, ``ModelReady``                               the request's model
``splitstream.v1.Router/Status``                                ``status``
``splitstream.v1.Feedback/Report``                              ``feedback``
other methods (``ServerLive``, ``ServerReady``, ...)             an authenticated caller
``grpc.health.v1.Health/*``, server reflection                  nothing: open, so Consul's, Kubernetes'
                                                                and balancers' health checks keep working
==============================================================  =========================================

Refusals: no credential or one that does not verify → UNAUTHENTICATED; a caller without the grant
→ PERMISSION_DENIED; over its rate limit → RESOURCE_EXHAUSTED. Messages name what is wrong, never a
token or key. Each is counted by reason; calls let through and calls rate-limited are counted by
principal (configured names only: a bounded label set).

The model name comes from the request head (the three leading fields the router reads anyway), and
the parsed head is handed to the router's core through :data:`CALL_HEAD`, so a request is never
parsed twice (a 16 MiB request's head costs ~1 ms to parse, measured). The principal's name reaches
the servicer through :data:`CALL_PRINCIPAL` (the handler runs in the task the interceptor's wrapper
runs in), which records it.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitstream.common.headers import VERSION_HEADER
from splitstream.common.proto.splitstream.v1 import router_pb2
from splitstream.router.auth.credentials import PrincipalsStore
from splitstream.router.auth.jwks import JwtVerifier, TokenRejected, bearer_token
from splitstream.router.auth.policy import Principal
from splitstream.router.auth.ratelimit import RateLimiter

API_KEY_HEADER = "x-api-key"
AUTHORIZATION_HEADER = "authorization"

#: The authenticated caller of the call running now ("" when authentication is off).
CALL_PRINCIPAL: contextvars.ContextVar[str] = contextvars.ContextVar("splitstream_call_principal", default="")
#: The request head the interceptor parsed for this call, if it did.
CALL_HEAD: contextvars.ContextVar[router_pb2.InferRequestHead | None] = contextvars.ContextVar(
    "splitstream_call_head", default=None
)

_INFER = frozenset({"/inference.GRPCInferenceService/ModelInfer", "/splitstream.v1.Router/Infer"})
_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
_MODEL = frozenset({"/inference.GRPCInferenceService/ModelMetadata", "/inference.GRPCInferenceService/ModelReady"})
_STATUS = "/splitstream.v1.Router/Status"
_FEEDBACK = "/splitstream.v1.Feedback/Report"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

FAILURE_REASONS = (
    "missing",
    "ambiguous",
    "api_key",
    "malformed",
    "algorithm",
    "unknown_key",
    "expired",
    "not_yet_valid",
    "audience",
    "issuer",
    "missing_claim",
    "signature",
    "invalid",
    "unknown_principal",
    "model",
    "pin",
    "status",
    "feedback",
    "bad_request",
)


class AuthMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.failures = Counter(
            "splitstream_router_auth_failures",
            "Calls refused by caller authentication (UNAUTHENTICATED) or authorization (PERMISSION_DENIED), by reason",
            ["code", "reason"],
            registry=registry,
        )
        self.allowed = Counter(
            "splitstream_router_auth_calls", "Calls let through, by principal", ["principal"], registry=registry
        )
        self.rate_limited = Counter(
            "splitstream_router_auth_rate_limited",
            "Calls refused RESOURCE_EXHAUSTED by the principal's rate limit, by principal",
            ["principal"],
            registry=registry,
        )
        self.reloads = Counter(
            "splitstream_router_auth_reloads",
            "Principals documents read: ok, or error (the last good one kept)",
            ["result"],
            registry=registry,
        )
        self.principals = Gauge(
            "splitstream_router_auth_principals",
            "Principals in the document in force",
            registry=registry,
            multiprocess_mode="livemax",  # --processes: every child reads the same document
        )


@dataclass(frozen=True, slots=True)
class Refusal:
    code: grpc.StatusCode
    message: str
    reason: str


class Refused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class Authenticator:
    """Credentials → principal, and the grant checks; knows nothing of gRPC servers (metadata in, names out)."""

    def __init__(
        self, store: PrincipalsStore, *, jwt: JwtVerifier | None, api_keys: bool, limiter: RateLimiter
    ) -> None:
        self.store = store
        self.jwt = jwt
        self.api_keys = api_keys
        self.limiter = limiter

    def _accepted(self) -> str:
        forms = []
        if self.api_keys:
            forms.append(f"an API key in '{API_KEY_HEADER}'")
        if self.jwt is not None:
            forms.append(f"a JWT in '{AUTHORIZATION_HEADER}: Bearer ...'")
        return " or ".join(forms)

    async def authenticate(self, metadata: tuple[tuple[str, str | bytes], ...]) -> Principal:
        keys = [v for k, v in metadata if k == API_KEY_HEADER and isinstance(v, str)]
        authorizations = [v for k, v in metadata if k == AUTHORIZATION_HEADER and isinstance(v, str)]
        token = bearer_token(authorizations) if self.jwt is not None else None
        if self.api_keys and keys and token is not None:
            raise _unauthenticated(
                f"send one credential: both '{API_KEY_HEADER}' and '{AUTHORIZATION_HEADER}' were sent", "ambiguous"
            )
        policy = self.store.policy
        assert policy is not None  # loaded before serving
        if self.api_keys and keys:
            principal = policy.by_api_key(keys[0].strip())
            if principal is None:
                raise _unauthenticated(f"the API key in '{API_KEY_HEADER}' is not valid", "api_key")
            return principal
        if token is not None and self.jwt is not None:
            try:
                name = await self.jwt.verify(token)
            except TokenRejected as error:
                raise _unauthenticated(str(error), error.reason) from None
            principal = policy.principals.get(name)
            if principal is None:
                raise Refused(
                    Refusal(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"principal '{name}' is not in the router's principals document (no grants)",
                        "unknown_principal",
                    )
                )
            return principal
        raise _unauthenticated(f"no credentials: send {self._accepted()}", "missing")


def _unauthenticated(message: str, reason: str) -> Refused:
    return Refused(Refusal(grpc.StatusCode.UNAUTHENTICATED, message, reason))


def _denied(message: str, reason: str) -> Refused:
    return Refused(Refusal(grpc.StatusCode.PERMISSION_DENIED, message, reason))


def check_model(
    principal: Principal, head: router_pb2.InferRequestHead, *, pinned_header: str | None, infer: bool
) -> None:
    if not principal.may_call(head.model_name):
        raise _denied(f"principal '{principal.name}' may not call model '{head.model_name}'", "model")
    if infer and (pinned_header or head.model_version) and not principal.pin:
        raise _denied(f"principal '{principal.name}' may not pin a version ({VERSION_HEADER} or model_version)", "pin")


def read_head(request: bytes, method: str = "") -> router_pb2.InferRequestHead:
    """The head of a ModelInferRequest, ModelMetadataRequest or ModelReadyRequest (name and version are
    fields 1 and 2 of all three); INVALID_ARGUMENT naming the message, as the handler itself would."""
    try:
        return router_pb2.InferRequestHead.FromString(request)
    except DecodeError:
        message = f"inference.{method.rpartition('/')[2]}Request" if method in _MODEL else "inference.ModelInferRequest"
        raise Refused(
            Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {message}", "bad_request")
        ) from None


class AuthInterceptor(aio.ServerInterceptor):
    """Wraps each handler so that the call is authenticated and authorized before the handler runs."""

    def __init__(self, authenticator: Authenticator, metrics: AuthMetrics) -> None:
        self.auth = authenticator
        self.metrics = metrics
        # Registered handlers are the same objects call after call: each is wrapped once, not per call.
        self._wrapped: dict[tuple[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        wrapped = self._wrapped.get((method, handler))
        if wrapped is None:
            wrapped = self._wrapped[method, handler] = self._wrap(handler, method)
        return wrapped

    async def _admit(self, method: str, context: aio.ServicerContext[Any, Any], request: bytes | None) -> Principal:
        """Authenticate, rate-limit and authorize one call (``request``: the unary request's bytes)."""
        metadata = tuple(context.invocation_metadata() or ())
        try:
            principal = await self.auth.authenticate(metadata)
            if not self.auth.limiter.allow(principal):
                self.metrics.rate_limited.labels(principal.name).inc()
                limit = principal.rate_limit
                assert limit is not None
                raise Refused(
                    Refusal(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"principal '{principal.name}' is over its rate limit ({limit.per_s:g}/s, burst {limit.burst})",
                        "rate_limited",
                    )
                )
            if method == _STATUS and not principal.status:
                raise _denied(f"principal '{principal.name}' may not read Status", "status")
            if method == _FEEDBACK and not principal.feedback:
                raise _denied(f"principal '{principal.name}' may not report feedback", "feedback")
            if request is not None and (method in _INFER or method in _MODEL):
                head = read_head(request, method)
                pinned = _header(metadata, VERSION_HEADER)
                check_model(principal, head, pinned_header=pinned, infer=method in _INFER)
                CALL_HEAD.set(head if method in _INFER else None)
        except Refused as refused:
            refusal = refused.refusal
            if refusal.reason != "rate_limited":
                self.metrics.failures.labels(refusal.code.name, refusal.reason).inc()
            await context.abort(refusal.code, refusal.message)
            raise AssertionError("unreachable: abort raises") from None
        CALL_PRINCIPAL.set(principal.name)
        self.metrics.allowed.labels(principal.name).inc()
        return principal

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        admit = self._admit
        metrics = self.metrics
        if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
            unary = handler.unary_unary

            async def unary_call(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                await admit(method, context, request if isinstance(request, bytes) else None)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_call,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            unary_stream = handler.unary_stream

            async def unary_stream_call(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                await admit(method, context, request if isinstance(request, bytes) else None)
                async for response in unary_stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream_call,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        stream = handler.stream_stream or handler.stream_unary
        if stream is None:
            return _refusing(handler)
        per_request = method == _STREAM_INFER

        async def checked(
            requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any], principal: Principal
        ) -> AsyncIterator[Any]:
            """Each request of the stream checked for the model and the pin before the handler sees it."""
            metadata = tuple(context.invocation_metadata() or ())
            pinned = _header(metadata, VERSION_HEADER)
            async for request in requests:
                if per_request and isinstance(request, bytes):
                    try:
                        check_model(principal, read_head(request), pinned_header=pinned, infer=True)
                    except Refused as refused:
                        refusal = refused.refusal
                        metrics.failures.labels(refusal.code.name, refusal.reason).inc()
                        await context.abort(refusal.code, refusal.message)
                yield request

        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            stream_stream = handler.stream_stream

            async def stream_stream_call(
                requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                principal = await admit(method, context, None)
                async for response in stream_stream(checked(requests, context, principal), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                stream_stream_call,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        # A coroutine taking the request iterator: stream-unary, or stream-stream writing its responses with
        # context.write() (the router's ModelStreamInfer). Each request is checked as it is read.
        coroutine = stream if inspect.iscoroutinefunction(stream) else None
        if coroutine is not None:

            async def stream_call(requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]) -> Any:
                principal = await admit(method, context, None)
                return await coroutine(checked(requests, context, principal), context)

            make = (
                grpc.stream_unary_rpc_method_handler
                if handler.stream_stream is None
                else grpc.stream_stream_rpc_method_handler
            )
            return make(
                stream_call,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of a shape the wrapper does not know (a sync servicer: none of ours) is refused rather
    than served unchecked."""

    async def refuse(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.INTERNAL, "internal error: this method cannot be authorized")

    return grpc.unary_unary_rpc_method_handler(refuse)


def _header(metadata: tuple[tuple[str, str | bytes], ...], name: str) -> str | None:
    for key, value in metadata:
        if key == name and isinstance(value, str):
            return value
    return None
