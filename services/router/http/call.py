"""What the front door keeps of one HTTP call while it is answered: one object on the request.

The edge, the handlers, the relays and the auth middleware share these fields. They were a dozen entries of
the request's own mapping, and aiohttp's ``Request`` is a ``MutableMapping`` written in Python: each read or
write a call of its own (a missing key's ``get`` or ``in`` raising a KeyError inside), about 40 calls per
answered request, a fifth of what the router did beyond the floor's bare pass-through (docs/benchmarks.md, the
HTTP front door). Now the request holds this one object, set by the edge, and the rest are attribute reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from splitstream.router.core import UNKNOWN_MODEL

if TYPE_CHECKING:
    from splitstream.router.core import CallOutcome
    from splitstream.router.http.recording import HttpExchange


class Call:
    """One request's state; ``started`` is ``time.monotonic()`` at the edge, ``route`` the metric's route label."""

    __slots__ = (
        "admitted",
        "complete",
        "exchange",
        "label_version",
        "model",
        "outcome",
        "principal",
        "receive_unix_ns",
        "request_id",
        "route",
        "sent_id",
        "started",
        "status",
        "ttft",
        "version",
        "worker_request",
    )

    def __init__(self, started: float, route: str) -> None:
        self.started = started
        self.route = route
        #: The metric labels (model, version), set as far as the handler gets.
        self.model = UNKNOWN_MODEL
        self.label_version = ""
        #: The served version, answered as ``x-splitstream-version`` (also on an error).
        self.version = ""
        #: The status the metrics count when it is not the response's own (a stream's error event, a 502 for an
        #: upstream's refusal); None: the response's.
        self.status: int | None = None
        #: The stream's last event went out: the client has its whole answer (:func:`~.sse.end_stream`).
        self.complete = False
        #: The first token's event went out (timed once).
        self.ttft = False
        #: The request id (None until known: auth's refusal and the generation handlers set it) and the one the
        #: client sent (None: none), which ``x-request-id`` echoes.
        self.request_id: str | None = None
        self.sent_id: str | None = None
        #: The routed call, counted and recorded by it once routed.
        self.outcome: CallOutcome | None = None
        #: The call's recording (None: not recorded) and the worker request a translated call sent.
        self.exchange: HttpExchange | None = None
        self.worker_request = b""
        self.receive_unix_ns = 0
        #: The authenticated principal's name, and (principal, guard) for the handlers' model checks; None when
        #: callers are not authenticated.
        self.principal = ""
        self.admitted: tuple[Any, Any] | None = None

    def served(self, version: str) -> None:
        """The version that answers: counted under it and named in the answer's header."""
        self.label_version = self.version = version


#: The request's key of its :class:`Call`.
CALL = web.RequestKey("splitstream.call", Call)


def call_of(request: web.Request) -> Call:
    return request[CALL]
