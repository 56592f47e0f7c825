"""The HTTP benchmarks run end to end with tiny settings: every path answers every call and the tables
come out (``bench/http_overhead.py``'s floor and recording router, ``bench/http_stack.py``'s aiohttp
pass-through). Nothing here times anything: the figures are the scripts' own business."""

from __future__ import annotations

import sys

import pytest

from tests import launcher
from tests.harness import ROOT, clean_env

TINY = ("--seconds", "0.2", "--rounds", "1")


def run_bench(script: str, *args: str) -> str:
    done = launcher.run(
        [sys.executable, f"bench/{script}", *TINY, *args],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def rows(output: str, flight: int) -> dict[str, str]:
    """The table rows of ``flight`` calls in flight, by path (a path with errors is named with them)."""
    found = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) > 2 and cells[0] == str(flight):
            found[cells[1]] = line
    return found


@pytest.mark.slow
def test_http_overhead_measures_the_floor_and_the_recording_router_unary_and_streamed() -> None:
    output = run_bench("http_overhead.py", "--paths", "floor,router", "--cases", "unary:1,stream:2")
    assert "Unary JSON" in output
    assert "Streamed chat (SSE)" in output
    for flight in (1, 2):
        assert set(rows(output, flight)) == {"direct", "floor", "router"}, output
    assert "router added p50" in output  # the targets' lines


@pytest.mark.slow
def test_http_overhead_runs_a_baseline_checkouts_routers_beside_this_ones() -> None:
    # This checkout's own interpreter stands in for the other checkout's: the rows, not the code, are checked.
    output = run_bench(
        "http_overhead.py", "--paths", "router,router-norec", "--cases", "unary:1", "--baseline-python", sys.executable
    )
    assert set(rows(output, 1)) == {"direct", "router", "router-norec", "router-base", "router-norec-base"}, output


@pytest.mark.slow
def test_http_stack_measures_the_aiohttp_pass_through() -> None:
    output = run_bench("http_stack.py", "--stacks", "aiohttp", "--cases", "unary:1")
    assert set(rows(output, 1)) == {"direct", "aiohttp"}, output


def test_http_record_path_times_each_step_and_refuses_a_bad_count() -> None:
    command = [sys.executable, "bench/http_record_path.py", "--number", "20", "--repeat", "1"]
    done = launcher.run(command, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for step in ("recording a call, all of it", "the answer's usage", "the entry encoded and appended"):
        assert step in done.stdout, done.stdout
    refused = launcher.run(
        [*command[:2], "--number", "0"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, check=False
    )
    assert refused.returncode == 2
    assert "--number" in refused.stderr
