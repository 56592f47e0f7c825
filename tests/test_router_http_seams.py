"""The router's HTTP front door pushed at its seams from outside: clients that leave at the last event, send
odd bytes or deep JSON, callers refused on KServe's routes, and ``openai`` upstreams that stall, refuse the
router's key or never close. Real processes: redis-server, a recorder, a router with ``--http-port``,
``--recorder`` and ``--auth-principals``, an affine worker (KServe ``/infer``), a generating worker (the
OpenAI and generate routes, translated) and an upstream that misbehaves on cue (:mod:`tests.faulty_upstream`,
its behaviour named by the model name the registry gives it). Each test reads back what the client got, the
call's record in Redis, or the router's metrics.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import yaml

from demo import language
from splitstream.common.files import atomic_write
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.router.config import parse_args
from tests.harness import ServiceProcess, Stack, free_port, metric_samples, scrape_metrics, wait_for
from tests.recording_stack import RecordingStack
from tests.test_auth import sha256
from tests.test_router_http import accepts

WRITER = "writer"
#: A generating model on a worker of its own, which a test stops (SIGSTOP) to stall it.
STALLING = "stalling"
AFFINE = "affine"
#: The faulty upstream's behaviours; model ``up-<behaviour>`` is served by it, asked as ``<behaviour>``.
BEHAVIOURS = ("ok", "linger", "endless", "stall", "stall-mid", "unauthorized", "forbidden")
#: --upstream-idle-timeout-s: short, so a stalled upstream ends a test's call soon.
IDLE_S = 2
KEYS = {name: f"sk-seams-{name}-0123456789abcdef" for name in ("alice", "bob", "limited")}
AFFINE_BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def up(behaviour: str) -> str:
    return f"up-{behaviour}"


@dataclass
class Seams:
    recording: RecordingStack
    http_port: int
    upstream: ServiceProcess
    stalling: ServiceProcess

    def records(self, model: str, request_id: str) -> recorder_pb2.CallRecord:
        (record,) = [r for r in self.recording.wait_recorded({request_id}, model=model) if r.request_id == request_id]
        return record

    def metric(self, name: str, **labels: str) -> float:
        samples = metric_samples(scrape_metrics(self.recording.router.metrics_port), name)
        return sum(value for found, value in samples if labels.items() <= found.items())


@pytest.fixture(scope="module")
def seams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seams]:
    tmp = tmp_path_factory.mktemp("http-seams")
    language.write_versions(tmp / "models", WRITER)
    language.write_versions(tmp / "models", STALLING)
    principals = tmp / "principals.yaml"
    atomic_write(
        principals,
        yaml.safe_dump(
            {
                "principals": {
                    "alice": {"api_keys_sha256": [sha256(KEYS["alice"])], "models": ["*"], "pin": True},
                    "bob": {"api_keys_sha256": [sha256(KEYS["bob"])], "models": [WRITER]},
                    "limited": {
                        "api_keys_sha256": [sha256(KEYS["limited"])],
                        "models": ["*"],
                        "rate_limit": {"per_s": 0.001, "burst": 1},
                    },
                }
            }
        ),
    )
    (tmp / "own").mkdir()
    own = Stack(tmp / "own")
    recording: RecordingStack | None = None
    try:
        port = free_port()
        upstream = ServiceProcess(
            "faulty-upstream", "tests.faulty_upstream", ["--port", str(port)], log_dir=own.tmp_path, port=port
        )
        own.processes.append(upstream)
        upstream.start(wait_serving=False)
        wait_for(lambda: accepts(port), timeout_s=30, what="the faulty upstream to accept")
        writer = own.worker(tmp / "models", WRITER, "v1")
        base = f"http://127.0.0.1:{port}/v1"
        stalling = own.worker(tmp / "models", STALLING, "v1")
        more: dict[str, Any] = {
            WRITER: {"endpoints": {"v1": [writer.address]}},
            STALLING: {"endpoints": {"v1": [stalling.address]}},
        }
        for behaviour in BEHAVIOURS:
            more[up(behaviour)] = {"endpoints": {"v1": {"openai": base, "model": behaviour}}}
        http_port = free_port()
        recording = RecordingStack(
            tmp / "recording",
            more_models=more,
            router_args=(
                "--http-port", str(http_port),
                "--auth-principals", f"file:{principals}",
                "--upstream-idle-timeout-s", str(IDLE_S),
                "--http-body-timeout-s", str(IDLE_S),
            ),
        )  # fmt: skip
        wait_for(lambda: accepts(http_port), timeout_s=30, what="the HTTP port to accept")
        yield Seams(recording, http_port, upstream, stalling)
    finally:
        if recording is not None:
            recording.close()
        own.close()


def send(
    port: int,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str | bytes] | None = None,
    *,
    key: str = KEYS["alice"],
) -> http.client.HTTPResponse:
    """A raw request (POST with ``body``, else GET); header values may be bytes, sent as they are."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=IDLE_S * 10)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    connection.putrequest("POST" if data is not None else "GET", path)
    all_headers: dict[str, str | bytes] = {"Content-Type": "application/json", **(headers or {})}
    if key:
        all_headers["Authorization"] = f"Bearer {key}"
    if data is not None:
        all_headers["Content-Length"] = str(len(data))
    for name, value in all_headers.items():
        connection.putheader(name, value)
    connection.endheaders(data)
    return connection.getresponse()


def answer(response: http.client.HTTPResponse) -> tuple[int, Any]:
    return response.status, json.loads(response.read())


def events(response: http.client.HTTPResponse) -> Iterator[str]:
    for line in response:
        if line.startswith(b"data: "):
            yield line[6:].decode().strip()


def completion(model: str, *, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "The ", "max_tokens": 4, "stream": stream, **extra}


# -- the end of a stream --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_client_that_leaves_at_done_is_recorded_and_counted_with_the_200_it_got(seams: Seams) -> None:
    """The upstream sends ``[DONE]`` and keeps its response open; the client leaves as soon as it reads it, as
    OpenAI's clients do. It had its whole answer: a 200, not a 499 (the upstream's connection is closed then)."""
    body = completion(up("linger"), stream=True)
    response = send(seams.http_port, "/v1/completions", body, {"x-request-id": "done-1"})
    assert response.status == 200
    got = []
    for event in events(response):
        got.append(event)
        if event == "[DONE]":
            break
    response.close()
    record = seams.records(up("linger"), "done-1")
    assert (record.http.status, record.status_code) == (200, grpc.StatusCode.OK.value[0])
    assert [e.payload.inline.decode() for e in record.http.events] == got
    assert seams.metric(
        "splitstream_router_http_requests_total", model=up("linger"), route="/v1/completions", status="200"
    )
    assert not seams.metric("splitstream_router_http_requests_total", model=up("linger"), status="499")


def test_a_client_leaving_a_passed_through_stream_is_recorded_499_and_the_upstream_sees_it_go(seams: Seams) -> None:
    gone = json.loads(send(seams.upstream.port, "/stats", key="").read())["gone"]
    body = completion(up("endless"), stream=True)
    response = send(seams.http_port, "/v1/completions", body, {"x-request-id": "gone-1"})
    stream = events(response)
    got = [next(stream) for _ in range(3)]
    response.close()
    record = seams.records(up("endless"), "gone-1")
    assert (record.http.status, record.status_code) == (499, grpc.StatusCode.CANCELLED.value[0])
    assert [e.payload.inline.decode() for e in record.http.events][:3] == got
    wait_for(
        lambda: json.loads(send(seams.upstream.port, "/stats", key="").read())["gone"] > gone,
        timeout_s=10,
        what="the upstream to see its client go",
    )


# -- who called ------------------------------------------------------------------------------------------------


def test_the_principal_is_recorded_on_openai_kserve_and_passed_through_calls(seams: Seams) -> None:
    calls = [
        (WRITER, "/v1/completions", completion(WRITER, stream=False)),
        (WRITER, "/v1/chat/completions", {"model": WRITER, "messages": [{"role": "user", "content": "The "}]}),
        (up("ok"), "/v1/completions", completion(up("ok"), stream=True)),
        (AFFINE, f"/v2/models/{AFFINE}/infer", AFFINE_BODY),
        (WRITER, f"/v2/models/{WRITER}/generate_stream", {"text_input": "The ", "max_tokens": 3}),
    ]
    for index, (model, path, body) in enumerate(calls):
        response = send(seams.http_port, path, body, {"x-request-id": f"who-{index}"})
        assert response.status == 200, (path, response.read())
        response.read()
        assert seams.records(model, f"who-{index}").principal == "alice", path


# -- upstreams that misbehave ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_that_never_answers_is_a_504_naming_the_idle_timeout_and_is_recorded(
    seams: Seams, stream: bool
) -> None:
    request_id = f"stall-{stream}"
    status, body = answer(
        send(seams.http_port, "/v1/completions", completion(up("stall"), stream=stream), {"x-request-id": request_id})
    )
    assert status == 504
    assert body["error"]["code"] == "deadline_exceeded"
    assert "--upstream-idle-timeout-s" in body["error"]["message"]
    record = seams.records(up("stall"), request_id)
    assert (record.http.status, record.status_code) == (504, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])


def test_an_upstream_that_stalls_mid_stream_ends_the_clients_stream_with_a_504_error_event(seams: Seams) -> None:
    body = completion(up("stall-mid"), stream=True)
    response = send(seams.http_port, "/v1/completions", body, {"x-request-id": "mid-1"})
    assert response.status == 200
    got = list(events(response))  # ends: never a hang
    assert [json.loads(event)["choices"][0]["text"] for event in got[:2]] == ["one", " two"]
    assert "[DONE]" not in got
    error = json.loads(got[-1])["error"]
    assert error["code"] == "deadline_exceeded"
    assert "sent nothing" in error["message"]
    record = seams.records(up("stall-mid"), "mid-1")
    assert (record.http.status, record.status_code) == (504, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
    assert record.http.events[-1].payload.inline.decode() == got[-1]


@contextlib.contextmanager
def stopped(worker: ServiceProcess) -> Iterator[None]:
    """The worker frozen (SIGSTOP) and thawed after, whatever happens: a worker that stalls mid-generation."""
    worker.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        worker.signal(signal.SIGCONT)


def test_a_generating_worker_that_sends_nothing_is_a_504_naming_the_idle_timeout(seams: Seams) -> None:
    """Our own worker stalls as an upstream can: the translated call must end too, not wait for the client's own
    timeout (an OpenAI client waits 10 minutes)."""
    with stopped(seams.stalling):
        status, body = answer(
            send(seams.http_port, "/v1/completions", completion(STALLING, stream=False), {"x-request-id": "ws-1"})
        )
    assert status == 504, body
    assert body["error"]["code"] == "deadline_exceeded"
    assert "sent nothing for 2 s (--upstream-idle-timeout-s)" in body["error"]["message"]
    record = seams.records(STALLING, "ws-1")
    assert (record.http.status, record.status_code) == (504, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])


def test_a_generating_worker_that_stalls_mid_stream_ends_the_clients_stream_with_an_error_event(
    seams: Seams,
) -> None:
    body = completion(STALLING, stream=True, max_tokens=4096)
    response = send(seams.http_port, "/v1/completions", body, {"x-request-id": "ws-2"})
    assert response.status == 200
    stream = events(response)
    got = [next(stream)]
    with stopped(seams.stalling):
        got += list(stream)  # ends: never a hang (the connection's own timeout is 10x the idle one)
    assert "[DONE]" not in got
    error = json.loads(got[-1])["error"]
    assert error["code"] == "deadline_exceeded"
    assert "sent nothing" in error["message"]
    assert len(got) < 4096
    record = seams.records(STALLING, "ws-2")
    assert (record.http.status, record.status_code) == (504, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
    # Thawed, the worker serves again.
    status, _ = answer(send(seams.http_port, "/v1/completions", completion(STALLING, stream=False)))
    assert status == 200


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "3601"])
def test_an_idle_timeout_out_of_bounds_is_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--registry", "file:registry.yaml", "--upstream-idle-timeout-s", value])
    assert exited.value.code == 2
    assert "--upstream-idle-timeout-s" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("behaviour", ["unauthorized", "forbidden"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_refusing_the_routers_credentials_is_a_502_naming_the_upstream(
    seams: Seams, behaviour: str, stream: bool
) -> None:
    """Not the client's 401/403: its own key was accepted; the router's key for the upstream is wrong."""
    request_id = f"creds-{behaviour}-{stream}"
    status, body = answer(
        send(seams.http_port, "/v1/completions", completion(up(behaviour), stream=stream), {"x-request-id": request_id})
    )
    assert status == 502
    assert body["error"]["type"] == "server_error"
    assert "upstream" in body["error"]["message"]
    assert "credentials" in body["error"]["message"]
    record = seams.records(up(behaviour), request_id)
    assert record.http.status == 502
    assert record.status_code == grpc.StatusCode.INTERNAL.value[0]


def test_passed_through_streams_count_in_the_stream_metrics_per_version(seams: Seams) -> None:
    labels = {"model": up("ok"), "version": "v1"}
    before = seams.metric("splitstream_router_streams_total", status="OK", **labels)
    for _ in range(2):
        response = send(seams.http_port, "/v1/completions", completion(up("ok"), stream=True))
        assert list(events(response))[-1] == "[DONE]"
    assert seams.metric("splitstream_router_streams_total", status="OK", **labels) == before + 2
    assert seams.metric("splitstream_router_stream_ttft_seconds_count", **labels) >= 2
    assert seams.metric("splitstream_router_stream_gap_seconds_count", **labels) >= 2
    assert seams.metric("splitstream_router_stream_responses_sum", **labels) >= 8  # 3 texts and [DONE], each
    assert seams.metric("splitstream_router_streams_active", **labels) == 0


# -- KServe's routes answer in KServe's shape -------------------------------------------------------------------


def assert_kserve_error(status: int, body: Any, expected: int, *words: str) -> None:
    assert status == expected, body
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    assert isinstance(body["error"], str), body
    for word in words:
        assert word in body["error"]


def test_refused_callers_on_kserve_routes_get_kserves_error_shape(seams: Seams) -> None:
    response = send(seams.http_port, f"/v2/models/{AFFINE}/infer", AFFINE_BODY, key="")
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert_kserve_error(*answer(response), 401)
    assert_kserve_error(*answer(send(seams.http_port, f"/v2/models/{AFFINE}/infer", AFFINE_BODY, key=KEYS["bob"])), 403)
    assert send(seams.http_port, f"/v2/models/{AFFINE}/ready", key=KEYS["limited"]).status == 200
    limited = send(seams.http_port, f"/v2/models/{AFFINE}/ready", key=KEYS["limited"])
    assert int(limited.headers["Retry-After"]) >= 1
    assert_kserve_error(*answer(limited), 429)


def nested(depth: int) -> bytes:
    return b'{"inputs": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    ("path", "body", "expected", "word"),
    [
        (f"/v2/models/{AFFINE}/infer", b"{not json", 400, "JSON"),
        (f"/v2/models/{AFFINE}/infer", nested(100_000), 400, "nested"),
        (f"/v2/models/{AFFINE}/infer", nested(500), 400, "nested"),
        (f"/v2/models/{WRITER}/generate", b'{"text_input": "\\ud800"}', 400, "text_input"),
        ("/v2/models/no-such-model/infer", json.dumps(AFFINE_BODY).encode(), 404, "no-such-model"),
    ],
    ids=["not-json", "deep", "nested-500", "lone-surrogate", "unknown-model"],
)
def test_bad_input_on_kserve_routes_is_refused_in_kserves_shape(
    seams: Seams, path: str, body: bytes, expected: int, word: str
) -> None:
    assert_kserve_error(*answer(send(seams.http_port, path, body)), expected, word)


# -- odd header bytes ------------------------------------------------------------------------------------------


def test_a_routing_key_that_is_not_utf8_is_a_400_naming_the_header_on_kserve_routes(seams: Seams) -> None:
    response = send(seams.http_port, f"/v2/models/{AFFINE}/infer", AFFINE_BODY, {"x-routing-key": b"\xff\xfeuser"})
    assert_kserve_error(*answer(response), 400, "x-routing-key")


@pytest.mark.parametrize(
    ("model", "path", "body"),
    [
        (WRITER, "/v1/completions", completion(WRITER, stream=False)),
        (up("ok"), "/v1/completions", completion(up("ok"), stream=False)),
        (AFFINE, f"/v2/models/{AFFINE}/infer", AFFINE_BODY),
    ],
    ids=["translated", "passed-through", "kserve-infer"],
)
def test_a_header_that_is_not_utf8_is_served_and_recorded_with_its_odd_bytes_replaced(
    seams: Seams, model: str, path: str, body: dict[str, Any]
) -> None:
    request_id = f"odd-{model}-{path.rsplit('/', 1)[-1]}"
    response = send(seams.http_port, path, body, {"x-request-id": request_id, "x-note": b"caf\xe9 \xff"})
    assert response.status == 200, response.read()
    response.read()
    record = seams.records(model, request_id)
    assert record.metadata["x-note"] == "caf\ufffd \ufffd"


def test_the_idle_timeout_default_is_sane() -> None:
    config = parse_args(["--registry", "file:registry.yaml"])
    assert math.isclose(config.upstream_idle_timeout_s, 300)


@pytest.mark.parametrize("route", ["infer", "generate"])
def test_a_kserve_call_routed_to_an_openai_upstream_is_a_400_naming_why(seams: Seams, route: str) -> None:
    """KServe's tensors have no OpenAI form: the client is told the version is an HTTP upstream and where to
    call it, in KServe's shape."""
    body = AFFINE_BODY if route == "infer" else {"text_input": "The "}
    status, answered = answer(send(seams.http_port, f"/v2/models/{up('ok')}/{route}", body))
    assert_kserve_error(status, answered, 400, "OpenAI-compatible HTTP upstream", "/v1/chat/completions")


@pytest.mark.parametrize(
    ("path", "kserve"), [("/v1/completions", False), (f"/v2/models/{AFFINE}/infer", True)], ids=["openai", "kserve"]
)
def test_a_body_that_stops_arriving_is_a_408_in_the_routes_shape(seams: Seams, path: str, kserve: bool) -> None:
    """Headers, then a few of the body's bytes, then nothing: the handler must not wait forever."""
    connection = http.client.HTTPConnection("127.0.0.1", seams.http_port, timeout=IDLE_S * 10)
    connection.putrequest("POST", path)
    for name, value in (
        ("Content-Type", "application/json"),
        ("Content-Length", "1000"),
        ("Authorization", f"Bearer {KEYS['alice']}"),
    ):
        connection.putheader(name, value)
    connection.endheaders(b'{"model": ')
    status, body = answer(connection.getresponse())
    if kserve:
        assert_kserve_error(status, body, 408, "--http-body-timeout-s")
    else:
        assert status == 408
        assert "--http-body-timeout-s" in body["error"]["message"]
