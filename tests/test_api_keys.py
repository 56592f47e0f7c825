"""API keys made by ``splitstream keys add`` and stored as HMAC-SHA256 keyed with the router's
``--api-key-secret-file``: a real router (gRPC and HTTP ports) authenticates them while reading the
document's old unsalted SHA-256 entries with a deprecation warning.
"""

from __future__ import annotations

import hashlib
import http.client
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from splitstream.common.files import atomic_write
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from tests.harness import ServiceProcess, Stack, free_port, run_module, wait_for, write_registry
from tests.test_router_http import accepts

MODEL = "digits"
LEGACY_KEY = "legacy-" + secrets.token_hex(24)


@dataclass
class Deployment:
    router: ServiceProcess
    http_port: int
    principals: Path
    secret_file: Path


def sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("api-keys")
    principals = tmp / "principals.yaml"
    principals.write_text(
        "# callers of the digits service\n"
        "principals:\n"
        "  web:            # the web frontend\n"
        f"    models: [{MODEL}]\n"
        "  legacy:\n"
        f"    api_keys_sha256: [{sha256(LEGACY_KEY)}]\n"
        f"    models: [{MODEL}]\n"
    )
    secret_file = tmp / "api-key-secret"
    secret_file.write_text(secrets.token_hex(32) + "\n")
    registry = tmp / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}}})
    stack = Stack(tmp)
    try:
        http_port = free_port()
        router = stack.router(
            registry,
            "--http-port", str(http_port),
            "--auth-principals", f"file:{principals}",
            "--api-key-secret-file", str(secret_file),
        )  # fmt: skip
        wait_for(lambda: accepts(http_port), timeout_s=10, what="the HTTP port to accept")
        yield Deployment(router, http_port, principals, secret_file)
    finally:
        stack.close()


def grpc_code(router: ServiceProcess, key: str) -> grpc.StatusCode:
    with grpc.insecure_channel(router.address) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelReady(oip.ModelReadyRequest(name=MODEL), metadata=[("x-api-key", key)], timeout=10)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK


def http_status(port: int, key: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def keys_add(deployment: Deployment, principal: str, *extra: str) -> str:
    result = run_module(
        "splitstream.admin", "keys", "add", principal,
        "--principals", str(deployment.principals),
        "--api-key-secret-file", str(deployment.secret_file),
        *extra,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert len(key) >= 43
    assert "\n" not in key
    return key


def test_a_key_from_keys_add_authenticates_over_grpc_and_http_and_is_stored_keyed(deployment: Deployment) -> None:
    key = keys_add(deployment, "web")
    wait_for(lambda: grpc_code(deployment.router, key) == grpc.StatusCode.OK, timeout_s=10, what="the new key")
    assert http_status(deployment.http_port, key) == 200
    text = deployment.principals.read_text()
    assert key not in text
    assert sha256(key) not in text
    assert "# the web frontend" in text
    assert "# callers of the digits service" in text
    [digest] = yaml.safe_load(text)["principals"]["web"]["api_keys_hmac_sha256"]
    assert len(digest) == 64
    wrong = key[:-2] + ("AA" if not key.endswith("AA") else "BB")
    assert grpc_code(deployment.router, wrong) == grpc.StatusCode.UNAUTHENTICATED
    assert http_status(deployment.http_port, wrong) == 401


def test_a_new_principal_gets_only_the_models_named(deployment: Deployment) -> None:
    key = keys_add(deployment, "batch-job", "--model", "other-model")
    wait_for(
        lambda: grpc_code(deployment.router, key) == grpc.StatusCode.PERMISSION_DENIED,
        timeout_s=10,
        what="the new principal to be known (authenticated, not granted the model)",
    )


def test_old_unsalted_entries_still_work_with_a_deprecation_warning(deployment: Deployment) -> None:
    assert grpc_code(deployment.router, LEGACY_KEY) == grpc.StatusCode.OK
    assert http_status(deployment.http_port, LEGACY_KEY) == 200
    assert "api_keys_sha256 (unsalted SHA-256) is deprecated" in deployment.router.log()


def test_keys_add_refuses_a_short_secret_and_a_bad_name_with_exit_2(tmp_path: Path) -> None:
    principals = tmp_path / "principals.yaml"
    atomic_write(principals, "principals: {}\n")
    short = tmp_path / "short"
    short.write_text("too-short\n")
    result = run_module(
        "splitstream.admin", "keys", "add", "web", "--principals", str(principals), "--api-key-secret-file", str(short)
    )
    assert result.returncode == 2
    assert "--api-key-secret-file" in result.stderr
    assert "at least 32" in result.stderr
    good = tmp_path / "good"
    good.write_text(secrets.token_hex(32))
    result = run_module(
        "splitstream.admin", "keys", "add", "bad name", "--principals", str(principals), "--api-key-secret-file",
        str(good),
    )  # fmt: skip
    assert result.returncode == 2
    assert "PRINCIPAL" in result.stderr
    assert principals.read_text() == "principals: {}\n"  # nothing written


def test_a_router_refuses_keyed_digests_without_the_secret(tmp_path: Path) -> None:
    principals = tmp_path / "principals.yaml"
    principals.write_text(yaml.safe_dump({"principals": {"web": {"api_keys_hmac_sha256": ["a" * 64]}}}))
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}}})
    result = run_module(
        "splitstream.router", "--registry", f"file:{registry}", "--host", "127.0.0.1", "--port", "0",
        "--auth-principals", f"file:{principals}",
    )  # fmt: skip
    assert result.returncode == 2
    assert "--api-key-secret-file" in result.stderr


@pytest.mark.parametrize("name", ["web\n", "web\r\n", "wéb", "web\tx", "\u202eweb"])
def test_keys_add_refuses_a_principal_name_with_control_or_non_ascii_characters(tmp_path: Path, name: str) -> None:
    principals = tmp_path / "principals.yaml"
    atomic_write(principals, "principals: {}\n")
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    result = run_module(
        "splitstream.admin", "keys", "add", name, "--principals", str(principals), "--api-key-secret-file", str(secret)
    )
    assert result.returncode == 2, result.stderr
    assert "PRINCIPAL" in result.stderr
    assert result.stdout == ""  # no key shown
    assert principals.read_text() == "principals: {}\n"


@pytest.mark.parametrize(
    ("document", "said"),
    [
        (b"\xff\xfe\x00principals", "not UTF-8"),
        (b"- web\n- batch\n", "not a mapping"),
        (b"just some text\n", "not a mapping"),
        (b"principals:\n  web: [digits]\n", "'web' is not a mapping"),
        (b"principals:\n  web:\n    models: []\n    api_keys_hmac_sha256: abc\n", "not a list"),
    ],
)
def test_keys_add_refuses_a_principals_document_it_cannot_edit_with_exit_2(
    tmp_path: Path, document: bytes, said: str
) -> None:
    principals = tmp_path / "principals.yaml"
    principals.write_bytes(document)
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    result = run_module(
        "splitstream.admin", "keys", "add", "web", "--principals", str(principals), "--api-key-secret-file", str(secret)
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "--principals" in result.stderr
    assert said in result.stderr, result.stderr
    assert result.stdout == ""
    assert principals.read_bytes() == document  # nothing written
