"""TLS and mutual TLS on every hop, certificate rotation, Redis over TLS with least-privilege ACL users.

Real processes and a real ``redis-server`` (built with TLS); certificates are made here with
``cryptography`` (``tests/certs.py``): a CA, server and client certificates, an expired one, one
from another CA.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import cast

import grpc
import numpy as np
import pytest
import redis
import requests
from cryptography import x509
from grpc import aio
from grpc_health.v1 import health_pb2

from splitstream.admin.main import main as admin
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import ARCHIVED_PREFIX, stream_key
from splitstream.common.tls import ClientTls
from tests import launcher
from tests.certs import Issued, Pki, served_serial
from tests.consul_emulator import ConsulEmulator
from tests.experiments import Call, Event, phase, write_calls, write_feedback
from tests.harness import (
    ROOT,
    InferClient,
    Stack,
    SteadyLoad,
    free_port,
    health_status,
    make_request,
    metric_samples,
    running_stack,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.models import add_version
from tests.redis_server import RedisServer, RedisTls

MODEL = "affine"
HMAC_KEY = "tls-tests-key"
SERVING = health_pb2.HealthCheckResponse.SERVING


def readme_acl(user: str, password: str) -> str:
    """docs/security.md's ``ACL SETUSER`` line for ``user`` (Storage), with ``password``: the tests use
    the documented lines themselves, so the documentation cannot drift from what works."""
    for line in (ROOT / "docs" / "security.md").read_text().splitlines():
        if line.startswith(f"ACL SETUSER {user} "):
            rules = line.removeprefix("ACL SETUSER ")
            return re.sub(r">[A-Z_]+_PASSWORD", f">{password}", rules)
    raise AssertionError(f"docs/security.md has no ACL SETUSER line for {user}")


RECORDER_ACL = readme_acl("splitstream-recorder", "recorder-pw")
READER_ACL = readme_acl("splitstream-reader", "reader-pw")


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path) as stack:
        yield stack


def tls_server_args(issued: Issued, *, mutual_ca: Path | None = None) -> list[str]:
    args = ["--grpc-use-ssl", "--grpc-server-cert", str(issued.cert), "--grpc-server-key", str(issued.key)]
    if mutual_ca is not None:
        args += ["--grpc-use-ssl-mutual", "--grpc-root-cert", str(mutual_ca)]
    return args


def health_code(address: str, tls: ClientTls) -> grpc.StatusCode | int:
    """SERVING's number, or the status code the call failed with (a refused handshake: UNAVAILABLE)."""
    try:
        return health_status(address, timeout_s=3.0, tls=tls)
    except grpc.RpcError as error:
        return error.code()


def trusting(pki: Pki, client: Issued | None = None, **options: str) -> ClientTls:
    return ClientTls(
        enabled=True,
        ca_file=str(pki.ca),
        cert_file=str(client.cert) if client else "",
        key_file=str(client.key) if client else "",
        **options,
    )


def rotate(target: Issued, new: Issued) -> None:
    """Replace ``target``'s files by ``new``'s the way renewal tools do: a write beside, then a rename."""
    for source, destination in ((new.key, target.key), (new.cert, target.cert)):
        staging = destination.with_suffix(".new")
        staging.write_bytes(source.read_bytes())
        os.replace(staging, destination)


def test_a_tls_worker_answers_clients_that_trust_its_ca_and_refuses_plaintext_and_other_cas(
    tmp_path: Path, pki: Pki, stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0)
    # Named only worker.internal: dialling 127.0.0.1 verifies only with the server-name override.
    cert = pki.issue("worker", names=("worker.internal",))
    good = trusting(pki, server_name="worker.internal")
    worker = stack.worker(repository, MODEL, "v1", *tls_server_args(cert), tls=good)

    assert health_code(worker.address, good) == SERVING
    assert health_code(worker.address, replace(good, server_name="")) == grpc.StatusCode.UNAVAILABLE
    other = Pki(tmp_path / "other", name="other")
    assert health_code(worker.address, trusting(other, server_name="worker.internal")) == grpc.StatusCode.UNAVAILABLE
    assert health_code(worker.address, ClientTls()) == grpc.StatusCode.UNAVAILABLE  # plaintext

    # The container healthcheck speaks TLS from its variables (the compose TLS stack relies on it).
    check = [sys.executable, "-m", "splitstream.common.healthcheck", worker.address]
    tls_env = {
        "SPLITSTREAM_HEALTHCHECK_TLS_CA": str(pki.ca),
        "SPLITSTREAM_HEALTHCHECK_TLS_SERVER_NAME": "worker.internal",
    }
    run = launcher.run(check, capture_output=True, text=True, timeout=30, env={**os.environ, **tls_env}, check=False)
    assert run.returncode == 0, run.stderr
    assert launcher.run(check, capture_output=True, timeout=30, check=False).returncode == 1

    # The admin CLI's shared --tls flags: it probes the worker's health over TLS, and says so without them.
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
    common = ["--registry", f"file:{registry}"]
    tls_flags = ["--tls-ca", str(pki.ca), "--tls-server-name", "worker.internal"]
    assert admin([*common, *tls_flags, "versions", MODEL, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["versions"][0]["health"] == "serving"
    assert admin([*common, "versions", MODEL, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["versions"][0]["health"] == "unreachable"
    assert admin([*common, "--tls-ca", str(tmp_path / "missing.pem"), "versions", MODEL]) == 2
    assert "--tls-ca" in capsys.readouterr().err


def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(
    tmp_path: Path, pki: Pki, stack: Stack
) -> None:
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0)
    live = pki.issue("live")
    tls = trusting(pki)
    worker = stack.worker(repository, MODEL, "v1", *tls_server_args(live), tls=tls)
    assert worker.process is not None
    pid = worker.process.pid
    assert served_serial("127.0.0.1", worker.port, ca=pki.ca) == live.serial

    renewed = pki.issue("renewed")
    rotate(live, renewed)
    wait_for(
        lambda: served_serial("127.0.0.1", worker.port, ca=pki.ca) == renewed.serial,
        timeout_s=10,
        what="the renewed certificate to be served",
    )
    assert health_code(worker.address, tls) == SERVING

    # Half a rotation (a new certificate beside the old key) is refused; the last good pair is served.
    (tmp_path / "pki" / "live.pem").write_bytes(pki.issue("half").cert.read_bytes())
    assert served_serial("127.0.0.1", worker.port, ca=pki.ca) == renewed.serial
    assert "rotated TLS files not usable" in worker.log()

    # A certificate rotated to an expired one is served (the files are what they are) and clients refuse it.
    rotate(live, pki.issue("expired", expired=True))
    wait_for(
        lambda: health_code(worker.address, tls) == grpc.StatusCode.UNAVAILABLE,
        timeout_s=10,
        what="clients to refuse the expired certificate",
    )
    assert worker.process.pid == pid
    assert worker.process.poll() is None


@pytest.fixture
def redis_tls(tmp_path: Path, pki: Pki) -> Iterator[RedisServer]:
    """redis-server on a TLS port only, requiring client certificates, with docs/security.md's ACL users."""
    server = pki.issue("redis")
    harness = pki.issue("redis-admin")
    tls = RedisTls(server.cert, server.key, pki.ca, auth_clients=True, client_cert=harness.cert, client_key=harness.key)
    with RedisServer(tmp_path / "redis", password="admin-pw", tls=tls, users=(RECORDER_ACL, READER_ACL)) as running:
        yield running


def test_mutual_tls_at_the_recorder_refuses_clients_without_a_valid_certificate(
    tmp_path: Path, pki: Pki, stack: Stack, redis_tls: RedisServer
) -> None:
    recorder_cert = pki.issue("recorder")
    router_cert = pki.issue("router-client", server=False)
    redis_client = pki.issue("recorder-redis-client", server=False)
    password_file = tmp_path / "recorder-redis-password"
    password_file.write_text("recorder-pw\n")
    port = free_port()
    good = trusting(pki, router_cert)
    recorder = stack.service(
        "recorder",
        "splitstream.recorder",
        [
            "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
            "--redis-url", redis_tls.url_for(), "--redis-username", "splitstream-recorder",
            "--redis-password-file", str(password_file),
            "--redis-tls-ca", str(pki.ca), "--redis-tls-cert", str(redis_client.cert),
            "--redis-tls-key", str(redis_client.key),
            "--hmac-key", HMAC_KEY,
            *tls_server_args(recorder_cert, mutual_ca=pki.ca),
        ],
        port=port,
        tls=good,
    )  # fmt: skip
    assert health_code(recorder.address, good) == SERVING  # and so Redis answered its PING over TLS, as its user

    assert health_code(recorder.address, trusting(pki)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    expired = pki.issue("expired-client", expired=True, server=False)
    assert health_code(recorder.address, trusting(pki, expired)) == grpc.StatusCode.UNAVAILABLE
    other = Pki(tmp_path / "other", name="other")
    stranger = other.issue("stranger", server=False)
    assert health_code(recorder.address, trusting(pki, stranger)) == grpc.StatusCode.UNAVAILABLE
    assert "recorder-pw" not in recorder.log()


@pytest.mark.slow
def test_every_hop_over_tls_records_a_call_that_a_read_only_user_replays_but_cannot_overwrite(
    tmp_path: Path, pki: Pki, stack: Stack, redis_tls: RedisServer
) -> None:
    """client →TLS→ router →TLS→ worker; router →mTLS→ recorder →TLS→ Redis (recorder's ACL user);
    then the replayer reads with the read-only user over TLS and re-sends to the router over TLS."""
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0)
    tls = trusting(pki)
    worker = stack.worker(repository, MODEL, "v1", *tls_server_args(pki.issue("worker")), tls=tls)

    recorder_port = free_port()
    router_client = pki.issue("router-client", server=False)
    redis_client = pki.issue("redis-client", server=False)
    redis_files = ["--redis-tls-ca", str(pki.ca), "--redis-tls-cert", str(redis_client.cert)]
    redis_files += ["--redis-tls-key", str(redis_client.key)]
    stack.service(
        "recorder",
        "splitstream.recorder",
        [
            "--host", "127.0.0.1", "--port", str(recorder_port), "--metrics-port", "0",
            "--redis-url", redis_tls.url_for(), "--redis-username", "splitstream-recorder", *redis_files,
            "--hmac-key", HMAC_KEY,
            *tls_server_args(pki.issue("recorder"), mutual_ca=pki.ca),
        ],
        port=recorder_port,
        tls=trusting(pki, router_client),
        env={"SPLITSTREAM_RECORDER_REDIS_PASSWORD": "recorder-pw"},  # the password never in argv
    )  # fmt: skip

    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
    router = stack.router(
        registry,
        *tls_server_args(pki.issue("router")),
        "--upstream-tls-ca", str(pki.ca),
        "--recorder", f"127.0.0.1:{recorder_port}",
        "--recorder-tls-ca", str(pki.ca),
        "--recorder-tls-cert", str(router_client.cert),
        "--recorder-tls-key", str(router_client.key),
        "--hmac-key", HMAC_KEY,
        "--log-dir", str(tmp_path / "spool"),
        "--record-batch-interval-ms", "20",
        tls=tls,
    )  # fmt: skip

    client = InferClient(router.address, tls=tls)
    try:
        response, _ = client.infer(make_request(MODEL, np.ones((1, 4), dtype=np.float32), request_id="tls-call-1"))
    finally:
        client.close()
    assert response.model_version == "v1"

    reader_options = {"ssl_ca_certs": str(pki.ca), "ssl_certfile": str(redis_client.cert)}
    reader_options["ssl_keyfile"] = str(redis_client.key)
    reader = redis.Redis.from_url(redis_tls.url_for("splitstream-reader", "reader-pw"), **reader_options)  # type: ignore[arg-type]
    try:
        entries = wait_for(
            lambda: reader.xrange(stream_key(MODEL)), timeout_s=30, interval_s=0.2, what="the call's record"
        )
        assert entries[0][1][b"request_id"] == b"tls-call-1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.xadd(stream_key(MODEL), {"request_id": "forged"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.set("splitstream:blob:forged", b"x")
    finally:
        reader.close()

    # A router without a client certificate is refused by the recorder: its client is answered, its
    # records wait in its spool, and nothing it sends reaches Redis.
    certless = stack.router(
        registry,
        "--upstream-tls-ca", str(pki.ca),
        "--recorder", f"127.0.0.1:{recorder_port}",
        "--recorder-tls-ca", str(pki.ca),
        "--hmac-key", HMAC_KEY,
        "--log-dir", str(tmp_path / "spool-certless"),
        "--record-batch-interval-ms", "20",
        "--shipper-metrics-port", str(certless_shipper_metrics := free_port()),
    )  # fmt: skip
    plain = InferClient(certless.address)
    try:
        plain.infer(make_request(MODEL, np.ones((1, 4), dtype=np.float32), request_id="tls-certless-1"))
    finally:
        plain.close()

    def kept() -> float:  # read by the shipper, and kept in the log while the recorder refuses it
        text = scrape_metrics(certless_shipper_metrics)
        entries = metric_samples(text, "splitstream_shipper_log_entries_total")
        read = sum(v for labels, v in entries if labels.get("kind") == "call")
        return read and sum(v for _, v in metric_samples(text, "splitstream_shipper_log_pending_bytes"))

    wait_for(lambda: kept() > 0, timeout_s=30, what="the refused router to keep its record in its log")
    admin = redis_tls.client()
    try:
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], admin.xrange(stream_key(MODEL)))
    finally:
        admin.close()
    assert b"tls-certless-1" not in {fields[b"request_id"] for _, fields in entries}

    out = tmp_path / "replay"
    replayed = launcher.run(
        [
            sys.executable, "-m", "splitstream.replayer",
            "--redis-url", redis_tls.url_for(), "--redis-username", "splitstream-reader", *redis_files,
            "--model", MODEL, "--since", "-10m", "--target", router.address, "--tls-ca", str(pki.ca),
            "--output-dir", str(out),
        ],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
        env={**os.environ, "SPLITSTREAM_REPLAY_REDIS_PASSWORD": "reader-pw", "SPLITSTREAM_HMAC_KEY": HMAC_KEY},
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    assert (out / "summary.json").exists()


@pytest.mark.slow
def test_a_bad_certificate_or_key_is_exit_2_with_one_line_naming_the_flag(tmp_path: Path, pki: Pki) -> None:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {})
    good = pki.issue("router")
    other = pki.issue("other")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    cases = [
        (["--grpc-use-ssl"], "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"),
        (["--grpc-use-ssl", "--grpc-server-cert", str(tmp_path / "gone.pem"), "--grpc-server-key", str(good.key)],
         "--grpc-server-cert"),
        (["--grpc-use-ssl", "--grpc-server-cert", str(good.cert), "--grpc-server-key", str(other.key)],
         "not the private key of --grpc-server-cert"),
        (["--grpc-use-ssl", "--grpc-server-cert", str(not_pem), "--grpc-server-key", str(good.key)], "not a PEM file"),
        ([*tls_server_args(good), "--grpc-use-ssl-mutual"], "--grpc-use-ssl-mutual needs --grpc-root-cert"),
        (["--grpc-server-cert", str(good.cert)], "--grpc-server-cert needs --grpc-use-ssl"),
        (["--upstream-tls-cert", str(good.cert)], "--upstream-tls-cert and --upstream-tls-key go together"),
        (["--recorder-tls-ca", str(not_pem)], "--recorder-tls-ca"),
    ]  # fmt: skip
    for flags, expected in cases:
        done = launcher.run(
            [sys.executable, "-m", "splitstream.router", "--registry", f"file:{registry}", "--port", "0", *flags],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (flags, done.stderr)
        assert len(lines) == 1, (flags, done.stderr)
        assert expected in lines[0], (flags, done.stderr)


@pytest.mark.slow
def test_bad_redis_and_consul_tls_settings_are_exit_2_with_one_line(tmp_path: Path, pki: Pki) -> None:
    client = pki.issue("client")
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {})
    recorder = [sys.executable, "-m", "splitstream.recorder", "--port", "0", "--hmac-key", "k"]
    router = [sys.executable, "-m", "splitstream.router", "--port", "0", "--registry", "consul://127.0.0.1:1"]
    cases: list[tuple[list[str], dict[str, str], str]] = [
        ([*recorder, "--redis-tls-ca", str(pki.ca)], {}, "need a rediss://"),
        ([*recorder, "--redis-url", "rediss://h:1/0", "--redis-tls-cert", str(client.cert)], {}, "go together"),
        ([*recorder, "--redis-url", "rediss://h:1/0", "--redis-password-file", str(tmp_path / "nope")], {},
         "--redis-password-file"),
        (router, {"CONSUL_HTTP_SSL": "true", "CONSUL_CACERT": str(tmp_path / "nope.pem")}, "CONSUL_CACERT"),
        (router, {"CONSUL_CACERT": str(pki.ca)}, "CONSUL_HTTP_SSL=true"),
        (router, {"CONSUL_HTTP_TOKEN_FILE": str(tmp_path / "nope")}, "CONSUL_HTTP_TOKEN_FILE"),
    ]  # fmt: skip
    for command, env, expected in cases:
        done = launcher.run(
            command, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False, env={**os.environ, **env}
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (command, env, done.stderr)
        assert len(lines) == 1, (command, env, done.stderr)
        assert expected in lines[0], (command, env, done.stderr)


def test_plaintext_stays_the_default(tmp_path: Path, stack: Stack) -> None:
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0)
    worker = stack.worker(repository, MODEL, "v1")
    assert health_code(worker.address, ClientTls()) == SERVING


@pytest.mark.slow
def test_workers_and_routers_use_consul_over_https_with_a_client_certificate_and_the_token_as_a_header(
    tmp_path: Path, pki: Pki, stack: Stack
) -> None:
    """Consul with verify_incoming: HTTPS only, client certificates required, an ACL token. The worker
    registers over HTTPS with a TLS gRPC check (which passes), the router discovers it over HTTPS and
    calls it over TLS; no request carries the token in its query string."""
    consul_cert = pki.issue("consul")
    token = "consul-acl-token"
    with ConsulEmulator(tmp_path / "consul", token=token, tls=(pki.ca, consul_cert.cert, consul_cert.key)) as consul:
        with pytest.raises(requests.exceptions.ConnectionError):  # no client certificate: refused
            requests.get(f"https://127.0.0.1:{consul.port}/v1/status/leader", verify=str(pki.ca), timeout=5)

        repository = tmp_path / "models"
        add_version(repository, MODEL, "v1", scale=2.0)
        tls = trusting(pki)
        stack.worker(
            repository,
            MODEL,
            "v1",
            *tls_server_args(pki.issue("worker")),
            "--registry",
            consul.spec,
            "--check-interval-s",
            "0.2",
            env=consul.env,
            tls=tls,
        )
        client = consul.client()
        wait_for(
            lambda: client.health.service(f"splitstream-{MODEL}", passing=True)[1],
            timeout_s=30,
            what="the worker's TLS gRPC check to pass",
        )
        token_file = tmp_path / "consul-token"
        token_file.write_text(token + "\n")
        from_file = {k: v for k, v in consul.env.items() if k != "CONSUL_HTTP_TOKEN"}
        from_file["CONSUL_HTTP_TOKEN_FILE"] = str(token_file)  # the router reads its token from a file
        router = stack.router(consul.spec, "--upstream-tls-ca", str(pki.ca), env=from_file)

        def answered() -> bool:
            infer = InferClient(router.address)
            try:
                response, _ = infer.infer(make_request(MODEL, np.ones((1, 4), dtype=np.float32)))
                return response.model_version == "v1"
            except grpc.RpcError:
                return False
            finally:
                infer.close()

        wait_for(answered, timeout_s=30, what="a call through the router to the worker found in Consul")
    assert "token in query string" not in consul.log()
    assert token not in router.log()


ARCHIVER_ACL = readme_acl("splitstream-archiver", "archiver-pw")


@pytest.mark.slow
def test_analyze_reads_as_the_read_only_user_and_the_archiver_as_its_own_over_tls(
    tmp_path: Path, pki: Pki, stack: Stack
) -> None:
    """The analysis CLI and ``splitstream-archive`` take the same Redis TLS files and ACL user as the
    recorder and the replayer: a Redis that accepts only TLS with client certificates and named users."""
    server = pki.issue("redis")
    harness = pki.issue("redis-admin")
    tls = RedisTls(server.cert, server.key, pki.ca, auth_clients=True, client_cert=harness.cert, client_key=harness.key)
    users = (READER_ACL, ARCHIVER_ACL)
    with RedisServer(tmp_path / "redis", password="admin-pw", tls=tls, users=users) as redis_tls:
        now_ns = time.time_ns()
        calls = [
            Call(f"c{i}", now_ns - 600 * 10**9 + i * 10**6, "v1" if i % 2 else "v2", unit=f"u{i}") for i in range(200)
        ]
        admin_client = redis_tls.client()
        try:
            write_calls(admin_client, MODEL, calls, phase({"v1": 50, "v2": 50}, "v1"))
            write_feedback(
                admin_client,
                MODEL,
                [Event("click", 1.0, c.time_ns + 10**6, request_id=c.request_id) for c in calls[::3]],
            )
        finally:
            admin_client.close()
        client = pki.issue("analyst", server=False)
        files = [
            "--redis-tls-ca",
            str(pki.ca),
            "--redis-tls-cert",
            str(client.cert),
            "--redis-tls-key",
            str(client.key),
        ]
        clean_env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}

        def analyze(*flags: str, password: str = "reader-pw") -> subprocess.CompletedProcess[str]:
            return launcher.run(
                [sys.executable, "-m", "splitstream.admin", "analyze", MODEL, "--redis-url", redis_tls.url_for(),
                 "--since", "-1h", "--metric", "click:proportion", "--output-dir", str(tmp_path / "analysis"), *flags],
                env={**clean_env, "SPLITSTREAM_ADMIN_REDIS_PASSWORD": password},
                cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip

        analysed = analyze("--redis-username", "splitstream-reader", *files)
        assert analysed.returncode == 0, analysed.stderr
        document = json.loads((tmp_path / "analysis" / "analysis.json").read_text())
        assert document["model"] == MODEL
        assert sum(arm["calls"] for arm in document["phases"][0]["arms"]) == len(calls)
        assert "reader-pw" not in analysed.stdout + analysed.stderr

        wrong = analyze("--redis-username", "splitstream-reader", *files, password="not-the-password")
        assert wrong.returncode == 1
        assert len(wrong.stderr.strip().splitlines()) == 1
        half = analyze("--redis-tls-cert", str(client.cert))
        assert half.returncode == 2
        assert "--redis-tls-cert and --redis-tls-key go together" in half.stderr

        archive_dir = tmp_path / "archive"
        port = free_port()
        stack.service(
            "archiver",
            "splitstream.archiver",
            [
                "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                "--redis-url", redis_tls.url_for(), "--redis-username", "splitstream-archiver", *files,
                "--archive", str(archive_dir), "--consumer", "a",
                "--flush-interval-s", "0.3", "--claim-idle-s", "30", "--scan-interval-s", "0.3",
            ],
            port=port,
            env={**clean_env, "SPLITSTREAM_ARCHIVE_REDIS_PASSWORD": "archiver-pw"},
        )  # fmt: skip
        wait_for(
            lambda: [path for path in archive_dir.rglob("*.parquet") if "/calls/" in str(path)],
            timeout_s=60,
            interval_s=0.3,
            what="the archiver to write the calls it read over TLS as its ACL user",
        )
        # Its ACL lets it publish the archive's progress too (the mark script SETs it): --trim-archived needs it.
        admin = redis_tls.client()
        try:
            wait_for(
                lambda: list(admin.scan_iter(match=f"{ARCHIVED_PREFIX}*")),
                timeout_s=30,
                interval_s=0.3,
                what="the archiver to raise its mark as its ACL user",
            )
        finally:
            admin.close()


async def record_over_tls(
    address: str, tls: ClientTls, batch: recorder_pb2.RecordBatch | None
) -> tuple[list[recorder_pb2.RecordAck], grpc.StatusCode]:
    """One Record stream on a channel made with ``tls``: the batch sent (none: nothing written), its acks and
    the stream's status (a write the recorder ended fails on the client's side; the status is the call's)."""
    async with tls.aio_channel(address) as channel:
        stream = channel.stream_stream(
            "/splitstream.v1.Recorder/Record", response_deserializer=recorder_pb2.RecordAck.FromString
        )()
        acks = []
        try:
            if batch is not None:
                await stream.write(batch.SerializeToString())
                ack = await stream.read()
                if ack is not aio.EOF:
                    acks.append(ack)
            await stream.done_writing()
        except (aio.AioRpcError, asyncio.InvalidStateError):
            pass
        return acks, await stream.code()


def test_the_recorder_takes_records_only_from_client_certificates_it_names(
    tmp_path: Path, pki: Pki, stack: Stack
) -> None:
    """Two routers' certificates from the same CA: both complete the mTLS handshake, only the one named in
    --allowed-client-identities (its DNS SAN / CN) writes; the other is refused UNAUTHENTICATED, counted,
    and nothing it sent is in Redis."""
    named = pki.issue("router-a", names=("router-a.splitstream",), server=False)
    unnamed = pki.issue("router-b", names=("router-b.splitstream",), server=False)
    with RedisServer(tmp_path / "redis") as redis_server:
        port, metrics_port = free_port(), free_port()
        recorder = stack.service(
            "recorder",
            "splitstream.recorder",
            [
                "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
                "--redis-url", redis_server.url, "--hmac-key", HMAC_KEY,
                *tls_server_args(pki.issue("recorder"), mutual_ca=pki.ca),
            ],
            port=port,
            tls=trusting(pki, unnamed),  # health is open to every verified certificate
            env={"SPLITSTREAM_RECORDER_ALLOWED_CLIENT_IDENTITIES": "router-x.splitstream, router-a.splitstream"},
        )  # fmt: skip

        def record(request_id: str) -> recorder_pb2.CallRecord:
            call = recorder_pb2.CallRecord(
                schema_version=1, request_id=request_id, receive_unix_ns=time.time_ns(), model=MODEL, version="v1"
            )
            call.request.inline = b"\x00"
            return call

        refused, code = asyncio.run(
            record_over_tls(
                recorder.address, trusting(pki, unnamed), recorder_pb2.RecordBatch(sequence=1, records=[record("b-1")])
            )
        )
        assert refused == []
        # A stream still writing when the recorder ends it may see its own write fail, INTERNAL (as in
        # tests/test_auth.py); the refusal's own status is read on a stream that sends nothing, below.
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
        _, silent = asyncio.run(record_over_tls(recorder.address, trusting(pki, unnamed), None))
        assert silent == grpc.StatusCode.UNAUTHENTICATED
        samples = metric_samples(scrape_metrics(metrics_port), "splitstream_recorder_unauthenticated_calls_total")
        assert sum(value for labels, value in samples if labels.get("reason") == "identity") == 2

        acks, code = asyncio.run(
            record_over_tls(
                recorder.address, trusting(pki, named), recorder_pb2.RecordBatch(sequence=1, records=[record("a-1")])
            )
        )
        assert code == grpc.StatusCode.OK
        assert [ack.sequence for ack in acks] == [1]
        client = redis_server.client()
        try:
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(stream_key(MODEL)))
        finally:
            client.close()
        assert [fields[b"request_id"] for _, fields in entries] == [b"a-1"]


def test_the_allow_list_matches_the_cn_dns_sans_and_spiffe_ids_never_other_san_types(
    tmp_path: Path, pki: Pki, stack: Stack
) -> None:
    """Certificates from the recorder's own CA whose only match is an email or a non-SPIFFE URI SAN spelled
    like an allowed name are refused, and nothing they send reaches Redis (gRPC's
    ``x509_subject_alternative_name`` lists every SAN type as one: they were let through before)."""
    allowed = "router-a.example"
    spiffe = "spiffe://splitstream.test/router-b"
    certificates = {
        "dns": pki.issue("dns", names=(allowed,), common_name="evil", server=False),
        "cn": pki.issue("cn", names=("elsewhere.example",), common_name=allowed, server=False),
        "spiffe": pki.issue(
            "spiffe", names=(), common_name="evil", other_names=(x509.UniformResourceIdentifier(spiffe),), server=False
        ),
        "email": pki.issue(
            "email", names=(), common_name="evil", other_names=(x509.RFC822Name(allowed),), server=False
        ),
        "uri": pki.issue(
            "uri", names=(), common_name="evil", other_names=(x509.UniformResourceIdentifier(allowed),), server=False
        ),
        "other-spiffe": pki.issue(
            "other-spiffe",
            names=(),
            common_name="evil",
            other_names=(x509.UniformResourceIdentifier("spiffe://splitstream.test/router-c"),),
            server=False,
        ),
        "ip": pki.issue("ip", names=("10.0.0.1",), common_name="evil", server=False),
    }
    with RedisServer(tmp_path / "redis") as redis_server:
        port = free_port()
        recorder = stack.service(
            "recorder",
            "splitstream.recorder",
            [
                "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                "--redis-url", redis_server.url, "--hmac-key", HMAC_KEY,
                "--allowed-client-identities", f"{allowed},{spiffe},10.0.0.1",
                *tls_server_args(pki.issue("recorder"), mutual_ca=pki.ca),
            ],
            port=port,
            tls=trusting(pki, certificates["email"]),
        )  # fmt: skip
        outcomes = {}
        for kind, issued in certificates.items():
            call = recorder_pb2.CallRecord(
                schema_version=1, request_id=f"{kind}-1", receive_unix_ns=time.time_ns(), model=MODEL, version="v1"
            )
            call.request.inline = b"\x00"
            tls = trusting(pki, issued)
            _, status = asyncio.run(record_over_tls(recorder.address, tls, None))  # the refusal's own status
            acks, _ = asyncio.run(
                record_over_tls(recorder.address, tls, recorder_pb2.RecordBatch(sequence=1, records=[call]))
            )
            outcomes[kind] = (status, len(acks))
        client = redis_server.client()
        try:
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(stream_key(MODEL)))
        finally:
            client.close()
    assert outcomes == {
        **{kind: (grpc.StatusCode.OK, 1) for kind in ("dns", "cn", "spiffe")},
        # IP SANs are no identity either: an allow-list entry spelled as an address matches nothing.
        **{kind: (grpc.StatusCode.UNAUTHENTICATED, 0) for kind in ("email", "uri", "other-spiffe", "ip")},
    }
    assert sorted(fields[b"request_id"] for _, fields in entries) == [b"cn-1", b"dns-1", b"spiffe-1"]


def test_an_allow_list_without_mutual_tls_exits_2_naming_the_flag(tmp_path: Path, pki: Pki) -> None:
    done = launcher.run(
        [sys.executable, "-m", "splitstream.recorder", "--port", "0", "--metrics-port", "0",
         "--allowed-client-identities", "router-a", *tls_server_args(pki.issue("recorder"))],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--allowed-client-identities needs --grpc-use-ssl-mutual" in done.stderr


@pytest.mark.slow
def test_the_router_renews_its_worker_channels_when_its_client_certificate_rotates(
    tmp_path: Path, pki: Pki, stack: Stack
) -> None:
    """A worker under mutual TLS moves its trust to a new CA; the router's client certificate files are
    replaced by one the new CA issued. Calls keep succeeding through the swap (the router builds a new
    channel from the new files and drains the old one), and after the worker restarts, which forces
    every connection to handshake again, the router still reaches it: it presents the new certificate."""
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0)
    new_pki = Pki(tmp_path / "new-pki", name="new")
    client_ca = tmp_path / "worker-client-ca.pem"
    client_ca.write_bytes(pki.ca.read_bytes())
    harness_old, harness_new = pki.issue("harness-old", server=False), new_pki.issue("harness-new", server=False)
    worker = stack.worker(
        repository, MODEL, "v1", *tls_server_args(pki.issue("worker")), "--grpc-use-ssl-mutual",
        "--grpc-root-cert", str(client_ca), tls=trusting(pki, harness_old),
    )  # fmt: skip

    live = Issued(tmp_path / "router-client.pem", tmp_path / "router-client-key.pem", 0)
    first = pki.issue("router-client-old", server=False)
    rotate(live, first)
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
    router = stack.router(
        registry,
        "--upstream-tls-ca", str(pki.ca),
        "--upstream-tls-cert", str(live.cert),
        "--upstream-tls-key", str(live.key),
    )  # fmt: skip

    def renewed() -> float:
        samples = metric_samples(
            scrape_metrics(router.metrics_port), "splitstream_router_upstream_channel_renewals_total"
        )
        return sum(value for labels, value in samples if labels.get("result") == "ok")

    with SteadyLoad(router.address, MODEL, threads=2) as load:
        load.wait_calls(20)
        staging = client_ca.with_suffix(".new")
        staging.write_bytes(new_pki.ca.read_bytes())
        os.replace(staging, client_ca)  # the worker now trusts only the new CA, for new connections
        rotate(live, new_pki.issue("router-client-new", server=False))
        wait_for(lambda: renewed() >= 1, timeout_s=30, what="the router to renew its worker channel")
        load.wait_calls(20)
    assert load.errors() == []
    assert "endpoint channel renewed with the rotated client certificate" in router.log()

    # The worker refuses the old certificate now; a restart makes the router's channel reconnect.
    assert health_code(worker.address, trusting(pki, first)) == grpc.StatusCode.UNAVAILABLE
    worker.stop()
    worker.tls = trusting(pki, harness_new)
    worker.start()
    client = InferClient(router.address)

    def answered() -> bool:
        try:
            response, _ = client.infer(make_request(MODEL, np.ones((1, 4), dtype=np.float32)), timeout_s=5.0)
        except grpc.RpcError:
            return False
        return response.model_version == "v1"

    try:
        wait_for(answered, timeout_s=30, interval_s=0.5, what="the router to reach the restarted worker")
    finally:
        client.close()
