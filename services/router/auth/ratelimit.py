"""Per-principal rate limits: one token bucket per principal, refilled continuously.

A bucket holds at most ``burst`` tokens and gains ``per_s`` a second; each call takes one, and a
call that finds none is refused (RESOURCE_EXHAUSTED) without waiting: the client decides whether
to back off, and the router never holds a call it will not serve. Buckets live in this process,
so N router replicas allow N times the rate; a limit per replica is what an operator sets.

Buckets are kept by principal name and rebuilt when a principal's limit changes in the principals
document (a reload keeps the tokens of an unchanged limit, so editing another principal does not
hand everyone a fresh burst).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from splitstream.router.auth.policy import Principal, RateLimit


@dataclass(slots=True)
class TokenBucket:
    limit: RateLimit
    tokens: float
    updated_s: float

    def take(self, now_s: float) -> bool:
        """Take one token if there is one (after refilling for the time since the last call)."""
        elapsed = max(now_s - self.updated_s, 0.0)
        self.tokens = min(self.tokens + elapsed * self.limit.per_s, float(self.limit.burst))
        self.updated_s = now_s
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class RateLimiter:
    """The buckets of every principal with a limit; O(1) a call, no lock (one event loop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def allow(self, principal: Principal) -> bool:
        """Whether ``principal`` may make one more call now (always, without a limit)."""
        limit = principal.rate_limit
        if limit is None:
            return True
        now = self._clock()
        bucket = self._buckets.get(principal.name)
        if bucket is None or bucket.limit != limit:
            bucket = self._buckets[principal.name] = TokenBucket(limit, float(limit.burst), now)
        return bucket.take(now)

    def retry_after_s(self, principal: Principal) -> float:
        """Seconds until ``principal``'s bucket holds a token again (0 when it holds one, or has no limit):
        the ``Retry-After`` of an HTTP 429."""
        bucket = self._buckets.get(principal.name)
        if bucket is None or bucket.limit != principal.rate_limit:
            return 0.0
        elapsed = max(self._clock() - bucket.updated_s, 0.0)
        tokens = min(bucket.tokens + elapsed * bucket.limit.per_s, float(bucket.limit.burst))
        return max(1.0 - tokens, 0.0) / bucket.limit.per_s

    def forget_except(self, names: frozenset[str]) -> None:
        """Drop the buckets of principals no longer configured (after a reload)."""
        for name in [n for n in self._buckets if n not in names]:
            del self._buckets[name]
