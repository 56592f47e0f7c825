"""TTFT and tokens per arm for a model that reports no usage: stand-ins for Triton's decoupled models.

What TensorRT-LLM's ensemble answers has no ``prompt_tokens``/``completion_tokens`` outputs, so the analysis
counts the responses carrying text as the completion tokens and leaves the prompt tokens unknown (and the
calls uncosted), saying so, never guessing them from the prompt's bytes. v2's stand-in waits 40 ms before
each token against v1's 2 ms: ``ttft_ms`` gets a "worse" verdict, and a rollout guarded by it rolls back.
Real processes: redis-server, a recorder, a router at 50/50 and two stand-ins (tests/triton_decoupled.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.harness import ServiceProcess, Stack
from tests.recording_stack import MODEL, RecordingStack
from tests.stream_client import run_stream
from tests.test_analysis_tokens import admin, current_weights, set_weights
from tests.triton_decoupled import start_standin, stream_request

DELAY_MS = {"v1": "2", "v2": "40"}
PRICE_FLAGS = ["--price", "v1=0.15/1M-in,0.60/1M-out", "--price", "v2=0.15/1M-in,0.60/1M-out"]


def standin(stack: Stack, version: str) -> ServiceProcess:
    return start_standin(stack, MODEL, version, "--delay-ms", DELAY_MS[version])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingStack]:
    recording = RecordingStack(
        tmp_path_factory.mktemp("ttft"),
        versions={"v1": {}, "v2": {}},
        experiment={"salt": "ttft", "control": "v1", "arms": [{"version": "v1", "weight": 50},
                                                              {"version": "v2", "weight": 50}]},
        worker=standin,
    )  # fmt: skip
    yield recording
    recording.close()


def streams(
    stack: RecordingStack, prefix: str, count: int, served: dict[str, int], stop: threading.Event | None = None
) -> None:
    """``count`` users (or until ``stop``), one stream of ``2 + n % 3`` tokens each, on four threads;
    ``served`` counts the tokens each version sent."""
    lock = threading.Lock()
    next_user = [0]

    def worker() -> None:
        while stop is None or not stop.is_set():
            with lock:
                number = next_user[0]
                if number >= count:
                    return
                next_user[0] += 1
            tokens = 2 + number % 3
            request = stream_request(f"{prefix}-{number}", tokens, model=MODEL, text=b"a prompt of 24 bytes....")
            result = run_stream(
                stack.router.address, [request], metadata=[("x-routing-key", f"{prefix}-user-{number}")]
            )
            assert result.code == grpc.StatusCode.OK, result.details
            assert len(result.responses) == tokens
            with lock:
                served[result.version] = served.get(result.version, 0) + tokens

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.mark.slow
def test_without_usage_outputs_the_text_responses_are_the_tokens_out_and_the_prompt_is_unknown(
    stack: RecordingStack, tmp_path: Path
) -> None:
    since = time.time()
    served: dict[str, int] = {}
    streams(stack, "plain", 40, served)
    assert set(served) == {"v1", "v2"}
    stack.wait_recorded({f"plain-{n}" for n in range(40)})
    result = admin("analyze", MODEL, "--redis-url", stack.redis.url, "--since", f"{since:.3f}", "--metric", "ttft_ms",
                   "--metric", "tokens_out", *PRICE_FLAGS, "--output-dir", str(tmp_path))  # fmt: skip
    assert result.returncode == 0, result.stderr
    (phase,) = json.loads((tmp_path / "analysis.json").read_text())["phases"]
    arms = {arm["arm"]: arm for arm in phase["arms"]}
    for version in ("v1", "v2"):
        arm = arms[version]
        assert arm["tokens_out"] == served[version]
        assert arm["generations"] == arm["prompt_tokens_unknown"] == arm["calls"]
        assert (arm["tokens_in"], arm["tokens_in_per_call"]) == (0, None)
        assert (arm["costed_calls"], arm["cost"], arm["cost_per_call"]) == (0, None, None)
        line = next(line for line in result.stdout.splitlines() if line.strip().startswith(f"{version}: "))
        assert f"prompt tokens unknown for {arm['calls']} (not counted in, nor costed)" in line
    # The first token waits for the stand-in's delay: about 2 ms on v1, 40 on v2.
    assert arms["v2"]["ttft_p50_ms"] >= 40 > arms["v1"]["ttft_p50_ms"]
    ttft = next(c for c in phase["comparisons"] if c["metric"] == "ttft_ms")
    assert (ttft["direction"], ttft["verdict"]) == ("lower", "worse")
    assert "v2 vs v1: ttft_ms" in result.stdout


@pytest.mark.slow
def test_a_rollout_guarded_by_ttft_rolls_back_a_version_whose_first_token_comes_later(stack: RecordingStack) -> None:
    set_weights(stack, "ttft-guard", {"v1": 100, "v2": 0})
    stop = threading.Event()
    traffic = threading.Thread(target=lambda: streams(stack, "guard", 100_000, {}, stop))
    traffic.start()
    try:
        result = admin(
            "--registry", f"file:{stack.registry}", "rollout", MODEL, "v2", "--steps", "50,100", "--interval", "120s",
            "--metrics", f"127.0.0.1:{stack.router.metrics_port}", "--redis-url", stack.redis.url,
            "--check-every", "1s", "--max-p99-ratio", "100", "--max-ttft-p99-ratio", "100", "--min-calls", "5",
            "--guard-min-units", "10", "--guard", "ttft_ms:lift<=10%",
        )  # fmt: skip
    finally:
        stop.set()
        traffic.join()
    assert result.returncode == 3, result.stdout + result.stderr
    assert "v2 harms ttft_ms" in result.stdout
    assert "(guard ttft_ms:mean:lift<=10%)" in result.stdout
    assert current_weights(stack) == {"v1": 100, "v2": 0}
