"""The analysis's per-unit aggregation as SQL: written once (:mod:`.aggregation`), run on DuckDB over the
archive (:mod:`.duckdb_engine`), printed for another engine, and read back from that engine's output
(:mod:`.aggregates`)."""

#: ``--dialect``'s choices: sqlglot's names for them.
DIALECTS = ("duckdb", "spark", "trino", "bigquery")
