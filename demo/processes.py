"""Start the demo's processes, wait until each serves, and stop every one of them on the way out.

Both demos (``demo.run``, ``demo.llm``) start the same stack the same way, so they start it here:
a flag a service renames is then renamed once.

Each process logs to ``<workdir>/logs/<name>.log``. The supervisor is a context
manager: leaving it (normally, on an error or on Ctrl-C) stops everything it
started, SIGTERM first, so the services drain and exit as they do in production.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc


def script_path(name: str) -> str:
    """A console script of this environment (beside its Python), else ``name`` as found on PATH."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


T = TypeVar("T")


def fresh_workdir(workdir: Path) -> Path:
    """``workdir`` resolved and emptied: a second run starts afresh, not on the last run's models and logs."""
    workdir = workdir.resolve()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    return workdir


def interruptible(run: Callable[[], T]) -> T | None:
    """``run()``, or None after Ctrl-C: the supervisor has stopped everything by then, so the demo says so."""
    try:
        return run()
    except KeyboardInterrupt:
        print("\ninterrupted: everything the demo started has been stopped")
        return None


def write_registry(workdir: Path, model: str, endpoints: dict[str, str], experiment: dict[str, Any]) -> Path:
    """A file registry of one model, one endpoint per version, split by ``experiment``."""
    registry = workdir / "registry.yaml"
    registry.write_text(
        yaml.safe_dump(
            {"models": {model: {"endpoints": {v: [a] for v, a in endpoints.items()}, "experiment": experiment}}},
            sort_keys=False,
        )
    )
    return registry


def stepper() -> Callable[[str], None]:
    """Numbered, timed progress lines: ``[  3.2s] 4. replaying``."""
    started = time.monotonic()
    count = 0

    def step(message: str) -> None:
        nonlocal count
        count += 1
        print(f"[{time.monotonic() - started:6.1f}s] {count}. {message}", flush=True)

    return step


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Supervisor:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        #: Started, not yet seen serving: name -> (gRPC address, timeout in seconds).
        self._starting: dict[str, tuple[str, float]] = {}

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(
        self, name: str, argv: list[str], *, grpc_address: str | None = None, timeout_s: float = 60, wait: bool = True
    ) -> None:
        """Start ``argv`` (a console script of this venv, or ``redis-server``); wait for grpc health SERVING,
        or with ``wait=False`` leave that to :meth:`wait_started`."""
        executable = shutil.which(argv[0], path=str(Path(sys.executable).parent)) or shutil.which(argv[0])
        if executable is None:
            raise RuntimeError(f"{argv[0]} not found")
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.processes[name] = subprocess.Popen([executable, *argv[1:]], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if grpc_address is not None:
            self._starting[name] = (grpc_address, timeout_s)
            if wait:
                self.wait_started()

    def wait_started(self) -> None:
        """Until every process started with a gRPC address serves. Processes that need nothing of each other
        (the recorder, the workers) are started together and waited for here: each spends seconds importing
        before it serves, and those seconds overlap instead of adding up."""
        while self._starting:
            name = next(iter(self._starting))
            address, timeout_s = self._starting.pop(name)
            self._wait_serving(name, address, timeout_s)

    def start_redis(self, *extra: str) -> str:
        """A redis-server that keeps nothing on disk; returns its URL."""
        port = free_port()
        self.start(
            "redis",
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra],
        )
        return f"redis://127.0.0.1:{port}/0"

    def start_recorder(self, redis_url: str, *extra: str, wait: bool = True) -> str:
        """Returns the recorder's address once it serves (``wait=False``: at once; see :meth:`wait_started`)."""
        address = f"127.0.0.1:{free_port()}"
        argv = ["splitstream-recorder", "--host", "127.0.0.1", "--port", address.split(":")[1]]
        argv += ["--metrics-port", str(free_port()), "--redis-url", redis_url, *extra]
        self.start("recorder", argv, grpc_address=address, wait=wait)
        return address

    def start_worker(self, models: Path, model: str, version: str, *, wait: bool = True) -> str:
        """Returns the worker's address once it serves (``wait=False``: at once; see :meth:`wait_started`)."""
        address = f"127.0.0.1:{free_port()}"
        argv = ["splitstream-worker", "--model-repository", str(models), "--model", model, "--version", version]
        argv += ["--host", "127.0.0.1", "--port", address.split(":")[1], "--metrics-port", str(free_port())]
        self.start(f"worker-{version}", argv, grpc_address=address, wait=wait)
        return address

    def start_router(self, registry: Path, recorder: str, *extra: str, metrics_port: int | None = None) -> str:
        """Returns the router's address once it serves. Records go out in 100 ms batches, so that they are
        in Redis soon after the traffic ends; the spool is ``<workdir>/spool``."""
        address = f"127.0.0.1:{free_port()}"
        argv = ["splitstream-router", "--registry", f"file:{registry}", "--host", "127.0.0.1"]
        argv += ["--port", address.split(":")[1], "--metrics-port", str(metrics_port or free_port())]
        argv += ["--recorder", recorder, *extra, "--log-dir", str(self.workdir / "spool")]
        argv += ["--record-batch-interval-ms", "100"]
        self.start("router", argv, grpc_address=address)
        return address

    def run(
        self, name: str, argv: list[str], *, timeout_s: float, log: str = "", whole_output: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run a command-line step to its end (``argv[0]`` a console script of this venv), its output kept in
        ``logs/<log or name>.log``; raises naming it if it fails, with the tail of its stderr or, with
        ``whole_output``, all it wrote."""
        done = subprocess.run([script_path(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout_s)
        (self.logs / f"{log or name}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            detail = done.stdout + done.stderr if whole_output else done.stderr.strip()[-500:]
            raise RuntimeError(f"{name} exited {done.returncode}: {detail}")
        return done

    def replay(self, redis_url: str, model: str, out: Path, *args: str, timeout_s: float) -> dict[str, Any]:
        """``splitstream-replay`` of ``model``'s records, its report into ``out``; returns its summary.json."""
        argv = ["splitstream-replay", "--redis-url", redis_url, "--model", model, *args]
        self.run("replay", [*argv, "--output-dir", str(out), "--no-progress"], timeout_s=timeout_s)
        summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
        return summary

    def _wait_serving(self, name: str, address: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.processes[name].poll() is not None:
                    raise RuntimeError(f"{name} exited; see {self.logs / (name + '.log')}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"{name} did not start serving within {timeout_s}s; see {self.logs / (name + '.log')}")

    def stop(self, name: str) -> None:
        self._stop_together([name])

    def stop_all(self) -> None:
        """The servers first, all at once (their drains overlap instead of adding up), then redis-server, the
        store the recorder writes into until it has stopped."""
        names = list(reversed(self.processes))
        self._stop_together([name for name in names if name != "redis"])
        self._stop_together([name for name in names if name == "redis"])

    def _stop_together(self, names: list[str]) -> None:
        """SIGTERM each of ``names`` at once; whatever has not exited 20 s later is killed."""
        stopping = [process for name in names if (process := self.processes.pop(name, None)) is not None]
        for process in stopping:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in stopping:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
