"""``splitstream analyze`` beyond one Redis: token streams judged by TTFT and tokens/s, segments by caller, and
the same analysis read from the archive (a directory, a real S3 API server), from the archive below a trimmed
Redis, and from the archive alone once Redis is flushed.

One "lab" experiment (50/50, v2 planted with a higher click rate) written the way the recorder writes it: every
user's first call a token stream (v2 streams twice the tokens in the same time, and starts later), callers
``alice`` and ``bob`` with some users calling as both, and a pre-period for CUPED.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from redis.asyncio import Redis

from demo import language
from splitstream.analysis.analyze import Query, analyze
from splitstream.analysis.loading import Source, Window, fingerprints
from splitstream.analysis.model import Analysis, MetricSpec
from splitstream.analysis.sources import ArchiveSource, StraddlingSource
from splitstream.analysis.usage import parse_prices
from splitstream.common.archive import ArchiveQuery, open_archive, readable_calls
from splitstream.common.headers import DEFAULT_ROUTING_KEY_HEADER
from splitstream.common.records import entry_fields, feedback_key, stream_key
from tests import launcher
from tests.experiments import Call, Event, call_record, phase, write_calls, write_feedback
from tests.harness import ROOT, Stack
from tests.harness import wait_for as wait_until
from tests.recording_stack import MODEL, RecordingStack
from tests.redis_server import RedisServer
from tests.s3_server import S3_ENV, S3Server
from tests.stream_client import run_stream
from tests.streams import generation_request
from tests.test_archive import archived_everything, start_archiver

HOUR_NS = 3_600 * 10**9
T0 = (time.time_ns() // 10**9 - 4 * 3_600) * 10**9
WINDOW = Window(T0, T0 + HOUR_NS, attribution_ns=HOUR_NS)  # the CLI's default attribution window (--max-lateness)
PRE = Window(T0 - 2 * HOUR_NS, T0 - HOUR_NS)
LAB = "lab"
METRICS = (MetricSpec.parse("click:proportion"), MetricSpec.parse("revenue:sum"))
USERS = 1_200
#: Users who call as alice first and as bob later (counted in both segments).
BOTH_CALLERS = 20
#: Token streams: per arm, tokens in STREAM_MS and time to first token.
TOKENS = {"v1": 20, "v2": 40}
TTFT_MS = {"v1": 50.0, "v2": 80.0}
STREAM_MS = 1_000.0
#: Streams that ended before any response (no TTFT, no token).
SILENT_STREAMS = 10


def user_unit(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


@dataclass
class Lab:
    redis: RedisServer
    streams: dict[str, int]
    users: dict[str, int]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    rng = np.random.default_rng(21)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    lab_phase = phase({"v1": 50, "v2": 50}, "v1", salt="lab")
    calls: list[Call] = []
    events: list[Event] = []
    streams = {"v1": 0, "v2": 0}
    users = {"alice": 0, "bob": 0}
    for i in range(USERS):
        arm = "v1" if i % 2 == 0 else "v2"
        unit = user_unit(f"lab-{i}")
        caller = "alice" if i % 3 == 0 else "bob"
        users[caller] += 1
        spend = float(rng.gamma(2.0, 10.0))
        pre_t = int(PRE.since_ns + rng.integers(0, HOUR_NS // 2))
        calls.append(Call(f"pre-{i}", pre_t, arm, unit=unit, principal=caller))
        events.append(Event("revenue", spend, pre_t + 10**9, request_id=f"pre-{i}", idempotency_key=f"rp-{i}"))
        both = i < 3 * BOTH_CALLERS and i % 3 == 0
        count = 1 + int(rng.poisson(1.0))
        times = np.sort(rng.integers(T0, T0 + HOUR_NS - 10 * 10**9, max(count, 2) if both else count))
        for j, t in enumerate(times):
            who = "bob" if both and j > 0 else caller
            stream = j == 0
            silent = stream and i < 2 * SILENT_STREAMS and i % 2 == 1  # v2 only: easy to count
            call = Call(
                f"lab{i}-{j}",
                int(t),
                arm,
                unit=unit,
                principal=who,
                latency_ms=STREAM_MS if stream else 5.0,
                tokens=(0 if silent else TOKENS[arm]) if stream else None,
                ttft_ms=None if silent or not stream else TTFT_MS[arm],
                usage=(8 + i % 5, TOKENS[arm]) if stream and not silent else None,
            )
            streams[arm] += int(stream)
            calls.append(call)
            if rng.random() < (0.10 if arm == "v1" else 0.30):
                events.append(Event("click", 1.0, call.time_ns + 10**9, request_id=call.request_id,
                                    idempotency_key=f"c-{call.request_id}"))  # fmt: skip
        events.append(Event("revenue", spend * float(rng.lognormal(0, 0.2)), int(times[0]) + 2 * 10**9,
                            request_id=f"lab{i}-0", idempotency_key=f"r-{i}"))  # fmt: skip
    client = server.client()
    write_calls(client, LAB, calls, lab_phase)
    write_feedback(client, LAB, events)
    client.close()
    try:
        yield Lab(server, streams, users)
    finally:
        server.stop()


def run(source: Redis | Source | str, query: Query) -> Analysis:
    async def go() -> Analysis:
        if isinstance(source, str):
            redis = Redis.from_url(source)
            try:
                return await analyze(redis, query)
            finally:
                await redis.aclose()
        if isinstance(source, StraddlingSource):
            try:
                return await analyze(source, query)
            finally:
                await source.redis.aclose()
        return await analyze(source, query)

    return asyncio.run(go())


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return launcher.run(
        [sys.executable, "-m", "splitstream.admin", "analyze", *args],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}, **S3_ENV},
        cwd=ROOT, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


def window_flags() -> list[str]:
    return ["--since", str(WINDOW.since_ns // 10**9), "--until", str(WINDOW.until_ns // 10**9)]


#: Prices of the lab's versions: each generation's cost, the same from every source.
PRICES = ("v1=0.15/1M-in,0.60/1M-out", "v2=3/1M-in,12/1M-out")
FULL = Query(
    model=LAB,
    window=WINDOW,
    metrics=(*METRICS, MetricSpec.parse("cost")),
    pre_window=PRE,
    segment="principal",
    prices=parse_prices(PRICES),
)


# -- token streams ---------------------------------------------------------------------------


def test_token_streams_are_calls_with_ttft_and_tokens_per_second_per_arm(lab: Lab) -> None:
    result = run(lab.redis.url, Query(model=LAB, window=WINDOW, metrics=METRICS))
    arms = {arm.arm: arm for arm in result.phases[0].arms}
    for name in ("v1", "v2"):
        arm = arms[name]
        assert arm.streams == lab.streams[name]
        assert arm.ttft_p50_ms == pytest.approx(TTFT_MS[name], rel=0.02)  # the histogram's 2 % buckets
        assert arm.ttft_p99_ms == pytest.approx(TTFT_MS[name], rel=0.02)
        answered = lab.streams[name] - (SILENT_STREAMS if name == "v2" else 0)
        assert arm.tokens == answered * TOKENS[name]
        # Tokens over the streams' seconds (the silent ones took their time too).
        assert arm.tokens_per_s == pytest.approx(arm.tokens / (lab.streams[name] * STREAM_MS / 1e3))
        assert arm.calls > arm.streams  # unary calls are calls, not streams
    assert arms["v2"].tokens_per_s > 1.5 * arms["v1"].tokens_per_s  # type: ignore[operator]


def test_the_cli_shows_stream_figures_and_segments_in_the_table_json_and_html(lab: Lab, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = cli(LAB, "--redis-url", lab.redis.url, *window_flags(), "--metric", "click:proportion",
               "--segment", "principal", "--output-dir", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "TTFT P50 MS" in done.stdout
    assert "TOKENS/S" in done.stdout
    assert "segment principal = alice:" in done.stdout
    assert "segment principal = bob:" in done.stdout
    assert f"{BOTH_CALLERS} units seen under several count in each" in done.stdout
    document = json.loads((out / "analysis.json").read_text())
    arm = document["phases"][0]["arms"][0]
    assert {"streams", "ttft_p50_ms", "ttft_p99_ms", "tokens", "tokens_per_s"} <= set(arm)
    assert document["segment_field"] == "principal"
    assert [s["value"] for s in document["segments"]] == ["alice", "bob"]
    html = (out / "analysis.html").read_text()
    assert "<th>TTFT p50 ms</th>" in html
    assert "<th>tokens/s</th>" in html
    assert "id='segments'" in html
    assert "principal = alice" in html


# -- segments --------------------------------------------------------------------------------


def test_each_principal_gets_its_own_comparison_and_users_of_two_count_in_both(lab: Lab) -> None:
    result = run(lab.redis.url, Query(model=LAB, window=WINDOW, metrics=METRICS, segment="principal"))
    assert result.segment_field == "principal"
    segments = {s.value: s for s in result.segments}
    assert set(segments) == {"alice", "bob"}
    assert result.units_in_several_segments == BOTH_CALLERS
    units = {value: s.phases[0].units for value, s in segments.items()}
    # A user who called as alice and as bob is in both; nobody is lost.
    assert units["alice"] == lab.users["alice"]
    assert units["bob"] == lab.users["bob"] + BOTH_CALLERS
    assert units["alice"] + units["bob"] == result.phases[0].units + BOTH_CALLERS
    calls = sum(s.calls.calls for s in segments.values())
    assert calls == result.calls.calls  # every call in exactly one segment
    for segment in segments.values():
        click = next(c for c in segment.phases[0].comparisons if c.metric == "click")
        assert click.verdict == "better", (segment.value, click.verdict_line)
        arms = {arm.arm: arm for arm in segment.phases[0].arms}
        assert arms["v1"].ttft_p50_ms == pytest.approx(TTFT_MS["v1"], rel=0.02)
    # The whole-experiment comparison is unchanged by segmenting.
    plain = run(lab.redis.url, Query(model=LAB, window=WINDOW, metrics=METRICS))
    assert plain.phases == result.phases


@pytest.mark.slow
def test_an_unknown_segment_field_exits_2_naming_the_choices(lab: Lab) -> None:
    done = cli(LAB, "--redis-url", lab.redis.url, *window_flags(), "--metric", "click:proportion",
               "--segment", "colour")  # fmt: skip
    assert done.returncode == 2
    assert "--segment" in done.stderr
    assert "principal" in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2  # usage line + the error, as argparse prints


# -- the archive -----------------------------------------------------------------------------


def copy_of(lab: Lab, server: RedisServer) -> Any:
    """The lab's streams copied into ``server`` (entry ids kept), for a test that trims or flushes; its client."""
    client = server.client()
    source = lab.redis.client()
    for key in (stream_key(LAB), feedback_key(LAB)):
        entries: Any = source.xrange(key)
        pipe = client.pipeline(transaction=False)
        for entry_id, fields in entries:
            pipe.xadd(key, fields, id=entry_id)
        pipe.execute()
    source.close()
    return client


def archive_lab(tmp_path: Path, server: RedisServer, client: Any, url: str, *extra: str) -> None:
    """Run an archiver over the lab's copy until both its streams (calls, feedback) are in the archive."""
    archiver = start_archiver(tmp_path, server.url, url, *extra)
    try:
        for key in (stream_key(LAB), feedback_key(LAB)):
            wait_until(lambda key=key: archived_everything(client, key), timeout_s=120, what=key)  # type: ignore[misc]
    finally:
        archiver.stop()


def trim_older(client: Any, share: Fraction) -> None:
    """Retention's work by hand: the older ``share`` of both streams trimmed away (the archive still has it)."""
    for key in (stream_key(LAB), feedback_key(LAB)):
        entries: Any = client.xrange(key)
        client.xtrim(key, minid=entries[int(len(entries) * share)][0])


def comparable(analysis: Analysis) -> Any:
    """The analysis without what depends on how entries are paged (entries read, copies met on the way, the
    most calls held at once for the join)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: strip(v) for k, v in value.items() if k not in ("entries_read", "duplicates", "held_for_join_peak")
            }
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(analysis.model_dump())


def assert_same(left: Any, right: Any, where: str = "") -> None:
    if isinstance(left, dict):
        assert isinstance(right, dict), where
        assert left.keys() == right.keys(), where
        for key in left:
            assert_same(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, list | tuple):
        assert isinstance(right, list | tuple), where
        assert len(left) == len(right), where
        for i, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(left, float) and isinstance(right, float):
        assert math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-12), (where, left, right)
    else:
        assert left == right, (where, left, right)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["directory", "s3"])
def test_the_archive_gives_the_same_analysis_as_redis_straddling_and_after_a_flush(
    lab: Lab, tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    endpoint = ""
    if store == "s3":
        s3: S3Server = request.getfixturevalue("s3")  # the session's server, emptied, with its archive bucket
        url, endpoint = "s3://archive/lab", s3.endpoint
    else:
        url = (tmp_path / "archive").as_uri()
    # Its own copy of the lab's Redis: the test trims and flushes it.
    with RedisServer(tmp_path / "redis") as server:
        client = copy_of(lab, server)
        expected = comparable(run(server.url, FULL))
        assert expected["phases"][0]["comparisons"]
        assert all(arm["cost"] and arm["tokens_in"] for arm in expected["phases"][0]["arms"])
        extra = ("--s3-endpoint", endpoint) if endpoint else ()
        archive_lab(tmp_path, server, client, url, *extra)
        archive = open_archive(url, endpoint=endpoint)
        # Stream figures are archived as columns: nothing need parse records.
        columns = readable_calls(archive, ArchiveQuery(model=LAB, since_ns=T0, until_ns=T0 + HOUR_NS))
        assert sum(t is not None for t in columns["tokens"].to_pylist()) == sum(lab.streams.values())
        assert_same(comparable(run(ArchiveSource(archive), FULL)), expected, "archive")
        # Retention took the older part of both streams: the archive serves it, Redis the rest.
        trim_older(client, Fraction(2, 3))
        straddling = StraddlingSource(Redis.from_url(server.url), archive)
        assert_same(comparable(run(straddling, FULL)), expected, "straddling")
        # And from the command line, after Redis has forgotten everything.
        client.flushall()
        client.close()
        out = tmp_path / "out"
        done = cli(LAB, "--source", f"archive:{url}", *extra, *window_flags(), "--metric", "click:proportion",
                   "--metric", "revenue:sum", "--metric", "cost", "--price", PRICES[0], "--price", PRICES[1],
                   "--cuped-pre-since", str(PRE.since_ns // 10**9),
                   "--cuped-pre-until", str(PRE.until_ns // 10**9), "--segment", "principal",
                   "--output-dir", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
        document = json.loads((out / "analysis.json").read_text())
        assert_same(comparable(Analysis.model_validate(document)), expected, "cli")


@pytest.mark.slow
def test_the_cli_reads_a_straddling_window_with_archive_behind_redis(lab: Lab, tmp_path: Path) -> None:
    url = (tmp_path / "archive").as_uri()
    with RedisServer(tmp_path / "redis") as server:
        client = copy_of(lab, server)
        flags = [*window_flags(), "--metric", "click:proportion", "--segment", "principal"]
        before = cli(LAB, "--redis-url", server.url, *flags, "--output-dir", str(tmp_path / "a"))
        assert before.returncode == 0, before.stderr
        archive_lab(tmp_path, server, client, url)
        trim_older(client, Fraction(1, 2))
        client.close()
        trimmed = cli(LAB, "--redis-url", server.url, *flags, "--output-dir", str(tmp_path / "b"))
        both = cli(LAB, "--redis-url", server.url, "--archive", url, *flags, "--output-dir", str(tmp_path / "c"))
    assert both.returncode == 0, both.stderr
    assert trimmed.returncode == 0, trimmed.stderr

    def read(name: str) -> Any:
        return comparable(Analysis.model_validate_json((tmp_path / name / "analysis.json").read_text()))

    assert_same(read("c"), read("a"), "straddling")
    assert read("b")["calls"]["calls"] < read("a")["calls"]["calls"]  # Redis alone has lost half


@pytest.mark.slow
def test_a_window_open_to_the_year_9999_reads_the_archive_as_redis(lab: Lab, tmp_path: Path) -> None:
    # The time flags take any instant up to 9999-12-31; the archive's times end in 2262 (int64 ns), and a
    # window reaching past that was an OverflowError traceback, alone or with the archive behind Redis.
    url = (tmp_path / "archive").as_uri()
    flags = ["--since", str(T0 // 10**9), "--until", "9999-12-31T00:00:00Z", "--metric", "click:proportion"]
    with RedisServer(tmp_path / "redis") as server:
        client = copy_of(lab, server)
        from_redis = cli(LAB, "--redis-url", server.url, *flags, "--output-dir", str(tmp_path / "redis"))
        archive_lab(tmp_path, server, client, url)
        trim_older(client, Fraction(1, 2))
        client.close()
        behind = cli(LAB, "--redis-url", server.url, "--archive", url, *flags, "--output-dir", str(tmp_path / "behind"))
    alone = cli(LAB, "--source", f"archive:{url}", *flags, "--output-dir", str(tmp_path / "alone"))
    for done in (from_redis, behind, alone):
        assert done.returncode == 0, done.stderr

    def read(name: str) -> Any:
        return comparable(Analysis.model_validate_json((tmp_path / name / "analysis.json").read_text()))

    assert read("redis")["calls"]["calls"] > 0
    assert_same(read("alone"), read("redis"), "archive alone")
    assert_same(read("behind"), read("redis"), "archive behind Redis")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--source", "archive:s3:///x"], "names no bucket"),
        (["--source", "archive:"], "empty archive URL"),
        (["--source", "tape:x"], "bad --source"),
        (["--archive", "s3://archive/p?colour=red"], "unknown option 'colour'"),
        (["--source", "archive:/x", "--archive", "/y"], "--archive goes with --source redis"),
    ],
)
def test_bad_archive_flags_exit_2_with_one_line(flags: list[str], message: str) -> None:
    done = cli(LAB, *window_flags(), "--metric", "click:proportion", *flags)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_missing_bucket_or_directory_exits_2_with_one_line(tmp_path: Path, s3: S3Server) -> None:
    (tmp_path / "empty").mkdir()
    cases = [
        (["--source", "archive:s3://missing/p", "--s3-endpoint", s3.endpoint], "bucket 'missing' does not exist"),
        (["--source", f"archive:{tmp_path / 'none'}"], "is not a directory"),
        (["--source", f"archive:{tmp_path / 'empty'}"], "unknown model 'lab': no calls of it in the archive"),
    ]
    for flags, message in cases:
        done = cli(LAB, *window_flags(), "--metric", "click:proportion", *flags)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert message in lines[0]


def test_a_request_id_has_one_fingerprint_whatever_page_it_comes_in() -> None:
    """Feedback names calls by request id; a page of events and a page of calls hold ids of other lengths, and the
    join must not depend on them (it did: pre-period events of the archive joined no call)."""
    alone = fingerprints([b"pre-1005"])[0]
    assert fingerprints([b"pre-1005", b"lab1005-0-with-a-longer-id"])[0] == alone
    assert fingerprints([b"x", b"pre-1005"])[1] == alone
    assert fingerprints([b"pre-1005", b"pre-1006"])[0] != fingerprints([b"pre-1006"])[0]


@pytest.mark.slow
def test_streams_through_a_real_router_and_recorder_are_judged_by_ttft_and_tokens_per_second(tmp_path: Path) -> None:
    """Generating workers (bigram v1, trigram v2) behind a router splitting users 50/50, recorded by the real
    recorder: the entries carry ``ttft_ms`` and ``tokens``, and the analysis reads its stream figures from them."""
    repository = tmp_path / "ngram"
    language.write_versions(repository, MODEL)

    def worker(stack: Stack, version: str) -> Any:
        return stack.worker(repository, MODEL, version)

    arms = [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}]
    experiment = {"salt": "analysis-streams", "control": "v1", "arms": arms}
    stack = RecordingStack(tmp_path, versions={"v1": {}, "v2": {}}, experiment=experiment, worker=worker)
    try:
        since_ns = time.time_ns() - 10**9
        ids = set()
        for user in range(12):
            request_id = f"chat-{user}"
            request = generation_request(MODEL, "Tell me about the sea. ", 16, request_id=request_id)
            result = run_stream(stack.router.address, [request.SerializeToString()],
                                metadata=[(DEFAULT_ROUTING_KEY_HEADER, f"user-{user}")])  # fmt: skip
            assert result.code == grpc.StatusCode.OK, result.details
            ids.add(request_id)
        stack.wait_recorded(ids)
        until_ns = time.time_ns() + 10**9
        client = stack.redis.client()
        entries: Any = client.xrange(stream_key(MODEL))
        client.close()
        expected: dict[str, list[int]] = {}
        for _, fields in entries:
            assert fields[b"tokens"]  # written by the recorder for every stream
            assert float(fields[b"ttft_ms"]) > 0
            expected.setdefault(fields[b"arm"].decode(), []).append(int(fields[b"tokens"]))
        query = Query(model=MODEL, window=Window(since_ns, until_ns), metrics=(MetricSpec.parse("click:proportion"),))
        result = run(stack.redis.url, query)
    finally:
        stack.close()
    by_arm = {arm.arm: arm for arm in result.phases[0].arms}
    assert set(by_arm) == set(expected) == {"v1", "v2"}
    for name, tokens in expected.items():
        arm = by_arm[name]
        assert arm.streams == arm.calls == len(tokens)
        assert arm.tokens == sum(tokens)
        assert arm.ttft_p50_ms is not None
        assert arm.latency_p50_ms is not None
        assert 0 < arm.ttft_p50_ms <= arm.latency_p50_ms * 1.03  # the first token comes before the stream ends
        assert arm.tokens_per_s is not None
        assert arm.tokens_per_s > 0


def test_entries_recorded_before_the_stream_and_principal_fields_read_as_unary_calls_of_no_caller(
    tmp_path: Path,
) -> None:
    old_phase = phase({"v1": 50, "v2": 50}, "v1", salt="old")
    calls = [Call(f"old-{i}", T0 + i * 10**9, "v1" if i % 2 else "v2", unit=user_unit(f"o{i}"), tokens=9,
                  ttft_ms=3.0, principal="alice") for i in range(40)]  # fmt: skip
    with RedisServer(tmp_path / "redis") as server:
        client = server.client()
        for call in calls:
            fields = entry_fields(call_record("old", call, old_phase))
            for newer in ("principal", "ttft_ms", "tokens"):
                del fields[newer]
            client.xadd(stream_key("old"), fields, id=f"{call.time_ns // 1_000_000}-*")  # type: ignore[arg-type]
        client.close()
        result = run(server.url, Query(model="old", window=WINDOW, metrics=METRICS, segment="principal"))
    assert result.calls.calls == 40
    assert result.calls.corrupt == 0
    assert sum(arm.streams for arm in result.phases[0].arms) == 0
    assert [s.value for s in result.segments] == [""]
    assert result.segments[0].calls.calls == 40
