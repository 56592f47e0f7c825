"""The recorder's Prometheus metrics, owned by one object (no module globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WRITE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class RecorderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.records_written = Counter(
            "splitstream_recorder_records_written",
            "Records Redis confirmed, by model",
            ["model"],
            registry=self.registry,
        )
        self.blobs_written = Counter(
            "splitstream_recorder_blobs_written",
            "New blobs stored (a payload seen before only has its TTL refreshed)",
            registry=self.registry,
        )
        self.batches = Counter(
            "splitstream_recorder_batches",
            "Batches handled: ok (written and acknowledged, rejected records named), invalid (not a RecordBatch), "
            "redis_error (not acknowledged)",
            ["result"],
            registry=self.registry,
        )
        self.redis_errors = Counter(
            "splitstream_recorder_redis_errors",
            "Redis commands or pings that failed (connection, timeout, error reply)",
            registry=self.registry,
        )
        self.records_rejected = Counter(
            "splitstream_recorder_records_rejected",
            "Records refused alone (malformed, or unreadable where a redaction rule must read them); "
            "named in the batch's ack, the rest of the batch is written",
            registry=self.registry,
        )
        self.feedback_written = Counter(
            "splitstream_recorder_feedback_written",
            "Outcome events written to splitstream:feedback:<model>, by model",
            ["model"],
            registry=self.registry,
        )
        self.feedback_duplicates = Counter(
            "splitstream_recorder_feedback_duplicates",
            "Outcome events not written because their idempotency key (per model and metric) was seen before",
            ["model"],
            registry=self.registry,
        )
        self.trims_held_by_archive = Counter(
            "splitstream_recorder_trims_held_by_archive",
            "Retention trims (one per stream per batch) that --trim-archived held back because the archive "
            "had not caught up; rising steadily: the archiver is down or behind, and Redis grows",
            registry=self.registry,
        )
        self.feedback_rejected = Counter(
            "splitstream_recorder_feedback_rejected",
            "Outcome events refused alone (malformed, a plain routing key, a bad metric name, ...); named in the ack",
            registry=self.registry,
        )
        self.write_seconds = Histogram(
            "splitstream_recorder_write_seconds",
            "Time Redis took to confirm one batch (blob round, if any, plus the pipelined XADDs)",
            buckets=WRITE_BUCKETS_S,
            registry=self.registry,
        )
        self.redis_up = Gauge(
            "splitstream_recorder_redis_up",
            "1 while Redis answers PING and took the last batch written, else 0; health follows it",
            registry=self.registry,
            multiprocess_mode="livemin",  # --processes: the worst live child
        )
        self.redis_writable = Gauge(
            "splitstream_recorder_redis_writable",
            "0 after Redis refused a write (maxmemory with noeviction, read-only replica, MISCONF) until a "
            "batch is written again, else 1; health is NOT_SERVING meanwhile",
            registry=self.registry,
            multiprocess_mode="livemin",  # --processes: the worst live child
        )
        self.streams = Gauge(
            "splitstream_recorder_open_streams",
            "Record streams (one per connected router) open now",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.unauthenticated = Counter(
            "splitstream_recorder_unauthenticated_calls",
            "Calls refused UNAUTHENTICATED before any of their messages was read: missing or invalid service "
            "token (or client certificate not allowed)",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("missing", "invalid", "identity"):
            self.unauthenticated.labels(reason)
        for result in ("ok", "invalid", "redis_error"):
            self.batches.labels(result)
