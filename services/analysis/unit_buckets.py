"""Calls per (unit row, time bucket, latency bucket): what a quantile's interval clustered by unit needs, in memory
bounded by units and the buckets their calls span rather than by calls.

A quantile of the calls pooled per arm, and its delta-method variance, need each unit's calls at or below a
value (and, for the lift-over-time timeline, those up to each time bucket's end); the latency buckets of the
analysis (2 % wide, :data:`splitstream.analysis.loading.LATENCY_GROWTH`) keep that to each unit's count per
bucket. A user with 10,000 calls between 5 and 50 ms spans some 120 buckets:
120 entries, not 10,000. Pages add pairs; they are merged (summed per pair) whenever the unmerged ones
outgrow the merged, so the work stays linear and the memory about the distinct pairs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

#: Buckets fit in 16 bits (LATENCY_BUCKETS is about 1,100), the time bucket of the call (the timeline's, 0 to
#: TIMELINE_POINTS - 1) in 5 more.
_BUCKET_BITS = 16
_PERIOD_BITS = 5


@dataclass(frozen=True, slots=True)
class UnitBucketCounts:
    """Distinct (row, period, bucket) triples and their calls: ``periods`` is the time bucket of the calls (what
    the quantiles' lift-over-time timeline needs: the calls up to each bucket's end). Integers of any width: the
    DuckDB engine's are as narrow as their values (int32 rows, int16 buckets, int8 periods), a third of int64's
    memory at ten million calls."""

    rows: npt.NDArray[np.integer[Any]]
    buckets: npt.NDArray[np.integer[Any]]
    counts: npt.NDArray[np.int32]
    periods: npt.NDArray[np.integer[Any]]


@dataclass(slots=True)
class UnitBuckets:
    #: Unmerged pairs allowed before a merge (and at least as many as the merged ones).
    merge_after: int = 100_000
    _keys: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    #: Calls per pair: int32, so a kept pair costs 12 bytes (a unit row's calls fit: a row counts them in int32 too).
    _counts: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    _pending: list[npt.NDArray[np.int64]] = field(default_factory=list)
    _pending_size: int = 0

    def add(self, rows: npt.NDArray[np.int64], buckets: npt.NDArray[np.int64], periods: npt.NDArray[np.int64]) -> None:
        """One call per (rows[i], periods[i], buckets[i])."""
        if not len(rows):
            return
        self._pending.append(
            (rows.astype(np.int64) << (_BUCKET_BITS + _PERIOD_BITS))
            | (periods.astype(np.int64) << _BUCKET_BITS)
            | buckets.astype(np.int64)
        )
        self._pending_size += len(rows)
        if self._pending_size > max(len(self._keys), self.merge_after):
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        keys = np.concatenate([self._keys, *self._pending])
        counts = np.concatenate([self._counts, np.ones(self._pending_size, np.int32)])
        self._keys, inverse = np.unique(keys, return_inverse=True)
        self._counts = np.bincount(inverse.reshape(-1), weights=counts, minlength=len(self._keys)).astype(np.int32)
        self._pending, self._pending_size = [], 0

    def result(self) -> UnitBucketCounts:
        self._merge()
        mask = (1 << _BUCKET_BITS) - 1
        periods = (self._keys >> _BUCKET_BITS) & ((1 << _PERIOD_BITS) - 1)
        return UnitBucketCounts(self._keys >> (_BUCKET_BITS + _PERIOD_BITS), self._keys & mask, self._counts, periods)
