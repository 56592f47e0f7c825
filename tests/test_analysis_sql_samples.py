"""The DuckDB engine's latency samples, grouped a range of rows at a time: the (row, period, bucket) counts the
page reader's :class:`UnitBuckets` keeps for the same calls, in its order, however the rows are cut."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from splitstream.analysis.sql import duckdb_engine
from splitstream.analysis.sql.aggregation import CALL_ROWS
from splitstream.analysis.unit_buckets import UnitBuckets


@pytest.mark.parametrize("part", [1, 7, 1000])
def test_samples_in_parts_are_the_page_readers_unit_buckets(monkeypatch: pytest.MonkeyPatch, part: int) -> None:
    rng = np.random.default_rng(part)
    n, calls = 50, 2_000
    rows = rng.integers(0, n, calls)
    periods = rng.integers(0, 20, calls)
    buckets = rng.integers(0, 40, calls)
    con = duckdb.connect()
    con.execute(
        f"CREATE TABLE {CALL_ROWS} (row_id INTEGER, period TINYINT, latency_bucket SMALLINT, ttft_bucket SMALLINT)"
    )
    con.executemany(
        f"INSERT INTO {CALL_ROWS} VALUES (?, ?, ?, NULL)",
        [(int(r), int(p), int(b)) for r, p, b in zip(rows, periods, buckets, strict=True)],
    )
    monkeypatch.setattr(duckdb_engine, "SAMPLE_ROWS_PER_PART", part)
    got = duckdb_engine._samples(con, "latency_bucket", n)
    reader = UnitBuckets(merge_after=100)
    reader.add(rows, buckets, periods)
    expected = reader.result()
    for name in ("rows", "buckets", "counts", "periods"):
        assert getattr(got, name).tolist() == getattr(expected, name).tolist(), name
    assert not len(duckdb_engine._samples(con, "ttft_bucket", n).rows)
