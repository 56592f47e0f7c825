"""What recording costs the router, counted in instructions rather than seconds.

``bench/recording_overhead.py`` times the router's CPU per call, and on a small shared
machine two identical routers differ by 5-20 % in one run (caches, frequency, the
neighbours' bursts), more than the 5 % the recording target allows. Instructions do
not move with the neighbours: here each router runs under valgrind's callgrind, which
counts every instruction the process executes in user space (all its threads: the
event loop, gRPC's, the log's flusher). The routers start uninstrumented (fast), and
each measured window is bracketed by ``callgrind_control --zero`` and ``--dump``, so
start-up and warm-up are left out. Paths: ``off`` (no recording), ``off'`` (an
identical twin: the noise floor of a count), ``on`` (every call appended to the log;
its child shipper runs natively and is not counted, as it has a core of its own in
production). The same calls are sent to each, in rotated rounds, at each load.

What a count leaves out is the kernel: the append's one ``write`` runs in the kernel,
so the table also gives write syscalls per call from ``/proc/PID/io`` (``syscw``);
``bench/recording_overhead.py`` times kernel and user CPU together.

    .venv/bin/python bench/recording_instructions.py [--calls 1000] [--rounds 2]

Needs valgrind (Debian: apt-get install valgrind); about 2 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.loadgen import METHOD, infer_request, rotated
from bench.recording_overhead import MODEL, start_backend
from tests.harness import ROOT, ServiceProcess, Stack, free_port, wait_for, write_registry
from tests.redis_server import RedisServer


class CountedRouter(ServiceProcess):
    """A router under callgrind with instrumentation off until the first window."""

    def __init__(self, name: str, args: list[str], *, log_dir: Path, port: int) -> None:
        super().__init__(name, "splitstream.router", args, log_dir=log_dir, port=port)
        self.counts = log_dir / f"{name}.callgrind"
        self._instrumented = False

    def start(self, *, wait_serving: bool = True, timeout_s: float = 300.0) -> CountedRouter:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={self.counts}",
            sys.executable,
            "-m",
            self._module,
            *self._args,
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self._env, cwd=ROOT)
        if wait_serving:
            self.wait_serving(timeout_s=timeout_s)
        return self

    def _control(self, *flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, str(self.pid)], check=True, capture_output=True)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def zero(self) -> None:
        if not self._instrumented:
            self._control("--instr=on")
            self._instrumented = True
        self._control("--zero")

    def dump(self) -> int:
        """Instructions since the last :meth:`zero` (callgrind writes each dump to its own numbered file)."""
        before = set(self.counts.parent.glob(f"{self.counts.name}.*"))
        self._control("--dump")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(self.counts.parent.glob(f"{self.counts.name}.*")) - before
            for path in new:
                for line in path.read_text(errors="replace").splitlines():
                    if line.startswith("totals:"):
                        return int(line.split()[1])
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: callgrind wrote no dump")

    def idle_per_s(self, seconds: float) -> float:
        """Instructions a second with no call: under callgrind a call takes ~15x its time, so the background
        work of a window is ~15x what it is per call natively, and is subtracted."""
        self.zero()
        started = time.monotonic()
        time.sleep(seconds)
        instructions = self.dump()
        return instructions / (time.monotonic() - started)


@dataclass
class Counts:
    calls: int = 0
    instructions: int = 0
    seconds: float = 0.0
    windows: list[float] = field(default_factory=list)

    @property
    def per_call(self) -> float:
        return self.instructions / self.calls

    def busy_per_call(self, idle_per_s: float) -> float:
        """Per call, less what the router does anyway in that time (timers, health checks, its flusher)."""
        return (self.instructions - idle_per_s * self.seconds) / self.calls


async def send(address: str, request: bytes, calls: int, concurrency: int) -> None:
    """``calls`` calls, ``concurrency`` at a time, each one's answer checked (a failed call raises)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD)
        left = calls

        async def caller() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await call(request, timeout=300)

        await asyncio.gather(*(caller() for _ in range(concurrency)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000, help="calls per path, round and load")
    parser.add_argument("--rounds", type=int, default=2, help="rotated rounds per load")
    parser.add_argument("--loads", default="1,32", help="comma-separated calls in flight")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle window per router (background rate)")
    parser.add_argument("--keep", action="store_true", help="keep the callgrind dumps (printed: where)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("needs valgrind and callgrind_control on PATH (Debian: apt-get install valgrind)")
    loads = [int(x) for x in args.loads.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="splitstream-bench-"))
    redis = RedisServer(tmp / "redis").start()
    stack = Stack(tmp)
    try:
        worker, recorder = start_backend(stack, redis.url)
        registry = tmp / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
        recording = ["--recorder", recorder.address, "--hmac-key", "bench", "--log-dir", str(tmp / "spool")]
        routers: dict[str, CountedRouter] = {}
        for name, extra in (("off", []), ("off'", []), ("on", recording)):
            port = free_port()
            router = CountedRouter(
                f"router-{len(routers)}",
                [
                    *("--registry", f"file:{registry}", "--host", "127.0.0.1", "--port", str(port)),
                    *("--metrics-port", str(free_port()), "--log-level", "WARNING", *extra),
                ],
                log_dir=tmp,
                port=port,
            )
            stack.processes.append(router)
            routers[name] = router.start(wait_serving=False)
        request = infer_request(MODEL)
        for name, router in routers.items():
            router.wait_serving(timeout_s=300)  # started together above: valgrind takes seconds to start each
            wait_for(lambda r=router: _answers(r.address, request), timeout_s=120, what=f"{name} to answer")
            asyncio.run(send(router.address, request, 100, 4))  # warm: connections, the worker pool, caches

        idle = {name: router.idle_per_s(args.idle_seconds) for name, router in routers.items()}
        print(
            f"router instructions per call (callgrind, user space, all threads): {args.calls} calls per window, "
            f"{args.rounds} rotated rounds; request {len(request)} bytes; idle instructions/s (timers, health "
            "checks, flusher): " + ", ".join(f"{name} {rate:,.0f}" for name, rate in idle.items()) + "\n"
        )
        header = (
            f"{'in flight':>9} {'recording':<10} {'instructions/call':>18} {'per round':>22} "
            f"{'less idle':>12} {'ms/call':>8}"
        )
        print(header)
        print("-" * len(header))
        for concurrency in loads:
            counts = {name: Counts() for name in routers}
            for round_index in range(args.rounds):
                for name in rotated(list(routers), round_index):
                    router = routers[name]
                    router.zero()
                    started = time.monotonic()
                    asyncio.run(send(router.address, request, args.calls, concurrency))
                    instructions = router.dump()
                    counts[name].seconds += time.monotonic() - started
                    counts[name].calls += args.calls
                    counts[name].instructions += instructions
                    counts[name].windows.append(instructions / args.calls)
            for name, x in counts.items():
                rounds = " ".join(f"{w:,.0f}" for w in x.windows)
                print(
                    f"{concurrency:>9} {name:<10} {x.per_call:18,.0f} {rounds:>22} "
                    f"{x.busy_per_call(idle[name]):12,.0f} {x.seconds / x.calls * 1e3:8.1f}"
                )
            off = counts["off"]
            for name in ("off'", "on"):
                x = counts[name]
                raw = x.per_call / off.per_call
                busy = x.busy_per_call(idle[name]) / off.busy_per_call(idle["off"])
                added = x.busy_per_call(idle[name]) - off.busy_per_call(idle["off"])
                print(f"{'':>9} {name}/off: {raw:.3f}x, less idle {busy:.3f}x ({added:+,.0f} instructions a call)")
            print()
    finally:
        stack.close()
        redis.stop()
        if args.keep:
            print(f"callgrind dumps kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _answers(address: str, request: bytes) -> bool:
    """Whether a call succeeds yet (a router serves before its pool has seen the worker healthy)."""
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(METHOD)(request, timeout=60)
        except grpc.RpcError:
            return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
