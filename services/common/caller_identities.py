"""Only named callers: an allow-list of verified client-certificate identities on a gRPC server.

A worker serves whoever reaches it, so a caller who skips the router skips its permissions and its
recording too. With mutual TLS the worker knows who is calling; ``--allowed-client-identities`` then
lets through only the routers named (subject CN, a DNS SAN or a ``spiffe://`` URI SAN, each read by
its type: :func:`~splitstream.common.cert_identity.peer_identities`, as the recorder matches them),
and refuses everyone else UNAUTHENTICATED before the handler runs. Health and reflection stay open
for balancers, Consul and Kubernetes.

gRPC exposes the verified certificate only on the handler's context, so the check wraps the handler
rather than refusing in ``intercept_service``.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from splitstream.common.errors import ConfigError

ALLOWED_IDENTITIES_FLAG = "--allowed-client-identities"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
REFUSED = "the client certificate is not one of the callers this server accepts"


def add_allowed_identities_argument(parser: argparse.ArgumentParser, *, callers: str) -> None:
    """``--allowed-client-identities``, repeatable (comma-separated in the environment)."""
    parser.add_argument(
        ALLOWED_IDENTITIES_FLAG,
        action="append",
        default=None,
        metavar="NAME[,NAME...]",
        help=f"with --grpc-use-ssl-mutual: serve only {callers} whose verified client certificate names one of "
        "these (subject CN, a DNS SAN, or a spiffe:// URI SAN; no other SAN type); others are refused "
        "UNAUTHENTICATED (repeatable; comma-separated). Without it any caller is served, and the log says so",
    )


def parse_identities(value: str | list[str] | None, *, mutual: bool) -> frozenset[str]:
    """The allow-list from repeated flags or one comma-separated value. Without mutual TLS no client
    certificate is verified, so a list would refuse every caller: a configuration error, not that."""
    specs = value if isinstance(value, list) else [value or ""]
    names = frozenset(part.strip() for spec in specs for part in spec.split(",") if part.strip())
    if names and not mutual:
        raise ConfigError(
            f"{ALLOWED_IDENTITIES_FLAG} needs --grpc-use-ssl-mutual (only then are client certificates verified)"
        )
    return names


class IdentityGate(aio.ServerInterceptor):
    """Every call but health and reflection runs only for a peer whose certificate names an allowed identity."""

    def __init__(self, allowed: frozenset[str], *, on_refusal: Callable[[], None] = lambda: None) -> None:
        # cert_identity parses certificates with cryptography (0.03 s of CPU to import): imported here, as the
        # server that has an allow-list starts, so the servers without one never load it.
        from splitstream.common.cert_identity import peer_identities

        self.allowed = allowed
        self.on_refusal = on_refusal
        self._peer_identities = peer_identities

    def allows(self, context: aio.ServicerContext[Any, Any]) -> bool:
        return bool(self._peer_identities(context.auth_context()) & self.allowed)

    async def refuse(self, context: aio.ServicerContext[Any, Any]) -> None:
        self.on_refusal()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler
        kinds = (
            (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
            (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
            (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
            (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
        )
        for behaviour, make in kinds:
            if behaviour is not None:
                return make(
                    self._checked(behaviour),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _checked(self, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        """``behaviour`` (a coroutine or an async generator, as grpc.aio servicers are) behind the check."""
        if inspect.isasyncgenfunction(behaviour):

            async def streamed(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                if not self.allows(context):
                    await self.refuse(context)
                async for response in behaviour(request, context):
                    yield response

            return streamed

        async def called(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            if not self.allows(context):
                await self.refuse(context)
            result = behaviour(request, context)
            return await result if inspect.isawaitable(result) else result

        return called
