"""Aggregates that stay the same size however many calls a replay sends.

A replay of millions of calls must not keep millions of latencies: distributions go into a
:class:`LogHistogram` (buckets 2 % wide, so quantiles are within ~1 % of the exact value),
counters into dicts, and only the worst calls into a bounded heap.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from splitstream.replayer.compare import CallDiff, OutputDiff
from splitstream.replayer.summary import GroupSummary, LatencyComparison, OutputSummary, Quantiles, rate


class LogHistogram:
    """Counts of non-negative values (seconds) in logarithmic buckets from ``floor_s`` up.

    Values at or below ``floor_s`` share the first bucket; quantiles return the bucket's
    geometric middle clamped to the exact min/max seen."""

    GROWTH = 1.02

    def __init__(self, floor_s: float = 1e-6) -> None:
        self.floor_s = floor_s
        self.counts: Counter[int] = Counter()
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, value_s: float) -> None:
        value_s = max(value_s, 0.0)
        self.counts[self._bucket(value_s)] += 1
        self.count += 1
        self.total += value_s
        self.min = min(self.min, value_s)
        self.max = max(self.max, value_s)

    def _bucket(self, value_s: float) -> int:
        if value_s <= self.floor_s:
            return 0
        return 1 + int(math.log(value_s / self.floor_s) / math.log(self.GROWTH))

    def bucket_bounds(self, bucket: int) -> tuple[float, float]:
        if bucket == 0:
            return (0.0, self.floor_s)
        return (self.floor_s * self.GROWTH ** (bucket - 1), self.floor_s * self.GROWTH**bucket)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1), or None when empty."""
        if not self.count:
            return None
        if q >= 1.0:
            return self.max
        rank = q * self.count
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                low, high = self.bucket_bounds(bucket)
                middle = math.sqrt(low * high) if low > 0 else high
                return min(max(middle, self.min), self.max)
        return self.max

    def cdf_points(self) -> list[tuple[float, float]]:
        """(upper bound s, cumulative fraction) per non-empty bucket: what the report plots."""
        points = []
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            points.append((min(self.bucket_bounds(bucket)[1], self.max), seen / self.count))
        return points

    def quantiles_ms(self) -> Quantiles:
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 4)

        return Quantiles(
            count=self.count,
            p50_ms=ms(self.quantile(0.50)),
            p95_ms=ms(self.quantile(0.95)),
            p99_ms=ms(self.quantile(0.99)),
            max_ms=ms(self.max if self.count else None),
            mean_ms=ms(self.total / self.count if self.count else None),
        )


@dataclass
class OutputTotals:
    """One output name across every call where both sides answered OK: compared (``calls``), or left
    out and counted by why in ``not_compared`` (``redacted_at_recording``, ``response_not_recorded``)."""

    calls: int = 0
    mismatched_calls: int = 0
    elements: int = 0
    mismatched_elements: int = 0
    nonfinite_mismatches: int = 0
    #: None until a numeric element was compared (BOOL and BYTES outputs have no error size).
    max_abs_error: float | None = None
    reasons: Counter[str] = field(default_factory=Counter)
    argmax_rows: float = 0.0
    argmax_calls: int = 0
    topk_rows: float = 0.0
    not_compared: Counter[str] = field(default_factory=Counter)

    def add(self, diff: OutputDiff) -> None:
        self.calls += 1
        self.elements += diff.elements
        self.mismatched_elements += diff.mismatches
        self.nonfinite_mismatches += diff.nonfinite_mismatches
        if not diff.match:
            self.mismatched_calls += 1
            self.reasons[diff.reason] += 1
        if diff.max_abs_error is not None:
            self.max_abs_error = max(self.max_abs_error or 0.0, diff.max_abs_error)
        if diff.argmax_agreement is not None:
            self.argmax_calls += 1
            self.argmax_rows += diff.argmax_agreement
            self.topk_rows += diff.topk_agreement or 0.0

    def summary(self) -> OutputSummary:
        return OutputSummary(
            calls=self.calls,
            mismatched_calls=self.mismatched_calls,
            mismatch_rate=rate(self.mismatched_calls, self.calls),
            element_mismatch_rate=rate(self.mismatched_elements, self.elements),
            max_abs_error=self.max_abs_error,
            reasons=dict(sorted(self.reasons.items())),
            nonfinite_mismatches=self.nonfinite_mismatches,
            not_compared=dict(sorted(self.not_compared.items())),
            argmax_agreement=round(self.argmax_rows / self.argmax_calls, 6) if self.argmax_calls else None,
            topk_agreement=round(self.topk_rows / self.argmax_calls, 6) if self.argmax_calls else None,
        )


@dataclass
class GroupTotals:
    """Counts and latencies of one slice of the calls (all of them, or one recorded version)."""

    completed: int = 0
    #: Calls both sides answered OK: the ones whose outputs were compared.
    both_ok: int = 0
    matches: int = 0
    mismatches: int = 0
    status_changes: int = 0
    #: Calls both answered OK with no recorded response to compare: not in ``both_ok``, so in no mismatch rate.
    not_compared: int = 0
    reference_errors: int = 0
    candidate_errors: int = 0
    candidate_versions: Counter[str] = field(default_factory=Counter)
    reference_latency: LogHistogram = field(default_factory=LogHistogram)
    candidate_latency: LogHistogram = field(default_factory=LogHistogram)

    def add(
        self, diff: CallDiff, candidate_version: str, reference_latency_s: float, candidate_latency_s: float
    ) -> None:
        self.completed += 1
        if diff.outcome == "match":
            self.matches += 1
        elif diff.outcome == "mismatch":
            self.mismatches += 1
        elif diff.outcome == "not_compared":
            self.not_compared += 1
        else:
            self.status_changes += 1
        self.both_ok += diff.reference_code == 0 and diff.candidate_code == 0 and diff.outcome != "not_compared"
        self.reference_errors += diff.reference_code != 0
        self.candidate_errors += diff.candidate_code != 0
        self.candidate_versions[candidate_version or "?"] += 1
        self.reference_latency.add(reference_latency_s)
        self.candidate_latency.add(candidate_latency_s)

    def summary(self) -> GroupSummary:
        return GroupSummary(
            completed=self.completed,
            compared=self.both_ok,
            matches=self.matches,
            mismatches=self.mismatches,
            status_changes=self.status_changes,
            not_compared=self.not_compared,
            mismatch_rate=rate(self.mismatches, self.both_ok),
            reference_error_rate=rate(self.reference_errors, self.completed),
            candidate_error_rate=rate(self.candidate_errors, self.completed),
            candidate_versions=dict(sorted(self.candidate_versions.items())),
            latency=LatencyComparison.of(self.reference_latency.quantiles_ms(), self.candidate_latency.quantiles_ms()),
        )


@dataclass(order=True)
class _Worst:
    key: tuple[int, float, float]
    sequence: int
    line: dict[str, Any] = field(compare=False)


class WorstCalls:
    """The ``capacity`` calls that differ most (status changes, then share of mismatched elements, then error)."""

    def __init__(self, capacity: int = 25) -> None:
        self.capacity = capacity
        self._heap: list[_Worst] = []
        self._sequence = 0

    def offer(self, diff: CallDiff, line: dict[str, Any]) -> None:
        if diff.outcome in ("match", "not_compared"):
            return
        self._sequence += 1
        item = _Worst(diff.severity(), -self._sequence, line)
        if len(self._heap) < self.capacity:
            heapq.heappush(self._heap, item)
        elif item > self._heap[0]:
            heapq.heapreplace(self._heap, item)

    def worst_first(self) -> list[dict[str, Any]]:
        return [item.line for item in sorted(self._heap, reverse=True)]
