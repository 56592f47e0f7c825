"""The guards' and the bandit's reads of the analysis from the recorder's Redis.

Apart from :mod:`splitstream.admin.outcomes` (the guards and how they are judged) because it imports the whole
analysis (its engines, pyarrow, redis): the ``splitstream`` CLI imports it only when a command reads outcomes,
so that every other command starts without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from redis.exceptions import RedisError

from splitstream.analysis.analyze import Query, analyze
from splitstream.analysis.loading import Window
from splitstream.analysis.model import Analysis, MetricSpec
from splitstream.analysis.usage import Price
from splitstream.common.redis_settings import NO_REDIS_SECURITY, RedisSecurity
from splitstream.common.redis_url import RedisClient, open_redis
from splitstream.common.secrets import redact_text, redact_url


class OutcomeReader:
    """Reads the analysis of a model's calls and feedback from the recorder's Redis, one check at a time.

    The rollout loop is synchronous (it sleeps between scrapes), so each read runs its own event loop
    with its own client: nothing is shared between checks, and no loop is blocked."""

    def __init__(
        self,
        url: str,
        *,
        model: str,
        metrics: Sequence[MetricSpec],
        alpha: float,
        security: RedisSecurity = NO_REDIS_SECURITY,
        timeout_s: float = 10.0,
        prices: dict[str, Price] | None = None,
        quantiles: bool = False,
    ) -> None:
        self.url = url
        #: Whether the reads compare latency quantiles (a rollout with a quantile guard): otherwise each check
        #: would keep every unit's calls per latency bucket for comparisons no guard reads.
        self.quantiles = quantiles
        #: ``--price`` per version, for guards on ``cost``.
        self.prices = prices or {}
        self.model = model
        self.metrics = tuple(metrics)
        self.alpha = alpha
        self.security = security
        self.timeout_s = timeout_s

    def _client(self) -> RedisClient:
        """ValueError for a URL that cannot be used (one Redis or a cluster, like every other reader)."""
        return open_redis(
            self.url,
            security=self.security,
            socket_connect_timeout=self.timeout_s,
            socket_timeout=max(self.timeout_s, 30),
        )

    def check_reachable(self) -> None:
        """ValueError for a bad URL, OSError naming Redis when it cannot be reached."""

        async def ping() -> None:
            client = self._client()
            try:
                await client.ping()
            except (RedisError, OSError) as error:
                raise OSError(f"Redis at {redact_url(self.url)} is unreachable: {redact_text(str(error))}") from None
            finally:
                await client.aclose()

        asyncio.run(ping())

    def read(self, since_ns: int) -> Analysis:
        """The sequential analysis of ``[since_ns, now)``; OSError naming Redis when it fails."""

        async def run() -> Analysis:
            client = self._client()
            try:
                query = Query(
                    model=self.model,
                    window=Window(since_ns, time.time_ns() + 1),
                    metrics=self.metrics,
                    alpha=self.alpha,
                    sequential=True,
                    prices=self.prices,
                    novelty_bucket_ns=None,  # a guard reads the step's lift, not its age profile
                    quantiles=self.quantiles,
                    quantile_timeline=False,  # a guard reads the ratio as it stands
                )
                return await analyze(client, query)
            except (RedisError, OSError) as error:
                raise OSError(f"Redis at {redact_url(self.url)} failed: {redact_text(str(error))}") from None
            finally:
                await client.aclose()

        return asyncio.run(run())
