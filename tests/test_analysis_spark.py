"""The analysis's printed SQL on a real distributed engine: a local PySpark session runs the Spark dialect of
``splitstream analyze --print-sql`` over the archive's own Parquet files, and ``--aggregates`` on what it wrote
gives the analysis DuckDB gives over the same archive (and the page reader, and Redis: test_analysis_sql.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from splitstream.analysis.sources import AggregatesSource, ArchiveSource
from splitstream.common.archive import CALLS, FEEDBACK, window_files
from tests.experiments import analyze_cli
from tests.test_analysis_sources import assert_same
from tests.test_analysis_sql import ELSEWHERE, HOUR_NS, MODEL, T0, Lab, carried, run, window_flags
from tests.test_analysis_sql import lab as lab  # the fixture: the archive the real archiver wrote


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if shutil.which("java") is None:
        pytest.fail("no java on PATH: install a Java runtime (.ci/run installs default-jre-headless)")
    from pyspark.sql import SparkSession

    warehouse = tmp_path_factory.mktemp("spark")
    session = (
        SparkSession.builder.master("local[2]")
        .appName("splitstream-sql")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.warehouse.dir", str(warehouse))
        .config("spark.driver.host", "127.0.0.1")
        # The archive's times are Parquet TIMESTAMP(NANOS): read as the integer nanoseconds the query expects.
        .config("spark.sql.legacy.parquet.nanosAsLong", "true")
        .getOrCreate()
    )
    try:
        yield session
    finally:
        session.stop()


@pytest.mark.slow
def test_spark_runs_the_printed_sql_and_aggregates_give_duckdbs_analysis(lab: Lab, spark: Any, tmp_path: Path) -> None:
    printed = analyze_cli(MODEL, "--print-sql", "--dialect", "spark", *window_flags(ELSEWHERE))
    assert printed.returncode == 0, printed.stderr
    for name, kind in (("calls", CALLS), ("feedback", FEEDBACK)):
        files = window_files(lab.archive, kind, MODEL, T0 - 2 * HOUR_NS, T0 + 4 * HOUR_NS)
        spark.read.parquet(*files).createOrReplaceTempView(name)
    out = tmp_path / "aggregates"
    spark.sql(printed.stdout).coalesce(1).write.parquet(str(out))
    (written,) = sorted(out.glob("part-*.parquet"))
    expected = carried(run(ArchiveSource(lab.archive), ELSEWHERE))
    assert expected["phases"][1]["srm"]  # the phases' weights came through the records Spark selected
    assert_same(carried(run(AggregatesSource(written), ELSEWHERE)), expected, "spark")
