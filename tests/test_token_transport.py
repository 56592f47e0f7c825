"""The service token never crosses a network in clear: real routers and recorders refuse to start when
it would (exit 2, one line), start when the hop is TLS or stays on the machine, and start as before with
--allow-insecure-token."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from splitstream.common.tls import PLAINTEXT, ClientTls
from tests import launcher
from tests.certs import Pki
from tests.harness import ROOT, Stack, free_port, health_status, running_stack, write_registry
from tests.redis_server import RedisServer
from tests.test_tls import tls_server_args

TOKEN = "transport-token-" + "9" * 32
HMAC_ENV = {"SPLITSTREAM_HMAC_KEY": "transport-test-hmac-key"}
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path) as stack:
        yield stack


def token_taken_safely(tmp_path: Path, name: str) -> list[tuple[list[str], ClientTls]]:
    """The two ways a server beyond loopback may take a credential, as (its flags, how a client reaches it):
    ``--allow-insecure-token``, and TLS with a certificate issued to ``name``."""
    pki = Pki(tmp_path / "pki")
    return [
        (["--allow-insecure-token"], PLAINTEXT),
        (tls_server_args(pki.issue(name)), ClientTls(enabled=True, ca_file=str(pki.ca))),
    ]


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "service-token"
    path.write_text(TOKEN + "\n")
    return path


def run(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return launcher.run(
        [sys.executable, "-m", module, *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False, env={**os.environ, **env},
    )  # fmt: skip


@pytest.mark.slow
def test_a_router_refuses_to_send_its_token_to_a_plaintext_recorder_on_another_host(
    tmp_path: Path, token_file: Path, stack: Stack
) -> None:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {})
    log_dir = ["--log-dir", str(tmp_path / "log")]
    done = run(
        "splitstream.router", "--registry", f"file:{registry}", *log_dir, "--port", "0", "--metrics-port", "0",
        "--recorder", "10.20.30.40:8003", "--service-token-file", str(token_file),
        env=HMAC_ENV,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("splitstream-router: error: --recorder 10.20.30.40:8003: the service token"), last
    assert "--recorder-tls" in last
    assert "--allow-insecure-token" in last
    assert TOKEN not in done.stderr
    # On loopback (the demo, the tests) and with the flag, it starts as before.
    for recorder, extra in (("127.0.0.1:8003", ()), ("10.20.30.40:8003", ("--allow-insecure-token",))):
        router = stack.router(
            registry, *log_dir, "--recorder", recorder, "--service-token-file", str(token_file), *extra, env=HMAC_ENV
        )
        assert health_status(router.address) == SERVING
        router.stop()


@pytest.mark.parametrize("form", ["file", "env"])
@pytest.mark.slow
def test_a_recorder_refuses_a_token_over_plaintext_beyond_loopback(
    tmp_path: Path, token_file: Path, redis_server: RedisServer, stack: Stack, form: str
) -> None:
    token_args = ["--service-token-file", str(token_file)] if form == "file" else []
    env = HMAC_ENV | ({"SPLITSTREAM_SERVICE_TOKEN": TOKEN} if form == "env" else {})
    base = ["--redis-url", redis_server.url, "--metrics-port", "0", "--host", "0.0.0.0", *token_args]
    done = run("splitstream.recorder", *base, "--port", str(free_port()), env=env)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("splitstream-recorder: error: --host 0.0.0.0: the service token would be accepted in clear")
    assert TOKEN not in done.stderr
    for extra, client in token_taken_safely(tmp_path, "recorder"):
        port = free_port()
        recorder = stack.service(
            "recorder", "splitstream.recorder", [*base, "--port", str(port), *extra], port=port, env=env, tls=client
        )
        assert health_status(recorder.address, tls=client) == SERVING
        recorder.stop()


@pytest.mark.slow
def test_a_router_refuses_callers_credentials_over_plaintext_beyond_loopback(tmp_path: Path, stack: Stack) -> None:
    """API keys and JWTs sent to a plaintext router on the network can be read and reused by whoever sees the
    traffic (on both ports: the HTTP front door serves the same TLS as gRPC)."""
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {})
    principals = tmp_path / "principals.yaml"
    principals.write_text("principals: {}\n")
    auth = ["--auth-principals", f"file:{principals}"]
    done = run(
        "splitstream.router", "--registry", f"file:{registry}", "--host", "0.0.0.0", "--port", "0", "--metrics-port",
        "0", *auth, env={},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("splitstream-router: error: --auth-principals: callers' API keys and JWTs would be "), last
    assert "--grpc-use-ssl" in last
    assert "--allow-insecure-token" in last
    for extra, client in token_taken_safely(tmp_path, "router"):
        port = free_port()
        router = stack.service(
            "router",
            "splitstream.router",
            ["--registry", f"file:{registry}", "--host", "0.0.0.0", "--port", str(port), "--metrics-port", "0",
             *auth, *extra],
            port=port,
            tls=client,
        )  # fmt: skip
        assert health_status(router.address, tls=client) == SERVING
        router.stop()
