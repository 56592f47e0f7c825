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
from splitstream.replayer.http_compare import HttpDiff
from splitstream.replayer.stream_compare import StreamAnswer, StreamDiff, gaps_s
from splitstream.replayer.summary import (
    GroupSummary,
    HttpSummary,
    LatencyComparison,
    OutputSummary,
    Quantiles,
    StreamGroupSummary,
    StreamsSummary,
    rate,
)


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
        self._push(diff.severity(), line)

    def offer_stream(self, diff: StreamDiff, line: dict[str, Any]) -> None:
        """A diverging stream, ranked by its edit distance (status changes first, as for calls)."""
        if diff.outcome in ("match", "not_compared"):
            return
        severity = (2, 1.0, 0.0) if diff.outcome == "status_change" else (1, diff.edit_distance or 0.0, 0.0)
        self._push(severity, line)

    def _push(self, severity: tuple[int, float, float], line: dict[str, Any]) -> None:
        """Among equal severities the earliest offered stays: its sequence ranks highest."""
        self._sequence += 1
        item = _Worst(severity, -self._sequence, line)
        if len(self._heap) < self.capacity:
            heapq.heappush(self._heap, item)
        elif item > self._heap[0]:
            heapq.heapreplace(self._heap, item)

    def worst_first(self) -> list[dict[str, Any]]:
        return [item.line for item in sorted(self._heap, reverse=True)]


#: Edges of the edit-distance histogram the report draws (normalized distance, 0..1).
EDIT_DISTANCE_EDGES = (0.0, 0.001, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


@dataclass
class StreamGroupTotals:
    """Token streams of one slice (all, or those one recorded version answered): how the tokens agree,
    and TTFT / inter-token gaps on both sides."""

    streams: int = 0
    #: Streams whose tokens were compared (both ended with the same status, text not redacted).
    compared: int = 0
    exact: int = 0
    edit_distance_total: float = 0.0
    text_edit_distance_total: float = 0.0
    text_compared: int = 0
    reference_tokens: int = 0
    candidate_tokens: int = 0
    prefix_compared: int = 0
    #: Responses the candidate streams received (the tokens/s numerator).
    candidate_responses: int = 0
    #: First-divergence indices of the streams that diverge (a few numbers each: small and exact).
    divergences: list[int] = field(default_factory=list)
    #: Streams per edit-distance bin (:data:`EDIT_DISTANCE_EDGES`).
    edit_bins: list[int] = field(default_factory=lambda: [0] * (len(EDIT_DISTANCE_EDGES) - 1))
    reference_ttft: LogHistogram = field(default_factory=LogHistogram)
    candidate_ttft: LogHistogram = field(default_factory=LogHistogram)
    reference_itl: LogHistogram = field(default_factory=LogHistogram)
    candidate_itl: LogHistogram = field(default_factory=LogHistogram)

    def add(self, diff: StreamDiff, reference: StreamAnswer, candidate: StreamAnswer) -> None:
        self.streams += 1
        self.candidate_responses += len(candidate.responses)
        if reference.ttft_s is not None:
            self.reference_ttft.add(reference.ttft_s)
        if candidate.ttft_s is not None:
            self.candidate_ttft.add(candidate.ttft_s)
        for gap in gaps_s(reference.response_times_s):
            self.reference_itl.add(gap)
        for gap in gaps_s(candidate.response_times_s):
            self.candidate_itl.add(gap)
        if diff.edit_distance is None:
            return
        self.compared += 1
        self.exact += diff.exact
        self.edit_distance_total += diff.edit_distance
        if diff.text_edit_distance is not None:
            self.text_compared += 1
            self.text_edit_distance_total += diff.text_edit_distance
        self.reference_tokens += diff.reference_tokens
        self.candidate_tokens += diff.candidate_tokens
        self.prefix_compared += diff.prefix_compared
        if diff.first_divergence is not None and len(self.divergences) < 100_000:
            self.divergences.append(diff.first_divergence)
        for position, upper in enumerate(EDIT_DISTANCE_EDGES[1:]):
            if diff.edit_distance <= upper or position == len(self.edit_bins) - 1:
                self.edit_bins[position] += 1
                break

    def summary(self) -> StreamGroupSummary:
        ordered = sorted(self.divergences)
        ttft = LatencyComparison.of(self.reference_ttft.quantiles_ms(), self.candidate_ttft.quantiles_ms())
        itl = LatencyComparison.of(self.reference_itl.quantiles_ms(), self.candidate_itl.quantiles_ms())
        return StreamGroupSummary(
            streams=self.streams,
            compared=self.compared,
            exact_matches=self.exact,
            token_match_rate=rate(self.exact, self.compared),
            mean_edit_distance=round(self.edit_distance_total / self.compared, 6) if self.compared else None,
            mean_text_edit_distance=(
                round(self.text_edit_distance_total / self.text_compared, 6) if self.text_compared else None
            ),
            first_divergence_p50=float(ordered[(len(ordered) - 1) // 2]) if ordered else None,
            reference_tokens=self.reference_tokens,
            candidate_tokens=self.candidate_tokens,
            prefix_compared=self.prefix_compared,
            edit_distance_bins=list(self.edit_bins),
            ttft=ttft,
            itl=itl,
        )


@dataclass
class StreamTotals:
    """Every replayed token stream, overall and by recorded version."""

    overall: StreamGroupTotals = field(default_factory=StreamGroupTotals)
    by_version: dict[str, StreamGroupTotals] = field(default_factory=dict)

    def add(self, version: str, diff: StreamDiff, reference: StreamAnswer, candidate: StreamAnswer) -> None:
        self.overall.add(diff, reference, candidate)
        self.by_version.setdefault(version, StreamGroupTotals()).add(diff, reference, candidate)

    def summary(self, active_s: float) -> StreamsSummary | None:
        if not self.overall.streams:
            return None
        tokens = self.overall.candidate_responses
        return StreamsSummary(
            **self.overall.summary().model_dump(),
            edit_distance_edges=list(EDIT_DISTANCE_EDGES),
            tokens_per_s=round(tokens / active_s, 1) if active_s > 0 and tokens else None,
            versions={version: group.summary() for version, group in sorted(self.by_version.items())},
        )


@dataclass
class HttpTotals:
    """Every replayed HTTP call: per route kind, and the reported token usage compared."""

    calls: int = 0
    apis: Counter[str] = field(default_factory=Counter)
    usage_compared: int = 0
    usage_mismatches: int = 0
    prompt_mismatches: int = 0
    completion_mismatches: int = 0
    body_mismatches: int = 0

    def add(self, api: str, diff: HttpDiff) -> None:
        self.calls += 1
        self.apis[api or "?"] += 1
        self.body_mismatches += bool(diff.body_difference)
        usage = diff.usage
        if usage.reference is None:
            return
        self.usage_compared += 1
        if usage.match:
            return
        self.usage_mismatches += 1
        candidate = usage.candidate
        self.prompt_mismatches += candidate is None or candidate[0] != usage.reference[0]
        self.completion_mismatches += candidate is None or candidate[1] != usage.reference[1]

    def summary(self) -> HttpSummary | None:
        if not self.calls:
            return None
        return HttpSummary(
            calls=self.calls,
            apis=dict(sorted(self.apis.items())),
            usage_compared=self.usage_compared,
            usage_mismatches=self.usage_mismatches,
            usage_mismatch_rate=rate(self.usage_mismatches, self.usage_compared),
            prompt_tokens_mismatches=self.prompt_mismatches,
            completion_tokens_mismatches=self.completion_mismatches,
            body_mismatches=self.body_mismatches,
        )
