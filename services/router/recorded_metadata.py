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
#: Routing-key header names whose decisions are kept (they change only with the registry).
_KEPT_HEADER_SETS = 64
#: Metadata keys whose decision is kept per routing-key header: clients send a few names, and any number of
#: odd ones is decided afresh on each call rather than kept (the memory stays small whatever clients send).
_KEPT_DECISIONS = 1024


class _Decisions(dict[str, bool]):
    """Whether each metadata key is recorded, for one routing-key header: decided at a key's first sight, so a
    call's pass costs one dict lookup per key (the rules in turn, each call, were a fifth of a log append)."""

    def __init__(self, left_out: frozenset[str]) -> None:
        super().__init__()
        self.left_out = left_out

    def __missing__(self, key: str) -> bool:
        keep = key not in self.left_out and not key.endswith("-bin") and not key.startswith(_RESERVED_PREFIXES)
        if len(self) < _KEPT_DECISIONS:
            self[key] = keep
        return keep


class RecordedMetadata:
    """The rule above, applied on the router's answering path to every recorded call.

    Why a class: the names a call leaves out depend only on its experiment's routing-key header, so
    each header name gets its decisions once and each call is one pass with one dict lookup per key."""

    def __init__(self, *, keep_credentials: bool) -> None:
        self._always_left_out = frozenset({DEFAULT_ROUTING_KEY_HEADER}) | (
            frozenset() if keep_credentials else CREDENTIAL_HEADERS
        )
        self._decisions: dict[str, _Decisions] = {}

    def encoded(self, metadata: Sequence[tuple[str, str | bytes]], routing_key_header: str) -> bytes:
        """The pairs of a call's metadata that its record may store, in their order, as the log stores
        them: ``key \\0 value \\0`` ... (gRPC text metadata holds no NUL; a ``-bin`` value is bytes)."""
        decisions = self._decisions.get(routing_key_header)
        if decisions is None:
            if len(self._decisions) >= _KEPT_HEADER_SETS:
                self._decisions.clear()
            decisions = self._decisions[routing_key_header] = _Decisions(self._always_left_out | {routing_key_header})
        return "".join(
            [f"{key}\0{value}\0" for key, value in metadata if decisions[key] and value.__class__ is str]
        ).encode()
