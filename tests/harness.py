"""Start real splitstream processes on free ports and wait until they serve.

Tests talk to these processes over real gRPC, exactly as users do. Each process
writes its log to a file under the test's tmp dir; a failed start shows it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitstream.common.tls import PLAINTEXT, ClientTls
from tests import launcher
from tests.models import add_version

ROOT = Path(__file__).resolve().parent.parent


def clean_env() -> dict[str, str]:
    """This environment without ``SPLITSTREAM_*`` settings (a developer's own would change what a command does)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}


def run_module(module: str, *args: str, cwd: Path = ROOT, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """``python -m <module> <args>`` to its end, text output captured, in :func:`clean_env`: how a test sees
    what a command-line user sees (exit code and stderr lines)."""
    return launcher.run(
        [sys.executable, "-m", module, *args],
        env=clean_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


#: Test ports come from below the kernel's ephemeral range (32768 and up on Linux), so a client socket's
#: port never collides with one a test handed to a server; each pytest-xdist worker has its own share.
_PORT_RANGE_START = 10000
_PORT_RANGE_END = 32000


def _worker_ports() -> Iterator[int]:
    """This test process's ports in turn, round and round: of N xdist workers, ``gw<i>`` takes share i."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    size = (_PORT_RANGE_END - _PORT_RANGE_START) // workers
    first = _PORT_RANGE_START + (index % workers) * size
    # From a random point of the share: two test runs side by side (two checkouts, say) would otherwise
    # walk the same ports in the same order, and one take a port the other just checked was free.
    start = random.randrange(size)
    while True:
        yield from (first + (start + i) % size for i in range(size))


_PORTS = _worker_ports()


def free_port() -> int:
    """A port nothing listens on, not handed out again until this process's share has gone round.

    The kernel may give the same ephemeral port to two binds in a row once the first socket is closed,
    so a worker asked for a gRPC port and a metrics port could have been handed one port twice; ports
    taken in turn from a share of our own cannot, nor can another xdist worker's test take them.
    """
    for port in _PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # something (a server of an earlier test, another program) holds it
                continue
        return port
    raise AssertionError("unreachable: the ports go round for ever")


def listen_args(port: int) -> list[str]:
    """Where a test's server listens: ``--host 127.0.0.1 --port PORT --metrics-port <a free port>``."""
    return ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(free_port())]


def wait_for(condition: Any, *, timeout_s: float, interval_s: float = 0.05, what: str = "condition") -> Any:
    """Poll ``condition()`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
        except Exception as error:  # the condition may raise while a process starts
            last_error = error
        else:
            if value:
                return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what} (last error: {last_error!r})")


def health_status(address: str, service: str = "", timeout_s: float = 1.0, *, tls: ClientTls = PLAINTEXT) -> int:
    with tls.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return int(response.status)


class ServiceProcess:
    """A splitstream service started as a real subprocess (``python -m <module> <args>``)."""

    def __init__(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        *,
        log_dir: Path,
        port: int,
        env: dict[str, str] | None = None,
        tls: ClientTls = PLAINTEXT,
        python: str | None = None,
    ) -> None:
        """``tls``: how the harness reaches it (its health while starting) when it serves TLS; ``python``: the
        interpreter to run it with (another checkout's virtual environment runs that checkout's code)."""
        self.name = name
        self.python = python or sys.executable
        self.tls = tls
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self._module = module
        self._args = list(args)
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def metrics_port(self) -> int:
        """The port of the last ``--metrics-port`` flag it was given (argparse's rule: the last one wins)."""
        flags = [i for i, arg in enumerate(self._args) if arg == "--metrics-port"]
        if not flags:
            raise AttributeError(f"{self.name} was started without --metrics-port")
        return int(self._args[flags[-1] + 1])

    def start(self, *, wait_serving: bool = True, timeout_s: float = 30.0) -> ServiceProcess:
        with open(self.log_path, "ab") as log:
            self.process = launcher.Popen(
                [self.python, "-m", self._module, *self._args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                cwd=ROOT,
            )
        if wait_serving:
            try:
                self.wait_serving(timeout_s=timeout_s)
            except BaseException:
                self.stop()  # a start that failed leaves no process behind
                raise
        return self

    def wait_serving(self, *, timeout_s: float = 30.0) -> None:
        def serving() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
            return health_status(self.address, tls=self.tls) == health_pb2.HealthCheckResponse.SERVING

        try:
            wait_for(serving, timeout_s=timeout_s, what=f"{self.name} to serve")
        except RuntimeError as error:
            raise AssertionError(str(error)) from None
        except TimeoutError as error:
            raise AssertionError(f"{error}\n--- {self.name} log ---\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait()

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        stop_all([self])

    def _terminate(self) -> bool:
        """SIGTERM, without waiting; False when it was not running."""
        if self.process is None or self.process.poll() is not None:
            return False
        self.process.send_signal(signal.SIGTERM)
        return True

    def _reap(self, deadline: float) -> None:
        """Wait for its exit until ``deadline`` (monotonic), then SIGKILL it."""
        assert self.process is not None
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


#: How long a SIGTERMed process gets for its ordered drain before the harness kills it.
STOP_TIMEOUT_S = 15.0


def stop_all(processes: Sequence[ServiceProcess]) -> None:
    """SIGTERM every process at once, then wait for each: their drains (each ``--drain-delay-s`` of serving
    on, then the work in flight) overlap instead of adding up one after another."""
    signalled = [process for process in processes if process._terminate()]
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in signalled:
        process._reap(deadline)


#: What :class:`Stack` gives each worker and router (but a recording one) before a test's own flags: no
#: ``--drain-delay-s`` (0.5 s by default), the time a SIGTERMed server goes on serving so that routers and
#: load balancers see it NOT_SERVING first. Nothing watches a test's processes but the test, and every stop
#: waited it out.
NO_DRAIN_DELAY = ("--drain-delay-s", "0")
#: The services' default drain delay, for a test that stops a worker or router while its callers still
#: send to it (zero failed calls relies on it); given after :data:`NO_DRAIN_DELAY`, it wins (argparse: the
#: last flag does).
DRAIN_DELAY = ("--drain-delay-s", "0.5")


class Stack:
    """Owns every process a test started and stops them all at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.processes: list[ServiceProcess] = []

    def worker(
        self,
        repository: Path,
        model: str,
        version: str,
        *extra: str,
        start: bool = True,
        name: str | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        tls: ClientTls = PLAINTEXT,
    ) -> ServiceProcess:
        port = port or free_port()
        args = [
            "--model-repository",
            str(repository),
            "--model",
            model,
            "--version",
            version,
            *listen_args(port),
            *NO_DRAIN_DELAY,
            *extra,
        ]
        process = ServiceProcess(
            name or f"worker-{model}-{version}-{port}",
            "splitstream.worker",
            args,
            log_dir=self.tmp_path,
            port=port,
            env=env,
            tls=tls,
        )
        self.processes.append(process)
        return process.start() if start else process

    def router(
        self,
        registry: Path | str,
        *extra: str,
        start: bool = True,
        name: str | None = None,
        env: dict[str, str] | None = None,
        tls: ClientTls = PLAINTEXT,
        python: str | None = None,
    ) -> ServiceProcess:
        port = free_port()
        args = [
            "--registry",
            registry if isinstance(registry, str) else f"file:{registry}",  # a Path is a file registry
            *listen_args(port),
            *NO_DRAIN_DELAY,
            *extra,
        ]
        process = ServiceProcess(
            name or f"router-{port}",
            "splitstream.router",
            args,
            log_dir=self.tmp_path,
            port=port,
            env=env,
            tls=tls,
            python=python,
        )
        self.processes.append(process)
        return process.start() if start else process

    def service(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        *,
        port: int,
        env: dict[str, str] | None = None,
        tls: ClientTls = PLAINTEXT,
        start: bool = True,
    ) -> ServiceProcess:
        """Any splitstream server (a recorder, say) started with exactly ``args``."""
        process = ServiceProcess(name, module, args, log_dir=self.tmp_path, port=port, env=env, tls=tls)
        self.processes.append(process)
        return process.start() if start else process

    def close(self) -> None:
        stop_all(self.processes)


@contextlib.contextmanager
def running_stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    try:
        yield stack
    finally:
        stack.close()


def write_registry(path: Path, models: dict[str, Any]) -> None:
    """Write the file registry atomically (write + rename), as a config manager would."""
    staging = path.with_suffix(".tmp")
    staging.write_text(yaml.safe_dump({"models": models}, sort_keys=False))
    staging.replace(path)


def scrape_metrics(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
        return text


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Samples of one metric from Prometheus text exposition (via prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                samples.append((dict(sample.labels), float(sample.value)))
    return samples


def make_request(model: str, x: Any, *, request_id: str = "", version: str = "", typed: bool = False) -> Any:
    """A ModelInferRequest carrying ``x`` as input 'x' (raw contents unless ``typed``)."""
    from splitstream.common.proto.inference import grpc_service_pb2 as oip
    from tests.tensors import add_raw_input, add_typed_input

    request = oip.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    (add_typed_input if typed else add_raw_input)(request, "x", x)
    return request


class InferClient:
    """A blocking Open Inference Protocol client that also returns the response (trailing) metadata."""

    def __init__(self, address: str, *, tls: ClientTls = PLAINTEXT) -> None:
        from splitstream.common.proto.inference import grpc_service_pb2_grpc

        self.channel = tls.channel(address)
        self.stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def infer(
        self, request: Any, *, metadata: Sequence[tuple[str, str]] = (), timeout_s: float = 10.0
    ) -> tuple[Any, dict[str, str]]:
        response, call = self.stub.ModelInfer.with_call(request, metadata=list(metadata), timeout=timeout_s)
        return response, dict(call.trailing_metadata())

    def close(self) -> None:
        self.channel.close()


class SteadyLoad:
    """Closed-loop load from ``threads`` threads until stopped; remembers every call's outcome.

    Each outcome is ``(sent_monotonic, code_name, served_version, request_id)``; every call
    carries its own ``x-request-id``.
    """

    def __init__(
        self, address: str, model: str, *, threads: int = 4, key_prefix: str | None = None, pause_s: float = 0.0
    ) -> None:
        import threading

        import numpy as np

        self._address = address
        self._model = model
        self._threads_n = threads
        self._key_prefix = key_prefix
        self._pause_s = pause_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._run_id = uuid.uuid4().hex[:8]
        self._x = np.ones((1, 4), dtype=np.float32)
        self.outcomes: list[tuple[float, str, str, str]] = []
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> SteadyLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _run(self, index: int) -> None:
        client = InferClient(self._address)
        n = 0
        try:
            while not self._stop.is_set():
                n += 1
                request_id = f"load-{self._run_id}-{index}-{n}"
                metadata = [("x-request-id", request_id)]
                if self._key_prefix is not None:
                    metadata.append(("x-routing-key", f"{self._key_prefix}-{index}-{n}"))
                sent = time.monotonic()
                try:
                    _, headers = client.infer(make_request(self._model, self._x), metadata=metadata)
                    outcome = (sent, "OK", headers.get("x-splitstream-version", ""), request_id)
                except grpc.RpcError as error:
                    outcome = (sent, error.code().name, "", request_id)
                with self._lock:
                    self.outcomes.append(outcome)
                if self._pause_s:
                    time.sleep(self._pause_s)
        finally:
            client.close()

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def errors(self) -> list[tuple[float, str, str, str]]:
        with self._lock:
            return [o for o in self.outcomes if o[1] != "OK"]

    def wait_calls(self, n: int, timeout_s: float = 30.0) -> None:
        start = self.count()
        wait_for(lambda: self.count() >= start + n, timeout_s=timeout_s, what=f"{n} more calls")


@contextlib.contextmanager
def one_version_router(tmp: Path, model: str, *, salt: str, extra: Sequence[str] = ()) -> Iterator[ServiceProcess]:
    """A router in front of one worker serving ``model`` v1 (``y = 2x``), all versions' traffic on v1
    (``extra``: more router flags)."""
    add_version(tmp / "models", model, "v1", scale=2.0)
    stack = Stack(tmp)
    try:
        worker = stack.worker(tmp / "models", model, "v1")
        experiment = {"salt": salt, "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
        write_registry(
            tmp / "registry.yaml", {model: {"endpoints": {"v1": [worker.address]}, "experiment": experiment}}
        )
        yield stack.router(tmp / "registry.yaml", *extra)
    finally:
        stack.close()


def router_status(router: ServiceProcess, model: str = "") -> Any:
    """The router's splitstream.v1.Router/Status (one model's when ``model`` is given: NOT_FOUND if it has none)."""
    from splitstream.common.proto.splitstream.v1 import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(router.address) as channel:
        return router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(model=model), timeout=5)


def registry_healthy(router: ServiceProcess) -> float:
    """``splitstream_router_registry_healthy`` as the router's /metrics shows it now."""
    return metric_samples(scrape_metrics(router.metrics_port), "splitstream_router_registry_healthy")[0][1]
