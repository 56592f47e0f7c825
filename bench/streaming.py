"""Token streams: time to first token, inter-token latency and tokens/s, direct to a worker and through the router.

One run, one worker serving the demo's bigram (v1 of demo/language.py, stepped by in-flight
batching, up to 64 sequences a step) and a router in front of it on a file registry; beside them a
worker serving the same model with ``max_batch_size: 1`` ("1 row": one sequence stepped at a time).
For 1 and 16 concurrent streams, each caller opens a ``ModelStreamInfer`` stream, sends one
request for 64 tokens (greedy), reads its 64 responses and starts over, for ``--seconds``; paths
are measured in rotated rounds so machine noise hits them alike. Printed per path: TTFT p50/p99
(request sent → first token), ITL p50/p99 (gap between consecutive tokens of a stream), tokens/s,
the router's CPU per token (from /proc), and the ratios the targets are stated in: router TTFT p50
minus direct at 1 stream (target <= 1 ms) and router tokens/s over direct at 16 streams (target
>= 0.8). Beside the router, "bare" is a bare grpc.aio pass-through in its own process (no routing,
metrics or recording: ``bench/stream_router.py``'s), the floor of any Python gRPC hop here, measured
in the same rounds so the router's figures can be read against it. The direct rows' tokens/s from
1 to 16 streams, and direct over "1 row" at 16 streams, is what in-flight batching buys.

When the router does not serve ModelStreamInfer (it answers UNIMPLEMENTED), its rows are skipped
and the script says so.

``--pin-worker`` puts the workers on the last CPU and everything else (this load generator, the
router, the bare pass-through) on the others, every thread of each process: the worker on its own
core, as a deployment would run it. On a machine with few cores that is a different trade-off, not
a fairer one (the client and the hop then share what is left), so the script says which it ran.

``--bare-uvloop`` adds "bare-uv": the same bare pass-through on uvloop's event loop (``pip install
uvloop`` first; it is no dependency of splitstream), to see what a faster event loop buys a hop.

    .venv/bin/python bench/streaming.py [--seconds 3] [--rounds 3] [--tokens 64] [--pin-worker] [--bare-uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import onnx
from grpc import aio
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import cpu_seconds, rotated
from bench.stream_router import bare_proxy
from demo import language
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from tests.harness import ServiceProcess, Stack, free_port, metric_samples, scrape_metrics, wait_for, write_registry
from tests.streams import generation_request

MODEL = "writer"
METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


@dataclass
class Result:
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0


async def one_stream(call_factory: aio.StreamStreamMultiCallable, request: bytes, tokens: int, into: Result) -> None:
    """One stream, one request; its TTFT and ITLs go ``into`` the result."""
    call = call_factory(timeout=60)
    sent = time.perf_counter()
    await call.write(request)
    await call.done_writing()
    last = sent
    count = 0
    async for data in call:
        now = time.perf_counter()
        response = oip.ModelStreamInferResponse.FromString(data)
        if response.error_message:
            raise RuntimeError(f"stream answered an error: {response.error_message}")
        if count == 0:
            into.ttfts_s.append(now - sent)
        else:
            into.itls_s.append(now - last)
        last = now
        count += 1
    if count != tokens:
        raise RuntimeError(f"expected {tokens} responses, got {count}")
    into.tokens += count


async def drive(address: str, request: bytes, tokens: int, concurrency: int, seconds: float, pids: list[int]) -> Result:
    """``concurrency`` callers, each opening the next stream when the last ended, for ``seconds``."""
    result = Result()
    async with aio.insecure_channel(address) as channel:
        call_factory = channel.stream_stream(METHOD)
        for _ in range(3):  # warm the connection and the path
            await one_stream(call_factory, request, tokens, Result())
        stop_at = time.perf_counter() + seconds
        cpu_before = cpu_seconds(pids) if pids else 0.0

        async def caller() -> None:
            while time.perf_counter() < stop_at:
                await one_stream(call_factory, request, tokens, result)

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - started
        result.cpu_s = (cpu_seconds(pids) - cpu_before) if pids else 0.0
    return result


@dataclass
class Summary:
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    cpu_us_per_token: float
    round_ttft_p50s_ms: list[float]

    @classmethod
    def of(cls, results: list[Result]) -> Summary:
        ttfts = [x for r in results for x in r.ttfts_s]
        itls = [x for r in results for x in r.itls_s]
        tokens = sum(r.tokens for r in results)
        return cls(
            tokens_per_s=tokens / sum(r.wall_s for r in results),
            ttft_p50_ms=float(np.percentile(ttfts, 50)) * 1000,
            ttft_p99_ms=float(np.percentile(ttfts, 99)) * 1000,
            itl_p50_ms=float(np.percentile(itls, 50)) * 1000,
            itl_p99_ms=float(np.percentile(itls, 99)) * 1000,
            cpu_us_per_token=sum(r.cpu_s for r in results) / tokens * 1e6,
            round_ttft_p50s_ms=[float(np.percentile(r.ttfts_s, 50)) * 1000 for r in results],
        )


def with_ballast(directory: Path, *, layers: int, width: int) -> None:
    """Give the version's next-token graph a step cost like a real language model's: ``layers`` MatMuls of
    [width, width] FP32 weights computed from the tokens and added to the logits times 1e-30 (nothing an
    argmax or a sampler can see). Like a transformer's decode step it reads every weight whatever the
    batch, so rows stepped together share that cost; the bigram alone costs microseconds a step, far
    less than streaming its token does."""
    path = directory / "model.onnx"
    model = onnx.load(path)
    graph = model.graph
    rng = np.random.default_rng(0)
    context = graph.input[0].type.tensor_type.shape.dim[1].dim_value
    scale = 1.0 / np.sqrt(width)
    weights = [rng.standard_normal((context, width)).astype(np.float32)]
    weights += [(rng.standard_normal((width, width)) * scale).astype(np.float32) for _ in range(layers)]
    nodes = [helper.make_node("Cast", ["tokens"], ["ballast_0"], to=TensorProto.FLOAT)]
    for index, weight in enumerate(weights):
        graph.initializer.append(numpy_helper.from_array(weight, f"ballast_w{index}"))
        nodes.append(helper.make_node("MatMul", [f"ballast_{index}", f"ballast_w{index}"], [f"ballast_m{index}"]))
        nodes.append(helper.make_node("Tanh", [f"ballast_m{index}"], [f"ballast_{index + 1}"]))
    last = f"ballast_{len(weights)}"
    graph.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "ballast_axes"))
    graph.initializer.append(numpy_helper.from_array(np.array(1e-30, dtype=np.float32), "ballast_scale"))
    nodes.append(helper.make_node("ReduceSum", [last, "ballast_axes"], ["ballast_sum"], keepdims=1))
    nodes.append(helper.make_node("Mul", ["ballast_sum", "ballast_scale"], ["ballast_tiny"]))
    logits = graph.output[0].name
    for node in graph.node:
        node.output[:] = ["ngram_logits" if name == logits else name for name in node.output]
    nodes.append(helper.make_node("Add", ["ngram_logits", "ballast_tiny"], [logits]))
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    onnx.save(model, path)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` (sched_setaffinity on a pid moves only its main thread) to ``cpus``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


def step_totals(worker: ServiceProcess) -> tuple[float, float]:
    """The worker's (sequences stepped, steps) so far, from its step-size histogram."""
    text = scrape_metrics(worker.metrics_port)
    total = sum(value for _, value in metric_samples(text, "splitstream_worker_step_sequences_sum"))
    count = sum(value for _, value in metric_samples(text, "splitstream_worker_step_sequences_count"))
    return total, count


def router_streams(address: str, request: bytes) -> str | None:
    """None when the router serves ModelStreamInfer; otherwise why not."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(METHOD)
        try:
            for data in call(iter([request]), timeout=10):
                response = oip.ModelStreamInferResponse.FromString(data)
                if response.error_message:
                    return f"it answered error_message {response.error_message!r}"
        except grpc.RpcError as error:
            return f"it answered {error.code().name}: {error.details()}"
    return None


def serves(address: str, request: bytes) -> bool:
    return router_streams(address, request) is None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per path, round and load")
    parser.add_argument("--rounds", type=int, default=3, help="rotated rounds per load")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream (max_tokens)")
    parser.add_argument(
        "--ballast-layers",
        type=int,
        default=0,
        help="give each step a language model's cost: this many [width, width] MatMuls (0: the bare bigram)",
    )
    parser.add_argument("--ballast-width", type=int, default=1024, help="width of the ballast MatMuls")
    parser.add_argument(
        "--pin-worker",
        action="store_true",
        help="the workers on the last CPU, the load generator, router and bare pass-through on the others",
    )
    parser.add_argument(
        "--bare-uvloop", action="store_true", help="also measure the bare pass-through on uvloop (bare-uv)"
    )
    args = parser.parse_args()
    if args.bare_uvloop and importlib.util.find_spec("uvloop") is None:
        parser.error("--bare-uvloop needs uvloop installed (pip install uvloop)")
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin_worker and len(cpus) < 2:
        parser.error(f"--pin-worker needs at least 2 CPUs, this process may use {len(cpus)}")

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    repository = tmp / "models"
    language.write_version(repository, MODEL, "v1", order=language.ORDERS["v1"])
    # The same model on a worker that steps one sequence at a time: what in-flight batching is measured against.
    language.write_version(repository, MODEL, "one", order=language.ORDERS["v1"], max_batch_size=1)
    if args.ballast_layers:
        for version in ("v1", "one"):
            with_ballast(repository / MODEL / version, layers=args.ballast_layers, width=args.ballast_width)
    stack = Stack(tmp)
    proxies: list[multiprocessing.process.BaseProcess] = []
    try:
        worker = stack.worker(repository, MODEL, "v1", "--log-level", "WARNING")
        unbatched = stack.worker(repository, MODEL, "one", "--log-level", "WARNING")
        registry = tmp / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
        router = stack.router(registry, "--log-level", "WARNING")
        request = generation_request(MODEL, "The ", args.tokens).SerializeToString()
        paths: dict[str, tuple[str, list[int]]] = {"direct": (worker.address, []), "1 row": (unbatched.address, [])}
        skipped = router_streams(router.address, request)
        if skipped is None:
            paths["router"] = (router.address, [router.process.pid])  # type: ignore[union-attr]
            for name, use_uvloop in [("bare", False)] + [("bare-uv", True)] * args.bare_uvloop:
                port = free_port()
                proxy = multiprocessing.get_context("spawn").Process(
                    target=bare_proxy, args=(port, worker.address, use_uvloop)
                )
                proxy.start()
                proxies.append(proxy)
                address = f"127.0.0.1:{port}"
                wait_for(partial(serves, address, request), timeout_s=30, what=name)
                assert proxy.pid is not None
                paths[name] = (address, [proxy.pid])

        placement = "each process on any CPU"
        if args.pin_worker:
            worker_cpus, other_cpus = {cpus[-1]}, set(cpus[:-1])
            for process in (worker, unbatched):
                assert process.process is not None
                pin(process.process.pid, worker_cpus)
            for pid in [os.getpid()] + [pid for _, pids in paths.values() for pid in pids]:
                pin(pid, other_cpus)
            placement = f"workers pinned to CPU {cpus[-1]}, the rest to CPUs {sorted(other_cpus)}"
        ballast = (
            f" plus {args.ballast_layers} ballast MatMuls of {args.ballast_width}x{args.ballast_width} a step"
            if args.ballast_layers
            else ""
        )
        print(
            f"token streams: {args.rounds} rounds x {args.seconds:g} s per path and load; {args.tokens} tokens a "
            f"stream, greedy, byte bigram (v1){ballast}; {os.cpu_count()} CPUs, {placement}"
        )
        if skipped is not None:
            print(f"router rows skipped: the router does not serve ModelStreamInfer ({skipped})")
        print()
        header = (
            f"{'streams':>7} {'path':<7} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
            f"{'ITL p99':>8} {'+TTFT p50':>10} {'x direct':>9} {'CPU us/token':>13}"
        )
        print(
            "latencies in ms; x direct: tokens/s over the direct path's; CPU: the router's (bare: the pass-through's) "
            "process; 1 row: direct to a worker with max_batch_size 1 (one sequence stepped at a time, the others "
            "wait); bare: a bare Python gRPC pass-through (bare-uv: the same on uvloop)"
        )
        print(header)
        print("-" * len(header))
        direct_rates: dict[int, float] = {}
        for concurrency in (1, 16):
            merged: dict[str, list[Result]] = {name: [] for name in paths}
            stepped_before, steps_before = step_totals(worker)
            for round_index in range(args.rounds):
                for name in rotated(list(paths), round_index):
                    address, pids = paths[name]
                    merged[name].append(
                        asyncio.run(drive(address, request, args.tokens, concurrency, args.seconds, pids))
                    )
            summary = {name: Summary.of(results) for name, results in merged.items()}
            direct = summary["direct"]
            direct_rates[concurrency] = direct.tokens_per_s
            unbatched_rate = summary["1 row"].tokens_per_s
            for name, x in summary.items():
                added = "" if name == "direct" else f"{x.ttft_p50_ms - direct.ttft_p50_ms:10.3f}"
                ratio = "" if name == "direct" else f"{x.tokens_per_s / direct.tokens_per_s:9.2f}"
                cpu = f"{x.cpu_us_per_token:13.0f}" if name in ("router", "bare", "bare-uv") else ""
                print(
                    f"{concurrency:>7} {name:<7} {x.tokens_per_s:9.0f} {x.ttft_p50_ms:9.3f} {x.ttft_p99_ms:9.3f} "
                    f"{x.itl_p50_ms:8.3f} {x.itl_p99_ms:8.3f} {added:>10} {ratio:>9} {cpu:>13}"
                )
            if "router" in summary:
                router_row, bare_row = summary["router"], summary["bare"]
                if concurrency == 1:
                    added_ms = router_row.ttft_p50_ms - direct.ttft_p50_ms
                    verdict = "met" if added_ms <= 1.0 else "MISSED"
                    print(
                        f"{'':>7} target: the router adds at most 1 ms to TTFT p50 at 1 stream: {added_ms:.3f} ms "
                        f"({verdict}); the bare pass-through adds {bare_row.ttft_p50_ms - direct.ttft_p50_ms:.3f} ms"
                    )
                else:
                    times = router_row.tokens_per_s / direct.tokens_per_s
                    verdict = "met" if times >= 0.8 else "MISSED"
                    print(
                        f"{'':>7} target: router tokens/s at 16 streams at least 0.8x direct: {times:.2f}x "
                        f"({verdict}); the bare pass-through {bare_row.tokens_per_s / direct.tokens_per_s:.2f}x"
                    )
            stepped, steps = step_totals(worker)
            mean_step = (stepped - stepped_before) / max(steps - steps_before, 1)
            print(f"{'':>7} the batched worker stepped {mean_step:.1f} sequences a step on average")
            spread = {n: statistics.pstdev(x.round_ttft_p50s_ms) for n, x in summary.items()}
            spreads = ", ".join(f"{n} {v:.3f}" for n, v in spread.items())
            print(f"{'':>7} TTFT p50 spread across rounds (ms): {spreads}")
            print()
        print(
            f"in-flight batching: direct tokens/s at 16 streams is {direct_rates[16] / direct_rates[1]:.1f}x "
            f"that at 1 stream, and {direct_rates[16] / unbatched_rate:.1f}x that of the worker stepping one "
            "sequence at a time (1 row) at 16 streams"
        )
    finally:
        for started in proxies:
            started.terminate()
            started.join(timeout=10)
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
