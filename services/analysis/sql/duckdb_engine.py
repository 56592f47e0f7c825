"""The aggregation (:mod:`splitstream.analysis.sql.aggregation`) run on DuckDB over the archive's Parquet: the
default for ``--source archive:``.

Only the window's hour partitions are opened (the archive's own listing), through a pyarrow dataset on the
archive's filesystem (a directory or an S3-compatible store alike) whose schema reads the times as integer
nanoseconds (DuckDB's own Parquet reader rounds them to microseconds); DuckDB pushes the columns and the time
filter down into it. Each step of the query is a temporary table, so each is computed once for the output and the
side queries, and DuckDB keeps them under ``memory_limit``, spilling the rest to a temporary directory rather
than growing without bound. A phase's record (its weights) is read back from the archive by request id and time,
one per phase, as the reader does.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from splitstream.analysis.arrays import RowCells, row_totals
from splitstream.analysis.folding import Loaded
from splitstream.analysis.loading import (
    LATENCY_BUCKETS,
    CallSamples,
    Exposures,
    Feedback,
    Histogram,
    PhaseInfo,
    StreamStats,
    UnitIndex,
    UsageStats,
    Window,
)
from splitstream.analysis.novelty import NoveltyFold, bucket_count
from splitstream.analysis.sql import aggregates
from splitstream.analysis.sql.aggregation import (
    CALL_ROWS,
    METRIC_PARTS,
    Aggregation,
    call_rows_select,
    samples_select,
    side_queries,
    steps,
    unit_rows_select,
)
from splitstream.analysis.statistics import MetricKind
from splitstream.analysis.unit_buckets import UnitBucketCounts
from splitstream.analysis.usage import Price, is_call_metric
from splitstream.common.archive import (
    CALL_SCHEMA,
    CALLS,
    FEEDBACK,
    FEEDBACK_SCHEMA,
    Archive,
    ArchiveError,
    ArchiveQuery,
    read_calls,
    window_files,
)

#: The columns the query reads (the serialized records, tags and the rest are left in the files).
READ_COLUMNS = frozenset(
    [
        *("request_id", "receive_time", "status", "latency_ms", "arm", "assignment", "phase", "routing_key_hmac"),
        *("ttft_ms", "tokens", "prompt_tokens", "completion_tokens", "stream_id"),
        *("unit", "metric", "value", "event_time", "idempotency_key"),
    ]
)
#: Steps kept as tables (read more than once, or from the archive's single-pass readers); the rest are views.
MATERIALIZED = frozenset(
    ["call_copies", "calls_read", "units", "exposed", "unit_rows", "events_read", "events", "joined"]
)
#: DuckDB's memory before it spills to disk (``SPLITSTREAM_ANALYSIS_MEMORY``, DuckDB's syntax: ``1GB``).
DEFAULT_MEMORY_LIMIT = "512MB"


def connect(temp_dir: str) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(config={"memory_limit": os.environ.get("SPLITSTREAM_ANALYSIS_MEMORY", DEFAULT_MEMORY_LIMIT)})
    con.execute(f"SET temp_directory = '{temp_dir}'")
    con.execute("SET preserve_insertion_order = false")
    return con


class _SerialDataset(ds.FileSystemDataset):
    """A dataset whose scans decode in the thread that reads them (``use_threads=False``).

    DuckDB scans a registered dataset through ``type(dataset).scanner(dataset, columns=..., filter=...)``. Arrow's
    threaded scanner decodes files ahead of its reader with no bound (apache/arrow#39808, ``fragment_readahead`` and
    ``batch_readahead`` do not hold it): while DuckDB was building a step from ten million calls, slower than Arrow
    decoded them, 1.9 GB of decoded batches waited in Arrow's pool. Decoded as they are read, one batch at a time,
    the scan holds a file's worth, and DuckDB's own threads still work on what it has read."""

    def scanner(self, **options: Any) -> ds.Scanner:  # type: ignore[override]
        return super().scanner(**{**options, "use_threads": False})


def _register(
    con: duckdb.DuckDBPyConnection,
    archive: Archive,
    name: str,
    schema: pa.Schema,
    files: list[str],
    since: int,
    until: int,
) -> None:
    """``name``: the files' rows received in ``[since, until)``, a view over a pyarrow dataset on the archive's
    filesystem (a directory or an S3-compatible store alike) that each query scans lazily: DuckDB pushes the
    columns down into the scan, and nothing is read ahead of a query or held between them. The time filter stays
    in DuckDB: pushed into Arrow it would compare the dataset's type with the files' (zoned) one and fail; the
    window's hour partitions are all that is opened anyway.

    The times read as integer nanoseconds: the dataset says ``timestamp[ns]`` without a zone (DuckDB's
    ``TIMESTAMP_NS``, which ``epoch_ns`` turns into integers), where DuckDB's own Parquet reader, and Arrow's
    zoned timestamps handed to DuckDB, round them to microseconds."""
    read = pa.schema(
        [
            pa.field(f.name, pa.timestamp("ns")) if pa.types.is_timestamp(f.type) else f
            for f in schema
            if f.name in READ_COLUMNS
        ]
    )
    try:
        found = ds.dataset(files, schema=read, filesystem=archive.filesystem, format="parquet")
    except (OSError, pa.ArrowException) as error:
        raise ArchiveError(f"archive {archive.url!r} cannot be read: {error}") from None
    dataset = _SerialDataset(list(found.get_fragments()), read, found.format, found.filesystem)
    con.register(f"{name}_files", dataset)
    columns = ", ".join(f"epoch_ns({f.name}) AS {f.name}" if pa.types.is_timestamp(f.type) else f.name for f in read)
    con.execute(
        f"CREATE TEMP VIEW {name} AS SELECT * FROM (SELECT {columns} FROM {name}_files) AS f"
        f" WHERE receive_time >= {since} AND receive_time < {until}"
    )


def _run(con: duckdb.DuckDBPyConnection, spec: Aggregation) -> None:
    for name, body in steps(spec):
        con.execute(f"CREATE TEMP {'TABLE' if name in MATERIALIZED else 'VIEW'} {name} AS {body}")
    # The output's unit rows (its phase rows' records are read back from the archive: :func:`_phase_info`).
    con.execute(f"CREATE TEMP TABLE {aggregates.ROWS_VIEW} AS {unit_rows_select(spec, unit_ids=True)}")


def load_archive(
    archive: Archive,
    model: str,
    window: Window,
    kinds: Sequence[MetricKind],
    metrics: Sequence[str],
    *,
    per_call: bool,
    randomized_only: bool = True,
    exclude_crossover: bool = True,
    prices: dict[str, Price] | None = None,
    novelty_ns: int | None = None,
    call_samples: bool = True,
) -> Loaded:
    """What :func:`splitstream.analysis.folding.load` returns for the archive, aggregated by DuckDB. Blocking (run
    it in a thread). Raises ArchiveError when the archive cannot be read."""
    spec = Aggregation(
        window,
        tuple(zip(metrics, kinds, strict=True)),
        per_call=per_call,
        randomized_only=randomized_only,
        prices=dict(prices or {}),
        novelty_ns=novelty_ns,
        novelty_buckets=bucket_count(window, novelty_ns) if novelty_ns else 0,
    )
    reach = window.feedback_reach()
    low = max(reach.since_ns - reach.clock_skew_ns, 0) // 1_000_000 * 1_000_000
    high = ((reach.until_ns + reach.max_lateness_ns + reach.clock_skew_ns) // 1_000_000 + 1) * 1_000_000
    call_files = window_files(archive, CALLS, model, window.since_ns, window.until_ns)
    feedback_files = window_files(archive, FEEDBACK, model, low, high)
    with tempfile.TemporaryDirectory(prefix="splitstream-duckdb-") as temp_dir:
        con = connect(temp_dir)
        try:
            _register(con, archive, "calls", CALL_SCHEMA, call_files, window.since_ns, window.until_ns)
            _register(con, archive, "feedback", FEEDBACK_SCHEMA, feedback_files, low, high)
            try:
                _run(con, spec)
                assemble = _loaded(con, archive, model, spec, exclude_crossover=exclude_crossover, samples=call_samples)
            except (duckdb.IOException, duckdb.InvalidInputException) as error:
                raise ArchiveError(f"archive {archive.url!r} cannot be read: {error}") from None
        finally:
            con.close()
    # What is left works on the arrays read: DuckDB's memory (its limit and what it keeps for reuse) is given back
    # first, as it was the largest part of the process's peak while these were made beside it.
    return assemble()


def _loaded(
    con: duckdb.DuckDBPyConnection,
    archive: Archive,
    model: str,
    spec: Aggregation,
    *,
    exclude_crossover: bool,
    samples: bool,
) -> Callable[[], Loaded]:
    """Everything the analysis reads from DuckDB, and the function that makes it the :class:`Loaded` once the
    connection is closed."""
    side = side_queries(spec)
    metrics = [name for name, _ in spec.metrics]
    kinds = [kind for _, kind in spec.metrics]
    arm_order = [arm for arm, _ in con.execute(side["arm_order"] + " ORDER BY first_ns, arm").fetchall()]
    # The queries that join every call to its row first, while this side holds least: DuckDB's memory (its limit,
    # and what it keeps for reuse) and the arrays read so far are what the process holds at each query.
    n = aggregates.index_rows(con, units="units")
    novelty = _novelty(con, side["novelty"], spec, n) if spec.novelty_ns else None
    call_samples = _call_samples(con, n) if samples else None
    phase_info = _phase_info(con, archive, model, spec.window)
    rows = aggregates.lay_out(con, metrics, kinds, arm_order, units="units", indexed=n)
    counts = con.execute(side["call_counts"]).fetchone()
    fb = con.execute(side["feedback_counts"]).fetchone()
    assert counts is not None
    assert fb is not None
    entries_read, corrupt, duplicates, calls, randomized_calls, keyed_calls = (int(v) for v in counts)
    fb_read, other_metrics, fb_corrupt, outside, fb_duplicates, events, by_request, not_randomized, by_unit = (
        int(v) for v in fb
    )
    if not spec.randomized_only:
        by_request, not_randomized = by_request + not_randomized, 0
    used = by_request + by_unit
    latency: dict[tuple[str, str, str], Histogram] = {}
    streams: dict[tuple[str, str, str], StreamStats] = {}
    usage: dict[tuple[str, str, str], UsageStats] = {}
    for (
        phase,
        arm,
        label,
        n,
        errors,
        streamed,
        tokens,
        seconds,
        ttft_calls,
        gens,
        out,
        known,
        tin,
        costed,
        cost,
        _,
    ) in con.execute(side["groups"]).fetchall():
        key = (phase, arm, label)
        latency[key] = Histogram(np.zeros(LATENCY_BUCKETS, dtype=np.int64), int(n), int(errors))
        if streamed or ttft_calls:
            stats = streams[key] = StreamStats(int(streamed), int(tokens), float(seconds))
            stats.ttft.calls = int(ttft_calls)
        if gens:
            usage[key] = UsageStats(int(gens), int(out), int(known), int(tin), int(costed), float(cost))
    for phase, arm, label, bucket, n in con.execute(side["latency"]).fetchall():
        latency[(phase, arm, label)].counts[int(bucket)] += int(n)
    for phase, arm, label, bucket, n in con.execute(side["ttft"]).fetchall():
        streams[(phase, arm, label)].ttft.counts[int(bucket)] += int(n)
    other = [
        (phase, assignment, arm, int(n), int(errors))
        for phase, assignment, arm, n, errors in con.execute(side["other"] + " ORDER BY 1, 2, 3").fetchall()
    ]

    def assemble() -> Loaded:
        folder = aggregates.folder_of(
            rows,
            kinds,
            metrics,
            spec.window,
            per_call=spec.per_call,
            exclude_crossover=exclude_crossover,
            used=used,
            unknown=events - used - not_randomized,
            not_randomized=not_randomized,
        )
        exposures = Exposures(
            units=rows.units(),
            bucket_calls=rows.bucket_calls,
            other=other,
            latency=latency,
            phase_info=phase_info,
            phases=rows.phases,
            arms=rows.arms,
            entries_read=entries_read,
            calls=calls,
            duplicates=duplicates,
            corrupt=corrupt,
            streams=streams,
            usage=usage,
            randomized_calls=randomized_calls,
            keyed_calls=keyed_calls,
            call_samples=call_samples,
        )
        folder.novelty = novelty
        feedback = Feedback(fb_read, fb_duplicates, fb_corrupt, other_metrics, outside)
        return Loaded(exposures, feedback, folder, {})

    return assemble


#: Rows of the layout per part of the samples' queries: a part's groups (at most its calls) stay well inside
#: DuckDB's 512 MB, and its arrays here are a few tens of MB.
SAMPLE_ROWS_PER_PART = 500_000
#: Rows of the novelty query's result added to its fold at a time.
NOVELTY_ROWS_PER_BATCH = 1_000_000


def _call_samples(con: duckdb.DuckDBPyConnection, n: int) -> CallSamples:
    """The latency and TTFT samples, from the calls joined to their rows once (:data:`CALL_ROWS`)."""
    con.execute(f"CREATE OR REPLACE TEMP TABLE {CALL_ROWS} AS {call_rows_select()}")
    try:
        return CallSamples(_samples(con, "latency_bucket", n), _samples(con, "ttft_bucket", n))
    finally:
        con.execute(f"DROP TABLE {CALL_ROWS}")


def _samples(con: duckdb.DuckDBPyConnection, value: str, n: int) -> UnitBucketCounts:
    """Per (row, period, value bucket) the calls, in that order, a range of rows at a time (each part sorted here
    and the parts in row order: sorted as a whole), in the narrowest integers that hold them."""
    parts: list[tuple[np.ndarray, ...]] = []  # type: ignore[type-arg]
    for low in range(0, max(n, 1), SAMPLE_ROWS_PER_PART):
        found = con.execute(samples_select(value, low, low + SAMPLE_ROWS_PER_PART)).fetchnumpy()
        row, period, bucket, count = (np.asarray(found[c]) for c in ("row_id", "period", "value_bucket", "n"))
        order = np.lexsort((bucket, period, row))
        parts.append(
            (
                row[order].astype(np.int32),
                bucket[order].astype(np.int16),
                count[order].astype(np.int32),
                period[order].astype(np.int8),
            )
        )
    rows, buckets, counts, periods = (
        np.concatenate([part[i] for part in parts]) if parts else np.zeros(0, dtype)
        for i, dtype in enumerate((np.int32, np.int16, np.int32, np.int8))
    )
    return UnitBucketCounts(rows, buckets, counts, periods)


def _novelty(con: duckdb.DuckDBPyConnection, select: str, spec: Aggregation, n: int) -> NoveltyFold:
    """The novelty fold (:class:`NoveltyFold`) filled from the query's rows, each matrix by its nonzero cells
    (:class:`RowCells`): a row has calls in one or two of the buckets, and the dense matrices of ten million
    calls' 2.9 million rows were 364 MB, held from here to the end of the statistics."""
    index = UnitIndex()
    index.size = n
    metrics = [name for name, _ in spec.metrics]
    kinds = [kind for _, kind in spec.metrics]
    assert spec.novelty_ns is not None
    fold = NoveltyFold(
        index,
        kinds,
        [name if is_call_metric(name) else None for name in metrics],
        spec.novelty_ns,
        spec.novelty_buckets,
    )
    # Each matrix's column of the result, with its type: row_id, since, calls, then the metrics' columns.
    columns: list[tuple[int, type]] = [(2, np.float32)]
    for code, kind in enumerate(kinds):
        base = 3 + code * len(METRIC_PARTS)
        columns += [(base, np.float64), (base + 1, np.float32)]
        if kind.counts_positive_calls:
            columns.append((base + 2, np.float32))
    found: dict[int, list[tuple[npt.NDArray[np.int64], npt.NDArray[Any]]]] = {column: [] for column, _ in columns}
    # A batch at a time: the whole result at once was some 700 MB at ten million calls. The query groups on (row,
    # bucket): each cell comes once, so its value is the cell's.
    for batch in con.execute(select).to_arrow_reader(NOVELTY_ROWS_PER_BATCH):
        rows, since = (batch.column(i).to_numpy().astype(np.int64) for i in (0, 1))
        cells = rows * fold.buckets + since
        for column, dtype in columns:
            values = pc.fill_null(batch.column(column), 0).to_numpy(zero_copy_only=False).astype(dtype)
            nonzero = values != 0
            found[column].append((cells[nonzero], values[nonzero]))

    def cells_of(column: int, dtype: type) -> RowCells:
        parts = found.pop(column)
        at = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        values = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype)
        order = np.argsort(at, kind="stable")
        return RowCells(at[order], values[order], (n, fold.buckets))

    fold.calls = cells_of(*columns[0])
    for code, kind in enumerate(kinds):
        base = 3 + code * len(METRIC_PARTS)
        fold.sums[code] = cells_of(base, np.float64)
        fold.counts[code] = cells_of(base + 1, np.float32)
        if kind.counts_positive_calls:
            fold.positives[code] = cells_of(base + 2, np.float32)
    fold.capacity = n
    return fold


def _phase_info(con: duckdb.DuckDBPyConnection, archive: Archive, model: str, window: Window) -> dict[str, PhaseInfo]:
    """Each phase's weights and control, from the record of its first call (read back from the archive)."""
    firsts = con.execute(
        """SELECT phase, request_id, time_ns FROM (SELECT phase, request_id, time_ns, ROW_NUMBER() OVER (PARTITION
        BY phase ORDER BY time_ns, stream_ms, stream_seq) AS nth FROM exposed) AS e WHERE nth = 1 AND phase <> ''"""
    ).fetchall()
    found: dict[str, PhaseInfo] = {}
    for phase, request_id, time_ns in firsts:
        query = ArchiveQuery(model=model, since_ns=int(time_ns), until_ns=int(time_ns) + 1)
        table = read_calls(archive, query, columns=["request_id", "record"])
        table = table.filter(pc.equal(table["request_id"], request_id))
        info = aggregates.phase_info(phase, table["record"][0].as_py() if table.num_rows else None)
        if info is not None:
            found[phase] = info
    return found


def load_aggregates(
    path: Path, window: Window, kinds: Sequence[MetricKind], metrics: Sequence[str], *, per_call: bool
) -> Loaded:
    """The statistics' input from an ``--aggregates`` file (the query's output, written by another engine): its
    unit rows and phases; nothing of what it does not carry (calls not randomized, latency, streams, counts)."""
    with tempfile.TemporaryDirectory(prefix="splitstream-duckdb-") as temp_dir:
        con = connect(temp_dir)
        try:
            aggregates.open_aggregates(con, path, metrics)
            rows = aggregates.lay_out(con, metrics, kinds)
            infos = aggregates.phase_records(con)
        finally:
            con.close()
    folder = aggregates.folder_of(rows, kinds, metrics, window, per_call=per_call, exclude_crossover=True)
    calls = int(row_totals(rows.bucket_calls).sum())
    exposures = Exposures(
        units=rows.units(),
        bucket_calls=rows.bucket_calls,
        other=[],
        latency={},
        phase_info=infos,
        phases=rows.phases,
        arms=rows.arms,
        calls=calls,
        randomized_calls=calls,
    )
    return Loaded(exposures, Feedback(), folder, {})
