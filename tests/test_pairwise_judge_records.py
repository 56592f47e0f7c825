"""``splitstream judge`` on what a record itself holds: a shadow's answer, a non-ASCII prompt, a body that is no
chat request.

The stack: redis-server, a recorder, a router (HTTP port, principals) and model ``writer`` with three versions:
demo/language.py's bigram v1 and trigram v2 (generating workers), and ``up``, an ``openai`` upstream
(tests/faulty_upstream.py, answering every body). The experiment sends every call to v1 and a copy of each unary
call to v2 as a shadow (sample rate 1), so each unary generation call's record holds both versions' answers.
Judged by tests/judge_server.py (a scripted judge faithful to OpenAI's chat API) preferring v2's answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from demo import language
from splitstream.common.files import atomic_write
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.records import blob_key
from splitstream.common.tensors import output_arrays
from tests import launcher
from tests.harness import ROOT, InferClient, ServiceProcess, Stack, free_port, wait_for
from tests.recording_stack import RecordingStack
from tests.streams import generation_request
from tests.test_pairwise_judge import JUDGE_KEY, KEY, Judge, accepts, start_judge

MODEL = "writer"
USERS = 12
#: A prompt of several scripts (and a character outside the Basic Multilingual Plane), as a user types it.
NON_ASCII = "Grüße aus Köln: ¿qué tal? 東京はどう? 🙂"

pytestmark = pytest.mark.slow


@dataclass
class Recorded:
    stack: RecordingStack
    since_ns: int
    until_ns: int
    http_port: int
    #: Per unary call's request id: the shadow's (v2's) recorded text.
    shadows: dict[str, str]
    preferred: Path


def _text(response: bytes) -> str:
    array = output_arrays(oip.ModelInferResponse.FromString(response))["text_output"]
    return b"".join(bytes(item) for item in array.reshape(-1)).decode()


def _chat(port: int, body: dict[str, Any], headers: dict[str, str]) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **headers},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        status: int = response.status
        return status


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    tmp = tmp_path_factory.mktemp("judge-records")
    language.write_versions(tmp / "models", MODEL)
    principals = tmp / "principals.yaml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    atomic_write(
        principals,
        yaml.safe_dump({"principals": {"app": {"api_keys_sha256": [digest], "models": ["*"], "pin": True}}}),
    )
    (tmp / "own").mkdir()
    own = Stack(tmp / "own")
    stack: RecordingStack | None = None
    try:
        upstream_port = free_port()
        upstream = ServiceProcess(
            "upstream",
            "tests.faulty_upstream",
            ["--port", str(upstream_port)],
            log_dir=own.tmp_path,
            port=upstream_port,
        )
        own.processes.append(upstream)
        upstream.start(wait_serving=False)
        workers = {version: own.worker(tmp / "models", MODEL, version) for version in ("v1", "v2")}
        entry = {
            "endpoints": {
                "v1": [workers["v1"].address],
                "v2": [workers["v2"].address],
                "up": {"openai": f"http://127.0.0.1:{upstream_port}/v1", "model": "ok"},
            },
            "experiment": {
                "salt": "judge-records",
                "control": "v1",
                "arms": [{"version": "v1", "weight": 100}],
                "shadows": [{"version": "v2", "sample_rate": 1.0}],
            },
        }
        http_port = free_port()
        stack = RecordingStack(
            tmp / "recording",
            model=MODEL,
            versions={"v1": {}, "v2": {}},
            worker=lambda _, version: workers[version],
            more_models={MODEL: entry},
            router_args=("--http-port", str(http_port), "--auth-principals", f"file:{principals}"),
        )
        wait_for(lambda: accepts(http_port), timeout_s=30, what="the HTTP port to accept")
        since_ns = time.time_ns()
        client = InferClient(stack.router.address)
        try:
            for user in range(USERS):
                request = generation_request(MODEL, f"Question {user}: ", 8 + user, request_id=f"unary-{user}")
                metadata = [("x-api-key", KEY), ("x-routing-key", f"user-{user}"), ("x-request-id", f"unary-{user}")]
                client.infer(request, metadata=metadata, timeout_s=30)
        finally:
            client.close()
        accents = {"model": MODEL, "messages": [{"role": "user", "content": NON_ASCII}], "max_tokens": 12}
        assert _chat(http_port, accents | {"user": "user-accents"}, {"x-request-id": "accents"}) == 200
        # A body our front door would refuse, passed through to the upstream as the client sent it: recorded, 200.
        bare = {"model": MODEL, "messages": ["hi"]}
        assert _chat(http_port, bare, {"x-request-id": "bare-message", "x-splitstream-version": "up"}) == 200
        until_ns = time.time_ns()
        ids = {f"unary-{user}" for user in range(USERS)} | {"accents", "bare-message"}

        def with_shadows() -> list[Any] | None:
            assert stack is not None
            records = stack.wait_recorded(ids, model=MODEL)
            unary = [r for r in records if r.request_id.startswith("unary-")]
            return records if all(r.shadows for r in unary) else None

        records = wait_for(with_shadows, timeout_s=30, what="every unary call's shadow to be recorded")
        shadows: dict[str, str] = {}
        redis = stack.redis.client()
        try:
            for record in records:
                if record.request_id.startswith("unary-"):
                    [shadow] = record.shadows
                    assert (shadow.version, shadow.status_code) == ("v2", 0)
                    payload = shadow.response
                    raw: Any = payload.inline or redis.get(blob_key(payload.blob_sha256))
                    shadows[record.request_id] = _text(bytes(raw))
        finally:
            redis.close()
        preferred = tmp / "preferred.jsonl"
        preferred.write_text("".join(json.dumps(text) + "\n" for text in shadows.values()))
        yield Recorded(stack, since_ns, until_ns, http_port, shadows, preferred)
    finally:
        if stack is not None:
            stack.close()
        own.close()


@pytest.fixture
def judges() -> Iterator[list[Judge]]:
    started: list[Judge] = []
    yield started
    for judge in started:
        judge.process.stop()


def judge_run(recorded: Recorded, judge: Judge, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "splitstream.admin", "judge", MODEL, "--redis-url", recorded.stack.redis.url,
        "--since", f"{recorded.since_ns / 1e9:.9f}", "--until", f"{recorded.until_ns / 1e9:.9f}",
        "--target", f"http://127.0.0.1:{recorded.http_port}", "--judge-url", judge.url, "--judge-model", "judge-1",
        "--output-dir", str(out), *args,
    ]  # fmt: skip
    env = {**os.environ, "SPLITSTREAM_JUDGE_API_KEY": JUDGE_KEY, "SPLITSTREAM_JUDGE_TARGET_API_KEY": KEY}
    return launcher.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)


def _pairs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]


def test_a_shadows_recorded_answer_is_judged_without_replaying(
    recorded: Recorded, judges: list[Judge], tmp_path: Path
) -> None:
    """No --grpc-target: the unary calls could not be replayed; their records hold v2's answer as a shadow."""
    judges.append(judge := start_judge(tmp_path, "--prefer", str(recorded.preferred)))
    done = judge_run(recorded, judge, tmp_path / "out", "--version", "v1", "--other-version", "v2")
    assert done.returncode == 0, done.stderr
    unary = {p["request_id"]: p for p in _pairs(tmp_path / "out") if p["request_id"].startswith("unary-")}
    assert set(unary) == set(recorded.shadows)
    for request_id, pair in unary.items():
        assert pair["other_source"] == "shadow"
        assert pair["other_answer"] == recorded.shadows[request_id]
        assert pair["winner"] == "v2"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["by_version"]["v2"]["preference_interval"][0] > 0.5


def test_a_non_ascii_prompt_reaches_the_judge_intact(recorded: Recorded, judges: list[Judge], tmp_path: Path) -> None:
    judges.append(judge := start_judge(tmp_path, "--first"))
    done = judge_run(recorded, judge, tmp_path / "out", "--version", "v1", "--other-version", "v2")
    assert done.returncode == 0, done.stderr
    [pair] = [p for p in _pairs(tmp_path / "out") if p["request_id"] == "accents"]
    assert pair["other_source"] == "replay"
    assert pair["verdict"] == "A"
    with urllib.request.urlopen(f"http://127.0.0.1:{judge.port}/prompts", timeout=5) as response:
        prompts = json.load(response)
    assert any(f"user: {NON_ASCII}" in prompt for prompt in prompts), prompts


def test_a_recorded_body_that_is_no_chat_request_is_skipped_and_counted(
    recorded: Recorded, judges: list[Judge], tmp_path: Path
) -> None:
    """``"messages": ["hi"]`` reached the upstream and was recorded with its 200: the judge counts it as an
    unreadable request and judges the rest (it crashed with a traceback before)."""
    judges.append(judge := start_judge(tmp_path, "--first"))
    done = judge_run(recorded, judge, tmp_path / "out", "--version", "up", "--other-version", "v1")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["counts"]["unreadable_request"] == 1
    assert "bare-message" not in {p["request_id"] for p in _pairs(tmp_path / "out")}
    # v1's chat was judged against the upstream's answer to it.
    assert "accents" in {p["request_id"] for p in _pairs(tmp_path / "out")}
