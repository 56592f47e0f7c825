"""Recorded token streams replayed and compared, end to end: real generating workers (bigram v1, trigram
v2) behind a real router splitting users 50/50, a recorder and redis-server, then the real replayer CLI.

Greedy generation is a function of the prompt and the model, so a stream v2 answered replays against v2
token for token, and one v1 answered diverges wherever the bigram's greedy text differs from the
trigram's: the replayer must say which, where, and by how much."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from redis.asyncio import Redis

from demo import language
from splitstream.common.headers import DEFAULT_ROUTING_KEY_HEADER, VERSION_HEADER
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.replayer.report import STREAM_CANDIDATE_COLOR, STREAM_REFERENCE_COLOR
from tests.browser import needs_chromium, pixels_of, screenshot
from tests.harness import Stack, wait_for
from tests.recording_stack import MODEL, RecordingStack
from tests.records import RecordedStream, stream_of
from tests.replays import ReplayRun, run_replay
from tests.stream_client import OpenStream, run_stream
from tests.streams import generation_request, token_text

TOKENS = 24
UNARY_METHOD = "/inference.GRPCInferenceService/ModelInfer"
PROMPTS = [
    "Hello, how are you today? ",
    "Tell me about the sea. ",
    "What is the weather like? ",
    "Write a short poem about the night. ",
    "Why is the sky blue? ",
    "Can you help me with my homework? ",
    "The quick brown fox ",
    "Once upon a time ",
    "Where should I travel next? ",
    "What do you think of the king? ",
    "Give me a recipe for bread. ",
    "How do I learn to play? ",
]
EXPERIMENT = {
    "salt": "stream-replay",
    "control": "v1",
    "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
}


def greedy(version: str, prompt: str, tokens: int) -> str:
    """The version's own greedy continuation, computed in NumPy from the same counts as its graph."""
    model = language.count(language.corpus(), language.ORDERS[version])
    text = b"\n" * model.context + prompt.encode()
    for _ in range(tokens):
        text += bytes((int(np.argmax(model.next_logits(text))),))
    return text[model.context + len(prompt.encode()) :].decode()


@dataclass
class Traffic:
    stack: RecordingStack
    since_ns: int
    #: The window's end: replays through the router are recorded too, and must not join later windows.
    until_ns: int
    #: request id → (prompt, version that served it).
    streams: dict[str, tuple[str, str]]
    cancelled_id: str
    records: dict[str, recorder_pb2.CallRecord]
    #: request id → the version that served the same user's next stream.
    again: dict[str, str]
    #: A unary ModelInfer call to the same model in the same window: (prompt, version that served it).
    unary: tuple[str, str]


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    tmp = tmp_path_factory.mktemp("stream-replay")
    repository = tmp / "ngram"
    language.write_versions(repository, MODEL)

    def worker(stack: Stack, version: str) -> Any:
        return stack.worker(repository, MODEL, version)

    stack = RecordingStack(tmp, versions={"v1": {}, "v2": {}}, experiment=EXPERIMENT, worker=worker)
    try:
        since_ns = time.time_ns() - 1_000_000_000
        streams: dict[str, tuple[str, str]] = {}
        for user, prompt in enumerate(PROMPTS):
            request_id = f"chat-{user}"
            request = generation_request(MODEL, prompt, TOKENS, request_id=request_id)
            result = run_stream(
                stack.router.address,
                [request.SerializeToString()],
                metadata=[(DEFAULT_ROUTING_KEY_HEADER, f"user-{user}")],
            )
            assert result.code == grpc.StatusCode.OK, result.details
            streams[request_id] = (prompt, result.version)
        again = {}
        for user, prompt in enumerate(PROMPTS):  # the same users again, before the window's records are read
            result = run_stream(
                stack.router.address,
                [generation_request(MODEL, prompt, 2, request_id=f"again-{user}").SerializeToString()],
                metadata=[(DEFAULT_ROUTING_KEY_HEADER, f"user-{user}")],
            )
            again[f"chat-{user}"] = result.version
        # A unary call in the same window (the worker answers ModelInfer with the whole text): mixed with streams.
        with grpc.insecure_channel(stack.router.address) as channel:
            _, call = channel.unary_unary(UNARY_METHOD).with_call(
                generation_request(MODEL, PROMPTS[1], TOKENS, request_id="unary-1").SerializeToString(),
                metadata=[(DEFAULT_ROUTING_KEY_HEADER, "user-unary")],
                timeout=20,
            )
            unary = (PROMPTS[1], dict(call.trailing_metadata() or ())[VERSION_HEADER])
        # Two requests on one stream, sent at once (pinned to v2): their responses interleave.
        pair = run_stream(
            stack.router.address,
            [
                generation_request(MODEL, prompt, TOKENS, request_id=request_id).SerializeToString()
                for request_id, prompt in (("pair-a", PROMPTS[2]), ("pair-b", PROMPTS[3]))
            ],
            metadata=[(VERSION_HEADER, "v2")],
        )
        assert pair.code == grpc.StatusCode.OK, pair.details
        # A stream its client leaves after three tokens, pinned to v2: recorded CANCELLED, with a prefix.
        cancelled = OpenStream(stack.router.address, metadata=[(VERSION_HEADER, "v2")])
        cancelled.send(generation_request(MODEL, PROMPTS[0], 2000, request_id="left-early").SerializeToString())
        for _ in range(3):
            cancelled.next()
        cancelled.cancel()
        cancelled.finish()
        cancelled.close()
        wanted = {*streams, "left-early", "unary-1", "pair-a", *(f"again-{user}" for user in range(len(PROMPTS)))}
        records = wait_for(
            lambda: (found := {r.request_id: r for r in stack.records()}).keys() >= wanted and found,
            timeout_s=30,
            what="every stream recorded",
        )
        yield Traffic(stack, since_ns, time.time_ns(), streams, "left-early", records, again, unary)
    finally:
        stack.close()


def stream_of_record(traffic: Traffic, record: recorder_pb2.CallRecord) -> RecordedStream:
    async def read() -> RecordedStream:
        client = Redis.from_url(traffic.stack.redis.url)
        try:
            return await stream_of(client, record)
        finally:
            await client.aclose()

    return asyncio.run(read())


class Run(ReplayRun):
    @property
    def results(self) -> dict[str, dict[str, Any]]:
        return {line["request_id"]: line for line in self.result_lines()}


def replay(traffic: Traffic, out: Path, *args: str) -> Run:
    window = ("--since", f"{traffic.since_ns / 1e9:.9f}", "--until", f"{traffic.until_ns / 1e9:.9f}")
    target = ("--target", traffic.stack.router.address, "--pin-version", "v2")
    return Run(*run_replay(traffic.stack.redis.url, out, *window, *target, *args, timeout_s=120), out)


@pytest.fixture(scope="module")
def against_v2(traffic: Traffic, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return replay(traffic, tmp_path_factory.mktemp("against-v2"), "--speed", "4")


@pytest.mark.slow
def test_the_router_splits_streams_stickily_and_records_the_text_each_version_generates(traffic: Traffic) -> None:
    served = {version for _, version in traffic.streams.values()}
    assert served == {"v1", "v2"}, "a 50/50 split of a dozen users sends streams to both versions"
    for request_id, (prompt, version) in traffic.streams.items():
        record = traffic.records[request_id]
        assert record.version == version
        assert record.HasField("stream")
        assert record.stream.responses_total >= TOKENS
        assert traffic.again[request_id] == version, "the same user again lands on the same version"
        text = b"".join(token_text(r) or b"" for _, _, r in stream_of_record(traffic, record).responses)
        assert text.decode() == greedy(version, prompt, TOKENS)
    assert traffic.records[traffic.cancelled_id].status_code == grpc.StatusCode.CANCELLED.value[0]


def test_replayed_against_v2_v2_streams_match_exactly_and_v1_streams_diverge_where_the_texts_differ(
    traffic: Traffic, against_v2: Run
) -> None:
    run = against_v2
    assert run.code == 0, run.stderr
    results = run.results
    for request_id, (prompt, version) in traffic.streams.items():
        line = results[request_id]
        assert line["kind"] == "stream"
        assert line["replayed"]["version"] == "v2"
        assert line["replayed"]["ttft_ms"] > 0
        assert line["recorded"]["ttft_ms"] > 0
        diff = line["stream"]
        if version == "v2":
            assert line["outcome"] == "match", (request_id, diff)
            assert (diff["first_divergence"], diff["edit_distance"]) == (None, 0.0)
            continue
        recorded_text, replayed_text = greedy("v1", prompt, TOKENS), greedy("v2", prompt, TOKENS)
        if recorded_text == replayed_text:  # the bigram's greedy text happens to be the trigram's
            assert line["outcome"] == "match"
            continue
        assert line["outcome"] == "mismatch", (request_id, diff)
        first = next(i for i, (a, b) in enumerate(zip(recorded_text, replayed_text, strict=True)) if a != b)
        assert diff["first_divergence"] == first
        assert diff["edit_distance"] > 0
        assert (diff["reference_text"], diff["candidate_text"]) == (recorded_text, replayed_text)
    streams = run.summary["streams"]
    assert streams["versions"]["v2"]["token_match_rate"] == 1.0
    assert streams["versions"]["v1"]["token_match_rate"] < 1.0
    assert streams["versions"]["v1"]["mean_edit_distance"] > 0
    assert streams["versions"]["v1"]["first_divergence_p50"] is not None
    metrics = run.summary["metrics"]
    assert 0 < metrics["token_match_rate"] < 1
    for name in ("ttft_p50_ratio", "ttft_p99_ratio", "itl_p50_ratio", "itl_p99_ratio", "tokens_per_s"):
        assert (metrics[name] or 0) > 0, name


def test_a_unary_call_in_the_same_window_is_replayed_and_compared_as_a_call(traffic: Traffic, against_v2: Run) -> None:
    prompt, version = traffic.unary
    line = against_v2.results["unary-1"]
    assert "kind" not in line
    assert "stream" not in line
    same_text = greedy(version, prompt, TOKENS) == greedy("v2", prompt, TOKENS)
    assert line["outcome"] == ("match" if same_text else "mismatch"), line
    if not same_text:
        assert line["outputs"]["text_output"]["reason"] == "values"


def test_a_stream_of_two_requests_is_replayed_with_both_and_compared_request_by_request(
    traffic: Traffic, against_v2: Run
) -> None:
    record = traffic.records["pair-a"]
    assert [m.index for m in record.stream.requests] == [0, 1]
    line = against_v2.results["pair-a"]
    assert line["outcome"] == "match", line
    assert line["stream"]["reference_tokens"] == line["stream"]["candidate_tokens"] == 2 * TOKENS


def test_a_stream_the_client_cancelled_is_replayed_as_far_as_it_went_and_compared_on_that_prefix(
    traffic: Traffic, against_v2: Run
) -> None:
    record = traffic.records[traffic.cancelled_id]
    line = against_v2.results[traffic.cancelled_id]
    assert line["recorded"]["status"] == "CANCELLED"
    assert line["outcome"] == "match", line
    assert line["stream"]["prefix_compared"] is True
    assert line["stream"]["reference_tokens"] == len(record.stream.responses)
    assert line["stream"]["candidate_tokens"] == len(record.stream.responses)


@pytest.mark.slow
def test_the_gate_bounds_token_match_rate_exit_1_when_v1_streams_diverge_0_when_the_bound_holds(
    traffic: Traffic, against_v2: Run, tmp_path: Path
) -> None:
    rate = against_v2.summary["metrics"]["token_match_rate"]
    failing = replay(traffic, tmp_path / "fail", "--speed", "max", "--gate", "token_match_rate>=0.99")
    assert failing.code == 1, failing.stderr
    assert f"token_match_rate={rate:g} (bound token_match_rate>=0.99)" in failing.stderr
    passing = replay(traffic, tmp_path / "pass", "--speed", "max", "--gate", f"token_match_rate>={rate - 0.01}")
    assert passing.code == 0, passing.stderr
    only_v2 = replay(traffic, tmp_path / "v2", "--speed", "max", "--version", "v2", "--gate", "token_match_rate>=1")
    assert only_v2.code == 0, only_v2.stderr
    bad = replay(traffic, tmp_path / "bad", "--gate", "token_match_ratio>=1")
    assert bad.code == 2
    assert bad.stderr.startswith("splitstream-replay: error: ")
    assert "token_match_ratio" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@needs_chromium
def test_the_report_renders_the_streams_section_with_its_charts_and_the_diverging_texts(
    against_v2: Run, tmp_path: Path
) -> None:
    html = (against_v2.out / "report.html").read_text()
    assert "<h2 id='streams'>Token streams</h2>" in html
    assert "Diverging streams" in html
    # The streams section sits below the others: only it is screenshot, from a page of its own.
    start = html.index("<h2 id='streams'>")
    page = tmp_path / "streams.html"
    page.write_text(html[: html.index("<body>") + len("<body>")] + html[start:])
    image = screenshot(page, tmp_path / "streams.png", height=1600)
    assert pixels_of(image, STREAM_REFERENCE_COLOR) > 300
    assert pixels_of(image, STREAM_CANDIDATE_COLOR) > 300


def test_noise_from_the_control_counts_each_stream_as_one_trial_of_the_text_field(
    traffic: Traffic, tmp_path: Path
) -> None:
    """``--noise-from v1`` over the streams v1 answered: greedy v1 regenerates its recorded text (the control
    never differs), v2 diverges on some; the text field's rates are those shares, one stream one trial."""
    run = replay(traffic, tmp_path, "--speed", "max", "--version", "v1", "--noise-from", "v1", "--noise-min-calls", "1")
    assert run.code == 0, run.stderr
    streams = [line for line in run.result_lines() if line.get("kind") == "stream"]
    compared = [line for line in streams if line["outcome"] in ("match", "mismatch")]
    assert compared
    assert {line["control"]["version"] for line in compared} == {"v1"}
    assert {line["control"]["outcome"] for line in compared} == {"match"}
    text = run.summary["noise"]["fields"]["text"]
    assert text["kind"] == "text"
    assert text["calls"] == len(compared)
    assert text["control_rate"] == 0.0
    diverged = sum(line["outcome"] == "mismatch" for line in compared)
    assert text["candidate_rate"] == pytest.approx(diverged / len(compared), abs=1e-6)
