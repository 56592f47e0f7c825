"""``openai`` upstreams, end to end: a router whose experiment splits 50/50, sticky by user, between v1 (our
generating worker, translated) and v2 (an OpenAI-compatible HTTP server, passed through).

The v2 upstream here is another process speaking OpenAI's HTTP API: a second splitstream router's HTTP port
in front of its own worker (the trigram model of demo/language.py), reached only over HTTP. Its worker's
metrics show what the upstream saw (a generation in flight, a cancel).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from demo import language
from splitstream.common.errors import ConfigError
from splitstream.common.registry import parse_registry
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

#: The model clients call; v1 is our worker of it, v2 the upstream, which serves it as UPSTREAM_MODEL.
MODEL = "chat"
UPSTREAM_MODEL = "writer"
#: A model whose only version is an upstream that a test kills mid-stream.
DOOMED = "doomed"
#: A model whose v1 lists an upstream that answers 503 (healthy, yet every call fails), a dead URL and a good one.
FLAKY = "flaky"
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
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("upstreams")
    models = tmp / "models"
    language.write_versions(models, MODEL, generation={"max_tokens_limit": LIMIT})
    language.write_versions(models, UPSTREAM_MODEL, generation={"max_tokens_limit": LIMIT})
    stack = Stack(tmp)
    try:
        v1 = stack.worker(models, MODEL, "v1")
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
                        "v2": {"openai": [upstream.base_url], "model": UPSTREAM_MODEL, "api_key_file": str(key_file)},
                    },
                    "experiment": {
                        "salt": "upstream-tests",
                        "control": "v1",
                        "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
                    },
                },
                DOOMED: {"endpoints": {"v1": {"openai": doomed.base_url, "model": UPSTREAM_MODEL}}},
                FLAKY: {
                    "endpoints": {
                        "v1": {"openai": [refusing.base_url, dead_url, upstream.base_url], "model": UPSTREAM_MODEL}
                    }
                },
            },
        )
        router, http_port = start_router(stack, registry)
        yield Deployment(stack, router, http_port, v1, upstream, doomed, refusing, dead_url)
    finally:
        stack.close()


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.base_url, api_key="unused", max_retries=0, timeout=30)


MESSAGES: list[Any] = [{"role": "user", "content": "The "}]


def open_stream(port: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
    )
    return connection.getresponse()


def users_by_version(client: openai.OpenAI, count: int) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {"v1": [], "v2": []}
    for index in range(count):
        user = f"user-{index}"
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8, user=user)
        seen[raw.headers["x-splitstream-version"]].append(user)
    return seen


# -- the split ------------------------------------------------------------------------------------------


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
        assert whole.usage.completion_tokens == 8

        stream = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, user=user, stream=True
        )
        assert stream.headers["x-splitstream-version"] == version
        chunks = [chunk for chunk in stream.parse() if chunk.choices]
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        assert streamed == whole.choices[0].message.content  # greedy: the same text, token by token
    # v2's answers come from the upstream, which knows the model by its own name: `model` was rewritten.
    v2 = client.completions.with_raw_response.create(model=MODEL, prompt="The ", max_tokens=4, user=seen["v2"][0])
    assert v2.headers["x-splitstream-version"] == "v2"
    assert v2.parse().model == UPSTREAM_MODEL


def test_the_upstreams_refusal_reaches_the_client_as_it_sent_it(deployment: Deployment) -> None:
    """The body goes through unchanged (no check of ours in the way): what the upstream refuses, it says."""
    response = open_stream(
        deployment.http_port,
        {"model": MODEL, "prompt": "The ", "max_tokens": 4, "tools": []},
        {"x-splitstream-version": "v2"},
    )
    body = json.loads(response.read())
    assert response.status == 400
    assert response.headers["x-splitstream-version"] == "v2"
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


# -- streams -----------------------------------------------------------------------------------------------


def test_events_reach_the_client_as_the_upstream_sends_them_and_a_disconnect_cancels_the_upstream(
    deployment: Deployment,
) -> None:
    worker = deployment.upstream.worker
    body = {"model": MODEL, "prompt": "The ", "max_tokens": LIMIT, "stream": True}
    response = open_stream(deployment.http_port, body, {"x-splitstream-version": "v2"})
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
def test_an_upstream_killed_mid_stream_ends_the_clients_stream_with_an_error_event(deployment: Deployment) -> None:
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
    wait_for(lambda: not accepts(deployment.doomed.http_port), timeout_s=5, what="the upstream to be gone")


# -- the API key -------------------------------------------------------------------------------------------


def test_the_api_key_never_appears_in_the_routers_log(deployment: Deployment) -> None:
    assert SECRET not in deployment.router.log()


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
