"""Recorded HTTP calls replayed over HTTP and compared, end to end: a router with ``--http-port``, callers
checked by API key, in front of two generating workers (demo/language.py's bigram v1 and trigram v2 at
50/50 by user), its shipper, a recorder and redis-server; calls made with the official ``openai`` client
(whole and streamed, with ``include_usage``) and Triton's generate routes; then the real replayer CLI.

Greedy generation is a function of the prompt and the model, so a call v2 answered replays against v2 with
the same text, and one v1 answered diverges wherever the bigram's text differs from the trigram's: the
replay must say which calls, where the texts part (a character offset) and how far (edit distance), and
compare the usage the answers report. gRPC calls in the same window are not HTTP exchanges: counted as not
replayed, never silently lost."""

from __future__ import annotations

import hashlib
import http.client
import json
import time
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
from splitstream.common.headers import VERSION_HEADER
from tests.harness import ServiceProcess, Stack, free_port, wait_for
from tests.recording_stack import RecordingStack
from tests.replays import ReplayRun, run_replay
from tests.streams import generation_request

MODEL = "writer"
KEY = "sk-replay-http-" + "7" * 32
USERS = 8
TOKENS = 16
PROMPTS = [
    "Hello, how are you today? ",
    "Tell me about the sea. ",
    "What is the weather like? ",
    "Write a short poem about the night. ",
    "Why is the sky blue? ",
    "The quick brown fox ",
    "Once upon a time ",
    "Where should I travel next? ",
]
UNARY_METHOD = "/inference.GRPCInferenceService/ModelInfer"

pytestmark = pytest.mark.slow


@dataclass
class Traffic:
    stack: RecordingStack
    http_port: int
    since_ns: int
    until_ns: int
    #: request id → the version that served it.
    served: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def accepts(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        return connection.getresponse().status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    tmp = tmp_path_factory.mktemp("http-replay")
    models = tmp / "models"
    language.write_versions(models, MODEL, generation={"max_tokens_limit": 1_000_000})
    principals = tmp / "principals.yaml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    atomic_write(
        principals,
        yaml.safe_dump({"principals": {"app": {"api_keys_sha256": [digest], "models": ["*"], "pin": True}}}),
    )

    def worker(stack: Stack, version: str) -> ServiceProcess:
        return stack.worker(models, MODEL, version)

    http_port = free_port()
    stack = RecordingStack(
        tmp,
        model=MODEL,
        versions={"v1": {}, "v2": {}},
        experiment={
            "salt": "http-replay",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        },
        worker=worker,
        router_args=("--http-port", str(http_port), "--auth-principals", f"file:{principals}"),
    )
    try:
        wait_for(lambda: accepts(http_port), timeout_s=30, what="the HTTP port to accept")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY, max_retries=0, timeout=30)
        since_ns = time.time_ns() - 1_000_000_000
        served: dict[str, str] = {}
        for user, prompt in enumerate(PROMPTS[:USERS]):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=TOKENS,
                user=f"user-{user}",
                extra_headers={"x-request-id": f"chat-{user}"},
            )
            served[f"chat-{user}"] = raw.headers["x-splitstream-version"]
            raw_stream = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                user=f"user-{user}",
                extra_headers={"x-request-id": f"stream-{user}"},
            )
            list(raw_stream.parse())
            served[f"stream-{user}"] = raw_stream.headers["x-splitstream-version"]
        completion = client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, extra_headers={"x-request-id": "completion-1"}
        )
        served["completion-1"] = completion.headers["x-splitstream-version"]
        for path, request_id in (("generate", "generate-1"), ("generate_stream", "generate-stream-1")):
            connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
            body = json.dumps({"text_input": PROMPTS[1], "max_tokens": TOKENS}).encode()
            headers = {"x-request-id": request_id, "Authorization": f"Bearer {KEY}", VERSION_HEADER: "v2"}
            connection.request("POST", f"/v2/models/{MODEL}/{path}", body, headers)
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            served[request_id] = "v2"
        # A gRPC call in the same window: no HTTP exchange to replay over HTTP.
        with grpc.insecure_channel(stack.router.address) as channel:
            channel.unary_unary(UNARY_METHOD)(
                generation_request(MODEL, PROMPTS[2], TOKENS, request_id="grpc-1").SerializeToString(),
                metadata=[("x-api-key", KEY), (VERSION_HEADER, "v2")],
                timeout=20,
            )
        served["grpc-1"] = "v2"
        stack.wait_recorded(set(served))
        yield Traffic(stack, http_port, since_ns, time.time_ns(), served)
    finally:
        stack.close()


class Run(ReplayRun):
    @property
    def results(self) -> dict[str, dict[str, Any]]:
        return {line["request_id"]: line for line in self.result_lines()}


def replay(traffic: Traffic, out: Path, *args: str, key: bool = True, target: str = "") -> Run:
    window = ("--since", f"{traffic.since_ns / 1e9:.9f}", "--until", f"{traffic.until_ns / 1e9:.9f}")
    env = {"SPLITSTREAM_REPLAY_API_KEY": KEY} if key else {"SPLITSTREAM_REPLAY_API_KEY": ""}
    code, stdout, stderr = run_replay(
        traffic.stack.redis.url,
        out,
        *window,
        "--target",
        target or traffic.url,
        "--speed",
        "max",
        "--no-progress",
        *args,
        env=env,
        timeout_s=120,
        model=MODEL,
    )
    return Run(code, stdout, stderr, out)


@pytest.fixture(scope="module")
def against_v2(traffic: Traffic, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return replay(traffic, tmp_path_factory.mktemp("against-v2"), "--pin-version", "v2")


def test_the_split_served_both_versions_so_the_replay_has_calls_to_match_and_to_diverge(traffic: Traffic) -> None:
    chats = {traffic.served[f"chat-{user}"] for user in range(USERS)}
    assert chats == {"v1", "v2"}


def test_calls_v2_answered_replay_against_v2_with_the_same_text_and_v1_calls_diverge_with_offset_and_distance(
    traffic: Traffic, against_v2: Run
) -> None:
    assert against_v2.code == 0, against_v2.stderr
    results = against_v2.results
    http_ids = [request_id for request_id in traffic.served if request_id != "grpc-1"]
    for request_id in http_ids:
        line = results[request_id]
        assert line["kind"] == "http", line
        assert line["replay_request_id"] == request_id + ":replay"
        assert line["replayed"]["version"] == "v2"
        assert (line["recorded"]["status"], line["replayed"]["status"]) == ("200", "200")
        text = line["text"]
        if traffic.served[request_id] == "v2":
            assert line["outcome"] == "match", line
            assert (text["first_divergence"], text["edit_distance"]) == (None, 0.0)
        else:
            assert line["outcome"] == "mismatch", line
            assert 0 <= text["first_divergence"] <= len(text["reference_text"])
            assert (
                text["reference_text"][: text["first_divergence"]] == text["candidate_text"][: text["first_divergence"]]
            )
            assert text["reference_text"] != text["candidate_text"]
            assert 0 < text["edit_distance"] <= 1
    # A streamed call is read as a stream: TTFT on both sides, and its usage (include_usage) compared.
    streamed = results["stream-0"]
    assert streamed["recorded"]["ttft_ms"] > 0
    assert streamed["replayed"]["ttft_ms"] > 0
    assert streamed["usage"]["match"] is True
    assert streamed["usage"]["reference"]["completion_tokens"] == TOKENS
    assert results["generate-stream-1"]["outcome"] == "match"
    assert results["generate-stream-1"]["replayed"]["ttft_ms"] > 0


def test_the_summary_counts_http_calls_by_route_compares_usage_and_ttft_and_the_grpc_call_is_not_replayed(
    traffic: Traffic, against_v2: Run
) -> None:
    summary = against_v2.summary
    http_calls = len(traffic.served) - 1
    v1_calls = sum(version == "v1" for request_id, version in traffic.served.items() if request_id != "grpc-1")
    assert summary["counts"]["not_replayed"] == {"grpc_call_needs_grpc_target": 1}
    assert against_v2.results["grpc-1"]["outcome"] == "not_replayed"
    assert summary["counts"]["completed"] == http_calls
    assert summary["metrics"]["failed_sends"] == 0
    assert summary["outcomes"] == {"match": http_calls - v1_calls, "mismatch": v1_calls, "status_change": 0}
    assert summary["http"]["apis"] == {"chat": 2 * USERS, "completion": 1, "generate": 1, "generate-stream": 1}
    assert summary["http"]["usage_compared"] == http_calls
    assert summary["metrics"]["usage_mismatch_rate"] == 0.0
    streams = summary["streams"]
    assert streams["compared"] == http_calls
    assert streams["token_match_rate"] == pytest.approx((http_calls - v1_calls) / http_calls, abs=1e-6)
    assert streams["ttft"]["reference"]["count"] > 0
    assert streams["ttft"]["candidate"]["count"] > 0
    assert streams["itl"]["candidate"]["count"] > 0
    assert "1 not replayed (gRPC calls: they need a host:port target)" in against_v2.stdout
    report = (against_v2.out / "report.html").read_text()
    assert "Token streams" in report
    assert f"HTTP calls: <b>{http_calls}</b>; usage compared on <b>{http_calls}</b>" in report


def test_replayed_against_the_other_version_the_v2_calls_diverge_and_the_v1_calls_match(
    traffic: Traffic, tmp_path: Path
) -> None:
    run = replay(traffic, tmp_path, "--pin-version", "v1")
    assert run.code == 0, run.stderr
    for request_id, line in run.results.items():
        if request_id == "grpc-1":
            continue
        assert line["outcome"] == ("match" if traffic.served[request_id] == "v1" else "mismatch"), line


def test_the_gate_fails_on_the_diverging_texts_and_passes_on_v2s_calls_alone(traffic: Traffic, tmp_path: Path) -> None:
    gate = "token_match_rate>=0.99,usage_mismatch_rate<=0.01,error_rate<=0"
    failing = replay(traffic, tmp_path / "all", "--pin-version", "v2", "--gate", gate)
    assert failing.code == 1, failing.stderr
    assert "token_match_rate" in failing.stderr
    passing = replay(traffic, tmp_path / "v2", "--pin-version", "v2", "--version", "v2", "--gate", gate)
    assert passing.code == 0, passing.stderr
    assert "gate passed" in passing.stdout


def test_without_the_key_the_router_refuses_and_the_replay_exits_2_naming_the_credentials(
    traffic: Traffic, tmp_path: Path
) -> None:
    run = replay(traffic, tmp_path, "--pin-version", "v2", key=False)
    assert run.code == 2
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("splitstream-replay: error: ")
    assert "HTTP 401" in line
    assert "SPLITSTREAM_REPLAY_API_KEY" in line
    assert not (tmp_path / "results.jsonl").exists()


def test_the_key_from_api_key_file_is_sent_as_a_bearer_token(traffic: Traffic, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    out = tmp_path / "out"
    run = replay(traffic, out, "--pin-version", "v2", "--version", "v2", "--api-key-file", str(key_file), key=False)
    assert run.code == 0, run.stderr
    assert run.summary["outcomes"]["status_change"] == 0
    assert KEY not in (out / "results.jsonl").read_text() + (out / "summary.json").read_text()


def test_a_grpc_target_replays_the_grpc_call_and_counts_the_http_calls_as_not_replayed(
    traffic: Traffic, tmp_path: Path
) -> None:
    run = replay(traffic, tmp_path, "--pin-version", "v2", target=traffic.stack.router.address)
    assert run.code == 0, run.stderr
    summary = run.summary
    assert summary["counts"]["not_replayed"] == {"http_call_needs_http_target": len(traffic.served) - 1}
    assert summary["counts"]["completed"] == 1
    assert run.results["grpc-1"]["outcome"] == "match"
    assert run.results["chat-0"]["not_replayed"] == "http_call_needs_http_target"


def test_an_unreachable_target_and_a_grpc_port_given_as_http_exit_2_with_one_line(
    traffic: Traffic, tmp_path: Path
) -> None:
    nobody = replay(traffic, tmp_path / "a", "--connect-timeout-s", "1", target=f"http://127.0.0.1:{free_port()}")
    assert nobody.code == 2
    (line,) = nobody.stderr.strip().splitlines()
    assert "is unreachable" in line
    grpc_port = replay(
        traffic, tmp_path / "b", "--connect-timeout-s", "3", target=f"http://{traffic.stack.router.address}"
    )
    assert grpc_port.code == 2
    (line,) = grpc_port.stderr.strip().splitlines()
    assert "does not answer HTTP/1.1" in line
    mixed = replay(traffic, tmp_path / "c", "--compare-to", traffic.stack.router.address)
    assert mixed.code == 2
    assert "must both be gRPC" in mixed.stderr


def test_drop_user_sends_the_body_without_the_recorded_user(traffic: Traffic, tmp_path: Path) -> None:
    """The recorded ``user`` is its HMAC: re-sent, the router splits on it as a user of its own; dropped, the
    call is routed as one without a user (here pinned), and still compared."""
    out = tmp_path / "out"
    run = replay(traffic, out, "--pin-version", "v2", "--version", "v2", "--drop-user", "--id-suffix", ":dropped")
    assert run.code == 0, run.stderr
    replayed = {r.request_id: r for r in traffic.stack.records() if r.request_id.endswith(":dropped")}
    chat = next(
        request_id
        for request_id, version in traffic.served.items()
        if request_id.startswith("chat-") and version == "v2"
    )
    sent = json.loads(replayed[chat + ":dropped"].http.request_body.inline)
    assert "user" not in sent
    assert run.results[chat]["outcome"] == "match"


def test_noise_from_v1_pins_the_second_pass_and_counts_each_text_as_one_trial(traffic: Traffic, tmp_path: Path) -> None:
    """``--pin-version v2 --noise-from v1``: the control's pass goes out pinned to v1 (not to v2), so it matches
    exactly the calls v1 answered; the text field's rates are the shares each side differs, one call one trial."""
    run = replay(traffic, tmp_path, "--pin-version", "v2", "--noise-from", "v1", "--noise-min-calls", "1")
    assert run.code == 0, run.stderr
    lines = {request_id: line for request_id, line in run.results.items() if request_id != "grpc-1"}
    for request_id, line in lines.items():
        assert line["control"]["outcome"] == ("match" if traffic.served[request_id] == "v1" else "mismatch"), line
    text = run.summary["noise"]["fields"]["text"]
    served_v1 = sum(traffic.served[request_id] == "v1" for request_id in lines)
    assert text["calls"] == len(lines)
    assert text["control_rate"] == pytest.approx((len(lines) - served_v1) / len(lines), abs=1e-6)
    assert text["candidate_rate"] == pytest.approx(served_v1 / len(lines), abs=1e-6)
