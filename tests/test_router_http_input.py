"""The HTTP front door's refusals of odd input: what a client sends that the JSON or HTTP layers accept but the
router cannot use (a role that is not a string, a nesting too deep, a lone surrogate, header bytes that are not
UTF-8, a request larger than the worker takes) is a 4xx naming what is wrong, never a 500. Real processes: the
deployment of ``tests/test_router_http.py`` (a router with --http-port in front of two generating workers)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from demo import language
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from tests import test_router_http
from tests.harness import Stack, metric_samples, scrape_metrics, wait_for, write_registry
from tests.streams import generation_request
from tests.test_router_http import CHAT, LIMIT, MODEL, Deployment, assert_openai_error, post, start_router

#: The HTTP tests' deployment (a fixture of that module, its own instance here).
deployment = test_router_http.deployment


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}).encode()


@pytest.mark.parametrize("role", [["user"], {"name": "user"}, 7])
def test_a_role_that_is_not_a_string_is_a_400_naming_it(deployment: Deployment, role: Any) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}, {"role": role, "content": "b"}]})
    status, _, answer = post(deployment, "/v1/chat/completions", body.encode())
    assert status == 400
    assert "'messages[1].role'" in assert_openai_error(answer, param="messages[1].role")


def test_a_body_nested_too_deep_is_a_400(deployment: Deployment) -> None:
    depth = 100_000
    status, _, answer = post(deployment, "/v1/chat/completions", b"[" * depth + b"]" * depth)
    assert status == 400
    assert "nested" in assert_openai_error(answer, param=None)
    inside = b'{"model": "writer", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    status, _, answer = post(deployment, "/v1/chat/completions", inside)
    assert status == 400
    # Within what the parser takes, but as deep as Python's own limit once an error message quotes the field.
    quoted = chat()[:-1] + b', "n": ' + b"[" * 950 + b"]" * 950 + b"}"
    status, _, answer = post(deployment, "/v1/chat/completions", quoted)
    assert status == 400
    assert "nested" in assert_openai_error(answer, param=None)


#: A JSON escape of a lone UTF-16 surrogate: valid JSON, but no Unicode text (it cannot be encoded as UTF-8).
SURROGATE = "\\ud800"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"model": "writer", "prompt": "a%s"}', "prompt"),
        ("/v1/completions", '{"model": "writer", "prompt": ["a%s"]}', "prompt[0]"),
        ("/v1/chat/completions", '{"model": "writer", "messages": [{"role": "user", "content": "%s"}]}', None),
        (
            "/v1/chat/completions",
            '{"model": "writer", "messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
            None,
        ),
        ("/v1/completions", '{"model": "writer", "prompt": "a", "stop": ["x%s"]}', "stop[0]"),
        ("/v1/completions", '{"model": "writer", "prompt": "a", "user": "u%s"}', "user"),
        ("/v1/completions", '{"model": "w%s", "prompt": "a"}', "model"),
        ("/v1/completions", '{"model": "writer", "prompt": "a", "x%s": 1}', "x\ud800"),
    ],
)
def test_a_lone_surrogate_in_a_string_field_is_a_400_naming_the_field(
    deployment: Deployment, path: str, body: str, param: str | None
) -> None:
    status, _, answer = post(deployment, path, (body % SURROGATE).encode())
    assert status == 400, answer
    if param is None:  # a message's content: the message is named
        param = answer["error"]["param"]
        assert param.startswith("messages[0].content"), answer
    assert "UTF-8" in assert_openai_error(answer, param=param)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-32-le"])
def test_a_lone_surrogate_in_a_body_not_in_utf8_is_a_400(deployment: Deployment, encoding: str) -> None:
    """JSON may come in UTF-16 or UTF-32 (the parser detects it): every byte of an ASCII text so encoded is
    ASCII, and its ``\\u`` escape is not the two bytes ``\\u``, so it must not pass for a plain body."""
    body = '{"model": "writer", "prompt": "a", "user": "u' + SURROGATE + '"}'
    status, _, answer = post(deployment, "/v1/completions", body.encode(encoding))
    assert status == 400, answer
    assert "UTF-8" in assert_openai_error(answer, param="user")


def raw_request(port: int, head: bytes, body: bytes) -> tuple[int, dict[str, str], Any]:
    """One HTTP/1.1 request written byte for byte on a socket (a client library would refuse such headers)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    header_block, _, content = data.partition(b"\r\n\r\n")
    lines = header_block.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(content)


@pytest.mark.parametrize("header", [b"x-routing-key", b"x-request-id", b"x-splitstream-version"])
def test_a_header_value_that_is_not_utf8_is_a_400_naming_the_header(deployment: Deployment, header: bytes) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    status, _, answer = raw_request(deployment.http_port, head + header + b": k\xff\xfe1\r\n", chat())
    assert status == 400, answer
    assert header.decode() in assert_openai_error(answer, param=header.decode())


def test_the_request_id_is_echoed_as_the_grpc_edge_echoes_it(deployment: Deployment) -> None:
    """One helper decides for both edges: an id that merely holds ``%`` comes back as sent (HTTP re-encoded
    ``a%41`` as ``a%2541``), a percent-encoded one is decoded for the completion's id and echoed as sent, and a
    long one a client could send is echoed as sent (HTTP left out any over 4 KiB)."""
    with grpc.insecure_channel(deployment.router.address) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for sent in ("a%41", "100%", "%C3%BC-1", "plain-id", "r" * 5000):
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            status, headers, answer = raw_request(
                deployment.http_port, head + b"x-request-id: " + sent.encode() + b"\r\n", chat()
            )
            assert status == 200, answer
            responses = stub.ModelStreamInfer(
                iter([generation_request(MODEL, "The ", 2)]), metadata=(("x-request-id", sent),), timeout=30
            )
            list(responses)
            trailers = dict(responses.trailing_metadata())
            assert headers["x-request-id"] == trailers["x-request-id"] == sent


def test_a_client_that_goes_away_is_counted_under_the_version_serving_it(deployment: Deployment) -> None:
    body = json.dumps({"model": MODEL, "prompt": "The ", "max_tokens": LIMIT}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    worker = deployment.workers["v2"]
    with socket.create_connection(("127.0.0.1", deployment.http_port), timeout=30) as sock:
        sock.sendall(head + b"x-splitstream-version: v2\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: active(worker) == 1, timeout_s=10, what="the generation to start")
    wait_for(lambda: active(worker) == 0, timeout_s=10, what="the generation to be cancelled")

    def gone() -> set[str]:
        samples = metric_samples(
            scrape_metrics(deployment.router.metrics_port), "splitstream_router_http_requests_total"
        )
        return {labels["version"] for labels, value in samples if labels["status"] == "499" and value > 0}

    assert wait_for(gone, timeout_s=10, what="a 499 counted") == {"v2"}


def active(worker: Any) -> float:
    samples = metric_samples(scrape_metrics(worker.metrics_port), "splitstream_worker_active_sequences")
    return sum(value for _, value in samples)


@pytest.mark.slow
def test_a_request_larger_than_the_worker_takes_is_a_413_not_a_429(tmp_path: Path) -> None:
    language.write_versions(tmp_path / "models", MODEL, generation={"max_tokens_limit": LIMIT})
    stack = Stack(tmp_path)
    try:
        worker = stack.worker(tmp_path / "models", MODEL, "v1", "--max-message-bytes", "4096")
        registry = tmp_path / "registry.yaml"
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
        _, port = start_router(stack, registry)
        deployment = Deployment(stack, registry, {"v1": worker}, stack.processes[-1], port)
        small = json.dumps({"model": MODEL, "prompt": "The ", "max_tokens": 2}).encode()
        assert post(deployment, "/v1/completions", small)[0] == 200
        large = json.dumps({"model": MODEL, "prompt": "x" * 20_000, "max_tokens": 2}).encode()
        status, headers, answer = post(deployment, "/v1/completions", large)
        assert status == 413, answer
        assert "retry-after" not in {name.lower() for name in headers}
        assert_openai_error(answer, param=None, code="request_too_large")
    finally:
        stack.close()
