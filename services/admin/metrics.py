"""Reading the routers' Prometheus metrics for one model, as a rollout judges a step.

Per router and version it reads ``splitstream_router_requests_total{model,version,status}``
and the ``splitstream_router_request_seconds`` histogram buckets; for token streams,
``splitstream_router_streams_total{model,version,status}`` (a stream counts as one call, its
final status as the call's) and the time-to-first-token and inter-token gap histograms. A step is judged
on the *difference* between two scrapes of each router (so only the calls of that
interval count), summed over routers. A counter that went down means the router
restarted; its new value is the whole delta, as Prometheus' ``rate()`` assumes.
"""

from __future__ import annotations

import math
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REQUESTS = "splitstream_router_requests_total"
BUCKETS = "splitstream_router_request_seconds_bucket"
STREAMS = "splitstream_router_streams_total"
TTFT_BUCKETS = "splitstream_router_stream_ttft_seconds_bucket"
GAP_BUCKETS = "splitstream_router_stream_gap_seconds_bucket"
#: Statuses that say the client sent something wrong (or gave up), not that the version failed.
CLIENT_STATUSES = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "CANCELLED"})


@dataclass
class VersionCounts:
    """Calls of one version: answered (unary calls and streams), failed, and cumulative histograms
    (``le`` → count) of unary latency, time to first token and inter-token gaps."""

    calls: float = 0.0
    errors: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)
    ttft: dict[float, float] = field(default_factory=dict)
    gaps: dict[float, float] = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        return self.errors / self.calls if self.calls else 0.0

    def quantile(self, q: float) -> float | None:
        """Of unary latency; like PromQL's ``histogram_quantile`` (see :func:`quantile`)."""
        return quantile(self.buckets, q)

    def minus(self, earlier: VersionCounts) -> VersionCounts:
        if self.calls < earlier.calls:  # the router restarted: everything it counted is new
            return VersionCounts(self.calls, self.errors, dict(self.buckets), dict(self.ttft), dict(self.gaps))
        return VersionCounts(
            self.calls - earlier.calls,
            self.errors - earlier.errors,
            _minus(self.buckets, earlier.buckets),
            _minus(self.ttft, earlier.ttft),
            _minus(self.gaps, earlier.gaps),
        )

    def add(self, other: VersionCounts) -> None:
        self.calls += other.calls
        self.errors += other.errors
        for mine, theirs in ((self.buckets, other.buckets), (self.ttft, other.ttft), (self.gaps, other.gaps)):
            for le, count in theirs.items():
                mine[le] = mine.get(le, 0.0) + count


def quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """Like PromQL's ``histogram_quantile``: linear inside the bucket; the highest finite bound if in +Inf.
    None for an empty histogram."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                finite = [b for b in bounds if not math.isinf(b)]
                return finite[-1] if finite else None
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return None


def observations(buckets: Mapping[float, float]) -> float:
    """How many values a cumulative histogram holds (its +Inf bucket)."""
    return buckets.get(math.inf, 0.0)


def _minus(later: Mapping[float, float], earlier: Mapping[float, float]) -> dict[float, float]:
    return {le: count - earlier.get(le, 0.0) for le, count in later.items()}


_HISTOGRAMS = {BUCKETS: "buckets", TTFT_BUCKETS: "ttft", GAP_BUCKETS: "gaps"}


class NotMetrics(ValueError):
    """A URL answered, but not with a router's metrics (a web page, another exporter): the --metrics
    flag names the wrong thing, which no retry or wait will mend."""


#: One scrape: router URL → version → counts.
Snapshot = dict[str, dict[str, VersionCounts]]


def parse(text: str, model: str) -> dict[str, VersionCounts]:
    """The counts of ``model``'s versions in one router's exposition text; NotMetrics for text that is not
    Prometheus exposition or not a router's (every router declares its requests counter, calls or none)."""
    versions: dict[str, VersionCounts] = {}
    router = False
    try:
        for family in text_string_to_metric_families(text):
            router = router or family.name == REQUESTS.removesuffix("_total")
            _add_family(family.samples, model, versions)
    except (ValueError, KeyError) as error:  # the parser's, and a bucket's ``le`` missing or not a number
        raise NotMetrics(f"not Prometheus text ({' '.join(str(error).split())[:120]})") from None
    if not router:
        raise NotMetrics(f"not a splitstream router's metrics (no {REQUESTS})")
    return versions


def _add_family(samples: Iterable[Any], model: str, versions: dict[str, VersionCounts]) -> None:
    for sample in samples:
        labels = sample.labels
        if labels.get("model") != model or "version" not in labels:
            continue
        counts = versions.setdefault(labels["version"], VersionCounts())
        if sample.name in (REQUESTS, STREAMS):
            counts.calls += sample.value
            if labels.get("status") not in CLIENT_STATUSES:
                counts.errors += sample.value
        elif sample.name in _HISTOGRAMS:
            histogram = getattr(counts, _HISTOGRAMS[sample.name])
            le = float(labels["le"])
            histogram[le] = histogram.get(le, 0.0) + sample.value


def scrape(urls: Iterable[str], model: str, *, timeout_s: float = 5.0) -> Snapshot:
    """Read every router; raises OSError (URLError included) naming the router that did not answer, and
    NotMetrics naming the one whose answer is not a router's metrics."""
    snapshot: Snapshot = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                body = response.read()
        except OSError as error:
            raise OSError(f"cannot read metrics from {url}: {getattr(error, 'reason', error)}") from None
        try:
            snapshot[url] = parse(body.decode(), model)
        except (NotMetrics, UnicodeDecodeError) as error:
            reason = error if isinstance(error, NotMetrics) else "not Prometheus text (not UTF-8)"
            raise NotMetrics(f"{url} answered {reason}") from None
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
    """``host:port`` or a URL → the URL of ``/metrics``; ValueError naming what is wrong with one that
    could never be read (urllib would only say so at the first scrape, as a traceback)."""
    url = text.strip()
    if "://" not in url:
        url = f"http://{url}"
    if url.rstrip("/").count("/") == 2:  # no path given
        url = url.rstrip("/") + "/metrics"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as error:  # a bad IPv6 literal, a port not a number or past 65535
        raise ValueError(f"--metrics {text!r}: {error}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"--metrics {text!r}: a router's /metrics is read over http:// or https://")
    if not parts.hostname or port == 0:
        raise ValueError(f"--metrics {text!r}: expected HOST:PORT or a URL, e.g. 127.0.0.1:8002")
    return url


def router_key(url: str) -> tuple[str, str, int, str, str]:
    """What tells two ``--metrics`` URLs (as :func:`metrics_url` makes them) apart: scheme, host (case is
    not), port (the scheme's default when none is given), path (a trailing slash is not) and query. Two
    URLs of one key read one router; summed, its calls and errors were counted twice."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/") or "/", parts.query


def distinct_routers(urls: Iterable[str]) -> tuple[tuple[str, ...], list[tuple[str, str]]]:
    """The URLs with each router once (the first URL naming it kept), and (dropped, kept) for the others."""
    kept: dict[tuple[str, str, int, str, str], str] = {}
    dropped: list[tuple[str, str]] = []
    for url in urls:
        key = router_key(url)
        if key in kept:
            dropped.append((url, kept[key]))
        else:
            kept[key] = url
    return tuple(kept.values()), dropped
