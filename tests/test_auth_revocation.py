"""Credentials refused before they expire: the revocation list (``--revoked-file``) and SIGHUP, on a real
router whose JWKS is served over loopback HTTP. Calls need a principal only (gRPC ``ServerReady``, HTTP
``GET /v1/models``), so no worker is started.
"""

from __future__ import annotations

import contextlib
import http.client
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from splitstream.common.files import atomic_write
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from tests.harness import ServiceProcess, Stack, free_port, run_module, wait_for, write_registry
from tests.test_auth import AUDIENCE, ISSUER, SigningKey, _JwksServer, jwks, sha256
from tests.test_processes import child_pids, log_events, wait_children_serving
from tests.test_router_http import accepts

MODEL = "digits"
KEY = "web-key-" + uuid.uuid4().hex * 2
RELOAD_KEY = "ops-key-" + uuid.uuid4().hex * 2


@dataclass
class Deployment:
    router: ServiceProcess
    http_port: int
    revoked: Path
    handler: Any
    key_a: SigningKey
    key_b: SigningKey


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("revocation")
    principals = tmp / "principals.yaml"
    document = {
        "principals": {
            "web": {"api_keys_sha256": [sha256(KEY)], "models": [MODEL]},
            "jwt-user": {"models": [MODEL]},
            "jwt-other": {"models": [MODEL]},
        }
    }
    atomic_write(principals, yaml.safe_dump(document))
    revoked = tmp / "revoked.txt"
    atomic_write(revoked, "# nothing revoked yet\n")
    key_a, key_b = SigningKey.new("key-a"), SigningKey.new("key-b")
    handler: Any = type("Handler", (_JwksServer,), {"keys": jwks(key_a, key_b), "authorization": None})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = tmp / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}}})
    stack = Stack(tmp)
    try:
        http_port = free_port()
        router = stack.router(
            registry,
            "--http-port", str(http_port),
            "--auth-principals", f"file:{principals}",
            "--jwt-jwks", f"http://127.0.0.1:{server.server_port}/jwks.json",
            "--jwt-audience", AUDIENCE,
            "--jwt-issuer", ISSUER,
            "--revoked-file", str(revoked),
        )  # fmt: skip  # --jwks-refresh-s stays 300 s: only SIGHUP can make the router read the set again
        wait_for(lambda: accepts(http_port), timeout_s=10, what="the HTTP port to accept")
        yield Deployment(router, http_port, revoked, handler, key_a, key_b)
    finally:
        stack.close()
        server.shutdown()
        server.server_close()


def grpc_code(router: ServiceProcess, credential: str) -> grpc.StatusCode:
    """ServerReady (any authenticated principal) with ``authorization: Bearer <credential>``."""
    with grpc.insecure_channel(router.address) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ServerReady(oip.ServerReadyRequest(), metadata=[("authorization", f"Bearer {credential}")], timeout=10)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK


def http_answer(port: int, credential: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {credential}"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_a_jwt_whose_jti_is_listed_is_refused_on_both_ports_within_the_poll(deployment: Deployment) -> None:
    jti = uuid.uuid4().hex
    token = deployment.key_a.token(jti=jti)
    kept = deployment.key_a.token(jti=uuid.uuid4().hex)
    assert grpc_code(deployment.router, token) == grpc.StatusCode.OK
    assert http_answer(deployment.http_port, token)[0] == 200
    atomic_write(deployment.revoked, f"# leaked in a ticket\njti:{jti}\n")
    wait_for(
        lambda: grpc_code(deployment.router, token) == grpc.StatusCode.UNAUTHENTICATED,
        timeout_s=10,
        what="the revoked jti to be refused over gRPC",
    )
    status, body = http_answer(deployment.http_port, token)
    assert status == 401
    assert jti.encode() not in body
    assert b"revok" not in body
    assert grpc_code(deployment.router, kept) == grpc.StatusCode.OK  # another token of the same principal
    log = deployment.router.log()
    assert "revoked credential refused" in log
    assert f"jti:{jti}" in log
    atomic_write(deployment.revoked, "")
    wait_for(lambda: grpc_code(deployment.router, token) == grpc.StatusCode.OK, timeout_s=10, what="un-revoked")


def test_a_revoked_principal_loses_its_api_keys_and_its_jwts(deployment: Deployment) -> None:
    token = deployment.key_a.token()  # sub: jwt-user
    other = deployment.key_a.token(sub="jwt-other")
    assert grpc_code(deployment.router, KEY) == grpc.StatusCode.OK
    atomic_write(deployment.revoked, "principal:web\nprincipal:jwt-user   # off-boarded\n")
    wait_for(
        lambda: grpc_code(deployment.router, KEY) == grpc.StatusCode.UNAUTHENTICATED,
        timeout_s=10,
        what="the revoked principal's key to be refused",
    )
    assert grpc_code(deployment.router, token) == grpc.StatusCode.UNAUTHENTICATED
    assert http_answer(deployment.http_port, KEY)[0] == 401
    assert grpc_code(deployment.router, other) == grpc.StatusCode.OK
    atomic_write(deployment.revoked, "")
    wait_for(lambda: grpc_code(deployment.router, KEY) == grpc.StatusCode.OK, timeout_s=10, what="un-revoked")


def test_a_broken_revocation_list_keeps_the_last_good_one(deployment: Deployment) -> None:
    atomic_write(deployment.revoked, "principal:web\n")
    wait_for(lambda: grpc_code(deployment.router, KEY) == grpc.StatusCode.UNAUTHENTICATED, timeout_s=10)
    atomic_write(deployment.revoked, "principal web\n")  # no colon: refused, the last list stays
    wait_for(lambda: "revocation list refused" in deployment.router.log(), timeout_s=10, what="the error logged")
    assert grpc_code(deployment.router, KEY) == grpc.StatusCode.UNAUTHENTICATED
    atomic_write(deployment.revoked, "")
    wait_for(lambda: grpc_code(deployment.router, KEY) == grpc.StatusCode.OK, timeout_s=10, what="un-revoked")


def test_a_key_removed_from_the_jwks_is_refused_at_once_after_sighup(deployment: Deployment) -> None:
    token = deployment.key_b.token()
    assert grpc_code(deployment.router, token) == grpc.StatusCode.OK
    deployment.handler.keys = jwks(deployment.key_a)  # the issuer withdraws key-b
    fresh = deployment.key_b.token(jti=uuid.uuid4().hex)
    # Without a signal the set is re-read only every --jwks-refresh-s (300 s): both are still taken.
    assert grpc_code(deployment.router, token) == grpc.StatusCode.OK
    assert grpc_code(deployment.router, fresh) == grpc.StatusCode.OK
    deployment.router.signal(signal.SIGHUP)
    wait_for(
        lambda: grpc_code(deployment.router, token) == grpc.StatusCode.UNAUTHENTICATED,
        timeout_s=5,
        what="the token of the withdrawn key to be refused after SIGHUP",
    )
    assert grpc_code(deployment.router, fresh) == grpc.StatusCode.UNAUTHENTICATED
    assert http_answer(deployment.http_port, token)[0] == 401
    assert grpc_code(deployment.router, deployment.key_a.token()) == grpc.StatusCode.OK
    assert deployment.router.process is not None
    assert deployment.router.process.poll() is None


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "--revoked-file"),
        ("jti:\n", "line 1"),
        ("user:bob\n", "line 1"),
        (b"jti:caf\xe9\n", "not UTF-8"),  # Latin-1: a traceback and exit 1 before
    ],
    ids=["missing", "empty-id", "unknown-kind", "not-utf8"],
)
def test_an_unusable_revocation_list_at_start_is_exit_2_naming_the_flag(
    tmp_path: Path, content: str | bytes | None, problem: str
) -> None:
    principals = tmp_path / "principals.yaml"
    principals.write_text(yaml.safe_dump({"principals": {"web": {"models": [MODEL]}}}))
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}}})
    revoked = tmp_path / "revoked.txt"
    if isinstance(content, bytes):
        revoked.write_bytes(content)
    elif content is not None:
        revoked.write_text(content)
    result = run_module(
        "splitstream.router",
        "--registry", f"file:{registry}",
        "--host", "127.0.0.1",
        "--port", "0",
        "--auth-principals", f"file:{principals}",
        "--revoked-file", str(revoked),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--revoked-file" in result.stderr
    assert problem in result.stderr


class _HeldJwks(_JwksServer):
    """A JWKS server whose first read after ``gate`` is set answers with the set as it was when the read came,
    once ``gate`` opens: a slow issuer, read before an operator withdrew a key and answering after."""

    gate: threading.Event | None = None
    reads = 0

    def do_GET(self) -> None:
        handler = type(self)
        handler.reads += 1
        self.keys, gate = handler.keys, handler.gate  # the set as of now
        if gate is not None:
            handler.gate = None
            gate.wait(10)
        super().do_GET()


@pytest.mark.slow
def test_a_sighup_during_a_jwks_read_is_not_undone_by_that_read(tmp_path: Path) -> None:
    """SIGHUP re-reads the set; a read already on its way (begun by a token of an unknown kid) holds the set
    from before the change. It ended last and put the withdrawn key back until --jwks-refresh-s."""
    principals = tmp_path / "principals.yaml"
    atomic_write(principals, yaml.safe_dump({"principals": {"jwt-user": {"models": [MODEL]}}}))
    key_a, key_b, key_c = SigningKey.new("key-a"), SigningKey.new("key-b"), SigningKey.new("key-c")
    handler: Any = type("Handler", (_HeldJwks,), {"keys": jwks(key_a, key_b), "authorization": None})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}}})
    stack = Stack(tmp_path)
    try:
        router = stack.router(
            registry,
            "--auth-principals", f"file:{principals}",
            "--jwt-jwks", f"http://127.0.0.1:{server.server_port}/jwks.json",
            "--jwt-audience", AUDIENCE,
            "--jwt-issuer", ISSUER,
            "--jwks-min-refresh-s", "0",
        )  # fmt: skip
        assert grpc_code(router, key_b.token()) == grpc.StatusCode.OK
        gate = threading.Event()
        handler.gate, handler.reads = gate, 0
        unknown: list[grpc.StatusCode] = []
        miss = threading.Thread(target=lambda: unknown.append(grpc_code(router, key_c.token())))
        miss.start()  # key-c is in no set: the router reads the JWKS, and the server holds that read
        wait_for(lambda: handler.reads == 1, timeout_s=10, what="the JWKS read of the unknown kid")
        handler.keys = jwks(key_a)  # the issuer withdraws key-b; the held read still answers a and b
        router.signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: reading" in router.log(), timeout_s=10, what="the SIGHUP reload")
        # The old code read at once, beside the held read; the fixed one waits for it (bounded: not asserted).
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: handler.reads >= 2, timeout_s=2)
        gate.set()
        miss.join(timeout=15)
        assert unknown == [grpc.StatusCode.UNAUTHENTICATED]
        wait_for(lambda: handler.reads >= 2, timeout_s=10, what="SIGHUP's own read of the JWKS")
        wait_for(
            lambda: grpc_code(router, key_b.token(jti=uuid.uuid4().hex)) == grpc.StatusCode.UNAUTHENTICATED,
            timeout_s=5,
            what="the withdrawn key-b to be refused after SIGHUP",
        )
        assert grpc_code(router, key_a.token()) == grpc.StatusCode.OK
    finally:
        stack.close()
        server.shutdown()
        server.server_close()


def refused_on_own_connection(router: ServiceProcess, credential: str, request_id: str) -> grpc.StatusCode:
    """ServerReady on a TCP connection of its own, so the kernel may hand it to either ``--processes`` child."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(router.address, options=options) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = [("authorization", f"Bearer {credential}"), ("x-request-id", request_id)]
        try:
            stub.ServerReady(oip.ServerReadyRequest(), metadata=metadata, timeout=10)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK


@dataclass
class TwoProcesses:
    router: ServiceProcess
    handler: Any
    key_a: SigningKey
    key_b: SigningKey


@contextlib.contextmanager
def two_process_router(tmp_path: Path) -> Iterator[TwoProcesses]:
    """A ``--processes 2`` router whose JWKS (key-a, key-b) is served over loopback HTTP and re-read every
    300 s only; principals: ``ops`` (the reload grant, key :data:`RELOAD_KEY`), ``web`` (:data:`KEY`)."""
    principals = tmp_path / "principals.yaml"
    document = {
        "principals": {
            "jwt-user": {"models": [MODEL]},
            "ops": {"api_keys_sha256": [sha256(RELOAD_KEY)], "reload": True},
            "web": {"api_keys_sha256": [sha256(KEY)], "models": [MODEL]},
        }
    }
    atomic_write(principals, yaml.safe_dump(document))
    key_a, key_b = SigningKey.new("key-a"), SigningKey.new("key-b")
    handler: Any = type("Handler", (_HeldJwks,), {"keys": jwks(key_a, key_b), "authorization": None})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}}})
    stack = Stack(tmp_path)
    try:
        router = stack.router(
            registry,
            "--processes", "2",
            "--auth-principals", f"file:{principals}",
            "--jwt-jwks", f"http://127.0.0.1:{server.server_port}/jwks.json",
            "--jwt-audience", AUDIENCE,
            "--jwt-issuer", ISSUER,
        )  # fmt: skip
        wait_children_serving(router)
        yield TwoProcesses(router, handler, key_a, key_b)
    finally:
        stack.close()
        server.shutdown()
        server.server_close()


def refused_by_both_children(router: ServiceProcess, token: str, prefix: str) -> None:
    """Calls on fresh connections until each child has refused ``token`` (each refusal's log line names its
    child); every one of them refused."""
    sent: set[str] = set()
    codes: list[grpc.StatusCode] = []  # every call's, checked after: wait_for retries a condition that raises

    def refused_by_both() -> bool:
        request_id = f"{prefix}-{len(sent)}"
        codes.append(refused_on_own_connection(router, token, request_id))
        sent.add(request_id)
        refusers = {
            event.get("process_index")
            for event in log_events(router)
            if event.get("event") == "gRPC call refused" and event.get("request_id") in sent
        }
        return refusers == {0, 1}

    wait_for(refused_by_both, timeout_s=60, what="a refusal by each child")
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, codes


@pytest.mark.slow
def test_sighup_to_a_processes_parent_makes_every_child_read_the_jwks_again(tmp_path: Path) -> None:
    """``--processes 2``: the children hold the credentials, and SIGHUP to the parent used to end it (and its
    children with it). Now it is sent on to both. The JWKS shows it: SIGHUP is the only way to have it read
    before --jwks-refresh-s (300 s), where the revocation list is polled anyway."""
    with two_process_router(tmp_path) as deployment:
        router = deployment.router
        pids = child_pids(router)
        token = deployment.key_b.token()
        assert {refused_on_own_connection(router, token, uuid.uuid4().hex) for _ in range(4)} == {grpc.StatusCode.OK}
        deployment.handler.keys, deployment.handler.reads = jwks(deployment.key_a), 0  # the issuer withdraws key-b
        router.signal(signal.SIGHUP)
        wait_for(lambda: deployment.handler.reads >= 2, timeout_s=15, what="each child to read the JWKS again")
        wait_for(
            lambda: refused_on_own_connection(router, token, uuid.uuid4().hex) == grpc.StatusCode.UNAUTHENTICATED,
            timeout_s=10,
            what="the withdrawn key to be refused",
        )
        refused_by_both_children(router, token, "after-sighup")
        assert child_pids(router) == pids  # sent on to children with a handler: none died of it
        assert router.process is not None
        assert router.process.poll() is None
        assert grpc_code(router, deployment.key_a.token()) == grpc.StatusCode.OK


@pytest.mark.slow
def test_credentials_reload_makes_every_child_of_a_router_read_the_jwks_from_another_host(tmp_path: Path) -> None:
    """``splitstream credentials reload`` (ReloadCredentials over gRPC, the reload grant): the child that
    takes the call has the supervisor signal both, answers once it has read the set, and says which key
    ids are in force. Without the grant: PERMISSION_DENIED, exit 1, nothing read."""
    with two_process_router(tmp_path) as deployment:
        router = deployment.router
        token = deployment.key_b.token()
        assert grpc_code(router, token) == grpc.StatusCode.OK
        deployment.handler.keys, deployment.handler.reads = jwks(deployment.key_a), 0  # the issuer withdraws key-b
        web_key, ops_key = tmp_path / "web-key", tmp_path / "ops-key"
        web_key.write_text(KEY + "\n")
        ops_key.write_text(RELOAD_KEY + "\n")
        reload = ("splitstream.admin", "credentials", "reload", "--router", router.address)
        denied = run_module(*reload, "--api-key-file", str(web_key), timeout_s=60)
        assert denied.returncode == 1, denied.stderr
        assert f"router {router.address}: PERMISSION_DENIED" in denied.stderr
        assert deployment.handler.reads == 0
        done = run_module(*reload, "--api-key-file", str(ops_key), timeout_s=60)
        assert done.returncode == 0, done.stderr
        assert "(2 processes)" in done.stdout or "2 processes" in done.stdout, done.stdout
        assert "JWKS key ids: key-a;" in done.stdout, done.stdout
        assert RELOAD_KEY not in done.stdout + done.stderr
        wait_for(lambda: deployment.handler.reads >= 2, timeout_s=15, what="each child to read the JWKS again")
        refused_by_both_children(router, token, "after-rpc")
        assert grpc_code(router, deployment.key_a.token()) == grpc.StatusCode.OK
