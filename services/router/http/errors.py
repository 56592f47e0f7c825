"""OpenAI's error object and the one mapping from what went wrong to an HTTP status.

Every refusal of the HTTP front door is an :class:`ApiError`, answered as OpenAI answers errors::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages", "code": null}}

with the status below, so OpenAI's clients raise their own typed exceptions (``BadRequestError``,
``NotFoundError``, ...). The routing core's gRPC status codes map here too (:func:`from_status`), in
one place, as the gRPC edge maps domain errors with ``status_of``.
"""

from __future__ import annotations

from typing import Any

import grpc

#: nginx's "client closed request": the metrics' status of a call whose client went away.
CLIENT_CLOSED = 499


class ApiError(Exception):
    """One refusal: ``status`` is the HTTP status, the rest OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        #: Response headers the error needs (``WWW-Authenticate`` on a 401, ``Retry-After`` on a 429).
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    """400: a body that is not JSON, or a field of the wrong type or value (``param`` names it)."""
    return ApiError(400, message, param=param)


def model_not_found(message: str) -> ApiError:
    """404: the model (or the pinned version) is not served; OpenAI's code ``model_not_found``."""
    return ApiError(404, message, param="model", code="model_not_found")


def internal() -> ApiError:
    """500: a bug of ours; the message says nothing of the internals (they are logged)."""
    return ApiError(500, "internal error", type="server_error")


#: The routing core's and the workers' gRPC codes → (HTTP status, OpenAI type). A worker's failure other
#: than those named is 502 (the router is a gateway); 500 is kept for the router's own bugs.
_STATUSES: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "server_error"),
    grpc.StatusCode.CANCELLED: (CLIENT_CLOSED, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


#: gRPC core's words for a message over ``grpc.max_receive_message_length`` (or the sender's own limit).
_TOO_LARGE = "message larger than max"


def from_status(code: grpc.StatusCode, details: str) -> ApiError:
    """The HTTP error for a call that ended with ``code`` (never OK)."""
    if code == grpc.StatusCode.NOT_FOUND:
        return model_not_found(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE in details:
        # Over a worker's (or the router's) gRPC message limit: the same request fails again, so not a 429,
        # which tells a client to retry. gRPC says so only in its text ("Received message larger than max").
        return ApiError(413, f"the request is too large for the model's worker: {details}", code="request_too_large")
    status, kind = _STATUSES.get(code, (502, "server_error"))
    return ApiError(status, details or code.name.lower(), type=kind, code=code.name.lower())
