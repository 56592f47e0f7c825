"""Sending one recorded request to a target (router or worker) as the bytes it was recorded as.

The replayer never re-encodes a request: the serialized ModelInferRequest goes out through a
generic unary method with no serializer, so what the target sees is byte for byte what the
client sent (after redaction). Calls are started from the scheduler thread with the blocking
API's ``future()``, which returns as soon as the call is on its way; completion arrives on a
gRPC thread through a callback, so a slow call never holds the next one back.

A call the replayer itself cannot send (gRPC refuses a header, the request is over the send
limit, the channel is closed) never reaches the target, so it must not read as the target's
answer: gRPC reports a refused header as an INTERNAL status of the call ("Invalid metadata"),
indistinguishable from a target's INTERNAL, so headers are checked here first, by gRPC core's
rules, and every such failure ends as an :class:`Outcome` with ``send_error`` set.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from splitstream.common.headers import VERSION_HEADER, from_header_value
from splitstream.common.tls import ClientTls

if TYPE_CHECKING:
    from splitstream.replayer.http_sender import HttpReply

METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
#: gRPC core's rule for metadata keys (validate_metadata.cc): lowercase letters, digits, ``-_.``.
_KEY = re.compile(r"^[0-9a-z_.-]+$")


class TargetUnreachable(ConnectionError):
    """The target did not accept a connection within the connect timeout."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one call ended. ``sent_at``/``done_at`` are perf_counter seconds. ``send_error``: why the
    replayer could not send it (then ``code`` means nothing: the target never saw the call)."""

    code: int
    message: str
    response: bytes | None
    version: str
    sent_at: float
    done_at: float
    send_error: str = ""
    #: A token stream's responses as they came: (perf_counter time, serialized ModelStreamInferResponse).
    stream_responses: tuple[tuple[float, bytes], ...] | None = None
    #: An HTTP target's answer (then ``code`` is 0 for a 2xx status, else the HTTP status).
    http: HttpReply | None = None

    @property
    def latency_s(self) -> float:
        return self.done_at - self.sent_at


def metadata_problem(metadata: Sequence[tuple[str, str | bytes]]) -> str:
    """Why gRPC would refuse to send ``metadata`` ("" when it would not): a key outside ``[0-9a-z_.-]``,
    a ``-bin`` value that is not bytes, or another value that is not a printable ASCII string."""
    for key, value in metadata:
        if not isinstance(key, str) or not _KEY.match(key):
            return f"metadata key {key!r} is not a valid gRPC header name (lowercase letters, digits, -_.)"
        if key.endswith("-bin"):
            if not isinstance(value, bytes):
                return f"metadata {key!r}: a -bin header's value must be bytes"
        elif not isinstance(value, str) or not (value.isascii() and value.isprintable()):
            return f"metadata {key!r}: value {value!r} is not printable ASCII"
    return ""


class Target:
    def __init__(self, address: str, *, tls: ClientTls, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self.channel = tls.channel(address, options)
        # No serializers: requests and responses stay bytes.
        self._call = self.channel.unary_unary(METHOD)
        self._stream_call = self.channel.stream_stream(STREAM_METHOD)
        # gRPC cancels a call whose future is garbage-collected ("Cancelled upon garbage collection!"),
        # and a future referenced only from its own done-callback is a cycle the collector frees while
        # the call is still in flight. So every future is held here until its callback has run.
        self._pending: set[grpc.Future] = set()

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise TargetUnreachable(
                f"target {self.address} is unreachable (no connection within {timeout_s:g}s)"
            ) from None

    def send(
        self,
        payload: bytes,
        metadata: Sequence[tuple[str, str]],
        *,
        timeout_s: float,
        on_done: Callable[[Outcome], None],
    ) -> None:
        """Start the call and return at once; ``on_done`` runs on a gRPC thread when it ends, or here,
        before returning, with ``send_error`` set when the call could not be sent."""
        sent_at = time.perf_counter()
        # ~0.9 µs for three headers (measured), beside tens of µs to start a gRPC call: cheap enough for the
        # timed sender thread.
        problem = metadata_problem(metadata)
        if not problem and len(payload) > self.max_message_bytes:
            problem = f"request is {len(payload)} bytes, over the {self.max_message_bytes}-byte send limit"
        if not problem:
            try:
                future = self._call.future(payload, metadata=metadata, timeout=timeout_s)
            except Exception as error:  # TypeError/ValueError from gRPC's checks, a closed channel: not the target's
                problem = f"{type(error).__name__}: {error}"
        if problem:
            on_done(Outcome(-1, "", None, "", sent_at, time.perf_counter(), send_error=problem))
            return

        def finished(call: grpc.Future) -> None:
            done_at = time.perf_counter()
            self._pending.discard(call)
            rendezvous: grpc.Call = call  # type: ignore[assignment]  # the future is also the Call
            code = rendezvous.code()
            version = ""
            for key, value in rendezvous.trailing_metadata() or ():
                if key == VERSION_HEADER:
                    version = from_header_value(str(value))
            if code is grpc.StatusCode.OK:
                on_done(Outcome(0, "", call.result(), version, sent_at, done_at))
            else:
                on_done(Outcome(code.value[0], rendezvous.details() or "", None, version, sent_at, done_at))

        self._pending.add(future)
        future.add_done_callback(finished)

    def send_stream(
        self,
        requests: Sequence[bytes],
        offsets_s: Sequence[float] | None,
        metadata: Sequence[tuple[str, str]],
        *,
        timeout_s: float,
        stop_after: int | None,
        on_done: Callable[[Outcome], None],
    ) -> None:
        """Start a token stream and return at once: its requests go out at ``offsets_s`` from the start
        (all at once when None), its responses are read, timed, as they come, on a thread of its own (the
        blocking API reads a stream by iterating it; the ``--concurrency`` slots bound these threads).
        ``stop_after``: cancel the stream once that many responses came (a recorded stream the client
        cancelled is replayed as far as it went). ``on_done`` runs on that thread at the end."""
        sent_at = time.perf_counter()
        problem = metadata_problem(metadata)
        if not problem and any(len(request) > self.max_message_bytes for request in requests):
            problem = f"a request of the stream is over the {self.max_message_bytes}-byte send limit"
        if problem:
            on_done(Outcome(-1, "", None, "", sent_at, time.perf_counter(), send_error=problem))
            return
        thread = threading.Thread(
            target=self._run_stream,
            args=(requests, offsets_s, metadata, timeout_s, stop_after, on_done, sent_at),
            name="replay-stream",
            daemon=True,
        )
        thread.start()

    def _run_stream(
        self,
        requests: Sequence[bytes],
        offsets_s: Sequence[float] | None,
        metadata: Sequence[tuple[str, str]],
        timeout_s: float,
        stop_after: int | None,
        on_done: Callable[[Outcome], None],
        sent_at: float,
    ) -> None:
        ended = threading.Event()

        def outgoing() -> Iterator[bytes]:
            for position, request in enumerate(requests):
                if offsets_s is not None and position:
                    wait_s = sent_at + offsets_s[position] - time.perf_counter()
                    if wait_s > 0 and ended.wait(wait_s):
                        return
                yield request

        responses: list[tuple[float, bytes]] = []
        stopped_by_us = False
        try:
            call = self._stream_call(outgoing(), metadata=metadata, timeout=timeout_s)
        except Exception as error:  # a closed channel, gRPC's own checks: not the target's answer
            why = f"{type(error).__name__}: {error}"
            on_done(Outcome(-1, "", None, "", sent_at, time.perf_counter(), send_error=why))
            return
        rendezvous: grpc.Call = call  # type: ignore[assignment]  # the iterator is also the Call
        try:
            for response in call:
                responses.append((time.perf_counter(), response))
                if stop_after is not None and len(responses) >= stop_after:
                    stopped_by_us = True
                    call.cancel()  # type: ignore[attr-defined]
                    break
        except grpc.RpcError:
            pass  # the status is read below
        finally:
            ended.set()
        done_at = time.perf_counter()
        code = rendezvous.code()
        version = ""
        for key, value in rendezvous.trailing_metadata() or ():
            if key == VERSION_HEADER:
                version = from_header_value(str(value))
        number = 1 if stopped_by_us else (code.value[0] if code is not None else 2)
        message = "" if stopped_by_us or code is grpc.StatusCode.OK else rendezvous.details() or ""
        on_done(Outcome(number, message, None, version, sent_at, done_at, stream_responses=tuple(responses)))

    def close(self) -> None:
        self.channel.close()
