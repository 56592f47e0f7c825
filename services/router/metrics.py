"""The router's Prometheus metrics, owned by one object (no module globals).

Label children are cached per (model, version, status): ``labels()`` costs a
lock and a dict build, which adds up at thousands of calls a second.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
#: Time to first token reaches seconds on a loaded LLM (queueing, long prompts): the tail needs buckets there.
TTFT_BUCKETS_S = (*LATENCY_BUCKETS_S, 10, 30, 60)
#: Gaps between tokens are milliseconds to tens of them (one decoding step each).
GAP_BUCKETS_S = (0.0001, 0.00025, *LATENCY_BUCKETS_S)
STREAM_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
RESPONSES_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _multiprocess() -> bool:
    """prometheus-client's multiprocess mode (a ``--processes`` child), by the test its own ``remove`` makes."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "splitstream_router_requests",
            "Calls answered, by model, served version and gRPC status",
            ["model", "version", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "splitstream_router_request_seconds",
            "Time from receiving a call to answering it",
            ["model", "version"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.retries = Counter(
            "splitstream_router_retries",
            "Calls retried on another endpoint after UNAVAILABLE",
            ["model", "version"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "splitstream_router_fallbacks",
            "Calls served by the control because their arm had no healthy endpoint",
            ["model", "arm", "version"],
            registry=self.registry,
        )
        self.ejections = Counter(
            "splitstream_router_endpoint_ejections",
            "Endpoints taken out of rotation by the circuit breaker",
            ["model", "version", "endpoint"],
            registry=self.registry,
        )
        self.upstream_tls_reloads = Counter(
            "splitstream_router_upstream_tls_reloads",
            "Times the --upstream-tls-* files were found changed (and usable); worker channels are then renewed",
            registry=self.registry,
        )
        self.upstream_channel_renewals = Counter(
            "splitstream_router_upstream_channel_renewals",
            "Worker channels replaced after a client TLS rotation (ok), not yet because the worker refused "
            "the new certificate or did not connect in time (deferred: retried at the next poll), or error",
            ["result"],
            registry=self.registry,
        )
        for result in ("ok", "deferred", "error"):
            self.upstream_channel_renewals.labels(result)
        self.registry_updates = Counter(
            "splitstream_router_registry_updates",
            "Registry states applied (ok), applied with invalid parts kept from before (partial), or rejected (error)",
            ["result"],
            registry=self.registry,
        )
        # With --processes N the parent's scrape merges the children's values: the worst live child here,
        # the live children's sum for what is in progress (prometheus-client's multiprocess modes).
        self.registry_healthy = Gauge(
            "splitstream_router_registry_healthy",
            "1 when the last registry read succeeded and was valid throughout, else 0",
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self.shadow_requests = Counter(
            "splitstream_router_shadow_requests",
            "Shadow copies answered, by model, shadow version and status",
            ["model", "version", "status"],
            registry=self.registry,
        )
        self.shadow_latency = Histogram(
            "splitstream_router_shadow_seconds",
            "Latency of shadow copies",
            ["model", "version"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.shadows_skipped = Counter(
            "splitstream_router_shadows_skipped",
            "Sampled shadow copies not sent",
            ["model", "reason"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "splitstream_router_in_flight",
            "Calls being forwarded now",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.received = Counter(
            "splitstream_router_calls_received",
            "Inference calls as they arrive, before gRPC reads the message: those gRPC refuses itself "
            "(too large, deadline gone) are counted here and in no requests_total",
            registry=self.registry,
        )
        self._answered: dict[tuple[str, str, str], tuple[Counter, Histogram]] = {}
        # Token streams (ModelStreamInfer), per model and served version. Times are the router's own: a
        # stream starts when its first request arrives, and a response counts when it is handed to gRPC
        # for the client (see splitstream.router.streams).
        self.streams = Counter(
            "splitstream_router_streams",
            "ModelStreamInfer streams ended, by model, served version and final gRPC status",
            ["model", "version", "status"],
            registry=self.registry,
        )
        self.streams_active = Gauge(
            "splitstream_router_streams_active",
            "ModelStreamInfer streams open now (routed to a version, not yet ended)",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.stream_ttft = Histogram(
            "splitstream_router_stream_ttft_seconds",
            "Time to first token: from the router receiving a stream's first request to relaying its first response",
            ["model", "version"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.stream_gap = Histogram(
            "splitstream_router_stream_gap_seconds",
            "Inter-token latency: time between two responses relayed on one stream",
            ["model", "version"],
            buckets=GAP_BUCKETS_S,
            registry=self.registry,
        )
        self.stream_responses = Histogram(
            "splitstream_router_stream_responses",
            "Responses relayed per stream",
            ["model", "version"],
            buckets=RESPONSES_BUCKETS,
            registry=self.registry,
        )
        self.stream_seconds = Histogram(
            "splitstream_router_stream_seconds",
            "Stream duration: from the first request to the final status",
            ["model", "version"],
            buckets=STREAM_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._streams: dict[tuple[str, str], StreamChildren] = {}
        # Set by the routing core whenever an arm's state may have changed, never computed at scrape time:
        # with --processes the parent's scrape reads the values the children last set (a collector run in a
        # child is never asked). An arm spilling in any live child is 1 on the parent.
        self.arm_spilling = Gauge(
            "splitstream_router_arm_spilling",
            "1 while an arm's version has no eligible endpoint, so its traffic goes to the control "
            "(or fails, for the control itself)",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self._arms: dict[tuple[str, str], bool] = {}

    def answered(self, model: str, version: str, status: str, latency_s: float) -> None:
        key = (model, version, status)
        children = self._answered.get(key)
        if children is None:
            children = (self.requests.labels(*key), self.latency.labels(model, version))
            self._answered[key] = children
        counter, histogram = children
        counter.inc()
        histogram.observe(latency_s)

    def stream_children(self, model: str, version: str) -> StreamChildren:
        """The per-version stream metrics, cached: ``labels()`` costs ~9 µs a call here, and a stream
        needs six of them."""
        key = (model, version)
        children = self._streams.get(key)
        if children is None:
            children = StreamChildren(
                active=self.streams_active.labels(model, version),
                ttft=self.stream_ttft.labels(model, version),
                gap=self.stream_gap.labels(model, version),
                responses=self.stream_responses.labels(model, version),
                seconds=self.stream_seconds.labels(model, version),
                ended={},
            )
            self._streams[key] = children
        return children

    def stream_ended(self, children: StreamChildren, model: str, version: str, status: str) -> None:
        counter = children.ended.get(status)
        if counter is None:
            counter = children.ended[status] = self.streams.labels(model, version, status)
        counter.inc()

    def set_arms(self, arms: Mapping[tuple[str, str], bool]) -> None:
        """``splitstream_router_arm_spilling``: every ``(model, arm version)`` now and whether it spills;
        arms no longer in ``arms`` are removed (with ``--processes``, where prometheus-client cannot
        remove a series, set to 0). Only changed values are written."""
        for key in self._arms.keys() - arms.keys():
            if _multiprocess():
                self.arm_spilling.labels(*key).set(0)
            else:
                self.arm_spilling.remove(*key)
        for key, spilling in arms.items():
            if self._arms.get(key) != spilling:
                self.arm_spilling.labels(*key).set(1 if spilling else 0)
        self._arms = dict(arms)


@dataclass(frozen=True, slots=True)
class StreamChildren:
    """One (model, version)'s stream metrics; ``ended`` caches the outcome counter per status."""

    active: Gauge
    ttft: Histogram
    gap: Histogram
    responses: Histogram
    seconds: Histogram
    ended: dict[str, Counter]
