"""Authenticated callers, per-model grants, the principal in records, rate limits, and a recorder that
takes records only from authenticated routers: real redis-server, recorder, worker and routers.

Keys and certificates are made here with ``cryptography``; JWTs are signed here with PyJWT and
verified by the router against a JWKS served from a file and from a local HTTP server.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import jwt
import numpy as np
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec
from grpc import aio
from grpc_health.v1 import health_pb2

from splitstream.common.files import atomic_write
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from splitstream.common.proto.splitstream.v1 import recorder_pb2, router_pb2, router_pb2_grpc
from splitstream.common.records import PAYLOAD_DROPPED_TAG, REDACTED_OUTPUTS_TAG, stream_key
from splitstream.common.service_auth import ServiceAuth
from splitstream.recorder.validation import parse_batch
from tests import launcher
from tests.certs import Pki
from tests.harness import (
    ROOT,
    InferClient,
    ServiceProcess,
    free_port,
    health_status,
    make_request,
    metric_samples,
    run_module,
    scrape_metrics,
    wait_for,
)
from tests.recording_stack import MODEL, RecordingStack, shipper_metric

AUDIENCE = "splitstream"
ISSUER = "https://issuer.test"
SERVICE_TOKEN = "service-token-" + "7" * 32
KEYS = {
    name: f"{name}-key-{uuid.uuid4().hex}{uuid.uuid4().hex}" for name in ("web", "ops", "limited", "other", "reporter")
}
X = np.arange(4, dtype=np.float32).reshape(1, 4)


def sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def principals_document(keys: dict[str, list[str]]) -> dict[str, Any]:
    """web: the model only; ops: everything; limited: two calls then one every ~17 min; other: another
    model; jwt-user: a JWT principal (no key) allowed the model; reporter: the model and feedback."""
    return {
        "principals": {
            "web": {"api_keys_sha256": [sha256(k) for k in keys.get("web", [])], "models": [MODEL]},
            "ops": {
                "api_keys_sha256": [sha256(k) for k in keys.get("ops", [])],
                "models": ["*"],
                "pin": True,
                "status": True,
            },
            "limited": {
                "api_keys_sha256": [sha256(k) for k in keys.get("limited", [])],
                "models": [MODEL],
                "rate_limit": {"per_s": 0.001, "burst": 2},
            },
            "other": {"api_keys_sha256": [sha256(k) for k in keys.get("other", [])], "models": ["other-model"]},
            "jwt-user": {"models": [MODEL]},
            "reporter": {
                "api_keys_sha256": [sha256(k) for k in keys.get("reporter", [])],
                "models": [MODEL],
                "feedback": True,
            },
        }
    }


@dataclass
class SigningKey:
    kid: str
    private: ec.EllipticCurvePrivateKey

    @classmethod
    def new(cls, kid: str) -> SigningKey:
        return cls(kid, ec.generate_private_key(ec.SECP256R1()))

    def jwk(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.private.public_key()))
        return data | {"kid": self.kid, "alg": "ES256", "use": "sig"}

    def token(self, **claims: Any) -> str:
        now = int(time.time())
        payload = {"sub": "jwt-user", "aud": AUDIENCE, "iss": ISSUER, "iat": now, "exp": now + 600} | claims
        return jwt.encode({k: v for k, v in payload.items() if v is not None}, self.private, "ES256", {"kid": self.kid})


def jwks(*keys: SigningKey) -> str:
    return json.dumps({"keys": [key.jwk() for key in keys]})


@dataclass
class AuthStack:
    stack: RecordingStack
    principals: Path
    jwks: Path
    key_a: SigningKey

    @property
    def router(self) -> ServiceProcess:
        return self.stack.router


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthStack]:
    tmp = tmp_path_factory.mktemp("auth")
    principals = tmp / "principals.yaml"
    atomic_write(principals, yaml.safe_dump(principals_document({n: [k] for n, k in KEYS.items()})))
    key_a = SigningKey.new("key-a")
    jwks_file = tmp / "jwks.json"
    atomic_write(jwks_file, jwks(key_a))
    token_file = tmp / "service-token"
    atomic_write(token_file, SERVICE_TOKEN + "\n")
    stack = RecordingStack(
        tmp,
        recorder_args=("--service-token-file", str(token_file)),
        experiment={"salt": "auth", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
        router_args=(
            "--auth-principals", f"file:{principals}",
            "--jwt-jwks", f"file:{jwks_file}",
            "--jwt-audience", AUDIENCE,
            "--jwt-issuer", ISSUER,
            "--jwks-min-refresh-s", "0",
            "--service-token-file", str(token_file),
            "--log-level", "DEBUG",
        ),
    )  # fmt: skip
    try:
        yield AuthStack(stack, principals, jwks_file, key_a)
    finally:
        stack.close()


def call(
    router: ServiceProcess, *, key: str = "", token: str = "", version: str = "", model: str = MODEL, rid: str = ""
) -> tuple[grpc.StatusCode, str]:
    metadata = [("x-api-key", key)] if key else []
    if token:
        metadata.append(("authorization", f"Bearer {token}"))
    client = InferClient(router.address)
    try:
        client.infer(make_request(model, X, version=version, request_id=rid), metadata=metadata)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    finally:
        client.close()


def metric(process: ServiceProcess, name: str, **labels: str) -> float:
    samples = metric_samples(scrape_metrics(process.metrics_port), name)
    return sum(value for sample_labels, value in samples if labels.items() <= sample_labels.items())


def logged_detail(router: ServiceProcess, details: str) -> str:
    """The refusal's detail, which the caller is not told: found in the router's log under the request id
    the caller's answer carries."""
    match = re.search(r"\(request id (\S+);", details)
    assert match, details
    rid = match[1]

    def line() -> dict[str, Any] | None:
        for text in router.log().splitlines():
            if rid in text and "gRPC call refused" in text:
                event: dict[str, Any] = json.loads(text)
                return event
        return None

    event = wait_for(line, timeout_s=10, what="the refusal's log line")
    assert event["request_id"] == rid
    return str(event["detail"])


# -- API keys ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_call_without_credentials_is_unauthenticated_and_counted(auth: AuthStack) -> None:
    code, details = call(auth.router)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "x-api-key" in details
    assert "Bearer" in details
    assert metric(auth.router, "splitstream_router_auth_failures_total", code="UNAUTHENTICATED", reason="missing") >= 1


def test_a_wrong_api_key_is_unauthenticated_and_the_message_never_quotes_it(auth: AuthStack) -> None:
    wrong = "not-a-key-" + uuid.uuid4().hex
    code, details = call(auth.router, key=wrong)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in logged_detail(auth.router, details)
    assert wrong not in details


def test_a_granted_key_is_served_and_health_stays_open_without_credentials(auth: AuthStack) -> None:
    assert call(auth.router, key=KEYS["web"]) == (grpc.StatusCode.OK, "")
    assert health_status(auth.router.address) == health_pb2.HealthCheckResponse.SERVING


def test_a_principal_not_granted_the_model_is_permission_denied(auth: AuthStack) -> None:
    code, details = call(auth.router, key=KEYS["other"])
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "'other'" not in details  # principal names are the configuration's
    detail = logged_detail(auth.router, details)
    assert "'other'" in detail
    assert f"'{MODEL}'" in detail
    assert metric(auth.router, "splitstream_router_auth_failures_total", reason="model") >= 1


def test_model_metadata_needs_the_model_grant_too(auth: AuthStack) -> None:
    with grpc.insecure_channel(auth.router.address) as channel:
        stub = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelMetadata",
            request_serializer=oip.ModelMetadataRequest.SerializeToString,
            response_deserializer=oip.ModelMetadataResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub(oip.ModelMetadataRequest(name=MODEL), metadata=[("x-api-key", KEYS["other"])], timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        answer = stub(oip.ModelMetadataRequest(name=MODEL), metadata=[("x-api-key", KEYS["web"])], timeout=10)
        assert answer.name == MODEL


@pytest.mark.parametrize("pin", ["header", "model_version"])
def test_pinning_a_version_needs_the_pin_grant(auth: AuthStack, pin: str) -> None:
    def pinned(key: str) -> tuple[grpc.StatusCode, str]:
        client = InferClient(auth.router.address)
        metadata = [("x-api-key", key)] + ([("x-splitstream-version", "v1")] if pin == "header" else [])
        request = make_request(MODEL, X, version="v1" if pin == "model_version" else "")
        try:
            client.infer(request, metadata=metadata)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        finally:
            client.close()

    code, details = pinned(KEYS["web"])
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "pin" in details
    assert "'web'" in logged_detail(auth.router, details)
    assert pinned(KEYS["ops"]) == (grpc.StatusCode.OK, "")


def test_status_needs_the_status_grant(auth: AuthStack) -> None:
    """Status holds experiment salts and worker addresses: not for every caller."""
    with grpc.insecure_channel(auth.router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for metadata in ([], [("x-api-key", KEYS["web"])]):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Status(router_pb2.StatusRequest(), metadata=metadata, timeout=10)
            expected = grpc.StatusCode.PERMISSION_DENIED if metadata else grpc.StatusCode.UNAUTHENTICATED
            assert refused.value.code() == expected
        status = stub.Status(router_pb2.StatusRequest(), metadata=[("x-api-key", KEYS["ops"])], timeout=10)
        assert status.models[0].experiment.salt == "auth"


def test_two_credentials_at_once_are_refused(auth: AuthStack) -> None:
    code, details = call(auth.router, key=KEYS["web"], token=auth.key_a.token())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "one credential" in details


def test_over_its_rate_limit_a_principal_gets_resource_exhausted_counted_under_its_name(auth: AuthStack) -> None:
    codes = [call(auth.router, key=KEYS["limited"])[0] for _ in range(4)]
    assert codes[:2] == [grpc.StatusCode.OK, grpc.StatusCode.OK]
    assert codes[2:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert metric(auth.router, "splitstream_router_auth_rate_limited_total", principal="limited") == 2
    # Other principals keep their own buckets.
    assert call(auth.router, key=KEYS["web"])[0] == grpc.StatusCode.OK


def test_an_api_key_file_edited_live_admits_a_new_key_and_refuses_a_removed_one_without_restart(
    auth: AuthStack,
) -> None:
    new_key = "fresh-" + uuid.uuid4().hex * 2
    keys = {n: [k] for n, k in KEYS.items()}
    keys["web"] = [KEYS["web"], new_key]
    atomic_write(auth.principals, yaml.safe_dump(principals_document(keys)))
    wait_for(lambda: call(auth.router, key=new_key)[0] == grpc.StatusCode.OK, timeout_s=20, what="the new key")
    keys["web"] = [new_key]
    atomic_write(auth.principals, yaml.safe_dump(principals_document(keys)))
    wait_for(
        lambda: call(auth.router, key=KEYS["web"])[0] == grpc.StatusCode.UNAUTHENTICATED,
        timeout_s=20,
        what="the removed key to be refused",
    )
    # A broken save keeps the last good document: the new key still works.
    auth.principals.write_text("principals: {web: {models: [x], pim: true}}\n")
    wait_for(lambda: metric(auth.router, "splitstream_router_auth_reloads_total", result="error") >= 1, timeout_s=20)
    assert call(auth.router, key=new_key)[0] == grpc.StatusCode.OK
    atomic_write(auth.principals, yaml.safe_dump(principals_document({n: [k] for n, k in KEYS.items()})))
    wait_for(lambda: call(auth.router, key=KEYS["web"])[0] == grpc.StatusCode.OK, timeout_s=20, what="restore")


# -- JWTs ----------------------------------------------------------------------------------------------


def test_a_valid_jwt_is_served(auth: AuthStack) -> None:
    assert call(auth.router, token=auth.key_a.token()) == (grpc.StatusCode.OK, "")


@pytest.mark.parametrize(
    ("claims", "problem"),
    [
        ({"exp": int(time.time()) - 3600}, "expired"),
        ({"nbf": int(time.time()) + 3600}, "not valid yet"),
        ({"aud": "someone-else"}, "audience"),
        ({"iss": "https://evil.test"}, "issuer"),
        ({"exp": None}, "'exp'"),
    ],
    ids=["expired", "nbf-future", "wrong-aud", "wrong-iss", "no-exp"],
)
def test_a_jwt_that_fails_a_claim_check_is_unauthenticated_naming_the_claim(
    auth: AuthStack, claims: dict[str, Any], problem: str
) -> None:
    """The caller is told only that its credential is not valid: the audience and issuer the router wants are
    its configuration (which a caller probing it would learn); the log says which check failed."""
    token = auth.key_a.token(**claims)
    code, details = call(auth.router, token=token)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert problem not in details
    for setting in (AUDIENCE, ISSUER, "ES256", "RS256", "aud", "iss"):
        assert setting not in details
    assert problem in logged_detail(auth.router, details)
    assert token not in details
    assert token.split(".")[2] not in auth.router.log()


def test_an_unsigned_jwt_and_a_forged_signature_are_refused(auth: AuthStack) -> None:
    header = base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT"}').rstrip(b"=").decode()
    body = auth.key_a.token().split(".")[1]
    code, details = call(auth.router, token=f"{header}.{body}.")
    assert (code, "ES256" in details, "RS256" in details) == (grpc.StatusCode.UNAUTHENTICATED, False, False)
    assert "algorithm" in logged_detail(auth.router, details)
    impostor = SigningKey(auth.key_a.kid, ec.generate_private_key(ec.SECP256R1()))  # same kid, other key
    code, details = call(auth.router, token=impostor.token())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "signature" in logged_detail(auth.router, details)


def test_a_jwt_principal_missing_from_the_document_is_permission_denied(auth: AuthStack) -> None:
    code, details = call(auth.router, token=auth.key_a.token(sub="stranger"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "stranger" not in details
    assert "'stranger'" in logged_detail(auth.router, details)


def test_a_token_signed_with_a_key_published_later_is_accepted_once_the_jwks_holds_it(auth: AuthStack) -> None:
    key_b = SigningKey.new("key-b")
    code, details = call(auth.router, token=key_b.token())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "unknown kid" in logged_detail(auth.router, details)
    atomic_write(auth.jwks, jwks(auth.key_a, key_b))  # rotation: the issuer publishes key-b
    assert call(auth.router, token=key_b.token()) == (grpc.StatusCode.OK, "")
    assert call(auth.router, token=auth.key_a.token()) == (grpc.StatusCode.OK, "")


class _JwksServer(BaseHTTPRequestHandler):
    keys: str = ""
    authorization: str = ""

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != self.authorization:
            self.send_response(401)
            self.end_headers()
            return
        body = self.keys.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_jwks_served_over_http_with_credentials_verifies_tokens_and_follows_rotation(
    auth: AuthStack, tmp_path: Path
) -> None:
    key_c, key_d = SigningKey.new("key-c"), SigningKey.new("key-d")
    password = "jwks-pass-" + uuid.uuid4().hex
    handler: Any = type("Handler", (_JwksServer,), {"keys": jwks(key_c)})
    handler.authorization = "Basic " + base64.b64encode(f"reader:{password}".encode()).decode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        router = auth.stack.stack.router(
            auth.stack.registry,
            "--auth-principals", f"file:{auth.principals}",
            "--jwt-jwks", f"http://reader:{password}@127.0.0.1:{server.server_port}/jwks.json",
            "--jwt-audience", AUDIENCE,
            "--jwt-issuer", ISSUER,
            "--jwks-min-refresh-s", "0",
            "--log-level", "DEBUG",
        )  # fmt: skip
        token_c = key_c.token()
        assert call(router, token=token_c) == (grpc.StatusCode.OK, "")
        assert call(router, token=token_c) == (grpc.StatusCode.OK, "")  # remembered: no second signature check
        assert call(router, token=key_d.token())[0] == grpc.StatusCode.UNAUTHENTICATED
        handler.keys = jwks(key_d)  # key-c retired, key-d published
        assert call(router, token=key_d.token()) == (grpc.StatusCode.OK, "")
        # The set was re-read: the token key-c signed is no longer taken, remembered or not.
        code, details = call(router, token=token_c)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "unknown kid" in logged_detail(router, details)
        router.stop()
        assert password not in router.log()
        # The URL's password was on the command line (ps shows it): the deprecation warning, as for --redis-url.
        (warning,) = [
            event["detail"]
            for event in map(json.loads, filter(lambda line: line.startswith("{"), router.log().splitlines()))
            if event.get("event") == "secret on the command line (deprecated)"
        ]
        assert "--jwt-jwks on the command line" in warning
        assert "SPLITSTREAM_ROUTER_JWT_JWKS" in warning
    finally:
        server.shutdown()
        server.server_close()


# -- what is recorded ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_principal_is_recorded_never_its_credential_and_filters_a_replay(auth: AuthStack, tmp_path: Path) -> None:
    web_ids = {f"web-{uuid.uuid4().hex}" for _ in range(3)}
    ops_ids = {f"ops-{uuid.uuid4().hex}" for _ in range(2)}
    for rid in web_ids:
        assert call(auth.router, key=KEYS["web"], rid=rid)[0] == grpc.StatusCode.OK
    for rid in ops_ids:
        assert call(auth.router, key=KEYS["ops"], rid=rid)[0] == grpc.StatusCode.OK
    jwt_id = f"jwt-{uuid.uuid4().hex}"
    token = auth.key_a.token()
    assert call(auth.router, token=token, rid=jwt_id)[0] == grpc.StatusCode.OK
    records = {r.request_id: r for r in auth.stack.wait_recorded(web_ids | ops_ids | {jwt_id})}
    assert {records[rid].principal for rid in web_ids} == {"web"}
    assert {records[rid].principal for rid in ops_ids} == {"ops"}
    assert records[jwt_id].principal == "jwt-user"
    assert not {"x-api-key", "authorization"} & set(records[jwt_id].metadata)
    stored = auth.stack.redis_bytes()
    assert not any(key.encode() in stored for key in KEYS.values())
    assert token.encode() not in stored
    assert token.split(".")[2].encode() not in stored
    client: Any = auth.stack.redis.client()  # binary replies; redis-py's stubs cannot say so
    try:
        fields = [f for _, f in client.xrange(stream_key(MODEL))]
    finally:
        client.close()
    assert {f[b"principal"] for f in fields if f[b"request_id"].decode() in ops_ids} == {b"ops"}

    key_file = tmp_path / "replay-key"
    key_file.write_text(KEYS["ops"] + "\n")
    out = tmp_path / "replay"
    done = launcher.run(
        [
            sys.executable, "-m", "splitstream.replayer",
            "--redis-url", auth.stack.redis.url, "--model", MODEL, "--since", "-10m",
            "--target", auth.router.address, "--principal", "ops", "--api-key-file", str(key_file),
            "--output-dir", str(out), "--no-progress",
        ],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    replayed = {r["request_id"] for r in results}
    assert ops_ids <= replayed
    assert not replayed & (web_ids | {jwt_id})
    assert {r["outcome"] for r in results if r["request_id"] in ops_ids} == {"match"}


def test_a_token_stream_records_its_principal_like_a_call(auth: AuthStack) -> None:
    rid = f"stream-{uuid.uuid4().hex}"
    request = make_request(MODEL, X, request_id=rid).SerializeToString()
    with grpc.insecure_channel(auth.router.address) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        responses = list(stream(iter([request]), metadata=[("x-api-key", KEYS["ops"])], timeout=30))
    assert len(responses) == 1  # a tensor model answers a streamed request once, marked final
    records = [r for r in auth.stack.wait_recorded({rid}) if r.request_id == rid]  # earlier tests' too
    assert records  # at least once: a resent batch may hold it twice
    assert all(record.HasField("stream") and record.principal == "ops" for record in records)


def test_no_key_or_token_reaches_the_router_s_log(auth: AuthStack) -> None:
    call(auth.router, key=KEYS["web"])
    call(auth.router, key=KEYS["other"])
    log = auth.router.log()
    assert not any(key in log for key in KEYS.values())
    assert SERVICE_TOKEN not in log
    assert SERVICE_TOKEN not in auth.stack.recorder.log()


# -- the recorder takes records only from authenticated routers -----------------------------------------


def forged(request_id: str, *, model: str = "evil:model", **tags: str) -> recorder_pb2.CallRecord:
    record = recorder_pb2.CallRecord(
        schema_version=1, request_id=request_id, receive_unix_ns=time.time_ns(), model=model, version="v1"
    )
    record.request.inline = oip.ModelInferRequest(model_name=model, id=request_id).SerializeToString()
    record.tags.update(tags)
    return record


async def send_records(
    address: str, token: str | None, *batches: recorder_pb2.RecordBatch
) -> tuple[list[Any], grpc.StatusCode]:
    """Send batches on one stream, each after the previous one's ack; the acks and the stream's final status.

    A stream the recorder ends while the client is still writing fails the write on the client's side
    (INTERNAL "Failed execute_batch"): the status the recorder gave is the call's, read after it."""
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    async with aio.insecure_channel(address) as channel:
        stream = channel.stream_stream(
            "/splitstream.v1.Recorder/Record", response_deserializer=recorder_pb2.RecordAck.FromString
        )(metadata=metadata)
        acks = []
        try:
            for item in batches:
                await stream.write(item.SerializeToString())
                ack = await stream.read()
                if ack is aio.EOF:
                    break
                acks.append(ack)
            await stream.done_writing()
        except (aio.AioRpcError, asyncio.InvalidStateError):
            pass
        return acks, await stream.code()


async def status_without_writing(address: str, token: str | None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    async with aio.insecure_channel(address) as channel:
        stream = channel.stream_stream("/splitstream.v1.Recorder/Record")(metadata=metadata)
        code: grpc.StatusCode = await stream.code()
        return code


@pytest.mark.parametrize("token", [None, "wrong-token-" + "x" * 20, SERVICE_TOKEN[:-1]], ids=["none", "wrong", "near"])
def test_forged_records_are_refused_before_a_byte_reaches_redis(auth: AuthStack, token: str | None) -> None:
    """The status is read on a stream that sends nothing (one that is still writing when the recorder ends
    it may see its own write fail, INTERNAL, instead); the forged stream's refusal shows in the recorder's
    count and in Redis, where nothing of it is."""
    recorder = auth.stack.recorder
    reason = "missing" if token is None else "invalid"
    refused_before = metric(recorder, "splitstream_recorder_unauthenticated_calls_total", reason=reason)
    assert asyncio.run(status_without_writing(recorder.address, token)) == grpc.StatusCode.UNAUTHENTICATED
    client = auth.stack.redis.client()
    try:
        keys_before = client.dbsize()
        batches = [
            recorder_pb2.RecordBatch(sequence=n, records=[forged(f"forged-{n}-{i}") for i in range(500)])
            for n in range(1, 5)
        ]
        acks, code = asyncio.run(send_records(recorder.address, token, *batches))
        assert acks == []
        assert code != grpc.StatusCode.OK
        assert client.dbsize() == keys_before
        assert not client.exists(stream_key("evil:model"))
    finally:
        client.close()
    # The router's own records keep arriving meanwhile, so the model's stream is searched, not counted.
    assert b"forged-" not in auth.stack.redis_bytes()
    refused = metric(recorder, "splitstream_recorder_unauthenticated_calls_total", reason=reason) - refused_before
    assert refused == 2


def test_with_the_token_reserved_tags_and_impossible_records_are_rejected_one_by_one(auth: AuthStack) -> None:
    good = forged("with-token-ok", model=MODEL, **{PAYLOAD_DROPPED_TAG: "response:12"})
    bad = [
        forged("reserved-tag", model=MODEL, **{REDACTED_OUTPUTS_TAG: "y"}),
        forged("other-reserved", model=MODEL, **{"splitstream.anything": "1"}),
        forged("star-model", model="*"),
    ]
    late = forged("far-future", model=MODEL)
    late.receive_unix_ns = time.time_ns() + 30 * 86_400 * 10**9
    negative = forged("negative-latency", model=MODEL)
    negative.latency_ns = -5
    batch = recorder_pb2.RecordBatch(sequence=7, records=[good, *bad, late, negative])
    (ack,), code = asyncio.run(send_records(auth.stack.recorder.address, SERVICE_TOKEN, batch))
    assert code == grpc.StatusCode.OK
    assert ack.written == 1
    reasons = {r.request_id: r.reason for r in ack.rejected}
    assert REDACTED_OUTPUTS_TAG in reasons["reserved-tag"]
    assert "reserved" in reasons["reserved-tag"]
    assert "splitstream.anything" in reasons["other-reserved"]
    assert "'*'" in reasons["star-model"]
    assert "ahead" in reasons["far-future"]
    assert "negative" in reasons["negative-latency"]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"tags": {REDACTED_OUTPUTS_TAG: "y"}}, "reserved to the recorder"),
        ({"model": "a*"}, "'*'"),
        ({"latency_ns": -1}, "cannot be negative"),
        ({"receive_unix_ns": 1_000_000}, "before the year 2000"),
    ],
)
def test_records_a_router_could_never_make_are_named_in_the_rejection(change: dict[str, Any], problem: str) -> None:
    record = forged("x", model="m")
    for field, value in change.items():
        if field == "tags":
            record.tags.update(value)
        else:
            setattr(record, field, value)
    parsed = parse_batch(
        recorder_pb2.RecordBatch(sequence=1, records=[record]).SerializeToString(), decode_requests=False
    )
    (rejection,) = parsed.rejected
    assert problem in rejection.reason


def test_a_verified_client_certificate_identity_is_allowed_only_when_listed(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    auth = ServiceAuth(allowed_identities=frozenset({"router-a.splitstream"}))
    named = pki.issue("a", names=("router-a.splitstream",), server=False).cert.read_bytes()
    other = pki.issue("b", names=("router-b.splitstream",), server=False).cert.read_bytes()
    assert auth.identity_allowed({"x509_pem_cert": [named]})
    assert not auth.identity_allowed({"x509_pem_cert": [other]})
    # gRPC's SAN property lists every SAN type as one: it is never read.
    assert not auth.identity_allowed({"x509_subject_alternative_name": [b"router-a.splitstream"]})
    assert not auth.identity_allowed({})


# -- configuration ---------------------------------------------------------------------------------------


JWT_CLAIMS = ("--jwt-audience", AUDIENCE, "--jwt-issuer", ISSUER)


@pytest.mark.parametrize(
    ("extra", "document", "problem"),
    [
        (["--jwt-jwks", "file:{jwks}", *JWT_CLAIMS], None, "--jwt-jwks needs --auth-principals"),
        (["--jwt-jwks", "file:{jwks}", "--jwt-issuer", ISSUER], {}, "--jwt-audience"),
        (
            ["--jwt-jwks", "file:{jwks}", "--jwt-audience", "a", "--jwt-issuer", "i", "--jwt-algorithms", "none"],
            {},
            "none",
        ),
        (
            ["--jwt-jwks", "file:{jwks}", "--jwt-audience", "a", "--jwt-issuer", "i", "--jwt-algorithms", "HS256"],
            {},
            "HS256",
        ),
        ([], {"principals": {"web": {"models": ["m"], "pim": True}}}, "principals.web.pim"),
        ([], {"principals": {"web": {"api_keys_sha256": ["abc"]}}}, "SHA-256"),
        # A digest with a newline after it matched ``$`` and was loaded: a key no caller's hash could ever equal.
        ([], {"principals": {"web": {"api_keys_sha256": ["a" * 64 + "\n"]}}}, "SHA-256"),
        (["--record-credential-headers"], {}, "--record-credential-headers"),
    ],
    ids=[
        "jwt-alone",
        "no-audience",
        "alg-none",
        "alg-hs256",
        "typo",
        "bad-digest",
        "digest-newline",
        "credential-headers",
    ],
)
def test_bad_auth_settings_exit_2_with_one_line(
    tmp_path: Path, extra: list[str], document: dict[str, Any] | None, problem: str
) -> None:
    registry = tmp_path / "registry.yaml"
    registry.write_text("models: {}\n")
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(jwks(SigningKey.new("k")))
    args = ["--registry", f"file:{registry}", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    args += [arg.format(jwks=jwks_file) for arg in extra]
    if document is not None:
        principals = tmp_path / "principals.yaml"
        principals.write_text(yaml.safe_dump(document or principals_document({})))
        args += ["--auth-principals", f"file:{principals}"]
    done = launcher.run(
        [sys.executable, "-m", "splitstream.router", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert problem in lines[-1], done.stderr
    assert lines[-1].startswith("splitstream-router: error:")


def test_a_service_token_too_short_to_be_a_secret_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("changeme\n")
    done = launcher.run(
        [sys.executable, "-m", "splitstream.recorder", "--service-token-file", str(token), "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    assert "at least 16" in done.stderr
    assert "changeme" not in done.stderr


def test_principals_from_a_consul_kv_key_follow_its_changes_without_restart(auth: AuthStack, tmp_path: Path) -> None:
    from tests.consul_emulator import ConsulEmulator

    key = "splitstream/auth/principals"
    with ConsulEmulator(tmp_path / "consul", token="consul-acl-token") as consul:
        client = consul.client()
        client.kv.put(key, json.dumps(principals_document({"web": [KEYS["web"]]})))
        router = auth.stack.stack.router(
            auth.stack.registry, "--auth-principals", f"{consul.spec}/{key}", env=consul.env
        )
        assert call(router, key=KEYS["web"]) == (grpc.StatusCode.OK, "")
        assert call(router, key=KEYS["ops"])[0] == grpc.StatusCode.UNAUTHENTICATED
        client.kv.put(key, json.dumps(principals_document({"ops": [KEYS["ops"]]})))
        wait_for(lambda: call(router, key=KEYS["ops"])[0] == grpc.StatusCode.OK, timeout_s=20, what="the new key")
        assert call(router, key=KEYS["web"])[0] == grpc.StatusCode.UNAUTHENTICATED
        router.stop()


async def test_each_request_of_a_token_stream_is_checked_for_its_model_and_pin(tmp_path: Path) -> None:
    """The router's interceptor in front of a stream handler that answers each request with its bytes:
    ModelStreamInfer is admitted as a whole, then every request is checked before the handler sees it."""
    from prometheus_client import CollectorRegistry

    from splitstream.router.auth.credentials import FilePrincipals, PrincipalsStore
    from splitstream.router.auth.interceptor import Authenticator, AuthInterceptor, AuthMetrics
    from splitstream.router.auth.ratelimit import RateLimiter

    principals = tmp_path / "principals.yaml"
    principals.write_text(yaml.safe_dump(principals_document({"web": [KEYS["web"]]})))
    store = PrincipalsStore(FilePrincipals(str(principals)), on_update=lambda policy, error: None)
    await store.load()
    interceptor = AuthInterceptor(
        Authenticator(store, jwt=None, api_keys=True, limiter=RateLimiter()), AuthMetrics(CollectorRegistry())
    )
    seen: list[bytes] = []

    async def echo(requests: Any, context: aio.ServicerContext[bytes, bytes]) -> Any:
        async for request in requests:
            seen.append(request)
            yield request

    server = aio.server(interceptors=[interceptor])
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService", {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(echo)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")

            async def stream(metadata: tuple[tuple[str, str], ...], *requests: Any) -> tuple[int, Any, str]:
                call = method((r.SerializeToString() for r in requests), metadata=metadata)
                answered = 0
                try:
                    async for _ in call:
                        answered += 1
                except aio.AioRpcError as error:
                    return answered, error.code(), error.details() or ""
                return answered, grpc.StatusCode.OK, ""

            allowed = oip.ModelInferRequest(model_name=MODEL)
            key = (("x-api-key", KEYS["web"]),)
            answered, code, details = await stream((), allowed)
            assert (answered, code) == (0, grpc.StatusCode.UNAUTHENTICATED)
            assert "x-api-key" in details
            assert await stream(key, allowed, allowed) == (2, grpc.StatusCode.OK, "")
            answered, code, details = await stream(key, allowed, oip.ModelInferRequest(model_name="other-model"))
            assert (answered, code) == (1, grpc.StatusCode.PERMISSION_DENIED)
            assert "may not call this model" in details
            answered, code, details = await stream(
                key, allowed, oip.ModelInferRequest(model_name=MODEL, model_version="v1")
            )
            assert (answered, code) == (1, grpc.StatusCode.PERMISSION_DENIED)
            assert "pin" in details
        assert all(router_pb2.InferRequestHead.FromString(r).model_name == MODEL for r in seen)
        assert not any(router_pb2.InferRequestHead.FromString(r).model_version for r in seen)
    finally:
        await server.stop(None)
        await store.close()


def test_a_router_without_the_recorder_s_token_keeps_its_records_in_its_log_and_says_why(
    auth: AuthStack, tmp_path: Path
) -> None:
    """A token missing on one router is an outage to fix, not a reason to lose its records."""
    router = auth.stack.start_router("--log-dir", str(tmp_path / "spool"))
    for n in range(5):
        assert call(router, rid=f"untokened-{n}")[0] == grpc.StatusCode.OK
    wait_for(
        lambda: (
            shipper_metric(auth.stack, "log_entries_total", kind="call") >= 5
            and shipper_metric(auth.stack, "log_pending_bytes") > 0
            # The refusal is logged when the shipper's stream is answered, which can come
            # after the entries are read and counted: wait for the line rather than race it.
            and "UNAUTHENTICATED: no service token" in router.log()
        ),
        timeout_s=30,
        what="the shipper to read the records, keep them in the log and say why",
    )
    assert shipper_metric(auth.stack, "records_dropped_total") == 0
    assert b"untokened-" not in auth.stack.redis_bytes()
    router.stop()


def test_bytes_that_are_no_request_are_unauthenticated_without_a_key_and_invalid_with_one(auth: AuthStack) -> None:
    """Authentication comes first: an anonymous caller learns nothing, not even what the router parses."""
    with grpc.insecure_channel(auth.router.address) as channel:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as anonymous:
            raw(b"\xff\xff\xff", timeout=10)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as known:
            raw(b"\xff\xff\xff", metadata=[("x-api-key", KEYS["web"])], timeout=10)
        assert known.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "inference.ModelInferRequest" in (known.value.details() or "")


def refused(router: ServiceProcess, metadata: list[tuple[str, str]], model: str = MODEL) -> Any:
    """The error of a ModelInfer, read as a client reads it (code, text and trailers); None when served."""
    with grpc.insecure_channel(router.address) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(make_request(model, X), metadata=metadata, timeout=10)
        except grpc.RpcError as error:
            return error
    return None


def trailer_request_id(error: Any) -> str:
    (value,) = [v for k, v in error.trailing_metadata() or () if k == "x-request-id"]
    return str(value)


def test_feedback_import_sends_its_api_key_to_a_router_that_authenticates(auth: AuthStack, tmp_path: Path) -> None:
    """Feedback/Report needs the feedback grant, and feedback import sent no credential: every import to such a
    router was refused UNAUTHENTICATED. It sends --api-key-file's key (or SPLITSTREAM_ADMIN_API_KEY's)."""
    events = tmp_path / "outcomes.csv"
    events.write_text(f"model,request_id,metric,value\n{MODEL},fb-import-1,conversion,1\n")
    key_file = tmp_path / "reporter-key"
    key_file.write_text(KEYS["reporter"] + "\n")
    command = ("splitstream.admin", "feedback", "import", str(events), "--router", auth.router.address)
    anonymous = run_module(*command, timeout_s=60)
    assert anonymous.returncode == 1, anonymous.stderr
    assert "UNAUTHENTICATED" in anonymous.stderr
    sent = run_module(*command, "--api-key-file", str(key_file), timeout_s=60)
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.strip() == f"{events}: 1 events read, 1 accepted, 0 rejected"
    assert KEYS["reporter"] not in sent.stdout + sent.stderr


# Last in the file: it takes the "limited" principal past its burst, which the test above counts from.
def test_every_refusal_carries_its_request_id_in_the_trailing_metadata(auth: AuthStack) -> None:
    """A client reads the id from the trailers, as from an answered call's, without parsing the text: the id
    it sent, else the one the router made, which the text of an UNAUTHENTICATED or PERMISSION_DENIED repeats
    and the log files the reason under. Before, only the text had it."""
    sent = refused(auth.router, [("x-request-id", "refused-sent-id")])
    assert sent.code() == grpc.StatusCode.UNAUTHENTICATED
    assert trailer_request_id(sent) == "refused-sent-id"
    assert "(request id refused-sent-id;" in sent.details()
    wrong = refused(auth.router, [("x-api-key", "wrong-" + uuid.uuid4().hex)])
    made = trailer_request_id(wrong)
    assert f"(request id {made};" in wrong.details()
    assert logged_detail(auth.router, wrong.details())
    denied = refused(auth.router, [("x-api-key", KEYS["other"]), ("x-request-id", "denied-id")])
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert trailer_request_id(denied) == "denied-id"
    # The bucket holds 2, refilled once in 1000 s: the third call at most is refused.
    attempts = (
        refused(auth.router, [("x-api-key", KEYS["limited"]), ("x-request-id", f"limited-{n}")]) for n in range(3)
    )
    limited = next(error for error in attempts if error is not None)
    assert limited.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailer_request_id(limited).startswith("limited-")
