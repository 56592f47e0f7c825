"""What an outcome event may be, checked alike where events enter (router, import CLI) and where they are stored.

An event becomes a stream entry (``splitstream:feedback:<model>``) and, with an idempotency key,
part of a Redis key; its metric becomes a column an analysis groups by. So every string is
bounded, a metric is a short name, and a value is a finite number. The router checks each event
of a report and refuses the bad ones one by one; the recorder checks again (it must not trust
whoever speaks to it) and refuses, beside these, any event still carrying a plain routing key.

Late events are expected (outcomes from a warehouse, hours later): an event time in the past is
never refused. One far in the future is (a clock or a unit error: milliseconds sent as seconds).
An event about a request id that was never recorded is not refused either: only the analysis,
reading both streams, can tell, and it counts them.
"""

from __future__ import annotations

import math
import re

from splitstream.common.names import check_model_name
from splitstream.common.proto.splitstream.v1 import feedback_pb2

#: Metric names: what an analysis groups by and a Redis key holds (``click``, ``revenue.usd``, ``nps:q1``).
METRIC_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
#: Longest request id an event may name (UTF-8 bytes). A call's id may be longer (any protobuf string);
#: such calls can still get feedback by routing key.
MAX_REQUEST_ID_BYTES = 16 << 10
#: Longest routing key (UTF-8 bytes): a header value, and gRPC refuses metadata past 8-16 KiB anyway.
MAX_ROUTING_KEY_BYTES = 4096
MAX_IDEMPOTENCY_KEY_BYTES = 256
#: How far past its receipt an event's time may be: clocks of reporters and routers differ a little.
MAX_FUTURE_NS = 300 * 10**9
_HMAC_HEX = re.compile(r"[0-9a-f]{64}")


class EventProblem(ValueError):
    """An event that cannot be recorded; the message starts with the field at fault (``metric: ...``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def check_event(event: feedback_pb2.FeedbackEvent, *, receive_unix_ns: int) -> None:
    """Raise :class:`EventProblem` for the first field of ``event`` that cannot be stored as it is.

    ``receive_unix_ns``: when the event reached the router (the future bound is relative to it)."""
    try:
        check_model_name(event.model)
    except ValueError as error:
        raise EventProblem("model", str(error)) from None
    if not METRIC_PATTERN.fullmatch(event.metric):
        shown = event.metric[:80]
        raise EventProblem(
            "metric", f"{shown!r} is not a metric name (1-64 of letters, digits and _ . : -, e.g. 'click')"
        )
    if not math.isfinite(event.value):
        raise EventProblem("value", f"{event.value!r} is not a finite number")
    if not (event.request_id or event.routing_key or event.routing_key_hmac):
        raise EventProblem("request_id", "neither request_id nor routing_key is set: the event is about nothing")
    _bounded("request_id", event.request_id, MAX_REQUEST_ID_BYTES)
    _bounded("routing_key", event.routing_key, MAX_ROUTING_KEY_BYTES)
    if event.routing_key and event.routing_key_hmac:
        raise EventProblem("routing_key_hmac", "set beside routing_key: send one of them")
    if event.routing_key_hmac and not _HMAC_HEX.fullmatch(event.routing_key_hmac):
        raise EventProblem("routing_key_hmac", "is not an HMAC-SHA256 in lowercase hex (64 digits)")
    _bounded("idempotency_key", event.idempotency_key, MAX_IDEMPOTENCY_KEY_BYTES)
    if event.idempotency_key and not event.idempotency_key.isprintable():
        raise EventProblem("idempotency_key", "holds control characters")
    if event.event_unix_ns < 0:
        raise EventProblem("event_unix_ns", f"{event.event_unix_ns} is before 1970 (unix time in ns; 0: now)")
    if event.event_unix_ns > receive_unix_ns + MAX_FUTURE_NS:
        ahead_s = (event.event_unix_ns - receive_unix_ns) / 1e9
        raise EventProblem(
            "event_unix_ns",
            f"is {ahead_s:.0f} s in the future (at most {MAX_FUTURE_NS // 10**9} s; unix time in ns, "
            "not ms or s scaled wrongly?)",
        )


def _bounded(field: str, value: str, limit: int) -> None:
    size = len(value.encode())
    if size > limit:
        raise EventProblem(field, f"is {size} bytes, at most {limit}")
