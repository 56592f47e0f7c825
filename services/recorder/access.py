"""Only authenticated routers may write: the recorder's server interceptor.

With a service token configured (:mod:`splitstream.common.service_auth`), every call but health and
reflection must carry it. The check runs in ``intercept_service``, on the call's metadata, before the
handler exists: a refused Record stream has none of its messages read, so nothing of it can reach
Redis. With an allow-list of client-certificate identities, a call without the token is let through
when the certificate gRPC verified names an allowed identity (checked on the handler's context,
the only place gRPC exposes it).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from splitstream.common.service_auth import ServiceAuth
from splitstream.recorder.metrics import RecorderMetrics

_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_MESSAGES = {
    "missing": "no service token: this recorder takes records only from routers given its service token "
    "(authorization: Bearer ...)",
    "invalid": "the service token is not valid",
    "identity": "the client certificate is not one of the routers this recorder takes records from",
}


class RouterAccess(aio.ServerInterceptor):
    def __init__(self, auth: ServiceAuth, metrics: RecorderMetrics) -> None:
        self.auth = auth
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(_OPEN_PREFIXES):
            return await continuation(handler_call_details)
        problem = "missing"
        if self.auth.token:
            problem = self.auth.token_problem(tuple(handler_call_details.invocation_metadata or ())) or ""
            if not problem:
                return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if self.auth.allowed_identities:
            return self._identity_checked(handler)
        return self._refusing(handler, problem)

    def _refusal(self, reason: str) -> Callable[[aio.ServicerContext[Any, Any]], Awaitable[None]]:
        async def refuse(context: aio.ServicerContext[Any, Any]) -> None:
            self.metrics.unauthenticated.labels(reason).inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGES[reason])

        return refuse

    def _refusing(self, handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
        """A handler of the same kind that refuses before reading anything."""
        refuse = self._refusal(reason)

        async def behaviour(_request: Any, context: aio.ServicerContext[Any, Any]) -> None:
            await refuse(context)

        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(behaviour)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(behaviour)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(behaviour)
        return grpc.unary_unary_rpc_method_handler(behaviour)

    def _identity_checked(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` run only for a peer whose verified certificate names an allowed identity."""
        auth = self.auth
        refuse = self._refusal("identity")
        kinds = (
            (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
            (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
            (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
        )
        for behaviour, make in kinds:
            if behaviour is not None and inspect.iscoroutinefunction(behaviour):
                checked = _checked(behaviour, auth, refuse)
                return make(
                    checked,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return self._refusing(handler, "identity")


def _checked(
    behaviour: Callable[[Any, Any], Awaitable[Any]],
    auth: ServiceAuth,
    refuse: Callable[[aio.ServicerContext[Any, Any]], Awaitable[None]],
) -> Callable[[Any, aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    async def checked(first: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        if not auth.identity_allowed(context.auth_context()):
            await refuse(context)
        return await behaviour(first, context)

    return checked
