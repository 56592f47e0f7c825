"""Open Inference Protocol load for the benchmark scripts: closed-loop callers, latencies, proxy CPU.

Each caller sends the same serialized request as raw bytes (no per-call
serialization in the client), so the client's own cost stays small and equal
across the paths a benchmark compares.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from grpc import aio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.tls import PLAINTEXT, ClientTls
from tests.tensors import add_raw_input

METHOD = "/inference.GRPCInferenceService/ModelInfer"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of ``pids`` so far (from /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / TICKS


def find_nginx() -> str | None:
    """nginx's binary: on PATH, or where Debian's package puts it (/usr/sbin is off a non-root PATH)."""
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL after 10 s): a bench's paths end together."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def rotated(names: list[str], round_index: int) -> list[str]:
    """The paths in a different order each round, so the order of measuring does not bias a path."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def infer_request(model: str, rows: int = 1, features: int = 4) -> bytes:
    request = oip.ModelInferRequest(model_name=model)
    add_raw_input(request, "x", np.ones((rows, features), dtype=np.float32))
    return request.SerializeToString()


@dataclass
class Result:
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1000


@dataclass
class Summary:
    """Several rounds of one path merged."""

    rate: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_call: float
    round_p50s_ms: list[float]

    @classmethod
    def of(cls, results: list[Result]) -> Summary:
        latencies = [x for r in results for x in r.latencies_s]
        return cls(
            rate=len(latencies) / sum(r.wall_s for r in results),
            p50_ms=float(np.percentile(latencies, 50)) * 1000,
            p99_ms=float(np.percentile(latencies, 99)) * 1000,
            cpu_us_per_call=sum(r.cpu_s for r in results) / len(latencies) * 1e6,
            round_p50s_ms=[r.pct(50) for r in results],
        )


async def drive(
    address: str,
    request: bytes,
    concurrency: int,
    seconds: float,
    pids: list[int],
    tls: ClientTls = PLAINTEXT,
    metadata: tuple[tuple[str, str], ...] = (),
    connections: int = 1,
) -> Result:
    """``concurrency`` callers, each sending the next call when the last returns, for ``seconds``
    (over one channel, so a TLS path pays its handshake once, in the warm-up, as a real client does;
    every call with ``metadata``: a caller's credentials, say). ``connections`` > 1: the callers share
    that many channels, each its own TCP connection, as separate clients would be (a server of several
    processes on one SO_REUSEPORT port gets each connection in one of them)."""
    result = Result()
    options = [("grpc.use_local_subchannel_pool", 1)] if connections > 1 else []
    channels = [tls.aio_channel(address, options) for _ in range(connections)]
    try:
        calls = [channel.unary_unary(METHOD) for channel in channels]
        for call in calls:
            for _ in range(max(1, 50 // connections)):  # warm the connections and the path
                await call(request, timeout=10, metadata=metadata)
        stop_at = time.perf_counter() + seconds
        cpu_before = cpu_seconds(pids) if pids else 0.0

        async def loop(index: int) -> None:
            call = calls[index % connections]
            while time.perf_counter() < stop_at:
                start = time.perf_counter()
                await call(request, timeout=10, metadata=metadata)
                result.latencies_s.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        result.wall_s = time.perf_counter() - started
        result.cpu_s = (cpu_seconds(pids) - cpu_before) if pids else 0.0
    finally:
        for channel in channels:
            await channel.close()
    return result


def measure(
    paths: dict[str, tuple[str, list[int]]],
    request: bytes,
    *,
    concurrency: int,
    seconds: float,
    rounds: int,
    tls: dict[str, ClientTls] | None = None,
    metadata: dict[str, tuple[tuple[str, str], ...]] | None = None,
    connections: int = 1,
) -> dict[str, Summary]:
    """Drive every path (name → (address, pids whose CPU to count)) ``rounds`` times, in a rotated
    order each round, and merge each path's rounds. ``tls``: the client TLS of the paths that need it;
    ``metadata`` per path name, if any; ``connections``: TCP connections the callers share."""
    merged: dict[str, list[Result]] = {name: [] for name in paths}
    for round_index in range(rounds):
        for name in rotated(list(paths), round_index):  # no path always runs first
            address, pids = paths[name]
            security = (tls or {}).get(name, PLAINTEXT)
            headers = (metadata or {}).get(name, ())
            merged[name].append(
                asyncio.run(drive(address, request, concurrency, seconds, pids, security, headers, connections))
            )
    return {name: Summary.of(results) for name, results in merged.items()}


@contextlib.asynccontextmanager
async def warmed_calls(
    paths: dict[str, tuple[str, list[int]]], request: bytes
) -> AsyncIterator[dict[str, aio.UnaryUnaryMultiCallable]]:
    """A channel per path, each warmed with 50 calls (connection, the path's caches), closed on the way out: what
    the side-by-side drivers below share."""
    channels = {name: PLAINTEXT.aio_channel(address, []) for name, (address, _) in paths.items()}
    try:
        calls = {name: channel.unary_unary(METHOD) for name, channel in channels.items()}
        for call in calls.values():
            for _ in range(50):
                await call(request, timeout=10)
        yield calls
    finally:
        for channel in channels.values():
            await channel.close()


def cpu_since(paths: dict[str, tuple[str, list[int]]], before: dict[str, float]) -> dict[str, float]:
    return {name: cpu_seconds(pids) - before[name] for name, (_, pids) in paths.items()}


async def drive_alternating(
    paths: dict[str, tuple[str, list[int]]], request: bytes, seconds: float
) -> dict[str, Result]:
    """One call in flight, the paths taken in turn call by call (each cycle in a rotated order), for
    ``seconds``. Why: measured in blocks of seconds, two identical paths differ by 5-30 % in p50 and p99 on
    a small shared machine, as the neighbours' load drifts between blocks; taken in turn, every path sees
    the same moments, so what differs between them is the path. CPU: each path's ``pids`` over the run,
    per call of that path (their idle work while the others are called included, alike for all)."""
    results = {name: Result() for name in paths}
    async with warmed_calls(paths, request) as calls:
        names = list(paths)
        cpu_before = {name: cpu_seconds(pids) for name, (_, pids) in paths.items()}
        started = time.perf_counter()
        stop_at = started + seconds
        cycle = 0
        while time.perf_counter() < stop_at:
            for name in rotated(names, cycle):
                call = calls[name]
                start = time.perf_counter()
                await call(request, timeout=10)
                results[name].latencies_s.append(time.perf_counter() - start)
            cycle += 1
        wall = time.perf_counter() - started
        for name, cpu in cpu_since(paths, cpu_before).items():
            results[name].cpu_s = cpu
            results[name].wall_s = wall / len(paths)  # each path had a share of the time
    return results


async def drive_together(
    paths: dict[str, tuple[str, list[int]]], request: bytes, concurrency: int, seconds: float
) -> dict[str, Result]:
    """``concurrency`` callers per path, every path driven at once for the same ``seconds``. Why: measured in
    turns of seconds (:func:`measure`), two identical paths at 32 in flight differed by 5-25 % as the
    neighbours' load drifted between turns; driven together, every path sees the same moments, and a path that
    costs more CPU per call on a shared core shows it as lower throughput and higher latency beside the others.
    CPU: each path's ``pids`` over the window, per call of that path."""
    results = {name: Result() for name in paths}
    async with warmed_calls(paths, request) as calls:
        cpu_before = {name: cpu_seconds(pids) for name, (_, pids) in paths.items()}
        started = time.perf_counter()
        stop_at = started + seconds

        async def loop(name: str) -> None:
            call, latencies = calls[name], results[name].latencies_s
            while time.perf_counter() < stop_at:
                start = time.perf_counter()
                await call(request, timeout=30)
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(loop(name) for name in paths for _ in range(concurrency)))
        wall = time.perf_counter() - started
        for name, cpu in cpu_since(paths, cpu_before).items():
            results[name].cpu_s = cpu
            results[name].wall_s = wall
    return results


def grpc_frame(message: bytes) -> bytes:
    """``message`` as gRPC puts it in an HTTP/2 body (uncompressed flag + 4-byte length), for
    HTTP/2 tools that know nothing of gRPC (h2load as a client, nghttpd as a stand-in worker)."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def h2load_drive(
    address: str,
    request: bytes,
    *,
    concurrency: int,
    connections: int,
    seconds: float,
    pids: list[int],
    workdir: Path,
) -> Result:
    """Closed-loop unary calls from h2load (nghttp2's load generator, C): ``connections`` TCP
    connections with ``concurrency // connections`` streams each, for ``seconds``. Why: a Python
    client costs about as much CPU per call as the router, so on a small machine it takes the
    cores the routers should have; h2load costs about 50 µs per call at a few thousand calls/s.

    h2load counts HTTP statuses only, and a gRPC error is HTTP 200 too (its status is in the
    trailers): the caller must check the calls succeeded some other way (the router's
    requests_total by status). Latencies come from h2load's per-request log; ``cpu_s`` is the
    CPU ``pids`` used over the whole run."""
    h2load = shutil.which("h2load")
    if h2load is None:
        raise RuntimeError("h2load is not installed (Debian/Ubuntu: apt-get install nghttp2-client)")
    if concurrency % connections:
        raise ValueError(f"concurrency {concurrency} is not a multiple of connections {connections}")
    body = workdir / "h2load-request.bin"
    body.write_bytes(grpc_frame(request))
    log = workdir / "h2load-requests.tsv"
    log.unlink(missing_ok=True)  # h2load appends to it
    command = [
        h2load,
        *("-c", str(connections), "-m", str(concurrency // connections), "-D", f"{round(seconds * 1000)}ms"),
        *("-d", str(body), "--log-file", str(log)),
        *("-H", "content-type: application/grpc", "-H", "te: trailers"),
        f"http://{address}{METHOD}",
    ]
    cpu_before = cpu_seconds(pids) if pids else 0.0
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    cpu_s = (cpu_seconds(pids) - cpu_before) if pids else 0.0
    counts = re.search(r"requests: (\d+) total, \d+ started, \d+ done, (\d+) succeeded", done.stdout)
    if done.returncode != 0 or counts is None or counts[1] != counts[2]:
        raise RuntimeError(f"h2load failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    # One line per completed request: start (µs since the epoch), HTTP status, duration (µs).
    latencies = [int(line.split("\t")[2]) / 1e6 for line in log.read_text().splitlines() if line]
    return Result(latencies_s=latencies, wall_s=seconds, cpu_s=cpu_s)  # h2load measures over -D seconds
