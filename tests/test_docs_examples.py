"""Every page's worked example runs, as written, against real processes (tests/doc_examples.py says how a
block is found and run, and what a test may change in it: addresses, paths, and nothing a reader relies on).

A page whose example cannot run here is in :data:`NOT_RUN` with the reason; a page in neither place fails
:func:`test_every_page_has_its_example_run_or_says_why_not`, so a new page cannot skip its example silently.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from tests.doc_examples import Background, Rewrite, block, documents, marked_blocks, page_name, run_block
from tests.harness import InferClient, free_port, make_request, wait_for
from tests.redis_server import RedisServer

#: The marked examples this file runs, page by page.
RUN: dict[str, set[str]] = {
    "rollouts.md": {"serve", "ramp"},
    "recording.md": {"serve", "read"},
}

#: Pages whose worked example is not run here, and why.
NOT_RUN: dict[str, str] = {
    "README.md": "its commands are `make demo` and `make test`: tests/test_demo.py runs the demo's story",
    "development.md": "its commands (make install, make test, make lint) are the test run itself",
    "architecture.md": "its worked example is one call's path in prose, which the end-to-end tests follow",
    "benchmarks.md": "`make bench` measures for minutes; the benchmark scripts are not tests",
    "configuration.md": "generated from the parsers; tests/test_docs.py checks it against them",
    "upgrading.md": "upgrade notes, no worked example",
    # Not marked yet: each of these gets its example run in a later commit of this series.
    "analysis.md": "to do",
    "archive.md": "to do",
    "http.md": "to do",
    "replay.md": "to do",
    "scaling.md": "to do",
    "security.md": "to do",
    "streams.md": "to do",
    "tensorrt.md": "to do",
}


def test_every_page_has_its_example_run_or_says_why_not() -> None:
    pages = {page_name(path) for path in documents()}
    assert set(RUN) & set(NOT_RUN) == set()
    assert pages - set(RUN) - set(NOT_RUN) == set(), "a page with no run example and no reason in NOT_RUN"
    assert (set(RUN) | set(NOT_RUN)) - pages == set(), "RUN or NOT_RUN names a page that is gone"


def test_every_marked_example_is_run_and_every_run_example_is_marked() -> None:
    marked = {page_name(path): set(marked_blocks(path)) for path in documents()}
    assert {page: names for page, names in marked.items() if names} == RUN


# -- shared processes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


def serving(address: str) -> bool:
    from tests.harness import health_status

    return health_status(address) == 1


def wait_serving(background: Background, address: str, timeout_s: float = 60) -> None:
    def up() -> bool:
        background.check_running()
        return serving(address)

    try:
        wait_for(up, timeout_s=timeout_s, what=f"{address} to serve ({background.block.page} {background.block.name})")
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{background.log()}") from None


class DigitsLoad:
    """Calls to the demo's digit classifier from a few threads, each with its own routing key, until stopped."""

    def __init__(self, address: str, threads: int = 2, pause_s: float = 0.01) -> None:
        self.address = address
        self.pause_s = pause_s
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> DigitsLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _run(self) -> None:
        client = InferClient(self.address)
        x = np.zeros((1, 64), dtype=np.float32)
        try:
            while not self._stop.is_set():
                try:
                    client.infer(make_request("digits", x), metadata=[("x-routing-key", uuid.uuid4().hex)])
                    with self._lock:
                        self.ok += 1
                except grpc.RpcError as error:
                    with self._lock:
                        self.errors.append(f"{error.code().name}: {error.details()}")
                self._stop.wait(self.pause_s)
        finally:
            client.close()


@dataclass
class Digits:
    """The rollouts page's deployment, started by its own block: two workers and a router."""

    cwd: Path
    router: str
    metrics: str
    workers: dict[str, str]


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Digits]:
    cwd = tmp_path_factory.mktemp("rollouts")
    ports = {page: str(free_port()) for page in ("9001", "9002", "9101", "9102")}
    router, metrics = free_port(), free_port()
    rewrite = Rewrite(
        {
            **{f"--port {p}": f"--port {ports[p]}" for p in ("9001", "9002")},
            **{f"--metrics-port {p}": f"--metrics-port {ports[p]}" for p in ("9101", "9102")},
            **{f'"127.0.0.1:{p}"': f'"127.0.0.1:{ports[p]}"' for p in ("9001", "9002")},
        }
    )
    # The router of the page is on its default ports (8001, 8002): moved by the flags' variables.
    env = {"SPLITSTREAM_ROUTER_PORT": str(router), "SPLITSTREAM_ROUTER_METRICS_PORT": str(metrics)}
    background = Background(block("rollouts.md", "serve"), cwd, rewrite=rewrite, env=env)
    try:
        for port in ("9001", "9002"):
            wait_serving(background, f"127.0.0.1:{ports[port]}")
        wait_serving(background, f"127.0.0.1:{router}")
        yield Digits(
            cwd,
            f"127.0.0.1:{router}",
            f"127.0.0.1:{metrics}",
            {v: f"127.0.0.1:{ports[p]}" for v, p in [("v1", "9001"), ("v2", "9002")]},
        )
    finally:
        background.stop()


def arm_weights(registry: Path) -> dict[str, float]:
    experiment = yaml.safe_load(registry.read_text())["models"]["digits"]["experiment"]
    return {arm["version"]: arm["weight"] for arm in experiment["arms"]}


# -- rollouts.md --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rollouts_ramps_v2_to_100_percent_while_traffic_flows(digits: Digits) -> None:
    assert arm_weights(digits.cwd / "registry.yaml") == {"v1": 90, "v2": 10}
    # A minute a step on the page; 5 s here, enough for --min-calls (20) of v2's calls at 10 %.
    rewrite = Rewrite({"127.0.0.1:8002": digits.metrics, "--interval 60s": "--interval 5s"})
    with DigitsLoad(digits.router) as load:
        wait_for(lambda: load.ok >= 20, timeout_s=30, what="calls through the router")
        result = run_block(block("rollouts.md", "ramp"), digits.cwd, rewrite=rewrite, timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "promoted: digits" in result.stdout, result.stdout
    assert load.errors == [], (digits.cwd / "example-serve.log").read_text()[-5000:]
    registry = digits.cwd / "registry.yaml"
    assert arm_weights(registry) == {"v2": 100}


# -- recording.md -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_recording_records_every_call_and_redis_cli_reads_the_last_five_back(
    digits: Digits, redis: RedisServer
) -> None:
    recorder, router = free_port(), free_port()
    rewrite = Rewrite(
        {
            "redis://127.0.0.1:6379/0": redis.url,
            "--port 8003 --metrics-port 8004": f"--port {recorder} --metrics-port {free_port()}",
            "--recorder 127.0.0.1:8003": f"--recorder 127.0.0.1:{recorder}",
            "/var/lib/splitstream/spool": "spool",
        }
    )
    env = {"SPLITSTREAM_ROUTER_PORT": str(router), "SPLITSTREAM_ROUTER_METRICS_PORT": str(free_port())}
    background = Background(block("recording.md", "serve"), digits.cwd, rewrite=rewrite, env=env)
    try:
        wait_serving(background, f"127.0.0.1:{router}")
        client = InferClient(f"127.0.0.1:{router}")
        ids = [f"doc-recording-{i}" for i in range(7)]
        for request_id in ids:
            client.infer(make_request("digits", np.zeros((1, 64), dtype=np.float32), request_id=request_id))
        client.close()
        read = block("recording.md", "read")
        reading = Rewrite({"redis://127.0.0.1:6379/0": redis.url})

        def newest_read() -> str | None:
            result = run_block(read, digits.cwd, rewrite=reading)
            assert result.returncode == 0, result.stderr
            return result.stdout if ids[-1] in result.stdout else None

        output = wait_for(newest_read, timeout_s=30, what="the last call in Redis")
    finally:
        background.stop()
    assert (digits.cwd / "spool").is_dir()  # the log directory the page names
    lines = output.splitlines()
    shown = [line for line in lines if line.startswith("doc-recording-")]
    assert shown == ids[:1:-1], output  # the last five, newest first
    assert {"version", "latency_ms", "record"} <= set(lines)  # the readable fields, then the record
