"""``splitstream.v1.Feedback/Report``: outcome events in, queued for the recorder beside the call records.

Each event of a report is checked on its own (:func:`splitstream.common.feedback.check_event`, plus:
the model is served here); a bad one is named in ``FeedbackReply.rejected`` (its index and a reason
starting with the field at fault) and the good ones are accepted. Only what concerns the whole
report fails it: too many events or bytes (INVALID_ARGUMENT), a router that records nothing
(FAILED_PRECONDITION), a full queue (RESOURCE_EXHAUSTED: nothing of the report was queued, send
it again) or a router shutting down (UNAVAILABLE).

A routing key is replaced by its HMAC under the router's ``--hmac-key`` before the event is queued,
so the key itself never reaches the queue, the spool, the recorder or a log line; the HMAC is the
one call records carry, so user-level events join the calls. An event about a request id nobody
recorded is accepted: only the analysis can tell, and it counts them.

Checking, hashing and serializing a report of 1,000 events takes a few milliseconds of CPU, so it
runs in a thread, not on the event loop the inference calls share.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc import aio
from prometheus_client import CollectorRegistry, Counter

from splitstream.common.feedback import EventProblem, check_event
from splitstream.common.handlers import typed_unary
from splitstream.common.proto.splitstream.v1 import feedback_pb2
from splitstream.common.records import routing_key_hmac
from splitstream.router.recording import CallLog

log = structlog.get_logger()

SERVICE = feedback_pb2.DESCRIPTOR.services_by_name["Feedback"].full_name
#: Most events one report may hold; send more as several reports.
MAX_EVENTS_PER_REPORT = 1000
#: Largest serialized report taken (well under the router's message limit: a report is checked whole).
MAX_REPORT_BYTES = 4 << 20
#: The fields a rejection can name: the ``reason`` label's values (bounded, whatever clients send).
REJECT_REASONS = (
    "model",
    "metric",
    "value",
    "request_id",
    "routing_key",
    "routing_key_hmac",
    "idempotency_key",
    "event_unix_ns",
)


class FeedbackMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.received = Counter(
            "splitstream_router_feedback_received", "Outcome events in Feedback/Report calls", registry=registry
        )
        self.accepted = Counter(
            "splitstream_router_feedback_accepted", "Outcome events queued for recording", registry=registry
        )
        self.rejected = Counter(
            "splitstream_router_feedback_rejected",
            "Outcome events refused one by one, by the field at fault (named in FeedbackReply.rejected)",
            ["reason"],
            registry=registry,
        )
        self.refused_reports = Counter(
            "splitstream_router_feedback_refused_reports",
            "Reports refused whole: too_large, not_recording, queue_full, shutting_down",
            ["reason"],
            registry=registry,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for reason in ("too_large", "not_recording", "queue_full", "shutting_down"):
            self.refused_reports.labels(reason)


class ReportRefused(Exception):
    """A report refused whole: ``code`` is its status."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Checked:
    """A report after checking: events ready to queue (serialized), and the refused ones."""

    events: list[bytes]
    rejected: list[feedback_pb2.RejectedEvent]


class FeedbackService:
    def __init__(
        self,
        *,
        mirror: CallLog | None,
        hmac_key: bytes,
        serves: Callable[[str], bool],
        registry: CollectorRegistry,
    ) -> None:
        """``serves(model)``: whether this router serves ``model`` now (the routing core's answer)."""
        self._mirror = mirror
        self._key = hmac_key
        self._serves = serves
        self.metrics = FeedbackMetrics(registry)

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        return [
            grpc.method_handlers_generic_handler(
                SERVICE, {"Report": typed_unary(self.report, feedback_pb2.FeedbackReport)}
            )
        ]

    async def report(
        self, request: feedback_pb2.FeedbackReport, context: aio.ServicerContext[Any, Any]
    ) -> feedback_pb2.FeedbackReply:
        try:
            return await self.handle(request)
        except ReportRefused as refused:
            await context.abort(refused.code, str(refused))
            raise AssertionError("unreachable: abort raises") from refused

    async def handle(self, request: feedback_pb2.FeedbackReport) -> feedback_pb2.FeedbackReply:
        """The reply for one report; raises :class:`ReportRefused` for a report refused whole."""
        count = len(request.events)
        self.metrics.received.inc(count)
        mirror = self._refuse_whole(request)
        checked = await asyncio.to_thread(self.check, request, time.time_ns())
        for rejection in checked.rejected:
            field = rejection.reason.partition(":")[0]
            self.metrics.rejected.labels(field if field in REJECT_REASONS else "model").inc()
        if checked.events and not mirror.offer_feedback(checked.events):
            self.metrics.refused_reports.labels("queue_full").inc()
            raise ReportRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "queue_full",
                f"the router's log refused them (full: the shipper is away or behind; or not writable); "
                f"none of the {count} events was queued: send the report again later",
            )
        self.metrics.accepted.inc(len(checked.events))
        log.debug("feedback report", events=count, accepted=len(checked.events), rejected=len(checked.rejected))
        return feedback_pb2.FeedbackReply(accepted=len(checked.events), rejected=checked.rejected)

    def _refuse_whole(self, request: feedback_pb2.FeedbackReport) -> CallLog:
        """The mirror to queue into, or :class:`ReportRefused` for what fails the report as a whole."""
        if self._mirror is None:
            self._refused("not_recording")
            raise ReportRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "not_recording",
                "this router records nothing (started without --recorder): it cannot store feedback",
            )
        if self._mirror.closing:
            self._refused("shutting_down")
            raise ReportRefused(
                grpc.StatusCode.UNAVAILABLE, "shutting_down", "the router is shutting down: send the report elsewhere"
            )
        count = len(request.events)
        if count > MAX_EVENTS_PER_REPORT:
            self._refused("too_large")
            raise ReportRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                "too_large",
                f"events: the report holds {count} events, at most {MAX_EVENTS_PER_REPORT}: send several reports",
            )
        size = request.ByteSize()
        if size > MAX_REPORT_BYTES:
            self._refused("too_large")
            raise ReportRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                "too_large",
                f"events: the report is {size} bytes, at most {MAX_REPORT_BYTES}: send several reports",
            )
        return self._mirror

    def _refused(self, reason: str) -> None:
        self.metrics.refused_reports.labels(reason).inc()

    def check(self, request: feedback_pb2.FeedbackReport, receive_unix_ns: int) -> Checked:
        """Check every event; hash routing keys; serialize the good ones (runs in a thread)."""
        events: list[bytes] = []
        rejected: list[feedback_pb2.RejectedEvent] = []
        for index, event in enumerate(request.events):
            try:
                check_event(event, receive_unix_ns=receive_unix_ns)
                if not self._serves(event.model):
                    raise EventProblem("model", f"'{event.model}' is not served by this router")
            except EventProblem as problem:
                rejected.append(feedback_pb2.RejectedEvent(index=index, reason=str(problem)))
                continue
            if event.routing_key:
                event.routing_key_hmac = routing_key_hmac(self._key, event.routing_key)
                event.ClearField("routing_key")
            event.receive_unix_ns = receive_unix_ns
            events.append(event.SerializeToString())
        return Checked(events, rejected)
