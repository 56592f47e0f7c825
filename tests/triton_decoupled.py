"""A stand-in for Triton serving a decoupled model (``ModelStreamInfer``), run as a real gRPC process.

Why it exists: the router's token streams are meant for Triton with the TensorRT-LLM backend (or any
decoupled model), and neither Triton nor TensorRT-LLM can run on the machines the tests run on (no
GPU, no Triton server build). This process speaks what the router sees of them, on a real port, so
the router's relay is tested against the protocol and not against our own worker:

- ``inference.GRPCInferenceService/ModelStreamInfer``: each request (a ``ModelInferRequest`` with
  the TensorRT-LLM ensemble's ``max_tokens`` INT32 input) is answered by ``max_tokens`` responses,
  one per token, in order, each a ``ModelStreamInferResponse`` whose ``infer_response`` carries the
  request's id, the model name and version, outputs ``text_output`` (BYTES ``[1]``, the token's text
  ``"<version>:<request id>:<n>"``) and ``cum_log_probs`` (FP32 ``[1]``), and the bool parameter
  ``triton_final_response``: true on the last. With ``triton_enable_empty_final_response`` set on
  the request, every token response says false and one more response, empty, says true (Triton's
  way of ending a request whose final flag came without data).
- A request that cannot be served (no or bad ``max_tokens``) gets one response with
  ``error_message`` set (and its id in ``infer_response``); the stream stays open for the others.
- Requests of one stream run concurrently, as Triton's decoupled models do; their responses may
  interleave.
- ``grpc.health.v1`` says SERVING, so the router's pools treat it as a worker. It is listed in the
  file registry like one.

Test controls (not Triton's): ``--delay-ms`` before each token; ``--abort-streams N`` ends the first
N streams with UNAVAILABLE before any response (a worker failing before the first token);
``--fail-after N`` ends every stream with INTERNAL once it sent N responses (a backend failing
mid-generation);
``--events FILE`` appends one JSON line per event (``request`` with the SHA-256 of its bytes and its
parameters, ``response`` with the SHA-256 of the bytes sent, ``cancelled``, ``stream_end``), so a
test sees what the worker got, sent and whether it saw a cancel.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import struct
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from tests.harness import ServiceProcess, Stack, free_port

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


class DecoupledModel:
    def __init__(
        self, *, model: str, version: str, delay_s: float, abort_streams: int, fail_after: int, events: Path | None
    ) -> None:
        self.model = model
        self.fail_after = fail_after
        self.version = version
        self.delay_s = delay_s
        self.abort_streams = abort_streams
        self.events = events
        self.streams = 0

    def event(self, **fields: Any) -> None:
        if self.events is not None:
            with self.events.open("a") as out:
                out.write(json.dumps(fields) + "\n")

    async def stream_infer(self, requests: AsyncIterator[bytes], context: aio.ServicerContext[bytes, bytes]) -> None:
        self.streams += 1
        number = self.streams
        lock = asyncio.Lock()
        tasks: list[asyncio.Task[None]] = []

        sent = 0

        async def send(message: oip.ModelStreamInferResponse) -> None:
            nonlocal sent
            payload = message.SerializeToString()
            async with lock:
                if self.fail_after and sent >= self.fail_after:
                    await context.abort(grpc.StatusCode.INTERNAL, f"stand-in: failed after {sent} responses")
                await context.write(payload)
                sent += 1
            self.event(event="response", stream=number, sha256=hashlib.sha256(payload).hexdigest())

        try:
            async for payload in requests:
                request = oip.ModelInferRequest.FromString(payload)
                self.event(
                    event="request",
                    stream=number,
                    id=request.id,
                    model=request.model_name,
                    sha256=hashlib.sha256(payload).hexdigest(),
                    parameters={k: str(v).strip() for k, v in request.parameters.items()},
                )
                if number <= self.abort_streams:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "stand-in: stream aborted before any response")
                tasks.append(asyncio.create_task(self._answer(request, send)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            self.event(event="cancelled", stream=number)
            for task in tasks:
                task.cancel()
            raise
        self.event(event="stream_end", stream=number)

    async def _answer(self, request: oip.ModelInferRequest, send: Any) -> None:
        tokens = _max_tokens(request)
        if tokens is None or tokens <= 0:
            error = oip.ModelStreamInferResponse(error_message=f"in request '{request.id}': max_tokens must be >= 1")
            error.infer_response.id = request.id
            error.infer_response.model_name = self.model
            await send(error)
            return
        empty_final = request.parameters[EMPTY_FINAL].bool_param if EMPTY_FINAL in request.parameters else False
        for n in range(tokens):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            message = oip.ModelStreamInferResponse()
            response = message.infer_response
            response.model_name, response.model_version, response.id = self.model, self.version, request.id
            # The data goes in raw_output_contents, as Triton sends it.
            response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
            text = f"{self.version}:{request.id}:{n}".encode()
            response.raw_output_contents.append(len(text).to_bytes(4, "little") + text)
            response.outputs.add(name="cum_log_probs", datatype="FP32", shape=[1])
            response.raw_output_contents.append(struct.pack("<f", -0.5 * (n + 1)))
            response.parameters[FINAL].bool_param = n == tokens - 1 and not empty_final
            await send(message)
        if empty_final:
            message = oip.ModelStreamInferResponse()
            response = message.infer_response
            response.model_name, response.model_version, response.id = self.model, self.version, request.id
            response.parameters[FINAL].bool_param = True
            await send(message)


def _max_tokens(request: oip.ModelInferRequest) -> int | None:
    for index, tensor in enumerate(request.inputs):
        if tensor.name != "max_tokens":
            continue
        if tensor.contents.int_contents:
            return int(tensor.contents.int_contents[0])
        if index < len(request.raw_input_contents) and len(request.raw_input_contents[index]) >= 4:
            return int.from_bytes(request.raw_input_contents[index][:4], "little", signed=True)
    return None


def stream_request(
    request_id: str, max_tokens: int, *, model: str = "llm", version: str = "", text: bytes = b"", **bools: bool
) -> bytes:
    """A serialized request for the stand-in: ``max_tokens`` as TensorRT-LLM's INT32 input, ``text`` (if
    any) as its ``text_input`` (BYTES), ``bools`` as bool parameters (``triton_enable_empty_final_response``)."""
    request = oip.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    if text:
        request.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
        request.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.append(max_tokens.to_bytes(4, "little", signed=True))
    for key, value in bools.items():
        request.parameters[key].bool_param = value
    return request.SerializeToString()


async def serve(args: argparse.Namespace) -> None:
    model = DecoupledModel(
        model=args.model,
        version=args.version,
        delay_s=args.delay_ms / 1000,
        abort_streams=args.abort_streams,
        fail_after=args.fail_after,
        events=Path(args.events) if args.events else None,
    )
    server = aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService",
                {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(model.stream_infer)},
            )
        ]
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a stand-in for Triton serving a decoupled model")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="llm")
    parser.add_argument("--version", default="1")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--abort-streams", type=int, default=0)
    parser.add_argument("--fail-after", type=int, default=0)
    parser.add_argument("--events", default="")
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()


def start_standin(stack: Stack, model: str, version: str, *args: str, events: Path | None = None) -> ServiceProcess:
    """Start a stand-in on a free port as one of ``stack``'s processes (stopped with it); serving on return."""
    port = free_port()
    flags = ["--port", str(port), "--model", model, "--version", version, *args]
    if events is not None:
        flags += ["--events", str(events)]
    process = ServiceProcess(
        f"triton-{model}-{version}-{port}", "tests.triton_decoupled", flags, log_dir=stack.tmp_path, port=port
    )
    stack.processes.append(process)
    return process.start()


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events a stand-in wrote so far (none if it wrote none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
