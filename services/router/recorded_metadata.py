"""Which request metadata a call record keeps: never a routing key, no credentials unless asked.

The routing key is stored only as its HMAC (``CallRecord.routing_key_hmac``), so its
header is left out on every path: the experiment's own header (known as soon as the
model is, so calls refused at routing are covered), and the default header name
whatever the experiment uses, since a client may send both. Credentials are left out
by default because a replay re-sends recorded metadata: a recording must not become
a store of other people's tokens. ``-bin`` values are bytes and never recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitstream.common.headers import DEFAULT_ROUTING_KEY_HEADER

#: Headers that carry someone's credentials (HTTP's and the common API-key conventions).
CREDENTIAL_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "x-auth-token"}
)
#: Set by gRPC and HTTP/2, not by the caller.
_RESERVED_PREFIXES = ("grpc-", ":")
#: Routing-key header names whose left-out set is kept (they change only with the registry).
_KEPT_HEADER_SETS = 64


class RecordedMetadata:
    """The rule above, applied on the router's answering path to every recorded call.

    Why a class: the names a call leaves out depend only on its experiment's routing-key header, so
    their set is built once per header name and each call is one pass with one set lookup per key
    (measured: half the cost of testing each key against each rule in turn)."""

    def __init__(self, *, keep_credentials: bool) -> None:
        self._always_left_out = frozenset({DEFAULT_ROUTING_KEY_HEADER}) | (
            frozenset() if keep_credentials else CREDENTIAL_HEADERS
        )
        self._left_out: dict[str, frozenset[str]] = {}

    def encoded(self, metadata: Sequence[tuple[str, str | bytes]], routing_key_header: str) -> bytes:
        """The pairs of a call's metadata that its record may store, in their order, as the log stores
        them: ``key \\0 value \\0`` ... (gRPC text metadata holds no NUL)."""
        left_out = self._left_out.get(routing_key_header)
        if left_out is None:
            if len(self._left_out) >= _KEPT_HEADER_SETS:
                self._left_out.clear()
            left_out = self._left_out[routing_key_header] = self._always_left_out | {routing_key_header}
        return "".join(
            [
                f"{key}\0{value}\0"
                for key, value in metadata
                if key not in left_out
                and isinstance(value, str)
                and not key.endswith("-bin")
                and not key.startswith(_RESERVED_PREFIXES)
            ]
        ).encode()
