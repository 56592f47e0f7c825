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

#: Printable ASCII but ``%``: what :func:`header_value` leaves as it is.
_KEPT = "".join(chr(code) for code in range(0x20, 0x7F) if chr(code) != "%")


def header_value(text: str) -> str:
    """``text`` as a valid gRPC metadata value: printable ASCII kept, ``%`` and everything else percent-encoded
    (UTF-8), so ``"a b"`` stays ``"a b"``, ``"ü"`` becomes ``"%C3%BC"`` and :func:`from_header_value` reverses it."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text  # the common case, without a copy
    return quote(text, safe=_KEPT, encoding="utf-8", errors="surrogatepass")


def from_header_value(value: str) -> str:
    """The string :func:`header_value` encoded. A value it cannot have made, whose escapes are not UTF-8
    (``"%80"``, a cut ``"%c3"``: a client may send anything printable), is taken as sent, so a header
    never fails a call."""
    if "%" not in value:
        return value
    try:
        return unquote(value, encoding="utf-8", errors="surrogatepass")
    except UnicodeDecodeError:
        return value
