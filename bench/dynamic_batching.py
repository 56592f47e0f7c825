"""What dynamic batching buys a worker: the same model served with it on and off.

Builds an MLP (``--layers`` MatMul+Relu of ``--width`` x ``--width``, FP32),
starts two workers on it (batching on: max_batch_size 32 and a
``--delay-us`` queue delay; off: each request runs alone; both with one
instance and one intra-op thread), drives each with ``--concurrency``
one-row requests in flight from a grpc.aio client, and prints throughput,
p50, p99 and the mean rows per backend run (from the worker's own batch-size
histogram). Workers are measured in alternating rounds so machine noise hits
both alike. The client shares the machine with the worker: on a small
machine its CPU use caps both rows alike, so read the ratio.

    .venv/bin/python bench/dynamic_batching.py [--seconds 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from grpc import aio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.mlp import mlp_model
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from tests.harness import Stack, free_port, metric_samples, scrape_metrics
from tests.tensors import add_raw_input

MODEL = "mlp"
METHOD = "/inference.GRPCInferenceService/ModelInfer"
MAX_BATCH_SIZE = 32


def add_mlp_version(repository: Path, version: str, *, width: int, layers: int, batching: dict[str, object]) -> None:
    directory = repository / MODEL / version
    mlp_model(directory / "model.onnx", width=width, layers=layers)
    config = {
        "backend": "onnxruntime",
        "max_batch_size": MAX_BATCH_SIZE,
        "dynamic_batching": batching,
        "instance_count": 1,
        "intra_op_threads": 1,
    }
    (directory / "config.yaml").write_text(yaml.safe_dump(config))


@dataclass
class Run:
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    batches: float = 0.0
    rows: float = 0.0


def batch_totals(metrics_port: int) -> tuple[float, float]:
    text = scrape_metrics(metrics_port)
    count = sum(v for _, v in metric_samples(text, "splitstream_worker_batch_size_count"))
    rows = sum(v for _, v in metric_samples(text, "splitstream_worker_batch_size_sum"))
    return count, rows


async def drive(address: str, metrics_port: int, request: bytes, concurrency: int, seconds: float) -> Run:
    run = Run()
    async with aio.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD)
        await asyncio.gather(*(call(request, timeout=10) for _ in range(concurrency)))  # warm every path
        batches_before, rows_before = await asyncio.to_thread(batch_totals, metrics_port)
        stop_at = time.perf_counter() + seconds

        async def closed_loop() -> None:
            while time.perf_counter() < stop_at:
                start = time.perf_counter()
                await call(request, timeout=10)
                run.latencies_s.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(closed_loop() for _ in range(concurrency)))
        run.wall_s = time.perf_counter() - started
        batches_after, rows_after = await asyncio.to_thread(batch_totals, metrics_port)
    run.batches = batches_after - batches_before
    run.rows = rows_after - rows_before
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per worker and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per worker")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--width", type=int, default=256, help="MatMul size (width x width)")
    parser.add_argument("--layers", type=int, default=4, help="MatMul+Relu layers")
    parser.add_argument("--delay-us", type=int, default=1000, help="max_queue_delay_us with batching on")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    repository = tmp / "models"
    variants = {
        "on": {"enabled": True, "max_queue_delay_us": args.delay_us},
        "off": {"enabled": False},
    }
    for version, batching in variants.items():
        add_mlp_version(repository, version, width=args.width, layers=args.layers, batching=batching)
    request = oip.ModelInferRequest(model_name=MODEL)
    add_raw_input(request, "x", np.ones((1, args.width), dtype=np.float32))
    payload = request.SerializeToString()

    stack = Stack(tmp)
    try:
        workers = {}
        for version in variants:
            metrics_port = free_port()
            worker = stack.worker(repository, MODEL, version, "--metrics-port", str(metrics_port), start=False)
            workers[version] = (worker.start(wait_serving=False), metrics_port)
        for worker, _ in workers.values():
            worker.wait_serving(timeout_s=60)

        runs: dict[str, list[Run]] = {version: [] for version in variants}
        for _ in range(args.rounds):
            for version, (worker, metrics_port) in workers.items():
                runs[version].append(
                    asyncio.run(drive(worker.address, metrics_port, payload, args.concurrency, args.seconds))
                )

        print(
            f"dynamic batching: MLP {args.layers} x MatMul {args.width}x{args.width} FP32, one row per request, "
            f"{args.concurrency} in flight, {args.rounds} rounds x {args.seconds:g} s per worker, "
            f"{os.cpu_count()} CPUs; worker: 1 instance, 1 intra-op thread, max_batch_size {MAX_BATCH_SIZE}, "
            f"max_queue_delay_us {args.delay_us} when on\n"
        )
        header = f"{'batching':<9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'rows/run':>9}"
        print(header)
        print("-" * len(header))
        rates = {}
        for version, results in runs.items():
            latencies = np.array([x for r in results for x in r.latencies_s])
            rates[version] = len(latencies) / sum(r.wall_s for r in results)
            batches = sum(r.batches for r in results)
            mean_rows = sum(r.rows for r in results) / batches if batches else float("nan")
            p50, p99 = (float(np.percentile(latencies, q)) * 1000 for q in (50, 99))
            print(f"{version:<9} {rates[version]:8.0f} {p50:8.2f} {p99:8.2f} {mean_rows:9.1f}")
        print(f"\nthroughput on/off: {rates['on'] / rates['off']:.2f}x")
    finally:
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
