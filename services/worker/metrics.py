"""Prometheus metrics of one worker, in a registry the worker owns.

The per-request signal lives here rather than in logs. Metric objects are
created against the registry passed in (never prometheus_client's global
one), so several workers or tests in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

_Metric = TypeVar("_Metric", bound=MetricWrapperBase)

#: Rows per backend run; powers of two up to the largest batch sizes in use.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
#: From 50 µs to 10 s: CPU models answer in microseconds, big GPU batches in seconds.
SECONDS_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


class WorkerMetrics:
    """The worker's metrics, each already labelled with its model and version."""

    def __init__(self, registry: CollectorRegistry, *, model: str, version: str) -> None:
        labels = ("model", "version")
        self._registry = registry
        self._model = model
        self._version = version
        self._requests = Counter(
            "splitstream_worker_requests",
            "ModelInfer calls and ModelStreamInfer requests answered, by gRPC status code name.",
            (*labels, "status"),
            registry=registry,
        )
        self._inference_seconds = self._version_metric(
            Histogram,
            "splitstream_worker_inference_seconds",
            "Backend run time per batch.",
            buckets=SECONDS_BUCKETS,
        )
        self._queue_seconds = self._version_metric(
            Histogram,
            "splitstream_worker_queue_seconds",
            "Time a request waited before the backend run of its batch started.",
            buckets=SECONDS_BUCKETS,
        )
        self._batch_size = self._version_metric(
            Histogram,
            "splitstream_worker_batch_size",
            "Rows per backend run.",
            buckets=BATCH_SIZE_BUCKETS,
        )
        self._queue_depth = self._version_metric(
            Gauge,
            "splitstream_worker_queue_depth",
            "Requests waiting for a backend run.",
        )

        # Generative models (``generation:``): one backend run per step over every active sequence.
        self._step_sequences = self._version_metric(
            Histogram,
            "splitstream_worker_step_sequences",
            "Sequences stepped together in one backend run (in-flight batching): > 1 means shared steps.",
            buckets=BATCH_SIZE_BUCKETS,
        )
        self._step_seconds = self._version_metric(
            Histogram,
            "splitstream_worker_step_seconds",
            "Backend run time of one generation step.",
            buckets=SECONDS_BUCKETS,
        )
        self._tokens = self._version_metric(
            Counter,
            "splitstream_worker_tokens_generated",
            "Tokens generated (end tokens, which are not sent, not counted).",
        )
        self._generations = Counter(
            "splitstream_worker_generations",
            "Generations ended, by why: length (max_tokens), stop_word, end_id, cancelled (the client went "
            "away or cancelled), error.",
            (*labels, "outcome"),
            registry=registry,
        )
        self._generation_tokens = Histogram(
            "splitstream_worker_generation_tokens",
            "Tokens one generation produced before it ended (a cancelled one: how far it got).",
            (*labels, "outcome"),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
            registry=registry,
        )
        self._active_sequences = self._version_metric(
            Gauge,
            "splitstream_worker_active_sequences",
            "Sequences being stepped now.",
        )

        self._paused_sequences = self._version_metric(
            Gauge,
            "splitstream_worker_paused_sequences",
            "Active sequences left out of the steps because their client is not reading (their stream's "
            "queue is full) until it reads again.",
        )
        self._queued_responses = self._version_metric(
            Gauge,
            "splitstream_worker_stream_queued_responses",
            "Responses of token streams made and not yet handed to gRPC, summed over streams (each stream "
            "holds at most a fixed number: a client that does not read pauses its generations).",
        )

        self._engine_info = Gauge(
            "splitstream_worker_engine_info",
            "1 for the engine serving this version, labelled with its backend and human tag.",
            (*labels, "backend", "engine_tag"),
            registry=registry,
        )
        self._context_device_memory = Gauge(
            "splitstream_worker_context_device_memory_bytes",
            "Device memory one execution context holds (TensorRT: its activations plus its I/O buffers).",
            (*labels, "context"),
            registry=registry,
        )

    def _version_metric(self, kind: type[_Metric], name: str, documentation: str, **options: Any) -> _Metric:
        """A ``kind`` metric of this worker's model version alone: labelled with its model and version."""
        metric = kind(name, documentation, ("model", "version"), registry=self._registry, **options)
        return metric.labels(self._model, self._version)

    def engine_loaded(self, *, backend: str, engine_tag: str, context_device_memory_bytes: Sequence[int]) -> None:
        self._engine_info.labels(self._model, self._version, backend, engine_tag).set(1)
        for index, nbytes in enumerate(context_device_memory_bytes):
            self._context_device_memory.labels(self._model, self._version, str(index)).set(nbytes)

    def request_done(self, status: grpc.StatusCode) -> None:
        self._requests.labels(self._model, self._version, status.name).inc()

    def batch_ran(self, *, rows: int, seconds: float) -> None:
        self._batch_size.observe(rows)
        self._inference_seconds.observe(seconds)

    def queued(self, seconds: float) -> None:
        self._queue_seconds.observe(seconds)

    def step_ran(self, *, sequences: int, tokens: int, seconds: float) -> None:
        self._step_sequences.observe(sequences)
        self._step_seconds.observe(seconds)
        self._tokens.inc(tokens)

    def generation_ended(self, *, outcome: str, tokens: int) -> None:
        self._generations.labels(self._model, self._version, outcome).inc()
        self._generation_tokens.labels(self._model, self._version, outcome).observe(tokens)

    def watch_active_sequences(self, active: Callable[[], int]) -> None:
        self._active_sequences.set_function(active)

    def watch_paused_sequences(self, paused: Callable[[], int]) -> None:
        self._paused_sequences.set_function(paused)

    def watch_queued_responses(self, queued: Callable[[], int]) -> None:
        self._queued_responses.set_function(queued)

    def watch_queue_depth(self, depth: Callable[[], int]) -> None:
        """Report ``depth()`` at each scrape, so the queue needs no bookkeeping per request."""
        self._queue_depth.set_function(depth)
