"""The lift by time since first exposure (``--novelty-bucket``) end to end: a real redis-server holding calls and
clicks written the way the recorder writes them, analysed by the CLI as a user runs it.

A planted novelty effect: each user's first answer is clicked far more often on v2 (60 % against 20 %), and the
answer a few seconds later as often on both (30 %). With two-second buckets the first bucket shows the lift, the
later one none, while the whole window's lift mixes the two.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.experiments import Call, Event, phase, write_calls, write_feedback
from tests.experiments import analyze_cli as cli
from tests.redis_server import RedisServer

HOUR_NS = 3_600 * 10**9
S = 10**9
T0 = (time.time_ns() // 10**9 - 3 * 3_600) * 10**9
MODEL = "novel"
USERS = 1_200
FIRST_RATES = {"v1": 0.2, "v2": 0.6}
LATER_RATE = 0.3


@dataclass
class Planted:
    redis: RedisServer
    #: Per arm and bucket (0: the first answer, 2: the answer 4.5 s later), clicks and calls.
    clicks: dict[tuple[str, int], int]
    calls: dict[tuple[str, int], int]


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Planted]:
    rng = np.random.default_rng(41)
    calls: list[Call] = []
    events: list[Event] = []
    clicks: dict[tuple[str, int], int] = {}
    counted: dict[tuple[str, int], int] = {}
    for i in range(USERS):
        arm = "v1" if i % 2 == 0 else "v2"
        first = int(T0 + rng.integers(0, HOUR_NS // 2))
        # The first answer (bucket 0 of 2 s), then one 4.5 s later (bucket 2): clicked half a second after each.
        for j, (offset, rate, bucket) in enumerate(((0, FIRST_RATES[arm], 0), (4_500_000_000, LATER_RATE, 2))):
            call = Call(f"u{i}-{j}", first + offset, arm, unit=f"{i:064x}")
            calls.append(call)
            counted[arm, bucket] = counted.get((arm, bucket), 0) + 1
            if rng.random() < rate:
                events.append(Event("click", 1.0, call.time_ns + S // 2, request_id=call.request_id,
                                    idempotency_key=f"k{i}-{j}"))  # fmt: skip
                clicks[arm, bucket] = clicks.get((arm, bucket), 0) + 1
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    client = server.client()
    write_calls(client, MODEL, calls, phase({"v1": 50, "v2": 50}, "v1", salt="novelty"))
    write_feedback(client, MODEL, events)
    client.close()
    try:
        yield Planted(server, clicks, counted)
    finally:
        server.stop()


def analysed(planted: Planted, out: Path, *flags: str) -> tuple[str, dict[str, Any]]:
    result = cli(
        MODEL, "--redis-url", planted.redis.url, "--since", str(T0 // S), "--until", str((T0 + HOUR_NS) // S),
        "--metric", "click:rate", *flags, "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    analysis = json.loads((out / "analysis.json").read_text())
    return result.stdout, analysis


def test_a_lift_present_at_first_exposure_and_gone_later_shows_per_bucket(planted: Planted, tmp_path: Path) -> None:
    stdout, analysis = analysed(planted, tmp_path / "2s", "--novelty-bucket", "2s")
    assert analysis["novelty_bucket_ns"] == 2 * S
    [click] = analysis["phases"][0]["comparisons"]
    by_bucket = {p["bucket"]: p for p in click["novelty"]}
    assert sorted(by_bucket) == [0, 2]  # nobody was active 2 to 4 s after their first answer
    first, later = by_bucket[0], by_bucket[2]
    assert (first["units_control"], first["units_arm"]) == (USERS // 2, USERS // 2)
    assert (later["units_control"], later["units_arm"]) == (USERS // 2, USERS // 2)
    assert later["since_first_s"] == 4.0
    # Each bucket's rate is its own clicks over its own calls, as planted.
    for point, bucket in ((first, 0), (later, 2)):
        assert point["control_value"] == pytest.approx(planted.clicks["v1", bucket] / planted.calls["v1", bucket])
        assert point["arm_value"] == pytest.approx(planted.clicks["v2", bucket] / planted.calls["v2", bucket])
    assert first["relative_ci"]["low"] > 1.0  # the novelty: v2 about three times v1 at first
    assert later["relative_ci"]["low"] < 0 < later["relative_ci"]["high"]  # and nothing left later
    assert first["p_value"] < 0.001
    assert "v2 vs v1: click by 2s since first exposure: +0s +" in stdout
    assert ", +4s " in stdout
    html = (tmp_path / "2s" / "analysis.html").read_text()
    assert "Lift by time since first exposure" in html
    assert html.count("class='point' data-bucket=") == 2


def test_the_default_day_buckets_put_a_short_experiment_in_one_bucket(planted: Planted, tmp_path: Path) -> None:
    stdout, analysis = analysed(planted, tmp_path / "1d")
    [click] = analysis["phases"][0]["comparisons"]
    [only] = click["novelty"]
    assert only["bucket"] == 0
    assert only["arm_value"] == pytest.approx(click["arm_value"])  # the whole window, as the overall lift
    assert "since first exposure" not in stdout  # one bucket: nothing to show apart


def test_novelty_off_leaves_the_buckets_out(planted: Planted, tmp_path: Path) -> None:
    _, analysis = analysed(planted, tmp_path / "off", "--novelty-bucket", "off")
    assert analysis["novelty_bucket_ns"] is None
    [click] = analysis["phases"][0]["comparisons"]
    assert click["novelty"] == []
    assert click["arm_value"] == pytest.approx(
        (planted.clicks["v2", 0] + planted.clicks["v2", 2]) / (planted.calls["v2", 0] + planted.calls["v2", 2])
    )
    assert "Lift by time since first exposure" not in (tmp_path / "off" / "analysis.html").read_text()


@pytest.mark.parametrize(
    ("bucket", "message"),
    [
        ("soon", "--novelty-bucket: bad duration 'soon'"),
        ("0s", "must be longer than 0"),
        ("5", "a number and a unit"),
        # Past int64 nanoseconds: the buckets' arithmetic raised OverflowError, a traceback after reading the window.
        ("99999999999999999999d", "--novelty-bucket: at most 100 years"),
    ],
)
def test_a_bad_novelty_bucket_exits_2_with_one_line_naming_the_flag(bucket: str, message: str) -> None:
    result = cli("m", "--since", "-1h", "--metric", "click:rate", "--novelty-bucket", bucket)
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if "error" in line]
    assert message in line, result.stderr
