"""Replaying records the router stored without a payload for size, on real processes end to end.

A record over the router's ``--record-batch-max-bytes`` alone is recorded without its largest
payloads, named in the ``splitstream.payload-dropped`` tag. Here the cap is 256 KiB, so the calls
are a few hundred KiB at most: a 12,800-row call (200 KiB in, 300 KiB out) loses its response; a
20,000-row call loses both; a 20,000-row call refused at routing (no response) loses its request.
A replay must skip the calls without a request and count them apart, replay those without a
response comparing their status only, and compare the rest as usual, with gate rates unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from splitstream.common.headers import VERSION_HEADER
from splitstream.common.records import dropped_payloads
from tests.harness import InferClient, make_request
from tests.recording_stack import MODEL, RecordingStack
from tests.test_replay import Run, Traffic, replay

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow

#: One batch per call on the workers (dynamic batching would hold the large inputs).
UNBATCHED = {"max_batch_size": 0, "dynamic_batching": {"enabled": False}}
SMALL = [f"small-{i}" for i in range(4)]
RESPONSE_DROPPED = [f"no-response-{i}" for i in range(2)]
BOTH_DROPPED = [f"no-payloads-{i}" for i in range(2)]
REFUSED = "refused-no-request"
NOT_REPLAYABLE = {*BOTH_DROPPED, REFUSED}
#: Replayed against v2 (y + 0.5), small calls (|y| ~ 2) mismatch at this tolerance.
TOLERANCE = ("--rtol", "0.01", "--atol", "0")
NOT_COMPARED = {"label": "response_not_recorded", "y": "response_not_recorded"}


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    stack = RecordingStack(
        tmp_path_factory.mktemp("payload-dropped-stack"),
        versions={"v1": {"scale": 2.0, "config": UNBATCHED}, "v2": {"scale": 2.0, "bias": 0.5, "config": UNBATCHED}},
        experiment={"control": "v1", "arms": [{"version": "v1", "weight": 100}]},
        router_args=("--record-batch-max-bytes", str(256 << 10)),  # the stream cap follows: half of it
    )
    try:
        client = InferClient(stack.router.address)
        rng = np.random.default_rng(11)
        start = time.time_ns()
        for request_id, rows in [
            *((i, 1) for i in SMALL),
            *((i, 12_800) for i in RESPONSE_DROPPED),
            *((i, 20_000) for i in BOTH_DROPPED),
        ]:
            x = rng.uniform(0.5, 1.5, (rows, 4)).astype(np.float32)
            client.infer(make_request(MODEL, x), metadata=[("x-request-id", request_id)], timeout_s=30)
        big = rng.uniform(0.5, 1.5, (20_000, 4)).astype(np.float32)
        with pytest.raises(grpc.RpcError) as refused:
            client.infer(make_request(MODEL, big), metadata=[("x-request-id", REFUSED), (VERSION_HEADER, "v9")])
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        client.close()
        end = time.time_ns()
        ids = [*SMALL, *RESPONSE_DROPPED, *BOTH_DROPPED, REFUSED]
        records = {r.request_id: r for r in stack.wait_recorded(set(ids))}
        yield Traffic(stack, {"P": (start, end)}, {"P": ids}, "", records)
    finally:
        stack.close()


def replay_router(traffic: Traffic, out: Path, *args: str) -> Run:
    # Calls of a few hundred KiB sent at once: on a loaded machine one took longer than the default 10 s
    # deadline, and a failed send is not an outcome. Deadlines are not what this module tests.
    router = ("--target", traffic.stack.router.address, "--speed", "max", "--timeout-s", "60")
    return replay(traffic, out, *router, *traffic.window_args("P"), *args)


def test_the_router_drops_the_payloads_this_module_expects(traffic: Traffic) -> None:
    """The premise of the replay tests below: which payloads each call's record lacks."""
    dropped = {request_id: set(dropped_payloads(record)) for request_id, record in traffic.records.items()}
    assert {request_id: names for request_id, names in dropped.items() if names} == {
        **{request_id: {"response"} for request_id in RESPONSE_DROPPED},
        **{request_id: {"request", "response"} for request_id in BOTH_DROPPED},
        REFUSED: {"request"},
    }


def test_calls_recorded_without_a_request_are_not_replayed_and_without_a_response_are_not_compared(
    traffic: Traffic, tmp_path: Path
) -> None:
    gate = "mismatch_rate<=0,error_rate<=0,status_change_rate<=0,failed_sends<=0"
    run = replay_router(traffic, tmp_path / "v1", "--pin-version", "v1", "--gate", gate)
    assert run.code == 0, run.stderr
    assert "gate passed" in run.stdout

    summary = run.summary
    assert summary["outcomes"] == {"match": 4, "mismatch": 0, "status_change": 0, "not_compared": 2}
    assert summary["counts"]["not_replayed"] == {"request_not_recorded": 3}
    assert (summary["counts"]["selected"], summary["counts"]["sent"], summary["counts"]["completed"]) == (9, 6, 6)
    assert summary["counts"]["send_errors"] == 0
    metrics = summary["metrics"]
    assert (metrics["mismatch_rate"], metrics["error_rate"], metrics["status_change_rate"]) == (0.0, 0.0, 0.0)
    assert metrics["failed_sends"] == 0
    assert summary["versions"]["v1"]["compared"] == 4  # the two without a response are not in the rate's base
    for name in ("y", "label"):
        assert summary["outputs"][name]["calls"] == 4
        assert summary["outputs"][name]["not_compared"] == {"response_not_recorded": 2}

    lines = {line["request_id"]: line for line in run.results}
    assert set(lines) == {*SMALL, *RESPONSE_DROPPED, *NOT_REPLAYABLE}
    assert run.ids("not_replayed") == NOT_REPLAYABLE
    for request_id in NOT_REPLAYABLE:
        assert lines[request_id]["not_replayed"] == "request_not_recorded"
        assert "replay_request_id" not in lines[request_id]
    assert lines[REFUSED]["recorded"]["status"] == "NOT_FOUND"
    assert run.ids("not_compared") == set(RESPONSE_DROPPED)
    for request_id in RESPONSE_DROPPED:
        line = lines[request_id]
        assert (line["replayed"]["status"], line["not_compared"]) == ("OK", NOT_COMPARED)
        assert "outputs" not in line
    assert run.ids("match") == set(SMALL)

    assert "3 not replayed (request not recorded)" in run.stdout
    html = (tmp_path / "v1" / "report.html").read_text()
    assert "not replayed: request not recorded (too large)" in html
    assert "2 (response not recorded (too large))" in html


def test_a_gate_fails_on_the_calls_it_could_compare_and_not_on_those_it_could_not(
    traffic: Traffic, tmp_path: Path
) -> None:
    """Against v2 the four small calls mismatch: the rate is 4 of 4, not 4 of 6 as it would be if the
    calls without a recorded response counted as compared, nor do those count as mismatches."""
    run = replay_router(traffic, tmp_path / "v2", "--pin-version", "v2", *TOLERANCE, "--gate", "mismatch_rate<=0")
    assert run.code == 1, run.stderr
    assert "gate failed: mismatch_rate=1 (bound mismatch_rate<=0)" in run.stderr
    summary = run.summary
    assert summary["outcomes"] == {"match": 0, "mismatch": 4, "status_change": 0, "not_compared": 2}
    assert summary["metrics"]["mismatch_rate"] == 1.0
    assert summary["metrics"]["error_rate"] == 0.0
    assert summary["counts"]["not_replayed"] == {"request_not_recorded": 3}
    assert run.ids("mismatch") == set(SMALL)
    assert {line["request_id"] for line in summary["worst_calls"]} == set(SMALL)


def test_against_a_live_reference_calls_without_a_recorded_response_are_compared_whole(
    traffic: Traffic, tmp_path: Path
) -> None:
    """With ``--compare-to`` the reference is the second target's answer, so a response missing from the
    record does not matter; a request missing from it still leaves nothing to send."""
    workers = traffic.stack.workers
    live = ("--target", workers["v2"].address, "--compare-to", workers["v1"].address, "--speed", "max")
    run = replay(traffic, tmp_path / "live", *live, *TOLERANCE, *traffic.window_args("P"))
    assert run.code == 0, run.stderr
    summary = run.summary
    assert summary["outcomes"] == {"match": 0, "mismatch": 6, "status_change": 0}
    assert summary["counts"]["not_replayed"] == {"request_not_recorded": 3}
    assert run.ids("mismatch") == {*SMALL, *RESPONSE_DROPPED}
    assert not any("not_compared" in line for line in run.results)
