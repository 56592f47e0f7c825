"""From the aggregation's output rows (:func:`splitstream.analysis.sql.aggregation.aggregation_query`: DuckDB's
result, or a cluster's written to Parquet or CSV for ``--aggregates``) to what the statistics read: the
:class:`~splitstream.analysis.loading.Exposures` rows and a :class:`~splitstream.analysis.folding.Folder` holding
the per-row, per-bucket sums, as the Redis reader leaves them, so :mod:`splitstream.analysis.analyze` is the same
whichever engine aggregated.

Rows are laid out in the order of ``(phase, arm, unit_is_call, unit)`` (``row_id``), and units become the
reader's fingerprints (:func:`~splitstream.analysis.loading.fingerprints`), so a unit is the same number as when
Redis is read (the CUPED pre-period and the units' order in the statistics depend on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from splitstream.analysis.arrays import RowCells, row_totals
from splitstream.analysis.folding import Folder
from splitstream.analysis.loading import (
    CALL_UNIT_SALT,
    TIMELINE_POINTS,
    Names,
    PhaseInfo,
    UnitIndex,
    Window,
    fingerprints,
    mixed,
)
from splitstream.analysis.sql import AggregatesError
from splitstream.analysis.sql.aggregation import METRIC_PARTS, metric_column
from splitstream.analysis.statistics import MetricKind
from splitstream.analysis.usage import is_call_metric
from splitstream.common.records import decode_record

#: The view the rows are read through (a DuckDB table or a file).
ROWS_VIEW = "aggregate_rows"
#: One row per (phase, arm, unit, unit_is_call) with its ``row_id`` (the layout of every per-row array) and first
#: call, and the unit rows with their ``row_id`` (:func:`lay_out` makes both).
ROW_INDEX = "row_index"
INDEXED_ROWS = "indexed_rows"
#: Rows of the layout read back at a time (their unit's text among them).
ROWS_PER_BATCH = 262_144


@dataclass(frozen=True, slots=True)
class Rows:
    """The unit rows laid out: per row its phase and arm codes, unit fingerprint, first call; calls and each
    metric's sums per time bucket."""

    phase: npt.NDArray[np.int16]
    arm: npt.NDArray[np.int16]
    unit: npt.NDArray[np.uint64]
    first_ns: npt.NDArray[np.int64]
    bucket_calls: RowCells
    sums: list[RowCells]
    counts: list[RowCells]
    positives: list[RowCells]
    phases: Names
    arms: Names

    def units(self) -> pa.Table:
        n = len(self.phase)
        return pa.table(
            {
                "phase": pa.array(self.phase, pa.int16()),
                "arm": pa.array(self.arm, pa.int16()),
                "unit": pa.array(self.unit, pa.uint64()),
                "calls": pa.array(row_totals(self.bucket_calls).astype(np.int64), pa.int64()),
                "first_ns": pa.array(self.first_ns, pa.int64()),
                "key": pa.array(np.arange(n, dtype=np.int64), pa.int64()),
            }
        )


def unit_fingerprints(units: Sequence[str], is_call: npt.NDArray[np.bool_]) -> npt.NDArray[np.uint64]:
    """The reader's unit of each row: the routing-key HMAC's fingerprint, or the call's (its request id's, salted)."""
    found = fingerprints([u.encode() for u in units])
    return np.where(is_call, mixed(found, CALL_UNIT_SALT), found)


def index_rows(con: duckdb.DuckDBPyConnection, units: str | None = None) -> int:
    """Number the rows of :data:`ROWS_VIEW` (:data:`ROW_INDEX`, :data:`INDEXED_ROWS`) and say how many there are.
    ``units``: the table numbering the units (``unit``, ``unit_id``) when the rows carry ``unit_id`` in place of
    the text (the DuckDB engine's); a file's rows (``--aggregates``) carry the text."""
    # Row ids numbered over the distinct rows (a unit's buckets share one), then given to every bucket's row.
    if units:
        # The DuckDB engine's rows carry their unit's number, which orders as (unit_is_call, unit) does: grouped,
        # joined and numbered on it, the text read once per row at the end. On the text, ten million calls' rows
        # did not fit in 512 MB.
        con.execute(
            f"""CREATE OR REPLACE TEMP TABLE {ROW_INDEX} AS SELECT *, ROW_NUMBER() OVER (ORDER BY phase, arm,
                unit_id) - 1 AS row_id FROM (SELECT phase, arm, unit_id, unit_is_call, MIN(first_ns) AS first_ns
                FROM {ROWS_VIEW} WHERE unit_id IS NOT NULL GROUP BY phase, arm, unit_id, unit_is_call) AS u"""
        )
        key = "unit_id"
    else:
        con.execute(
            f"""CREATE OR REPLACE TEMP TABLE {ROW_INDEX} AS SELECT phase, arm, unit, unit_is_call, first_ns,
                ROW_NUMBER() OVER (ORDER BY phase, arm, unit_is_call, unit) - 1 AS row_id FROM (SELECT phase, arm,
                unit, unit_is_call, MIN(first_ns) AS first_ns FROM {ROWS_VIEW} WHERE unit IS NOT NULL
                GROUP BY phase, arm, unit, unit_is_call) AS u"""
        )
        key = "unit"
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE {INDEXED_ROWS} AS SELECT r.*, i.row_id FROM {ROWS_VIEW} AS r
            JOIN {ROW_INDEX} AS i ON r.phase = i.phase AND r.arm = i.arm AND r.{key} = i.{key}
            AND r.unit_is_call = i.unit_is_call"""
    )
    found = con.execute(f"SELECT COUNT(*) FROM {ROW_INDEX}").fetchone()
    return int(found[0]) if found else 0


def lay_out(
    con: duckdb.DuckDBPyConnection,
    metrics: Sequence[str],
    kinds: Sequence[MetricKind],
    arm_order: Sequence[str] = (),
    units: str | None = None,
    *,
    indexed: int | None = None,
) -> Rows:
    """The rows of :data:`ROWS_VIEW` as arrays. ``arm_order``: arms in the order the reader would meet them
    (else by their first call). ``units``: as for :func:`index_rows`. ``indexed``: the rows' number where
    :func:`index_rows` has numbered them already (the DuckDB engine reads its side queries on them first)."""
    n = index_rows(con, units) if indexed is None else indexed
    if units:
        per_row_select = (
            f"SELECT i.row_id, i.phase, i.arm, u.unit, i.unit_is_call, i.first_ns FROM {ROW_INDEX} AS i"
            f" JOIN {units} AS u ON u.unit_id = i.unit_id ORDER BY i.row_id"
        )
    else:
        per_row_select = f"SELECT row_id, phase, arm, unit, unit_is_call, first_ns FROM {ROW_INDEX} ORDER BY row_id"
    phases, arms = Names(), Names()
    # Codes in the order of each phase's and arm's first call, as the reader meets them.
    for field in ("phase", "arm"):
        names = arms if field == "arm" else phases
        for name in arm_order if field == "arm" else ():
            names.code(name.encode())
        for (name,) in con.execute(
            f"SELECT {field} FROM {ROW_INDEX} GROUP BY {field} ORDER BY MIN(first_ns), {field}"
        ).fetchall():
            names.code(name.encode())
    phase, arm = np.zeros(n, np.int16), np.zeros(n, np.int16)
    unit, first_ns = np.zeros(n, np.uint64), np.zeros(n, np.int64)
    # A batch of rows at a time: the units' text and its Python strings for the fingerprints, for every row at
    # once, were more than a gigabyte at ten million calls (2.9 million rows).
    start = 0
    for batch in con.execute(per_row_select).to_arrow_reader(ROWS_PER_BATCH):
        end = start + batch.num_rows
        for column, names, codes in ((1, phases, phase), (2, arms, arm)):
            encoded = pc.dictionary_encode(batch.column(column))
            mapping = np.array([names.codes[v.encode()] for v in encoded.dictionary.to_pylist()], dtype=np.int16)
            codes[start:end] = mapping[encoded.indices.to_numpy()] if len(mapping) else 0
        is_call = batch.column(4).to_numpy(zero_copy_only=False).astype(bool)
        unit[start:end] = unit_fingerprints(batch.column(3).to_pylist(), is_call)
        first_ns[start:end] = batch.column(5).to_numpy(zero_copy_only=False).astype(np.int64)
        start = end
    # The DuckDB engine's rows are grouped on (phase, arm, unit, bucket): one per cell. A file's may hold a cell
    # in a few rows (another engine's output): added up.
    unique_cells = units is not None

    def matrix(column: str, dtype: type) -> RowCells:
        # One column at a time, its zeros left out: the whole output at once (every metric's three columns beside
        # the row and bucket) was over a gigabyte at ten million calls, most of it zeros.
        quoted = '"' + column.replace('"', '""') + '"'
        cells = con.execute(
            f"SELECT row_id * {TIMELINE_POINTS} + bucket AS at, {quoted} FROM {INDEXED_ROWS}"
            f" WHERE {quoted} IS NOT NULL AND {quoted} <> 0"
        ).to_arrow_table()
        at = cells.column(0).to_numpy().astype(np.int64, copy=False)
        values = np.nan_to_num(cells.column(1).to_numpy(zero_copy_only=False).astype(dtype))
        del cells
        if unique_cells:
            order = np.argsort(at, kind="stable")
            return RowCells(at[order], values[order], (n, TIMELINE_POINTS))
        # Added in float64 and rounded once: a cell is one output row, or a few whole counts, so this gives what
        # adding in ``dtype`` gave.
        distinct, inverse = np.unique(at, return_inverse=True)
        summed = np.bincount(inverse.reshape(-1), weights=values.astype(np.float64), minlength=len(distinct))
        return RowCells(distinct, summed.astype(dtype), (n, TIMELINE_POINTS))

    bucket_calls = matrix("calls", np.int32)
    sums, counts, positives = [], [], []
    for name, kind in zip(metrics, kinds, strict=True):
        sums.append(matrix(metric_column(name, "sum"), np.float64))
        counts.append(matrix(metric_column(name, "count"), np.float32))
        positives.append(
            matrix(metric_column(name, "positives"), np.float32)
            if kind.counts_positive_calls
            else RowCells.empty(n, TIMELINE_POINTS, np.float32)
        )
    return Rows(phase, arm, unit, first_ns, bucket_calls, sums, counts, positives, phases, arms)


def folder_of(
    rows: Rows,
    kinds: Sequence[MetricKind],
    metrics: Sequence[str],
    window: Window,
    *,
    per_call: bool,
    exclude_crossover: bool,
    used: int = 0,
    unknown: int = 0,
    not_randomized: int = 0,
) -> Folder:
    """A :class:`Folder` holding the rows' sums, finished as the reader's is (crossover units left out)."""
    index = UnitIndex()
    index.size = len(rows.phase)
    folder = Folder(
        index,
        kinds,
        window,
        per_call=per_call,
        exclude_crossover=exclude_crossover,
        joining=False,
        from_calls=[name if is_call_metric(name) else None for name in metrics],
    )
    folder.rows = folder.capacity = index.size
    folder.sums, folder.counts = list(rows.sums), list(rows.counts)
    folder.positives = [
        p if kind.counts_positive_calls else RowCells.empty(index.size, TIMELINE_POINTS, np.float32)
        for p, kind in zip(rows.positives, kinds, strict=True)
    ]
    folder.used, folder.unknown, folder.not_randomized = used, unknown, not_randomized
    folder.finish(rows.units())
    return folder


def phase_info(phase: str, record: bytes | None) -> PhaseInfo | None:
    """A phase's weights and control from one of its records (:meth:`ExposureReader.note_record`)."""
    if not phase or not record:
        return None
    try:
        decoded = decode_record(record)
    except Exception:  # UnsupportedSchema, protobuf's DecodeError: the phase goes without weights
        return None
    weights = {version: float(weight) for version, weight in sorted(decoded.phase.weights.items())}
    return PhaseInfo(phase, weights, decoded.phase.control)


# -- --aggregates FILE --------------------------------------------------------------------------------------------

#: What each column of the output must hold (DuckDB's types, read from the file): text, integers, numbers, flags.
_TEXT, _INTEGER, _NUMBER, _FLAG = "text", "integer", "number", "boolean"


def _expected(metrics: Sequence[str]) -> dict[str, str]:
    kinds = {
        "phase": _TEXT,
        "arm": _TEXT,
        "unit": _TEXT,
        "unit_is_call": _FLAG,
        "bucket": _INTEGER,
        "calls": _INTEGER,
        "first_ns": _INTEGER,
        "phase_record": _TEXT,
    }
    for name in metrics:
        for part in METRIC_PARTS:
            kinds[metric_column(name, part)] = _NUMBER if part == "sum" else _INTEGER
    return kinds


def _kind_of(duck_type: str) -> set[str]:
    """Which of the column kinds a DuckDB type can hold (an all-null CSV column reads as text: anything)."""
    upper = duck_type.upper()
    if upper in ("BOOLEAN",):
        return {_FLAG}
    if any(upper.startswith(t) for t in ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT",
                                          "USMALLINT", "UINTEGER", "UBIGINT")):  # fmt: skip
        return {_INTEGER, _NUMBER}
    if any(upper.startswith(t) for t in ("DOUBLE", "FLOAT", "REAL", "DECIMAL")):
        return {_NUMBER}
    if upper in ("VARCHAR", "BLOB"):
        return {_TEXT}
    if upper == "NULL":
        return {_TEXT, _INTEGER, _NUMBER, _FLAG}
    return set()


def open_aggregates(con: duckdb.DuckDBPyConnection, path: Path, metrics: Sequence[str]) -> None:
    """Make ``path`` (Parquet or CSV, by its content) the view :data:`ROWS_VIEW`; AggregatesError naming the first
    column that is missing or of a type it cannot be."""
    if not path.is_file():
        raise AggregatesError(f"--aggregates {path}: no such file")
    with path.open("rb") as head:
        parquet = head.read(4) == b"PAR1"
    reader = "read_parquet" if parquet else "read_csv"
    options = "" if parquet else ", header = true, auto_detect = true"
    literal = "'" + str(path).replace("'", "''") + "'"
    try:
        described = con.execute(f"DESCRIBE SELECT * FROM {reader}({literal}{options})").fetchall()
    except duckdb.Error as error:
        raise AggregatesError(f"--aggregates {path}: not a Parquet or CSV file DuckDB can read ({error})") from None
    found = {str(row[0]): str(row[1]) for row in described}
    for column, kind in _expected(metrics).items():
        if column not in found:
            raise AggregatesError(f"--aggregates {path}: column {column!r} is missing (the query's output has it)")
        if kind not in _kind_of(found[column]):
            raise AggregatesError(f"--aggregates {path}: column {column!r} is {found[column]}, expected {kind}")
    con.execute(f"CREATE OR REPLACE VIEW {ROWS_VIEW} AS SELECT * FROM {reader}({literal}{options})")


def phase_records(con: duckdb.DuckDBPyConnection) -> dict[str, PhaseInfo]:
    """The phases' weights and control from the phase rows (``unit`` null) of :data:`ROWS_VIEW`."""
    found: dict[str, PhaseInfo] = {}
    for phase, record in con.execute(
        f"SELECT phase, CAST(phase_record AS VARCHAR) FROM {ROWS_VIEW} WHERE unit IS NULL AND phase_record IS NOT NULL"
    ).fetchall():
        try:
            data = bytes.fromhex(record)
        except ValueError:
            continue
        info = phase_info(phase, data)
        if info is not None and phase not in found:
            found[phase] = info
    return found
