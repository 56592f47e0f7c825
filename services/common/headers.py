"""The gRPC metadata splitstream reads and writes, named once, and how client strings become header values.

gRPC core refuses a non-``-bin`` metadata value that is not printable ASCII
(0x20..0x7E) when a server sets it ("Illegal header value"), and a unary aio
handler whose trailers are refused never answers: the client waits for its
deadline. Request ids come from clients (``ModelInferRequest.id`` is any
protobuf string: KServe and Triton accept ``"ünïcode"`` or ``"a\\x01b"``), so
every client-controlled string is passed through :func:`header_value` before it
goes into metadata.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

#: The call's id: read from the client (else the request's ``id`` field, else generated), echoed in trailers.
REQUEST_ID_HEADER = "x-request-id"
#: One header, two directions: on a request it pins the version (bypassing the split, as replays do);
#: on a response it names the version that served the call.
VERSION_HEADER = "x-splitstream-version"
#: The sticky key's header unless an experiment names another.
DEFAULT_ROUTING_KEY_HEADER = "x-routing-key"

#: The longest request id splitstream puts into metadata, as a header value. gRPC refuses a call whose
#: metadata passes 8 KiB at random (its default soft limit) and always past 16 KiB, on whichever side
#: receives it: through a router, ids of 9,000 to 15,000 bytes failed 4 to 10 calls in 10 with
#: RESOURCE_EXHAUSTED and longer ones every call, though the worker alone served them all. Half the soft
#: limit leaves room for the other headers.
MAX_ID_HEADER_BYTES = 4096

#: Printable ASCII but ``%``: what :func:`header_value` leaves as it is.
_KEPT = "".join(chr(code) for code in range(0x20, 0x7F) if chr(code) != "%")


def header_value(text: str) -> str:
    """``text`` as a valid gRPC metadata value: printable ASCII kept, ``%`` and everything else percent-encoded
    (UTF-8), so ``"a b"`` stays ``"a b"``, ``"ü"`` becomes ``"%C3%BC"`` and :func:`from_header_value` reverses it."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text  # the common case, without a copy
    return quote(text, safe=_KEPT, encoding="utf-8", errors="surrogatepass")


def from_header_value(value: str) -> str:
    """The string :func:`header_value` encoded. A value it cannot have made is taken as sent: escapes that
    are not UTF-8 (``"%80"``, a cut ``"%c3"``), and ASCII ids that merely contain ``%`` (``"a%41"``,
    ``"100%"``, a URL-encoded ``"req%2F1"``), which a client means literally. So a header never fails a
    call, and an id is only ever decoded when decoding and re-encoding gives back exactly what was sent."""
    if "%" not in value:
        return value
    try:
        decoded = unquote(value, encoding="utf-8", errors="surrogatepass")
    except UnicodeDecodeError:
        return value
    return decoded if header_value(decoded) == value else value


def request_id_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """``x-request-id`` as metadata, or no metadata for an id whose header value would be longer than
    :data:`MAX_ID_HEADER_BYTES`: a protobuf ``id`` may be any length, and a header that long fails the
    call. The id still travels in the request's and the response's ``id`` field."""
    value = header_value(request_id)
    return ((REQUEST_ID_HEADER, value),) if len(value) <= MAX_ID_HEADER_BYTES else ()


def echoed_request_id(sent: str | None, request_id: str) -> tuple[tuple[str, str], ...]:
    """The ``x-request-id`` an edge answers with (gRPC's trailers, HTTP's headers: both use this, so both echo
    the same ids). The client's header comes back as it was sent when it is printable ASCII and decodes
    (:func:`from_header_value`) to the call's id: ``a%41`` is echoed ``a%41``, not re-encoded as ``a%2541``,
    and one longer than :data:`MAX_ID_HEADER_BYTES` that the client could send is echoed too. Otherwise (an id
    from the request's body, a generated one) the id is encoded by :func:`request_id_metadata`: none when too long."""
    if sent is not None and sent.isascii() and sent.isprintable() and from_header_value(sent) == request_id:
        return ((REQUEST_ID_HEADER, sent),)
    return request_id_metadata(request_id)
