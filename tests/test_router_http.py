"""The router's HTTP front door (OpenAI-compatible API), end to end: a router with --http-port in front of
two generating workers (v1 bigram, v2 trigram of demo/language.py) split 50/50, called with the official
``openai`` client and with raw HTTP requests."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from demo import language
from splitstream.common.tls import ClientTls
from tests.certs import Pki, served_serial
from tests.harness import (
    ROOT,
    ServiceProcess,
    Stack,
    free_port,
    metric_samples,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.streams import StreamClient, generation_request

MODEL = "writer"
LIMIT = 1_000_000
#: A model listed with an endpoint nobody serves: no healthy version.
GHOST = "ghost"
MAX_BODY_BYTES = 1 << 20


@dataclass
class Deployment:
    stack: Stack
    registry: Path
    workers: dict[str, ServiceProcess]
    router: ServiceProcess
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"


def start_router(stack: Stack, registry: Path, *extra: str) -> tuple[ServiceProcess, int]:
    http_port = free_port()
    router = stack.router(registry, "--http-port", str(http_port), "--max-message-bytes", str(MAX_BODY_BYTES), *extra)
    wait_for(lambda: accepts(http_port), timeout_s=10, what="the HTTP port to accept")
    return router, http_port


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return False
    return True


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("http")
    language.write_versions(tmp / "models", MODEL, generation={"max_tokens_limit": LIMIT})
    stack = Stack(tmp)
    try:
        workers = {version: stack.worker(tmp / "models", MODEL, version) for version in language.ORDERS}
        registry = tmp / "registry.yaml"
        experiment = {
            "salt": "http-tests",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        }
        write_registry(
            registry,
            {
                MODEL: {"endpoints": {v: [w.address] for v, w in workers.items()}, "experiment": experiment},
                GHOST: {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}},
            },
        )
        router, http_port = start_router(stack, registry)
        yield Deployment(stack, registry, workers, router, http_port)
    finally:
        stack.close()


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.base_url, api_key="unused", max_retries=0, timeout=30)


def post(deployment: Deployment, path: str, body: bytes, method: str = "POST") -> tuple[int, dict[str, Any], Any]:
    """A raw HTTP request: (status, headers, JSON body)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{deployment.http_port}{path}",
        data=body if method == "POST" else None,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def worker_metric(worker: ServiceProcess, name: str) -> float:
    return sum(value for _, value in metric_samples(scrape_metrics(worker.metrics_port), name))


CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The "},
]
JOINED = "system: Be brief.\nuser: The \nassistant:"


# -- the openai client ------------------------------------------------------------------------------


def test_the_openai_client_gets_a_chat_completion_with_usage_and_the_served_version(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=12, user="alice")
    completion = raw.parse()
    assert raw.headers["x-splitstream-version"] in ("v1", "v2")
    assert raw.headers["x-request-id"]
    assert completion.id == "chatcmpl-" + raw.headers["x-request-id"]
    assert completion.object == "chat.completion"
    assert completion.model == MODEL
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert len(choice.message.content or "") == 12  # the demo's models write one ASCII byte a token
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(JOINED.encode())  # the documented join, byte tokens
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == len(JOINED.encode()) + 12


def test_a_streamed_chat_sends_the_role_then_the_tokens_then_the_finish_and_the_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, user="bob")
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=10,
            user="bob",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [chunk.choices[0].delta.content for chunk in chunks[1:-2]]
    assert len(pieces) == 10  # one event per token, as the worker sent them
    assert "".join(p or "" for p in pieces) == whole.choices[0].message.content  # same user, same version, greedy
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.completion_tokens, chunks[-1].usage.total_tokens) == (10, len(JOINED.encode()) + 10)


def test_completions_answer_text_completion_objects_streamed_or_not(client: openai.OpenAI) -> None:
    pin = {"x-splitstream-version": "v1"}
    whole = client.completions.create(model=MODEL, prompt="The ", max_tokens=8, extra_headers=pin)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (4, 8)
    chunks = list(client.completions.create(model=MODEL, prompt="The ", max_tokens=8, stream=True, extra_headers=pin))
    assert {chunk.object for chunk in chunks} == {"text_completion"}
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stop_sequence_ends_the_text_and_is_left_out_of_it_streamed_or_not(client: openai.OpenAI) -> None:
    pin = {"x-splitstream-version": "v2"}
    text = client.completions.create(model=MODEL, prompt="The ", max_tokens=30, extra_headers=pin).choices[0].text
    stop = text[6:9]
    expected = text[: text.index(stop)]
    whole = client.completions.create(model=MODEL, prompt="The ", max_tokens=30, stop=[stop], extra_headers=pin)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    chunks = list(
        client.completions.create(model=MODEL, prompt="The ", max_tokens=30, stop=stop, stream=True, extra_headers=pin)
    )
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_lists_the_registry_models(client: openai.OpenAI) -> None:
    assert sorted(model.id for model in client.models.list()) == [GHOST, MODEL]
    assert client.models.retrieve(MODEL).owned_by == "splitstream"


def test_the_worked_example_of_the_docs_runs(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "docs" / "http.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'base_url="http://localhost:8000/v1"' in example
    namespace: dict[str, Any] = {}
    exec(example.replace("http://localhost:8000/v1", deployment.base_url), namespace)
    assert namespace["version"] in ("v1", "v2")
    assert namespace["streamed"] == namespace["answer"].choices[0].message.content
    assert len(namespace["streamed"]) == 12
    assert capsys.readouterr().out.startswith(namespace["version"])


# -- routing ------------------------------------------------------------------------------------------


def served_version(client: openai.OpenAI, **extra: Any) -> str:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="a", max_tokens=1, **extra)
    return str(raw.headers["x-splitstream-version"])


def test_the_same_user_always_gets_the_same_version_and_users_land_on_both(client: openai.OpenAI) -> None:
    versions = {user: served_version(client, user=user) for user in (f"user-{i}" for i in range(24))}
    assert set(versions.values()) == {"v1", "v2"}
    for user in list(versions)[:6]:
        assert {served_version(client, user=user) for _ in range(3)} == {versions[user]}


def test_a_key_gets_the_same_version_over_http_and_grpc_and_the_header_wins_over_user(
    client: openai.OpenAI, deployment: Deployment
) -> None:
    by_user = {user: served_version(client, user=user) for user in (f"key-{i}" for i in range(12))}
    assert set(by_user.values()) == {"v1", "v2"}
    grpc_client = StreamClient(deployment.router.address)
    try:
        for key, version in by_user.items():
            assert served_version(client, user="someone-else", extra_headers={"x-routing-key": key}) == version
            call: Any = grpc_client.stream([generation_request(MODEL, "a", 1)], metadata=[("x-routing-key", key)])
            list(call)
            assert dict(call.trailing_metadata())["x-splitstream-version"] == version
    finally:
        grpc_client.close()


def test_the_pin_header_chooses_the_version(client: openai.OpenAI) -> None:
    for version in ("v1", "v2"):
        pins = {
            served_version(client, user=f"p-{i}", extra_headers={"x-splitstream-version": version}) for i in range(6)
        }
        assert pins == {version}


# -- errors -------------------------------------------------------------------------------------------


def assert_openai_error(body: Any, *, param: str | None, code: str | None = None) -> str:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    return str(body["error"]["message"])


def test_a_body_that_is_not_json_is_a_400_in_openais_error_shape(deployment: Deployment) -> None:
    status, _, body = post(deployment, "/v1/chat/completions", b'{"model": "writer", "messages": [')
    assert status == 400
    assert "not valid JSON" in assert_openai_error(body, param=None)
    assert body["error"]["type"] == "invalid_request_error"


def test_messages_of_the_wrong_type_is_a_400_naming_messages(deployment: Deployment) -> None:
    status, _, body = post(deployment, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode())
    assert status == 400
    assert "'messages' must be an array" in assert_openai_error(body, param="messages")


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [("temperature", "hot", "temperature"), ("max_tokens", 0, "max_tokens"), ("n", 2, "n"), ("tools", [], "tools")],
)
def test_a_field_of_the_wrong_value_is_a_400_naming_it(
    deployment: Deployment, field: str, value: Any, param: str
) -> None:
    body = {"model": MODEL, "messages": CHAT, field: value}
    status, _, answer = post(deployment, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400
    assert f"'{param}'" in assert_openai_error(answer, param=param)


def test_what_the_worker_refuses_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="a", max_tokens=LIMIT + 1)
    assert caught.value.status_code == 400
    assert caught.value.param == "max_tokens"  # type: ignore[attr-defined]


def test_an_unknown_model_is_a_404(client: openai.OpenAI, deployment: Deployment) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert caught.value.code == "model_not_found"
    status, _, body = post(deployment, "/v1/completions", json.dumps({"model": "nope", "prompt": "a"}).encode())
    assert status == 404
    assert "'nope' does not exist" in assert_openai_error(body, param="model", code="model_not_found")


def test_a_model_with_no_healthy_version_is_a_503(deployment: Deployment) -> None:
    request = json.dumps({"model": GHOST, "prompt": "a"}).encode()
    _, _, body = wait_for(
        lambda: (answer := post(deployment, "/v1/completions", request))[0] == 503 and answer,
        timeout_s=15,
        what="a 503 for the model without a worker",
    )
    assert "no healthy endpoint" in assert_openai_error(body, param=None, code="unavailable")


def test_a_body_over_the_limit_is_a_413(deployment: Deployment) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    status, _, answer = post(deployment, "/v1/completions", body)
    assert status == 413
    assert "too large" in assert_openai_error(answer, param=None, code="request_too_large")


def test_feedback_to_a_router_that_records_nothing_is_a_503_saying_so(deployment: Deployment) -> None:
    body = json.dumps({"id": "chatcmpl-abc", "metric": "click", "value": 1, "model": MODEL}).encode()
    status, _, answer = post(deployment, "/v1/feedback", body)
    assert status == 503
    assert answer["error"]["code"] == "not_recording"
    assert "--recorder" in answer["error"]["message"]


def test_an_unknown_route_is_a_404_and_a_wrong_method_a_405(deployment: Deployment) -> None:
    status, _, body = post(deployment, "/v1/embeddings", b"{}")
    assert status == 404
    assert_openai_error(body, param=None, code="not_found")
    status, _, body = post(deployment, "/v1/chat/completions", b"", method="GET")
    assert status == 405
    assert_openai_error(body, param=None, code="method_not_allowed")


def test_http_requests_are_counted_by_model_version_route_and_status_and_streams_timed(deployment: Deployment) -> None:
    pin = {"x-splitstream-version": "v2"}
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True}
    assert list(events(open_stream(deployment.http_port, body, pin)))[-1] == "[DONE]"
    post(deployment, "/v1/embeddings", b"{}")
    text = scrape_metrics(deployment.router.metrics_port)
    counted = {
        (labels["model"], labels["version"], labels["route"], labels["status"])
        for labels, value in metric_samples(text, "splitstream_router_http_requests_total")
        if value > 0
    }
    assert (MODEL, "v2", "/v1/completions", "200") in counted
    assert ("_unknown", "", "other", "404") in counted
    ttft = metric_samples(text, "splitstream_router_http_ttft_seconds_count")
    assert any(labels == {"model": MODEL, "version": "v2", "route": "/v1/completions"} and n > 0 for labels, n in ttft)


# -- streams that end early ---------------------------------------------------------------------------


def open_stream(port: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
    )
    response = connection.getresponse()
    assert response.status == 200, response.read()
    assert response.headers["content-type"].startswith("text/event-stream")
    return response


def events(response: http.client.HTTPResponse) -> Iterator[str]:
    for line in response:
        if line.startswith(b"data: "):
            yield line[6:].decode().strip()


def test_a_client_that_disconnects_mid_stream_cancels_the_worker_stream(deployment: Deployment) -> None:
    worker = deployment.workers["v1"]
    cancelled_before = cancelled_generations(worker)
    body = {"model": MODEL, "prompt": "The ", "max_tokens": LIMIT, "stream": True}
    response = open_stream(deployment.http_port, body, {"x-splitstream-version": "v1"})
    stream = events(response)
    for _ in range(5):
        json.loads(next(stream))
    assert worker_metric(worker, "splitstream_worker_active_sequences") == 1
    response.close()  # the socket goes: the router's handler is cancelled, and the worker's stream with it
    wait_for(
        lambda: worker_metric(worker, "splitstream_worker_active_sequences") == 0,
        timeout_s=10,
        what="the worker's generation to end",
    )
    assert cancelled_generations(worker) == cancelled_before + 1


def cancelled_generations(worker: ServiceProcess) -> float:
    samples = metric_samples(scrape_metrics(worker.metrics_port), "splitstream_worker_generations_total")
    return sum(value for labels, value in samples if labels.get("outcome") == "cancelled")


@pytest.mark.slow
def test_sigterm_lets_a_stream_in_flight_finish_while_new_connections_are_refused(deployment: Deployment) -> None:
    router, port = start_router(deployment.stack, deployment.registry)
    tokens = 20_000  # more than the socket buffers hold: the stream waits on this client while the router drains
    body = {"model": MODEL, "prompt": "The ", "max_tokens": tokens, "stream": True}
    response = open_stream(port, body, {"x-splitstream-version": "v2"})
    stream = events(response)
    first = json.loads(next(stream))
    router.signal(signal.SIGTERM)

    wait_for(lambda: not accepts(port), timeout_s=10, what="the HTTP port to stop accepting")
    rest = list(stream)
    assert rest[-1] == "[DONE]"
    chunks = [first, *map(json.loads, rest[:-1])]
    assert len("".join(chunk["choices"][0]["text"] for chunk in chunks)) == tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert router.wait(timeout_s=30) == 0


def test_a_worker_that_fails_mid_stream_ends_the_stream_with_an_error_event_and_no_done(
    deployment: Deployment,
) -> None:
    """Its own worker and router: the worker is killed while its tokens are being relayed."""
    worker = deployment.stack.worker(deployment.stack.tmp_path / "models", MODEL, "v1")
    registry = deployment.stack.tmp_path / "registry-doomed.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
    _, port = start_router(deployment.stack, registry)
    response = open_stream(port, {"model": MODEL, "prompt": "The ", "max_tokens": LIMIT, "stream": True})
    assert response.headers["x-splitstream-version"] == "v1"
    stream = events(response)
    for _ in range(3):
        assert json.loads(next(stream))["object"] == "text_completion"
    worker.kill()
    rest = list(stream)  # ends: never a hang
    assert "[DONE]" not in rest
    error = json.loads(rest[-1])
    assert_openai_error(error, param=None, code="unavailable")
    assert error["error"]["type"] == "server_error"


# -- TLS ------------------------------------------------------------------------------------------------


def test_the_http_port_serves_tls_with_the_grpc_ports_files_and_follows_their_rotation(
    deployment: Deployment, tmp_path: Path
) -> None:
    pki = Pki(tmp_path / "pki")
    live = pki.issue("live")
    tls = ["--grpc-use-ssl", "--grpc-server-cert", str(live.cert), "--grpc-server-key", str(live.key)]
    http_port = free_port()
    deployment.stack.router(
        deployment.registry,
        "--http-port",
        str(http_port),
        *tls,
        tls=ClientTls(enabled=True, ca_file=str(pki.ca)),
    )
    wait_for(lambda: accepts(http_port), timeout_s=10, what="the HTTPS port to accept")
    client = openai.OpenAI(
        base_url=f"https://127.0.0.1:{http_port}/v1",
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(pki.ca))),
    )
    answer = client.completions.create(model=MODEL, prompt="The ", max_tokens=3)
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 3
    plaintext = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
    plaintext.request("GET", "/v1/models")
    with pytest.raises((http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError)):
        plaintext.getresponse()  # plaintext is not spoken there
    assert served_serial("127.0.0.1", http_port, ca=pki.ca, alpn="http/1.1") == live.serial
    renewed = pki.issue("renewed")
    for source, destination in ((renewed.key, live.key), (renewed.cert, live.cert)):  # as renewal tools do
        staging = destination.with_suffix(".new")
        staging.write_bytes(source.read_bytes())
        os.replace(staging, destination)
    wait_for(
        lambda: served_serial("127.0.0.1", http_port, ca=pki.ca, alpn="http/1.1") == renewed.serial,
        timeout_s=10,
        what="the renewed certificate to be served",
    )
    assert [model.id for model in client.models.list()] == [GHOST, MODEL]


# -- in-process: the pieces of the edge ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pieces", "stop", "expected"),
    [
        (["ab", "c", "d"], ["cd"], ["ab", "", ""]),  # the stop sequence spans two pieces: neither is let out
        (["ab", "c", "x"], ["cd"], ["ab", "", "cx"]),  # a held "c" that turns out not to be a stop: let out
        (["a", "b", "c"], ["zz", "bc"], ["a", "", ""]),
        (["hello"], [], ["hello"]),
    ],
)
def test_stop_sequences_are_held_back_until_the_next_piece_tells(
    pieces: list[str], stop: list[str], expected: list[str]
) -> None:
    from splitstream.router.http.openai_api import StopFilter

    stops = StopFilter(stop)
    out = [stops.feed(piece) for piece in pieces[:-1]]
    out.append(stops.feed(pieces[-1]) + stops.end())
    assert out == expected


def test_the_chat_join_is_role_colon_content_lines_then_assistant() -> None:
    from splitstream.router.http.openai_api import join_messages

    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    assert join_messages([{"role": "user", "content": parts}, {"role": "assistant", "content": None}]) == (
        "user: Hi there\nassistant: \nassistant:"
    )


def test_with_mutual_tls_the_http_port_refuses_clients_without_a_certificate(
    deployment: Deployment, tmp_path: Path
) -> None:
    pki = Pki(tmp_path / "pki")
    server, caller = pki.issue("server"), pki.issue("caller")
    http_port = free_port()
    deployment.stack.router(
        deployment.registry,
        *("--http-port", str(http_port)),
        *("--grpc-use-ssl-mutual", "--grpc-root-cert", str(pki.ca)),
        *("--grpc-server-cert", str(server.cert), "--grpc-server-key", str(server.key)),
        tls=ClientTls(enabled=True, ca_file=str(pki.ca), cert_file=str(caller.cert), key_file=str(caller.key)),
    )
    wait_for(lambda: accepts(http_port), timeout_s=10, what="the HTTPS port to accept")

    def models(context: ssl.SSLContext) -> Any:
        url = f"https://127.0.0.1:{http_port}/v1/models"
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            return json.loads(response.read())

    anonymous = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionResetError)):
        models(anonymous)
    known = ssl.create_default_context(cafile=str(pki.ca))
    known.load_cert_chain(caller.cert, caller.key)
    assert [model["id"] for model in models(known)["data"]] == [GHOST, MODEL]
