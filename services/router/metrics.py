"""The router's Prometheus metrics, owned by one object (no module globals).

Label children are cached per (model, version, status): ``labels()`` costs a
lock and a dict build, which adds up at thousands of calls a second.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


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
        self.registry_updates = Counter(
            "splitstream_router_registry_updates",
            "Registry states applied (ok), applied with invalid parts kept from before (partial), or rejected (error)",
            ["result"],
            registry=self.registry,
        )
        self.registry_healthy = Gauge(
            "splitstream_router_registry_healthy",
            "1 when the last registry read succeeded and was valid throughout, else 0",
            registry=self.registry,
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
        self.in_flight = Gauge("splitstream_router_in_flight", "Calls being forwarded now", registry=self.registry)
        self._answered: dict[tuple[str, str, str], tuple[Counter, Histogram]] = {}

    def answered(self, model: str, version: str, status: str, latency_s: float) -> None:
        key = (model, version, status)
        children = self._answered.get(key)
        if children is None:
            children = (self.requests.labels(*key), self.latency.labels(model, version))
            self._answered[key] = children
        counter, histogram = children
        counter.inc()
        histogram.observe(latency_s)
