"""The shared service runtime, on real router, recorder and worker processes.

One contract for all three: a taken port or a bad flag value exits 2 with one line on
stderr; SIGTERM drains and exits 0; health Watch streams see NOT_SERVING and end at
once instead of holding the shutdown grace; every listener obeys the configured address.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests import launcher
from tests.harness import ROOT, ServiceProcess, free_port, scrape_metrics, wait_for, write_registry
from tests.models import add_version
from tests.redis_server import RedisServer

MODEL = "affine"
SERVICES = ("router", "recorder", "worker")
PROGS = {"router": "splitstream-router", "recorder": "splitstream-recorder", "worker": "splitstream-worker"}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Services:
    """What each service needs besides the shared server flags (a registry, a Redis URL, a model)."""

    tmp: Path
    redis_url: str = "redis://127.0.0.1:1/0"  # nothing listens there: enough for startup checks
    registry: Path = field(init=False)
    repository: Path = field(init=False)

    def __post_init__(self) -> None:
        self.repository = self.tmp / "models"
        add_version(self.repository, MODEL, "v1", scale=2.0)
        self.registry = self.tmp / "registry.yaml"
        write_registry(self.registry, {MODEL: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}}})

    def own_args(self, service: str) -> list[str]:
        if service == "router":
            return ["--registry", f"file:{self.registry}"]
        if service == "recorder":
            return ["--redis-url", self.redis_url]
        return ["--model-repository", str(self.repository), "--model", MODEL, "--version", "v1"]

    def args(self, service: str, *, port: int, metrics_port: int, extra: tuple[str, ...] = ()) -> list[str]:
        return [
            *self.own_args(service),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            *extra,
        ]

    def run(self, service: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
        return launcher.run(
            [sys.executable, "-m", f"splitstream.{service}", *args],
            env={**clean, **(env or {})},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def process(self, service: str, *extra: str) -> ServiceProcess:
        port = free_port()
        args = self.args(service, port=port, metrics_port=free_port(), extra=extra)
        return ServiceProcess(f"{service}-{port}", f"splitstream.{service}", args, log_dir=self.tmp, port=port)


@pytest.fixture
def services(tmp_path: Path) -> Services:
    return Services(tmp_path)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def started() -> Iterator[list[ServiceProcess]]:
    """Processes a test started; stopped at the end whatever happened."""
    processes: list[ServiceProcess] = []
    yield processes
    for process in processes:
        process.stop()


def taken_port() -> socket.socket:
    """A listening socket on 127.0.0.1 (its port is taken until it is closed)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def one_error_line(result: subprocess.CompletedProcess[str], service: str) -> str:
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{PROGS[service]}: error: "), lines[0]
    return lines[0]


# -- exit codes --------------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_a_taken_grpc_port_exits_2_with_one_line_naming_it(services: Services, service: str) -> None:
    with taken_port() as taken:
        port = taken.getsockname()[1]
        result = services.run(service, services.args(service, port=port, metrics_port=free_port()))
    line = one_error_line(result, service)
    assert f"127.0.0.1:{port}" in line
    assert "in use" in line


@pytest.mark.parametrize("service", SERVICES)
def test_a_taken_metrics_port_exits_2_with_one_line_naming_it(services: Services, service: str) -> None:
    with taken_port() as taken:
        metrics_port = taken.getsockname()[1]
        result = services.run(service, services.args(service, port=free_port(), metrics_port=metrics_port))
    line = one_error_line(result, service)
    assert f"127.0.0.1:{metrics_port}" in line
    assert "--metrics-port" in line


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "70000"),
        ("--metrics-port", "-1"),
        ("--drain-delay-s", "nan"),
        ("--drain-delay-s", "1e300"),
        ("--shutdown-grace-s", "inf"),
        ("--shutdown-grace-s", "-1"),
        ("--log-level", "LOUD"),
        ("--max-message-bytes", "0"),
        ("--host", "no.such.host.invalid"),
        ("--host", "x" * 300),  # a DNS label over 63 characters: IDNA refuses to encode it
        ("--metrics-host", "x" * 300),
    ],
)
def test_an_invalid_server_flag_exits_2_with_one_line_naming_the_flag(
    services: Services, service: str, flag: str, value: str
) -> None:
    args = services.args(service, port=free_port(), metrics_port=free_port(), extra=(flag, value))
    line = one_error_line(services.run(service, args), service)
    assert flag in line


@pytest.mark.parametrize("service", SERVICES)
def test_an_invalid_server_flag_from_the_environment_exits_2_naming_the_flag(services: Services, service: str) -> None:
    variable = f"SPLITSTREAM_{service.upper()}_LOG_LEVEL"
    args = services.args(service, port=free_port(), metrics_port=free_port())
    line = one_error_line(services.run(service, args, env={variable: "loud"}), service)
    assert "--log-level" in line


# -- shutdown ----------------------------------------------------------------------------------


class HealthWatcher:
    """One grpc.health.v1 Watch stream read in a thread: every status seen, and how the stream ended."""

    def __init__(self, address: str) -> None:
        self.statuses: list[int] = []
        self.ended_code: grpc.StatusCode | None = None
        self.ended_at = 0.0
        self._channel = grpc.insecure_channel(address)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        stream = health_pb2_grpc.HealthStub(self._channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
        try:
            for response in stream:
                self.statuses.append(response.status)
            self.ended_code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.ended_code = error.code()
        self.ended_at = time.monotonic()

    def close(self) -> None:
        self._channel.close()
        self._thread.join(timeout=10)


def start_serving(services: Services, service: str, redis: RedisServer, *extra: str) -> ServiceProcess:
    services.redis_url = redis.url
    return services.process(service, *extra).start(timeout_s=60)


@pytest.mark.parametrize("service", SERVICES)
def test_sigterm_drains_and_exits_0_without_a_traceback(
    services: Services, redis: RedisServer, started: list[ServiceProcess], service: str
) -> None:
    process = start_serving(services, service, redis, "--drain-delay-s", "0.1")
    started.append(process)
    process.signal(signal.SIGTERM)
    assert process.wait(timeout_s=30) == 0, process.log()
    log = process.log()
    assert "Traceback" not in log
    assert '"stopped"' in log


@pytest.mark.parametrize("service", SERVICES)
def test_a_health_watch_sees_not_serving_then_ends_at_once_instead_of_holding_the_grace(
    services: Services, redis: RedisServer, started: list[ServiceProcess], service: str
) -> None:
    # A 60 s grace: a Watch stream left open would hold the stop that long.
    process = start_serving(services, service, redis, "--drain-delay-s", "0.3", "--shutdown-grace-s", "60")
    started.append(process)
    watcher = HealthWatcher(process.address)
    try:
        wait_for(lambda: SERVING in watcher.statuses, timeout_s=10, what="the watcher to see SERVING")
        sent = time.monotonic()
        process.signal(signal.SIGTERM)
        wait_for(lambda: watcher.ended_code is not None, timeout_s=15, what="the Watch stream to end")
        assert watcher.ended_code == grpc.StatusCode.OK
        assert watcher.statuses[-1] == NOT_SERVING
        assert watcher.ended_at - sent < 15
        assert process.wait(timeout_s=15) == 0, process.log()
    finally:
        watcher.close()


# -- addresses ---------------------------------------------------------------------------------


def accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except ConnectionRefusedError:
        return False


@pytest.mark.parametrize("service", SERVICES)
def test_the_metrics_endpoint_listens_only_on_the_host_given(
    services: Services, redis: RedisServer, started: list[ServiceProcess], service: str
) -> None:
    """127.0.0.2 is loopback too on Linux: a socket bound to 0.0.0.0 accepts there, one bound to
    127.0.0.1 refuses, so this tells the two apart without needing a second network interface."""
    process = start_serving(services, service, redis)
    started.append(process)
    assert "# HELP" in scrape_metrics(process.metrics_port)
    assert not accepts("127.0.0.2", process.metrics_port)
    assert not accepts("127.0.0.2", process.port)


def test_metrics_host_puts_the_metrics_endpoint_on_its_own_address(
    services: Services, redis: RedisServer, started: list[ServiceProcess]
) -> None:
    process = start_serving(services, "router", redis, "--metrics-host", "127.0.0.3")
    started.append(process)
    assert wait_for(lambda: accepts("127.0.0.3", process.metrics_port), timeout_s=5, what="metrics on 127.0.0.3")
    assert not accepts("127.0.0.1", process.metrics_port)
    assert accepts("127.0.0.1", process.port)


def test_a_router_whose_spool_dir_cannot_be_made_exits_2_with_one_line(services: Services, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the spool directory should be\n")
    extra = ("--recorder", f"127.0.0.1:{free_port()}", "--hmac-key", "k", "--log-dir", str(blocker / "spool"))
    args = services.args("router", port=free_port(), metrics_port=free_port(), extra=extra)
    line = one_error_line(services.run("router", args), "router")
    assert "--log-dir" in line


def test_sigterm_ends_a_service_whose_work_lost_the_first_cancel(tmp_path: Path, started: list[ServiceProcess]) -> None:
    """A loop that swallows one cancel (what ``asyncio.wait_for`` does on 3.11 when the cancel meets a reply)
    must not keep the process up after SIGTERM: the drain cancels again until the work ends."""
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(free_port()), "--drain-delay-s", "0"]
    process = ServiceProcess("lost-cancel", "tests.lost_cancel_service", args, log_dir=tmp_path, port=port)
    started.append(process.start(timeout_s=30))
    process.signal(signal.SIGTERM)
    assert process.wait(timeout_s=20) == 0, process.log()
    log = process.log()
    assert "lost a cancel" in log
    assert "cancelling it again" in log
    assert "stopped" in log
