"""Callers on the router's HTTP port: API keys (``Authorization: Bearer``, as OpenAI's clients send them)
and JWTs, per-model grants, rate limits and the filtered model list, checked by the same gate as gRPC.

Real processes: two generating workers and a router with ``--http-port`` and ``--auth-principals``,
called with the official ``openai`` client and with raw HTTP requests. JWTs are signed here with PyJWT
and verified by the router against a JWKS file.
"""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml

from demo import language
from splitstream.common.files import atomic_write
from tests.harness import ServiceProcess, Stack, free_port, metric_samples, scrape_metrics, wait_for, write_registry
from tests.streams import StreamClient, generation_request
from tests.test_auth import AUDIENCE, ISSUER, SigningKey, jwks, sha256
from tests.test_router_http import accepts

MODEL = "writer"
#: A model the registry lists that only ``ops`` may call (its endpoint serves nobody: only listed).
SECRET = "secret-model"
KEYS = {name: f"sk-{name}-{uuid.uuid4().hex}{uuid.uuid4().hex}" for name in ("web", "ops", "limited", "other")}


def principals_document() -> dict[str, Any]:
    """web: the model only; ops: everything, pin; limited: the model, two calls then one every ~17 min;
    other: another model only; jwt-user: a JWT principal allowed the model."""
    return {
        "principals": {
            "web": {"api_keys_sha256": [sha256(KEYS["web"])], "models": [MODEL]},
            "ops": {"api_keys_sha256": [sha256(KEYS["ops"])], "models": ["*"], "pin": True},
            "limited": {
                "api_keys_sha256": [sha256(KEYS["limited"])],
                "models": [MODEL],
                "rate_limit": {"per_s": 0.001, "burst": 2},
            },
            "other": {"api_keys_sha256": [sha256(KEYS["other"])], "models": ["other-model"]},
            "jwt-user": {"models": [MODEL]},
        }
    }


@dataclass
class AuthHttp:
    stack: Stack
    registry: Path
    router: ServiceProcess
    http_port: int
    key: SigningKey
    router_args: tuple[str, ...]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def client(self, api_key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthHttp]:
    tmp = tmp_path_factory.mktemp("http-auth")
    language.write_versions(tmp / "models", MODEL, generation={"max_tokens_limit": 1_000_000})
    principals = tmp / "principals.yaml"
    atomic_write(principals, yaml.safe_dump(principals_document()))
    key = SigningKey.new("key-a")
    jwks_file = tmp / "jwks.json"
    atomic_write(jwks_file, jwks(key))
    stack = Stack(tmp)
    try:
        workers = {version: stack.worker(tmp / "models", MODEL, version) for version in language.ORDERS}
        registry = tmp / "registry.yaml"
        experiment = {
            "salt": "http-auth",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        }
        write_registry(
            registry,
            {
                MODEL: {"endpoints": {v: [w.address] for v, w in workers.items()}, "experiment": experiment},
                SECRET: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}},
            },
        )
        router_args = (
            "--auth-principals", f"file:{principals}",
            "--jwt-jwks", f"file:{jwks_file}",
            "--jwt-audience", AUDIENCE,
            "--jwt-issuer", ISSUER,
            "--log-level", "DEBUG",
        )  # fmt: skip
        http_port = free_port()
        router = stack.router(registry, "--http-port", str(http_port), *router_args)
        wait_for(lambda: accepts(http_port), timeout_s=10, what="the HTTP port to accept")
        yield AuthHttp(stack, registry, router, http_port, key, router_args)
    finally:
        stack.close()


def request(
    port: int, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPMessage, Any]:
    """A raw request (POST with ``body``, else GET): (status, headers, JSON body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(
            "POST" if body is not None else "GET",
            path,
            json.dumps(body) if body is not None else None,
            {"Content-Type": "application/json", **(headers or {})},
        )
        response = connection.getresponse()
        return response.status, response.headers, json.loads(response.read())
    finally:
        connection.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def metric(process: ServiceProcess, name: str, **labels: str) -> float:
    samples = metric_samples(scrape_metrics(process.metrics_port), name)
    return sum(value for sample_labels, value in samples if labels.items() <= sample_labels.items())


COMPLETION = {"model": MODEL, "prompt": "The ", "max_tokens": 3}


# -- 401 ------------------------------------------------------------------------------------------------


def test_without_a_key_the_openai_client_gets_a_401_invalid_api_key(deployment: AuthHttp) -> None:
    before = metric(deployment.router, "splitstream_router_auth_failures_total", reason="missing")
    with pytest.raises(openai.AuthenticationError) as caught:
        deployment.client("never-sent").completions.create(
            model=MODEL, prompt="The ", max_tokens=3, extra_headers={"Authorization": openai.Omit()}
        )
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert caught.value.response.headers["www-authenticate"] == "Bearer"
    assert caught.value.response.headers["x-request-id"]
    status, headers, body = request(deployment.http_port, "/v1/completions", COMPLETION)
    assert status == 401
    assert headers["WWW-Authenticate"] == "Bearer"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_api_key"
    assert metric(deployment.router, "splitstream_router_auth_failures_total", reason="missing") == before + 2


def test_a_wrong_key_is_a_401_whose_answer_says_nothing_of_the_key_or_the_configuration(
    deployment: AuthHttp,
) -> None:
    wrong = "sk-wrong-" + uuid.uuid4().hex
    with pytest.raises(openai.AuthenticationError) as caught:
        deployment.client(wrong).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}])
    assert caught.value.code == "invalid_api_key"
    answer = caught.value.response.text
    for secret in (wrong, "x-api-key", "JWT", "principal", "jwks"):
        assert secret not in answer
    rid = caught.value.response.headers["x-request-id"]
    # The operator finds why under the request id the caller was given.
    line = wait_for(
        lambda: next((x for x in deployment.router.log().splitlines() if rid in x), None),
        timeout_s=10,
        what="the refusal's log line",
    )
    event = json.loads(line)
    assert (event["event"], event["status"], event["reason"]) == ("HTTP call refused", 401, "api_key")
    assert wrong not in line


def test_every_route_needs_a_credential_by_default_even_one_that_does_not_exist(deployment: AuthHttp) -> None:
    status, headers, _ = request(deployment.http_port, "/v1/embeddings", {})
    assert (status, headers["WWW-Authenticate"]) == (401, "Bearer")
    status, _, _ = request(deployment.http_port, "/v1/models")
    assert status == 401
    status, _, body = request(deployment.http_port, "/v1/embeddings", {}, bearer(KEYS["web"]))
    assert (status, body["error"]["code"]) == (404, "not_found")


# -- served -----------------------------------------------------------------------------------------------


def test_an_api_key_as_bearer_is_served_streamed_or_not_and_x_api_key_too(deployment: AuthHttp) -> None:
    client = deployment.client(KEYS["web"])
    answer = client.completions.create(model=MODEL, prompt="The ", max_tokens=3, user="u1")
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt="The ", max_tokens=3, user="u1", stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == answer.choices[0].text
    status, _, body = request(deployment.http_port, "/v1/completions", COMPLETION, {"x-api-key": KEYS["web"]})
    assert status == 200, body
    assert metric(deployment.router, "splitstream_router_auth_calls_total", principal="web") >= 3


def test_at_debug_level_each_http_call_is_logged_with_its_request_id_and_status(deployment: AuthHttp) -> None:
    rid = "debug-line-" + uuid.uuid4().hex
    status, _, body = request(
        deployment.http_port, "/v1/completions", COMPLETION, {**bearer(KEYS["web"]), "x-request-id": rid}
    )
    assert status == 200, body

    def line() -> dict[str, Any] | None:
        for text in deployment.router.log().splitlines():
            if rid in text and '"call"' in text:
                return dict(json.loads(text))
        return None

    logged = wait_for(line, timeout_s=10, what="the call's DEBUG line")
    expected = {"event": "call", "request_id": rid, "status": "OK", "level": "debug", "model": MODEL}
    assert {key: logged.get(key) for key in expected} == expected, logged


def test_a_jwt_as_bearer_is_served(deployment: AuthHttp) -> None:
    token = deployment.key.token()
    answer = deployment.client(token).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The "}], max_tokens=4
    )
    assert answer.choices[0].message.content
    assert metric(deployment.router, "splitstream_router_auth_calls_total", principal="jwt-user") >= 1
    expired = deployment.key.token(exp=1)
    with pytest.raises(openai.AuthenticationError):
        deployment.client(expired).completions.create(model=MODEL, prompt="a", max_tokens=1)


def test_grpc_takes_an_api_key_as_bearer_too(deployment: AuthHttp) -> None:
    client = StreamClient(deployment.router.address)
    try:
        call: Any = client.stream(
            [generation_request(MODEL, "a", 2)], metadata=[("authorization", f"Bearer {KEYS['web']}")]
        )
        assert len(list(call)) >= 1
        assert call.code() == grpc.StatusCode.OK
    finally:
        client.close()


# -- 403 ------------------------------------------------------------------------------------------------


def test_a_principal_without_the_model_is_a_403_checked_before_any_stream_begins(deployment: AuthHttp) -> None:
    client = deployment.client(KEYS["other"])
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.completions.create(model=MODEL, prompt="The ", max_tokens=3)
    assert caught.value.status_code == 403
    assert "other" not in caught.value.response.text  # no principal's name
    before = metric(deployment.router, "splitstream_router_streams_total")
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=3, stream=True
        )
    status, headers, body = request(
        deployment.http_port, "/v1/completions", COMPLETION | {"stream": True}, bearer(KEYS["other"])
    )
    assert status == 403
    assert headers["Content-Type"].startswith("application/json")  # an error object, never an event stream
    assert body["error"]["param"] == "model"
    assert metric(deployment.router, "splitstream_router_streams_total") == before  # no worker was asked
    assert (
        metric(deployment.router, "splitstream_router_auth_failures_total", code="PERMISSION_DENIED", reason="model")
        >= 3
    )


def test_pinning_a_version_over_http_needs_the_pin_grant(deployment: AuthHttp) -> None:
    pin = {"x-splitstream-version": "v2"}
    with pytest.raises(openai.PermissionDeniedError):
        deployment.client(KEYS["web"]).completions.create(model=MODEL, prompt="a", max_tokens=1, extra_headers=pin)
    raw = deployment.client(KEYS["ops"]).completions.with_raw_response.create(
        model=MODEL, prompt="a", max_tokens=1, extra_headers=pin
    )
    assert raw.headers["x-splitstream-version"] == "v2"


def test_the_model_list_shows_only_the_models_the_principal_may_call(deployment: AuthHttp) -> None:
    assert [model.id for model in deployment.client(KEYS["web"]).models.list()] == [MODEL]
    assert sorted(model.id for model in deployment.client(KEYS["ops"]).models.list()) == [SECRET, MODEL]
    assert list(deployment.client(KEYS["other"]).models.list()) == []
    assert deployment.client(KEYS["web"]).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.PermissionDeniedError):
        deployment.client(KEYS["web"]).models.retrieve(SECRET)


# -- 429 ------------------------------------------------------------------------------------------------


def test_over_its_rate_limit_a_principal_gets_a_429_with_retry_after(deployment: AuthHttp) -> None:
    client = deployment.client(KEYS["limited"])
    for _ in range(2):  # the burst
        client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert caught.value.status_code == 429
    assert caught.value.code == "rate_limit_exceeded"
    retry_after = int(caught.value.response.headers["retry-after"])
    assert 900 <= retry_after <= 1000  # one call every 1000 s, a moment after the last token went
    assert metric(deployment.router, "splitstream_router_auth_rate_limited_total", principal="limited") >= 1
    assert "limited" not in caught.value.response.text


# -- the log ----------------------------------------------------------------------------------------------


def test_no_key_or_token_reaches_the_router_s_log(deployment: AuthHttp) -> None:
    token = deployment.key.token()
    for credential in (*KEYS.values(), token):
        request(deployment.http_port, "/v1/completions", COMPLETION, bearer(credential))
        request(deployment.http_port, "/v1/models", None, {"x-api-key": credential})
    log = deployment.router.log()
    assert "HTTP call refused" in log
    for credential in (*KEYS.values(), token):
        assert credential not in log
        assert credential[-24:] not in log


# -- routes added later ---------------------------------------------------------------------------------


async def test_a_route_added_later_is_checked_by_default_and_only_health_is_open(tmp_path: Path) -> None:
    """The front door's own application, in process: its KServe routes are checked by the guard without code
    of their own, only health is open, and a route nobody declared is refused rather than served."""
    import aiohttp
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from splitstream.router.auth.credentials import FilePrincipals, PrincipalsStore
    from splitstream.router.auth.gate import Authenticator, AuthMetrics, Gate
    from splitstream.router.auth.ratelimit import RateLimiter
    from splitstream.router.core import EndpointSettings, RouterCore
    from splitstream.router.http.app import HttpFrontDoor
    from splitstream.router.metrics import RouterMetrics

    principals = tmp_path / "principals.yaml"
    document = principals_document()
    document["principals"]["ops"]["feedback"] = True
    principals.write_text(yaml.safe_dump(document))
    store = PrincipalsStore(FilePrincipals(str(principals)), on_update=lambda policy, error: None)
    await store.load()
    registry = CollectorRegistry()
    gate = Gate(Authenticator(store, jwt=None, api_keys=True, limiter=RateLimiter()), AuthMetrics(registry))
    metrics = RouterMetrics()
    core = RouterCore(
        settings=EndpointSettings(channel_options=(), eject_after_failures=3, eject_duration_s=1, drain_timeout_s=1),
        metrics=metrics,
    )
    front = HttpFrontDoor(core, metrics.registry, max_body_bytes=1 << 20, shutdown_grace_s=1, gate=gate)

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"principal": request.get("principal", "")})

    # The KServe routes are the front door's own (their handlers answer 4xx here: the core serves no model, so
    # "admitted" is any status but 401/403); /v1/feedback (registered only with a recorder) and one undeclared
    # route are added as a later change would add them.
    front.app.router.add_get("/v1/undeclared", ok)
    front.app.router.add_post("/v1/feedback", ok)
    port = await front.start("127.0.0.1", 0, None)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:

            async def status(method: str, path: str, key: str = "") -> int:
                headers = bearer(key) if key else {}
                async with session.request(method, path, headers=headers, json={}) as response:
                    return response.status

            def admitted(code: int) -> bool:
                return code not in (401, 403)

            assert await status("GET", "/v2/health/live") == 200
            assert await status("GET", f"/v2/models/{MODEL}/ready") == 401
            assert admitted(await status("GET", f"/v2/models/{MODEL}/ready", KEYS["web"]))
            assert await status("GET", f"/v2/models/{SECRET}/ready", KEYS["web"]) == 403
            assert await status("POST", f"/v2/models/{MODEL}/infer", KEYS["other"]) == 403
            assert admitted(await status("POST", f"/v2/models/{MODEL}/infer", KEYS["web"]))
            assert await status("POST", f"/v2/models/{MODEL}/versions/v1/infer", KEYS["web"]) == 403  # pin
            assert admitted(await status("POST", f"/v2/models/{MODEL}/versions/v1/infer", KEYS["ops"]))
            assert await status("POST", "/v1/feedback", KEYS["web"]) == 403
            assert await status("POST", "/v1/feedback", KEYS["ops"]) == 200
            async with session.get("/v1/undeclared", headers=bearer(KEYS["ops"])) as response:
                assert (response.status, (await response.json())["error"]["message"]) == (500, "internal error")
    finally:
        await front.stop()
        await store.close()
        await core.close()


def test_a_401_and_a_403_name_their_request_id_in_the_message_as_grpc_does(deployment: AuthHttp) -> None:
    """The id is in x-request-id, and in the message as the gRPC port's text has it (a log line to find)."""
    status, headers, body = request(
        deployment.http_port, "/v1/completions", COMPLETION, {**bearer("sk-wrong"), "x-request-id": "http-401"}
    )
    assert (status, headers["x-request-id"]) == (401, "http-401")
    assert "(request id http-401; the router's log has the reason)" in body["error"]["message"]
    status, headers, body = request(deployment.http_port, "/v1/completions", COMPLETION, bearer(KEYS["other"]))
    rid = headers["x-request-id"]
    assert status == 403
    assert f"(request id {rid};" in body["error"]["message"]
    assert "other" not in body["error"]["message"]
