"""The archiver's Prometheus metrics, owned by one object (no module globals).

With ``--processes N`` the parent's scrape merges the children's (prometheus-client's multiprocess
mode): counters add up; the lag gauges say the same of the shared group in every child, so the live
children's largest is shown; the buffered entries are each child's own, so the live ones' sum."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ArchiverMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.records = Counter(
            "splitstream_archive_records",
            "Stream entries archived and acknowledged, by model and kind (calls, feedback)",
            ["model", "kind"],
            registry=self.registry,
        )
        self.bytes = Counter(
            "splitstream_archive_bytes",
            "Bytes of Parquet written (compressed, as stored)",
            ["model", "kind"],
            registry=self.registry,
        )
        self.files = Counter(
            "splitstream_archive_files", "Parquet files written", ["model", "kind"], registry=self.registry
        )
        self.upload_errors = Counter(
            "splitstream_archive_upload_errors",
            "Files whose write or upload failed (retried with backoff; nothing is acknowledged until it succeeds)",
            registry=self.registry,
        )
        self.redis_errors = Counter(
            "splitstream_archive_redis_errors", "Redis commands that failed (retried)", registry=self.registry
        )
        self.claimed = Counter(
            "splitstream_archive_claimed",
            "Entries taken over (XAUTOCLAIM) from an archiver that left them pending too long (crashed)",
            registry=self.registry,
        )
        self.corrupt = Counter(
            "splitstream_archive_corrupt_entries",
            "Entries whose record does not decode: archived with their readable fields and raw bytes",
            registry=self.registry,
        )
        self.missing_blobs = Counter(
            "splitstream_archive_missing_blobs",
            "Payloads whose blob was gone from Redis when archived (kept as a reference only)",
            registry=self.registry,
        )
        self.skipped_streams = Counter(
            "splitstream_archive_skipped_streams",
            "Streams not archived: their name is not UTF-8, so names no model (each counted once)",
            registry=self.registry,
        )
        self.lag_entries = Gauge(
            "splitstream_archive_lag_entries",
            "Entries in the stream not archived yet (not delivered to any archiver, or pending)",
            ["stream"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.lag_seconds = Gauge(
            "splitstream_archive_lag_seconds",
            "Age of the oldest entry not archived yet (0 when the archive has caught up)",
            ["stream"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.buffered = Gauge(
            "splitstream_archive_buffered_entries",
            "Entries read and held for the next file (pending in Redis until it is written)",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
