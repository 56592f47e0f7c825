"""splitstream-archive: every recorded call and outcome event, kept as Parquet on object storage."""
