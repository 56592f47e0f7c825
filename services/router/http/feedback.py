"""``POST /v1/feedback``: an outcome event for one call (a thumbs-up, a click) from a web front end, over HTTP.

The body names the call by the id its answer carried (``chatcmpl-<request id>``, ``cmpl-<request id>``, or
the request id itself), the metric and its value::

    {"id": "chatcmpl-4f1c...", "metric": "thumbs_up", "value": 1,
     "idempotency_key": "optional", "timestamp": 1733460000.5, "model": "optional", "user": "optional"}

It becomes one ``FeedbackEvent`` handed to the router's :class:`~splitstream.router.feedback.FeedbackService`,
the gRPC ``Feedback/Report``'s own: the same checks, the same metrics, the same log entry, so it lands in
``splitstream:feedback:<model>`` beside the events reported over gRPC and joins the call by request id. The
model is the body's ``model`` when given, else the model of a call this router answered recently under that
id (a bounded memory of ids), else the router's only model. ``timestamp`` is unix seconds (a number) or an
RFC 3339 string; absent, the event happened when the router received it. ``user`` reports about a user (a
routing key, stored as its HMAC) rather than, or beside, one call.

A field of the wrong type, a missing one or one the checks refuse is a 400 naming it (``param``, in the
body's own names); a router that records nothing, whose log is full or that is shutting down answers 503.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from splitstream.common.proto.splitstream.v1 import feedback_pb2
from splitstream.router.feedback import FeedbackService, ReportRefused
from splitstream.router.http.body import read_body
from splitstream.router.http.errors import ApiError, bad_request
from splitstream.router.http.openai_api import parse_body

#: The body's fields: every other is refused naming it, never ignored.
FIELDS = frozenset({"id", "metric", "value", "idempotency_key", "timestamp", "model", "user"})
#: The prefixes of the completion ids the front door answers with (``chatcmpl-<request id>``).
ID_PREFIXES = ("chatcmpl-", "cmpl-")
#: The FeedbackEvent fields a check names → the body's field that set them.
_PARAMS = {"request_id": "id", "routing_key": "user", "routing_key_hmac": "user", "event_unix_ns": "timestamp"}
#: Calls whose model is remembered by request id, the most recent ones (a dict of this many strings).
RECENT_CALLS = 65536
#: Unix seconds whose nanoseconds an int64 holds (the FeedbackEvent's field).
_LATEST_S = 9.2e9


class RecentCalls:
    """The model of each recent call by request id, so a feedback body need not name it; bounded, oldest out."""

    def __init__(self, limit: int = RECENT_CALLS) -> None:
        self.limit = limit
        self._models: dict[str, str] = {}

    def note(self, request_id: str, model: str) -> None:
        models = self._models
        models.pop(request_id, None)
        models[request_id] = model
        if len(models) > self.limit:
            del models[next(iter(models))]

    def model_of(self, request_id: str) -> str | None:
        return self._models.get(request_id)


class HttpFeedback:
    """The route's handler: the body checked, turned into one event, reported through ``service``."""

    def __init__(self, service: FeedbackService, model_names: Callable[[], Sequence[str]]) -> None:
        self.service = service
        self.model_names = model_names
        self.recent = RecentCalls()

    async def post(self, request: web.Request) -> web.Response:
        body = parse_body(await read_body(request))
        event, shown_id = self._event(body)
        try:
            reply = await self.service.handle(feedback_pb2.FeedbackReport(events=[event]))
        except ReportRefused as refused:
            raise ApiError(503, str(refused), type="server_error", code=refused.reason) from None
        if reply.rejected:
            reason = reply.rejected[0].reason
            field, _, message = reason.partition(":")
            param = _PARAMS.get(field, field)
            if field == "model" and "model" not in body:
                message = (
                    f" the id {shown_id!r} is not a call this router answered recently, and it serves several "
                    "models: name the call's model in 'model'"
                )
            raise bad_request(f"'{param}'{message}", param)
        return web.json_response(
            {
                "object": "feedback",
                "accepted": True,
                "request_id": event.request_id,
                "model": event.model,
                "metric": event.metric,
            }
        )

    def _event(self, body: dict[str, Any]) -> tuple[feedback_pb2.FeedbackEvent, str]:
        """The event the body describes (400 naming a field of the wrong type or a missing one), and its id."""
        for key in body:
            if key not in FIELDS:
                raise bad_request(f"unsupported parameter '{key}' (fields: {', '.join(sorted(FIELDS))})", key)
        values = {key: value for key, value in body.items() if value is not None}
        for key in ("id", "metric", "idempotency_key", "model", "user"):
            if key in values and not isinstance(values[key], str):
                raise bad_request(f"'{key}' must be a string", key)
        if "metric" not in values:
            raise bad_request("'metric' is required (a name such as 'thumbs_up')", "metric")
        if "id" not in values and "user" not in values:
            raise bad_request("'id' is required: the answer's id (chatcmpl-...) or its request id", "id")
        value = values.get("value")
        if isinstance(value, bool) or not isinstance(value, int | float):
            what = "missing" if value is None else f"a {type(value).__name__}"
            raise bad_request(f"'value' must be a number, got {what}", "value")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise bad_request(f"'value' must be a finite number, got {str(value)[:40]}", "value")
        shown_id = values.get("id", "")
        request_id = self._request_id(shown_id)
        model = values.get("model") or self._model(request_id)
        event = feedback_pb2.FeedbackEvent(
            model=model,
            request_id=request_id,
            routing_key=values.get("user", ""),
            metric=values["metric"],
            value=number,
            idempotency_key=values.get("idempotency_key", ""),
            event_unix_ns=_event_unix_ns(values.get("timestamp")),
        )
        return event, shown_id

    def _request_id(self, shown: str) -> str:
        """The request id an id names: itself if a recent call had it, else less a completion id's prefix."""
        if not shown or self.recent.model_of(shown) is not None:
            return shown
        for prefix in ID_PREFIXES:
            if shown.startswith(prefix) and len(shown) > len(prefix):
                return shown[len(prefix) :]
        return shown

    def _model(self, request_id: str) -> str:
        model = self.recent.model_of(request_id) if request_id else None
        if model is not None:
            return model
        served = list(self.model_names())
        return served[0] if len(served) == 1 else ""


def _event_unix_ns(timestamp: Any) -> int:
    """``timestamp`` (unix seconds, or an RFC 3339 string) in unix ns; 0 (now) when absent."""
    if timestamp is None:
        return 0
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float | str):
        raise bad_request("'timestamp' must be unix seconds (a number) or an RFC 3339 string", "timestamp")
    if isinstance(timestamp, str):
        try:
            parsed = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
        except ValueError:
            raise bad_request(f"'timestamp' {timestamp[:64]!r} is not an RFC 3339 time", "timestamp") from None
        if parsed.tzinfo is None:
            raise bad_request("'timestamp' needs a time zone (Z or +hh:mm)", "timestamp")
        seconds = parsed.timestamp()
    else:
        seconds = float(timestamp)
    if not 0 <= seconds < _LATEST_S:  # NaN too; past the bound the ns overflow the field (the checks say "ahead")
        raise bad_request(f"'timestamp' {str(timestamp)[:40]} is not unix seconds from 1970 on", "timestamp")
    return int(seconds * 1e9)
