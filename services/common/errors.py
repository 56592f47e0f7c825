"""Named domain errors and their one mapping to gRPC status codes.

Services raise these from their cores (which know nothing of gRPC) and the
servicer edge turns them into a status with :func:`status_of`. Anything else
that escapes becomes INTERNAL with a generic message, so internals never leak.
"""

from __future__ import annotations

import grpc


class SplitstreamError(Exception):
    """Base class; ``code`` is the gRPC status the client receives."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidInput(SplitstreamError):
    """The request does not match the model's metadata → INVALID_ARGUMENT."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(SplitstreamError):
    """No such model (or version) is served here → NOT_FOUND."""

    code = grpc.StatusCode.NOT_FOUND


class ModelNotReady(SplitstreamError):
    """The model exists but cannot serve now (warming up, draining, no endpoint) → UNAVAILABLE."""

    code = grpc.StatusCode.UNAVAILABLE


class WrongProtocol(SplitstreamError):
    """The version is served over another protocol than the call's (an ``openai`` HTTP upstream called
    over gRPC) → FAILED_PRECONDITION: the call would fail the same way on every retry."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ConfigError(Exception):
    """A configuration file or flag is invalid; the message names the field and the problem."""


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for ``error``."""
    if isinstance(error, SplitstreamError):
        return error.code, str(error)
    return grpc.StatusCode.INTERNAL, "internal error"
