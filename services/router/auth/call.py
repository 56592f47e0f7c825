"""What the auth interceptor hands the call it let through, apart from the interceptor.

The servicer and the stream relay read these on every call, authenticated or not; the authentication
stack itself (policies as pydantic models, credentials, limits) is imported only by a router started
with ``--auth-principals``.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitstream.common.proto.splitstream.v1 import router_pb2

#: The authenticated caller of the call running now ("" when authentication is off).
CALL_PRINCIPAL: contextvars.ContextVar[str] = contextvars.ContextVar("splitstream_call_principal", default="")

#: The request head the interceptor parsed for this call, if it did.
CALL_HEAD: contextvars.ContextVar[router_pb2.InferRequestHead | None] = contextvars.ContextVar(
    "splitstream_call_head", default=None
)
