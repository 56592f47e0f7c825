"""Caller authentication and authorization at the router's gRPC edge: one server interceptor.

The checks themselves are :mod:`.gate`'s, shared with the HTTP front door; this module says which
each gRPC method needs and turns a refusal into the call's status. Credentials come from the call's
metadata (Triton and KServe clients can set headers): ``x-api-key: <key>``, or ``authorization:
Bearer <key or JWT>`` (:mod:`.gate`). What each method needs:

==============================================================  =========================================
method                                                          needs
==============================================================  =========================================
``ModelInfer``, ``splitstream.v1.Router/Infer``                 the request's model; ``pin`` when the call
                                                                pins a version (header or model_version)
``ModelStreamInfer``                                            the same, for every request of the stream
``ModelMetadata``, ``ModelReady``                               the request's model
``splitstream.v1.Router/Status``                                ``status``
``splitstream.v1.Router/ReloadCredentials``                     ``reload``
``splitstream.v1.Feedback/Report``                              ``feedback``
other methods (``ServerLive``, ``ServerReady``, ...)             an authenticated caller
``grpc.health.v1.Health/*``, server reflection                  nothing: open, so Consul's, Kubernetes'
                                                                and balancers' health checks keep working
==============================================================  =========================================

Refusals: no credential or one that does not verify → UNAUTHENTICATED; a caller without the grant
→ PERMISSION_DENIED; over its rate limit → RESOURCE_EXHAUSTED. The first two answer generic texts
with a request id, the detail logged under it (:mod:`.answers`); every refusal carries the request id
in its trailing metadata (``x-request-id``); no message ever quotes a token or key. Each is counted
by reason; calls let through and calls rate-limited are counted by principal (configured names only:
a bounded label set).

The model name comes from the request head (the three leading fields the router reads anyway), and
the parsed head is handed to the router's core through :data:`CALL_HEAD`, so a request is never
parsed twice (a 16 MiB request's head costs ~1 ms to parse, measured). The principal's name reaches
the servicer through :data:`CALL_PRINCIPAL` (the handler runs in the task the interceptor's wrapper
runs in), which records it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from splitstream.common.headers import VERSION_HEADER
from splitstream.common.proto.splitstream.v1 import router_pb2
from splitstream.router.auth.answers import public_answer
from splitstream.router.auth.call import CALL_HEAD
from splitstream.router.auth.gate import (
    API_KEY_HEADER,
    AUTHORIZATION_HEADER,
    CALL_PRINCIPAL,
    FAILURE_REASONS,
    FEEDBACK,
    RELOAD,
    STATUS,
    Authenticator,
    AuthMetrics,
    Gate,
    Refusal,
    Refused,
)
from splitstream.router.auth.policy import Principal

__all__ = [
    "API_KEY_HEADER",
    "AUTHORIZATION_HEADER",
    "CALL_HEAD",
    "CALL_PRINCIPAL",
    "FAILURE_REASONS",
    "AuthInterceptor",
    "AuthMetrics",
    "Authenticator",
    "check_model",
    "read_head",
]


_INFER = frozenset({"/inference.GRPCInferenceService/ModelInfer", "/splitstream.v1.Router/Infer"})
_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
_MODEL = frozenset({"/inference.GRPCInferenceService/ModelMetadata", "/inference.GRPCInferenceService/ModelReady"})
_STATUS = "/splitstream.v1.Router/Status"
_FEEDBACK = "/splitstream.v1.Feedback/Report"
_RELOAD = "/splitstream.v1.Router/ReloadCredentials"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def check_model(
    principal: Principal, head: router_pb2.InferRequestHead, *, pinned_header: str | None, infer: bool
) -> None:
    Gate.check_model(principal, head.model_name, pinned=infer and bool(pinned_header or head.model_version))


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
        self.gate = Gate(authenticator, metrics)
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
        gate = self.gate
        try:
            principal = await gate.admit(metadata)
            if method == _STATUS:
                gate.require(principal, STATUS)
            if method == _FEEDBACK:
                gate.require(principal, FEEDBACK)
            if method == _RELOAD:
                gate.require(principal, RELOAD)
            if request is not None and (method in _INFER or method in _MODEL):
                head = read_head(request, method)
                pinned = _header(metadata, VERSION_HEADER)
                check_model(principal, head, pinned_header=pinned, infer=method in _INFER)
                CALL_HEAD.set(head if method in _INFER else None)
        except Refused as refused:
            refusal = refused.refusal
            gate.count(refusal)
            answer = public_answer(refusal, method, metadata)
            await context.abort(refusal.code, answer.text, answer.trailers)
            raise AssertionError("unreachable: abort raises") from None
        gate.let_through(principal)
        return principal

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        admit = self._admit
        gate = self.gate
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
                        gate.count(refusal)
                        answer = public_answer(refusal, method, metadata)
                        await context.abort(refusal.code, answer.text, answer.trailers)
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
