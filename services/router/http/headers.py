"""Request headers whose bytes are not UTF-8.

aiohttp decodes header values as UTF-8 with ``surrogateescape``: a value that is not UTF-8 comes through
as a ``str`` holding lone surrogates, which fails wherever it is encoded again (a routing key hashed, a
request id put in the worker's request, the record's metadata). A header the router acts on is refused
(400 naming it); any other is recorded with its odd bytes replaced, so the call's record is never lost.
"""

from __future__ import annotations

from aiohttp import web

from splitstream.router.http.errors import ApiError


def header_text(request: web.Request, name: str) -> str | None:
    """A header's value; 400 naming the header when its bytes are not UTF-8."""
    value = request.headers.get(name)
    if value is not None and not is_text(value):
        raise ApiError(400, f"the header '{name}' is not UTF-8 text", param=name)
    return value


def is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def as_text(value: str) -> str:
    """``value`` as text that encodes: bytes that were not UTF-8 become U+FFFD, as a browser shows them."""
    if is_text(value):
        return value
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
