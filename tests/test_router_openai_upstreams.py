"""``openai`` upstreams, end to end: a router whose experiment splits 50/50, sticky by user, between v1 (our
generating worker, translated) and v2 (an OpenAI-compatible HTTP server, passed through).

- v2 is an independent server: LiteLLM's proxy (``make test`` installs it in its own venv and names its
  ``litellm`` in ``SPLITSTREAM_LITELLM``) answering a mock response, with a master key, so it answers
  only calls that carry the API key the registry names.
- The fault tests need an upstream whose generation can be watched and that streams as long as asked:
  another splitstream router's HTTP port in front of its own worker (the trigram model of
  demo/language.py), reached only over HTTP; its worker's metrics show what the upstream saw.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from demo import language
from splitstream.common.errors import ConfigError
from splitstream.common.registry import parse_registry
from tests import launcher
from tests.consul_emulator import ConsulEmulator
from tests.harness import (
    InferClient,
    ServiceProcess,
    Stack,
    free_port,
    make_request,
    metric_samples,
    router_status,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.streams import StreamClient, generation_request
from tests.test_router_http import accepts, events, start_router, worker_metric

#: The model of the experiment: v1 is our worker of it, v2 LiteLLM, which knows it as MOCK_MODEL.
MODEL = "chat"
MOCK_MODEL = "mock-llm"
MOCK_ANSWER = "Hello from an independent server."
#: A model served only by the splitstream upstream, which knows it as UPSTREAM_MODEL.
RELAY = "relay"
UPSTREAM_MODEL = "writer"
#: A model whose only version is an upstream that a test kills mid-stream.
DOOMED = "doomed"
#: A model whose v1 lists an upstream that answers 503 (healthy, yet every call fails), a dead URL and a good one.
FLAKY = "flaky"
#: A model served by the doomed upstream and the good one: once the doomed one is killed, calls go on.
PAIR = "pair"
#: A model whose only upstream's API key file is missing.
KEYLESS = "keyless"
#: A model split 50/50 between our worker (v1, the control) and an upstream that answers 503 (v2).
SPILL = "spill"
LIMIT = 1_000_000
SECRET = "sk-test-0123456789abcdef"


@dataclass
class Upstream:
    router: ServiceProcess
    worker: ServiceProcess
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"


@dataclass
class Deployment:
    stack: Stack
    router: ServiceProcess
    http_port: int
    v1: ServiceProcess
    litellm_url: str
    upstream: Upstream
    doomed: Upstream
    refusing: Upstream
    dead_url: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"


def start_upstream(stack: Stack, name: str, worker: ServiceProcess, address: str = "") -> Upstream:
    """A splitstream router with --http-port in front of ``worker`` (UPSTREAM_MODEL v2), or of ``address``
    when given (nobody serves it: the upstream's /v1/models answers 200, its generations 503)."""
    address = address or worker.address
    registry = stack.tmp_path / f"{name}.yaml"
    write_registry(registry, {UPSTREAM_MODEL: {"endpoints": {"v2": [address]}}})
    router, port = start_router(stack, registry)
    return Upstream(router, worker, port)


@pytest.fixture(scope="module")
def litellm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """LiteLLM's proxy on a free port, answering MOCK_ANSWER to calls carrying SECRET; its base URL."""
    command = os.environ.get("SPLITSTREAM_LITELLM")
    assert command, "run through `make test`, which installs LiteLLM's proxy in its own venv (SPLITSTREAM_LITELLM)"
    tmp = tmp_path_factory.mktemp("litellm")
    config = tmp / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": MOCK_MODEL,
                        "litellm_params": {
                            "model": f"openai/{MOCK_MODEL}",
                            "api_key": "unused",
                            "mock_response": MOCK_ANSWER,
                        },
                    }
                ],
                "general_settings": {"master_key": SECRET},
            }
        )
    )
    port = free_port()
    # No network here: LiteLLM must not try to fetch its model price list at start.
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
    with open(tmp / "litellm.log", "wb") as log:
        process = launcher.Popen(
            [command, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:

        def serving() -> bool:
            assert process.poll() is None, (tmp / "litellm.log").read_text(errors="replace")
            return get(f"{base_url}/models", SECRET) == 200

        wait_for(serving, timeout_s=180, what="LiteLLM's proxy to serve")
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def get(url: str, key: str = "") -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return 0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, litellm: str) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("upstreams")
    models = tmp / "models"
    language.write_versions(models, MODEL, generation={"max_tokens_limit": LIMIT})
    language.write_versions(models, UPSTREAM_MODEL, generation={"max_tokens_limit": LIMIT})
    language.write_versions(models, SPILL)
    stack = Stack(tmp)
    try:
        v1 = stack.worker(models, MODEL, "v1")
        spill_v1 = stack.worker(models, SPILL, "v1")
        worker = stack.worker(models, UPSTREAM_MODEL, "v2")
        upstream = start_upstream(stack, "upstream", worker)
        doomed = start_upstream(stack, "doomed", worker)
        refusing = start_upstream(stack, "refusing", worker, f"127.0.0.1:{free_port()}")
        dead_url = f"http://127.0.0.1:{free_port()}/v1"
        key_file = tmp / "upstream.key"
        key_file.write_text(SECRET + "\n")
        registry = tmp / "registry.yaml"
        write_registry(
            registry,
            {
                MODEL: {
                    "endpoints": {
                        "v1": [v1.address],
                        "v2": {"openai": [litellm], "model": MOCK_MODEL, "api_key_file": str(key_file)},
                    },
                    "experiment": {
                        "salt": "upstream-tests",
                        "control": "v1",
                        "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
                    },
                },
                SPILL: {
                    "endpoints": {
                        "v1": [spill_v1.address],
                        "v2": {"openai": refusing.base_url, "model": UPSTREAM_MODEL},
                    },
                    "experiment": {
                        "salt": "spill-tests",
                        "control": "v1",
                        "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
                    },
                },
                KEYLESS: {
                    "endpoints": {
                        "v1": {"openai": litellm, "model": MOCK_MODEL, "api_key_file": str(tmp / "missing.key")}
                    }
                },
                RELAY: {"endpoints": {"v1": {"openai": upstream.base_url, "model": UPSTREAM_MODEL}}},
                DOOMED: {"endpoints": {"v1": {"openai": doomed.base_url, "model": UPSTREAM_MODEL}}},
                PAIR: {"endpoints": {"v1": {"openai": [doomed.base_url, upstream.base_url], "model": UPSTREAM_MODEL}}},
                FLAKY: {
                    "endpoints": {
                        "v1": {"openai": [refusing.base_url, dead_url, upstream.base_url], "model": UPSTREAM_MODEL}
                    }
                },
            },
        )
        router, http_port = start_router(stack, registry, "--log-level", "debug")
        yield Deployment(stack, router, http_port, v1, litellm, upstream, doomed, refusing, dead_url)
    finally:
        stack.close()


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.base_url, api_key="unused", max_retries=0, timeout=30)


MESSAGES: list[Any] = [{"role": "user", "content": "The "}]


def open_stream(
    port: int, body: dict[str, Any], headers: dict[str, str] | None = None, *, path: str = "/v1/completions"
) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    return connection.getresponse()


def users_by_version(client: openai.OpenAI, count: int) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {"v1": [], "v2": []}
    for index in range(count):
        user = f"user-{index}"
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8, user=user)
        seen[raw.headers["x-splitstream-version"]].append(user)
    return seen


# -- the split ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_both_versions_answer_the_openai_client_sticky_per_user_streamed_and_whole(client: openai.OpenAI) -> None:
    seen = users_by_version(client, 12)
    assert seen["v1"], seen
    assert seen["v2"], seen
    for version, users in seen.items():
        user = users[0]
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8, user=user)
        assert raw.headers["x-splitstream-version"] == version  # sticky
        assert raw.headers["x-request-id"]
        whole = raw.parse()
        assert whole.object == "chat.completion"
        assert whole.choices[0].message.content
        assert whole.usage is not None

        stream = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, user=user, stream=True
        )
        assert stream.headers["x-splitstream-version"] == version
        chunks = [chunk for chunk in stream.parse() if chunk.choices]
        assert len(chunks) > 1  # token by token
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        assert streamed == whole.choices[0].message.content
        if version == "v2":  # LiteLLM's answer, which it gives only with the key (its master key) and its model name
            assert whole.choices[0].message.content == MOCK_ANSWER
            assert whole.model == MOCK_MODEL
        else:
            assert whole.choices[0].message.content != MOCK_ANSWER
    completion = client.completions.with_raw_response.create(model=MODEL, prompt="The ", user=seen["v2"][0])
    assert completion.headers["x-splitstream-version"] == "v2"
    assert completion.parse().choices[0].text == MOCK_ANSWER


def test_the_api_key_from_the_file_is_what_lets_the_upstream_answer_and_is_never_logged(
    deployment: Deployment, client: openai.OpenAI
) -> None:
    assert get(f"{deployment.litellm_url}/models") != 200  # the upstream refuses a call without the key
    assert get(f"{deployment.litellm_url}/models", SECRET) == 200
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, extra_headers={"x-splitstream-version": "v2", "x-request-id": "key-check-1"}
    )
    assert raw.parse().choices[0].message.content == MOCK_ANSWER
    assert raw.headers["x-request-id"] == "key-check-1"
    assert "Bearer" not in deployment.router.log()
    assert SECRET not in deployment.router.log()  # at --log-level debug


def test_passed_through_requests_are_counted_and_timed_as_translated_ones(
    deployment: Deployment, client: openai.OpenAI
) -> None:
    pin = {"x-splitstream-version": "v2"}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_headers=pin)
    for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_headers=pin, stream=True):
        pass
    text = scrape_metrics(deployment.router.metrics_port)
    v2 = {"model": MODEL, "version": "v2", "route": "/v1/chat/completions"}

    def total(name: str, **labels: str) -> float:
        wanted = {**v2, **labels}
        return sum(value for found, value in metric_samples(text, name) if wanted.items() <= found.items())

    assert total("splitstream_router_http_requests_total", status="200") >= 2
    assert total("splitstream_router_http_request_seconds_count") >= 2
    assert total("splitstream_router_http_ttft_seconds_count") >= 1


def test_fields_our_workers_refuse_pass_through_to_the_upstream_unchanged(deployment: Deployment) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    body = {"model": MODEL, "messages": MESSAGES, "tools": [tool]}
    translated = open_stream(deployment.http_port, body, {"x-splitstream-version": "v1"}, path="/v1/chat/completions")
    assert translated.status == 400
    assert json.loads(translated.read())["error"]["param"] == "tools"
    passed = open_stream(deployment.http_port, body, {"x-splitstream-version": "v2"}, path="/v1/chat/completions")
    assert passed.status == 200
    assert passed.headers["x-splitstream-version"] == "v2"
    assert json.loads(passed.read())["choices"][0]["message"]["content"] == MOCK_ANSWER


def test_the_upstreams_refusal_reaches_the_client_as_it_sent_it(deployment: Deployment) -> None:
    """The body goes through unchanged (no check of ours in the way): what the upstream refuses, it says."""
    response = open_stream(deployment.http_port, {"model": RELAY, "prompt": "The ", "max_tokens": 4, "tools": []})
    body = json.loads(response.read())
    assert response.status == 400
    assert response.headers["x-splitstream-version"] == "v1"
    assert body["error"]["param"] == "tools"  # the upstream's (another splitstream router's) own refusal


def test_a_grpc_client_routed_to_an_openai_version_gets_failed_precondition_naming_it(
    deployment: Deployment,
) -> None:
    client = StreamClient(deployment.router.address)
    try:
        request = generation_request(MODEL, "The ", max_tokens=4)
        with pytest.raises(grpc.RpcError) as raised:
            list(client.stream([request], metadata=[("x-splitstream-version", "v2")]))
    finally:
        client.close()
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"model '{MODEL}' version 'v2'" in str(raised.value.details())
    unary = InferClient(deployment.router.address)
    try:
        with pytest.raises(grpc.RpcError) as raised:
            unary.infer(make_request(FLAKY, np.zeros(1, dtype=np.float32)))
    finally:
        unary.close()
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# -- health and retries -----------------------------------------------------------------------------------


def test_a_dead_upstream_is_skipped_and_a_failing_one_retried_before_the_first_byte(
    deployment: Deployment, client: openai.OpenAI
) -> None:
    def health(address: str) -> int:
        status = router_status(deployment.router, FLAKY)
        (pool,) = status.models[0].versions
        return next(endpoint.health for endpoint in pool.endpoints if endpoint.address == address)

    wait_for(lambda: health(deployment.dead_url) == 3, timeout_s=10, what="the dead upstream to be unreachable")
    assert health(deployment.refusing.base_url) == 1  # its /models answers: healthy, yet it answers 503
    for index in range(6):
        stream = index % 2 == 1
        answer = client.completions.create(model=FLAKY, prompt="The ", max_tokens=4, stream=stream)
        if stream:
            assert "".join(chunk.choices[0].text for chunk in answer if chunk.choices)  # type: ignore[union-attr]
        else:
            assert answer.choices[0].text  # type: ignore[union-attr]
    retries = metric_samples(scrape_metrics(deployment.router.metrics_port), "splitstream_router_retries_total")
    assert sum(value for labels, value in retries if labels["model"] == FLAKY) >= 1


def test_a_failing_upstream_arm_spills_to_the_control_worker_translated(
    deployment: Deployment, client: openai.OpenAI
) -> None:
    for index in range(8):
        raw = client.completions.with_raw_response.create(
            model=SPILL, prompt="The ", max_tokens=4, user=f"spilled-{index}", stream=index % 2 == 1
        )
        assert raw.headers["x-splitstream-version"] == "v1"  # half the users' arm is v2: its 503 spilled to v1
        assert raw.status_code == 200
    retries = metric_samples(scrape_metrics(deployment.router.metrics_port), "splitstream_router_retries_total")
    assert sum(value for labels, value in retries if labels["model"] == SPILL) >= 1


def test_an_upstream_whose_key_file_is_missing_is_not_serving_and_the_log_names_the_file(
    deployment: Deployment, client: openai.OpenAI
) -> None:
    def health() -> int:
        (pool,) = router_status(deployment.router, KEYLESS).models[0].versions
        return int(pool.endpoints[0].health)

    wait_for(lambda: health() == 2, timeout_s=10, what="the keyless upstream to be not serving")
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=KEYLESS, messages=MESSAGES)
    assert raised.value.status_code == 503
    assert "missing.key (api_key_file) cannot be read" in deployment.router.log()
    streams = metric_samples(scrape_metrics(deployment.router.metrics_port), "splitstream_router_streams_total")
    assert sum(value for labels, value in streams if labels["model"] == KEYLESS and labels["status"] == "UNAVAILABLE")


# -- streams -----------------------------------------------------------------------------------------------


def test_events_reach_the_client_as_the_upstream_sends_them_and_a_disconnect_cancels_the_upstream(
    deployment: Deployment,
) -> None:
    worker = deployment.upstream.worker
    body = {"model": RELAY, "prompt": "The ", "max_tokens": LIMIT, "stream": True}
    response = open_stream(deployment.http_port, body)
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    stream = events(response)
    for _ in range(5):
        assert json.loads(next(stream))["object"] == "text_completion"
    # The first events came while the upstream is still generating (a million tokens): nothing is buffered.
    assert worker_metric(worker, "splitstream_worker_active_sequences") == 1
    response.close()  # the client goes: the router closes the upstream's connection, and the upstream stops
    wait_for(
        lambda: worker_metric(worker, "splitstream_worker_active_sequences") == 0,
        timeout_s=10,
        what="the upstream's generation to end",
    )


@pytest.mark.slow
def test_an_upstream_killed_mid_stream_ends_the_clients_stream_with_an_error_event(
    deployment: Deployment, client: openai.OpenAI
) -> None:
    """Then calls to a version it served with another upstream go on: refused connections are retried on the
    other before the first byte (until the health check takes it out of rotation, within a second)."""
    response = open_stream(
        deployment.http_port, {"model": DOOMED, "prompt": "The ", "max_tokens": LIMIT, "stream": True}
    )
    assert response.status == 200
    stream = events(response)
    for _ in range(3):
        assert json.loads(next(stream))["object"] == "text_completion"
    deployment.doomed.router.kill()
    rest = list(stream)  # ends: never a hang
    assert "[DONE]" not in rest
    error = json.loads(rest[-1])
    assert error["error"]["type"] == "server_error"
    assert "broke off" in error["error"]["message"]
    assert not accepts(deployment.doomed.http_port)
    for index in range(4):
        raw = client.completions.with_raw_response.create(
            model=PAIR, prompt="The ", max_tokens=4, stream=index % 2 == 1
        )
        assert raw.status_code == 200


# -- Consul -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_consul_instance_with_protocol_openai_is_an_upstream(deployment: Deployment, tmp_path: Path) -> None:
    """Consul registers the v2 upstream as an instance with meta protocol: openai (no gRPC check: it is not a
    gRPC server); the router passes v2 calls through to its base URL. An instance whose meta makes no valid
    base URL is left out, with a warning naming it."""
    service = f"splitstream-{MODEL}"
    with ConsulEmulator(tmp_path / "consul") as emulator:
        agent = emulator.client().agent.service
        host, port = deployment.v1.address.rsplit(":", 1)
        agent.register(service, service_id="chat-v1", address=host, port=int(port), meta={"version": "v1"})
        upstream = {"version": "v2", "protocol": "openai", "openai_model": UPSTREAM_MODEL}
        agent.register(
            service, service_id="chat-v2", address="127.0.0.1", port=deployment.upstream.http_port, meta=upstream
        )
        bad = {"version": "v2", "protocol": "openai", "scheme": "ftp"}
        agent.register(service, service_id="chat-v2-bad", address="127.0.0.1", port=1, meta=bad)
        http_port = free_port()
        router = deployment.stack.router(emulator.spec, "--http-port", str(http_port))
        wait_for(lambda: accepts(http_port), timeout_s=10, what="the HTTP port to accept")

        def routed() -> bool:
            (model,) = router_status(router).models or [None]
            if model is None:
                return False
            versions = {pool.version: [e.address for e in pool.endpoints] for pool in model.versions}
            return versions.get("v2") == [deployment.upstream.base_url]

        wait_for(routed, timeout_s=10, what="v2 to be the upstream's base URL")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="The ", max_tokens=4, extra_headers={"x-splitstream-version": "v2"}
        )
        assert raw.headers["x-splitstream-version"] == "v2"
        assert raw.parse().model == UPSTREAM_MODEL  # answered by the upstream, which knows the model by its name
        assert "chat-v2-bad" in router.log()
        router.stop()


# -- the registry ------------------------------------------------------------------------------------------


def registry_with(v2: Any) -> dict[str, Any]:
    experiment = {"control": "v1", "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}]}
    return {"models": {"m": {"endpoints": {"v1": ["127.0.0.1:9001"], "v2": v2}, "experiment": experiment}}}


def test_an_openai_version_is_read_with_its_base_urls_model_and_key_source() -> None:
    state = parse_registry(registry_with({"openai": "http://10.0.0.5:8000/v1/", "model": "m8b", "api_key_env": "K"}))
    entry = state.models["m"]
    assert entry.endpoints["v2"] == ("http://10.0.0.5:8000/v1",)
    assert entry.upstreams["v2"].model == "m8b"
    assert entry.upstreams["v2"].api_key_env == "K"
    assert "v1" not in entry.upstreams


@pytest.mark.parametrize(
    ("v2", "expected"),
    [
        ({"openai": ["ftp://10.0.0.5/v1"]}, "models.m.endpoints.v2.openai[0]: "),
        ({"openai": ["http://10.0.0.5:99999/v1"]}, "expected an http(s) base URL"),
        ({"openai": ["http://user:hunter2@10.0.0.5/v1"]}, "no credentials in a URL"),
        ({"openai": "http://a/v1", "api_key_file": "k", "api_key_env": "K"}, "not both"),
        ({"openai": "http://a/v1", "api_key": SECRET}, "api_key"),
        (["http://a/v1"], "expected host:port"),
    ],
)
def test_a_bad_openai_version_is_refused_naming_it(v2: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_registry(registry_with(v2))
    assert expected in str(raised.value)
    assert "hunter2" not in str(raised.value)
    assert SECRET not in str(raised.value)
