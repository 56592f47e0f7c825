"""Recording on the router's side: each finished call appended to the local write-ahead log, nothing more.

Building, batching and streaming records on the event loop that answers calls would cost
the router, and a killed router would lose what sat in a memory queue; so an answered call
costs only one framed append (:mod:`splitstream.common.wal`: a compact header and the request and
response bytes as they are) to an open segment file; ``splitstream-shipper`` (a child
process by default, see :mod:`splitstream.router.shipper_child`) turns the log into
records. The append never waits on the shipper or the network: a log over
``--spool-max-bytes`` (the shipper dead or far behind) or a failing disk refuses it, and
the call is counted as dropped and answered all the same.

What a crash loses: a killed router nothing it appended (the bytes are in the page cache);
a machine crash at most ``--log-flush-interval-s`` of appends (the flusher's fdatasync).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric

from splitstream.common.experiment import Phase
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import routing_key_hmac
from splitstream.common.wal import (
    CALL,
    CALL_HEAD,
    FALLBACK,
    FEEDBACK,
    HAS_RESPONSE,
    HTTP,
    HTTP_HEAD,
    KINDS,
    PINNED,
    RETRIED,
    SHADOWS,
    STREAM,
    ShadowEntry,
    WalWriter,
    encode_feedback,
    encode_shadows,
    stranded_logs,
)
from splitstream.router.core import CallOutcome
from splitstream.router.recorded_metadata import RecordedMetadata
from splitstream.router.routing import Assignment

log = structlog.get_logger()

#: The routing core's assignments as CallRecord spells them, by the assignment's id() (as the status codes below).
_ASSIGNMENTS = {id(kind): recorder_pb2.Assignment.Value(f"ASSIGNMENT_{kind.name}") for kind in Assignment}
#: A failing disk is logged at most this often (every call would fail alike).
_ERROR_LOG_INTERVAL_S = 10.0
_DROP_REASONS = ("log_full", "log_error", "unrecordable", "closing")
#: A status code's number by the code's id(): ``code.value[0]`` is an enum property lookup and a tuple index, and
#: a dict keyed by the code calls Enum's __hash__, written in Python (the members live as long as the process).
_CODE_NUMBERS = {id(code): code.value[0] for code in grpc.StatusCode}
#: Routing keys whose HMAC is kept: a client's calls share its key, and the HMAC is a fifth of an append.
_HMAC_CACHE_KEYS = 4096
#: Longer routing keys are not kept (the cache's memory stays small whatever clients send).
_HMAC_CACHE_KEY_CHARS = 256


class AppendedCounts:
    """Entries appended, by kind, counted as plain integers on the answering path, and added to the
    ``splitstream_router_log_appended`` counter when it is read: prometheus-client's ``Counter.inc`` (a lock
    and a value object) was 4,400 of an append's 41,800 instructions (callgrind).

    A collector of the router's registry, registered ahead of the counter, so a scrape syncs first and reads
    exact counts. A ``--processes`` child is scraped through its metric files instead, which only the counter
    writes: :meth:`sync` runs at each log flush there (the count lags by at most ``--log-flush-interval-s``)."""

    def __init__(self) -> None:
        self.counts = [0] * (max(KINDS) + 1)  # by entry kind; only the event loop's thread adds
        self._synced = [0] * len(self.counts)
        self._counters: dict[int, Counter] = {}
        self._lock = threading.Lock()  # a scrape (another thread) and a flush may sync at once

    def bind(self, counter: Counter) -> None:
        for kind, name in (
            (CALL, "call"),
            (STREAM, "stream"),
            (SHADOWS, "shadows"),
            (FEEDBACK, "feedback"),
            (HTTP, "http"),
        ):
            self._counters[kind] = counter.labels(name)

    def sync(self) -> None:
        with self._lock:
            for kind, counter in self._counters.items():
                delta = self.counts[kind] - self._synced[kind]
                if delta:
                    counter.inc(delta)
                    self._synced[kind] += delta

    def collect(self) -> Iterable[Metric]:
        self.sync()
        return ()


class LogMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.appended_counts = AppendedCounts()
        registry.register(self.appended_counts)  # before the counter it syncs: a registry collects in order
        self.appended = Counter(
            "splitstream_router_log_appended",
            "Entries appended to the write-ahead log, by kind",
            ["kind"],
            registry=registry,
        )
        self.records_dropped = Counter(
            "splitstream_router_log_records_dropped",
            "Calls not logged (so never recorded): log_full (the log is at --spool-max-bytes: the shipper is "
            "away or behind), log_error (the disk refused the write), unrecordable, closing",
            ["reason"],
            registry=registry,
        )
        self.feedback_dropped = Counter(
            "splitstream_router_log_feedback_dropped",
            "Outcome events not logged (their report was refused: RESOURCE_EXHAUSTED): log_full, log_error",
            ["reason"],
            registry=registry,
        )
        self.log_bytes = Gauge(
            "splitstream_router_log_bytes",
            "Log bytes not yet shipped, as the cap counts them",
            registry=registry,
            multiprocess_mode="livesum",  # --processes: the children's logs together
        )
        self.stranded_bytes = Gauge(
            "splitstream_router_log_stranded_bytes",
            "Unshipped log bytes found at start beside --log-dir in directories no router or shipper is at "
            "(a router restarted with another --log-dir left them): ship them with splitstream-shipper --log-dir",
            registry=registry,
            multiprocess_mode="max",
        )
        for reason in _DROP_REASONS:
            self.records_dropped.labels(reason)
            self.feedback_dropped.labels(reason)
        self.appended_counts.bind(self.appended)


class CallLog:
    """What the request path records into: ``offer`` (calls), ``offer_shadows``, ``offer_feedback``."""

    def __init__(
        self,
        directory: str,
        registry: CollectorRegistry,
        *,
        router_id: str,
        hmac_key: bytes,
        max_bytes: int,
        segment_bytes: int,
        flush_interval_s: float,
        record_credential_headers: bool = False,
    ) -> None:
        self.writer = WalWriter(directory, max_bytes=max_bytes, segment_bytes=segment_bytes)
        self.metrics = LogMetrics(registry)
        # Read at scrape time; with --processes the parent's scrape reads what each child's flusher last
        # set instead (prometheus-client's multiprocess mode calls no function).
        self.metrics.log_bytes.set_function(lambda: self.writer.unshipped_bytes)
        self.router_id = router_id
        self._router_id = router_id.encode()
        self.hmac_key = hmac_key
        self.flush_interval_s = flush_interval_s
        self.record_credential_headers = record_credential_headers
        self._recorded_metadata = RecordedMetadata(keep_credentials=record_credential_headers)
        self._closing = False
        self._phases: dict[str, bytes] = {}
        self._hmacs: dict[str, bytes] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._last_error_log = 0.0
        self._appended = self.metrics.appended_counts

    def warn_stranded(self, *, also: Sequence[str] = ()) -> None:
        """Say (log, metric) which logs beside this one hold calls nothing ships: a router restarted with another
        ``--log-dir`` left its old log unshipped without a word, and only the router can notice."""
        stranded = stranded_logs(self.writer.directory, also=[Path(p) for p in also])
        self.metrics.stranded_bytes.set(sum(size for _, size in stranded))
        for directory, size in stranded:
            log.warning(
                "a log beside --log-dir holds unshipped calls and no router or shipper is at it: ship it "
                "with splitstream-shipper --log-dir (or start its router again)",
                log_dir=str(directory),
                unshipped_bytes=size,
            )

    @property
    def closing(self) -> bool:
        return self._closing

    def _append(self, kind: int, parts: Sequence[bytes]) -> str | None:
        """None once appended, else the drop reason."""
        try:
            if not self.writer.append_parts(kind, parts):
                return "log_full"
        except OSError as error:
            now = time.monotonic()
            if now - self._last_error_log > _ERROR_LOG_INTERVAL_S:
                self._last_error_log = now
                log.error("log append failed; calls are answered but not recorded", error=str(error)[:300])
            return "log_error"
        self._appended.counts[kind] += 1
        return None

    def offer(
        self,
        outcome: CallOutcome,
        request: bytes,
        metadata: Sequence[tuple[str, str | bytes]],
        *,
        shadows_expected: int = 0,
    ) -> None:
        """Log a finished call. One append; never blocks on anything but the write itself."""
        if self._closing:
            self.metrics.records_dropped.labels("closing").inc()
            return
        try:
            kind, parts = self._encode(outcome, request, metadata, shadows_expected)
        except Exception:
            log.exception("call not recordable; dropped", request_id=str(outcome.request_id)[:200])
            self.metrics.records_dropped.labels("unrecordable").inc()
            return
        reason = self._append(kind, parts)
        if reason is not None:
            self.metrics.records_dropped.labels(reason).inc()

    def _encode(
        self,
        outcome: CallOutcome,
        request: bytes,
        metadata: Sequence[tuple[str, str | bytes]],
        shadows_expected: int,
        record_fields: bytes | None = None,
    ) -> tuple[int, tuple[bytes, bytes, bytes]]:
        """The entry's kind and its payload as three parts: the head and the other fields joined, then the request
        and the response bytes as they are (never copied here: a tensor can be megabytes). With ``record_fields``
        (the HTTP front door's record fields, serialized) an HTTP entry: its response field is empty (the answer
        is in ``record_fields``, the third part) and it has no shadows."""
        stream = b""
        if outcome.stream is not None:  # a token stream: its messages, serialized once it ended
            call = recorder_pb2.StreamCall()
            outcome.stream.fill(call)
            stream = call.SerializeToString()
        # The call entry's layout (splitstream.common.wal): packed here in one go rather than through
        # wal.encode_call's keywords, which cost a third more on every call (measured side by side), and each
        # length taken with len() by name, which costs a third of what *map(len, fields) did (callgrind).
        tail: tuple[int, ...]  # the head's last lengths: the response's, and an HTTP entry's record fields'
        if record_fields is None:
            kind = CALL if outcome.stream is None else STREAM
            response = outcome.response or b""
            has_response = HAS_RESPONSE if outcome.response is not None else 0
            last, head_struct, tail = response, CALL_HEAD, (len(response),)
        else:
            kind, has_response, shadows_expected = HTTP, 0, 0
            last, head_struct, tail = record_fields, HTTP_HEAD, (0, len(record_fields))
        request_id = outcome.request_id.encode()
        model = outcome.model.encode()
        version = outcome.version.encode()
        arm = outcome.arm.encode()
        details = outcome.details.encode()
        endpoint = outcome.endpoint.encode()
        router_id = self._router_id
        principal = outcome.principal.encode()
        key_hmac = b"" if outcome.routing_key is None else self._routing_key_hmac(outcome.routing_key)
        phase = b"" if outcome.phase is None else self._phase_field(outcome.phase)
        recorded = self._recorded_metadata.encoded(metadata, outcome.routing_key_header)
        flags = (
            (FALLBACK if outcome.fallback else 0)
            | (PINNED if outcome.pinned else 0)
            | (RETRIED if outcome.retried else 0)
            | has_response
        )
        head = head_struct.pack(
            outcome.receive_unix_ns,
            int(outcome.latency_s * 1e9),
            _CODE_NUMBERS[id(outcome.code)],
            flags,
            -1 if outcome.assignment is None else _ASSIGNMENTS[id(outcome.assignment)],
            min(shadows_expected, 255),
            len(request_id),
            len(model),
            len(version),
            len(arm),
            len(details),
            len(endpoint),
            len(router_id),
            len(principal),
            len(key_hmac),
            len(phase),
            len(recorded),
            len(stream),
            len(request),
            *tail,
        )
        fields = b"".join(
            (
                head,
                request_id,
                model,
                version,
                arm,
                details,
                endpoint,
                router_id,
                principal,
                key_hmac,
                phase,
                recorded,
                stream,
            )
        )
        return kind, (fields, request, last)

    def offer_http(
        self,
        outcome: CallOutcome,
        request: bytes,
        metadata: Sequence[tuple[str, str | bytes]],
        record_fields: bytes,
    ) -> None:
        """Log a finished call of the HTTP front door: ``outcome`` and ``request`` as for a token stream (the
        translated worker stream, its first request), ``metadata`` the client's headers, ``record_fields`` the
        record's ``http`` and ``usage`` fields already serialized. One append, as :meth:`offer`; an HTTP call
        has no shadows."""
        if self._closing:
            self.metrics.records_dropped.labels("closing").inc()
            return
        try:
            _, parts = self._encode(outcome, request, metadata, 0, record_fields)
        except Exception:
            log.exception("HTTP call not recordable; dropped", request_id=str(outcome.request_id)[:200])
            self.metrics.records_dropped.labels("unrecordable").inc()
            return
        reason = self._append(HTTP, parts)
        if reason is not None:
            self.metrics.records_dropped.labels(reason).inc()

    def routing_key_hmac(self, routing_key: str) -> str:
        """The HMAC records carry for ``routing_key`` (the HTTP front door masks a body's ``user`` with it)."""
        return self._routing_key_hmac(routing_key).decode()

    def offer_shadows(self, request_id: str, shadows: Sequence[ShadowEntry]) -> None:
        """Log a call's shadow outcomes (the shipper joins them to the call logged before)."""
        try:
            payload = encode_shadows(request_id, shadows)
        except Exception:
            log.exception("shadow outcomes not recordable; dropped", request_id=request_id[:200])
            return
        self._append(SHADOWS, (payload,))

    def feedback_room(self) -> int:
        """Events one report may hold (0 while closing): the log, not a queue, bounds them."""
        return 0 if self._closing else 1 << 30

    def offer_feedback(self, events: Sequence[bytes]) -> bool:
        """Log serialized events, all or none: False (counted) when the log refuses them."""
        if self._closing:
            return False
        reason = self._append(FEEDBACK, (encode_feedback(events),))
        if reason is not None:
            self.metrics.feedback_dropped.labels(reason).inc(len(events))
            return False
        return True

    def _routing_key_hmac(self, routing_key: str) -> bytes:
        """The key's HMAC as the log stores it, kept for the recent keys that are not too long."""
        hmac = self._hmacs.get(routing_key)
        if hmac is None:
            hmac = routing_key_hmac(self.hmac_key, routing_key).encode()
            if len(routing_key) <= _HMAC_CACHE_KEY_CHARS:
                if len(self._hmacs) >= _HMAC_CACHE_KEYS:
                    self._hmacs.clear()
                self._hmacs[routing_key] = hmac
        return hmac

    def _phase_field(self, phase: Phase) -> bytes:
        """``CallRecord.phase`` serialized, once per phase: the shipper appends these bytes to the record it
        builds (serialized messages concatenate into one)."""
        field = self._phases.get(phase.id)
        if field is None:
            if len(self._phases) >= 64:  # phases change with registry edits: keep the recent ones
                self._phases.clear()
            message = recorder_pb2.Phase(id=phase.id, control=phase.control)
            message.weights.update(phase.weights)
            field = self._phases[phase.id] = recorder_pb2.CallRecord(phase=message).SerializeToString()
        return field

    # -- background ------------------------------------------------------------------------------

    def start(self) -> None:
        self._flusher = asyncio.create_task(self._flush_loop(), name="log-flush")

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            self._appended.sync()
            try:
                await asyncio.to_thread(self.writer.flush)
                self.metrics.log_bytes.set(self.writer.unshipped_bytes)
            except OSError as error:
                log.error("log flush failed", error=str(error)[:300])

    async def close(self) -> None:
        """No more appends; what was appended is flushed to disk."""
        self._closing = True
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        await asyncio.to_thread(self.writer.close)
        self._appended.sync()
