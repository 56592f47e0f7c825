"""Redis connection settings every Redis client shares: options checked at start, TLS files, ACL credentials,
and the one factory (:func:`open_redis`) that turns a ``--redis-url`` into a client.

A URL names one Redis (``redis://``, ``rediss://`` for TLS) or a Redis Cluster
(``redis+cluster://host:port[,host:port...]``, ``rediss+cluster://`` for TLS): the cluster's nodes to
ask for the slot map first; any one that answers is enough, so list more than one (a master that is down
at start is then no obstacle). Userinfo and query work as for one Redis; a database number other than 0
is refused (a cluster has only database 0).
"""

from __future__ import annotations

from typing import Any, TypeAlias
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from splitstream.common.redis_settings import CLUSTER_SCHEMES, NO_REDIS_SECURITY, RedisSecurity

#: What :func:`open_redis` returns: one Redis, or a cluster client that routes each command to its slot's master.
RedisClient: TypeAlias = Redis | RedisCluster


def is_cluster(client: object) -> bool:
    """Whether ``client`` (a client or a pipeline) talks to a Redis Cluster."""
    from redis.asyncio.cluster import ClusterPipeline

    return isinstance(client, RedisCluster | ClusterPipeline)


class _RedisCluster(RedisCluster):
    """A cluster client whose failure to read the slot map is a :class:`redis.exceptions.ConnectionError`,
    as one Redis's failure to connect is.

    redis-py raises ``RedisClusterException`` there ("Redis Cluster cannot be connected", a certificate
    refused, "Cluster mode is not enabled on this node"), which is no ``RedisError``: every component that
    says "Redis unreachable" in one line (``except RedisError``) let it through as a traceback instead,
    found with a TLS cluster and a reader without the CA."""

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        try:
            return await super().initialize(*args, **kwargs)
        except RedisClusterException as error:
            raise RedisConnectionError(str(error)) from error


#: Query parameters of a cluster URL and the type of their value (the rest are refused by name).
_CLUSTER_QUERY: dict[str, type] = {
    "socket_timeout": float,
    "socket_connect_timeout": float,
    "client_name": str,
    "ssl_cert_reqs": str,
    "ssl_check_hostname": bool,
    "read_from_replicas": bool,
}


def _cluster_options(url: str) -> dict[str, Any]:
    """``RedisCluster`` keyword arguments for a ``redis+cluster://`` URL; ValueError saying what is wrong."""
    parts = urlsplit(url)
    options: dict[str, Any] = {}
    nodes = []
    netloc = parts.netloc.rpartition("@")[2]
    if parts.username:
        options["username"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    for item in netloc.split(","):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster node {item!r} is not host:port")
        nodes.append(ClusterNode(host, int(port)))
    if not nodes:
        raise ValueError("a cluster URL names at least one node (redis+cluster://host:port[,host:port...])")
    database = parts.path.strip("/")
    if database not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {database!r}")
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        kind = _CLUSTER_QUERY.get(name)
        if kind is None:
            raise ValueError(f"unknown option {name!r} in a cluster URL (known: {', '.join(sorted(_CLUSTER_QUERY))})")
        if kind is bool:
            if value.lower() not in ("true", "false", "yes", "no", "1", "0"):
                raise ValueError(f"option {name}={value!r} is not a boolean")
            options[name] = value.lower() in ("true", "yes", "1")
        elif kind is float:
            try:
                options[name] = float(value)
            except ValueError:
                raise ValueError(f"option {name}={value!r} is not a number") from None
        else:
            options[name] = value
    if options.get("ssl_cert_reqs", "required") not in ("none", "optional", "required"):
        raise ValueError(f"ssl_cert_reqs={options['ssl_cert_reqs']!r} is not none, optional or required")
    options["startup_nodes"] = nodes
    options["ssl"] = parts.scheme == "rediss+cluster"
    return options


def open_redis(
    url: str,
    *,
    security: RedisSecurity | None = None,
    socket_timeout: float | None = None,
    socket_connect_timeout: float | None = None,
    client_name: str | None = None,
    retry: Any = None,
) -> RedisClient:
    """The client for ``url`` (one Redis or a cluster), not connected yet; ValueError for a URL or option
    that cannot be used, raised here rather than at the first command.

    ``retry``: one Redis's reconnect policy (a :class:`redis.asyncio.retry.Retry`), also the cluster client's
    whole-command retry: each retry there re-reads the slot map (how a failover is followed)."""
    options: dict[str, Any] = (security or NO_REDIS_SECURITY).client_options()
    if socket_timeout is not None:
        options["socket_timeout"] = socket_timeout
    if socket_connect_timeout is not None:
        options["socket_connect_timeout"] = socket_connect_timeout
    if client_name is not None:
        options["client_name"] = client_name
    if retry is not None:
        options["retry"] = retry
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        options |= _cluster_options(url)  # the URL wins, as with from_url
        try:
            return _RedisCluster(**options)
        except (TypeError, RedisError) as error:
            raise ValueError(str(error)) from None
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"unknown scheme {scheme!r} (expected redis, rediss, redis+cluster or rediss+cluster)")
    client = Redis.from_url(url, **options)
    check_connection_options(client)
    return client


def check_connection_options(client: Redis) -> None:
    """Build (without connecting) one connection as ``client`` would; raise ValueError if it cannot be.

    redis-py's ``from_url`` passes query parameters it does not know (``?x=1``) and values it checks late
    (``?ssl_cert_reqs=bogus``) on to the connection's constructor, which raises only when the first
    connection is made: without this check the recorder and the replayer would exit 1 with a traceback (the
    replayer's "gate failed" code) instead of refusing the flag."""
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)
    except (TypeError, RedisError) as error:
        raise ValueError(str(error)) from None
