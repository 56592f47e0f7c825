"""Protected mode on real processes: a router, recorder or worker reachable from other hosts in plaintext with
no caller authentication refuses to start unless told ``--insecure``; a worker with
``--allowed-client-identities`` serves only the routers it names; ``/metrics`` stays on loopback unless
``--metrics-host`` says otherwise."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from splitstream.common.loopback import is_loopback_host
from splitstream.common.tls import ClientTls
from tests import launcher
from tests.certs import Issued, Pki
from tests.harness import (
    ROOT,
    InferClient,
    ServiceProcess,
    Stack,
    free_port,
    health_status,
    make_request,
    running_stack,
    wait_for,
    write_registry,
)
from tests.models import add_version
from tests.redis_server import RedisServer

MODEL = "affine"
SERVING = health_pb2.HealthCheckResponse.SERVING
HMAC_ENV = {"SPLITSTREAM_HMAC_KEY": "protected-mode-hmac-key"}
WARNING = "any caller is served"


def non_loopback_ip() -> str:
    """This machine's first non-loopback IPv4 address, or "" when it has none."""
    try:
        out = launcher.run(["hostname", "-I"], capture_output=True, text=True, timeout=5, check=False).stdout
    except OSError:
        return ""
    return next((a for a in out.split() if "." in a and not is_loopback_host(a)), "")


#: Where the refusal is tried: the machine's own address when it has one, and the old default.
HOSTS = [h for h in (non_loopback_ip(), "0.0.0.0") if h]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path) as stack:
        yield stack


def server_args(service: str, tmp_path: Path, redis_url: str) -> tuple[str, list[str]]:
    """The module and the flags (all but where it listens) of a minimal router, recorder or worker."""
    if service == "router":
        registry = tmp_path / "registry.yaml"
        write_registry(registry, {})
        return "splitstream.router", ["--registry", f"file:{registry}", "--log-dir", str(tmp_path / "log")]
    if service == "recorder":
        return "splitstream.recorder", ["--redis-url", redis_url]
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0)
    return "splitstream.worker", ["--model-repository", str(repository), "--model", MODEL, "--version", "v1"]


@pytest.mark.parametrize("service", ["router", "recorder", "worker"])
@pytest.mark.parametrize("host", HOSTS)
def test_a_plaintext_server_beyond_loopback_without_authentication_needs_insecure(
    tmp_path: Path, redis_server: RedisServer, stack: Stack, service: str, host: str
) -> None:
    module, args = server_args(service, tmp_path, redis_server.url)
    port = free_port()
    listen = ["--host", host, "--port", str(port), "--metrics-port", "0"]
    done = launcher.run(
        [sys.executable, "-m", module, *args, *listen],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False, env={**os.environ, **HMAC_ENV},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"splitstream-{service}: error: --host {host}: plaintext beyond loopback"), lines
    assert "--grpc-use-ssl" in lines[0]
    assert "--insecure" in lines[0]

    process = stack.service(service, module, [*args, *listen, "--insecure"], port=port, env=HMAC_ENV, start=False)
    process.address = f"{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    process.start()
    assert health_status(process.address) == SERVING
    if service == "worker":
        assert WARNING in process.log()


def test_loopback_needs_nothing(tmp_path: Path, stack: Stack) -> None:
    """The demo's and the tests' setting: the default --host is loopback, with no flag to add."""
    module, args = server_args("worker", tmp_path, "")
    port = free_port()
    worker = stack.service("worker", module, [*args, "--port", str(port), "--metrics-port", "0"], port=port)
    assert health_status(worker.address) == SERVING


def mutual_worker(tmp_path: Path, pki: Pki, stack: Stack, *, host: str, allowed: str) -> ServiceProcess:
    module, args = server_args("worker", tmp_path, "")
    server = pki.issue("worker")
    port = free_port()
    tls = [
        "--grpc-use-ssl-mutual", "--grpc-server-cert", str(server.cert), "--grpc-server-key", str(server.key),
        "--grpc-root-cert", str(pki.ca),
    ]  # fmt: skip
    health_client = pki.issue("prober", names=("prober.splitstream",), server=False)
    return stack.service(
        "worker",
        module,
        [
            *args,
            "--host",
            host,
            "--port",
            str(port),
            "--metrics-port",
            "0",
            *tls,
            "--allowed-client-identities",
            allowed,
        ],
        port=port,
        tls=trusting(pki, health_client),  # health stays open to every verified certificate
    )


def trusting(pki: Pki, client: Issued) -> ClientTls:
    return ClientTls(enabled=True, ca_file=str(pki.ca), cert_file=str(client.cert), key_file=str(client.key))


def test_a_worker_serves_only_the_client_identities_it_names(tmp_path: Path, stack: Stack) -> None:
    """Two certificates from the worker's own CA: both complete the mTLS handshake, only the named one
    (its DNS SAN) gets an inference; the other is refused UNAUTHENTICATED, so a caller who skips the router
    cannot skip its permissions and recording too. Named, the worker needs no --insecure on the network."""
    pki = Pki(tmp_path / "pki")
    named = pki.issue("router-a", names=("router-a.splitstream",), server=False)
    unnamed = pki.issue("router-b", names=("router-b.splitstream",), server=False)
    worker = mutual_worker(tmp_path, pki, stack, host="0.0.0.0", allowed="router-x.splitstream,router-a.splitstream")
    request = make_request(MODEL, np.ones((1, 4), dtype=np.float32))

    refused = InferClient(worker.address, tls=trusting(pki, unnamed))
    try:
        with pytest.raises(grpc.RpcError) as error:
            refused.infer(request)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "router-b" not in (error.value.details() or "")
        # The token stream too: refused before the worker reads a request.
        stream = refused.stub.ModelStreamInfer(iter([request]), timeout=10)
        with pytest.raises(grpc.RpcError) as error:
            list(stream)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        refused.close()

    served = InferClient(worker.address, tls=trusting(pki, named))
    try:
        response, _ = served.infer(request)
        assert response.model_name == MODEL
    finally:
        served.close()
    assert WARNING not in worker.log()


def scrape(host: str, port: int) -> bool:
    """Whether ``/metrics`` answers on ``host:port``."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=3) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.mark.skipif(not non_loopback_ip(), reason="this machine has no non-loopback IPv4 address")
def test_metrics_stay_on_loopback_unless_metrics_host_is_given(tmp_path: Path, stack: Stack) -> None:
    """A worker serving every interface (--host 0.0.0.0) still shows /metrics to this machine only, until
    --metrics-host opens it to a Prometheus elsewhere."""
    ip = non_loopback_ip()
    module, args = server_args("worker", tmp_path, "")
    for extra, reachable in (((), False), (("--metrics-host", "0.0.0.0"), True)):
        port, metrics_port = free_port(), free_port()
        listen = ["--host", "0.0.0.0", "--port", str(port), "--metrics-port", str(metrics_port), "--insecure"]
        worker = stack.service("worker", module, [*args, *listen, *extra], port=port)
        assert wait_for(lambda p=metrics_port: scrape("127.0.0.1", p), timeout_s=10, what="metrics on loopback")
        assert scrape(ip, metrics_port) is reachable
        worker.stop()


def test_a_worker_allow_list_without_mutual_tls_exits_2_naming_the_flag(tmp_path: Path) -> None:
    """Without mutual TLS no client certificate is verified: the list would refuse every router."""
    module, args = server_args("worker", tmp_path, "")
    done = launcher.run(
        [sys.executable, "-m", module, *args, "--port", "0", "--metrics-port", "0", "--allowed-client-identities", "r"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        "splitstream-worker: error: --allowed-client-identities needs --grpc-use-ssl-mutual (only then are client "
        "certificates verified)"
    ]
