"""The per-unit aggregation of an analysis, as SQL: the one definition the DuckDB engine runs over the archive and
``splitstream analyze --print-sql`` prints for a warehouse or cluster.

It is written in DuckDB's dialect and transpiled (sqlglot) for the others. It reads two tables with the archive's
columns (:data:`splitstream.common.archive.CALL_SCHEMA`, :data:`~splitstream.common.archive.FEEDBACK_SCHEMA`),
``calls`` and ``feedback``, whose times (``receive_time``, ``event_time``) are integer nanoseconds since the epoch
(the DuckDB engine's views convert the archive's ``timestamp[ns]``; Spark reads them so with
``spark.sql.legacy.parquet.nanosAsLong``). It does what the Redis reader does (:mod:`splitstream.analysis.loading`,
:mod:`splitstream.analysis.folding`), in steps named like its CTEs:

- ``calls_read``: the window's calls, a request id's copies within an hour partition read once (the earliest
  stream id), as the archive's reader does;
- ``calls_good``: those whose time and latency parse (the rest are ``corrupt``), ``calls_once`` one per request id,
  the first received (later ones are ``duplicates``); ``units`` numbers each distinct unit (the routing-key HMAC,
  or the call itself) once, and ``exposed`` carries each call's unit number, time bucket (twentieths of the
  window), latency bucket and values of the metrics of the calls: every later grouping and join is on the number,
  not on the 64-character text, which only the output's rows carry, joined to them last;
- ``unit_rows``: one row per (phase, arm, unit) of the calls that count (randomized ones), with its first call;
- ``events_read`` … ``events``: the feedback of the metrics asked, dated in the window (events naming a call: up
  to the attribution window past its end), one per (metric, idempotency key), the first received;
- ``joined``: an event naming a request id joins that call when dated from the clock skew before it to the join
  horizon after it; an event naming only a unit joins the row the unit was last first-exposed in at or before it;
- the output (:func:`aggregation_query`): long rows per (phase, arm, unit, time bucket) with ``calls``, ``first_ns``
  and per metric ``<name>.sum``, ``<name>.count``, ``<name>.positives`` (each call once, in the bucket of its
  first positive event; each positive event of a unit once), plus one row per phase (``unit`` null) carrying one
  of its serialized records (``phase_record``, hex) for its weights and control (SQL cannot decode protobuf).

Crossover units (in two arms of a phase) are left in: the statistics leave them out, as they do for the reader.
The side queries (:func:`side_queries`: counts, latency and TTFT histograms, streams and tokens, calls not
randomized, novelty; :func:`samples_select`: per-unit latency and TTFT samples, a range of rows at a time)
serve the DuckDB engine's report; a cluster's output carries the per-unit rows only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sqlglot

from splitstream.analysis.loading import (
    LATENCY_BUCKETS,
    LATENCY_FLOOR_MS,
    LATENCY_GROWTH,
    RANDOMIZED,
    TIMELINE_POINTS,
    Window,
)
from splitstream.analysis.sql import DIALECTS
from splitstream.analysis.statistics import MetricKind
from splitstream.analysis.usage import Price, is_call_metric

if TYPE_CHECKING:
    from splitstream.analysis.analyze import Query

#: The columns of a metric in the output, after its name and a dot.
METRIC_PARTS = ("sum", "count", "positives")
_LOG_GROWTH = math.log(LATENCY_GROWTH)
#: The archive's partitions: a request id's copies within one are read once
#: (:func:`~splitstream.common.archive.iter_calls`).
HOUR_NS = 3_600 * 10**9


@dataclass(frozen=True, slots=True)
class Aggregation:
    """What the query is built from: the window, the metrics (name, kind) in ``--metric`` order, the unit, and
    the choices the CUPED pre-period makes (every call counts, nothing is novelty)."""

    window: Window
    metrics: tuple[tuple[str, MetricKind], ...]
    per_call: bool = False
    randomized_only: bool = True
    prices: dict[str, Price] = field(default_factory=dict)
    novelty_ns: int | None = None
    novelty_buckets: int = 0


def aggregation_of(query: Query) -> Aggregation:
    """The aggregation of an analysis's window (its CUPED pre-period and segments are not in it)."""
    return Aggregation(
        query.window,
        tuple((m.name, m.kind) for m in query.metrics),
        per_call=query.unit == "call",
        prices=dict(query.prices),
    )


def metric_column(name: str, part: str) -> str:
    return f"{name}.{part}"


def _text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _bucket(expression: str, spec: Aggregation) -> str:
    """The time bucket of a time (:meth:`Window.bucket_of`): integer arithmetic, clipped to the window's."""
    w = spec.window
    span = max(w.until_ns - w.since_ns, 1)
    return f"LEAST(GREATEST(({expression} - {w.since_ns}) * {TIMELINE_POINTS} // {span}, 0), {TIMELINE_POINTS - 1})"


def _latency_bucket(expression: str) -> str:
    """:func:`splitstream.analysis.loading._latency_buckets` in SQL."""
    return (
        f"LEAST(CAST(FLOOR(LN(GREATEST({expression}, {LATENCY_FLOOR_MS!r}) / {LATENCY_FLOOR_MS!r}) / {_LOG_GROWTH!r})"
        f" AS BIGINT), {LATENCY_BUCKETS - 1})"
    )


def _finite(expression: str) -> str:
    """Not null, not NaN, not infinite (NaN compares above every number, or not at all, on these engines)."""
    return f"({expression} IS NOT NULL AND {expression} BETWEEN -1.7e308 AND 1.7e308)"


def _cost(spec: Aggregation) -> str:
    if not spec.prices:
        return "CAST(NULL AS DOUBLE)"
    per_in = " ".join(f"WHEN {_text(v)} THEN {p.per_token_in!r}" for v, p in sorted(spec.prices.items()))
    per_out = " ".join(f"WHEN {_text(v)} THEN {p.per_token_out!r}" for v, p in sorted(spec.prices.items()))
    return (
        f"CAST(prompt_tokens AS DOUBLE) * (CASE arm {per_in} END)"
        f" + CAST(completion_tokens AS DOUBLE) * (CASE arm {per_out} END)"
    )


#: Each metric of the calls: its value per call (NULL: none).
def _call_values(spec: Aggregation) -> dict[str, str]:
    return {
        "tokens_in": "CAST(prompt_tokens AS DOUBLE)",
        "tokens_out": "CAST(completion_tokens AS DOUBLE)",
        "ttft_ms": f"CASE WHEN {_finite('ttft_ms')} THEN ttft_ms END",
        "cost": _cost(spec),
    }


def steps(spec: Aggregation) -> list[tuple[str, str]]:
    """The CTEs, in order: (name, SELECT) in DuckDB's dialect."""
    w = spec.window
    horizon = w.join_horizon_ns()
    randomized = ", ".join(_text(a.decode()) for a in RANDOMIZED)
    feedback_metrics = [name for name, _ in spec.metrics if not is_call_metric(name)]
    metric_list = ", ".join(_text(n) for n in feedback_metrics) or "NULL"
    codes = " ".join(f"WHEN {_text(n)} THEN {i}" for i, (n, _) in enumerate(spec.metrics) if not is_call_metric(n))
    metric_code = f"CASE metric {codes} END" if codes else "CAST(NULL AS INTEGER)"
    values = _call_values(spec)
    call_metric_columns = ", ".join(
        f"{values[name]} AS {_quoted('call_value_' + name)}" for name, _ in spec.metrics if is_call_metric(name)
    )
    # The stream id range of the window's feedback (:func:`splitstream.analysis.loading.bounds`), as the reader
    # asks the archive for it (by receive time).
    reach = w.feedback_reach()
    low = max(reach.since_ns - reach.clock_skew_ns, 0) // 1_000_000 * 1_000_000
    high = ((reach.until_ns + reach.max_lateness_ns + reach.clock_skew_ns) // 1_000_000 + 1) * 1_000_000
    unit = (
        "request_id"
        if spec.per_call
        else "CASE WHEN COALESCE(routing_key_hmac, '') = '' THEN request_id ELSE routing_key_hmac END"
    )
    unit_is_call = "TRUE" if spec.per_call else "COALESCE(routing_key_hmac, '') = ''"
    chosen = "randomized" if spec.randomized_only else "TRUE"
    # A request id's copies are few (a resent record): the ids with more than one row are found by one grouping,
    # and only their rows go through the window functions that pick a copy; the rest are their own first copy.
    # (Empty and missing ids share the key '' here, so both take the exact path.)
    window_calls = f"""SELECT *, CAST(SPLIT_PART(stream_id, '-', 1) AS BIGINT) AS stream_ms,
                    CAST(SPLIT_PART(stream_id, '-', 2) AS BIGINT) AS stream_seq
                  FROM calls WHERE receive_time >= {w.since_ns} AND receive_time < {w.until_ns}"""
    copied = "COALESCE(request_id, '') IN (SELECT copied_id FROM call_copies)"
    out = [
        (
            "call_copies",
            f"""SELECT COALESCE(request_id, '') AS copied_id FROM calls
                  WHERE receive_time >= {w.since_ns} AND receive_time < {w.until_ns}
                  GROUP BY COALESCE(request_id, '') HAVING COUNT(*) > 1""",
        ),
        (
            "calls_read",
            f"""SELECT *, 1 AS copy FROM ({window_calls}) AS c WHERE NOT {copied}
                UNION ALL
                SELECT *, ROW_NUMBER() OVER (PARTITION BY request_id, receive_time // {HOUR_NS}
                    ORDER BY stream_ms, stream_seq) AS copy
                  FROM ({window_calls}) AS c WHERE {copied}""",
        ),
        (
            "calls_good",
            f"""SELECT * FROM calls_read WHERE copy = 1 AND receive_time IS NOT NULL AND {_finite("latency_ms")}""",
        ),
        (
            "calls_once",
            f"""SELECT *, 1 AS nth FROM calls_good WHERE NOT {copied}
                UNION ALL
                SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY request_id ORDER BY receive_time, stream_ms,
                    stream_seq) AS nth FROM calls_good WHERE {copied}) AS c
                  WHERE nth = 1 OR COALESCE(request_id, '') = ''""",
        ),
        (
            "units",
            f"""SELECT unit, unit_is_call, ROW_NUMBER() OVER (ORDER BY unit_is_call, unit) - 1 AS unit_id
                  FROM (SELECT DISTINCT {unit} AS unit, {unit_is_call} AS unit_is_call FROM calls_once) AS u""",
        ),
        (
            "exposed",
            f"""SELECT request_id, receive_time AS time_ns, stream_ms, stream_seq, latency_ms, tokens, ttft_ms,
                    prompt_tokens, completion_tokens,
                    COALESCE(phase, '') AS phase, COALESCE(arm, '') AS arm,
                    COALESCE(assignment, '') AS assignment, COALESCE(status, '') <> 'OK' AS failed,
                    COALESCE(assignment, '') IN ({randomized}) AS randomized,
                    COALESCE(routing_key_hmac, '') <> '' AS keyed,
                    u.unit_id, {unit_is_call} AS unit_is_call,
                    {_bucket("receive_time", spec)} AS bucket,
                    {_latency_bucket("latency_ms")} AS latency_bucket
                    {", " + call_metric_columns if call_metric_columns else ""}
                  FROM calls_once LEFT JOIN units AS u ON u.unit = ({unit}) AND u.unit_is_call = ({unit_is_call})""",
        ),
        (
            "unit_rows",
            f"""SELECT phase, arm, unit_id, unit_is_call, MIN(time_ns) AS first_ns FROM exposed WHERE {chosen}
                  GROUP BY phase, arm, unit_id, unit_is_call""",
        ),
        (
            "events_read",
            f"""SELECT *, ROW_NUMBER() OVER (PARTITION BY stream_id ORDER BY receive_time) AS copy,
                    CAST(SPLIT_PART(stream_id, '-', 1) AS BIGINT) AS stream_ms,
                    CAST(SPLIT_PART(stream_id, '-', 2) AS BIGINT) AS stream_seq
                  FROM feedback WHERE receive_time >= {low} AND receive_time < {high}""",
        ),
        (
            "events_sorted",
            f"""SELECT *, metric IN ({metric_list}) AS asked,
                    {_finite("value")} AND event_time IS NOT NULL AS good,
                    event_time >= {w.since_ns} AND event_time < CASE WHEN COALESCE(request_id, '') <> ''
                      THEN {w.until_ns + w.attribution_ns} ELSE {w.until_ns} END AS inside
                  FROM events_read WHERE copy = 1""",
        ),
        (
            "events_kept",
            """SELECT *, ROW_NUMBER() OVER (PARTITION BY metric, idempotency_key ORDER BY receive_time, stream_ms,
                    stream_seq) AS nth
                  FROM events_sorted WHERE asked AND good AND inside""",
        ),
        (
            "events",
            f"""SELECT stream_id AS event_id, {metric_code} AS code, COALESCE(request_id, '') AS request_id,
                    COALESCE(unit, '') AS unit, value, event_time AS event_ns, {_bucket("event_time", spec)} AS bucket
                  FROM events_kept WHERE nth = 1 OR COALESCE(idempotency_key, '') = ''""",
        ),
        (
            "by_request",
            f"""SELECT e.event_id, e.code, e.request_id, e.value, e.event_ns, e.bucket, c.randomized,
                    c.phase, c.arm, c.unit_id, c.unit_is_call
                  FROM events AS e JOIN exposed AS c ON e.request_id = c.request_id
                  WHERE e.request_id <> '' AND e.event_ns >= c.time_ns - {w.clock_skew_ns}
                    AND e.event_ns < c.time_ns + {horizon}""",
        ),
        (
            "by_unit",
            """SELECT * FROM (SELECT e.event_id, e.code, e.value, e.event_ns, e.bucket, r.phase, r.arm, r.unit_id,
                    r.unit_is_call, ROW_NUMBER() OVER (PARTITION BY e.event_id ORDER BY r.first_ns DESC, r.phase DESC,
                    r.arm DESC) AS pick
                  FROM events AS e JOIN units AS n ON n.unit = e.unit AND NOT n.unit_is_call
                    JOIN unit_rows AS r ON r.unit_id = n.unit_id AND r.first_ns <= e.event_ns
                  WHERE e.request_id = '' AND e.unit <> '') AS u WHERE pick = 1"""
            if not spec.per_call
            else """SELECT e.event_id, e.code, e.value, e.event_ns, e.bucket, '' AS phase, '' AS arm,
                    CAST(0 AS BIGINT) AS unit_id, FALSE AS unit_is_call, 1 AS pick FROM events AS e WHERE FALSE""",
        ),
        (
            "joined",
            f"""SELECT phase, arm, unit_id, unit_is_call, code, value, event_ns, bucket, request_id FROM by_request
                  WHERE {chosen}
                UNION ALL
                SELECT phase, arm, unit_id, unit_is_call, code, value, event_ns, bucket, NULL AS request_id
                  FROM by_unit""",
        ),
    ]
    return out


def _metric_sums(spec: Aggregation) -> list[str]:
    """Per metric, the three output columns of one row of the union (:func:`aggregation_query`), by source."""
    return [metric_column(name, part) for name, _ in spec.metrics for part in METRIC_PARTS]


def unit_rows_select(spec: Aggregation, *, unit_ids: bool = False) -> str:
    """The long rows per (phase, arm, unit, bucket): calls, their metrics of the calls, events, positives; with
    ``unit_ids`` (the DuckDB engine's), each row's unit number (:func:`steps`' ``units``) in place of its text,
    which :func:`~splitstream.analysis.sql.aggregates.lay_out` reads once per unit from ``units``.

    Grouped on the units' numbers, the unit's text joined once to the grouped rows: grouping ten million calls
    on 64-character keys held those keys several times over."""
    chosen = "randomized" if spec.randomized_only else "TRUE"
    columns = _metric_sums(spec)
    parts: list[str] = []
    # The calls: their count and first time, and each metric of the calls as if an event at the call's time.
    call_metrics = []
    for index, (name, _) in enumerate(spec.metrics):
        value = _quoted("call_value_" + name)
        if is_call_metric(name):
            call_metrics += [f"SUM({value})", f"COUNT({value})", "0"]
        else:
            call_metrics += ["0.0", "0", "0"]
        del index
    parts.append(
        "SELECT phase, arm, unit_id, unit_is_call, bucket, COUNT(*) AS calls, MIN(time_ns) AS first_ns, "
        + ", ".join(f"{c} AS {_quoted(n)}" for c, n in zip(call_metrics, columns, strict=True))
        + f" FROM exposed WHERE {chosen} GROUP BY phase, arm, unit_id, unit_is_call, bucket"
    )
    # The events: per metric, the sum of values and their number at the event's bucket.
    event_metrics = []
    for index, (name, _) in enumerate(spec.metrics):
        if is_call_metric(name):
            event_metrics += ["0.0", "0", "0"]
        else:
            event_metrics += [
                f"SUM(CASE WHEN code = {index} THEN value ELSE 0.0 END)",
                f"SUM(CASE WHEN code = {index} THEN 1 ELSE 0 END)",
                "0",
            ]
    parts.append(
        "SELECT phase, arm, unit_id, unit_is_call, bucket, 0 AS calls, CAST(NULL AS BIGINT) AS first_ns, "
        + ", ".join(f"{c} AS {_quoted(n)}" for c, n in zip(event_metrics, columns, strict=True))
        + " FROM joined GROUP BY phase, arm, unit_id, unit_is_call, bucket"
    )
    # Positives: a call once, in the bucket of its first positive event; an event naming only a unit, once each.
    for index, (name, kind) in enumerate(spec.metrics):
        if not kind.counts_positive_calls or is_call_metric(name):
            continue
        zeros = ["0.0", "0", "0"] * len(spec.metrics)
        zeros[3 * index + 2] = "COUNT(*)"
        select = ", ".join(f"{c} AS {_quoted(n)}" for c, n in zip(zeros, columns, strict=True))
        parts.append(
            f"SELECT phase, arm, unit_id, unit_is_call, bucket, 0 AS calls, CAST(NULL AS BIGINT) AS first_ns, {select}"
            " FROM (SELECT phase, arm, unit_id, unit_is_call, MIN(bucket) AS bucket FROM joined"
            f" WHERE code = {index} AND value > 0 AND request_id IS NOT NULL"
            " GROUP BY phase, arm, unit_id, unit_is_call, request_id"
            " UNION ALL SELECT phase, arm, unit_id, unit_is_call, bucket FROM joined"
            f" WHERE code = {index} AND value > 0 AND request_id IS NULL) AS p"
            " GROUP BY phase, arm, unit_id, unit_is_call, bucket"
        )
    summed = ", ".join(
        f"SUM({_quoted(n)}) AS {_quoted(n)}"
        if n.endswith(".sum")
        else f"CAST(SUM({_quoted(n)}) AS BIGINT) AS {_quoted(n)}"
        for n in columns
    )
    grouped = (
        "SELECT phase, arm, unit_id, unit_is_call, bucket, CAST(SUM(calls) AS BIGINT) AS calls, "
        f"MIN(first_ns) AS first_ns, {summed} FROM ("
        + " UNION ALL ".join(parts)
        + ") AS rows GROUP BY phase, arm, unit_id, unit_is_call, bucket"
    )
    if unit_ids:
        return grouped
    outer = ", ".join(f"g.{_quoted(n)}" for n in columns)
    return (
        "SELECT g.phase, g.arm, u.unit, g.unit_is_call, g.bucket, g.calls, g.first_ns, "
        f"{outer}, CAST(NULL AS VARCHAR) AS phase_record"
        f" FROM ({grouped}) AS g LEFT JOIN units AS u ON u.unit_id = g.unit_id"
    )


def phase_rows_select(spec: Aggregation) -> str:
    """One row per phase: the record of its first call (weights and control)."""
    w = spec.window
    nulls = ", ".join(
        f"CAST(NULL AS {'DOUBLE' if n.endswith('.sum') else 'BIGINT'}) AS {_quoted(n)}" for n in _metric_sums(spec)
    )
    return (
        "SELECT f.phase, CAST(NULL AS VARCHAR) AS arm, CAST(NULL AS VARCHAR) AS unit, CAST(NULL AS BOOLEAN) AS "
        "unit_is_call, CAST(NULL AS BIGINT) AS bucket, CAST(NULL AS BIGINT) AS calls, f.time_ns AS first_ns, "
        f"{nulls}, HEX(c.record) AS phase_record"
        " FROM (SELECT * FROM (SELECT phase, request_id, time_ns, ROW_NUMBER() OVER (PARTITION BY phase ORDER BY"
        " time_ns, stream_ms, stream_seq) AS nth FROM exposed) AS e WHERE nth = 1) AS f"
        f" JOIN calls AS c ON c.request_id = f.request_id AND c.receive_time = f.time_ns"
        f" WHERE c.receive_time >= {w.since_ns} AND c.receive_time < {w.until_ns}"
    )


def with_steps(spec: Aggregation, select: str) -> str:
    return "WITH " + ",\n".join(f"{name} AS ({body})" for name, body in steps(spec)) + "\n" + select


def output_select(spec: Aggregation) -> str:
    """The aggregation's output (without its CTEs): unit rows, then phase rows."""
    return f"{unit_rows_select(spec)}\nUNION ALL\n{phase_rows_select(spec)}"


def aggregation_query(spec: Aggregation, dialect: str = "duckdb") -> str:
    """The whole query in ``dialect`` (one of :data:`DIALECTS`)."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r} (one of {', '.join(DIALECTS)})")
    text = with_steps(spec, output_select(spec))
    return sqlglot.transpile(text, read="duckdb", write=dialect, pretty=True)[0]


def output_columns(metrics: Sequence[str]) -> list[str]:
    """The output's columns, in order."""
    return [
        "phase",
        "arm",
        "unit",
        "unit_is_call",
        "bucket",
        "calls",
        "first_ns",
        *(metric_column(name, part) for name in metrics for part in METRIC_PARTS),
        "phase_record",
    ]


# -- the side queries (the DuckDB engine's report: what a cluster's per-unit rows do not carry) --------------------


#: The layout's index of rows (:data:`splitstream.analysis.sql.aggregates.ROW_INDEX`) and a call's join to it.
_ROW_INDEX = "row_index"
_ROW_JOIN = "c.phase = r.phase AND c.arm = r.arm AND c.unit_id = r.unit_id AND c.unit_is_call = r.unit_is_call"


def side_queries(spec: Aggregation) -> dict[str, str]:
    """SELECTs over the steps (:func:`steps`), by name."""
    label = "CASE WHEN randomized THEN 'randomized' ELSE assignment END"
    out = {
        # The calls read in one pass (the steps before ``exposed`` are views: read again, not held).
        "call_counts": f"""SELECT r.entries_read, r.entries_read - r.good AS corrupt, r.good - x.calls AS duplicates,
                x.calls, x.randomized_calls, x.keyed_calls
              FROM (SELECT COUNT(*) AS entries_read, COALESCE(SUM(CASE WHEN receive_time IS NOT NULL
                      AND {_finite("latency_ms")} THEN 1 ELSE 0 END), 0) AS good FROM calls_read WHERE copy = 1) AS r,
                (SELECT COUNT(*) AS calls, COALESCE(SUM(CASE WHEN randomized THEN 1 ELSE 0 END), 0) AS randomized_calls,
                  COALESCE(SUM(CASE WHEN randomized AND keyed THEN 1 ELSE 0 END), 0) AS keyed_calls
                  FROM exposed) AS x""",
        # One pass over each step: the view ``events_sorted`` (each event's first copy) is not read again per count.
        "feedback_counts": """SELECT s.entries_read, s.other_metrics, s.corrupt, s.outside_window,
                s.kept - e.events AS duplicates, e.events, r.by_request, r.not_randomized, u.by_unit
              FROM (SELECT COUNT(*) AS entries_read,
                  COALESCE(SUM(CASE WHEN NOT asked THEN 1 ELSE 0 END), 0) AS other_metrics,
                  COALESCE(SUM(CASE WHEN asked AND NOT good THEN 1 ELSE 0 END), 0) AS corrupt,
                  COALESCE(SUM(CASE WHEN asked AND good AND NOT inside THEN 1 ELSE 0 END), 0) AS outside_window,
                  COALESCE(SUM(CASE WHEN asked AND good AND inside THEN 1 ELSE 0 END), 0) AS kept
                FROM events_sorted) AS s,
                (SELECT COUNT(*) AS events FROM events) AS e,
                (SELECT COALESCE(SUM(CASE WHEN randomized THEN 1 ELSE 0 END), 0) AS by_request,
                  COALESCE(SUM(CASE WHEN NOT randomized THEN 1 ELSE 0 END), 0) AS not_randomized FROM by_request) AS r,
                (SELECT COUNT(*) AS by_unit FROM joined WHERE request_id IS NULL) AS u""",
        "groups": f"""SELECT phase, arm, {label} AS label, COUNT(*) AS calls,
                CAST(SUM(CASE WHEN failed THEN 1 ELSE 0 END) AS BIGINT) AS errors,
                CAST(SUM(CASE WHEN tokens IS NOT NULL THEN 1 ELSE 0 END) AS BIGINT) AS streams,
                CAST(COALESCE(SUM(tokens), 0) AS BIGINT) AS tokens,
                COALESCE(SUM(CASE WHEN tokens IS NOT NULL THEN latency_ms END), 0.0) / 1e3 AS seconds,
                CAST(SUM(CASE WHEN {_finite("ttft_ms")} THEN 1 ELSE 0 END) AS BIGINT) AS ttft_calls,
                CAST(SUM(CASE WHEN completion_tokens IS NOT NULL THEN 1 ELSE 0 END) AS BIGINT) AS generations,
                CAST(COALESCE(SUM(completion_tokens), 0) AS BIGINT) AS tokens_out,
                CAST(SUM(CASE WHEN completion_tokens IS NOT NULL AND prompt_tokens IS NOT NULL THEN 1 ELSE 0 END)
                  AS BIGINT) AS prompt_known,
                CAST(COALESCE(SUM(CASE WHEN completion_tokens IS NOT NULL THEN prompt_tokens END), 0) AS BIGINT)
                  AS tokens_in,
                CAST(SUM(CASE WHEN completion_tokens IS NOT NULL AND ({_cost(spec)}) IS NOT NULL THEN 1 ELSE 0 END)
                  AS BIGINT) AS costed,
                COALESCE(SUM(CASE WHEN completion_tokens IS NOT NULL THEN {_cost(spec)} END), 0.0) AS cost,
                MIN(time_ns) AS first_ns
              FROM exposed GROUP BY phase, arm, {label}""",
        "latency": f"""SELECT phase, arm, {label} AS label, latency_bucket AS bucket, COUNT(*) AS n
              FROM exposed GROUP BY phase, arm, {label}, latency_bucket""",
        "ttft": f"""SELECT phase, arm, {label} AS label, {_latency_bucket("ttft_ms")} AS bucket, COUNT(*) AS n
              FROM exposed WHERE {_finite("ttft_ms")} GROUP BY phase, arm, {label}, {_latency_bucket("ttft_ms")}""",
        "other": """SELECT phase, assignment, arm, COUNT(*) AS calls,
                CAST(SUM(CASE WHEN failed THEN 1 ELSE 0 END) AS BIGINT) AS errors
              FROM exposed WHERE NOT randomized GROUP BY phase, assignment, arm""",
        "arm_order": """SELECT arm, MIN(time_ns) AS first_ns FROM exposed GROUP BY arm""",
    }
    if spec.novelty_ns:
        out["novelty"] = _novelty_select(spec)
    return out


#: The randomized calls by their row in the layout's index, each with its period (time bucket) and the latency and
#: TTFT buckets of its value (``ttft_bucket`` null without a finite TTFT): the samples' parts
#: (:func:`samples_select`) are read from it.
CALL_ROWS = "call_rows"


def call_rows_select() -> str:
    """Each randomized call joined to its row once, kept in the narrowest integers its columns fit: ten million
    calls are some 100 MB here, which DuckDB keeps under its memory limit or spills."""
    return f"""SELECT CAST(r.row_id AS INTEGER) AS row_id, CAST(c.bucket AS TINYINT) AS period,
              CAST(c.latency_bucket AS SMALLINT) AS latency_bucket,
              CAST(CASE WHEN {_finite("c.ttft_ms")} THEN {_latency_bucket("c.ttft_ms")} END AS SMALLINT) AS ttft_bucket
            FROM exposed AS c JOIN {_ROW_INDEX} AS r ON {_ROW_JOIN} WHERE c.randomized"""


def samples_select(value: str, low: int, high: int) -> str:
    """Calls per (row, period, value bucket) of the rows numbered ``[low, high)``, ``value`` the latency's or
    TTFT's bucket column of :data:`CALL_ROWS`. A part of the rows at a time: grouped over all ten million calls
    at once, the join and grouping held them and ran out of DuckDB's 512 MB."""
    return f"""SELECT row_id, period, {value} AS value_bucket, COUNT(*) AS n FROM {CALL_ROWS}
              WHERE row_id >= {low} AND row_id < {high} AND {value} IS NOT NULL
              GROUP BY row_id, period, {value}"""


def _novelty_select(spec: Aggregation, index: str = "row_index") -> str:
    """Per (row, bucket since the row's first call): calls, and per metric sum, count and positive events.

    Rows by their number in ``index`` (the layout's table of (phase, arm, unit) rows with ``row_id`` and first
    call, :func:`splitstream.analysis.sql.aggregates.lay_out`): one join of each call and event to its row, then
    a grouping on two integers, which DuckDB spills to disk when it outgrows its memory; a grouping on the rows'
    text keys, joined to the layout afterwards, held ten million calls' keys twice and did not fit in 512 MB."""
    width = spec.novelty_ns
    columns = _metric_sums(spec)

    def since(expression: str) -> str:
        return f"GREATEST(({expression} - r.first_ns) // {width}, 0)"

    chosen = "c.randomized" if spec.randomized_only else "TRUE"
    call_parts = []
    for name, _ in spec.metrics:
        value = "c." + _quoted("call_value_" + name)
        call_parts += (
            [f"{value}", f"CASE WHEN {value} IS NULL THEN 0 ELSE 1 END", "0"]
            if is_call_metric(name)
            else [
                "0.0",
                "0",
                "0",
            ]
        )
    event_parts = []
    for number, (name, _) in enumerate(spec.metrics):
        if is_call_metric(name):
            event_parts += ["0.0", "0", "0"]
        else:
            event_parts += [
                f"CASE WHEN j.code = {number} THEN j.value ELSE 0.0 END",
                f"CASE WHEN j.code = {number} THEN 1 ELSE 0 END",
                f"CASE WHEN j.code = {number} AND j.value > 0 THEN 1 ELSE 0 END",
            ]
    calls = (
        f"SELECT r.row_id, {since('c.time_ns')} AS since, 1 AS calls, "
        + ", ".join(f"{c} AS {_quoted(n)}" for c, n in zip(call_parts, columns, strict=True))
        + f" FROM exposed AS c JOIN {index} AS r ON c.phase = r.phase AND c.arm = r.arm AND c.unit_id = r.unit_id"
        f" AND c.unit_is_call = r.unit_is_call WHERE {chosen} AND {since('c.time_ns')} < {spec.novelty_buckets}"
    )
    events = (
        f"SELECT r.row_id, {since('j.event_ns')} AS since, 0 AS calls, "
        + ", ".join(f"{c} AS {_quoted(n)}" for c, n in zip(event_parts, columns, strict=True))
        + f" FROM joined AS j JOIN {index} AS r ON j.phase = r.phase AND j.arm = r.arm AND j.unit_id = r.unit_id"
        f" AND j.unit_is_call = r.unit_is_call WHERE {since('j.event_ns')} < {spec.novelty_buckets}"
    )
    summed = ", ".join(f"SUM({_quoted(n)}) AS {_quoted(n)}" for n in columns)
    return (
        f"SELECT row_id, since, SUM(calls) AS calls, {summed} FROM ({calls} UNION ALL {events}) AS n"
        " GROUP BY row_id, since"
    )
