"""``splitstream judge`` end to end: chat calls recorded through a router's HTTP port (two generating workers,
demo/language.py's bigram v1 and trigram v2, 50/50 by user, a recorder and redis-server), judged by a real
HTTP server speaking OpenAI's chat completions API (tests/judge_server.py: scripted verdicts).

Greedy generation answers every chat prompt with the same text per version (the prompt ends in
"assistant:"), so calls differ by ``max_tokens``: each length is a different pair of answers. The scripted
judge prefers v2's text (an answer that starts v2's long answer), except one pair in four (a hash of the two
answers): v2 must come out preferred with an interval above 0.5 (clustered by user, checked against
statsmodels), ``analyze --metric judge:rate`` must read the verdicts written as feedback, a judge that always
says "A" must not make either version win, a re-run must not ask the judge again, and a 429 is retried."""

from __future__ import annotations

import hashlib
import http.client
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

import numpy as np
import openai
import pytest
import statsmodels.api as sm
import yaml

from demo import language
from splitstream.admin.pairwise import load_cache, parse_verdict
from splitstream.admin.pairwise_stats import Judged, clustered_mean, version_summary
from splitstream.common.files import atomic_write
from tests import launcher
from tests.harness import ROOT, ServiceProcess, Stack, free_port, wait_for, write_registry
from tests.recording_stack import RecordingStack
from tests.streams import StreamClient, generation_request

MODEL = "writer"
KEY = "sk-judge-http-" + "5" * 32
JUDGE_KEY = "sk-the-judge-0123456789"
USERS = 16
CALLS_PER_USER = 3
STREAM_USERS = 8
STREAM_PROMPT = "The quick brown fox "


def accepts(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        return connection.getresponse().status == 200
    except OSError:
        return False


@dataclass
class Traffic:
    stack: RecordingStack
    http_port: int
    since_ns: int
    until_ns: int
    served: dict[str, str]
    preferred: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    tmp = tmp_path_factory.mktemp("pairwise")
    models = tmp / "models"
    language.write_versions(models, MODEL, generation={"max_tokens_limit": 1_000_000})
    principals = tmp / "principals.yaml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    atomic_write(
        principals,
        yaml.safe_dump(
            {"principals": {"app": {"api_keys_sha256": [digest], "models": ["*"], "pin": True, "feedback": True}}}
        ),
    )
    http_port = free_port()
    stack = RecordingStack(
        tmp,
        model=MODEL,
        versions={"v1": {}, "v2": {}},
        experiment={
            "salt": "pairwise",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        },
        worker=lambda stack, version: stack.worker(models, MODEL, version),
        router_args=("--http-port", str(http_port), "--auth-principals", f"file:{principals}"),
    )
    try:
        wait_for(lambda: accepts(http_port), timeout_s=30, what="the HTTP port to accept")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY, max_retries=0, timeout=30)
        # v2's long answer, before the window: the scripted judge prefers what starts it.
        long = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=64,
            extra_headers={"x-splitstream-version": "v2"},
        )
        preferred = tmp / "preferred.jsonl"
        preferred.write_text(json.dumps(long.choices[0].message.content) + "\n")
        since_ns = time.time_ns()
        served: dict[str, str] = {}
        for user in range(USERS):
            for call in range(CALLS_PER_USER):
                request_id = f"chat-{user}-{call}"
                tokens = 6 + (user * CALLS_PER_USER + call) % 29
                messages: Any = [{"role": "user", "content": f"Question {call} of user {user}"}]
                raw: Any = client.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=tokens,
                    stream=call == 2,  # streamed: the recorded answer is its events
                    user=f"user-{user}",
                    extra_headers={"x-request-id": request_id},
                )
                if call == 2:
                    list(raw.parse())
                served[request_id] = raw.headers["x-splitstream-version"]
        # Token streams over gRPC, one per user of the first STREAM_USERS, judged only with --grpc-target.
        streams = StreamClient(stack.router.address)
        try:
            for user in range(STREAM_USERS):
                request = generation_request(MODEL, STREAM_PROMPT, 16, request_id=f"stream-{user}")
                metadata = [("x-api-key", KEY), ("x-routing-key", f"user-{user}"), ("x-request-id", f"stream-{user}")]
                list(streams.stream([request], metadata=metadata))
                served[f"stream-{user}"] = ""
        finally:
            streams.close()
        stack.wait_recorded(set(served))
        yield Traffic(stack, http_port, since_ns, time.time_ns(), served, preferred)
    finally:
        stack.close()


@dataclass
class Judge:
    process: ServiceProcess
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stats(self) -> dict[str, int]:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=5) as response:
            data: dict[str, int] = json.load(response)
        return data


def start_judge(tmp: Path, *args: str) -> Judge:
    port = free_port()
    stack = Stack(tmp)
    process = stack.service(
        f"judge-{port}", "tests.judge_server", ["--port", str(port), "--key", JUDGE_KEY, *args], port=port, start=False
    )
    process.start(wait_serving=False)
    judge = Judge(process, port)

    def up() -> bool:
        try:
            judge.stats()
            return True
        except OSError:
            return False

    wait_for(up, timeout_s=30, what="the judge server")
    return judge


@pytest.fixture
def judges(tmp_path: Path) -> Iterator[list[Judge]]:
    started: list[Judge] = []
    yield started
    for judge in started:
        judge.process.stop()


@dataclass
class JudgeRun:
    code: int
    stdout: str
    stderr: str
    out: Path

    @property
    def summary(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.out / "summary.json").read_text())
        return data

    def pairs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.out / "pairs.jsonl").read_text().splitlines()]


def run_judge(traffic: Traffic, judge: Judge, out: Path, *args: str) -> JudgeRun:
    command = [
        sys.executable,
        "-m",
        "splitstream.admin",
        "judge",
        MODEL,
        "--redis-url",
        traffic.stack.redis.url,
        "--since",
        f"{traffic.since_ns / 1e9:.9f}",
        "--until",
        f"{traffic.until_ns / 1e9:.9f}",
        "--version",
        "v1",
        "--other-version",
        "v2",
        "--target",
        traffic.url,
        "--judge-url",
        judge.url,
        "--judge-model",
        "judge-1",
        "--output-dir",
        str(out),
        "--backoff-s",
        "0.05",
        *args,
    ]
    env = {**os.environ, "SPLITSTREAM_JUDGE_API_KEY": JUDGE_KEY, "SPLITSTREAM_JUDGE_TARGET_API_KEY": KEY}
    done = launcher.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    return JudgeRun(done.returncode, done.stdout, done.stderr, out)


@pytest.mark.slow
def test_the_version_the_judge_prefers_wins_with_an_interval_above_one_half(
    traffic: Traffic, judges: list[Judge], tmp_path: Path
) -> None:
    judges.append(judge := start_judge(tmp_path, "--prefer", str(traffic.preferred), "--flip-every", "4"))
    run = run_judge(traffic, judge, tmp_path / "out", "--feedback-router", traffic.stack.router.address)
    assert run.code == 0, run.stderr
    summary = run.summary
    pairs = run.pairs()
    assert len(pairs) == USERS * CALLS_PER_USER
    assert {pair["recorded_version"] for pair in pairs} == {"v1", "v2"}  # both directions judged
    for pair in pairs:
        assert pair["judge_raw"].endswith(f"Verdict: {pair['verdict']}")
        assert set(pair["order"].values()) == {"v1", "v2"}
    v2 = summary["by_version"]["v2"]
    assert v2["preference_interval"][0] > 0.5, summary
    assert summary["by_version"]["v1"]["preference_interval"][1] < 0.5
    assert v2["wins"] + v2["ties"] + v2["losses"] == len(pairs)
    assert v2["losses"] > 0  # the flipped pairs: the interval has width
    # The interval against statsmodels' cluster-robust standard error of a mean (clusters: users).
    scores = np.array([0 if p["winner"] == "tie" else (1 if p["winner"] == "v2" else -1) for p in pairs], float)
    users = [p["routing_key_hmac"] for p in pairs]
    groups = np.unique(users, return_inverse=True)[1]
    fit = sm.OLS(scores, np.ones(len(scores))).fit(cov_type="cluster", cov_kwds={"groups": groups}, use_t=True)
    assert v2["preference"] == pytest.approx((1 + fit.params[0]) / 2)
    assert v2["preference_interval"] == pytest.approx(list((1 + fit.conf_int(0.05)[0]) / 2))
    assert summary["feedback"]["accepted"] == len(pairs)

    # The verdicts are feedback: analyze reads judge:rate per arm, v2's answers won more often.
    def analyzed() -> dict[str, Any] | None:
        done = launcher.run(
            [
                sys.executable,
                "-m",
                "splitstream.admin",
                "analyze",
                MODEL,
                "--redis-url",
                traffic.stack.redis.url,
                "--since",
                f"{traffic.since_ns / 1e9:.9f}",
                "--until",
                f"{traffic.until_ns / 1e9:.9f}",
                "--metric",
                "judge:rate",
                "--output-dir",
                str(tmp_path / "analysis"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        analysis: dict[str, Any] = json.loads((tmp_path / "analysis" / "analysis.json").read_text())
        if analysis["feedback"]["used"] < len(pairs):
            return None
        return analysis

    analysis = wait_for(analyzed, timeout_s=30, what="the verdicts to be recorded as feedback")
    arms = {arm["arm"]: arm for arm in analysis["phases"][0]["arms"]}
    rates = {name: next(iter(arm["metrics"].values()))["value"] for name, arm in arms.items()}
    wins = {v: sum(1 for p in pairs if p["recorded_version"] == v and p["winner"] == v) for v in ("v1", "v2")}
    # Per exposure call of the arm: the gRPC streams of the window (not judged in this run) count too.
    assert sum(arm["calls"] for arm in arms.values()) == len(pairs) + STREAM_USERS
    assert rates == pytest.approx({v: wins[v] / arms[v]["calls"] for v in ("v1", "v2")})
    assert rates["v2"] > rates["v1"]

    # A re-run reads every pair from the cache: the judge is not asked again.
    asked = judge.stats()["completions"]
    again = run_judge(traffic, judge, tmp_path / "out")
    assert again.code == 0, again.stderr
    assert judge.stats()["completions"] == asked
    assert again.summary["judge_calls"] == 0
    assert again.summary["by_version"] == summary["by_version"]


@pytest.mark.slow
def test_random_order_cancels_a_judge_that_always_says_a(traffic: Traffic, judges: list[Judge], tmp_path: Path) -> None:
    judges.append(judge := start_judge(tmp_path, "--first"))
    run = run_judge(traffic, judge, tmp_path / "out")
    assert run.code == 0, run.stderr
    summary = run.summary
    assert summary["position"]["first_win_rate"] == 1.0
    low, high = summary["by_version"]["v2"]["preference_interval"]
    assert low < 0.5 < high, summary
    assert 0.3 < summary["by_version"]["v2"]["win_rate"] < 0.7


@pytest.mark.slow
def test_a_429_is_retried_after_its_retry_after(traffic: Traffic, judges: list[Judge], tmp_path: Path) -> None:
    judges.append(judge := start_judge(tmp_path, "--first", "--throttle", "2"))
    run = run_judge(traffic, judge, tmp_path / "out", "--max-pairs", "3", "--concurrency", "1")
    assert run.code == 0, run.stderr
    assert len(run.pairs()) == 3
    assert run.summary["judge_retries"] == 2
    assert judge.stats() == {"completions": 3, "throttled": 2}


@pytest.mark.slow
@pytest.mark.parametrize("retry_after", ["nan", "inf", "soon"])
def test_a_retry_after_that_is_no_delay_falls_back_to_the_backoff(
    traffic: Traffic, judges: list[Judge], tmp_path: Path, retry_after: str
) -> None:
    judges.append(judge := start_judge(tmp_path, "--first", "--throttle", "2", f"--retry-after={retry_after}"))
    run = run_judge(traffic, judge, tmp_path / "out", "--max-pairs", "1", "--backoff-s", "0.4")
    assert run.code == 0, run.stderr
    assert judge.stats() == {"completions": 1, "throttled": 2}
    with urllib.request.urlopen(f"http://127.0.0.1:{judge.port}/gaps", timeout=5) as response:
        gaps = json.load(response)
    assert len(gaps) == 2
    # The backoff: 0.4 s then 0.8 s, jittered to between half and one and a half of each.
    assert min(gaps) >= 0.2, gaps
    assert max(gaps) < 5, gaps


@pytest.mark.slow
def test_token_streams_are_judged_against_the_other_versions_stream(
    traffic: Traffic, judges: list[Judge], tmp_path: Path
) -> None:
    judges.append(judge := start_judge(tmp_path, "--first"))
    run = run_judge(traffic, judge, tmp_path / "out", "--grpc-target", traffic.stack.router.address)
    assert run.code == 0, run.stderr
    streams = [pair for pair in run.pairs() if pair["request_id"].startswith("stream-")]
    assert len(streams) == STREAM_USERS
    recorded = {pair["recorded_version"]: pair["recorded_answer"] for pair in streams}
    assert set(recorded) == {"v1", "v2"}
    assert recorded["v1"] != recorded["v2"]
    for pair in streams:  # greedy: the other version's stream answers the prompt as its own recorded ones did
        assert pair["other_answer"] == recorded[pair["other_version"]]
        assert pair["verdict"] == "A"
    assert len(run.pairs()) == USERS * CALLS_PER_USER + STREAM_USERS


@pytest.mark.slow
def test_the_token_budget_stops_asking_and_a_refused_key_fails_the_run(
    traffic: Traffic, judges: list[Judge], tmp_path: Path
) -> None:
    judges.append(judge := start_judge(tmp_path, "--first"))
    run = run_judge(traffic, judge, tmp_path / "budget", "--max-tokens", "100", "--concurrency", "1")
    assert run.code == 0, run.stderr
    # Each verdict costs ~74 tokens here: the second call passes 100, the rest are not asked.
    assert judge.stats()["completions"] == 2
    assert run.summary["counts"]["over_budget"] == USERS * CALLS_PER_USER - 2

    refused = run_judge(traffic, judge, tmp_path / "refused", "--judge-api-key-file", str(traffic.preferred))
    assert refused.code == 1
    assert "answered HTTP 401" in refused.stderr
    assert judge.stats()["completions"] == 2


@pytest.mark.slow
def test_a_cache_torn_mid_line_by_a_killed_run_loses_no_pair_on_the_next_runs(
    traffic: Traffic, judges: list[Judge], tmp_path: Path
) -> None:
    judges.append(judge := start_judge(tmp_path, "--first"))
    out = tmp_path / "out"
    first = run_judge(traffic, judge, out, "--max-pairs", "3", "--concurrency", "1")
    assert first.code == 0, first.stderr
    cache = out / "cache.jsonl"
    lines = cache.read_text().splitlines(keepends=True)
    assert len(lines) == 3
    cache.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # killed while writing the third
    again = run_judge(traffic, judge, out, "--max-pairs", "3", "--concurrency", "1")
    assert again.code == 0, again.stderr
    assert judge.stats()["completions"] == 4  # the torn pair is judged again, once
    assert len(load_cache(cache)) == 3  # every pair judged so far is whole in the cache
    third = run_judge(traffic, judge, out, "--max-pairs", "3", "--concurrency", "1")
    assert third.code == 0, third.stderr
    assert third.summary["judge_calls"] == 0
    assert judge.stats()["completions"] == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ("not-json", "answered no chat completion"),
        ("no-message", "answered no chat completion"),
        ("huge", "larger than"),
        ("500", "failed 3 times, last: HTTP 500"),
    ],
)
def test_a_judge_answering_no_chat_completion_fails_the_run_with_exit_1(
    traffic: Traffic, judges: list[Judge], tmp_path: Path, answer: str, said: str
) -> None:
    judges.append(judge := start_judge(tmp_path, "--answer", answer))
    run = run_judge(traffic, judge, tmp_path / "out", "--max-pairs", "2", "--concurrency", "1", "--retries", "2")
    assert run.code == 1, run.stderr
    assert "Traceback" not in run.stderr
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("splitstream judge: error: the judge at "), line
    assert said in line, line
    assert len(line) < 2000
    assert judge.stats()["completions"] == (3 if answer == "500" else 1)


def test_a_rubric_without_the_answers_is_refused_naming_the_flag(tmp_path: Path) -> None:
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Which is better? {{conversation}}")
    done = launcher.run(
        [
            sys.executable,
            "-m",
            "splitstream.admin",
            "judge",
            MODEL,
            "--since",
            "-1h",
            "--version",
            "v1",
            "--other-version",
            "v2",
            "--target",
            "http://127.0.0.1:9",
            "--judge-url",
            "http://127.0.0.1:9/v1",
            "--judge-model",
            "j",
            "--rubric",
            str(rubric),
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"splitstream judge: error: --rubric {rubric}: the rubric lacks {{{{answer_a}}}}, {{{{answer_b}}}}"
    ]


@pytest.mark.parametrize(
    ("answer", "verdict"),
    [
        ("A is clearer.\nVerdict: B", "B"),
        ("The rubric says 'Verdict: A' or 'Verdict: B'. I pick...\n**Verdict: tie**", "tie"),
        ("verdict = [[A]]", "A"),
        (" B. ", "B"),
        ("I cannot decide.", None),
    ],
)
def test_verdicts_are_read_from_the_last_verdict_line(answer: str, verdict: str | None) -> None:
    assert parse_verdict(answer) == verdict


def test_the_interval_rejects_a_true_null_at_about_alpha_when_users_differ() -> None:
    """A/A: 2,000 runs of 30 users (1-6 calls each, 10 % ties) whose own preference varies (logit N(0, 1))
    around no preference at all. The clustered t interval excludes 0.5 in about 5 % of them; one that took
    calls as independent would in about 11 %."""
    rng = np.random.default_rng(30)
    runs, users, excluded, naive = 2000, 30, 0, 0
    for _ in range(runs):
        calls = rng.integers(1, 7, size=users)
        win = 1 / (1 + np.exp(-rng.normal(0, 1.0, size=users)))
        cluster = np.repeat(np.arange(users), calls)
        draws = rng.random(cluster.size)
        scores = np.where(rng.random(cluster.size) < 0.1, 0, np.where(draws < win[cluster], 1, -1))
        judged = [Judged(int(s), str(c), True) for s, c in zip(scores, cluster, strict=True)]
        low, high = version_summary(judged, sign=1, alpha=0.05)["preference_interval"]  # type: ignore[misc]
        excluded += not low <= 0.5 <= high
        naive += abs(scores.mean()) > 1.96 * scores.std(ddof=1) / np.sqrt(scores.size)
    assert 0.035 <= excluded / runs <= 0.065, excluded / runs
    assert naive / runs > 0.09


def test_the_clustered_standard_error_is_statsmodels_on_random_clusters() -> None:
    rng = np.random.default_rng(7)
    scores = rng.choice([-1.0, 0.0, 1.0], size=400, p=[0.3, 0.2, 0.5])
    groups = rng.integers(0, 37, size=400)
    mean, se = clustered_mean(list(scores), [str(g) for g in groups])
    fit = sm.OLS(scores, np.ones(400)).fit(cov_type="cluster", cov_kwds={"groups": groups})
    assert mean == pytest.approx(fit.params[0])
    assert se == pytest.approx(fit.bse[0])


@pytest.mark.slow
def test_a_rollout_guarded_by_the_judges_feedback_rolls_back_a_version_the_judge_finds_worse(
    traffic: Traffic, judges: list[Judge], tmp_path: Path
) -> None:
    """``rollout --guard 'judge:rate:lift>=-10%'`` end to end: chat calls arrive during the step, ``splitstream
    judge --feedback-router`` writes its verdicts on them as feedback, and the guard reads them like clicks. The
    judge prefers v1's answers (seven pairs in eight): v2's judge rate is far below v1's, and the rollout rolls
    v2 back on the guard."""
    client = openai.OpenAI(base_url=f"{traffic.url}/v1", api_key=KEY, max_retries=0, timeout=30)
    longest = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=64,
        extra_headers={"x-splitstream-version": "v1"},
    )  # fmt: skip
    preferred = tmp_path / "preferred-v1.jsonl"
    preferred.write_text(json.dumps(longest.choices[0].message.content) + "\n")
    judges.append(judge := start_judge(tmp_path, "--prefer", str(preferred), "--flip-every", "8"))
    registry = yaml.safe_load(traffic.stack.registry.read_text())["models"]
    arms_before = [{"version": "v1", "weight": 100}, {"version": "v2", "weight": 0}]
    registry[MODEL]["experiment"] = {"salt": "judged-rollout", "control": "v1", "arms": arms_before}
    write_registry(traffic.stack.registry, registry)
    command = [
        sys.executable, "-m", "splitstream.admin", "--registry", f"file:{traffic.stack.registry}", "rollout", MODEL,
        "v2", "--steps", "50", "--interval", "120s", "--check-every", "1s", "--metrics",
        f"127.0.0.1:{traffic.stack.router.metrics_port}", "--redis-url", traffic.stack.redis.url,
        "--max-p99-ratio", "1000", "--min-calls", "5", "--guard-min-units", "20", "--guard", "judge:rate:lift>=-10%",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    rollout = launcher.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:

        def arms() -> dict[str, float]:
            experiment = yaml.safe_load(traffic.stack.registry.read_text())["models"][MODEL]["experiment"]
            return {arm["version"]: arm["weight"] for arm in experiment["arms"]}

        wait_for(lambda: arms() == {"v1": 50, "v2": 50}, timeout_s=30, what="the rollout's step to be written")
        since_ns = time.time_ns()
        served: dict[str, str] = {}
        number = 0
        # New users until 240 calls of the step's split have been answered (the router follows within a second).
        while sum(1 for v in served.values() if v) < 240:
            request_id = f"rollout-judged-{number}"
            raw: Any = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"Question of user {number}"}],
                max_tokens=6 + number % 29, user=f"rollout-user-{number}", extra_headers={"x-request-id": request_id},
            )  # fmt: skip
            version = raw.headers["x-splitstream-version"]
            served[request_id] = version if (version == "v2" or any(served.values())) else ""
            number += 1
        traffic.stack.wait_recorded(set(served))
        window = Traffic(traffic.stack, traffic.http_port, since_ns, time.time_ns(), served, preferred)
        run = run_judge(window, judge, tmp_path / "judged", "--feedback-router", traffic.stack.router.address)
        assert run.code == 0, run.stderr
        assert run.summary["feedback"]["accepted"] == len(served)
        stdout, stderr = rollout.communicate(timeout=150)
    finally:
        if rollout.poll() is None:
            rollout.kill()
            rollout.communicate()
    assert rollout.returncode == 3, stdout + stderr
    checks = [line for line in stdout.splitlines() if line.strip().startswith("check ")]
    assert any("judge lift " in line for line in checks), checks  # the guard read the verdicts
    assert "ROLLED BACK: v2 harms judge lift " in stdout, stdout
    assert "(guard judge:rate:lift>=-10%)" in stdout
    assert arms() == {"v1": 100, "v2": 0}
