"""The noise floor (``--noise-from`` / ``--noise-target``): differences beyond what the control shows against itself.

End to end: a stack (redis-server, recorder, router, two workers) serving model ``affine`` built here, whose graph
adds its own noise (``RandomNormalLike``, sigma 0.01) to both outputs on every run:
- v1 (the control): ``y = 2x + noise``, ``z = x + noise``;
- v2 (the candidate): the same, and ``z`` shifted by a constant 0.02: smaller than the largest difference the
  control shows against itself, but outside its distribution.
Every element differs from its recorded value on every call, so under the fixed ``--rtol/--atol`` every call is
a mismatch; with the floor, v1 against itself shows nothing above the noise and v2 shows ``z`` (not ``y``).

The decision itself is checked against statsmodels' Newcombe interval, and its false-positive rate by A/A
simulation.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from statsmodels.stats.proportion import confint_proportions_2indep

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.replayer.compare import Answer
from splitstream.replayer.main import parse_args
from splitstream.replayer.noise import DiffHistogram, NoiseSettings, NoiseTotals, newcombe_interval
from tests import launcher
from tests.doc_examples import Rewrite, block, run_block
from tests.harness import ROOT, InferClient, ServiceProcess, Stack, make_request, wait_for
from tests.models import save_graph
from tests.recording_stack import MODEL, RecordingStack
from tests.replays import ReplayRun, replay_command, run_replay

SIGMA = 0.01
OFFSET = 0.02
FEATURES = 64
CALLS = 200
#: The end-to-end runs that expect a field within the noise judge at 99.9 % for the run (0.1 % of A/A runs flag a
#: field), so that they are not flaky at the default's 1 %; the planted shift is found at either.
STRICT = ("--noise-confidence", "0.999")


def noisy_model(path: Path, *, offset: float, outputs: tuple[str, ...] = ("y", "z")) -> Path:
    """``y = 2x + N(0, SIGMA)``, ``z = x + N(0, SIGMA) + offset``, a fresh draw per element and per run (only
    the ``outputs`` named)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", FEATURES])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", FEATURES])
    nodes = [
        helper.make_node("RandomNormalLike", ["x"], ["noise_y"], scale=SIGMA),
        helper.make_node("RandomNormalLike", ["x"], ["noise_z"], scale=SIGMA),
        helper.make_node("Mul", ["x", "two"], ["doubled"]),
        helper.make_node("Add", ["doubled", "noise_y"], ["y"]),
        helper.make_node("Add", ["x", "noise_z"], ["noisy_z"]),
        helper.make_node("Add", ["noisy_z", "offset"], ["z"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
        numpy_helper.from_array(np.array(offset, dtype=np.float32), "offset"),
    ]
    declared = [info for info in (y, z) if info.name in outputs]
    return save_graph(helper.make_graph(nodes, "noisy", [x], declared, initializer=inits), path)


@dataclass
class Noisy:
    stack: RecordingStack
    repository: Path
    since: float
    until: float

    def window(self) -> list[str]:
        return ["--since", f"{self.since:.9f}", "--until", f"{self.until:.9f}"]

    def replay(self, out: Path, *args: str) -> ReplayRun:
        code, stdout, stderr = run_replay(
            self.stack.redis.url, out, "--target", self.stack.router.address, "--speed", "max", "--no-progress",
            *self.window(), *args, timeout_s=120,
        )  # fmt: skip
        return ReplayRun(code, stdout, stderr, out)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Noisy]:
    tmp = tmp_path_factory.mktemp("noise-stack")
    repository = tmp / "noisy-models"
    for version, offset in (("v1", 0.0), ("v2", OFFSET)):
        directory = repository / MODEL / version
        noisy_model(directory / "model.onnx", offset=offset)
        settings = {"backend": "onnxruntime", "max_batch_size": 8, "dynamic_batching": {"max_queue_delay_us": 500}}
        (directory / "config.yaml").write_text(yaml.safe_dump(settings))

    def worker(stack: Stack, version: str) -> ServiceProcess:
        return stack.worker(repository, MODEL, version)

    stack = RecordingStack(
        tmp / "stack",
        versions={"v1": {}, "v2": {}},
        worker=worker,
        experiment={"salt": "noise", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
    )
    try:
        client = InferClient(stack.router.address)
        rng = np.random.default_rng(5)
        since = time.time()
        for i in range(CALLS):
            x = rng.uniform(-1, 1, (1, FEATURES)).astype(np.float32)
            client.infer(make_request(MODEL, x), metadata=[("x-request-id", f"noise-{i}")])
        until = time.time()
        stack.wait_recorded({f"noise-{i}" for i in range(CALLS)})
        yield Noisy(stack, repository, since - 0.001, until + 0.001)
    finally:
        stack.close()


@pytest.mark.slow
def test_control_against_itself_shows_nothing_above_the_floor(noisy: Noisy, tmp_path: Path) -> None:
    run = noisy.replay(
        tmp_path, "--pin-version", "v1", "--noise-from", "v1", *STRICT, "--gate", "diff_above_noise_rate<=0"
    )
    assert run.code == 0, run.stderr
    summary = run.summary
    # Under the fixed tolerance the model's own noise floods the report: every call mismatches.
    assert summary["metrics"]["mismatch_rate"] == 1.0
    noise = summary["noise"]
    assert set(noise["fields"]) == {"y", "z"}
    for field in noise["fields"].values():
        assert field["trusted"]
        assert field["above_noise"] is False
        assert field["calls"] == CALLS
        assert field["control"]["elements"] == field["candidate"]["elements"] == CALLS * FEATURES
    assert summary["metrics"]["diff_above_noise_rate"] == 0.0
    line = run.result_lines()[0]
    assert line["control"]["version"] == "v1"
    assert line["control"]["outcome"] == "mismatch"
    assert "Noise floor" in (tmp_path / "report.html").read_text()


@pytest.mark.slow
def test_a_shift_smaller_than_the_noise_is_found_on_its_output_only(noisy: Noisy, tmp_path: Path) -> None:
    run = noisy.replay(
        tmp_path, "--pin-version", "v2", "--noise-from", "v1", *STRICT, "--gate", "diff_above_noise_rate<=0"
    )
    assert run.code == 1, run.stderr
    assert "diff_above_noise_rate=0.5" in run.stderr
    fields = run.summary["noise"]["fields"]
    assert fields["y"]["above_noise"] is False
    z = fields["z"]
    assert z["above_noise"] is True
    assert z["excess_low"] > 0
    # The planted change is smaller than the largest difference of the control against itself.
    assert z["control"]["max"] > OFFSET
    assert z["candidate_rate"] > 10 * z["control_rate"]
    report = (tmp_path / "report.html").read_text()
    assert "<code>z</code>" in report
    assert "above the noise" in report
    assert "within the noise" in report


@pytest.mark.slow
def test_a_confidence_next_to_one_still_finds_the_shift(noisy: Noisy, tmp_path: Path) -> None:
    """``--noise-confidence`` one ulp below 1: each field's tail (1.1e-16 / 2) is below what ``1 - tail`` keeps,
    and an interval built from ``ppf(1 - tail)`` was infinitely wide, so nothing was ever above the noise."""
    run = noisy.replay(
        tmp_path, "--pin-version", "v2", "--noise-from", "v1", "--noise-quantile", "0.99",
        "--noise-confidence", "0.9999999999999999", "--gate", "diff_above_noise_rate<=0",
    )  # fmt: skip
    assert run.code == 1, run.stderr
    fields = run.summary["noise"]["fields"]
    assert fields["z"]["above_noise"] is True
    assert fields["y"]["above_noise"] is False
    assert all(math.isfinite(f["excess_low"]) and math.isfinite(f["excess_high"]) for f in fields.values())


@pytest.mark.slow
def test_noise_target_and_a_floor_not_trusted_yet(noisy: Noisy, tmp_path: Path) -> None:
    """``--noise-target ADDR``: the second pass goes to another address (v1's worker, then the router). 60 calls of
    64 elements are fewer than the 10,000 a 0.999 floor needs: no verdict, and a gate on it fails as not
    measured; at the 0.99 quantile (1,000 needed) the shift is found."""
    v1 = noisy.stack.workers["v1"].address
    gate = ("--gate", "diff_above_noise_rate<=0")
    early = noisy.replay(tmp_path / "early", "--pin-version", "v2", "--noise-target", v1, "--limit", "60", *gate)
    assert early.code == 1, early.stderr
    assert "diff_above_noise_rate=not measured" in early.stderr
    noise = early.summary["noise"]
    assert noise["control"] == v1
    assert noise["fields"]["z"]["trusted"] is False
    assert noise["fields"]["z"]["above_noise"] is None
    assert early.result_lines()[0]["control"]["target"] == v1

    # A router as --noise-target: the control's pass goes out without the candidate's pin, so the router's
    # own split (all v1) serves it.
    router = noisy.stack.router.address
    args = ("--pin-version", "v2", "--noise-target", router, "--limit", "60", "--noise-quantile", "0.99", *STRICT)
    run = noisy.replay(tmp_path / "late", *args)
    assert run.code == 0, run.stderr
    assert {line["control"]["version"] for line in run.result_lines()} == {"v1"}
    assert {line["replayed"]["version"] for line in run.result_lines()} == {"v2"}
    fields = run.summary["noise"]["fields"]
    assert fields["z"]["above_noise"] is True
    assert fields["y"]["above_noise"] is False


@pytest.mark.slow
def test_a_noise_target_killed_mid_run_leaves_the_floor_to_the_calls_before(noisy: Noisy, tmp_path: Path) -> None:
    """The control's instance dies (SIGKILL) partway: the replay does not hang or fail; the calls after answer
    UNAVAILABLE on the control's side and carry no evidence, so the floor counts only the calls before."""
    control = noisy.stack.stack.worker(noisy.repository, MODEL, "v1", name="noise-control")
    command = replay_command(
        noisy.stack.redis.url, tmp_path, "--target", noisy.stack.router.address, "--pin-version", "v2",
        "--noise-target", control.address, "--noise-min-calls", "5", "--speed", "0.1", "--no-progress",
        *noisy.window(),
    )  # fmt: skip
    process = launcher.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = tmp_path / "results.jsonl"
    try:
        wait_for(lambda: results.exists() and results.read_text().count("\n") >= 10, timeout_s=60, what="ten calls")
        control.kill()
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(lines) == CALLS
    assert all(line["replayed"]["status"] == "OK" for line in lines)
    answered = sum(line["control"]["status"] == "OK" for line in lines)
    assert {line["control"]["status"] for line in lines} == {"OK", "UNAVAILABLE"}
    assert 10 <= answered < CALLS
    fields = json.loads((tmp_path / "summary.json").read_text())["noise"]["fields"]
    assert fields["z"]["calls"] == fields["y"]["calls"] == answered
    assert fields["y"]["control"]["elements"] == answered * FEATURES


@pytest.mark.slow
def test_a_control_missing_an_output_writes_its_floor_as_inf_not_null(noisy: Noisy, tmp_path: Path) -> None:
    """A control answering without ``z`` (a presence change: every element infinitely far) has an infinite floor
    for ``z``: summary.json says ``"inf"``, where JSON's ``null`` would read as "not measured"."""
    repository = tmp_path / "models"
    noisy_model(repository / MODEL / "v1" / "model.onnx", offset=0.0, outputs=("y",))
    (repository / MODEL / "v1" / "config.yaml").write_text(yaml.safe_dump({"backend": "onnxruntime"}))
    control = noisy.stack.stack.worker(repository, MODEL, "v1", name="control-without-z")
    try:
        run = noisy.replay(tmp_path / "out", "--pin-version", "v1", "--noise-target", control.address, "--limit", "40")
    finally:
        control.stop()
    assert run.code == 0, run.stderr
    z = run.summary["noise"]["fields"]["z"]
    assert z["floor"] == "inf"
    assert z["control"]["max"] == "inf"
    assert run.summary["noise"]["fields"]["y"]["floor"] < 1


def test_without_noise_flags_nothing_changes(noisy: Noisy, tmp_path: Path) -> None:
    run = noisy.replay(tmp_path, "--pin-version", "v1", "--limit", "5")
    assert run.code == 0, run.stderr
    assert "noise" not in run.summary
    assert run.summary["metrics"]["diff_above_noise_rate"] is None
    assert all("control" not in line for line in run.result_lines())


@pytest.mark.slow
def test_the_docs_worked_example(noisy: Noisy, tmp_path: Path) -> None:
    """docs/replay.md's noise-floor example, as it stands on the page but for the router and the window."""
    window = f"--since {noisy.since:.9f} --until {noisy.until:.9f}"
    rewrite = Rewrite({"localhost:8001": noisy.stack.router.address, "--since -10m": window})
    result = run_block(
        block("replay.md", "noise-floor"),
        tmp_path,
        rewrite=rewrite,
        env={"SPLITSTREAM_REPLAY_REDIS_URL": noisy.stack.redis.url},
        timeout_s=120,
    )
    print(result.stdout + result.stderr)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gate failed: diff_above_noise_rate=0.5" in result.stderr
    summary = json.loads((tmp_path / "noise-v2" / "summary.json").read_text())
    print(json.dumps(summary["noise"], indent=2))
    assert summary["noise"]["fields"]["z"]["above_noise"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--noise-from", "v1", "--noise-quantile", "1.5"], "--noise-quantile 1.5 must be at least 0.5 and below 1"),
        (["--noise-from", "v1", "--noise-min-calls", "0"], "--noise-min-calls 0 must be at least 1"),
        (["--noise-from", "v1", "--noise-confidence", "1"], "--noise-confidence 1 must be at least 0.5 and below 1"),
        (["--noise-from", "v1", "--noise-target", "localhost:1"], "--noise-target: not allowed with argument"),
        (["--noise-target", "http://localhost:1"], "--noise-target 'http://localhost:1' must both be gRPC"),
        (["--noise-from", "v 1\n"], "--noise-from 'v 1\\n' is not a version name"),
    ],
)
def test_bad_noise_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--model", MODEL, "--since", "-1h", "--target", "localhost:2", *args])
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert message in errors[0]


# -- the statistics ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k1", "n1", "k2", "n2"), [(13, 12800, 384, 12800), (5, 40, 2, 50), (0, 30, 3, 30), (9, 9, 1, 9)]
)
def test_newcombe_interval_matches_statsmodels(k1: int, n1: int, k2: int, n2: int) -> None:
    for confidence in (0.95, 0.995):
        expected = confint_proportions_2indep(k1, n1, k2, n2, method="newcomb", compare="diff", alpha=1 - confidence)
        assert newcombe_interval(k1, n1, k2, n2, confidence) == pytest.approx(expected, abs=1e-9)


def test_floor_bin_counts_are_exact() -> None:
    histogram = DiffHistogram()
    values = np.array([0.0, 0.0, 1e-3, 2e-3, 5e-3, 0.1, np.inf, np.nan])
    histogram.add(values)
    assert histogram.total == 8
    floor = histogram.floor_bin(0.5)  # the 4th of 8 sorted values: 2e-3
    assert histogram.quantile(0.5) == pytest.approx(2e-3, rel=0.024)
    assert histogram.beyond(floor) == int(np.sum(np.nan_to_num(values, nan=np.inf) > histogram.quantile(0.5)))


#: A/A simulations: runs, calls per run, elements per call (numbers quoted in docs/replay.md).
SIMULATIONS = 2000


@pytest.mark.slow
def test_a_a_false_positive_rate_is_within_the_stated_one_percent() -> None:
    """A control against itself (two fields, independent Gaussian noise, 100 calls of 20 elements, floor at the
    0.995 quantile; texts: 100 calls differing at 30 %): the share of runs showing any field above the noise stays
    at or below 1 %."""
    rng = np.random.default_rng(20261206)
    flagged = 0
    settings = NoiseSettings(control="sim", quantile=0.995)
    for _ in range(SIMULATIONS):
        totals = NoiseTotals(settings)
        for name in ("a", "b"):
            control = np.abs(rng.normal(0, 1, 2_000))
            candidate = np.abs(rng.normal(0, 1, 2_000))
            totals.add_differences(name, control, candidate, control.size)  # 100 calls' elements at once
            totals.tensors[name].calls = 100
        for control_differs, candidate_differs in zip(rng.random(100) < 0.3, rng.random(100) < 0.3, strict=True):
            totals.add_text("text", bool(control_differs), bool(candidate_differs))
        summary = totals.summary()
        flagged += any(f.above_noise for f in summary.fields.values())
    rate = flagged / SIMULATIONS
    print(f"A/A: {flagged} of {SIMULATIONS} runs flagged a field ({rate:.2%})")
    assert rate <= 0.01 + 3 * np.sqrt(0.01 * 0.99 / SIMULATIONS)


def test_summary_reads_back(tmp_path: Path) -> None:
    totals = NoiseTotals(NoiseSettings(control="v1 at --target", min_calls=1))
    totals.add_differences("y", np.zeros(20_000), np.full(20_000, 0.5), 20_000)
    summary = totals.summary()
    assert summary.fields["y"].above_noise is True
    assert json.loads(summary.model_dump_json())["diff_above_noise_rate"] == 1.0


def test_answers_the_same_bytes_as_the_reference_count_as_zero_differences() -> None:
    """A deterministic control (the same bytes as the reference, not decoded again) and a candidate that differs
    in every element: zero differences on one side, every element beyond the floor of 0 on the other."""

    def response(values: np.ndarray) -> bytes:
        message = oip.ModelInferResponse(model_name=MODEL)
        message.outputs.add(name="y", datatype="FP32", shape=list(values.shape))
        message.raw_output_contents.append(values.astype(np.float32).tobytes())
        return message.SerializeToString()

    values = np.arange(64, dtype=np.float32).reshape(1, 64)
    reference = response(values)
    totals = NoiseTotals(NoiseSettings(control="v1", quantile=0.5, min_calls=1))
    totals.add_answers(Answer(0, reference), Answer(0, bytes(reference)), Answer(0, response(values + 0.5)))
    y = totals.summary().fields["y"]
    assert y.floor == 0.0
    assert y.control is not None
    assert y.candidate is not None
    assert (y.control.elements, y.control.max, y.candidate.elements) == (64, 0.0, 64)
    assert (y.control_rate, y.candidate_rate, y.above_noise) == (0.0, 1.0, True)
