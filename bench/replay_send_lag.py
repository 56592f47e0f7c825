"""How precisely ``splitstream-replay`` keeps the recorded pace, and how fast it can go.

One run: a worker and a router in front of it, a redis-server holding synthetic recorded
traffic (one window per rate, calls evenly spaced at 100, 1,000 and 3,000 calls/s, each the
same small request with the worker's real answer recorded), and the real CLI replaying each
window at ``--speed 1`` against the router. Send lag = actual minus planned send time, as the
replayer measures it (summary.json). Each row is followed by a "(bare)" row: the same
sleep-then-spin wait in a process with nothing else to do, run right after, which shows how
late this (shared, 2-core) machine wakes anyone at that moment. Then the router's capacity
(closed loop, 64 in flight, ``bench.loadgen``) against ``--speed max --concurrency 64`` on
the largest window. Target: p99 send lag under 1 ms at 1,000 calls/s.

    .venv/bin/python bench/replay_send_lag.py [--seconds 3] [--rounds 1] [--target router|worker]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import METHOD, drive, infer_request
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import entry_fields, stream_key
from tests.harness import ROOT, Stack, write_registry
from tests.models import add_version
from tests.redis_server import RedisServer
from tests.replays import replay_command

MODEL = "bench"
RATES = (100, 1000, 3000)


def write_window(client: redis.Redis, start_ns: int, rate: int, seconds: float, request: bytes, response: bytes) -> int:
    """``rate * seconds`` records received evenly from ``start_ns``, in the recorder's layout."""
    count = int(rate * seconds)
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        receive_ns = start_ns + i * 1_000_000_000 // rate
        record = recorder_pb2.CallRecord(
            schema_version=1,
            request_id=f"r{rate}-{i}",
            receive_unix_ns=receive_ns,
            model=MODEL,
            version="v1",
            status_code=0,
            latency_ns=1_000_000,
        )
        record.request.inline = request
        record.request.size_bytes = len(request)
        record.response.inline = response
        record.response.size_bytes = len(response)
        # Stream id = receive time, as for a record that reached Redis on time.
        pipe.xadd(stream_key(MODEL), entry_fields(record), id=f"{receive_ns // 1_000_000}-{i}")  # type: ignore[arg-type]
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()
    return count


def replay(redis_url: str, target: str, since_ns: int, until_ns: int, out: Path, *extra: str) -> dict:
    window = (
        "--since",
        f"{since_ns // 10**9}.{since_ns % 10**9:09d}",
        "--until",
        f"{until_ns // 10**9}.{until_ns % 10**9:09d}",
    )
    command = replay_command(
        redis_url, out, "--target", target, *window, "--no-progress", "--max-lateness", "0", *extra, model=MODEL
    )
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    summary: dict = json.loads((out / "summary.json").read_text())
    return summary


def bare_loop_lag_ms(rate: int, seconds: float) -> tuple[float, float, float]:
    """The same sleep-then-spin wait in a bare process with nothing else to do: the floor this machine
    allows right now (a loaded shared machine wakes even this late)."""
    code = (
        "import time, json\n"
        "from splitstream.replayer.schedule import sleep_until\n"
        f"start = time.perf_counter() + 0.05\nlags = []\n"
        f"for i in range({int(rate * seconds)}):\n"
        f"    t = start + i / {rate}\n"
        "    sleep_until(t)\n"
        "    lags.append(time.perf_counter() - t)\n"
        "print(json.dumps(lags))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    lags = np.array(json.loads(done.stdout)) * 1000
    return float(np.percentile(lags, 50)), float(np.percentile(lags, 99)), float(lags.max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each recorded window")
    parser.add_argument("--rounds", type=int, default=1, help="replays per rate")
    parser.add_argument("--rates", default=",".join(map(str, RATES)), help="comma-separated calls/s to replay at")
    parser.add_argument(
        "--target",
        choices=("router", "worker"),
        default="router",
        help="what the timed replays go to (the worker alone absorbs more calls/s than the router here)",
    )
    parser.add_argument("--replay-args", default="", help="extra splitstream-replay arguments (space-separated)")
    args = parser.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    extra = args.replay_args.split()

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    server = RedisServer(tmp / "redis").start()
    stack = Stack(tmp)
    try:
        repository = tmp / "models"
        add_version(repository, MODEL, "v1", scale=2.0, config={"dynamic_batching": {"enabled": False}})
        worker = stack.worker(repository, MODEL, "v1")
        registry = tmp / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
        router = stack.router(registry, "--log-level", "WARNING")
        request = infer_request(MODEL)
        with grpc.insecure_channel(worker.address) as channel:
            response = channel.unary_unary(METHOD)(request, timeout=10)

        client = server.client()
        base_ns = time.time_ns() - 3600 * 10**9  # an hour ago: recorded traffic
        windows = {}
        for n, rate in enumerate(rates):
            start = base_ns + n * int((args.seconds + 10) * 1e9)
            count = write_window(client, start, rate, args.seconds, request, response)
            windows[rate] = (start, start + int(args.seconds * 1e9), count)
        client.close()

        print(
            f"replay send lag at --speed 1 against the {args.target} ({args.seconds:g} s windows, "
            f"{args.rounds} round(s)); (bare): the same wait in an idle process, at the same time\n"
        )
        header = (
            f"{'calls/s':>8} {'calls':>6} {'lag p50 ms':>11} {'lag p99 ms':>11} {'lag max ms':>11} "
            f"{'mismatch':>9} {'errors':>7}"
        )
        print(header)
        print("-" * len(header))
        target = router.address if args.target == "router" else worker.address
        for rate in rates:
            since, until, count = windows[rate]
            for r in range(args.rounds):
                s = replay(server.url, target, since, until, tmp / f"out-{rate}-{r}", "--concurrency", "4096", *extra)
                lag = s["send_lag"]
                print(
                    f"{rate:>8} {s['counts']['completed']:>6} {lag['p50_ms']:>11.3f} {lag['p99_ms']:>11.3f} "
                    f"{lag['max_ms']:>11.3f} {s['outcomes']['mismatch']:>9} {s['status_changes']['ok_to_error']:>7}"
                )
                if s["status_changes"]["transitions"]:
                    print(f"{'':>8} errors: {s['status_changes']['transitions']}")
                p50, p99, worst = bare_loop_lag_ms(rate, args.seconds)
                print(f"{'(bare)':>8} {'':>6} {p50:>11.3f} {p99:>11.3f} {worst:>11.3f}")

        capacity = asyncio.run(drive(router.address, request, 64, args.seconds, []))
        since, until, count = windows[rates[-1]]
        fast = replay(
            server.url, router.address, since, until, tmp / "out-max", "--speed", "max", "--concurrency", "64"
        )
        print(f"\n{'path':<44} {'calls/s':>8}")
        print("-" * 53)
        print(
            f"{'router capacity (closed loop, 64 in flight)':<44} {len(capacity.latencies_s) / capacity.wall_s:>8.0f}"
        )
        print(f"{'splitstream-replay --speed max --concurrency 64':<44} {fast['replay_rate_calls_per_s']:>8.0f}")
        print(f"({fast['counts']['completed']} calls, {fast['outcomes']['mismatch']} mismatched)")
    finally:
        stack.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
