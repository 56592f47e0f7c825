"""What the HTTP front door records of one call: the exchange as the client saw it, gathered as the call goes.

Capture is at the front door's own level: the body as received, then each server-sent event's data as
written or the body as sent, so a call translated to a worker stream and one passed through to an HTTP
upstream are recorded by the same code. Gathering costs the answering path a tuple appended per event,
under the per-call byte cap of ``--record-stream-max-bytes`` (as a gRPC token stream's messages: past the
cap events are counted, not kept, and the record says ``truncated``); the protobuf is built once, when the
call has ended, and handed to the router's log in one append (:meth:`CallLog.offer_http`), which never
waits on the network.

What a record never holds: credentials and the routing-key headers (the router's recorded-metadata rules,
as for gRPC metadata), headers about the connection rather than the call (``connection``,
``content-length``, ...), and the body's ``user``, which is a routing key: it is stored as
``hmac:<its HMAC>``, the HMAC records carry as ``routing_key_hmac``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from splitstream.common.proto.splitstream.v1 import recorder_pb2

#: Headers about the connection, not the call: never recorded (a replay sets its own).
CONNECTION_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "content-length"}
)


class HttpExchange:
    """One HTTP call as recorded: request body, response body or SSE events with their offsets, status, usage.

    Offsets run from ``started_ns`` (``time.monotonic_ns()`` when the front door received the request)."""

    __slots__ = (
        "api",
        "body",
        "content_type",
        "events",
        "events_total",
        "first_token_ns",
        "kept_bytes",
        "max_bytes",
        "method",
        "path",
        "request_body",
        "response_body",
        "response_content_type",
        "started_ns",
        "truncated",
        "usage",
    )

    def __init__(self, method: str, path: str, api: str, *, max_bytes: int, started_ns: int) -> None:
        self.method = method
        self.path = path
        self.api = api
        self.max_bytes = max_bytes
        self.started_ns = started_ns
        self.request_body = b""
        self.content_type = ""
        #: The request body parsed (a JSON object), when it was one: its ``user`` is masked in the record.
        self.body: Mapping[str, Any] | None = None
        self.response_body: bytes | None = None
        self.response_content_type = ""
        self.events: list[tuple[int, int, bytes]] = []  # (index, offset_ns, data)
        self.events_total = 0
        self.kept_bytes = 0
        self.truncated = False
        self.first_token_ns = 0
        #: (prompt tokens, completion tokens) as the answer reported them; None when it reported none.
        self.usage: tuple[int, int] | None = None

    def received(self, body: bytes, content_type: str, parsed: Mapping[str, Any] | None = None) -> None:
        self.request_body, self.content_type, self.body = body, content_type, parsed

    def event(self, data: bytes, *, token: bool = False) -> None:
        """An SSE event's ``data`` just written; ``token``: it carries generated text (the first one's offset
        is the call's TTFT)."""
        offset_ns = max(time.monotonic_ns() - self.started_ns, 1)
        index = self.events_total
        self.events_total += 1
        if token and not self.first_token_ns:
            self.first_token_ns = offset_ns
        if self.truncated:
            return
        if self.kept_bytes + len(data) > self.max_bytes:
            self.truncated = True
            return
        self.kept_bytes += len(data)
        self.events.append((index, offset_ns, data))

    def answered(self, body: bytes, content_type: str) -> None:
        """A whole (not streamed) answer's body, as sent."""
        self.response_body, self.response_content_type = body, content_type

    def serialize(self, status: int, mask: Callable[[str], str]) -> bytes:
        """The record's ``http`` and ``usage`` fields, as a serialized CallRecord holding only them (the shipper
        appends these bytes to the record it builds). ``mask(user)``: what a body's ``user`` is stored as."""
        record = recorder_pb2.CallRecord()
        http = record.http
        http.method, http.path, http.status, http.api = self.method, self.path, status, self.api
        _fill(http.request_body, self._recorded_body(mask))
        http.request_content_type = self.content_type
        if self.response_body is not None:
            _fill(http.response_body, self.response_body)
            http.response_content_type = self.response_content_type
        elif self.events_total:
            http.response_content_type = "text/event-stream"
        for index, offset_ns, data in self.events:
            message = http.events.add(index=index, offset_ns=offset_ns)
            _fill(message.payload, data)
        http.first_token_ns = self.first_token_ns
        http.events_total = self.events_total
        http.truncated = self.truncated
        if self.usage is not None:
            record.usage.prompt_tokens, record.usage.completion_tokens = self.usage
        return record.SerializeToString()

    def _recorded_body(self, mask: Callable[[str], str]) -> bytes:
        """The body as received, but a ``user`` (a routing key) replaced by its mask."""
        body = self.body
        if body is None or not isinstance(body.get("user"), str):
            return self.request_body
        return json.dumps({**body, "user": mask(body["user"])}, separators=(",", ":")).encode()


def recorded_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The client's headers as the recorder's metadata pairs (lower-case names), less the connection's own; the
    router's recorded-metadata rules then leave out credentials and routing keys."""
    pairs = []
    for name, value in headers.items():
        lower = name.lower()
        if lower not in CONNECTION_HEADERS:
            pairs.append((lower, value))
    return pairs


def _fill(payload: recorder_pb2.Payload, data: bytes) -> None:
    payload.inline = data
    payload.size_bytes = len(data)
