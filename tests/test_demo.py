"""`make demo`'s story, shortened: 90/10 then 50/50, every call recorded and clicked or not, a replay report, the
A/B analysis of the clicks, nothing left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import launcher
from tests.harness import ROOT

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow


def run_demo(module: str, workdir: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """The demo as ``make`` runs it, asserted to succeed; its output and its summary.json."""
    result = launcher.run(
        [sys.executable, "-m", module, *args, "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary: dict[str, Any] = json.loads((workdir / "summary.json").read_text())
    return result, summary


def assert_nothing_left_running(workdir: Path) -> None:
    """No process the demo started with its workdir on the command line (workers, router) outlives it."""
    leftover = launcher.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes still running: {leftover.stdout}"


def test_the_demo_tells_the_whole_story_and_leaves_nothing_running(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result, summary = run_demo("demo.run", workdir, "--calls", "400", "--step-seconds", "2")
    before, after = summary["phases"]["90/10"], summary["phases"]["50/50"]
    # 400 calls from 1000 sticky users: a standard deviation of about 2 points on each share.
    assert abs(before["v2"]["share"] - 0.10) < 0.07
    assert abs(after["v2"]["share"] - 0.50) < 0.10
    assert after["v2"]["accuracy"] > after["v1"]["accuracy"]
    assert summary["errors"] == 0
    assert summary["recorded"] == summary["calls_sent"]
    label = summary["replay"]["outputs"]["label"]
    assert 0 < label["mismatch_rate"] < 0.3
    report = Path(summary["report"]).read_text()
    assert "<svg" in report
    assert "digits" in report
    assert "accuracy" in result.stdout
    # The outcome act: every answer's click reported, analysed per phase, v2's lift with its interval.
    analysis = summary["analysis"]
    assert set(analysis) == {"90/10", "50/50"}
    for phase in analysis.values():
        assert phase["srm_flagged"] is False, phase
        click = phase["click"]
        assert click["absolute_ci"]["low"] < click["absolute_lift"] < click["absolute_ci"]["high"]
        assert click["relative_ci"]["low"] < click["relative_lift"] < click["relative_ci"]["high"]
    units = analysis["50/50"]["units"]
    assert units["v1"] > 0
    assert units["v2"] > 0
    assert "v2 vs v1: click" in result.stdout
    assert "units per arm: observed" in result.stdout
    assert ": ok" in result.stdout
    page = Path(summary["analysis_report"])
    assert page.parent == Path(summary["report"]).parent
    assert "<svg" in page.read_text()
    assert_nothing_left_running(workdir)


def test_the_llm_demo_records_streams_split_50_50_replays_them_and_rates_openai_chats_leaving_nothing_running(
    tmp_path: Path,
) -> None:
    workdir = tmp_path / "demo-llm"
    result, summary = run_demo(
        "demo.llm", workdir, "--streams", "24", "--tokens", "24", "--chat-users", "120", "--chats-per-user", "2",
        "--judge-pairs", "80",
    )  # fmt: skip
    assert set(summary["users"]) == {"v1", "v2"}, "a 50/50 split of 24 streams reaches both versions"
    assert summary["errors"] == 0
    assert summary["recorded"] == summary["streams_sent"] == 24
    for row in summary["users"].values():
        assert row["ttft_p50_ms"] is not None
        assert row["itl_p50_ms"] is not None
    versions = summary["replay"]["versions"]
    assert versions["v2"]["token_match_rate"] == 1.0
    assert versions["v1"]["token_match_rate"] < 1.0
    assert versions["v1"]["mean_edit_distance"] > 0
    report = Path(summary["report"]).read_text()
    assert "Token streams" in report
    assert "TTFT" in result.stdout
    # The noise floor of v2 over v1: v1 against itself (greedy) differs nowhere; v2 differs, from its first tokens.
    noise = summary["noise"]
    assert noise["calls"] == versions["v1"]["streams"]
    assert noise["control_rate"] == 0.0
    assert noise["candidate_rate"] > 0.5
    assert noise["above_noise"] is True
    assert noise["positions_above"], noise
    assert noise["diff_above_noise_rate"] == 1.0
    assert "noise floor (v1's" in result.stdout
    assert "v2 above the noise" in result.stdout
    # The judged win rate: 80 recorded chats judged against the other version's answer by the demo's judge, whose
    # rule (the larger share of real words) favours the trigram.
    judged = summary["judge"]
    assert judged["pairs"] == 80
    v2 = judged["by_version"]["v2"]
    assert v2["preference"] > 0.5
    assert v2["preference_interval"][0] > 0.5, judged
    assert "judged win rate (splitstream judge" in result.stdout
    assert "a rule, not a language model" in result.stdout
    # splitstream analyze: per arm the tokens the users received, TTFT and the cost at v2's double price.
    arms = summary["analysis"]["arms"]
    for version, row in summary["users"].items():
        assert arms[version]["generations"] == row["streams"]
        assert arms[version]["tokens_out"] == row["tokens"]
        assert arms[version]["ttft_p50_ms"] is not None
    assert arms["v2"]["cost_per_call"] > arms["v1"]["cost_per_call"]
    assert any(
        line.startswith("v2 vs v1: cost") and line.endswith("v2 worse") for line in summary["analysis"]["verdicts"]
    )
    assert "COST/CALL" in result.stdout
    assert Path(summary["analysis_report"]).exists()
    # The OpenAI act: chat users over HTTP with the openai client, sticky by user=, each answer rated by its id.
    chats = summary["openai"]
    assert chats["error_count"] == 0, chats["errors"]
    assert chats["chats"] == chats["chats_wanted"] == 240
    assert set(chats["versions"]) == {"v1", "v2"}, "both versions answered over HTTP"
    assert chats["switched_users"] == 0, "a user keeps its version: the split is sticky by the body's user"
    assert chats["recorded_http"] == {v: row["chats"] for v, row in chats["versions"].items()}, "recorded as HTTP"
    assert chats["feedback_accepted"] == chats["chats"], "POST /v1/feedback accepted every chat's rating"
    assert chats["feedback_in_redis"] == chats["feedback_accepted"]
    rated = summary["openai_analysis"]
    for version, row in chats["versions"].items():
        arm = rated["arms"][version]
        assert arm["generations"] == row["chats"]
        assert arm["tokens_in"] == row["tokens_in"]
        assert arm["tokens_out"] == row["tokens_out"]
        assert arm["ttft_p50_ms"] is not None
        assert arm["cost_per_call"] > 0
    assert rated["arms"]["v2"]["cost_per_call"] > rated["arms"]["v1"]["cost_per_call"]
    # The planted better version (the trigram writes more real words, so it earns more thumbs-up) wins.
    assert any(line.startswith("v2 vs v1: thumbs_up") and line.endswith("v2 better") for line in rated["verdicts"]), (
        rated["verdicts"]
    )
    assert any(line.startswith("v2 vs v1: ttft_ms") for line in rated["verdicts"])
    assert any(line.startswith("v2 vs v1: cost") for line in rated["verdicts"])
    assert "the OpenAI act" in result.stdout
    assert "thumbs_up:rate" in rated["table"]
    assert rated["table"] in result.stdout
    assert Path(rated["report"]).exists()
    assert_nothing_left_running(workdir)
