"""``--processes N`` with ``--http-port``: every child serves HTTP on the same port (SO_REUSEPORT), the
parent's metrics count HTTP calls of all children, and SIGTERM drains HTTP streams in every child.

Real processes: a generating worker and a router parent with two children, called over fresh HTTP
connections (the kernel spreads connections over the children by their addresses)."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from demo import language
from splitstream.common.files import atomic_write
from tests.harness import (
    ServiceProcess,
    Stack,
    free_port,
    metric_samples,
    run_module,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.test_auth import sha256
from tests.test_processes import alive, child_pids, log_events, wait_children_serving
from tests.test_router_http import accepts, events, open_stream

MODEL = "writer"
KEY = f"sk-web-{uuid.uuid4().hex}{uuid.uuid4().hex}"
#: Fresh connections per check: enough that both children get some whatever the kernel's hash does.
CONNECTIONS = 24


@dataclass
class Models:
    stack: Stack
    registry: Path
    principals: Path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Models]:
    tmp = tmp_path_factory.mktemp("http-processes")
    language.write_versions(tmp / "models", MODEL, generation={"max_tokens_limit": 1_000_000})
    principals = tmp / "principals.yaml"
    document = {"principals": {"web": {"api_keys_sha256": [sha256(KEY)], "models": [MODEL]}}}
    atomic_write(principals, yaml.safe_dump(document))
    stack = Stack(tmp)
    try:
        worker = stack.worker(tmp / "models", MODEL, "v1")
        registry = tmp / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
        yield Models(stack, registry, principals)
    finally:
        stack.close()


def start_parent(models: Models, *extra: str) -> tuple[ServiceProcess, int]:
    http_port = free_port()
    router = models.stack.router(models.registry, "--processes", "2", "--http-port", str(http_port), *extra)
    wait_children_serving(router)

    def both_listen_http() -> bool:
        return {e.get("process_index") for e in log_events(router) if e.get("event") == "HTTP listening"} == {0, 1}

    wait_for(both_listen_http, timeout_s=30, what="both children to listen for HTTP")
    return router, http_port


def completion(port: int, headers: dict[str, str]) -> int:
    """One call on a connection of its own; its status."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps({"model": MODEL, "prompt": "The ", "max_tokens": 2})
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json", **headers})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


@pytest.mark.slow
def test_every_child_serves_the_http_port_checked_and_counted_by_the_parent(models: Models) -> None:
    router, port = start_parent(models, "--auth-principals", f"file:{models.principals}")
    statuses = [completion(port, {"Authorization": f"Bearer {KEY}"}) for _ in range(CONNECTIONS)]
    assert statuses == [200] * CONNECTIONS
    refused = [completion(port, {"x-request-id": f"refused-{i}"}) for i in range(CONNECTIONS)]
    assert refused == [401] * CONNECTIONS
    # Each child logs the refusals it answered with its index: both answered some.
    refusals = [e for e in log_events(router) if e.get("event") == "HTTP call refused"]
    assert {e["request_id"] for e in refusals} == {f"refused-{i}" for i in range(CONNECTIONS)}
    assert {e["process_index"] for e in refusals} == {0, 1}
    # The parent's one scrape shows every child's HTTP calls, and their auth counts.
    text = scrape_metrics(router.metrics_port)
    by_status: dict[str, float] = {}
    for labels, value in metric_samples(text, "splitstream_router_http_requests_total"):
        by_status[labels["status"]] = by_status.get(labels["status"], 0) + value
    assert (by_status.get("200"), by_status.get("401")) == (CONNECTIONS, CONNECTIONS)
    allowed = sum(v for _, v in metric_samples(text, "splitstream_router_auth_calls_total"))
    assert allowed == CONNECTIONS


@pytest.mark.slow
def test_sigterm_drains_http_in_every_child_while_a_stream_finishes(models: Models) -> None:
    router, port = start_parent(models)
    pids = set(child_pids(router).values())
    tokens = 20_000  # more than the socket buffers hold: the stream waits on this client while the router drains
    response = open_stream(port, {"model": MODEL, "prompt": "The ", "max_tokens": tokens, "stream": True})
    stream = events(response)
    first = json.loads(next(stream))
    router.signal(signal.SIGTERM)
    wait_for(lambda: not accepts(port), timeout_s=30, what="the HTTP port to stop accepting")
    rest = list(stream)
    assert rest[-1] == "[DONE]"
    chunks = [first, *map(json.loads, rest[:-1])]
    assert len("".join(chunk["choices"][0]["text"] for chunk in chunks)) == tokens
    assert router.wait(timeout_s=60) == 0
    assert not [pid for pid in pids if alive(pid)]
    stopped = {e["index"]: e["code"] for e in log_events(router) if e.get("event") == "child stopped"}
    assert stopped == {0: 0, 1: 0}


def test_an_http_port_already_taken_is_exit_2_in_one_line_before_any_child_starts(models: Models) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_module(
            "splitstream.router",
            *("--registry", f"file:{models.registry}", "--host", "127.0.0.1", "--port", str(free_port())),
            *("--metrics-port", "0", "--processes", "2", "--http-port", str(port)),
        )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        f"splitstream-router: error: cannot listen for HTTP on 127.0.0.1:{port} (--host/--http-port): "
        f"port {port} is already in use"
    )
    assert "child started" not in result.stderr
