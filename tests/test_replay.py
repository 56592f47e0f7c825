"""``splitstream-replay`` end to end: traffic recorded through a real stack, replayed by the real CLI.

One stack per module (redis-server, recorder, router, workers v1 and v2 of model ``affine``):
- v1: ``y = 2x``; v2: ``y = 2x + 0.5`` and at most 2 rows per request (more: INVALID_ARGUMENT),
  with a 20 ms batching delay. So against v2, with ``--rtol 0.01 --atol 0``, exactly the calls
  with small inputs (|x| ~ 1) mismatch on ``y`` (an error of 0.5 on values near 2), calls with
  large inputs (|x| ~ 100) match, 4-row calls change from OK to INVALID_ARGUMENT, and ``label``
  (argmax, unchanged by a positive scale and a bias) always matches.

Recorded phases, each its own receive-time window:
- A: 10 calls, 5 of them pinned to v2;
- B: 30 calls of six kinds (see :func:`kind_of`), routing keys ``user-0..2``; plus, written
  straight to the stream afterwards the way a spooled record arrives, a late record received
  inside B and a duplicate of a B call;
- C: a burst pattern (groups of calls separated by 40-250 ms gaps) for the timing test;
- D: written directly: two good records and four bad entries (garbage, no record, no time,
  a newer schema).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import entry_fields, stream_key
from splitstream.replayer.main import main as replay_main
from splitstream.replayer.report import CANDIDATE_COLOR, REFERENCE_COLOR
from splitstream.replayer.selection import Selection
from splitstream.replayer.summary import Summary
from tests import launcher
from tests.browser import needs_chromium, pixels_of, screenshot
from tests.harness import ROOT, InferClient, free_port, make_request, wait_for
from tests.recording_stack import HMAC_KEY, MODEL, RecordingStack
from tests.replays import ReplayRun, run_replay
from tests.replays import replay_command as replayer_command

V2_CONFIG = {"max_batch_size": 2, "dynamic_batching": {"max_queue_delay_us": 20_000}}
#: Gaps before each call of the burst pattern (phase C), seconds.
BURST_GAPS_S = [0, 0, 0, 0, 0.04, 0, 0, 0.12, 0, 0, 0, 0.25, 0, 0, 0.06, 0, 0, 0, 0.09, 0]


def kind_of(i: int) -> str:
    """What call ``b-<i>`` of phase B is."""
    return ("bad-input", "small", "small", "large", "large-4-rows", "large-2-rows")[i % 6]


@dataclass
class Traffic:
    stack: RecordingStack
    windows: dict[str, tuple[int, int]]
    ids: dict[str, list[str]]
    late_id: str
    records: dict[str, recorder_pb2.CallRecord]

    def window_args(self, name: str) -> list[str]:
        since, until = self.windows[name]
        return ["--since", f"{since / 1e9:.9f}", "--until", f"{until / 1e9:.9f}"]


class Run(ReplayRun):
    @property
    def results(self) -> list[dict[str, Any]]:
        return self.result_lines()

    def ids(self, outcome: str | None = None) -> set[str]:
        return {r["request_id"] for r in self.results if outcome is None or r["outcome"] == outcome}


def replay_command(traffic: Traffic, out: Path, *args: str) -> list[str]:
    return replayer_command(traffic.stack.redis.url, out, *args)


def replay(traffic: Traffic, out: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 60) -> Run:
    return Run(*run_replay(traffic.stack.redis.url, out, *args, env=env, timeout_s=timeout_s), out)


def xadd_record(stack: RecordingStack, record: recorder_pb2.CallRecord) -> None:
    """Write ``record`` as the recorder lays it out (this is what a spooled record looks like when it lands)."""
    client = stack.redis.client()
    try:
        client.xadd(stream_key(MODEL), entry_fields(record))  # type: ignore[arg-type]
    finally:
        client.close()


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    stack = RecordingStack(
        tmp_path_factory.mktemp("replay-stack"),
        versions={"v1": {"scale": 2.0}, "v2": {"scale": 2.0, "bias": 0.5, "config": V2_CONFIG}},
        experiment={"salt": "replay", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
    )
    try:
        yield record_traffic(stack)
    finally:
        stack.close()


def record_traffic(stack: RecordingStack) -> Traffic:
    client = InferClient(stack.router.address)
    rng = np.random.default_rng(11)
    ids: dict[str, list[str]] = {"A": [], "A-v2": [], "B": [], "C": []}
    windows: dict[str, tuple[int, int]] = {}

    def call(request_id: str, x: np.ndarray, *, version: str = "", key: str = "") -> None:
        metadata = [("x-request-id", request_id), ("x-tenant", "acme")]
        if version:
            metadata.append(("x-splitstream-version", version))
        if key:
            metadata.append(("x-routing-key", key))
        try:
            client.infer(make_request(MODEL, x), metadata=metadata)
        except grpc.RpcError as error:  # recorded failures are part of the traffic
            if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise

    start = time.time_ns()
    for i in range(10):
        pinned = i % 2 == 1
        request_id = f"a-{i}"
        call(request_id, rng.uniform(0.5, 1.5, (1, 4)).astype(np.float32), version="v2" if pinned else "")
        ids["A-v2" if pinned else "A"].append(request_id)
    time.sleep(0.05)
    windows["A"] = (start, time.time_ns())
    start = windows["A"][1]
    for i in range(30):
        kind = kind_of(i)
        rows = {"large-4-rows": 4, "large-2-rows": 2}.get(kind, 1)
        features = 5 if kind == "bad-input" else 4
        scale = 1.0 if kind in ("small", "bad-input") else 100.0
        x = (rng.uniform(0.5, 1.5, (rows, features)) * scale).astype(np.float32)
        call(f"b-{i}", x, key=f"user-{i % 3}")
        ids["B"].append(f"b-{i}")
    time.sleep(0.05)
    windows["B"] = (start, time.time_ns())
    time.sleep(0.05)
    start = time.time_ns()
    for i, gap in enumerate(BURST_GAPS_S):
        time.sleep(gap)
        call(f"c-{i}", np.ones((1, 4), np.float32))
        ids["C"].append(f"c-{i}")
    time.sleep(0.05)
    windows["C"] = (start, time.time_ns())
    client.close()

    records = {r.request_id: r for r in stack.wait_recorded({i for group in ids.values() for i in group})}

    # Late: received inside B (between b-1 and b-2), written now, long after B ended.
    late = recorder_pb2.CallRecord()
    late.CopyFrom(records["b-1"])
    late.request_id = "late-1"
    late.receive_unix_ns = records["b-1"].receive_unix_ns + 1000
    xadd_record(stack, late)
    # A duplicate of b-3, as a resent batch would write it.
    xadd_record(stack, records["b-3"])

    # D: two good records and four entries that are not readable records.
    start = time.time_ns()
    for n in range(2):
        good = recorder_pb2.CallRecord()
        good.CopyFrom(records["b-3"])
        good.request_id = f"d-{n}"
        good.receive_unix_ns = start + 1_000_000 * (n + 1)
        xadd_record(stack, good)
    newer = recorder_pb2.CallRecord()
    newer.CopyFrom(records["b-3"])
    newer.request_id, newer.schema_version, newer.receive_unix_ns = "d-newer", 99, start + 3_000_000
    xadd_record(stack, newer)
    redis = stack.redis.client()
    t = str(start + 4_000_000)
    redis.xadd(stream_key(MODEL), {"request_id": "d-garbage", "time_ns": t, "record": b"\xff\x00garbage"})
    redis.xadd(stream_key(MODEL), {"request_id": "d-no-record", "time_ns": t, "status": "OK"})
    redis.xadd(stream_key(MODEL), {"request_id": "d-no-time", "record": records["b-3"].SerializeToString()})
    redis.close()
    windows["D"] = (start, start + 10_000_000)
    return Traffic(stack, windows, ids, "late-1", records)


# -- what comes back matches what went in ---------------------------------------------------


@pytest.mark.slow
def test_traffic_replayed_against_v1_matches_every_recorded_answer(traffic: Traffic, tmp_path: Path) -> None:
    run = replay(
        traffic,
        tmp_path,
        "--target",
        traffic.stack.router.address,
        "--pin-version",
        "v1",
        "--speed",
        "max",
        *traffic.window_args("B"),
        "--gate",
        "mismatch_rate<=0,status_change_rate<=0",
    )
    assert run.code == 0, run.stderr
    summary = run.summary
    assert run.ids() == {*traffic.ids["B"], traffic.late_id}  # the late record too, the duplicate once
    assert summary["selection"]["duplicates"] == 1
    assert summary["outcomes"] == {"match": 31, "mismatch": 0, "status_change": 0}
    assert summary["gate"]["passed"]
    by_id = {r["request_id"]: r for r in run.results}
    assert by_id["b-0"]["replayed"]["status"] == "INVALID_ARGUMENT"  # failed then, fails the same way now
    assert by_id["b-1"]["replay_request_id"] == "b-1:replay"
    assert {r["replayed"]["version"] for r in run.results if r["replayed"]["status"] == "OK"} == {"v1"}
    # Sent in receive-time order: the late record goes out between b-1 and b-2.
    in_send_order = sorted(run.results, key=lambda r: r["sequence"])
    assert [r["request_id"] for r in in_send_order][:4] == ["b-0", "b-1", "late-1", "b-2"]
    assert [r["receive_unix_ns"] for r in in_send_order] == sorted(r["receive_unix_ns"] for r in run.results)


@pytest.mark.slow
def test_traffic_replayed_against_v2_finds_exactly_the_expected_mismatches_by_request_id(
    traffic: Traffic, tmp_path: Path
) -> None:
    run = replay(
        traffic,
        tmp_path,
        "--target",
        traffic.stack.router.address,
        "--pin-version",
        "v2",
        "--speed",
        "max",
        "--rtol",
        "0.01",
        "--atol",
        "0",
        *traffic.window_args("B"),
        "--gate",
        "mismatch_rate<=0.01,error_rate<=0.5",
    )
    small = {i for n, i in enumerate(traffic.ids["B"]) if kind_of(n) == "small"}
    four_rows = {i for n, i in enumerate(traffic.ids["B"]) if kind_of(n) == "large-4-rows"}
    assert run.code == 1, run.stderr
    assert "gate failed: mismatch_rate=" in run.stderr
    assert "error_rate" not in run.stderr.split("gate failed:")[1]  # that bound held
    assert run.ids("mismatch") == small | {traffic.late_id}  # late-1 is a copy of the small b-1
    assert run.ids("status_change") == four_rows
    summary = run.summary
    assert summary["status_changes"]["transitions"] == {"OK->INVALID_ARGUMENT": len(four_rows)}
    assert summary["status_changes"]["ok_to_error"] == len(four_rows)
    assert summary["outputs"]["label"]["mismatched_calls"] == 0
    assert summary["outputs"]["y"]["mismatched_calls"] == len(small) + 1
    assert summary["outputs"]["y"]["max_abs_error"] == pytest.approx(0.5, abs=1e-3)
    assert summary["outputs"]["y"]["argmax_agreement"] == 1.0
    compared = summary["outcomes"]["match"] + summary["outcomes"]["mismatch"] - 5  # 5 bad-input calls: both failed
    assert summary["metrics"]["mismatch_rate"] == pytest.approx((len(small) + 1) / compared, abs=1e-6)

    report = (tmp_path / "report.html").read_text()
    for chart in (
        "latency CDF",
        "latency percentiles (ms)",
        "share of calls mismatched, per output",
        "replayed latency CDF by reference version",
    ):
        assert f"<svg width='520' height='300' viewBox='0 0 520 300' role='img' aria-label='{chart}'>" in report
    assert report.count("<polyline class='series'") >= 3
    assert "Per-version breakdown" in report
    assert "OK-&gt;INVALID_ARGUMENT" in report
    assert "late-1:replay" in report
    for request_id in small | four_rows:
        assert f"<code>{request_id}</code>" in report  # the worst calls, by request id
    for external in ("http://", "https://", "<script", "<link", "src="):
        assert external not in report


@pytest.mark.slow
def test_compare_to_diffs_two_targets_with_the_second_as_reference(traffic: Traffic, tmp_path: Path) -> None:
    run = replay(
        traffic,
        tmp_path,
        "--target",
        traffic.stack.workers["v2"].address,
        "--compare-to",
        traffic.stack.workers["v1"].address,
        "--speed",
        "max",
        "--rtol",
        "0.01",
        "--atol",
        "0",
        *traffic.window_args("B"),
    )
    assert run.code == 0, run.stderr
    small = {i for n, i in enumerate(traffic.ids["B"]) if kind_of(n) == "small"}
    assert run.ids("mismatch") == small | {traffic.late_id}
    line = next(r for r in run.results if r["request_id"] == "b-1")
    assert line["compare_to"]["target"] == traffic.stack.workers["v1"].address
    assert line["replayed"]["target"] == traffic.stack.workers["v2"].address
    assert run.summary["reference"] == "compare_to"


# -- outputs redacted at recording ------------------------------------------------------------


@pytest.mark.slow
def test_outputs_redacted_at_recording_are_not_compared_and_the_others_still_are(tmp_path: Path) -> None:
    """Recorded with ``label`` dropped and ``score`` zeroed (the model's third output, sum(y)); ``y`` is kept.
    v2 adds 0.5 to ``y`` and so to ``score``: against v2, ``y`` mismatches and ``score`` is still not compared."""
    versions = {"v1": {"scale": 2.0, "score": True}, "v2": {"scale": 2.0, "bias": 0.5, "score": True}}
    stack = RecordingStack(
        tmp_path / "stack",
        recorder_args=("--redact-output", "label:drop", "--redact-output", "score:mask"),
        versions=versions,
        experiment={"control": "v1", "arms": [{"version": "v1", "weight": 100}]},
    )
    try:
        client = InferClient(stack.router.address)
        rng = np.random.default_rng(3)
        ids = [f"r-{i}" for i in range(6)]
        start = time.time_ns()
        for request_id in ids:
            x = rng.uniform(0.5, 1.5, (1, 4)).astype(np.float32)
            client.infer(make_request(MODEL, x), metadata=[("x-request-id", request_id)])
        client.close()
        time.sleep(0.05)
        traffic = Traffic(stack, {"R": (start, time.time_ns())}, {"R": ids}, "", {})
        stack.wait_recorded(set(ids))
        router, window = ["--target", stack.router.address, "--speed", "max"], traffic.window_args("R")
        redacted = {"label": "redacted_at_recording", "score": "redacted_at_recording"}

        same = replay(traffic, tmp_path / "v1", *router, "--pin-version", "v1", *window, "--gate", "mismatch_rate<=0")
        assert same.code == 0, same.stderr
        assert same.summary["outcomes"] == {"match": 6, "mismatch": 0, "status_change": 0}
        outputs = same.summary["outputs"]
        assert (outputs["y"]["calls"], outputs["y"]["mismatched_calls"]) == (6, 0)
        for name in redacted:
            assert outputs[name]["calls"] == outputs[name]["mismatched_calls"] == 0
            assert outputs[name]["not_compared"] == {"redacted_at_recording": 6}
        for line in same.results:
            assert list(line["outputs"]) == ["y"]
            assert line["not_compared"] == redacted
        assert "Not compared (redacted at recording)" in (tmp_path / "v1" / "report.html").read_text()

        tolerance = ["--rtol", "0.01", "--atol", "0"]
        other = replay(traffic, tmp_path / "v2", *router, "--pin-version", "v2", *tolerance, *window)
        assert other.code == 0, other.stderr
        assert other.ids("mismatch") == set(ids)
        outputs = other.summary["outputs"]
        assert outputs["y"]["mismatched_calls"] == 6
        assert outputs["y"]["max_abs_error"] == pytest.approx(0.5, abs=1e-3)
        assert outputs["score"] == outputs["label"] == same.summary["outputs"]["label"]
        for line in other.results:
            assert (line["outputs"]["y"]["reason"], line["not_compared"]) == ("values", redacted)

        # Two live answers: nothing was redacted in them, so every output is compared.
        workers = stack.workers
        live = replay(
            traffic,
            tmp_path / "live",
            *("--target", workers["v2"].address, "--compare-to", workers["v1"].address, "--speed", "max"),
            *tolerance,
            *window,
        )
        assert live.code == 0, live.stderr
        outputs = live.summary["outputs"]
        assert {name: o["mismatched_calls"] for name, o in outputs.items()} == {"label": 0, "score": 6, "y": 6}
        assert not any("not_compared" in o for o in outputs.values())
        assert not any("not_compared" in line for line in live.results)
    finally:
        stack.close()


# -- selection ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_filters_select_exactly_what_they_say(traffic: Traffic, tmp_path: Path) -> None:
    worker = traffic.stack.workers["v1"].address
    common = ["--target", worker, "--speed", "max"]
    b_ids = traffic.ids["B"]

    errors = replay(traffic, tmp_path / "errors", *common, *traffic.window_args("B"), "--errors-only")
    assert errors.ids() == {i for n, i in enumerate(b_ids) if kind_of(n) == "bad-input"}

    since_a = traffic.windows["A"][0] / 1e9
    until_b = traffic.windows["B"][1] / 1e9
    version = replay(
        traffic,
        tmp_path / "version",
        *common,
        "--since",
        f"{since_a:.9f}",
        "--until",
        f"{until_b:.9f}",
        "--version",
        "v2",
    )
    assert version.ids() == set(traffic.ids["A-v2"])

    keyed = replay(
        traffic,
        tmp_path / "key",
        *common,
        *traffic.window_args("B"),
        "--routing-key",
        "user-1",
        "--routing-key",
        "user-2",
        env={"SPLITSTREAM_HMAC_KEY": HMAC_KEY},
    )
    assert keyed.ids() == {i for n, i in enumerate(b_ids) if n % 3 in (1, 2)} | {traffic.late_id}  # late-1: b-1's key

    sample = replay(traffic, tmp_path / "sample", *common, *traffic.window_args("B"), "--sample", "0.5", "--seed", "3")
    chooser = Selection(models=(MODEL,), since_ns=0, until_ns=1, sample=0.5, sample_seed=3)
    expected = {i for i in [*b_ids, traffic.late_id] if chooser.sampled(i)}
    assert sample.ids() == expected
    assert 0 < len(expected) < 31

    limited = replay(traffic, tmp_path / "limit", *common, *traffic.window_args("B"), "--limit", "5")
    assert limited.ids() == {"b-0", "b-1", "late-1", "b-2", "b-3"}


def test_iso_8601_windows_with_a_timezone_select_the_same_calls_as_epoch_seconds(
    traffic: Traffic, tmp_path: Path
) -> None:
    from datetime import UTC, datetime

    since, until = traffic.windows["A"]
    iso = [
        datetime.fromtimestamp(since / 1e9, UTC).isoformat(),
        datetime.fromtimestamp(until / 1e9 - 0.001, UTC).astimezone().isoformat(),  # local offset
    ]
    run = replay(
        traffic,
        tmp_path,
        "--target",
        traffic.stack.workers["v1"].address,
        "--speed",
        "max",
        "--since",
        iso[0],
        "--until",
        iso[1],
    )
    assert run.code == 0, run.stderr
    assert run.ids() == {*traffic.ids["A"], *traffic.ids["A-v2"]}


def test_corrupt_and_unknown_schema_entries_are_skipped_and_counted_never_fatal(
    traffic: Traffic, tmp_path: Path
) -> None:
    run = replay(
        traffic, tmp_path, "--target", traffic.stack.workers["v1"].address, "--speed", "max", *traffic.window_args("D")
    )
    assert run.code == 0, run.stderr
    assert run.ids("match") == {"d-0", "d-1"}
    # garbage bytes, no record field, no time_ns: corrupt; schema 99: unknown schema.
    assert run.summary["counts"]["skipped"] == {"corrupt": 3, "unsupported_schema": 1}


# -- timing --------------------------------------------------------------------------------


@pytest.mark.slow
def test_speed_1_reproduces_the_recorded_gaps_at_the_router(traffic: Traffic, tmp_path: Path) -> None:
    """The 19 gaps of the burst (0 to 250 ms) as the router saw them, recorded vs replayed.

    Measured on the 2-core development machine (three runs): every gap within 0.94 ms of the
    recorded one, median 0.2-0.35 ms; the replayer's own send lag p99 under 0.1 ms. The bounds
    leave room for other test suites sharing the two cores (a loaded run saw a median of 3.6 ms):
    median error under 8 ms, at least 15 of 19 gaps within 10 ms, the whole burst's length within
    30 ms; and never early. They still fail a replay that ignores the pace: the five gaps of 40 to
    250 ms would be off by about their length, and only 14 gaps could be within 10 ms."""
    run = replay(
        traffic, tmp_path, "--target", traffic.stack.router.address, "--id-suffix", ":speed1", *traffic.window_args("C")
    )
    assert run.code == 0, run.stderr
    assert run.ids("match") == set(traffic.ids["C"])
    lines = sorted(run.results, key=lambda r: r["receive_unix_ns"])
    planned = np.array([r["planned_s"] for r in lines])
    sent = np.array([r["sent_s"] for r in lines])
    assert np.all(sent >= planned)  # never early
    lag = run.summary["send_lag"]
    assert lag["count"] == len(BURST_GAPS_S)
    assert lag["p50_ms"] < 3.0

    # Independent of the replayer's own clock: the router recorded the replayed calls too.
    replayed = traffic.stack.wait_recorded({f"{i}:speed1" for i in traffic.ids["C"]})
    by_id = {r.request_id: r.receive_unix_ns for r in replayed}
    original = np.diff([traffic.records[i].receive_unix_ns for i in traffic.ids["C"]]) / 1e6
    again = np.diff([by_id[f"{i}:speed1"] for i in traffic.ids["C"]]) / 1e6
    errors_ms = np.abs(again - original)
    print("gap errors ms:", errors_ms.round(3).tolist(), "send lag:", lag)
    shown = list(zip(original.round(2).tolist(), again.round(2).tolist(), strict=True))
    assert float(np.median(errors_ms)) < 8.0, shown
    assert int(np.sum(errors_ms < 10.0)) >= 15, shown
    assert abs(again.sum() - original.sum()) < 30.0, shown  # the burst takes as long as it did


@pytest.mark.slow
def test_speed_max_never_has_more_than_the_concurrency_in_flight(traffic: Traffic, tmp_path: Path) -> None:
    # v2 holds a lone call up to 20 ms for a batch partner, so three callers keep three in flight.
    run = replay(
        traffic,
        tmp_path,
        "--target",
        traffic.stack.workers["v2"].address,
        "--speed",
        "max",
        "--concurrency",
        "3",
        *traffic.window_args("B"),
    )
    assert run.code == 0, run.stderr
    events = sorted([(r["sent_s"], 1) for r in run.results] + [(r["done_s"], -1) for r in run.results])
    in_flight = peak = 0
    for _, step in events:  # at equal times, -1 sorts first: a slot is freed before it is reused
        in_flight += step
        peak = max(peak, in_flight)
    assert peak <= 3
    assert run.summary["max_in_flight"] == 3
    assert run.summary["speed"] == "max"
    assert run.summary["send_lag"] is None


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_still_writes_a_partial_summary(traffic: Traffic, tmp_path: Path) -> None:
    # The burst takes ~0.6 s; at speed 0.05 it would take ~12 s.
    command = replay_command(
        traffic, tmp_path, "--target", traffic.stack.workers["v1"].address, "--speed", "0.05", *traffic.window_args("C")
    )
    process = launcher.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = tmp_path / "results.jsonl"
    try:
        wait_for(
            lambda: results.exists() and results.read_text().count("\n") >= 2,
            timeout_s=30,
            what="the first calls to finish",
        )
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"]
    assert 1 <= summary["counts"]["completed"] < len(BURST_GAPS_S)
    assert summary["counts"]["completed"] == len(results.read_text().splitlines())
    assert (tmp_path / "report.html").read_text().count("Interrupted") == 1


# -- exit codes ------------------------------------------------------------------------------


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stopped:
        replay_main(list(args))
    code = stopped.value.code
    return (code if isinstance(code, int) else 1), capsys.readouterr().err


def test_usage_errors_exit_2_with_one_line(
    traffic: Traffic, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    closed = f"127.0.0.1:{free_port()}"
    base = ["--output-dir", str(tmp_path), "--connect-timeout-s", "1"]
    redis = ["--redis-url", traffic.stack.redis.url, "--model", MODEL]
    target = ["--target", traffic.stack.workers["v1"].address]
    cases = {
        "bad time": ([*redis, *target, "--since", "yesterday"], "bad time 'yesterday'"),
        "naive time": ([*redis, *target, "--since", "2026-01-01T14:02:00"], "has no timezone"),
        "backwards": ([*redis, *target, "--since", "-1m", "--until", "-2m"], "must be after --since"),
        "bad gate": ([*redis, *target, "--since", "-1m", "--gate", "latency<=1"], "unknown gate metric"),
        "bad speed": ([*redis, *target, "--since", "-1m", "--speed", "fast"], "bad --speed"),
        "key without hmac": ([*redis, *target, "--since", "-1m", "--routing-key", "u"], "needs --hmac-key"),
        "unknown model": (
            ["--redis-url", traffic.stack.redis.url, "--model", "nope", *target, "--since", "-1m"],
            "unknown model 'nope'",
        ),
        "redis down": (
            ["--redis-url", f"redis://{closed}/0", "--model", MODEL, *target, "--since", "-1m"],
            "is unreachable",
        ),
        "target down": ([*redis, "--target", closed, "--since", "-1m"], f"target {closed} is unreachable"),
        "port out of range": ([*redis, "--target", "h:70000", "--since", "-1m"], "port 1..65535"),
        "infinite buffer": ([*redis, *target, "--since", "-1m", "--reorder-buffer-mb", "inf"], "--reorder-buffer-mb"),
        "NaN deadline": ([*redis, *target, "--since", "-1m", "--timeout-s", "nan"], "--timeout-s must be"),
        "NaN connect": ([*redis, *target, "--since", "-1m", "--connect-timeout-s", "nan"], "--connect-timeout-s"),
        "NaN tolerance": ([*redis, *target, "--since", "-1m", "--rtol", "nan"], "--rtol and --atol must be finite"),
        "NaN lateness": ([*redis, *target, "--since", "-1m", "--max-lateness", "nan"], "bad duration 'nan'"),
        "bare relative time": ([*redis, *target, "--since", "-10"], "bad time '-10'"),
        "pin not a version": ([*redis, *target, "--since", "-1m", "--pin-version", "v\u00fc"], "not a version name"),
        "password in a bad url": (
            ["--redis-url", "redis://:s3cret@h:notaport/0", "--model", MODEL, *target, "--since", "-1m"],
            "bad --redis-url 'redis://:***@h:notaport/0'",
        ),
    }
    env_key = os.environ.pop("SPLITSTREAM_HMAC_KEY", None)
    try:
        for name, (args, message) in cases.items():
            code, err = run_main(capsys, *base, *args)
            assert code == 2, (name, err)
            assert err.startswith("splitstream-replay: error: "), (name, err)
            assert message in err, (name, err)
            assert err.count("\n") == 1, (name, err)
            assert "s3cret" not in err, (name, err)
    finally:
        if env_key is not None:
            os.environ["SPLITSTREAM_HMAC_KEY"] = env_key


@pytest.mark.slow
def test_the_gate_exits_0_when_every_bound_holds_and_1_listing_those_that_fail(
    traffic: Traffic, tmp_path: Path
) -> None:
    common = ["--target", traffic.stack.workers["v1"].address, "--speed", "max", *traffic.window_args("A")]
    # Phase A replayed on v1: the five calls v2 answered now differ, the five v1 answered match.
    passing = replay(traffic, tmp_path / "pass", *common, "--gate", "mismatch_rate<=0.6,error_rate<=0,completed>=10")
    assert passing.code == 0, passing.stderr
    assert "gate passed" in passing.stdout
    failing = replay(traffic, tmp_path / "fail", *common, "--gate", "mismatch_rate<=0.1,error_rate<=0,completed>=11")
    assert failing.code == 1
    assert failing.ids("mismatch") == set(traffic.ids["A-v2"])
    (line,) = [line for line in failing.stderr.splitlines() if "gate failed" in line]
    assert "mismatch_rate=0.5 (bound mismatch_rate<=0.1)" in line
    assert "completed=10 (bound completed>=11)" in line
    assert "error_rate" not in line
    assert failing.summary["gate"]["passed"] is False
    typed = Summary.model_validate_json((failing.out / "summary.json").read_text())  # the whole file is the model
    assert typed.gate is not None
    assert [(b.bound, b.passed) for b in typed.gate.bounds] == [
        ("mismatch_rate<=0.1", False),
        ("error_rate<=0", True),
        ("completed>=11", False),
    ]


@needs_chromium
def test_the_report_renders_offline_in_headless_chromium_with_its_charts_drawn(
    traffic: Traffic, tmp_path: Path
) -> None:
    run = replay(traffic, tmp_path, "--target", traffic.stack.workers["v2"].address, *traffic.window_args("B"))
    assert run.code == 0, run.stderr
    image = screenshot(tmp_path / "report.html", tmp_path / "report.png")
    assert image.shape == (2600, 1200, 3)
    # The latency charts draw the recorded calls in the reference colour and the replayed ones in the
    # candidate colour: a page whose SVG did not render has (almost) none of either.
    assert pixels_of(image, REFERENCE_COLOR) > 500
    assert pixels_of(image, CANDIDATE_COLOR) > 500


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_tls_targets_are_verified_against_the_given_ca_and_server_name(traffic: Traffic, tmp_path: Path) -> None:
    from concurrent import futures

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    launcher.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=replay-target",
         "-addext", "subjectAltName=DNS:replay-target", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    method = "/inference.GRPCInferenceService/ModelInfer"
    upstream = grpc.insecure_channel(traffic.stack.workers["v1"].address)
    forward = upstream.unary_unary(method)  # bytes in, bytes out

    class TlsFront(grpc.GenericRpcHandler):
        """TLS in front of worker v1, forwarding the request bytes as they come."""

        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if details.method != method:  # type: ignore[attr-defined]
                return None
            return grpc.unary_unary_rpc_method_handler(lambda request, _: forward(request, timeout=10))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[TlsFront()])
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
    server.start()
    try:
        common = [
            "--target",
            f"127.0.0.1:{port}",
            "--speed",
            "max",
            "--connect-timeout-s",
            "2",
            *traffic.window_args("A"),
        ]
        run = replay(traffic, tmp_path / "ok", *common, "--tls-ca", str(cert), "--tls-server-name", "replay-target")
        assert run.code == 0, run.stderr
        assert run.ids("match") == set(traffic.ids["A"])  # v1's own answers; the v2-answered calls differ
        assert run.ids("mismatch") == set(traffic.ids["A-v2"])
        untrusted = replay(traffic, tmp_path / "untrusted", *common, "--tls")  # system roots: not this CA
        assert untrusted.code == 2
        assert "is unreachable" in untrusted.stderr
    finally:
        server.stop(grace=None)
        upstream.close()


# -- what the replayer cannot send is its own failure, never the target's --------------------

#: Request ids any protobuf string may be (KServe and Triton accept them), none a valid gRPC header value.
UNPRINTABLE_IDS = ("ünïcode", "a\x01b", "tab\there")


def write_window(traffic: Traffic, copies: dict[str, recorder_pb2.CallRecord]) -> list[str]:
    """Write ``copies`` (request id → record to copy) as calls received now, one 1 ms apart; the window's args."""
    start = time.time_ns()
    for n, (request_id, original) in enumerate(copies.items()):
        record = recorder_pb2.CallRecord()
        record.CopyFrom(original)
        record.request_id = request_id
        record.receive_unix_ns = start + 1_000_000 * (n + 1)
        xadd_record(traffic.stack, record)
    until = start + 1_000_000 * (len(copies) + 1)
    return ["--since", f"{start / 1e9:.9f}", "--until", f"{until / 1e9:.9f}"]


@pytest.mark.slow
def test_recorded_ids_that_are_not_printable_ascii_are_replayed_and_answered_not_counted_as_status_changes(
    traffic: Traffic, tmp_path: Path
) -> None:
    answered_by_v1 = traffic.records[traffic.ids["A"][0]]
    window = write_window(traffic, dict.fromkeys(UNPRINTABLE_IDS, answered_by_v1))
    run = replay(
        traffic,
        tmp_path,
        "--target",
        traffic.stack.router.address,
        "--speed",
        "max",
        "--id-suffix",
        ":rëplay",
        *window,
        "--gate",
        "status_change_rate<=0,mismatch_rate<=0,completed>=3",
    )
    assert run.code == 0, run.stderr
    assert {r["request_id"]: r["outcome"] for r in run.results} == dict.fromkeys(UNPRINTABLE_IDS, "match")
    assert {r["replay_request_id"] for r in run.results} == {i + ":rëplay" for i in UNPRINTABLE_IDS}
    assert {r["replayed"]["status"] for r in run.results} == {"OK"}
    assert run.summary["counts"]["send_errors"] == 0


@pytest.mark.slow
def test_metadata_grpc_refuses_to_send_is_a_send_error_of_the_replayer_not_a_status_change(
    traffic: Traffic, tmp_path: Path
) -> None:
    answered_by_v1 = traffic.records[traffic.ids["A"][0]]
    unsendable = recorder_pb2.CallRecord()
    unsendable.CopyFrom(answered_by_v1)
    unsendable.metadata["x-tenant"] = "acme\x01"  # as anyone with Redis access could have written it
    window = write_window(traffic, {"sendable": answered_by_v1, "unsendable": unsendable})
    run = replay(traffic, tmp_path, "--target", traffic.stack.router.address, "--speed", "max", *window)
    assert run.code == 0, run.stderr
    outcomes = {r["request_id"]: r for r in run.results}
    assert outcomes["sendable"]["outcome"] == "match"
    assert outcomes["unsendable"]["outcome"] == "send_error"
    assert "'x-tenant'" in outcomes["unsendable"]["send_error"]
    assert "not printable ASCII" in outcomes["unsendable"]["send_error"]
    summary = run.summary
    assert summary["counts"]["send_errors"] == 1
    assert summary["counts"]["completed"] == 1
    assert summary["outcomes"]["status_change"] == 0
    assert summary["status_changes"]["transitions"] == {}
    assert summary["metrics"]["failed_sends"] == 1


# -- nothing measured never passes; an unusable output directory is a setup error ---------------


@pytest.mark.slow
def test_an_empty_window_with_a_gate_fails_it_as_not_measured_instead_of_passing_on_zero_rates(
    traffic: Traffic, tmp_path: Path
) -> None:
    first_call_ns = traffic.windows["A"][0]
    empty = ["--since", f"{(first_call_ns - 20 * 10**9) / 1e9:.9f}", "--until", f"{(first_call_ns - 10**10) / 1e9:.9f}"]
    common = ["--target", traffic.stack.workers["v1"].address, "--speed", "max", *empty]
    run = replay(traffic, tmp_path / "gated", *common, "--gate", "mismatch_rate<=0.01,error_rate<=0.001")
    assert run.code == 1, run.stderr
    (line,) = [line for line in run.stderr.splitlines() if "gate failed" in line]
    assert "no call completed" in line
    assert "mismatch_rate=not measured (bound mismatch_rate<=0.01)" in line
    assert "error_rate=not measured (bound error_rate<=0.001)" in line
    assert "gate passed" not in run.stdout
    assert "mismatch rate not measured" in run.stdout
    summary = run.summary
    assert summary["counts"]["selected"] == summary["counts"]["completed"] == 0
    for metric in ("mismatch_rate", "status_change_rate", "divergence_rate", "error_rate", "max_abs_error"):
        assert summary["metrics"][metric] is None, metric
    assert summary["gate"]["passed"] is False
    assert Summary.model_validate(summary).metrics.mismatch_rate is None
    assert "No call completed" in (run.out / "report.html").read_text()

    ungated = replay(traffic, tmp_path / "ungated", *common)
    assert ungated.code == 0, ungated.stderr  # nothing to replay is a result; only a gate needs evidence
    assert ungated.summary["metrics"]["mismatch_rate"] is None
    assert "gate" not in ungated.summary


@pytest.mark.slow
def test_an_output_dir_that_cannot_be_written_exits_2_with_one_line_not_a_traceback(
    traffic: Traffic, tmp_path: Path
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    results_taken = tmp_path / "results-taken"
    (results_taken / "results.jsonl").mkdir(parents=True)
    cases = {
        "under a file": (a_file / "out", "Not a directory"),
        "a file": (a_file, "File exists"),
        "results.jsonl a directory": (results_taken, "Is a directory"),
    }
    common = ["--target", traffic.stack.workers["v1"].address, "--speed", "max", *traffic.window_args("A")]
    for name, (out, reason) in cases.items():
        run = replay(traffic, out, *common)
        assert run.code == 2, (name, run.stderr)
        assert run.stderr.startswith("splitstream-replay: error: cannot write --output-dir"), (name, run.stderr)
        assert reason in run.stderr, (name, run.stderr)
        assert run.stderr.count("\n") == 1, (name, run.stderr)


def test_a_summary_that_cannot_be_written_after_the_replay_exits_2_with_one_line_and_keeps_the_results(
    traffic: Traffic, tmp_path: Path
) -> None:
    (tmp_path / "summary.json").mkdir()  # in the way of the atomic rename
    run = replay(traffic, tmp_path, "--target", traffic.stack.workers["v1"].address, *traffic.window_args("A"))
    assert run.code == 2, run.stderr
    assert run.stderr.startswith("splitstream-replay: error: cannot write the summary or report"), run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.ids() == set(traffic.ids["A"] + traffic.ids["A-v2"])  # every finished call is kept


@pytest.mark.slow
def test_a_recorded_id_too_long_for_a_header_is_replayed_and_answered_not_counted_as_a_status_change(
    traffic: Traffic, tmp_path: Path
) -> None:
    """The replayer sent every id in x-request-id; gRPC refuses metadata past 16 KiB (past 8 KiB at random),
    so a long id (the router records it whole) came back RESOURCE_EXHAUSTED, counted as the target's change."""
    answered_by_v1 = traffic.records[traffic.ids["A"][0]]
    long_ids = [f"{n}-" + "ü" * 20_000 for n in range(3)]
    window = write_window(traffic, dict.fromkeys(long_ids, answered_by_v1))
    run = replay(traffic, tmp_path, "--target", traffic.stack.router.address, "--speed", "max", *window)
    assert run.code == 0, run.stderr
    assert {r["request_id"]: r["outcome"] for r in run.results} == dict.fromkeys(long_ids, "match")
    assert run.summary["counts"]["send_errors"] == 0
