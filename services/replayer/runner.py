"""One replay: read → schedule and send → compare and record, as three stages joined by bounded queues.

- The **reader** (the asyncio loop, main thread) pages through Redis, selects calls, resolves
  blob payloads and queues ready-to-send plans. It runs ahead of the sender by at most
  ``_READ_AHEAD`` calls, so memory stays flat however long the window.
- The **sender** (its own thread) waits for each call's planned time (sleep, then spin: see
  :mod:`splitstream.replayer.schedule`), takes a slot of ``--concurrency`` and starts the call
  on every target without waiting for it. Open loop: a slow target delays nothing but its own
  answers, unless the concurrency cap is reached, which then shows as send lag.
- The **collector** (its own thread) receives finished calls, diffs them, writes
  ``results.jsonl`` and keeps the aggregates for the summary and the report.

Stopping (Ctrl-C, :meth:`Replay.stop`): the reader stops reading, the sender stops starting
calls (queued ones are counted as not sent), calls in flight finish (each has its deadline),
and the collector writes what it has: a partial summary is still a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitstream.common.headers import (
    DEFAULT_ROUTING_KEY_HEADER,
    REQUEST_ID_HEADER,
    VERSION_HEADER,
    request_id_metadata,
)
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import (
    REDACTED_HTTP_TAG,
    MissingBlob,
    dropped_payloads,
    payload_bytes,
    redacted_outputs,
    status_name,
)
from splitstream.common.redis_url import RedisClient
from splitstream.replayer.compare import Answer, CallDiff, Tolerance, compare_answers
from splitstream.replayer.http_calls import HttpRequest
from splitstream.replayer.http_compare import CLIENT_LEFT, HttpAnswer, Text, compare_http, read_text, status_code
from splitstream.replayer.http_compare import reported_usage as http_usage
from splitstream.replayer.noise import TEXT_FIELD, NoiseSettings, NoiseTotals
from splitstream.replayer.outputs import ResultsWriter
from splitstream.replayer.progress import Progress
from splitstream.replayer.schedule import OpenLoopClock, sleep_until
from splitstream.replayer.selection import SelectedCall, Selection, SelectionStats, select_calls
from splitstream.replayer.sender import Outcome, Target
from splitstream.replayer.stats import GroupTotals, HttpTotals, LogHistogram, OutputTotals, StreamTotals, WorstCalls
from splitstream.replayer.stream_compare import CANCELLED, StreamAnswer, StreamDiff, compare_streams
from splitstream.replayer.summary import (
    NEEDS_GRPC_TARGET,
    NEEDS_HTTP_TARGET,
    REQUEST_NOT_RECORDED,
    Counts,
    Metrics,
    Outcomes,
    StatusChanges,
    Summary,
    ToleranceSummary,
    Window,
    rate,
)

if TYPE_CHECKING:
    from splitstream.common.archive import Archive
    from splitstream.replayer.http_sender import HttpTarget

_READ_AHEAD = 2048
#: Recorded metadata that is never re-sent: ids and pins are set by the replay itself, transport
#: headers are the replayer's own, and masked values (``hmac:...``) are not what the client sent.
_NOT_FORWARDED = frozenset(
    {
        REQUEST_ID_HEADER,
        DEFAULT_ROUTING_KEY_HEADER,
        VERSION_HEADER,
        "user-agent",
        "content-type",
        "te",
        "host",
        "authority",
    }
)
#: A recorded credential is not forwarded when the replayer sends its own (a call carrying two is refused).
_CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key"})
#: Recorded HTTP headers that are the connection's or the body's, set again by the replay itself.
_HTTP_NOT_FORWARDED = _NOT_FORWARDED | {"content-length", "accept-encoding", "cookie", "transfer-encoding", "expect"}
_END = object()


@dataclass(frozen=True, kw_only=True)
class ReplaySettings:
    """How to send and compare (the selection is separate: see :class:`Selection`)."""

    targets: tuple[str, ...]
    #: None: as fast as ``concurrency`` allows.
    speed: float | None
    concurrency: int
    timeout_s: float
    pin_version: str = ""
    id_suffix: str = ":replay"
    forward_metadata: bool = True
    tolerance: Tolerance = field(default_factory=Tolerance)
    output_dir: Path = Path("replay-out")
    progress: bool = True
    #: Niceness asked for the sender thread (best effort; 0 leaves it alone).
    sender_nice: int = -10
    #: The replayer's own credential headers (``x-api-key``), sent on every call to a router that
    #: authenticates callers; recorded credential headers are then never forwarded.
    credentials: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    #: Leave the body's ``user`` out of replayed HTTP calls (it is recorded as ``hmac:...``, not the user).
    drop_user: bool = False
    #: ``--noise-from``/``--noise-target``: the control's second pass, always the last of ``targets``.
    noise: NoiseSettings | None = None
    #: ``--noise-from VERSION``: the pin of the control's second pass (sent to ``--target``).
    noise_pin: str = ""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if not 0 < self.timeout_s < math.inf:  # NaN fails this too
            raise ValueError("--timeout-s must be a positive number of seconds")
        if self.speed is not None and self.speed <= 0:
            raise ValueError("--speed must be positive or 'max'")
        if not -20 <= self.sender_nice <= 19:
            raise ValueError("--sender-nice must be within -20..19")

    @property
    def compare_to(self) -> str:
        compared = len(self.targets) - (1 if self.noise is not None else 0)
        return self.targets[1] if compared > 1 else ""

    @property
    def noise_position(self) -> int | None:
        """Which of ``targets`` is the control's second pass (None without a noise floor)."""
        return len(self.targets) - 1 if self.noise is not None else None

    @property
    def http(self) -> bool:
        """Whether the targets speak HTTP (``http(s)://``): HTTP records are replayed, gRPC ones are not."""
        return self.targets[0].startswith(("http://", "https://"))


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """What a recorded token stream adds to its plan: every request kept, when each went out, and the
    recorded answer. Requests keep their recorded offsets from the stream's start, divided by
    ``--speed`` (all at once with ``--speed max``)."""

    requests: tuple[bytes, ...]
    offsets_s: tuple[float, ...] | None
    recorded: StreamAnswer
    #: Cancel the replayed stream after this many responses (a stream the client cancelled).
    stop_after: int | None


@dataclass(frozen=True, slots=True)
class HttpPlan:
    """What a recorded HTTP call adds to its plan: the request as it goes out, and the recorded answer."""

    api: str
    request: HttpRequest
    recorded: HttpAnswer


@dataclass(slots=True)
class Plan:
    """A selected call, ready to send: request bytes, headers, and the recorded answer."""

    index: int
    call: SelectedCall
    request: bytes
    metadata: list[tuple[str, str]]
    recorded: Answer
    replay_id: str
    stream: StreamPlan | None = None
    http: HttpPlan | None = None
    #: ``--noise-from VERSION``: the metadata (HTTP: the request) the control's second pass goes out with.
    noise_metadata: list[tuple[str, str]] | None = None
    noise_request: HttpRequest | None = None


@dataclass(frozen=True, slots=True)
class NotReplayed:
    """A selected call the reader could not plan: it goes to the collector for its results line."""

    call: SelectedCall
    why: str


@dataclass(slots=True)
class Flight:
    """A plan on its way to every target."""

    plan: Plan
    #: Order in which the sender started flights (0, 1, ...): receive-time order unless told otherwise.
    sequence: int
    planned_at: float | None
    outcomes: list[Outcome | None]
    remaining: int


@dataclass
class Aggregates:
    """Everything the summary and the report are made of (fixed size: see :mod:`stats`)."""

    overall: GroupTotals = field(default_factory=GroupTotals)
    by_version: dict[str, GroupTotals] = field(default_factory=dict)
    outputs: dict[str, OutputTotals] = field(default_factory=dict)
    send_lag: LogHistogram = field(default_factory=lambda: LogHistogram(floor_s=1e-7))
    status_changes: Counter[str] = field(default_factory=Counter)
    transitions: Counter[str] = field(default_factory=Counter)
    worst: WorstCalls = field(default_factory=WorstCalls)
    #: Token streams (none in a replay of unary calls only); an HTTP call's generated text counts as one.
    streams: StreamTotals = field(default_factory=StreamTotals)
    #: HTTP calls (none in a replay of gRPC calls).
    http: HttpTotals = field(default_factory=HttpTotals)
    #: The noise floor's evidence (only with ``--noise-from``/``--noise-target``).
    noise: NoiseTotals | None = None
    max_in_flight: int = 0
    not_sent: int = 0
    #: Calls the replayer could not send (a header gRPC refuses, over the send limit): not the target's doing.
    send_errors: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    #: Selected calls that cannot be replayed, by why (:data:`REQUEST_NOT_RECORDED`).
    not_replayed: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    first_sent_at: float | None = None
    last_done_at: float | None = None


class Replay:
    def __init__(
        self,
        redis: RedisClient | None,
        selection: Selection,
        settings: ReplaySettings,
        targets: Sequence[Target | HttpTarget],
        *,
        archive: Archive | None = None,
        archive_only: bool = False,
    ) -> None:
        """``redis`` None: every call comes from ``archive`` (``--source archive:URL``); else ``archive``,
        when given, holds what retention trimmed from Redis."""
        self.redis = redis
        self.archive = archive
        self.archive_only = archive_only
        self.selection = selection
        self.settings = settings
        self.targets = targets
        self.stats = SelectionStats()
        self.aggregates = Aggregates()
        if settings.noise is not None:
            self.aggregates.noise = NoiseTotals(settings.noise)
        self.stopping = threading.Event()
        self.interrupted = False
        self._send_queue: queue.Queue[Any] = queue.Queue(maxsize=_READ_AHEAD)
        #: Set once the read-ahead queue is full (or reading is over): the clock starts then, so the
        #: first calls do not compete with the reader's initial burst.
        self._primed = threading.Event()
        self._done_queue: queue.Queue[Any] = queue.Queue()
        self._slots = threading.Semaphore(settings.concurrency)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._clock = OpenLoopClock(settings.speed)
        #: perf_counter time that results' ``planned_s``/``sent_s``/``done_s`` count from (set by the first send).
        self._origin = 0.0
        self.started_unix_ns = time.time_ns()
        self.wall_s = 0.0
        #: The niceness the sender thread got, if it could be changed.
        self.sender_nice_applied: int | None = None

    def stop(self) -> None:
        """Stop cleanly (safe from a signal handler): no new calls; those in flight finish; outputs are written."""
        self.interrupted = True
        self.stopping.set()
        self._primed.set()

    async def run(self, results: ResultsWriter) -> Aggregates:
        """Run the whole replay, a line per call into ``results`` (opened by the caller, so an output
        directory that cannot be written is a setup error before anything is sent; closed here);
        returns when every started call has finished and been recorded."""
        progress = Progress(self.selection, enabled=self.settings.progress)
        sender = threading.Thread(target=self._send_loop, name="replay-sender", daemon=True)
        collector = threading.Thread(
            target=self._collect_loop, args=(results, progress), name="replay-collector", daemon=True
        )
        # The sender must get the GIL within a millisecond when its time comes: CPython's default
        # switch interval is 5 ms; 1 ms measured best here (at 0.2 ms the sender and gRPC's
        # completion thread hand the GIL back and forth, and p99 lag got worse). A full garbage
        # collection walks every tracked object (the read-ahead queue and the reorder buffer hold
        # many) and would stop it for milliseconds: young generations are still collected, full
        # collections wait for the end.
        previous_interval = sys.getswitchinterval()
        previous_thresholds = gc.get_threshold()
        sys.setswitchinterval(0.001)
        gc.freeze()
        gc.set_threshold(previous_thresholds[0], previous_thresholds[1], 1_000_000_000)
        started = time.perf_counter()
        try:
            sender.start()
            collector.start()
            try:
                await self._read()
            finally:
                await self._put(_END, force=True)
                await asyncio.to_thread(sender.join)
                await asyncio.to_thread(collector.join)
        finally:
            sys.setswitchinterval(previous_interval)
            gc.set_threshold(*previous_thresholds)
            gc.unfreeze()
            self.wall_s = time.perf_counter() - started
            results.close()
            progress.close()
        return self.aggregates

    # -- reader (event loop) ---------------------------------------------------------------

    async def _read(self) -> None:
        index = 0
        calls = select_calls(
            self.redis, self.selection, self.stats, archive=self.archive, archive_only=self.archive_only
        )
        try:
            async for call in calls:
                if self.stopping.is_set():
                    return
                is_http = call.record.HasField("http")
                if is_http != self.settings.http:
                    # A recorded HTTP call is an HTTP exchange, a gRPC call a gRPC one: neither can be sent to the
                    # other kind of target as it was made. Counted, with a line, never silently left out.
                    self._done_queue.put(NotReplayed(call, NEEDS_HTTP_TARGET if is_http else NEEDS_GRPC_TARGET))
                    continue
                if _request_dropped(call.record):
                    # Straight to the collector (unbounded queue; it only writes a line): the sender has
                    # nothing to send, and _END reaches the collector after this through the sender.
                    self._done_queue.put(NotReplayed(call, REQUEST_NOT_RECORDED))
                    continue
                try:
                    plan = await self._prepare(index, call)
                except MissingBlob:
                    self.aggregates.skipped["missing_blob"] += 1
                    continue
                index += 1
                if not await self._put(plan):
                    return
        finally:
            await calls.aclose()

    async def _prepare(self, index: int, call: SelectedCall) -> Plan:
        record = call.record
        if record.HasField("http"):
            return await self._prepare_http(index, call)
        request = await self._payload(record.request)
        answered = record.status_code == 0
        response_recorded = not (answered and "response" in dropped_payloads(record))
        response = await self._payload(record.response) if answered and response_recorded else None
        replay_id = record.request_id + self.settings.id_suffix
        # Recorded ids are any protobuf string ("ünïcode", "a\x01b"); gRPC refuses such a header value.
        metadata = list(request_id_metadata(replay_id))
        own = {key for key, _ in self.settings.credentials}
        if self.settings.forward_metadata:
            metadata += [
                (key, value)
                for key, value in sorted(record.metadata.items())
                if key.lower() not in _NOT_FORWARDED
                and not value.startswith("hmac:")
                and not (own and key.lower() in _CREDENTIAL_HEADERS)
            ]
        metadata += self.settings.credentials
        if self.settings.pin_version:
            metadata.append((VERSION_HEADER, self.settings.pin_version))
        recorded = Answer(record.status_code, response, redacted_outputs(record), response_recorded)
        stream = await self._prepare_stream(record, request) if record.HasField("stream") else None
        plan = Plan(index, call, request, metadata, recorded, replay_id, stream)
        if self.settings.noise is not None:
            plan.noise_metadata = _pinned(metadata, self.settings.noise_pin)
        return plan

    async def _prepare_http(self, index: int, call: SelectedCall) -> Plan:
        """An HTTP call's plan: the recorded method, path, body and content type; the recorded headers but
        credentials, ids, pins and masked values (as gRPC metadata); the replayer's own credential; the
        recorded answer (body, or events with their offsets) to compare with."""
        record = call.record
        http = record.http
        body = await self._payload(http.request_body)
        if self.settings.drop_user:
            body = _without_user(body)
        replay_id = record.request_id + self.settings.id_suffix
        headers = [*request_id_metadata(replay_id)]
        if http.request_content_type:
            headers.append(("content-type", http.request_content_type))
        own = {key for key, _ in self.settings.credentials}
        if self.settings.forward_metadata:
            headers += [
                (key, value)
                for key, value in sorted(record.metadata.items())
                if key.lower() not in _HTTP_NOT_FORWARDED
                and not value.startswith("hmac:")
                and not (own and key.lower() in _CREDENTIAL_HEADERS)
            ]
        headers += self.settings.credentials
        if self.settings.pin_version:
            headers.append((VERSION_HEADER, self.settings.pin_version))
        redacted = set(filter(None, record.tags.get(REDACTED_HTTP_TAG, "").split(",")))
        recorded_ok = not (redacted & {"response_body", "events"}) and "http.response_body" not in dropped_payloads(
            record
        )
        streamed = bool(http.events_total) or http.response_content_type == "text/event-stream"
        events = [await self._payload(event.payload) for event in http.events] if recorded_ok and streamed else []
        answered: bytes | None = None
        if not streamed:
            has_body = recorded_ok and http.HasField("response_body")
            answered = await self._payload(http.response_body) if has_body else b""
        usage = (
            (int(record.usage.prompt_tokens), int(record.usage.completion_tokens)) if record.HasField("usage") else None
        )
        answer = HttpAnswer(
            status=http.status,
            body=answered,
            events=tuple(events),
            event_times_s=tuple(event.offset_ns / 1e9 for event in http.events) if streamed else (),
            ttft_s=http.first_token_ns / 1e9 if http.first_token_ns else None,
            usage=usage,
            prefix_only=http.truncated,
            recorded=recorded_ok,
        )
        request = HttpRequest(http.method or "POST", http.path, body, tuple(headers))
        recorded = Answer(status_code(http.status), None, frozenset(), recorded_ok)
        plan = Plan(index, call, body, headers, recorded, replay_id, http=HttpPlan(http.api, request, answer))
        if self.settings.noise is not None:
            pinned = tuple(_pinned(headers, self.settings.noise_pin))
            plan.noise_request = HttpRequest(request.method, request.path, request.body, pinned)
        return plan

    async def _prepare_stream(self, record: Any, first_request: bytes) -> StreamPlan:
        """The requests and recorded responses of a stream record (payloads fetched from blobs)."""
        stream = record.stream
        requests = [await payload_bytes(self.redis, m.payload) for m in stream.requests]
        offsets = [m.offset_ns / 1e9 for m in stream.requests]
        if not requests:  # the cap kept none: the record's ``request`` is the first one
            requests, offsets = [first_request], [0.0]
        speed = self.settings.speed
        responses = tuple([await payload_bytes(self.redis, m.payload) for m in stream.responses])
        recorded = StreamAnswer(
            record.status_code,
            responses,
            tuple(m.offset_ns / 1e9 for m in stream.responses),
            stream.first_response_ns / 1e9 if stream.first_response_ns else None,
            prefix_only=stream.truncated,
            redacted=redacted_outputs(record),
        )
        cancelled = record.status_code == CANCELLED
        return StreamPlan(
            tuple(requests),
            None if speed is None else tuple(offset / speed for offset in offsets),
            recorded,
            max(int(stream.responses_total), 1) if cancelled else None,
        )

    async def _payload(self, payload: recorder_pb2.Payload) -> bytes:
        """Archived records carry their payloads inline; one whose blob was already gone when it was
        archived has no Redis to ask when replaying from the archive alone."""
        if self.redis is None:
            if payload.WhichOneof("body") == "blob_sha256":
                raise MissingBlob(f"blob {payload.blob_sha256} was not archived with its record")
            return payload.inline
        return await payload_bytes(self.redis, payload)

    async def _put(self, item: object, *, force: bool = False) -> bool:
        """Queue for the sender, waiting while the queue is full; False if stopped first (unless ``force``)."""
        while True:
            if self.stopping.is_set() and not force:
                return False
            try:
                self._send_queue.put_nowait(item)
                if item is _END:
                    self._primed.set()
                return True
            except queue.Full:
                self._primed.set()
                await asyncio.sleep(0.002)

    # -- sender (thread) -------------------------------------------------------------------

    def _send_loop(self) -> None:
        self._raise_priority()
        timeout_s = self.settings.timeout_s
        while not self._primed.wait(timeout=0.05) and not self.stopping.is_set():
            pass
        while True:
            item = self._send_queue.get()
            if item is _END:
                break
            if self.stopping.is_set():
                self.aggregates.not_sent += 1
                continue
            plan: Plan = item
            planned = self._clock.planned(plan.call.receive_ns)
            if planned is not None and not sleep_until(planned, stop=self.stopping):
                self.aggregates.not_sent += 1
                continue
            if not self._take_slot():
                self.aggregates.not_sent += 1
                continue
            if self.aggregates.sent == 0:
                self._origin = self._clock.start if self._clock.start is not None else time.perf_counter()
            flight = Flight(plan, self.aggregates.sent, planned, [None] * len(self.targets), len(self.targets))
            self.aggregates.sent += 1
            for position, target in enumerate(self.targets):
                noise = position == self.settings.noise_position
                metadata = plan.noise_metadata if noise and plan.noise_metadata is not None else plan.metadata
                if not isinstance(target, Target):  # an HttpTarget (aiohttp: imported by an HTTP replay only)
                    assert plan.http is not None  # the reader plans HTTP records only for HTTP targets
                    target.send(
                        plan.noise_request if noise and plan.noise_request is not None else plan.http.request,
                        timeout_s=timeout_s,
                        on_done=lambda outcome, f=flight, p=position: self._finished(f, p, outcome),
                    )
                    continue
                if plan.stream is not None:
                    target.send_stream(
                        plan.stream.requests,
                        plan.stream.offsets_s,
                        metadata,
                        timeout_s=timeout_s,
                        stop_after=plan.stream.stop_after,
                        on_done=lambda outcome, f=flight, p=position: self._finished(f, p, outcome),
                    )
                    continue
                target.send(
                    plan.request,
                    metadata,
                    timeout_s=timeout_s,
                    on_done=lambda outcome, f=flight, p=position: self._finished(f, p, outcome),
                )
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)
        self._done_queue.put(_END)

    def _raise_priority(self) -> None:
        """Best effort: run this thread at ``sender_nice`` (Linux niceness is per thread). It sleeps
        most of the time, so a higher priority costs others little, and when the machine is busy
        (a router and workers on the same cores) it wakes on time instead of waiting for a slice:
        p99 send lag at 1,000 calls/s through a router on 2 cores went from ~0.7-2 ms to ~0.4-0.8 ms.
        Lowering the niceness needs CAP_SYS_NICE; without it the thread keeps the default."""
        if self.settings.sender_nice == 0:
            return
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.settings.sender_nice)
        except OSError:
            return
        self.sender_nice_applied = self.settings.sender_nice

    def _take_slot(self) -> bool:
        while not self._slots.acquire(timeout=0.05):
            if self.stopping.is_set():
                return False
        with self._lock:
            self._in_flight += 1
            self.aggregates.max_in_flight = max(self.aggregates.max_in_flight, self._in_flight)
        return True

    def _finished(self, flight: Flight, position: int, outcome: Outcome) -> None:
        """gRPC callback thread: the last target's answer completes the flight and frees its slot."""
        with self._lock:
            flight.outcomes[position] = outcome
            flight.remaining -= 1
            if flight.remaining:
                return
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()
        self._slots.release()
        self._done_queue.put(flight)

    # -- collector (thread) ----------------------------------------------------------------

    def _collect_loop(self, results: ResultsWriter, progress: Progress) -> None:
        while True:
            item = self._done_queue.get()
            if item is _END:
                return
            if isinstance(item, NotReplayed):
                results.write(self._not_replayed(item))
                continue
            flight: Flight = item
            line, diff = self._judge(flight)
            results.write(line)
            progress.advance(flight.plan.call.receive_ns, diff)

    def _judge(self, flight: Flight) -> tuple[dict[str, Any], CallDiff | None]:
        """The call's results line and diff; None for a call the replayer could not send (nothing to compare)."""
        plan = flight.plan
        record = plan.call.record
        replayed = flight.outcomes[0]
        assert replayed is not None
        failed = [(position, o) for position, o in enumerate(flight.outcomes) if o is not None and o.send_error]
        if failed:
            return self._send_error(flight, failed), None
        compared = flight.outcomes[1] if self.settings.compare_to else None
        noise_at = self.settings.noise_position
        control = flight.outcomes[noise_at] if noise_at is not None else None
        if plan.http is not None:
            return self._judge_http(flight, plan.http, replayed, compared, control)
        if plan.stream is not None:
            return self._judge_stream(flight, plan.stream, replayed, compared, control)
        if compared is not None:
            reference = Answer(compared.code, compared.response)
            reference_latency_s = compared.latency_s
            reference_version = _served_version(compared)
        else:
            reference = plan.recorded
            reference_latency_s = record.latency_ns / 1e9
            reference_version = record.version
        candidate = Answer(replayed.code, replayed.response)
        diff = compare_answers(reference, candidate, self.settings.tolerance)
        replayed_version = _served_version(replayed)
        control_diff = None
        if control is not None and self.aggregates.noise is not None:
            control_answer = Answer(control.code, control.response)
            control_diff = compare_answers(reference, control_answer, self.settings.tolerance)
            self.aggregates.noise.add_answers(reference, control_answer, candidate)

        agg = self.aggregates
        lag_ms = self._count(flight, diff, replayed, replayed_version, reference_version, reference_latency_s)
        for output in diff.outputs:
            agg.outputs.setdefault(output.name, OutputTotals()).add(output)
        for name in diff.not_compared:
            agg.outputs.setdefault(name, OutputTotals()).not_compared[diff.not_compared_why] += 1
        line = self._line(flight, diff, replayed, lag_ms)
        if compared is not None:
            line["compare_to"] = _side(self.targets[1].address, compared)
            line["compare_to"]["sent_s"] = round(compared.sent_at - self._origin, 6)
        if diff.outputs:
            line["outputs"] = {o.name: o.as_dict() for o in diff.outputs}
        if diff.not_compared:
            line["not_compared"] = dict.fromkeys(diff.not_compared, diff.not_compared_why)
        if control is not None and control_diff is not None:
            line["control"] = self._control_side(control, control_diff.outcome)
            line["control"]["outputs"] = {o.name: o.as_dict() for o in control_diff.outputs}
        agg.worst.offer(diff, line)
        return line, diff

    def _control_side(self, control: Outcome, outcome: str) -> dict[str, Any]:
        """The results line's ``control``: the control's second pass, and how it compared with the reference."""
        noise_at = self.settings.noise_position
        assert noise_at is not None
        side = _side(self.targets[noise_at].address, control) | {"outcome": outcome}
        side["sent_s"] = round(control.sent_at - self._origin, 6)
        return side

    def _judge_stream(
        self, flight: Flight, stream: StreamPlan, replayed: Outcome, compared: Outcome | None, control: Outcome | None
    ) -> tuple[dict[str, Any], CallDiff]:
        """A token stream's results line: the token comparison (:mod:`stream_compare`) and TTFT/ITL on
        both sides. It counts as one call in the overall outcomes and latencies (its duration)."""
        plan = flight.plan
        record = plan.call.record
        candidate = _stream_answer(replayed)
        if compared is not None:
            reference = _stream_answer(compared)
            reference_latency_s = compared.latency_s
            reference_version = _served_version(compared)
        else:
            reference = stream.recorded
            reference_latency_s = record.latency_ns / 1e9
            reference_version = record.version
        sdiff = compare_streams(reference, candidate)
        diff = CallDiff(sdiff.outcome, sdiff.reference_code, sdiff.candidate_code)
        control_outcome = None
        if control is not None and self.aggregates.noise is not None:
            control_diff = compare_streams(reference, _stream_answer(control))
            control_outcome = control_diff.outcome
            if self._count_text(sdiff.outcome, control_outcome):
                self.aggregates.noise.add_positions(
                    TEXT_FIELD, sdiff.reference_sequence, control_diff.candidate_sequence, sdiff.candidate_sequence
                )
        replayed_version = _served_version(replayed)
        lag_ms = self._count(flight, diff, replayed, replayed_version, reference_version, reference_latency_s)
        self.aggregates.streams.add(reference_version or "?", sdiff, reference, candidate)
        line = self._line(flight, diff, replayed, lag_ms, kind="stream")
        line["recorded"] |= {
            "ttft_ms": _ms(stream.recorded.ttft_s),
            "responses_total": int(record.stream.responses_total),
            "truncated": record.stream.truncated,
        }
        line["replayed"]["ttft_ms"] = _ms(candidate.ttft_s)
        line["stream"] = sdiff.as_dict()
        if control is not None and control_outcome is not None:
            line["control"] = self._control_side(control, control_outcome)
        if compared is not None:
            line["compare_to"] = _side(self.targets[1].address, compared) | {"ttft_ms": _ms(reference.ttft_s)}
            line["compare_to"]["sent_s"] = round(compared.sent_at - self._origin, 6)
        self.aggregates.worst.offer_stream(sdiff, line)
        return line, diff

    def _judge_http(
        self, flight: Flight, plan: HttpPlan, replayed: Outcome, compared: Outcome | None, control: Outcome | None
    ) -> tuple[dict[str, Any], CallDiff]:
        """An HTTP call's results line: status, text or body, usage; TTFT and inter-token gaps on both sides of a
        generating call, whose text also counts among the streams' (:mod:`http_compare`)."""
        record = flight.plan.call.record
        candidate = _http_answer(replayed, plan.api)
        if compared is not None:
            reference = _http_answer(compared, plan.api)
            reference_latency_s = compared.latency_s
            reference_version = compared.version
        else:
            reference = plan.recorded
            reference_latency_s = record.latency_ns / 1e9
            reference_version = record.version
        hdiff = compare_http(plan.api, reference, candidate, self.settings.tolerance)
        control_outcome = None
        if control is not None and self.aggregates.noise is not None:
            control_outcome = compare_http(
                plan.api, reference, _http_answer(control, plan.api), self.settings.tolerance
            ).outcome
            self._count_text(hdiff.outcome, control_outcome)
        labels = (str(hdiff.reference_status), str(hdiff.candidate_status))
        code_ref = status_code(reference.status)
        code_cand = status_code(candidate.status)
        if reference.status == CLIENT_LEFT:  # a prefix: its status says nothing of the replay's
            code_ref = code_cand
        why = hdiff.not_compared_why
        diff = CallDiff(hdiff.outcome, code_ref, code_cand, not_compared_why=why, status_labels=labels)
        lag_ms = self._count(flight, diff, replayed, replayed.version, reference_version, reference_latency_s)
        self.aggregates.http.add(plan.api, hdiff)
        line = self._line(flight, diff, replayed, lag_ms, kind="http")
        line["api"] = plan.api
        if control is not None and control_outcome is not None:
            line["control"] = self._control_side(control, control_outcome)
        line["recorded"] |= {"status": str(record.http.status), "ttft_ms": _ms(plan.recorded.ttft_s)}
        line["replayed"] |= {"status": str(candidate.status), "ttft_ms": _ms(candidate.ttft_s)}
        if hdiff.usage.compared or hdiff.usage.candidate is not None:
            line["usage"] = hdiff.usage.as_dict()
        if hdiff.text is not None:
            reference_text = read_text(plan.api, reference)
            candidate_text = read_text(plan.api, candidate)
            self.aggregates.streams.add(
                reference_version or "?",
                hdiff.text,
                _text_stream(reference, reference_text),
                _text_stream(candidate, candidate_text),
            )
            line["text"] = hdiff.text.as_dict()
            self.aggregates.worst.offer_stream(hdiff.text, line)
        else:
            if hdiff.body_difference:
                line["body_difference"] = hdiff.body_difference
            if diff.outcome == "status_change":
                self.aggregates.worst.offer(diff, line)
            elif diff.outcome == "mismatch":
                self.aggregates.worst.offer_stream(_BODY_DIFFERS, line)
        if hdiff.not_compared_why:
            line["not_compared"] = hdiff.not_compared_why
        if candidate.status >= 400 and replayed.http is not None and replayed.http.body:
            line["replayed"]["message"] = replayed.http.body[:300].decode("utf-8", errors="replace")
        if compared is not None:
            line["compare_to"] = _side(self.targets[1].address, compared) | {
                "status": str(reference.status),
                "ttft_ms": _ms(reference.ttft_s),
            }
            line["compare_to"]["sent_s"] = round(compared.sent_at - self._origin, 6)
        return line, diff

    def _count_text(self, candidate_outcome: str, control_outcome: str) -> bool:
        """A generated text (or body) as one trial of the text field, when all three answered alike and it was
        compared: whether the candidate's and the control's differ from the reference. True when counted."""
        outcomes = {candidate_outcome, control_outcome}
        if self.aggregates.noise is not None and outcomes <= {"match", "mismatch"}:
            self.aggregates.noise.add_text(TEXT_FIELD, control_outcome == "mismatch", candidate_outcome == "mismatch")
            return True
        return False

    def _count(
        self,
        flight: Flight,
        diff: CallDiff,
        replayed: Outcome,
        replayed_version: str,
        reference_version: str,
        reference_latency_s: float,
    ) -> float | None:
        """Add one judged call (unary or stream) to the totals every call shares: outcomes and latencies
        overall and per recorded version, status changes, send lag, the replay's first and last instant.
        Returns the call's send lag in ms (None when it was not paced)."""
        agg = self.aggregates
        agg.overall.add(diff, replayed_version, reference_latency_s, replayed.latency_s)
        group = agg.by_version.setdefault(reference_version or "?", GroupTotals())
        group.add(diff, replayed_version, reference_latency_s, replayed.latency_s)
        if diff.status_change_kind:
            agg.status_changes[diff.status_change_kind] += 1
            agg.transitions[diff.status_change or ""] += 1
        lag_ms = None
        if flight.planned_at is not None:
            lag_s = replayed.sent_at - flight.planned_at
            agg.send_lag.add(lag_s)
            lag_ms = round(lag_s * 1000, 4)
        if agg.first_sent_at is None:
            agg.first_sent_at = replayed.sent_at
        agg.last_done_at = max(agg.last_done_at or 0.0, *(o.done_at for o in flight.outcomes if o is not None))
        return lag_ms

    def _line(
        self, flight: Flight, diff: CallDiff, replayed: Outcome, lag_ms: float | None, *, kind: str = ""
    ) -> dict[str, Any]:
        """The results-line fields a unary call and a token stream share (``kind`` marks a stream's)."""
        record = flight.plan.call.record
        origin = self._origin
        return {
            **_flight_ids(flight),
            **({"kind": kind} if kind else {}),
            "outcome": diff.outcome,
            "status_change": diff.status_change,
            "planned_s": None if flight.planned_at is None else round(flight.planned_at - origin, 6),
            "sent_s": round(replayed.sent_at - origin, 6),
            "done_s": round(replayed.done_at - origin, 6),
            "send_lag_ms": lag_ms,
            "recorded": {
                "version": record.version,
                "status": status_name(record.status_code),
                "latency_ms": round(record.latency_ns / 1e6, 4),
            },
            "replayed": _side(self.targets[0].address, replayed),
        }

    def _not_replayed(self, item: NotReplayed) -> dict[str, Any]:
        """The results line of a call that was not sent, counted apart: neither a send error (nothing
        was tried) nor a status change (the target never saw it)."""
        record = item.call.record
        self.aggregates.not_replayed[item.why] += 1
        return {
            "request_id": record.request_id,
            "model": record.model,
            "receive_unix_ns": item.call.receive_ns,
            "stream_id": item.call.stream_id,
            "outcome": "not_replayed",
            "not_replayed": item.why,
            "payloads_dropped": dropped_payloads(record),
            "recorded": {"version": record.version, "status": status_name(record.status_code)},
        }

    def _send_error(self, flight: Flight, failed: list[tuple[int, Outcome]]) -> dict[str, Any]:
        """The results line of a call that never reached (one of) the targets: counted as a send error,
        neither a status change nor a match, since the target did not answer it."""
        record = flight.plan.call.record
        errors = {self.targets[position].address: outcome.send_error for position, outcome in failed}
        self.aggregates.send_errors += 1
        return {
            **_flight_ids(flight),
            "outcome": "send_error",
            "send_error": "; ".join(f"{address}: {message}" for address, message in errors.items()),
            "recorded": {"version": record.version, "status": status_name(record.status_code)},
        }

    # -- summary -------------------------------------------------------------------------

    def summary(self) -> Summary:
        """The run as the typed summary (``summary.json``; also what the report and the gate read)."""
        agg = self.aggregates
        overall = agg.overall.summary()
        latency = overall.latency
        outputs = {name: totals.summary() for name, totals in sorted(agg.outputs.items())}
        agreements = [o.argmax_agreement for o in outputs.values() if o.argmax_agreement is not None]
        topks = [o.topk_agreement for o in outputs.values() if o.topk_agreement is not None]
        errors = [o.max_abs_error for o in outputs.values() if o.max_abs_error is not None]
        completed = overall.completed
        send_lag = agg.send_lag.quantiles_ms() if agg.send_lag.count else None
        active_s = (
            agg.last_done_at - agg.first_sent_at
            if agg.first_sent_at is not None and agg.last_done_at is not None
            else 0.0
        )
        streams = agg.streams.summary(active_s)
        http = agg.http.summary()
        noise = agg.noise.summary() if agg.noise is not None else None
        metrics = Metrics(
            mismatch_rate=overall.mismatch_rate,
            status_change_rate=rate(overall.status_changes, completed),
            divergence_rate=rate(overall.mismatches + overall.status_changes, completed),
            error_rate=overall.candidate_error_rate,
            reference_error_rate=overall.reference_error_rate,
            p50_ratio=latency.p50_ratio,
            p95_ratio=latency.p95_ratio,
            p99_ratio=latency.p99_ratio,
            p99_ms=latency.candidate.p99_ms,
            max_abs_error=max(errors, default=None),
            argmax_agreement=min(agreements, default=None),
            topk_agreement=min(topks, default=None),
            send_lag_p99_ms=send_lag.p99_ms if send_lag else None,
            send_lag_max_ms=send_lag.max_ms if send_lag else None,
            completed=completed,
            failed_sends=self.stats.selected - completed - sum(agg.not_replayed.values()),
            skipped=sum(self.stats.skipped.values()),
            token_match_rate=streams.token_match_rate if streams else None,
            mean_edit_distance=streams.mean_edit_distance if streams else None,
            mean_text_edit_distance=streams.mean_text_edit_distance if streams else None,
            first_divergence_p50=streams.first_divergence_p50 if streams else None,
            ttft_p50_ratio=streams.ttft.p50_ratio if streams else None,
            ttft_p99_ratio=streams.ttft.p99_ratio if streams else None,
            itl_p50_ratio=streams.itl.p50_ratio if streams else None,
            itl_p99_ratio=streams.itl.p99_ratio if streams else None,
            tokens_per_s=streams.tokens_per_s if streams else None,
            usage_mismatch_rate=http.usage_mismatch_rate if http else None,
            diff_above_noise_rate=noise.diff_above_noise_rate if noise else None,
        )
        tolerance = self.settings.tolerance
        return Summary(
            interrupted=self.interrupted,
            started_unix_ns=self.started_unix_ns,
            wall_s=round(self.wall_s, 3),
            window=Window(
                models=list(self.selection.models),
                since_unix_ns=self.selection.since_ns,
                until_unix_ns=self.selection.until_ns,
                max_lateness_s=self.selection.max_lateness_ns / 1e9,
            ),
            target=self.targets[0].address,
            compare_to=self.settings.compare_to or None,
            reference="compare_to" if self.settings.compare_to else "recorded",
            pin_version=self.settings.pin_version or None,
            speed=self.settings.speed if self.settings.speed is not None else "max",
            concurrency=self.settings.concurrency,
            tolerance=ToleranceSummary(rtol=tolerance.rtol, atol=tolerance.atol, top_k=tolerance.top_k),
            selection=self.stats.summary(),
            counts=Counts(
                selected=self.stats.selected,
                sent=agg.sent,
                completed=completed,
                not_sent=agg.not_sent,
                send_errors=agg.send_errors,
                skipped=dict(self.stats.skipped) | dict(agg.skipped),
                not_replayed=dict(sorted(agg.not_replayed.items())),
            ),
            outcomes=Outcomes(
                match=overall.matches,
                mismatch=overall.mismatches,
                status_change=overall.status_changes,
                not_compared=overall.not_compared,
            ),
            status_changes=StatusChanges(
                ok_to_error=agg.status_changes["ok_to_error"],
                error_to_ok=agg.status_changes["error_to_ok"],
                error_to_other_error=agg.status_changes["error_to_other_error"],
                transitions=dict(sorted(agg.transitions.items())),
            ),
            latency=latency,
            outputs=outputs,
            versions={version: group.summary() for version, group in sorted(agg.by_version.items())},
            send_lag=send_lag,
            max_in_flight=agg.max_in_flight,
            sender_nice=self.sender_nice_applied,
            replay_rate_calls_per_s=round(completed / active_s, 1) if active_s > 0 else None,
            metrics=metrics,
            streams=streams,
            http=http,
            noise=noise,
            worst_calls=agg.worst.worst_first(),
        )

    def histograms(self) -> dict[str, LogHistogram]:
        """The distributions the report draws."""
        return {
            "reference_latency": self.aggregates.overall.reference_latency,
            "candidate_latency": self.aggregates.overall.candidate_latency,
            "send_lag": self.aggregates.send_lag,
            **{
                f"candidate_latency:{version}": group.candidate_latency
                for version, group in self.aggregates.by_version.items()
            },
            **self._stream_histograms(),
        }

    def _stream_histograms(self) -> dict[str, LogHistogram]:
        streams = self.aggregates.streams
        if not streams.overall.streams:
            return {}
        groups = {"": streams.overall} | {f":{version}": group for version, group in streams.by_version.items()}
        out: dict[str, LogHistogram] = {}
        for suffix, group in groups.items():
            out[f"reference_ttft{suffix}"] = group.reference_ttft
            out[f"candidate_ttft{suffix}"] = group.candidate_ttft
            out[f"reference_itl{suffix}"] = group.reference_itl
            out[f"candidate_itl{suffix}"] = group.candidate_itl
        return out


#: A differing non-text body, ranked among the worst calls as a wholly differing text would be.
_BODY_DIFFERS = StreamDiff("mismatch", 0, 0, edit_distance=1.0)


def _pinned(metadata: Sequence[tuple[str, str]], version: str) -> list[tuple[str, str]]:
    """The control's second pass: ``metadata`` pinned to ``version`` (``--noise-from``) instead of the candidate's
    ``--pin-version``, or not pinned at all (``--noise-target``: a router there serves its own control)."""
    kept = [(key, value) for key, value in metadata if key != VERSION_HEADER]
    return [*kept, (VERSION_HEADER, version)] if version else kept


def _request_dropped(record: recorder_pb2.CallRecord) -> bool:
    """Whether the request to send is not in the record: left out for size, or an HTTP body redacted."""
    dropped = dropped_payloads(record)
    if not record.HasField("http"):
        return "request" in dropped
    redacted = record.tags.get(REDACTED_HTTP_TAG, "").split(",")
    return "http.request_body" in dropped or "request_body" in redacted


def _without_user(body: bytes) -> bytes:
    """The JSON body without its ``user`` (``--drop-user``); a body that is no JSON object is sent as it is."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if not isinstance(parsed, dict) or "user" not in parsed:
        return body
    del parsed["user"]
    return json.dumps(parsed, separators=(",", ":")).encode()


def _http_answer(outcome: Outcome, api: str) -> HttpAnswer:
    """A replayed HTTP answer, its event times counted from when the request went out."""
    reply = outcome.http
    if reply is None:
        return HttpAnswer(status=-1)
    events = tuple(data for _, data in reply.events)
    answer = HttpAnswer(reply.status, reply.body, events, tuple(at for at, _ in reply.events))
    times = read_text(api, answer).times_s
    return HttpAnswer(
        answer.status,
        answer.body,
        answer.events,
        answer.event_times_s,
        ttft_s=times[0] if times else None,
        usage=http_usage(answer),
    )


def _text_stream(answer: HttpAnswer, text: Text) -> StreamAnswer:
    """An HTTP answer's text as a token stream for the streams' totals: one token per piece, timed."""
    return StreamAnswer(
        status_code(answer.status),
        tuple(piece.encode() for piece in text.pieces),
        text.times_s,
        answer.ttft_s,
        prefix_only=answer.prefix_only,
    )


def _flight_ids(flight: Flight) -> dict[str, Any]:
    """What names a sent call in its results line, answered or not, so that lines join with the recording."""
    plan = flight.plan
    record = plan.call.record
    return {
        "request_id": record.request_id,
        "replay_request_id": plan.replay_id,
        "model": record.model,
        "receive_unix_ns": plan.call.receive_ns,
        "stream_id": plan.call.stream_id,
        "sequence": flight.sequence,
    }


def _served_version(outcome: Outcome) -> str:
    """The version that answered: the router's trailing header, else the response's model_version."""
    if outcome.version or outcome.response is None:
        return outcome.version
    with contextlib.suppress(Exception):
        return oip.ModelInferResponse.FromString(outcome.response).model_version
    return ""


def _stream_answer(outcome: Outcome) -> StreamAnswer:
    """A replayed stream's answer, its times counted from its first request."""
    received = outcome.stream_responses or ()
    times = tuple(at - outcome.sent_at for at, _ in received)
    return StreamAnswer(outcome.code, tuple(raw for _, raw in received), times, times[0] if times else None)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


def _side(address: str, outcome: Outcome) -> dict[str, Any]:
    side: dict[str, Any] = {
        "target": address,
        "version": _served_version(outcome),
        "status": status_name(outcome.code),
        "latency_ms": round(outcome.latency_s * 1000, 4),
    }
    if outcome.message:
        side["message"] = outcome.message[:300]
    return side
