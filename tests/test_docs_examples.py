"""Every page's worked example runs, as written, against real processes (tests/doc_examples.py says how a
block is found and run, and what a test may change in it: addresses, paths, and nothing a reader relies on).

A page whose example cannot run here is in :data:`NOT_RUN` with the reason; a page in neither place fails
:func:`test_every_page_has_its_example_run_or_says_why_not`, so a new page cannot skip its example silently.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis as redis_lib
import yaml

from splitstream.common.headers import VERSION_HEADER
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import entry_fields, routing_key_hmac, stream_key
from splitstream.common.timewindow import format_instant
from tests.doc_examples import Background, Rewrite, block, documents, marked_blocks, page_name, run_block
from tests.experiments import Call, Event, call_record, phase, write_calls, write_feedback
from tests.harness import InferClient, Stack, free_port, listen_args, make_request, wait_for, write_registry
from tests.models import add_version
from tests.redis_server import RedisServer
from tests.s3_server import S3_ENV, S3Server

#: The marked examples this file runs, page by page.
RUN: dict[str, set[str]] = {
    "rollouts.md": {"serve", "ramp"},
    "recording.md": {"serve", "read"},
    # noise-floor: run by tests/test_replay_noise.py, against the noisy model it builds; noise-floor-streams by
    # tests/test_replay_noise_streams.py, against the sampling language models it builds.
    "replay.md": {"incident", "ci", "compare", "noise-floor", "noise-floor-streams"},
    "analysis.md": {"analyze", "archive"},
    # sql: run by tests/test_archive.py (test_the_docs_duckdb_query_counts_each_call_and_click_once_per_version).
    "archive.md": {"archive", "replay", "sql"},
}

#: Pages whose worked example is not run here, and why.
NOT_RUN: dict[str, str] = {
    "README.md": "its commands are `make demo` and `make test`: tests/test_demo.py runs the demo's story",
    "development.md": "its commands (make install, make test, make lint) are the test run itself",
    "architecture.md": "its worked example is one call's path in prose, which the end-to-end tests follow",
    "benchmarks.md": "`make bench` measures for minutes; the benchmark scripts are not tests",
    "configuration.md": "generated from the parsers; tests/test_docs.py checks it against them",
    "upgrading.md": "upgrade notes, no worked example",
    "scaling.md": "needs a three-master Redis Cluster at fixed addresses and one router per core; "
    "tests/test_redis_cluster.py and tests/test_processes.py run the same flags on a local cluster",
    "security.md": "its commands elide their usual flags (`...`); tests/test_tls.py runs these TLS flags and the "
    "cluster tests apply the page's ACL lines",
    "bandits.md": "its example moves weights on feedback over minutes; tests/test_bandit.py runs the same command "
    "on real processes with one-second intervals",
    "streams.md": "its worked example is `make demo-llm`, which tests/test_demo.py runs",
    # Run by another test file, not yet through this file's markers:
    "http.md": "its Python example is run by tests/test_router_http.py (test_the_worked_example_of_the_docs_runs)",
    "tensorrt.md": "needs an NVIDIA GPU; tests/test_tensorrt_worker.py runs the builder and worker on the fake GPU",
}


def test_every_page_has_its_example_run_or_says_why_not() -> None:
    pages = {page_name(path) for path in documents()}
    assert set(RUN) & set(NOT_RUN) == set()
    assert pages - set(RUN) - set(NOT_RUN) == set(), "a page with no run example and no reason in NOT_RUN"
    assert (set(RUN) | set(NOT_RUN)) - pages == set(), "RUN or NOT_RUN names a page that is gone"


def test_every_marked_example_is_run_and_every_run_example_is_marked() -> None:
    marked = {page_name(path): set(marked_blocks(path)) for path in documents()}
    assert {page: names for page, names in marked.items() if names} == RUN


# -- shared processes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


def serving(address: str) -> bool:
    from tests.harness import health_status

    return health_status(address) == 1


def wait_serving(background: Background, address: str, timeout_s: float = 60) -> None:
    def up() -> bool:
        background.check_running()
        return serving(address)

    try:
        wait_for(up, timeout_s=timeout_s, what=f"{address} to serve ({background.block.page} {background.block.name})")
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{background.log()}") from None


class DigitsLoad:
    """Calls to the demo's digit classifier from a few threads, each with its own routing key, until stopped."""

    def __init__(self, address: str, threads: int = 2, pause_s: float = 0.01) -> None:
        self.address = address
        self.pause_s = pause_s
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> DigitsLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _run(self) -> None:
        client = InferClient(self.address)
        x = np.zeros((1, 64), dtype=np.float32)
        try:
            while not self._stop.is_set():
                try:
                    client.infer(make_request("digits", x), metadata=[("x-routing-key", uuid.uuid4().hex)])
                    with self._lock:
                        self.ok += 1
                except grpc.RpcError as error:
                    with self._lock:
                        self.errors.append(f"{error.code().name}: {error.details()}")
                self._stop.wait(self.pause_s)
        finally:
            client.close()


@dataclass
class Digits:
    """The rollouts page's deployment, started by its own block: two workers and a router."""

    cwd: Path
    router: str
    metrics: str
    workers: dict[str, str]


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Digits]:
    cwd = tmp_path_factory.mktemp("rollouts")
    ports = {page: str(free_port()) for page in ("9001", "9002", "9101", "9102")}
    router, metrics = free_port(), free_port()
    rewrite = Rewrite(
        {
            **{f"--port {p}": f"--port {ports[p]}" for p in ("9001", "9002")},
            **{f"--metrics-port {p}": f"--metrics-port {ports[p]}" for p in ("9101", "9102")},
            **{f'"127.0.0.1:{p}"': f'"127.0.0.1:{ports[p]}"' for p in ("9001", "9002")},
        }
    )
    # The router of the page is on its default ports (8001, 8002): moved by the flags' variables.
    env = {"SPLITSTREAM_ROUTER_PORT": str(router), "SPLITSTREAM_ROUTER_METRICS_PORT": str(metrics)}
    background = Background(block("rollouts.md", "serve"), cwd, rewrite=rewrite, env=env)
    try:
        for port in ("9001", "9002"):
            wait_serving(background, f"127.0.0.1:{ports[port]}")
        wait_serving(background, f"127.0.0.1:{router}")
        # The router serves before its health watch has seen both workers (it started alongside them): wait
        # until each version answers through it, so the load the tests put on it meets a ready deployment.
        for version in ("v1", "v2"):
            wait_for(
                lambda version=version: _answers(f"127.0.0.1:{router}", version),
                timeout_s=30,
                what=f"{version} answering through the router",
            )
        yield Digits(
            cwd,
            f"127.0.0.1:{router}",
            f"127.0.0.1:{metrics}",
            {v: f"127.0.0.1:{ports[p]}" for v, p in [("v1", "9001"), ("v2", "9002")]},
        )
    finally:
        background.stop()


def _answers(router: str, version: str) -> bool:
    client = InferClient(router)
    try:
        client.infer(make_request("digits", np.zeros((1, 64), dtype=np.float32)), metadata=[(VERSION_HEADER, version)])
        return True
    except grpc.RpcError:
        return False
    finally:
        client.close()


def arm_weights(registry: Path) -> dict[str, float]:
    experiment = yaml.safe_load(registry.read_text())["models"]["digits"]["experiment"]
    return {arm["version"]: arm["weight"] for arm in experiment["arms"]}


# -- rollouts.md --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rollouts_ramps_v2_to_100_percent_while_traffic_flows(digits: Digits) -> None:
    assert arm_weights(digits.cwd / "registry.yaml") == {"v1": 90, "v2": 10}
    # A minute a step on the page; 5 s here, enough for --min-calls (20) of v2's calls at 10 %. The p99 of
    # those few dozen calls is their slowest one, and one scheduling stall on a loaded 2-core machine sets it:
    # 1.6-2.0x the control's for the same model at load 6, 4.9x at load 17. The bound is out of a stall's reach
    # here; the guard tripping is tested in test_rollout_faults.
    rewrite = Rewrite(
        {
            "127.0.0.1:8002": digits.metrics,
            "--interval 60s": "--interval 5s",
            "--max-p99-ratio 1.5": "--max-p99-ratio 20",
        }
    )
    with DigitsLoad(digits.router) as load:
        wait_for(lambda: load.ok >= 20, timeout_s=30, what="calls through the router")
        result = run_block(block("rollouts.md", "ramp"), digits.cwd, rewrite=rewrite, timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "promoted: digits" in result.stdout, result.stdout
    assert load.errors == [], (digits.cwd / "example-serve.log").read_text()[-5000:]
    registry = digits.cwd / "registry.yaml"
    assert arm_weights(registry) == {"v2": 100}


# -- recording.md -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_recording_records_every_call_and_redis_cli_reads_the_last_five_back(
    digits: Digits, redis: RedisServer
) -> None:
    recorder, router = free_port(), free_port()
    rewrite = Rewrite(
        {
            "redis://127.0.0.1:6379/0": redis.url,
            "--port 8003 --metrics-port 8004": f"--port {recorder} --metrics-port {free_port()}",
            "--recorder 127.0.0.1:8003": f"--recorder 127.0.0.1:{recorder}",
            "/var/lib/splitstream/spool": "spool",
        }
    )
    env = {"SPLITSTREAM_ROUTER_PORT": str(router), "SPLITSTREAM_ROUTER_METRICS_PORT": str(free_port())}
    background = Background(block("recording.md", "serve"), digits.cwd, rewrite=rewrite, env=env)
    try:
        wait_serving(background, f"127.0.0.1:{router}")
        client = InferClient(f"127.0.0.1:{router}")
        ids = [f"doc-recording-{i}" for i in range(7)]
        for request_id in ids:
            client.infer(make_request("digits", np.zeros((1, 64), dtype=np.float32), request_id=request_id))
        client.close()
        read = block("recording.md", "read")
        reading = Rewrite({"redis://127.0.0.1:6379/0": redis.url})

        def newest_read() -> str | None:
            result = run_block(read, digits.cwd, rewrite=reading)
            assert result.returncode == 0, result.stderr
            return result.stdout if ids[-1] in result.stdout else None

        output = wait_for(newest_read, timeout_s=30, what="the last call in Redis")
    finally:
        background.stop()
    assert (digits.cwd / "spool").is_dir()  # the log directory the page names
    lines = output.splitlines()
    shown = [line for line in lines if line.startswith("doc-recording-")]
    assert shown == ids[:1:-1], output  # the last five, newest first
    assert {"version", "latency_ms", "record"} <= set(lines)  # the readable fields, then the record


# -- resnet: the model of replay.md, analysis.md and archive.md ----------------------------------------

HMAC_KEY = "docs-examples-key"
DAY_S = 86_400
#: The fixed dates of the pages, as they stand there: replay.md's incident window, analysis.md's experiment
#: start two minutes before it, and archive.md's window of last month.
PAGE_INCIDENT = ("2026-11-29T14:02:00Z", "2026-11-29T14:05:00Z")
PAGE_EXPERIMENT_START = "2026-11-29T14:00:00Z"
PAGE_LAST_MONTH = ("2026-10-01T00:00Z", "2026-10-01T06:00Z")
#: How far before the test's start each lands: the incident out of the replays' and analyses' last day (-1d)
#: and of the day before it (-2d .. -1d); last month within analysis.md's archive lines (-30d); the users' calls
#: of the week before, which analysis.md's CUPED line reads as its pre-period (-8d .. -1d), inside it.
INCIDENT_DAYS_BEFORE = 2
LAST_MONTH_DAYS_BEFORE = 20
LAST_WEEK_DAYS_BEFORE = 4


def _epoch_s(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp())


def _moved(text: str, days: int) -> str:
    """A page's instant ``days`` later (earlier when negative), written as the page writes it."""
    moment = datetime.fromisoformat(text).astimezone(UTC) + timedelta(days=days)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ" if text.count(":") == 2 else "%Y-%m-%dT%H:%MZ")


def _days_to(text: str, now_s: float, days_before: int) -> int:
    """The whole days that move the page's ``text`` to between ``days_before`` and ``days_before + 1`` days
    before ``now_s`` (negative: back)."""
    return math.floor((now_s - days_before * DAY_S - _epoch_s(text)) / DAY_S)


@dataclass(frozen=True, slots=True)
class PastDates:
    """Where the test writes the pages' past calls, computed from its start: the pages' fixed dates moved by
    whole days, and the moved dates that replace them in the blocks that hold them.

    The pages mix fixed dates (an incident on 2026-11-29) with times relative to now (``--since -1d``,
    ``--cuped-pre-since -8d``, ``--since -30d``), so calls written at the fixed dates would leave a relative
    window, or enter one, as the calendar moves: last month's calls (2026-10-01) left ``--since -30d`` at the
    end of October, and the CUPED pre-period (``-8d .. -1d``) held the incident for a week, then nothing.
    Moved by whole days, a window keeps its time of day (``incident-1402``) and its distance to the page's
    other dates, and every line reads the same calls on any day.
    """

    incident_days: int
    last_month_days: int
    now_s: float

    @classmethod
    def before(cls, now_s: float) -> PastDates:
        return cls(
            _days_to(PAGE_INCIDENT[0], now_s, INCIDENT_DAYS_BEFORE),
            _days_to(PAGE_LAST_MONTH[0], now_s, LAST_MONTH_DAYS_BEFORE),
            now_s,
        )

    @property
    def incident(self) -> tuple[int, int]:
        """replay.md's incident window, in unix seconds."""
        return (
            _epoch_s(PAGE_INCIDENT[0]) + self.incident_days * DAY_S,
            _epoch_s(PAGE_INCIDENT[1]) + self.incident_days * DAY_S,
        )

    @property
    def last_month(self) -> tuple[int, int]:
        """archive.md's window of last month, in unix seconds."""
        return (
            _epoch_s(PAGE_LAST_MONTH[0]) + self.last_month_days * DAY_S,
            _epoch_s(PAGE_LAST_MONTH[1]) + self.last_month_days * DAY_S,
        )

    @property
    def last_week(self) -> tuple[int, int]:
        """The hour of the live users' calls of the week before, which analysis.md's CUPED line reads as its
        pre-period (no page names it)."""
        start = int(self.now_s) - LAST_WEEK_DAYS_BEFORE * DAY_S
        return (start, start + 3_600)

    def moved(self, *texts: str) -> dict[str, str]:
        """The replacements of the pages' fixed dates ``texts`` (for a :class:`Rewrite`, which fails when the
        block no longer holds one)."""
        days = {text: self.incident_days for text in (*PAGE_INCIDENT, PAGE_EXPERIMENT_START)}
        days |= {text: self.last_month_days for text in PAGE_LAST_MONTH}
        return {text: _moved(text, days[text]) for text in texts}


@pytest.mark.parametrize(
    "now",
    [
        "2026-01-01T00:00:00Z",  # before the pages' dates: they move forward
        "2026-12-07T15:00:00Z",
        "2027-12-07T15:00:00Z",  # a year on
        "2028-02-29T23:59:59Z",
        "2040-06-30T14:03:00Z",  # a minute past the incident's time of day, 14 years on
    ],
)
def test_the_pages_past_dates_land_where_their_relative_lines_read_them_on_any_day(now: str) -> None:
    """The calls at the moved dates fall in the same relative windows whatever the day: the incident out of
    the last two days, the users' week before inside the CUPED pre-period, last month inside -30d; and the
    text that replaces a page's date names the instant the calls are written at."""
    now_s = _epoch_s(now)
    dates = PastDates.before(now_s)
    incident, last_month, last_week = dates.incident, dates.last_month, dates.last_week
    assert now_s - 3 * DAY_S < incident[0] <= now_s - 2 * DAY_S
    assert incident[1] - incident[0] == 180
    assert datetime.fromtimestamp(incident[0], UTC).strftime("%H:%M:%S") == "14:02:00"  # incident-1402
    assert now_s - 8 * DAY_S <= last_week[0] < last_week[1] < now_s - DAY_S
    assert now_s - 30 * DAY_S < last_month[0] < last_month[1] < now_s - 8 * DAY_S
    assert last_month[1] - last_month[0] == 6 * 3_600
    moved = dates.moved(*PAGE_INCIDENT, PAGE_EXPERIMENT_START, *PAGE_LAST_MONTH)
    assert [_epoch_s(moved[text]) for text in PAGE_INCIDENT] == list(incident)
    assert _epoch_s(moved[PAGE_EXPERIMENT_START]) == incident[0] - 120
    assert [_epoch_s(moved[text]) for text in PAGE_LAST_MONTH] == list(last_month)
    assert [len(moved[text]) for text in moved] == [len(text) for text in moved]  # written as the page writes it


@dataclass
class Resnet:
    cwd: Path
    router: str
    workers: dict[str, str]
    dates: PastDates
    live: list[str]
    incident: list[str]
    last_month: list[str]
    #: The live users' calls of the week before (request ids, in the order of the live calls' users).
    last_week: list[str]


def past_calls(prefix: str, window: tuple[int, int], n: int) -> list[Call]:
    """``n`` calls of v1 in the window, 30 s after its start and 0.1 s apart (a replay at the recorded pace
    takes 1.2 s, not the window's minutes)."""
    start_ns = (window[0] + 30) * 1_000_000_000
    return [Call(f"{prefix}-{i}", start_ns + i * 100_000_000, "v1", unit=f"unit-{i}") for i in range(n)]


def last_week_calls(window: tuple[int, int], users: list[str]) -> list[Call]:
    """A call of each user in the window, a minute apart, as the router records them (the routing key's HMAC):
    the units the CUPED line finds in its pre-period."""
    start_ns = window[0] * 1_000_000_000
    key = HMAC_KEY.encode()
    return [
        Call(f"last-week-{i}", start_ns + i * 60 * 10**9, "v1", unit=routing_key_hmac(key, user))
        for i, user in enumerate(users)
    ]


def write_past(client: redis_lib.Redis, calls: list[Call], request: bytes, response: bytes) -> None:
    """The calls' entries as the recorder writes them, at their time (tests/experiments.py), each with the
    request and the answer of a real call."""
    call_phase = phase({"v1": 50, "v2": 50}, "v1", salt="resnet-docs")
    for call in sorted(calls, key=lambda call: call.time_ns):  # a stream's ids only grow
        record = call_record("resnet", call, call_phase, request)
        record.response.CopyFrom(recorder_pb2.Payload(inline=response, size_bytes=len(response)))
        client.xadd(stream_key("resnet"), entry_fields(record), id=f"{call.time_ns // 1_000_000}-*")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def resnet(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Resnet]:
    """Model resnet, v1 and v2 (the same y = 2x, so a replay of one against the other matches), behind a
    router recording to the shared Redis; 40 live calls, one of each of 40 users, the same users' calls of the
    week before, and the past windows the pages replay, at dates computed from now (:class:`PastDates`)."""
    dates = PastDates.before(time.time())
    tmp = tmp_path_factory.mktemp("resnet")
    for version in ("v1", "v2"):
        add_version(tmp / "models", "resnet", version, scale=2.0)
    stack = Stack(tmp)
    try:
        workers = {v: stack.worker(tmp / "models", "resnet", v).address for v in ("v1", "v2")}
        recorder_port = free_port()
        stack.service(
            "recorder",
            "splitstream.recorder",
            [*listen_args(recorder_port), "--redis-url", redis.url, "--hmac-key", HMAC_KEY],
            port=recorder_port,
        )
        experiment = {
            "salt": "resnet-docs",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        }
        registry = tmp / "registry.yaml"
        write_registry(
            registry, {"resnet": {"endpoints": {v: [a] for v, a in workers.items()}, "experiment": experiment}}
        )
        router = stack.router(
            registry, "--recorder", f"127.0.0.1:{recorder_port}", "--hmac-key", HMAC_KEY, "--log-dir", str(tmp / "log")
        )
        x = np.ones((1, 4), dtype=np.float32)
        worker = InferClient(workers["v1"])
        answer, _ = worker.infer(make_request("resnet", x))
        worker.close()
        users = [f"user-{i}" for i in range(40)]
        incident = past_calls("incident", dates.incident, 12)
        last_month = past_calls("last-month", dates.last_month, 10)
        last_week = last_week_calls(dates.last_week, users)
        past = [*last_month, *last_week, *incident]
        writer = redis.client()
        write_past(writer, past, make_request("resnet", x).SerializeToString(), answer.SerializeToString())
        client = InferClient(router.address)
        live = [f"live-{i}" for i in range(len(users))]
        for request_id, user in zip(live, users, strict=True):
            client.infer(make_request("resnet", x, request_id=request_id), metadata=[("x-routing-key", user)])
        client.close()
        wait_for(
            lambda: writer.xlen("splitstream:calls:resnet") >= len(live) + len(past),
            timeout_s=30,
            what="the live calls in Redis",
        )
        writer.close()
        yield Resnet(
            tmp,
            router.address,
            workers,
            dates,
            live,
            [c.request_id for c in incident],
            [c.request_id for c in last_month],
            [c.request_id for c in last_week],
        )
    finally:
        stack.close()


def replay_env(redis: RedisServer) -> dict[str, str]:
    """What the lines that name no --redis-url read, and the deployment's key."""
    return {"SPLITSTREAM_REPLAY_REDIS_URL": redis.url, "SPLITSTREAM_HMAC_KEY": HMAC_KEY}


def summary(directory: Path) -> dict:
    return json.loads((directory / "summary.json").read_text())


# -- replay.md ----------------------------------------------------------------------------------------


def replay_rewrite(resnet: Resnet, redis: RedisServer) -> Rewrite:
    return Rewrite(
        {
            "redis://127.0.0.1:6379/0": redis.url,
            "localhost:8001": resnet.router,
            "candidate:9002": resnet.workers["v2"],
            "new-worker:9002": resnet.workers["v2"],
            "old-worker:9001": resnet.workers["v1"],
        }
    )


def run_replay_example(
    name: str, resnet: Resnet, redis: RedisServer, dates: Mapping[str, str] = {}
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run the page's block ``name`` with the addresses it holds moved, and ``dates`` (:meth:`PastDates.moved`)."""
    example = block("replay.md", name)
    addresses = {k: v for k, v in replay_rewrite(resnet, redis).replacements.items() if k in example.text}
    rewrite = Rewrite({**addresses, **dates})
    cwd = resnet.cwd / f"replay-{name}"
    return run_block(example, cwd, rewrite=rewrite, env=replay_env(redis), timeout_s=180), cwd


@pytest.mark.slow
def test_replay_resends_the_incident_window_to_v2_through_the_router(resnet: Resnet, redis: RedisServer) -> None:
    result, cwd = run_replay_example("incident", resnet, redis, resnet.dates.moved(*PAGE_INCIDENT))
    assert result.returncode == 0, result.stdout + result.stderr
    out = cwd / "incident-1402"
    for name in ("results.jsonl", "summary.json", "report.html"):
        assert (out / name).is_file(), name
    replayed = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["request_id"] for r in replayed) == sorted(resnet.incident)
    assert {r["replayed"]["version"] for r in replayed} == {"v2"}, replayed[0]
    assert {r["outcome"] for r in replayed} == {"match"}, replayed[0]


@pytest.mark.slow
def test_replay_gates_the_candidate_on_yesterdays_traffic(resnet: Resnet, redis: RedisServer) -> None:
    """The candidate answers as recorded (same model), so no drift; its p99 against the recorded one is what a
    shared machine makes it, so the test holds the gate to its own summary: exit 1 exactly when a bound
    fails, and the bound named."""
    result, cwd = run_replay_example("ci", resnet, redis)
    report = summary(cwd / "replay-out")
    assert report["metrics"]["mismatch_rate"] == 0, report["metrics"]
    assert report["metrics"]["error_rate"] == 0, report["metrics"]
    replayed = {
        json.loads(line)["request_id"] for line in (cwd / "replay-out" / "results.jsonl").read_text().splitlines()
    }
    assert set(resnet.live) <= replayed  # yesterday's calls (and the incident's replays the router recorded)
    assert replayed.isdisjoint(resnet.incident + resnet.last_week + resnet.last_month)  # none of earlier days
    if report["gate"]["passed"]:
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        assert result.returncode == 1, result.stdout + result.stderr
        assert [line.split("=")[0] for line in report["gate"]["failures"]] == ["p99_ratio"], report["gate"]
        assert "gate failed: p99_ratio=" in result.stderr


@pytest.mark.slow
def test_replay_compares_two_targets_on_the_failed_calls(resnet: Resnet, redis: RedisServer) -> None:
    result, cwd = run_replay_example("compare", resnet, redis)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replayed 0 of 0 selected calls" in result.stdout  # no call failed in the last 15 minutes
    assert (cwd / "replay-out" / "summary.json").is_file()


# -- analysis.md --------------------------------------------------------------------------------------


def last_week_revenue(i: int) -> float:
    """What user ``i`` spent on its call of the week before: about what it spends now (``i % 7``), so the CUPED
    line's covariate explains most of a user's revenue."""
    return float(i % 7) + 0.5 * ((5 * i) % 3 - 1)


def write_outcomes(redis: RedisServer, resnet: Resnet) -> None:
    """What the page's metrics read: a click, a satisfaction score, revenue and a wait for each live call
    (as the recorder writes reported events), each user's revenue of the week before (a second after its call
    then), and an LLM's generations with their tokens and TTFT."""
    now_ns = time.time_ns()
    events = []
    for i, request_id in enumerate(resnet.live):
        events += [
            Event("click", float(i % 3 != 0), now_ns, request_id=request_id),
            Event("satisfaction", float(1 + i % 5), now_ns, request_id=request_id),
            Event("revenue", float(i % 7), now_ns, request_id=request_id),
            Event("wait_s", 1.0 + (i % 4) / 10, now_ns, request_id=request_id),
        ]
    last_week_ns = resnet.dates.last_week[0] * 10**9
    for i, request_id in enumerate(resnet.last_week):
        events.append(
            Event("revenue", last_week_revenue(i), last_week_ns + i * 60 * 10**9 + 10**9, request_id=request_id)
        )
    client = redis.client()
    write_feedback(client, "resnet", events)
    llm_calls = [
        Call(
            f"llm-{i}",
            now_ns - 600_000_000_000 + i * 1_000_000,
            ("v1", "v2")[i % 2],
            unit=f"chat-{i}",
            tokens=24,
            ttft_ms=10.0 + i % 5,
            usage=(30, 24),
        )
        for i in range(40)
    ]
    write_calls(client, "llm", llm_calls, phase({"v1": 50, "v2": 50}, "v1", salt="llm"))
    client.close()


@pytest.mark.slow
def test_analysis_compares_the_arms_on_each_pages_metric(resnet: Resnet, redis: RedisServer) -> None:
    """Every line runs; the CUPED line's pre-period (the week before, relative) holds each user's revenue of
    then, so its interval is narrowed by the covariate, whatever the day the test runs."""
    write_outcomes(redis, resnet)
    cwd = resnet.cwd / "analysis"
    rewrite = Rewrite({"redis://127.0.0.1:6379/0": redis.url, **resnet.dates.moved(PAGE_EXPERIMENT_START)})
    result = run_block(
        block("analysis.md", "analyze"), cwd, rewrite=rewrite, env={"SPLITSTREAM_ADMIN_REDIS_URL": redis.url}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for metric in ("click", "satisfaction", "revenue", "wait_s", "tokens_out", "ttft_ms", "cost"):
        assert f"v2 vs v1: {metric} " in out, (metric, out)
    analysis = json.loads((cwd / "ab-resnet" / "analysis.json").read_text())
    assert analysis["model"] == "resnet"
    assert (cwd / "ab-resnet" / "analysis.html").is_file()
    cuped = json.loads((cwd / "ab-cuped" / "analysis.json").read_text())
    [revenue] = [c for p in cuped["phases"] for c in p["comparisons"] if c["metric"] == "revenue"]
    assert (revenue["cuped_theta"] or 0) > 0.5, revenue  # None: no pre-period value, the plain comparison
    width = revenue["absolute_ci"]["high"] - revenue["absolute_ci"]["low"]
    unadjusted = revenue["unadjusted_ci"]["high"] - revenue["unadjusted_ci"]["low"]
    assert width < 0.5 * unadjusted, revenue


# -- archive.md (and analysis.md's lines that read the archive) ----------------------------------------


@pytest.mark.slow
def test_archive_copies_the_calls_to_s3_and_last_month_is_replayed_and_analysed_from_it(
    resnet: Resnet, redis: RedisServer, tmp_path: Path
) -> None:
    """The page's MinIO is moto's S3 server here, its bucket made first as an operator would. Last month's calls
    are 20 days old whatever the day (:class:`PastDates`), so the replay's window (moved with them) and the
    analysis's ``--since -30d`` both hold them."""
    s3 = S3Server(tmp_path / "s3").start()
    try:
        s3.create_bucket("recordings")
        cwd = resnet.cwd / "archive"
        store = {"http://minio:9000": s3.endpoint, "redis://127.0.0.1:6379/0": redis.url}
        # The page's archiver writes a file once its oldest entry waited --flush-interval-s (30 s); a second here
        # (through its environment, like the ports, so the page's command runs as written), or the test waits 30 s.
        env = {
            **S3_ENV,
            "SPLITSTREAM_ARCHIVE_PORT": str(free_port()),
            "SPLITSTREAM_ARCHIVE_METRICS_PORT": "0",
            "SPLITSTREAM_ARCHIVE_FLUSH_INTERVAL_S": "1",
        }
        archiver = Background(block("archive.md", "archive"), cwd, rewrite=Rewrite(store), env=env)
        try:
            mark_key = f"splitstream:archived:{{{stream_key('resnet')}}}"
            last_month_ms = (resnet.dates.last_month[0] + 30) * 1000 + 100 * len(resnet.last_month)
            client = redis.client()

            def archived() -> bool:
                archiver.check_running()
                mark = client.get(mark_key)
                return (
                    mark is not None
                    and int(str(mark if isinstance(mark, str) else mark.decode()).split("-")[0]) > last_month_ms
                )

            wait_for(archived, timeout_s=60, what="last month's calls archived")
            client.close()
        finally:
            archiver.stop()
        replay = run_block(
            block("archive.md", "replay"),
            cwd,
            rewrite=Rewrite(
                {
                    "http://minio:9000": s3.endpoint,
                    "localhost:8001": resnet.router,
                    **resnet.dates.moved(*PAGE_LAST_MONTH),
                }
            ),
            env={**S3_ENV, **replay_env(redis)},
        )
        assert replay.returncode == 0, replay.stdout + replay.stderr
        replayed = [json.loads(line) for line in (cwd / "replay-out" / "results.jsonl").read_text().splitlines()]
        assert sorted(r["request_id"] for r in replayed) == sorted(resnet.last_month)
        assert {r["replayed"]["version"] for r in replayed} == {"v2"}
        analysis = run_block(
            block("analysis.md", "archive"),
            cwd,
            rewrite=Rewrite({"http://minio:9000": s3.endpoint}),
            env={**S3_ENV, "SPLITSTREAM_ADMIN_REDIS_URL": redis.url},
        )
        assert analysis.returncode == 0, analysis.stdout + analysis.stderr
        # Both runs (the archive alone; the archive below Redis) reach back to last month (-30d): the phase of its
        # calls starts at the first of them.
        first_last_month = format_instant((resnet.dates.last_month[0] + 30) * 10**9)
        assert analysis.stdout.count(f"from {first_last_month}") == 2, analysis.stdout
    finally:
        s3.stop()
