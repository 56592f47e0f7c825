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

from aiohttp import web

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.sse import EventData
from splitstream.router.http.call import CALL
from splitstream.router.http.headers import as_text

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
        "reader",
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
        #: The written bytes of an event not ended yet; made at a stream's first write (a whole answer has none).
        self.reader: EventData | None = None
        #: (prompt tokens, completion tokens) as the answer reported them; None when it reported none.
        self.usage: tuple[int, int] | None = None

    def received(self, body: bytes, content_type: str, parsed: Mapping[str, Any] | None = None) -> None:
        self.request_body, self.content_type, self.body = body, content_type, parsed

    def written(self, chunk: bytes) -> None:
        """Bytes of a server-sent event stream as written to the client, cut anywhere (a relay passes chunks
        through as they come): each event that ends in them is recorded by its ``data`` (lines ending in CRLF as
        in LF, as the SSE format allows both)."""
        reader = self.reader
        if reader is None:
            reader = self.reader = EventData()
        for data in reader.feed(chunk):
            self.event(data)

    def event(self, data: bytes) -> None:
        """An SSE event's ``data`` just written. The first one carrying generated text sets the call's TTFT."""
        offset_ns = max(time.monotonic_ns() - self.started_ns, 1)
        index = self.events_total
        self.events_total += 1
        if not self.first_token_ns and _carries_text(data):
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

    def reported_usage(self) -> tuple[int, int] | None:
        """The tokens an OpenAI answer reported (a whole answer's ``usage``, or the last streamed chunk that
        has one: ``include_usage``, which comes just before ``[DONE]``), for an answer the front door relayed
        without reading it."""
        if self.response_body is not None:
            tail = _tail_usage(self.response_body)
            if tail is not None:
                return tail
        bodies = [self.response_body] if self.response_body is not None else [e[2] for e in self.events[-3:]][::-1]
        for body in bodies:
            try:
                answer = json.loads(body)
            except ValueError:
                continue
            usage = answer.get("usage") if isinstance(answer, dict) else None
            if isinstance(usage, dict):
                prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
                if isinstance(prompt, int) and isinstance(completion, int):
                    return prompt, completion
        return None

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


class RecordedStreamResponse(web.StreamResponse):
    """A streamed response whose written bytes also go to its call's :class:`HttpExchange`: whatever writes
    the stream (the front door's own answers, a relay of an upstream's events), the record sees what the
    client was sent, once the write returned."""

    def __init__(self, exchange: HttpExchange, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exchange = exchange

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await super().write(data)
        self.exchange.written(data if data.__class__ is bytes else bytes(data))


def stream_response(request: web.Request, **kwargs: Any) -> web.StreamResponse:
    """The ``web.StreamResponse`` to answer ``request`` with: recorded when the call is (it has an exchange)."""
    exchange = request[CALL].exchange
    if exchange is not None:
        return RecordedStreamResponse(exchange, **kwargs)
    return web.StreamResponse(**kwargs)


def _carries_text(data: bytes) -> bool:
    """Whether an event holds generated text (an OpenAI chat delta's content or a completion's text; Triton's
    generate ``text_output``). Parsed only until the call's first such event: the rest need not be."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    if isinstance(chunk, dict) and chunk.get("text_output"):
        return True
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and delta.get("content")):
            return True
    return False


#: A header name as sent → its lower-case name, or "" for a connection header: clients send the same few names
#: on every call, so each is lowered and checked once (bounded: odd names past the cap are decided afresh).
_HEADER_NAMES: dict[str, str] = {}
_HEADER_NAMES_KEPT = 1024


def recorded_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The client's headers as the recorder's metadata pairs (lower-case names), less the connection's own; the
    router's recorded-metadata rules then leave out credentials and routing keys."""
    pairs = []
    names = _HEADER_NAMES
    for name, value in headers.items():
        lower = names.get(name)
        if lower is None:
            lower = name.lower()
            if lower in CONNECTION_HEADERS:
                lower = ""
            if len(names) < _HEADER_NAMES_KEPT:
                names[name] = lower
        if lower:
            # odd bytes must not cost the call its record
            pairs.append((lower, value if value.isascii() else as_text(value)))
    return pairs


#: Where a whole answer's top-level ``usage`` can be read without parsing the answer: OpenAI's servers (and
#: vLLM's, and the front door's own) write it as the object's last member, after the generated text.
_USAGE_KEY = b'"usage"'
_TAIL_DECODER = json.JSONDecoder()


def _tail_usage(body: bytes) -> tuple[int, int] | None:
    """The usage of a whole answer whose last top-level member is ``"usage": {...}``, read from that member alone
    (the whole answer, generated text and all, was parsed again on every call for two integers). None when the
    answer is not so shaped, or is not a JSON object: the caller then parses it whole, as before. The member is
    the top-level object's when only that object's ``}`` follows it, and the object must start as one does."""
    at = body.rfind(_USAGE_KEY)
    if at <= 0 or body[at - 1] == 0x5C or not body.lstrip().startswith(b"{"):  # 0x5C: an escaped quote, in text
        return None
    try:
        text = body[at + len(_USAGE_KEY) :].decode()
        rest = text.lstrip()
        if not rest.startswith(":"):
            return None
        rest = rest[1:].lstrip()
        usage, end = _TAIL_DECODER.raw_decode(rest)
    except ValueError:  # not UTF-8, or not JSON there: the whole parse decides
        return None
    if rest[end:].strip() != "}" or not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        return prompt, completion
    return None


def _fill(payload: recorder_pb2.Payload, data: bytes) -> None:
    payload.inline = data
    payload.size_bytes = len(data)
