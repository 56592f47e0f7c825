"""The analysis's SQL path: DuckDB over the archive gives the analysis the page reader gives on the same archive
(and on Redis), field by field, for data of every shape the reader handles; ``--print-sql`` prints the query for
other engines and ``--aggregates`` runs the statistics on what such a query produced.

The data are written to a real Redis as the recorder writes them, then archived by the real archiver."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import sqlglot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from splitstream.analysis.analyze import Query, analyze
from splitstream.analysis.loading import Source, Window
from splitstream.analysis.model import Analysis, MetricSpec
from splitstream.analysis.sources import AggregatesSource, ArchiveSource, RedisSource
from splitstream.analysis.usage import parse_prices
from splitstream.common.archive import (
    CALL_SCHEMA,
    CALLS,
    FEEDBACK,
    FEEDBACK_SCHEMA,
    Archive,
    open_archive,
    partition_dir,
    window_files,
    write_file,
)
from splitstream.common.records import feedback_key, stream_key
from tests.experiments import Call, Event, analyze_cli, call_record, phase, write_arrivals
from tests.harness import wait_for
from tests.redis_server import RedisServer
from tests.test_analysis_sources import assert_same
from tests.test_archive import archived_everything, start_archiver

MODEL = "sqlab"
HOUR_NS = 3_600 * 10**9
MINUTE_NS = 60 * 10**9
T0 = (time.time_ns() // 10**9 - 5 * 3_600) * 10**9
#: The window, with half an hour of attribution after it.
WINDOW = Window(T0, T0 + HOUR_NS, attribution_ns=HOUR_NS // 2)
PRE = Window(T0 - HOUR_NS, T0)
PRICES = ("v1=0.15/1M-in,0.60/1M-out", "v2=3/1M-in,12/1M-out")
FIRST = phase({"v1": 50, "v2": 50}, "v1", salt="sql-a")
SECOND = phase({"v1": 20, "v2": 80}, "v1", salt="sql-b")


def user(i: int) -> str:
    return hashlib.sha256(f"sql-{i}".encode()).hexdigest()


@dataclass
class Lab:
    redis: RedisServer
    archive: Archive


def _traffic(
    rng: np.random.Generator,
) -> tuple[list[tuple[int, Call]], list[tuple[int, Call]], list[tuple[int, Event]]]:
    """Calls of the first and second phase (each with its arrival at Redis), and events: every shape the reader
    handles, each a few times."""
    first: list[tuple[int, Call]] = []
    second: list[tuple[int, Call]] = []
    events: list[tuple[int, Event]] = []
    half = T0 + HOUR_NS // 2
    for i in range(300):
        arm = "v1" if i % 2 == 0 else "v2"
        unit = user(i)
        # The pre-period (CUPED): a call and an outcome per unit, routed however.
        pre_t = int(PRE.since_ns + rng.integers(0, HOUR_NS - MINUTE_NS))
        first.append((pre_t, Call(f"pre-{i}", pre_t, arm, unit=unit, assignment="pin" if i % 7 == 0 else "hash")))
        events.append((pre_t + 10**9, Event("revenue", float(rng.gamma(2, 5)), pre_t + 10**9, request_id=f"pre-{i}")))
        for j in range(1 + int(rng.poisson(1.5))):
            in_second = i % 5 == 0 and j > 0
            start = half if in_second else T0
            t = int(start + rng.integers(0, HOUR_NS // 2 - 2 * MINUTE_NS))
            keyed = i % 11 != 0  # some calls carry no routing key: each is its own unit
            assignment = "hash" if keyed else "random"
            if i % 13 == 0 and j == 0:
                assignment = ["pin", "spill", "retry", "unspecified"][i % 4]
            stream = i % 4 == 0
            crossed = i % 37 == 0 and j == 1 and not in_second  # a unit seen in both arms of a phase
            call = Call(
                f"c{i}-{j}",
                t,
                ("v2" if arm == "v1" else "v1") if crossed else arm,
                unit=unit if keyed else "",
                assignment=assignment,
                status_code=14 if rng.random() < 0.05 else 0,
                latency_ms=float(rng.lognormal(3 if arm == "v1" else 3.2, 0.5)),
                tokens=int(rng.integers(5, 50)) if stream else None,
                ttft_ms=float(rng.lognormal(4, 0.3)) if stream and i % 8 else None,
                usage=(int(rng.integers(5, 20)), int(rng.integers(10, 60))) if stream and i % 3 else None,
            )
            (second if in_second else first).append((t, call))
            if i % 17 == 0:  # archived twice (a redelivered entry) and once retried seconds later
                (second if in_second else first).append((t + 10**9, call))
            if i % 19 == 0 and not in_second:
                retry = Call(call.request_id, t + 3 * 10**9, call.arm, unit=call.unit, assignment=call.assignment)
                first.append((t + 3 * 10**9, retry))
            lift = 0.25 if arm == "v2" else 0.15
            for k in range(int(rng.random() < lift) + int(rng.random() < 0.1)):  # some calls click twice
                when = t + int(rng.integers(1, 60)) * 10**9
                key = f"click-{call.request_id}-{k}"
                click = Event("click", 1.0, when, request_id=call.request_id, idempotency_key=key)
                events.append((when, click))
                if k == 0 and i % 6 == 0:  # delivered twice: one counts
                    events.append((when + 2 * 10**9, click))
            if rng.random() < 0.3:  # a negative click (an impression without one)
                when = t + 5 * 10**9
                events.append((when, Event("click", 0.0, when, request_id=call.request_id)))
            score = Event("score", float(rng.normal(3 if arm == "v1" else 3.3, 1)), t + 20 * 10**9,
                          request_id=call.request_id, idempotency_key=f"s-{call.request_id}")  # fmt: skip
            events.append((score.event_ns, score))
            if j == 0:
                # Late outcomes: inside the attribution window, and past it.
                for late in (t + 45 * MINUTE_NS, t + HOUR_NS):  # inside the join horizon, and just past it
                    events.append((late, Event("revenue", float(rng.gamma(2, 4)), late, request_id=call.request_id)))
                too_late = WINDOW.until_ns + WINDOW.attribution_ns + MINUTE_NS
                events.append((too_late, Event("revenue", 9.0, too_late, request_id=call.request_id)))
        # Outcomes naming only the unit: joined to the phase it was last first-exposed in.
        for when in (T0 + 10 * MINUTE_NS + i * 10**9, half + 20 * MINUTE_NS + i * 10**9):
            event = Event("revenue", float(rng.gamma(2, 3)), when, unit=unit, idempotency_key=f"u{i}-{when}")
            events.append((when, event))
    for k in range(20):  # events that join nothing, and metrics not asked for
        when = T0 + k * MINUTE_NS
        events.append((when, Event("revenue", 1.0, when, request_id=f"nobody-{k}")))
        events.append((when, Event("revenue", 1.0, when, unit=f"stranger-{k}")))
        events.append((when, Event("dwell", 2.0, when, request_id=f"c{k}-0")))
        events.append((when - 2 * HOUR_NS, Event("click", 1.0, when - 2 * HOUR_NS, request_id=f"c{k}-0")))
    return first, second, events


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    tmp = tmp_path_factory.mktemp("sql")
    server = RedisServer(tmp / "redis").start()
    first, second, events = _traffic(np.random.default_rng(29))
    client = server.client()
    write_arrivals(client, MODEL, first, FIRST)
    write_arrivals(client, MODEL, second, SECOND)
    write_arrivals(client, MODEL, events, FIRST)
    url = (tmp / "archive").as_uri()
    archiver = start_archiver(tmp, server.url, url)
    try:
        for key in (stream_key(MODEL), feedback_key(MODEL)):
            wait_for(lambda key=key: archived_everything(client, key), timeout_s=120, what=key)  # type: ignore[misc]
    finally:
        archiver.stop()
        client.close()
    try:
        yield Lab(server, open_archive(url))
    finally:
        server.stop()


def run(source: Source, query: Query) -> Any:
    async def go() -> Analysis:
        if isinstance(source, RedisSource):
            try:
                return await analyze(source, query)
            finally:
                await source.redis.aclose()
        return await analyze(source, query)

    return strip(asyncio.run(go()).model_dump())


def strip(value: Any) -> Any:
    """The analysis without the most calls the page reader held at once (a figure of its memory, not the data)."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k != "held_for_join_peak"}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


METRICS = tuple(
    MetricSpec.parse(text)
    for text in ("click:proportion", "revenue:sum", "score:mean", "ttft_ms:mean", "cost:sum", "tokens_out:mean")
)
QUERIES = {
    "user": Query(model=MODEL, window=WINDOW, metrics=METRICS, prices=parse_prices(PRICES)),
    "call": Query(model=MODEL, window=WINDOW, metrics=METRICS, unit="call", prices=parse_prices(PRICES)),
    "conversion-cuped": Query(
        model=MODEL,
        window=WINDOW,
        metrics=(MetricSpec.parse("click:conversion"), MetricSpec.parse("revenue:sum")),
        pre_window=PRE,
        sequential=True,
        novelty_bucket_ns=10 * MINUTE_NS,
    ),
    "no-attribution": Query(
        model=MODEL,
        window=Window(T0, T0 + HOUR_NS),
        metrics=(MetricSpec.parse("click:rate"), MetricSpec.parse("revenue:mean")),
        novelty_bucket_ns=None,
        quantiles=False,
    ),
}


@pytest.mark.parametrize("name", sorted(QUERIES))
@pytest.mark.slow
def test_duckdb_gives_the_page_readers_analysis_of_the_archive_field_by_field(lab: Lab, name: str) -> None:
    query = QUERIES[name]
    expected = run(ArchiveSource(lab.archive, engine="python"), query)
    # The data hold every shape: make sure they reached the analysis (else the equality proves little).
    assert expected["calls"]["not_randomized"] > 0
    for count in ("duplicates", "unknown", "outside_window", "other_metrics", "not_randomized", "crossover"):
        assert expected["feedback"][count] > 0 or (query.unit == "call" and count == "crossover"), count
    assert len(expected["phases"]) == 2
    assert expected["phases"][0]["crossover_units"] > 0 or query.unit == "call"
    assert all(c["verdict"] != "no data" for p in expected["phases"] for c in p["comparisons"])
    assert_same(run(ArchiveSource(lab.archive), query), expected, name)


def test_duckdb_on_the_archive_gives_the_analysis_of_redis(lab: Lab) -> None:
    from redis.asyncio import Redis

    query = QUERIES["user"]
    expected = run(RedisSource(Redis.from_url(lab.redis.url)), query)
    got = run(ArchiveSource(lab.archive), query)
    for part in (got, expected):  # the archive reads a copy archived twice once; Redis meets it twice
        for counts in (part["calls"], part["feedback"]):
            counts.pop("entries_read")
            counts.pop("duplicates")
    assert_same(got, expected, "redis")


# -- the query elsewhere: --print-sql and --aggregates -------------------------------------------------------------


def window_flags(query: Query) -> list[str]:
    flags = ["--since", str(query.window.since_ns // 10**9), "--until", str(query.window.until_ns // 10**9)]
    flags += ["--attribution-window", f"{query.window.attribution_ns // 10**9}s"]
    for metric in query.metrics:
        flags += ["--metric", str(metric)]
    return [*flags, "--novelty-bucket", "off"]


#: The aggregation of the "user" query, as another engine would run it (no novelty: not in its output).
ELSEWHERE = Query(model=MODEL, window=WINDOW, metrics=METRICS[:3], novelty_bucket_ns=None)


def run_printed_sql(archive: Archive, sql: str, out: Path) -> None:
    """The printed query run as another engine would run it: on DuckDB, over tables of the archive's files whose
    times are integer nanoseconds (the query's contract), its output written where ``out`` says (Parquet or CSV)."""
    con = duckdb.connect()
    for name, kind, schema in (("calls", CALLS, CALL_SCHEMA), ("feedback", FEEDBACK, FEEDBACK_SCHEMA)):
        files = window_files(archive, kind, MODEL, T0 - 2 * HOUR_NS, T0 + 4 * HOUR_NS)
        table = ds.dataset(files, schema=schema, filesystem=archive.filesystem).to_table()
        for index, field in enumerate(schema):
            if pa.types.is_timestamp(field.type):
                table = table.set_column(index, field.name, table[field.name].cast(pa.int64()))
        con.register(f"{name}_arrow", table)
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM {name}_arrow")
    form = "PARQUET" if out.suffix == ".parquet" else "CSV, HEADER"
    con.execute(f"COPY ({sql}) TO '{out}' (FORMAT {form})")
    con.close()


def carried(analysis: Any) -> Any:
    """What per-unit aggregates carry of an analysis: the phases' units, arms' metrics, comparisons and verdicts
    (not the calls' latency, streams or tokens, nor the counts of entries read)."""
    arm_fields = ("arm", "weight", "units", "calls", "metrics")
    phases = [
        {
            **{k: v for k, v in phase.items() if k not in ("arms", "quantiles")},
            "arms": [{k: arm[k] for k in arm_fields} for arm in phase["arms"]],
        }
        for phase in analysis["phases"]
    ]
    return {"phases": phases, "verdicts": analysis["verdicts"]}


@pytest.mark.slow
def test_print_sql_prints_the_query_in_each_dialect_and_a_bad_dialect_exits_2() -> None:
    for dialect in ("duckdb", "spark", "trino", "bigquery"):
        done = analyze_cli(MODEL, "--print-sql", "--dialect", dialect, *window_flags(ELSEWHERE))
        assert done.returncode == 0, done.stderr
        parsed = sqlglot.parse_one(done.stdout, read=dialect)
        assert parsed.find(sqlglot.exp.Window) is not None  # the de-duplication, as the dialect writes it
        assert "calls_read" in done.stdout
        assert "click.positives" in done.stdout.replace("`", "").replace('"', "")
    bad = analyze_cli(MODEL, "--print-sql", "--dialect", "oracle", *window_flags(ELSEWHERE))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "splitstream: error: bad --dialect 'oracle' (expected one of duckdb, spark, trino, bigquery)"
    ]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
@pytest.mark.slow
def test_aggregates_from_the_printed_query_give_the_direct_analysis(lab: Lab, tmp_path: Path, suffix: str) -> None:
    printed = analyze_cli(MODEL, "--print-sql", "--dialect", "duckdb", *window_flags(ELSEWHERE))
    assert printed.returncode == 0, printed.stderr
    rows = tmp_path / f"aggregates{suffix}"
    run_printed_sql(lab.archive, printed.stdout, rows)
    expected = carried(run(ArchiveSource(lab.archive), ELSEWHERE))
    assert expected["phases"][1]["srm"]  # the phases' records were read: their weights
    assert_same(carried(run(AggregatesSource(rows), ELSEWHERE)), expected, "aggregates")
    done = analyze_cli(MODEL, "--aggregates", str(rows), *window_flags(ELSEWHERE), "--output-dir", str(tmp_path / "o"))
    assert done.returncode == 0, done.stderr
    document = json.loads((tmp_path / "o" / "analysis.json").read_text())
    assert_same(carried(strip(document)), expected, "cli")


@pytest.mark.slow
def test_aggregates_missing_or_mistyped_columns_exit_2_naming_the_column(tmp_path: Path) -> None:
    columns = {
        "phase": pa.array(["p"]),
        "arm": pa.array(["v1"]),
        "unit": pa.array(["u"]),
        "unit_is_call": pa.array([False]),
        "bucket": pa.array([0]),
        "calls": pa.array([1]),
        "first_ns": pa.array([T0]),
        "click.sum": pa.array([1.0]),
        "click.count": pa.array([1]),
        "click.positives": pa.array([1]),
        "phase_record": pa.array([None], pa.string()),
    }
    flags = [*window_flags(Query(model=MODEL, window=WINDOW, metrics=(METRICS[0],))), "--output-dir", str(tmp_path)]
    missing = tmp_path / "missing.parquet"
    pq.write_table(pa.table({k: v for k, v in columns.items() if k != "click.positives"}), missing)
    done = analyze_cli(MODEL, "--aggregates", str(missing), *flags)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"splitstream: error: --aggregates {missing}: column 'click.positives' is missing (the query's output has it)"
    ]
    mistyped = tmp_path / "mistyped.parquet"
    pq.write_table(pa.table({**columns, "calls": pa.array(["one"])}), mistyped)
    done = analyze_cli(MODEL, "--aggregates", str(mistyped), *flags)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"splitstream: error: --aggregates {mistyped}: column 'calls' is VARCHAR, expected integer"
    ]


# -- a property: any small archive -----------------------------------------------------------------------------

START = T0 + HOUR_NS // 2  # the window spans two hour partitions
#: Lateness long enough that the page reader forgets no copy the SQL finds (it is the only difference).
SMALL = Window(START, START + HOUR_NS, max_lateness_ns=4 * HOUR_NS, attribution_ns=20 * MINUTE_NS)
PHASES = {name: phase({"v1": 50, "v2": 50}, "v1", salt=name) for name in ("pa", "pb")}

calls_strategy = hst.lists(
    hst.tuples(
        hst.integers(0, 40),  # request id (repeats: copies and retries)
        hst.integers(-5 * MINUTE_NS, HOUR_NS + 5 * MINUTE_NS),  # receive time from the window's start
        hst.sampled_from(["v1", "v2"]),
        hst.sampled_from(["hash", "hash", "random", "pin", "spill"]),
        hst.integers(0, 8),  # unit (0: no routing key)
        hst.sampled_from(["pa", "pb"]),
        hst.floats(0.01, 5_000.0),
    ),
    min_size=1,
    max_size=60,
)
events_strategy = hst.lists(
    hst.tuples(
        hst.sampled_from(["click", "revenue", "other"]),
        hst.integers(0, 45),  # request id (past 40: none such; 0: only a unit)
        hst.integers(0, 10),  # unit (0: none)
        hst.sampled_from([0.0, 1.0, 2.5, -1.0]),
        hst.integers(-10 * MINUTE_NS, HOUR_NS + 30 * MINUTE_NS),
        hst.integers(0, 6),  # idempotency key (0: none)
    ),
    max_size=80,
)


def write_small_archive(base: Path, calls: list[Any], events: list[Any]) -> Archive:
    """The calls and events as the archiver lays them out: a file per hour partition, stream ids in time order."""
    archive = open_archive(base.as_uri())
    rows: dict[str, list[dict[str, Any]]] = {}
    for n, (request, offset, arm, assignment, unit, phase_name, latency) in enumerate(
        sorted(calls, key=lambda c: c[1])
    ):
        t = START + offset
        call = Call(f"r{request}", t, arm, unit=f"u{unit}" if unit else "", assignment=assignment)
        record = call_record(MODEL, call, PHASES[phase_name]).SerializeToString()
        rows.setdefault(partition_dir(CALLS, MODEL, t), []).append(
            {
                "request_id": call.request_id,
                "receive_time": t,
                "version": arm,
                "arm": arm,
                "assignment": assignment,
                "phase": PHASES[phase_name].id,
                "status": "OK",
                "latency_ms": latency,
                "routing_key_hmac": call.unit,
                "stream_id": f"{t // 10**6}-{n}",
                "record": record,
            }
        )
    for n, (metric, request, unit, value, offset, key) in enumerate(sorted(events, key=lambda e: e[4])):
        t = START + offset
        rows.setdefault(partition_dir(FEEDBACK, MODEL, t), []).append(
            {
                "request_id": f"r{request}" if request else "",
                "unit": f"u{unit}" if unit else "",
                "metric": metric,
                "value": value,
                "event_time": t,
                "receive_time": t,
                "idempotency_key": f"k{key}" if key else "",
                "stream_id": f"{t // 10**6}-{n}",
            }
        )
    for directory, found in rows.items():
        schema = CALL_SCHEMA if directory.startswith(CALLS) else FEEDBACK_SCHEMA
        table = pa.Table.from_pylist([{name: row.get(name) for name in schema.names} for row in found], schema)
        write_file(archive, f"{directory}/{found[0]['stream_id']}_{found[-1]['stream_id']}.parquet", table)
    return archive


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=calls_strategy, events=events_strategy, unit=hst.sampled_from(["user", "call"]))
@pytest.mark.slow
def test_any_small_archive_gives_duckdb_the_page_readers_analysis(
    tmp_path_factory: pytest.TempPathFactory, calls: list[Any], events: list[Any], unit: str
) -> None:
    archive = write_small_archive(tmp_path_factory.mktemp("small"), calls, events)
    query = Query(
        model=MODEL,
        window=SMALL,
        metrics=(MetricSpec.parse("click:proportion"), MetricSpec.parse("revenue:mean")),
        unit=unit,  # type: ignore[arg-type]
        novelty_bucket_ns=20 * MINUTE_NS,
    )
    assert_same(run(ArchiveSource(archive), query), run(ArchiveSource(archive, engine="python"), query), "small")
