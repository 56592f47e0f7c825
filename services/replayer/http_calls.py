"""What the replayer knows of HTTP targets and calls apart from sending them: the parsing of the flags and
the planning of the calls use it, and only an HTTP replay imports aiohttp (:mod:`splitstream.replayer.http_sender`),
a quarter of a start's CPU that a gRPC replay did without."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


class TargetRefused(ConnectionError):
    """The target answered the replayer's probe with 401 or 403: its credentials are missing or wrong."""


def is_http_target(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def check_http_target(address: str) -> None:
    """ValueError naming what is wrong with an ``http(s)://host:port`` target (a path after it is its base)."""
    try:
        parts = urlsplit(address)
        port = parts.port
    except ValueError as error:
        raise ValueError(f"bad target {address!r}: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad target {address!r} (expected http://host:port or https://host:port)")
    if parts.query or parts.fragment:
        raise ValueError(f"bad target {address!r}: no query or fragment (the recorded path is appended)")
    if port == 0:
        raise ValueError(f"bad target {address!r}: port 1..65535")


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """A recorded call as it goes out again. ``path`` holds the query string as recorded."""

    method: str
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class HttpReply:
    """What the target answered: its status, a whole body, or each server-sent event's data with its time
    from when the request went out (seconds)."""

    status: int
    content_type: str
    body: bytes | None
    events: tuple[tuple[float, bytes], ...] = ()
