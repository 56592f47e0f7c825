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
from dataclasses import dataclass

import grpc
import structlog

from splitstream.common.headers import REQUEST_ID_HEADER, VERSION_HEADER
from splitstream.common.runtime import process_index
from splitstream.router.auth.gate import Refusal

log = structlog.get_logger()

#: Longest caller-sent request id echoed in an answer (a longer or unprintable one is replaced).
_MAX_ECHOED_ID = 128

MISSING = (
    "no credentials: send an API key in 'x-api-key' or 'authorization: Bearer ...', "
    "or a JWT in 'authorization: Bearer ...'"
)
#: After the request id in a refusal's text, on both ports.
LOG_HAS_THE_REASON = "the router's log has the reason"
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


@dataclass(frozen=True, slots=True)
class PublicAnswer:
    """What a refused gRPC caller gets: the status's text and, in trailing metadata, the request id."""

    text: str
    request_id: str

    @property
    def trailers(self) -> tuple[tuple[str, str], ...]:
        """``x-request-id`` as the trailing metadata of every refusal, as an answered call carries it (and an
        HTTP refusal its header): a client reads the id without parsing the text. The id is printable ASCII
        of at most 128 characters (:func:`request_id`), a valid header value as it is."""
        return ((REQUEST_ID_HEADER, self.request_id),)


def public_answer(refusal: Refusal, method: str, metadata: Sequence[tuple[str, str | bytes]]) -> PublicAnswer:
    """The answer a refused caller gets. UNAUTHENTICATED and PERMISSION_DENIED are generic and carry a request
    id, in the text and the trailers, under which the detail is logged; other codes (rate limit, a request that
    does not parse) say what is wrong with the caller's own call, with the request id in the trailers only."""
    rid = request_id(metadata)
    if refusal.code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return PublicAnswer(refusal.message, rid)
    index = process_index()  # which of --processes N refused it, as the HTTP port's line says
    log.info(
        "gRPC call refused", request_id=rid, code=refusal.code.name, reason=refusal.reason, detail=refusal.message,
        method=method, **({"process_index": index} if index is not None else {}),
    )  # fmt: skip
    if refusal.code == grpc.StatusCode.UNAUTHENTICATED:
        if refusal.reason in _PUBLIC_REASONS:
            text = MISSING if refusal.reason == "missing" else refusal.message
        else:
            text = "the credential is not valid"
    else:
        text = _DENIED.get(refusal.reason, "permission denied")
    return PublicAnswer(f"{text} (request id {rid}; {LOG_HAS_THE_REASON})", rid)
