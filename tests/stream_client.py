"""Driving ``ModelStreamInfer`` from tests as a plain gRPC client: raw bytes both ways, so a test sees
exactly what the router relayed."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from splitstream.common.proto.inference import grpc_service_pb2 as oip

STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
FINAL = "triton_final_response"


@dataclass
class StreamResult:
    responses: list[bytes]
    code: grpc.StatusCode
    details: str
    trailers: dict[str, str] = field(default_factory=dict)

    def decoded(self) -> list[oip.ModelStreamInferResponse]:
        return [oip.ModelStreamInferResponse.FromString(r) for r in self.responses]

    @property
    def version(self) -> str:
        return self.trailers.get("x-splitstream-version", "")


def is_final(response: oip.ModelStreamInferResponse) -> bool:
    parameters = response.infer_response.parameters
    return FINAL in parameters and parameters[FINAL].bool_param


def run_stream(
    address: str,
    requests: Sequence[bytes],
    *,
    metadata: Sequence[tuple[str, str]] = (),
    timeout_s: float = 20.0,
) -> StreamResult:
    """Send ``requests`` on one stream, half-close, and read every response to the final status."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(STREAM_METHOD)(iter(requests), metadata=list(metadata), timeout=timeout_s)
        responses: list[bytes] = []
        try:
            for response in call:
                responses.append(response)
        except grpc.RpcError:
            pass
        trailers = {k: v for k, v in (call.trailing_metadata() or ()) if isinstance(v, str)}
        return StreamResult(responses, call.code(), call.details() or "", trailers)


class OpenStream:
    """A stream whose requests the test sends one by one while reading responses; ``cancel()`` ends it
    from the client side."""

    def __init__(
        self, address: str, *, metadata: Sequence[tuple[str, str]] = (), timeout_s: float | None = 30.0
    ) -> None:
        self._channel = grpc.insecure_channel(address)
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self.call = self._channel.stream_stream(STREAM_METHOD)(
            self._requests(), metadata=list(metadata), timeout=timeout_s
        )
        self.responses: queue.Queue[bytes | grpc.RpcError | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[bytes]:
        while (item := self._outbox.get()) is not None:
            yield item

    def _read(self) -> None:
        try:
            for response in self.call:
                self.responses.put(response)
        except grpc.RpcError as error:
            self.responses.put(error)
            return
        self.responses.put(None)

    def send(self, request: bytes) -> None:
        self._outbox.put(request)

    def close_sending(self) -> None:
        self._outbox.put(None)

    def next(self, timeout_s: float = 20.0) -> bytes:
        item = self.responses.get(timeout=timeout_s)
        if not isinstance(item, bytes):
            raise AssertionError(f"expected a response, got {item!r}")
        return item

    def remaining(self) -> list[bytes]:
        """The responses received and not yet taken (call after :meth:`finish`)."""
        items = []
        while not self.responses.empty():
            item = self.responses.get_nowait()
            if isinstance(item, bytes):
                items.append(item)
        return items

    def cancel(self) -> None:
        self.call.cancel()
        self._outbox.put(None)

    def finish(self, timeout_s: float = 20.0) -> tuple[grpc.StatusCode, str]:
        """Wait for the final status (reading what responses remain)."""
        self._reader.join(timeout=timeout_s)
        return self.call.code(), self.call.details() or ""

    def close(self) -> None:
        self._outbox.put(None)
        self._channel.close()
