"""Reading the routers' Prometheus metrics for one model, as a rollout judges a step.

Per router and version it reads ``splitstream_router_requests_total{model,version,status}``
and the ``splitstream_router_request_seconds`` histogram buckets. A step is judged
on the *difference* between two scrapes of each router (so only the calls of that
interval count), summed over routers. A counter that went down means the router
restarted; its new value is the whole delta, as Prometheus' ``rate()`` assumes.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

REQUESTS = "splitstream_router_requests_total"
BUCKETS = "splitstream_router_request_seconds_bucket"
#: Statuses that say the client sent something wrong (or gave up), not that the version failed.
CLIENT_STATUSES = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "CANCELLED"})


@dataclass
class VersionCounts:
    """Calls of one version: answered, failed, and the cumulative latency histogram (``le`` → count)."""

    calls: float = 0.0
    errors: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        return self.errors / self.calls if self.calls else 0.0

    def quantile(self, q: float) -> float | None:
        """Like PromQL's ``histogram_quantile``: linear inside the bucket; the highest finite bound if in +Inf."""
        bounds = sorted(self.buckets)
        if not bounds:
            return None
        total = self.buckets[bounds[-1]]
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound in bounds:
            count = self.buckets[bound]
            if count >= rank:
                if math.isinf(bound):
                    finite = [b for b in bounds if not math.isinf(b)]
                    return finite[-1] if finite else None
                if count == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
            lower_bound, lower_count = bound, count
        return None

    def minus(self, earlier: VersionCounts) -> VersionCounts:
        if self.calls < earlier.calls:  # the router restarted: everything it counted is new
            return VersionCounts(self.calls, self.errors, dict(self.buckets))
        return VersionCounts(
            self.calls - earlier.calls,
            self.errors - earlier.errors,
            {le: count - earlier.buckets.get(le, 0.0) for le, count in self.buckets.items()},
        )

    def add(self, other: VersionCounts) -> None:
        self.calls += other.calls
        self.errors += other.errors
        for le, count in other.buckets.items():
            self.buckets[le] = self.buckets.get(le, 0.0) + count


#: One scrape: router URL → version → counts.
Snapshot = dict[str, dict[str, VersionCounts]]


def parse(text: str, model: str) -> dict[str, VersionCounts]:
    """The counts of ``model``'s versions in one router's exposition text."""
    versions: dict[str, VersionCounts] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("model") != model or "version" not in labels:
                continue
            counts = versions.setdefault(labels["version"], VersionCounts())
            if sample.name == REQUESTS:
                counts.calls += sample.value
                if labels.get("status") not in CLIENT_STATUSES:
                    counts.errors += sample.value
            elif sample.name == BUCKETS:
                le = float(labels["le"])
                counts.buckets[le] = counts.buckets.get(le, 0.0) + sample.value
    return versions


def scrape(urls: Iterable[str], model: str, *, timeout_s: float = 5.0) -> Snapshot:
    """Read every router; raises OSError (URLError included) naming the router that did not answer."""
    snapshot: Snapshot = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                text = response.read().decode()
        except OSError as error:
            raise OSError(f"cannot read metrics from {url}: {getattr(error, 'reason', error)}") from None
        snapshot[url] = parse(text, model)
    return snapshot


def interval(before: Snapshot, after: Snapshot) -> dict[str, VersionCounts]:
    """Calls between two snapshots, per version, summed over routers."""
    total: dict[str, VersionCounts] = {}
    for url, versions in after.items():
        earlier: Mapping[str, VersionCounts] = before.get(url, {})
        for version, counts in versions.items():
            total.setdefault(version, VersionCounts()).add(counts.minus(earlier.get(version, VersionCounts())))
    return total


def metrics_url(text: str) -> str:
    """``host:port`` or a URL → the URL of ``/metrics``."""
    if "://" not in text:
        text = f"http://{text}"
    if text.rstrip("/").count("/") == 2:  # no path given
        text = text.rstrip("/") + "/metrics"
    return text
