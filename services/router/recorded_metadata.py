"""Which request metadata a call record keeps: never a routing key, no credentials unless asked.

The routing key is stored only as its HMAC (``CallRecord.routing_key_hmac``), so its
header is left out on every path: the experiment's own header (known as soon as the
model is, so calls refused at routing are covered), and the default header name
whatever the experiment uses, since a client may send both. Credentials are left out
by default because a replay re-sends recorded metadata: a recording must not become
a store of other people's tokens. ``-bin`` values are bytes and never recorded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from splitstream.common.headers import DEFAULT_ROUTING_KEY_HEADER

#: Headers that carry someone's credentials (HTTP's and the common API-key conventions).
CREDENTIAL_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "x-auth-token"}
)
#: Set by gRPC and HTTP/2, not by the caller.
_RESERVED_PREFIXES = ("grpc-", ":")


def recorded_metadata(
    metadata: Sequence[tuple[str, str | bytes]], *, routing_key_header: str, keep_credentials: bool
) -> Iterator[tuple[str, str]]:
    """The ``(key, value)`` pairs of a call's metadata that its record may store."""
    for key, value in metadata:
        if not isinstance(value, str) or key.endswith("-bin") or key.startswith(_RESERVED_PREFIXES):
            continue
        if key in (routing_key_header, DEFAULT_ROUTING_KEY_HEADER):
            continue
        if key in CREDENTIAL_HEADERS and not keep_credentials:
            continue
        yield key, value
