"""The analysis's per-unit aggregation as SQL: written once (:mod:`.aggregation`), run on DuckDB over the
archive (:mod:`.duckdb_engine`), printed for another engine, and read back from that engine's output
(:mod:`.aggregates`)."""

#: ``--dialect``'s choices: sqlglot's names for them.
DIALECTS = ("duckdb", "spark", "trino", "bigquery")


class AggregatesError(ValueError):
    """An ``--aggregates`` file that is not the query's output: says which column is missing or of which type.
    Here rather than beside its reader, which imports DuckDB: the CLI catches it without importing that."""
