"""Tokens, time to first token and cost per arm in ``splitstream analyze``, end to end on real processes.

redis-server, a recorder, a router at 50/50 and two generating workers serving the demo's n-gram language
models (demo/language.py): greedy after ``The ``, v1 writes ``the the …`` and v2 ``and the …``, so with the
stop word ``the`` v1 answers in at most 3 tokens and v2 in up to 7. Simulated users with sticky keys stream
through the router; the test counts what each client saw (prompt bytes are the prompt's tokens, responses
carrying text the completion's) and its own TTFT, then runs the real CLI and checks the per-arm tokens,
TTFT p50/p99 and cost against those counts, the metrics ``tokens_out``, ``ttft_ms`` and ``cost`` compared
like any other, ``--price`` errors as one line and exit 2, and a rollout guarded by ``cost`` rolled back.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from demo import language
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from tests import launcher
from tests.harness import ROOT, ServiceProcess, Stack, router_status, wait_for, write_registry
from tests.recording_stack import MODEL, RecordingStack
from tests.stream_client import STREAM_METHOD
from tests.streams import generation_request, is_final, token_text

PRICES = {"v1": (0.15, 0.60), "v2": (3.0, 12.0)}  # per million tokens in and out: v2 twenty times v1
PRICE_FLAGS = [flag for version, (p_in, p_out) in PRICES.items()
               for flag in ("--price", f"{version}={p_in}/1M-in,{p_out}/1M-out")]  # fmt: skip
USERS = 60


def generating_worker(repository: Path) -> object:
    def start(stack: Stack, version: str) -> ServiceProcess:
        return stack.worker(repository, MODEL, version)

    return start


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingStack]:
    tmp = tmp_path_factory.mktemp("tokens")
    language.write_versions(tmp / "lm", MODEL, generation={"max_tokens_limit": 64})
    recording = RecordingStack(
        tmp / "stack",
        versions={"v1": {}, "v2": {}},
        experiment={"salt": "tokens", "control": "v1", "arms": [{"version": "v1", "weight": 50},
                                                                {"version": "v2", "weight": 50}]},
        worker=generating_worker(tmp / "lm"),  # type: ignore[arg-type]
    )  # fmt: skip
    yield recording
    recording.close()


@dataclass
class Observed:
    """What the clients saw, per version that served them."""

    streams: dict[str, int] = field(default_factory=dict)
    tokens_in: dict[str, int] = field(default_factory=dict)
    tokens_out: dict[str, int] = field(default_factory=dict)
    #: Completion tokens the final responses reported (the worker's usage outputs).
    reported_out: dict[str, int] = field(default_factory=dict)
    ttft_ms: dict[str, list[float]] = field(default_factory=dict)
    request_ids: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cost(self, version: str) -> float:
        p_in, p_out = PRICES[version]
        return (self.tokens_in[version] * p_in + self.tokens_out[version] * p_out) / 1e6


def stream_as(stack: RecordingStack, channel: grpc.Channel, user: str, number: int, observed: Observed) -> None:
    """One generation through the router as ``user``: a prompt of its own length, a few tokens at most."""
    prompt = f"{'.' * (number % 7)}{number} The "
    request_id = f"{user}-q"
    request = generation_request(MODEL, prompt, 2 + number % 5, request_id=request_id, stop_words=["the"])
    started = time.perf_counter()
    call = channel.stream_stream(STREAM_METHOD)(iter([request.SerializeToString()]),
                                                metadata=[("x-routing-key", user)], timeout=30)  # fmt: skip
    first: float | None = None
    responses = []
    for raw in call:
        if first is None:
            first = time.perf_counter()
        responses.append(oip.ModelStreamInferResponse.FromString(raw))
    assert call.code() == grpc.StatusCode.OK, call.details()
    version = dict(call.trailing_metadata() or ())["x-splitstream-version"]
    assert first is not None
    out = sum(1 for r in responses if token_text(r))
    (final,) = [r for r in responses if is_final(r)]
    reported = {o.name: i for i, o in enumerate(final.infer_response.outputs)}
    completion = int(np.frombuffer(final.infer_response.raw_output_contents[reported["completion_tokens"]], "<i4")[0])
    with observed.lock:
        observed.streams[version] = observed.streams.get(version, 0) + 1
        observed.tokens_in[version] = observed.tokens_in.get(version, 0) + len(prompt.encode())
        observed.tokens_out[version] = observed.tokens_out.get(version, 0) + out
        observed.reported_out[version] = observed.reported_out.get(version, 0) + completion
        observed.ttft_ms.setdefault(version, []).append((first - started) * 1e3)
        observed.request_ids.add(request_id)


def users(
    stack: RecordingStack, prefix: str, count: int, observed: Observed, stop: threading.Event | None = None
) -> None:
    """``count`` users (or until ``stop``), one stream each, on four threads."""
    lock = threading.Lock()
    next_user = [0]

    def worker() -> None:
        with grpc.insecure_channel(stack.router.address) as channel:
            while stop is None or not stop.is_set():
                with lock:
                    number = next_user[0]
                    if number >= count:
                        return
                    next_user[0] += 1
                stream_as(stack, channel, f"{prefix}-user-{number}", number, observed)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def admin(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return launcher.run(
        [sys.executable, "-m", "splitstream.admin", *args],
        env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
        cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


@dataclass(frozen=True)
class Run:
    observed: Observed
    result: subprocess.CompletedProcess[str]
    analysis: dict
    #: Each version's recorded TTFTs (ms), from the records read back.
    recorded_ttft_ms: dict[str, list[float]]


@pytest.fixture(scope="module")
def run(stack: RecordingStack, tmp_path_factory: pytest.TempPathFactory) -> Run:
    since = time.time()
    observed = Observed()
    users(stack, "tokens", USERS, observed)
    assert set(observed.streams) == {"v1", "v2"}
    records = stack.wait_recorded(observed.request_ids)
    recorded: dict[str, list[float]] = {}
    for record in records:
        if record.request_id in observed.request_ids:
            recorded.setdefault(record.version, []).append(record.stream.first_response_ns / 1e6)
    out = tmp_path_factory.mktemp("analysis")
    result = admin(
        "analyze", MODEL, "--redis-url", stack.redis.url, "--since", f"{since:.3f}", "--metric", "tokens_out",
        "--metric", "ttft_ms", "--metric", "cost", *PRICE_FLAGS, "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return Run(observed, result, json.loads((out / "analysis.json").read_text()), recorded)


def quantile(values: list[float], q: float) -> float:
    """The value at quantile ``q`` as the analysis's histogram takes it: the first whose rank reaches q·n."""
    return sorted(values)[max(math.ceil(q * len(values)) - 1, 0)]


@pytest.mark.slow
def test_tokens_in_and_out_ttft_and_cost_per_arm_match_what_the_clients_saw(run: Run) -> None:
    observed = run.observed
    assert observed.tokens_out == observed.reported_out  # the worker's usage says what the client counted
    (phase,) = run.analysis["phases"]
    arms = {arm["arm"]: arm for arm in phase["arms"]}
    for version in ("v1", "v2"):
        arm = arms[version]
        n = observed.streams[version]
        assert arm["calls"] == arm["generations"] == n
        assert arm["tokens_in"] == observed.tokens_in[version]
        assert arm["tokens_out"] == observed.tokens_out[version]
        assert arm["tokens_in_per_call"] == pytest.approx(observed.tokens_in[version] / n)
        assert arm["tokens_out_per_call"] == pytest.approx(observed.tokens_out[version] / n)
        assert arm["prompt_tokens_unknown"] == 0
        assert arm["price"] == f"{version}={PRICES[version][0]}/1M-in,{PRICES[version][1]}/1M-out"
        assert arm["costed_calls"] == n
        assert arm["cost"] == pytest.approx(observed.cost(version), rel=1e-9)
        assert arm["cost_per_call"] == pytest.approx(observed.cost(version) / n, rel=1e-9)
        # TTFT: the router's clock, in 2 % histogram buckets; each within what the client waited.
        recorded = run.recorded_ttft_ms[version]
        assert arm["ttft_p50_ms"] == pytest.approx(quantile(recorded, 0.5), rel=0.02)
        assert arm["ttft_p99_ms"] == pytest.approx(quantile(recorded, 0.99), rel=0.02)
        assert arm["ttft_p99_ms"] <= max(observed.ttft_ms[version]) * 1.02
        metrics = arm["metrics"]
        assert metrics["tokens_out"]["value"] == pytest.approx(observed.tokens_out[version] / n)
        assert metrics["cost"]["value"] == pytest.approx(observed.cost(version) / n, rel=1e-9)
        assert metrics["ttft_ms"]["value"] == pytest.approx(float(np.mean(recorded)), rel=1e-3)
    assert observed.tokens_out["v2"] / observed.streams["v2"] > observed.tokens_out["v1"] / observed.streams["v1"]


@pytest.mark.slow
def test_the_metrics_of_the_calls_get_verdicts_and_the_table_shows_tokens_ttft_and_cost(run: Run) -> None:
    (phase,) = run.analysis["phases"]
    verdicts = {c["metric"]: c for c in phase["comparisons"]}
    assert set(verdicts) == {"tokens_out", "ttft_ms", "cost"}
    assert (verdicts["tokens_out"]["direction"], verdicts["tokens_out"]["verdict"]) == ("higher", "better")
    assert (verdicts["cost"]["direction"], verdicts["cost"]["verdict"]) == ("lower", "worse")
    assert verdicts["ttft_ms"]["direction"] == "lower"
    assert verdicts["cost"]["p_value"] < 0.001
    out = run.result.stdout
    header = next(line for line in out.splitlines() if line.strip().startswith("ARM"))
    for column in ("TTFT P50 MS", "TTFT P99 MS", "IN/CALL", "OUT/CALL", "COST/CALL"):
        assert column in header
    v1_row = next(line for line in out.splitlines() if line.strip().startswith("v1 (control)"))
    assert v1_row.count("[") == 3  # each metric's value and interval, ttft_ms:mean:lower and cost:mean:lower too
    v1_line = next(line for line in out.splitlines() if line.strip().startswith("v1: "))
    assert f"tokens in {run.observed.tokens_in['v1']} " in v1_line
    assert f"out {run.observed.tokens_out['v1']} " in v1_line
    assert "at v1=0.15/1M-in,0.6/1M-out" in v1_line
    assert "v2 vs v1: cost" in out
    assert "v2 worse" in out


@pytest.mark.slow
def test_an_arm_without_a_price_has_no_cost_and_the_report_says_so(
    stack: RecordingStack, run: Run, tmp_path: Path
) -> None:
    result = admin("analyze", MODEL, "--redis-url", stack.redis.url, "--since", "-1h", "--metric", "tokens_out",
                   "--price", "v1=0.15/1M-in,0.60/1M-out", "--output-dir", str(tmp_path))  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads((tmp_path / "analysis.json").read_text())
    arms = {arm["arm"]: arm for phase in document["phases"] for arm in phase["arms"]}
    assert arms["v2"]["price"] is None
    assert arms["v2"]["cost"] is None
    assert arms["v1"]["cost"] is not None
    v2_line = next(line for line in result.stdout.splitlines() if line.strip().startswith("v2: "))
    assert "no --price for it: no cost" in v2_line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--price", "v1"], "bad --price 'v1': it starts without VERSION="),
        (["--price", "v1=0.15/1M-in"], "v1 has no 'out' price"),
        (["--price", "v1=0.15/1M-in,abc"], "'abc' is not AMOUNT/1M-in or AMOUNT/1M-out"),
        (["--price", "v1=0.15/1M-in,0.6/1M-out", "--price", "v1=1/1M-in,1/1M-out"], "'v1' is priced twice"),
        (["--price", "v1=-1/1M-in,0.6/1M-out"], "'-1/1M-in' is not AMOUNT/1M-in"),
        (["--price", "v1=1e999/1M-in,0.6/1M-out"], "is past any number"),
        (["--metric", "ttft_ms:proportion"], "its kind is mean (per call) or sum"),
    ],
    ids=["no-version", "no-out", "bad-part", "twice", "negative", "infinite", "ttft-proportion"],
)
def test_a_bad_price_or_metric_of_the_calls_exits_2_with_one_line_naming_it(flags: list[str], message: str) -> None:
    metric = [] if "--metric" in flags else ["--metric", "cost"]
    result = admin("analyze", MODEL, "--redis-url", "redis://127.0.0.1:1/0", "--since", "-1h", *metric, *flags,
                   timeout_s=60)  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]


def set_weights(stack: RecordingStack, salt: str, weights: dict[str, float]) -> None:
    registry = yaml.safe_load(stack.registry.read_text())["models"]
    registry[MODEL]["experiment"] = {
        "salt": salt,
        "control": "v1",
        "arms": [{"version": v, "weight": w} for v, w in weights.items()],
    }
    write_registry(stack.registry, registry)
    wait_for(
        lambda: router_status(stack.router, MODEL).models[0].experiment.salt == salt,
        timeout_s=30,
        interval_s=0.2,
        what=f"the router to follow experiment {salt}",
    )


def current_weights(stack: RecordingStack) -> dict[str, float]:
    experiment = yaml.safe_load(stack.registry.read_text())["models"][MODEL]["experiment"]
    return {arm["version"]: arm["weight"] for arm in experiment["arms"]}


@pytest.mark.slow
def test_a_rollout_guarded_by_cost_per_call_rolls_back_a_version_that_costs_more(
    stack: RecordingStack, run: Run
) -> None:
    set_weights(stack, "guard", {"v1": 100, "v2": 0})
    stop = threading.Event()
    traffic = threading.Thread(target=lambda: users(stack, "guard", 100_000, Observed(), stop))
    traffic.start()
    try:
        result = admin(
            "--registry", f"file:{stack.registry}", "rollout", MODEL, "v2", "--steps", "50,100", "--interval", "120s",
            "--metrics", f"127.0.0.1:{stack.router.metrics_port}", "--redis-url", stack.redis.url,
            "--check-every", "1s", "--max-p99-ratio", "100", "--min-calls", "5", "--guard-min-units", "10",
            "--guard", "cost:lift<=10%", *PRICE_FLAGS,
        )  # fmt: skip
    finally:
        stop.set()
        traffic.join()
    assert result.returncode == 3, result.stdout + result.stderr
    assert "ROLLED BACK" in result.stdout
    assert "v2 harms cost" in result.stdout
    assert "(guard cost:mean:lift<=10%)" in result.stdout
    assert current_weights(stack) == {"v1": 100, "v2": 0}


@pytest.mark.slow
def test_a_guard_on_cost_without_a_price_for_the_new_version_exits_2_changing_nothing(stack: RecordingStack) -> None:
    before = stack.registry.read_text()
    result = admin(
        "--registry", f"file:{stack.registry}", "rollout", MODEL, "v2", "--steps", "50", "--interval", "60s",
        "--metrics", f"127.0.0.1:{stack.router.metrics_port}", "--redis-url", stack.redis.url,
        "--guard", "cost:lift<=10%", "--price", "v1=0.15/1M-in,0.60/1M-out", timeout_s=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs --price for v2" in result.stderr
    assert stack.registry.read_text() == before
