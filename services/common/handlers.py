"""Unary gRPC handlers that parse their request bytes themselves.

With grpc's own ``request_deserializer`` the bytes are parsed before any handler
runs, and a ``DecodeError`` there is answered UNKNOWN with a Python exception's
name ("Unexpected <class DecodeError>"): a status a client cannot tell from a
server bug. A handler that receives bytes and parses them can answer
INVALID_ARGUMENT naming the message it expected, as for any other bad input.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc import aio

from splitstream.common.errors import InvalidInput, status_of

RequestT = TypeVar("RequestT", bound=Message)
ResponseT = TypeVar("ResponseT", bound=Message)


def parse(request_type: type[RequestT], data: bytes) -> RequestT:
    """``data`` as a ``request_type``, or :class:`InvalidInput` naming the message when it is not one
    (a corrupt wire format, a string field that is not UTF-8, nesting past protobuf's recursion limit)."""
    try:
        return request_type.FromString(data)
    except DecodeError:
        raise InvalidInput(f"request is not a valid {request_type.DESCRIPTOR.full_name}") from None


def typed_unary(
    handler: Callable[[RequestT, aio.ServicerContext[bytes, ResponseT]], Awaitable[ResponseT]],
    request_type: type[RequestT],
) -> grpc.RpcMethodHandler:
    """A unary handler that hands ``handler`` its request parsed from bytes, and answers bytes that do not
    parse INVALID_ARGUMENT naming ``request_type`` without calling ``handler``."""

    async def parse_then_handle(data: bytes, context: aio.ServicerContext[bytes, ResponseT]) -> ResponseT:
        try:
            request = parse(request_type, data)
        except InvalidInput as error:
            await context.abort(*status_of(error))
            raise AssertionError("unreachable: abort raises") from error
        return await handler(request, context)

    return grpc.unary_unary_rpc_method_handler(parse_then_handle, response_serializer=_serialize)


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data
