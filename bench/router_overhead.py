"""What the router adds to a call, side by side with the direct path and nginx.

One run, same load, same worker: client → worker; client → router → worker;
and, when nginx is installed, client → nginx (grpc_pass, upstream keepalive) →
worker, the reference a user would otherwise pick. For 1 and 64 calls in
flight it prints throughput, p50, p99, each path's added latency over direct,
and the proxy's CPU time per forwarded call (from /proc). Paths are measured
in interleaved rounds so machine noise hits them alike; compare ratios.

    .venv/bin/python bench/router_overhead.py [--seconds 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from grpc import aio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from tests.harness import Stack, free_port, wait_for, write_registry
from tests.models import add_version

MODEL = "bench"
METHOD = "/inference.GRPCInferenceService/ModelInfer"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / TICKS


@dataclass
class Result:
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def calls(self) -> int:
        return len(self.latencies_s)

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1000


async def drive(address: str, request: bytes, concurrency: int, seconds: float, pids: list[int]) -> Result:
    result = Result()
    async with aio.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD)
        for _ in range(50):  # warm the connection and the path
            await call(request, timeout=10)
        stop_at = time.perf_counter() + seconds
        cpu_before = cpu_seconds(pids) if pids else 0.0

        async def loop() -> None:
            while time.perf_counter() < stop_at:
                start = time.perf_counter()
                await call(request, timeout=10)
                result.latencies_s.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - started
        result.cpu_s = (cpu_seconds(pids) - cpu_before) if pids else 0.0
    return result


def start_nginx(tmp: Path, upstream: str) -> tuple[subprocess.Popen[bytes], str, list[int]] | None:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        return None
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream worker {{ server {upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port} http2;
    location / {{ grpc_pass grpc://worker; }}
  }}
}}
""")
    process = subprocess.Popen([nginx, "-p", str(tmp), "-c", str(conf)], stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    wait_for(lambda: _port_open(port), timeout_s=10, what="nginx")
    time.sleep(0.5)  # the master has forked its worker by now
    children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    return process, address, [process.pid, *map(int, children)]


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per path, round and load")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per load")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    repository = tmp / "models"
    add_version(
        repository, MODEL, "v1", scale=2.0, config={"max_batch_size": 8, "dynamic_batching": {"enabled": False}}
    )
    stack = Stack(tmp)
    nginx = None
    try:
        worker = stack.worker(repository, MODEL, "v1")
        registry = tmp / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
        router = stack.router(registry, "--log-level", "WARNING")
        paths: dict[str, tuple[str, list[int]]] = {
            "direct": (worker.address, []),
            "router": (router.address, [router.process.pid]),  # type: ignore[union-attr]
        }
        nginx = start_nginx(tmp, worker.address)
        if nginx is not None:
            paths["nginx"] = (nginx[1], nginx[2])

        request = oip.ModelInferRequest(model_name=MODEL)
        tensors.add_raw_input(request, "x", np.ones((1, 4), dtype=np.float32))
        payload = request.SerializeToString()

        print(
            f"router overhead: {args.rounds} rounds x {args.seconds:g} s per path and load; "
            f"{os.cpu_count()} CPUs; nginx {'on' if nginx else 'not installed'}\n"
        )
        header = (
            f"{'in flight':>9} {'path':<7} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'+p50 ms':>8} {'+p99 ms':>8} {'CPU us/call':>12}"
        )
        print(header)
        print("-" * len(header))
        for concurrency in (1, 64):
            merged: dict[str, list[Result]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, (address, pids) in paths.items():
                    merged[name].append(asyncio.run(drive(address, payload, concurrency, args.seconds, pids)))
            summary: dict[str, dict[str, Any]] = {}
            for name, results in merged.items():
                latencies = [x for r in results for x in r.latencies_s]
                calls = len(latencies)
                summary[name] = {
                    "rate": calls / sum(r.wall_s for r in results),
                    "p50": float(np.percentile(latencies, 50)) * 1000,
                    "p99": float(np.percentile(latencies, 99)) * 1000,
                    "cpu": sum(r.cpu_s for r in results) / calls * 1e6 if paths[name][1] else float("nan"),
                    "p50s": [r.pct(50) for r in results],
                }
            direct = summary["direct"]
            for name, s in summary.items():
                added50 = "" if name == "direct" else f"{s['p50'] - direct['p50']:8.3f}"
                added99 = "" if name == "direct" else f"{s['p99'] - direct['p99']:8.3f}"
                cpu = "" if name == "direct" else f"{s['cpu']:12.0f}"
                print(
                    f"{concurrency:>9} {name:<7} {s['rate']:9.0f} {s['p50']:8.3f} {s['p99']:8.3f} "
                    f"{added50:>8} {added99:>8} {cpu:>12}"
                )
            spread = {n: statistics.pstdev(s["p50s"]) for n, s in summary.items()}
            print(f"{'':>9} p50 spread across rounds (ms): " + ", ".join(f"{n} {v:.3f}" for n, v in spread.items()))
            print()
    finally:
        if nginx is not None:
            nginx[0].terminate()
            nginx[0].wait(timeout=10)
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
