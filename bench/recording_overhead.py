"""What recording costs the client: the same load through a router with recording off and on.

One run: a worker, a recorder on its own redis-server, and two routers in front
of the worker, identical except that one records every call (it appends each to
its write-ahead log; its child splitstream-shipper ships the log to the recorder).
At one call in flight the paths are taken in turn call by call, and at 32 every path is driven at
once with 32 callers of its own, so that each sees the same moments of a noisy machine
(``--blocks``: each path measured for ``--seconds`` in turn, in rotated rounds). The
table gives throughput, p50, p99, router CPU per call (the router process alone),
and the on/off ratios (router CPU also as the difference in µs per call, to set beside what an
append costs in place: see docs/benchmarks.md). Targets: p50 and p99 on/off at most 1.05x and within 0.02
of the noise floor off'/off (``--noise-floor``); router CPU per call on/off at most
1.05x. The shipper's CPU per record is printed on its own line: in production it
runs on a core of its own, and here it runs with the recorder (see below).

In production the recorder and Redis have hosts of their own. Here they would
share the cores of client, router and worker, and their CPU bursts would show
in the client's p99 although the router's own cost is small, so by default
(``--recorder-cpu separate``) they run on a core of their own and everything
else on the rest; ``idle`` and ``shared`` put them on the same cores under
SCHED_IDLE or at equal priority; the recording routers' shippers go with them.
``--intervals-ms 200,1000`` adds one recording router per batch interval, measured side by side.

    .venv/bin/python bench/recording_overhead.py [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncio

from bench.loadgen import Result, Summary, drive_alternating, drive_together, infer_request, measure
from tests.harness import ServiceProcess, Stack, free_port, write_registry
from tests.models import add_version
from tests.redis_server import RedisServer

MODEL = "bench"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per path, round and load")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per load")
    parser.add_argument(
        "--recorder-cpu",
        choices=("separate", "idle", "shared"),
        default="separate",
        help="where the recorder and redis-server run. separate: on a core of their own (the last one), everything "
        "else on the others, standing in for the separate hosts they have in production; idle: on the same cores "
        "as client, router and worker but under SCHED_IDLE; shared: the same cores at equal priority",
    )
    parser.add_argument(
        "--intervals-ms",
        default="",
        help="comma-separated --record-batch-interval-ms values: one recording router each, measured side by side "
        "(default: the router's own default only)",
    )
    parser.add_argument(
        "--noise-floor",
        action="store_true",
        help='add a second router with recording off ("off\'"): its ratios to "off" show how far two identical '
        "paths differ in this run, i.e. how much of an on/off ratio is noise",
    )
    parser.add_argument(
        "--blocks",
        action="store_true",
        help="measure each path for --seconds in turn, in rotated rounds, rather than taking the paths in turn call "
        "by call (1 in flight) or driving them all at once (32 in flight)",
    )
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    recorder_cores = set(cores[-1:])
    if args.recorder_cpu == "separate":
        if len(cores) < 2:
            parser.error("--recorder-cpu separate needs at least two CPUs")
        os.sched_setaffinity(0, set(cores[:-1]))  # inherited by every process started below

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    redis = RedisServer(tmp / "redis").start()
    stack = Stack(tmp)
    try:
        worker, recorder = start_backend(stack, redis.url)
        for pid in (recorder.process.pid, redis.process.pid):  # type: ignore[union-attr]
            if args.recorder_cpu == "idle":
                os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
            elif args.recorder_cpu == "separate":
                for thread in Path(f"/proc/{pid}/task").iterdir():  # affinity is per thread; theirs exist by now
                    os.sched_setaffinity(int(thread.name), recorder_cores)
        registry = tmp / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
        plain = stack.router(registry, "--log-level", "WARNING", name="router-plain")
        paths = {"off": (plain.address, [plain.process.pid])}  # type: ignore[union-attr]
        if args.noise_floor:
            twin = stack.router(registry, "--log-level", "WARNING", name="router-plain-twin")
            paths["off'"] = (twin.address, [twin.process.pid])  # type: ignore[union-attr]
        shippers: list[int] = []
        intervals: list[float | None] = [float(x) for x in args.intervals_ms.split(",") if x.strip()] or [None]
        for interval in intervals:
            name = "on" if interval is None else f"on {interval:g}ms"
            extra = [] if interval is None else ["--record-batch-interval-ms", str(interval)]
            recording = stack.router(
                registry,
                "--log-level",
                "WARNING",
                "--recorder",
                recorder.address,
                "--hmac-key",
                "bench",
                "--log-dir",
                str(tmp / f"spool-{len(paths)}"),
                *extra,
                name=f"router-recording-{len(paths)}",
            )
            paths[name] = (recording.address, [recording.process.pid])  # type: ignore[union-attr]
            shippers.append(shipper_pid(tmp / f"spool-{len(paths) - 1}"))
        for pid in shippers:
            if args.recorder_cpu == "idle":
                os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
            elif args.recorder_cpu == "separate":
                for thread in Path(f"/proc/{pid}/task").iterdir():
                    os.sched_setaffinity(int(thread.name), recorder_cores)
        shipper_cpu_before = sum(cpu_seconds(pid) for pid in shippers)
        payload = infer_request(MODEL)
        print(
            f"recording overhead: {args.rounds} rounds x {args.seconds:g} s per path and load; "
            f"request {len(payload)} bytes; recorder and redis-server CPU: {args.recorder_cpu}\n"
        )
        header = f"{'in flight':>9} {'recording':<11} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/call':>12}"
        print(header)
        print("-" * len(header))
        for concurrency in (1, 32):
            if args.blocks:
                summary = measure(paths, payload, concurrency=concurrency, seconds=args.seconds, rounds=args.rounds)
            elif concurrency == 1:
                summary = alternating(paths, payload, seconds=args.seconds, rounds=args.rounds)
            else:
                summary = together(paths, payload, concurrency, seconds=args.seconds, rounds=args.rounds)
            for name, x in summary.items():
                print(
                    f"{concurrency:>9} {name:<11} {x.rate:9.0f} {x.p50_ms:8.3f} {x.p99_ms:8.3f} "
                    f"{x.cpu_us_per_call:12.0f}"
                )
            off = summary["off"]
            for name, on in summary.items():
                if name != "off":
                    print(
                        f"{'':>9} {name}/off: throughput {on.rate / off.rate:.2f}x, p50 {on.p50_ms / off.p50_ms:.2f}x, "
                        f"p99 {on.p99_ms / off.p99_ms:.2f}x, "
                        f"router CPU/call {on.cpu_us_per_call / off.cpu_us_per_call:.2f}x "
                        f"({on.cpu_us_per_call - off.cpu_us_per_call:+.0f} us)"
                    )
            print()
        client = redis.client()
        written = wait_shipped(client, f"splitstream:calls:{MODEL}")
        print(f"records in Redis after the run: {written}")
        shipper_cpu = sum(cpu_seconds(pid) for pid in shippers) - shipper_cpu_before
        if written:
            print(
                f"shipper CPU per record: {shipper_cpu / written * 1e6:.0f} us "
                f"({shipper_cpu:.2f} s for {written} records; its own process, beside the router)"
            )
    finally:
        stack.close()
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def start_backend(stack: Stack, redis_url: str) -> tuple[ServiceProcess, ServiceProcess]:
    """The worker of the bench's model and a recorder writing to ``redis_url``, logging warnings only (the
    recording benches share them: this one and bench/recording_instructions.py)."""
    repository = stack.tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0, config={"dynamic_batching": {"enabled": False}})
    worker = stack.worker(repository, MODEL, "v1")
    port = free_port()
    recorder = stack.service(
        "recorder",
        "splitstream.recorder",
        [
            *("--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0"),
            *("--redis-url", redis_url, "--log-level", "WARNING"),
        ],
        port=port,
    )
    return worker, recorder


def alternating(paths: dict[str, tuple[str, list[int]]], payload: bytes, *, seconds: float, rounds: int) -> dict:
    """One call in flight, the paths taken in turn call by call, ``rounds`` runs of ``seconds`` per path."""
    return merged_rounds(rounds, lambda: drive_alternating(paths, payload, seconds * len(paths)))


def together(
    paths: dict[str, tuple[str, list[int]]], payload: bytes, concurrency: int, *, seconds: float, rounds: int
) -> dict:
    """``concurrency`` callers per path, every path at once, ``rounds`` runs of ``seconds``."""
    return merged_rounds(rounds, lambda: drive_together(paths, payload, concurrency, seconds))


def merged_rounds(rounds: int, drive: Callable[[], Coroutine[Any, Any, dict[str, Result]]]) -> dict[str, Summary]:
    """``drive`` run ``rounds`` times, each path's results merged."""
    merged: dict[str, list[Result]] = {}
    for _ in range(rounds):
        for name, result in asyncio.run(drive()).items():
            merged.setdefault(name, []).append(result)
    return {name: Summary.of(results) for name, results in merged.items()}


def shipper_pid(log_dir: Path, timeout_s: float = 30.0) -> int:
    """The pid of the shipper shipping ``log_dir`` (it writes it into the log's lock file)."""
    deadline = time.monotonic() + timeout_s
    lock = log_dir / "shipper.lock"
    while time.monotonic() < deadline:
        text = lock.read_text() if lock.exists() else ""
        if text.strip():
            return int(text)
        time.sleep(0.05)
    raise TimeoutError(f"no shipper locked {log_dir}")


def cpu_seconds(pid: int) -> float:
    """User and system CPU a process used so far (/proc/PID/stat, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_shipped(client: object, key: str, quiet_s: float = 1.0, timeout_s: float = 60.0) -> int:
    """The stream's length once it stopped growing for ``quiet_s`` (the shippers caught up)."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        length = int(client.xlen(key))  # type: ignore[attr-defined]
        if length == last:
            return length
        last = length
        time.sleep(quiet_s)
    return last


if __name__ == "__main__":
    raise SystemExit(main())
