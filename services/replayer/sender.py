"""Sending one recorded request to a target (router or worker) as the bytes it was recorded as.

The replayer never re-encodes a request: the serialized ModelInferRequest goes out through a
generic unary method with no serializer, so what the target sees is byte for byte what the
client sent (after redaction). Calls are started from the scheduler thread with the blocking
API's ``future()``, which returns as soon as the call is on its way; completion arrives on a
gRPC thread through a callback, so a slow call never holds the next one back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

METHOD = "/inference.GRPCInferenceService/ModelInfer"
VERSION_HEADER = "x-splitstream-version"


class TargetUnreachable(ConnectionError):
    """The target did not accept a connection within the connect timeout."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsOptions:
    """TLS for the target channels (off unless ``enabled``); files are PEM."""

    enabled: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one call ended. ``sent_at``/``done_at`` are perf_counter seconds."""

    code: int
    message: str
    response: bytes | None
    version: str
    sent_at: float
    done_at: float

    @property
    def latency_s(self) -> float:
        return self.done_at - self.sent_at


class Target:
    def __init__(self, address: str, *, tls: TlsOptions, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        self.address = address
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls.enabled:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self.channel = grpc.secure_channel(address, tls.credentials(), options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        # No serializers: requests and responses stay bytes.
        self._call = self.channel.unary_unary(METHOD)
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
        """Start the call and return at once; ``on_done`` runs on a gRPC thread when it ends."""
        sent_at = time.perf_counter()
        future = self._call.future(payload, metadata=metadata, timeout=timeout_s)

        def finished(call: grpc.Future) -> None:
            done_at = time.perf_counter()
            self._pending.discard(call)
            rendezvous: grpc.Call = call  # type: ignore[assignment]  # the future is also the Call
            code = rendezvous.code()
            version = ""
            for key, value in rendezvous.trailing_metadata() or ():
                if key == VERSION_HEADER:
                    version = str(value)
            if code is grpc.StatusCode.OK:
                on_done(Outcome(0, "", call.result(), version, sent_at, done_at))
            else:
                on_done(Outcome(code.value[0], rendezvous.details() or "", None, version, sent_at, done_at))

        self._pending.add(future)
        future.add_done_callback(finished)

    def close(self) -> None:
        self.channel.close()
