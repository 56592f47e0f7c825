"""Start the demo's processes, wait until each serves, and stop every one of them on the way out.

Each process logs to ``<workdir>/logs/<name>.log``. The supervisor is a context
manager: leaving it (normally, on an error or on Ctrl-C) stops everything it
started, SIGTERM first, so the services drain and exit as they do in production.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def script_path(name: str) -> str:
    """A console script of this environment (beside its Python), else ``name`` as found on PATH."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


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
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str], *, grpc_address: str | None = None, timeout_s: float = 60) -> None:
        """Start ``argv`` (a console script of this venv, or ``redis-server``); wait for grpc health SERVING."""
        executable = shutil.which(argv[0], path=str(Path(sys.executable).parent)) or shutil.which(argv[0])
        if executable is None:
            raise RuntimeError(f"{argv[0]} not found")
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.processes[name] = subprocess.Popen([executable, *argv[1:]], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if grpc_address is not None:
            self._wait_serving(name, grpc_address, timeout_s)

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
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def stop_all(self) -> None:
        for name in reversed(list(self.processes)):
            self.stop(name)
