"""What the router adds to token streams (ModelStreamInfer), side by side with the direct path.

One run, same streams, same backend: client → stand-in; client → router → stand-in; and client →
a bare grpc.aio pass-through (twenty lines, no routing, metrics or recording) → stand-in, the floor
of any Python gRPC hop on this machine. The backend is
the Triton decoupled-model stand-in of the tests (``tests/triton_decoupled.py``: Triton cannot run
here), answering each request with ``--tokens`` responses ``--delay-ms`` apart, so what differs
between the paths is the router alone. For 1 and 16 concurrent streams (each a closed loop: a
stream of one request, read to its end, then the next) it prints TTFT p50/p99 (client's send to
first response), inter-token gap p50/p99, responses/s, the router's CPU time per relayed response,
and the ratios the issue sets targets for: TTFT p50 added at 1 stream (at most 1 ms) and
responses/s through the router over direct at 16 streams (at least 0.8). Paths are measured in
rotating rounds so machine noise hits them alike.

    .venv/bin/python bench/stream_router.py [--seconds 3] [--rounds 3] [--tokens 64] [--delay-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc import aio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import cpu_seconds, rotated
from tests.harness import Stack, free_port, wait_for, write_registry
from tests.triton_decoupled import start_standin, stream_request

MODEL = "llm"
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


@dataclass
class Totals:
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    responses: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    errors: int = 0

    def rate(self) -> float:
        return self.responses / self.seconds if self.seconds else 0.0


async def drive(address: str, request: bytes, streams: int, seconds: float, pids: list[int], into: Totals) -> None:
    """``streams`` closed loops of one-request streams for ``seconds``; adds what they measured to ``into``."""
    async with aio.insecure_channel(address) as channel:
        call_stream = channel.stream_stream(STREAM_METHOD)
        await channel.channel_ready()
        end = time.perf_counter() + seconds

        async def loop() -> None:
            while time.perf_counter() < end:
                call = call_stream()
                sent = time.perf_counter()
                await call.write(request)
                await call.done_writing()
                last = None
                try:
                    async for _ in call:
                        now = time.perf_counter()
                        if last is None:
                            into.ttft_s.append(now - sent)
                        else:
                            into.gaps_s.append(now - last)
                        last = now
                        into.responses += 1
                except grpc.RpcError:
                    into.errors += 1

        cpu_before = cpu_seconds(pids)
        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(streams)))
        into.seconds += time.perf_counter() - started
        into.cpu_s += cpu_seconds(pids) - cpu_before


def bare_proxy(port: int, upstream: str, use_uvloop: bool = False) -> None:
    """A bare ``ModelStreamInfer`` pass-through (run in its own process): the least a Python hop costs.
    ``use_uvloop``: on uvloop's event loop instead of asyncio's (uvloop is no dependency of ours; the
    caller checks it is installed)."""

    async def serve() -> None:
        channel = aio.insecure_channel(upstream)
        open_stream = channel.stream_stream(STREAM_METHOD)

        async def relay(requests: Any, context: Any) -> None:
            call = open_stream()

            async def forward() -> None:
                async for request in requests:
                    await call.write(request)
                await call.done_writing()

            forwarder = asyncio.create_task(forward())
            async for response in call:
                await context.write(response)
            await forwarder

        server = aio.server()
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "inference.GRPCInferenceService", {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(relay)}
                )
            ]
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    if use_uvloop:
        importlib.import_module("uvloop").run(serve())
    else:
        asyncio.run(serve())


def ms(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) * 1000 if values else float("nan")


def _serves(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=1)
        except grpc.FutureTimeoutError:
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per path, round and load")
    parser.add_argument("--rounds", type=int, default=3, help="rotating rounds per load")
    parser.add_argument("--tokens", type=int, default=64, help="responses per stream")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="the backend's time per token")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    stack = Stack(tmp)
    bare: multiprocessing.process.BaseProcess | None = None
    try:
        backend = start_standin(stack, MODEL, "v1", "--delay-ms", str(args.delay_ms))
        registry = tmp / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [backend.address]}}})
        router = stack.router(registry, "--log-level", "WARNING")
        assert router.process is not None
        bare_port = free_port()
        bare = multiprocessing.get_context("spawn").Process(target=bare_proxy, args=(bare_port, backend.address))
        bare.start()
        wait_for(lambda: _serves(f"127.0.0.1:{bare_port}"), timeout_s=30, what="the bare pass-through")
        assert bare.pid is not None
        paths = {
            "direct": (backend.address, []),
            "router": (router.address, [router.process.pid]),
            "bare": (f"127.0.0.1:{bare_port}", [bare.pid]),
        }
        request = stream_request("bench", args.tokens, model=MODEL)
        print(
            f"token streams through the router: {args.rounds} rounds x {args.seconds:g} s per path and load; "
            f"{args.tokens} tokens a stream, {args.delay_ms:g} ms a token at the backend; {os.cpu_count()} CPUs\n"
        )
        header = (
            f"{'streams':>7} {'path':<7} {'resp/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'gap p50':>8} {'gap p99':>8} {'+TTFT p50':>10} {'CPU us/resp':>12} {'errors':>6}"
        )
        print(header + "\n" + "-" * len(header))
        for streams in (1, 16):
            totals = {name: Totals() for name in paths}
            for round_index in range(args.rounds):
                for name in rotated(list(paths), round_index):
                    address, pids = paths[name]
                    asyncio.run(drive(address, request, streams, args.seconds, pids, totals[name]))
            direct = totals["direct"]
            for name, t in totals.items():
                added = "" if name == "direct" else f"{ms(t.ttft_s, 0.5) - ms(direct.ttft_s, 0.5):10.3f}"
                cpu = "" if name == "direct" else f"{t.cpu_s / max(t.responses, 1) * 1e6:12.0f}"
                print(
                    f"{streams:>7} {name:<7} {t.rate():8.0f} {ms(t.ttft_s, 0.5):9.3f} {ms(t.ttft_s, 0.99):9.3f} "
                    f"{ms(t.gaps_s, 0.5):8.3f} {ms(t.gaps_s, 0.99):8.3f} {added:>10} {cpu:>12} {t.errors:>6}"
                )
            router_totals, bare_totals = totals["router"], totals["bare"]
            if streams == 1:
                added_ttft = ms(router_totals.ttft_s, 0.5) - ms(direct.ttft_s, 0.5)
                floor = ms(bare_totals.ttft_s, 0.5) - ms(direct.ttft_s, 0.5)
                verdict = "ok" if added_ttft <= 1.0 else "OVER the 1 ms target"
                print(
                    f"{'':>7} router adds {added_ttft:.3f} ms to TTFT p50 at 1 stream ({verdict}); "
                    f"the bare pass-through {floor:.3f} ms"
                )
            else:
                ratio = router_totals.rate() / direct.rate() if direct.rate() else float("nan")
                floor = bare_totals.rate() / direct.rate() if direct.rate() else float("nan")
                verdict = "ok" if ratio >= 0.8 else "UNDER the 0.8x target"
                print(
                    f"{'':>7} responses/s through the router: {ratio:.2f}x direct at {streams} streams ({verdict}); "
                    f"the bare pass-through {floor:.2f}x"
                )
            print()
    finally:
        if bare is not None:
            bare.terminate()
            bare.join(timeout=10)
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
