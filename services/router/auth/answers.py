"""What a refused gRPC caller is told, and what the router's log keeps.

A refusal's message (:class:`~splitstream.router.auth.gate.Refusal`) says exactly what is wrong: the
audience or issuer a JWT must carry, the algorithms accepted, the principal a token names, the model a
principal may not call. That is the operator's to read, not an unauthenticated caller's: it maps the
router's configuration for whoever probes it. So the caller gets a fixed text per status (and per
grant, for PERMISSION_DENIED on what the caller itself asked for), with a request id; the detail goes
to the log under that id. The HTTP front door answers the same way (:mod:`splitstream.router.http.auth`).

Texts that depend on nothing configured are kept whole: no credential sent (how to send one), and two
credentials sent at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import grpc
import structlog

from splitstream.common.headers import REQUEST_ID_HEADER, VERSION_HEADER
from splitstream.router.auth.gate import Refusal

log = structlog.get_logger()

#: Longest caller-sent request id echoed in an answer (a longer or unprintable one is replaced).
_MAX_ECHOED_ID = 128

MISSING = (
    "no credentials: send an API key in 'x-api-key' or 'authorization: Bearer ...', "
    "or a JWT in 'authorization: Bearer ...'"
)
_PUBLIC_REASONS = frozenset({"missing", "ambiguous"})
_DENIED = {
    "model": "you may not call this model",
    "pin": f"you may not pin a version ({VERSION_HEADER} or model_version)",
}


def request_id(metadata: Sequence[tuple[str, str | bytes]]) -> str:
    """The caller's ``x-request-id`` when it is short printable ASCII, else a new one."""
    for key, value in metadata:
        if key == REQUEST_ID_HEADER and isinstance(value, str):
            if 0 < len(value) <= _MAX_ECHOED_ID and value.isascii() and value.isprintable():
                return value
            break
    return uuid.uuid4().hex


def public_message(refusal: Refusal, method: str, metadata: Sequence[tuple[str, str | bytes]]) -> str:
    """The text a refused caller gets. UNAUTHENTICATED and PERMISSION_DENIED are generic and carry a request
    id under which the detail is logged; other codes (rate limit, a request that does not parse) say what is
    wrong with the caller's own call and are returned as they are."""
    if refusal.code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return refusal.message
    rid = request_id(metadata)
    log.info(
        "gRPC call refused", request_id=rid, code=refusal.code.name, reason=refusal.reason, detail=refusal.message,
        method=method,
    )  # fmt: skip
    if refusal.code == grpc.StatusCode.UNAUTHENTICATED:
        if refusal.reason in _PUBLIC_REASONS:
            text = MISSING if refusal.reason == "missing" else refusal.message
        else:
            text = "the credential is not valid"
    else:
        text = _DENIED.get(refusal.reason, "permission denied")
    return f"{text} (request id {rid}; the router's log has the reason)"
