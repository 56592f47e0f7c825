"""Checking a Redis URL's options when a process starts, not when it first connects."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import RedisError


def check_connection_options(client: Redis) -> None:
    """Build (without connecting) one connection as ``client`` would; raise ValueError if it cannot be.

    redis-py's ``from_url`` passes query parameters it does not know (``?x=1``) and values it checks late
    (``?ssl_cert_reqs=bogus``) on to the connection's constructor, which raises only when the first
    connection is made: found by probing, the recorder and the replayer exited 1 with a traceback (the
    replayer's "gate failed" code) instead of refusing the flag."""
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)
    except (TypeError, RedisError) as error:
        raise ValueError(str(error)) from None
