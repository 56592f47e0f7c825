"""The noise floor of token streams from sampled generation, end to end, position by position.

The stack (redis-server, recorder, router, two generating workers) serves model ``sampled``: demo/language.py's
bigram (v1) and trigram (v2), each graph made to sample at temperature 0.1 by itself (Gumbel-max: the worker's
greedy pick of ``logits + 0.1 * Gumbel noise``, drawn by ``RandomUniformLike`` on every step, is a draw from
``softmax(logits / 0.1)``). Sampling is done by the model, not the request, so every run of a prompt writes a
new text, as a served LLM without a seed does. 60 streams of 16 tokens are recorded, all answered by v1.

Replayed with ``--noise-from v1``: v1 against itself differs from its recorded texts in about 90 % of streams
(the fixed comparison calls nearly every stream a mismatch) and shows nothing above the noise; v2 differs in
every stream, and the per-text rate (90 % against 100 %) cannot tell it from noise, but its first tokens differ
from the recorded ones far more often than the control's do, and those positions are reported above the noise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from demo import language
from tests.doc_examples import Rewrite, block, run_block
from tests.harness import ServiceProcess, Stack
from tests.recording_stack import RecordingStack
from tests.replays import ReplayRun, run_replay
from tests.streams import StreamClient, generation_request

MODEL = "sampled"
TEMPERATURE = 0.1
STREAMS = 60
TOKENS = 16
PROMPTS = ("The quick brown fox ", "Hello there, how are you? ", "Once upon a time ", "What is a list? ")
#: The A/A run judges at 99.9 % for the run, so that it is not flaky at the default's 1 %.
STRICT = ("--noise-confidence", "0.999")

pytestmark = pytest.mark.slow


def sampling_graph(path: Path, temperature: float) -> None:
    """Rewrite the n-gram graph at ``path`` so that its logits carry Gumbel noise at ``temperature``:
    ``logits - temperature * log(-log(u))``, ``u`` uniform on (0, 1) drawn per element and per run."""
    model = onnx.load(str(path))
    graph = model.graph
    for node in graph.node:
        node.output[:] = ["raw_logits" if name == "logits" else name for name in node.output]
    graph.node.extend(
        [
            helper.make_node("RandomUniformLike", ["raw_logits"], ["uniform"], low=1e-6, high=1 - 1e-6),
            helper.make_node("Log", ["uniform"], ["log_u"]),
            helper.make_node("Neg", ["log_u"], ["neg_log_u"]),
            helper.make_node("Log", ["neg_log_u"], ["log_neg_log_u"]),
            helper.make_node("Mul", ["log_neg_log_u", "temperature"], ["scaled"]),
            helper.make_node("Sub", ["raw_logits", "scaled"], ["logits"]),
        ]
    )
    graph.initializer.append(numpy_helper.from_array(np.array(temperature, dtype=np.float32), "temperature"))
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


@dataclass
class Sampled:
    stack: RecordingStack
    since: float
    until: float

    def replay(self, out: Path, *args: str) -> ReplayRun:
        code, stdout, stderr = run_replay(
            self.stack.redis.url, out, "--target", self.stack.router.address, "--speed", "max", "--no-progress",
            "--since", f"{self.since:.9f}", "--until", f"{self.until:.9f}", *args, model=MODEL, timeout_s=120,
        )  # fmt: skip
        return ReplayRun(code, stdout, stderr, out)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sampled]:
    tmp = tmp_path_factory.mktemp("sampled-streams")
    models = tmp / "models"
    for directory in language.write_versions(models, MODEL).values():
        sampling_graph(directory / "model.onnx", TEMPERATURE)

    def worker(stack: Stack, version: str) -> ServiceProcess:
        return stack.worker(models, MODEL, version)

    stack = RecordingStack(
        tmp / "stack",
        model=MODEL,
        versions={"v1": {}, "v2": {}},
        worker=worker,
        experiment={"salt": "sampled", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
    )
    try:
        client = StreamClient(stack.router.address)
        since = time.time()
        try:
            for index in range(STREAMS):
                request = generation_request(MODEL, PROMPTS[index % len(PROMPTS)], TOKENS, request_id=f"s-{index}")
                answer = list(client.stream([request], metadata=[("x-request-id", f"s-{index}")]))
                assert answer, "every stream answers"
        finally:
            client.close()
        until = time.time()
        stack.wait_recorded({f"s-{index}" for index in range(STREAMS)})
        yield Sampled(stack, since - 0.001, until + 0.001)
    finally:
        stack.close()


def test_sampled_streams_against_themselves_show_no_text_or_position_above_the_noise(
    sampled: Sampled, tmp_path: Path
) -> None:
    run = sampled.replay(
        tmp_path, "--pin-version", "v1", "--noise-from", "v1", *STRICT, "--gate", "diff_above_noise_rate<=0"
    )
    assert run.code == 0, run.stderr
    summary = run.summary
    # Sampling alone: nearly every stream differs from its recording under the exact comparison.
    assert summary["metrics"]["mismatch_rate"] > 0.5
    text = summary["noise"]["fields"]["text"]
    assert text["kind"] == "text"
    assert text["calls"] == STREAMS
    assert text["control_rate"] > 0.5
    assert text["above_noise"] is False
    positions = text["positions"]
    assert [p["position"] for p in positions] == list(range(TOKENS))
    assert all(p["calls"] == STREAMS and p["trusted"] for p in positions)
    assert all(p["above_noise"] is False for p in positions)
    assert text["positions_above"] == []
    assert any(p["control_rate"] > 0 for p in positions), "the floor is the control's own mismatch rate"
    assert summary["metrics"]["diff_above_noise_rate"] == 0.0


def test_a_changed_model_is_found_at_the_positions_where_the_per_text_rate_cannot_tell(
    sampled: Sampled, tmp_path: Path
) -> None:
    run = sampled.replay(tmp_path, "--pin-version", "v2", "--noise-from", "v1", "--gate", "diff_above_noise_rate<=0")
    assert run.code == 1, run.stderr
    assert "diff_above_noise_rate=1" in run.stderr
    text = run.summary["noise"]["fields"]["text"]
    assert text["candidate_rate"] == 1.0
    # Whole texts: both sides differ from the recording nearly always; the interval of the excess holds 0.
    assert text["excess_low"] <= 0 < text["excess_high"], text
    assert text["above_noise"] is True
    above = text["positions_above"]
    assert 0 in above, text["positions"]
    first = text["positions"][0]
    assert first["candidate_rate"] > first["control_rate"] + 0.3
    assert first["excess_low"] > 0
    assert "token positions above the noise: 0" in (tmp_path / "report.html").read_text()


def test_the_docs_worked_example(sampled: Sampled, tmp_path: Path) -> None:
    """docs/replay.md's token-stream noise example, as it stands on the page but for the router and the window."""
    window = f"--since {sampled.since:.9f} --until {sampled.until:.9f}"
    rewrite = Rewrite({"localhost:8001": sampled.stack.router.address, "--since -10m": window})
    result = run_block(
        block("replay.md", "noise-floor-streams"),
        tmp_path,
        rewrite=rewrite,
        env={"SPLITSTREAM_REPLAY_REDIS_URL": sampled.stack.redis.url},
        timeout_s=120,
    )
    print(result.stdout + result.stderr)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gate failed: diff_above_noise_rate=1" in result.stderr
    text = json.loads((tmp_path / "noise-streams" / "summary.json").read_text())["noise"]["fields"]["text"]
    print(json.dumps({k: v for k, v in text.items() if k != "positions"}))
    for position in text["positions"]:
        print(json.dumps(position))
    assert 0 in text["positions_above"]
