"""``splitstream-recorder``: receive call records from routers and write them to Redis Streams.

Wiring only: flags → :class:`RecorderConfig`, and a :class:`Recorder` that the shared runtime
(:mod:`splitstream.common.runtime`) serves, drains and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog
from grpc import aio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.redis_url import RedisClient, open_redis
from splitstream.common.runtime import Runtime, Service, run_service
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.service_auth import ServiceAuth
from splitstream.common.supervisor import supervise
from splitstream.recorder.access import RouterAccess
from splitstream.recorder.config import PROG, RecorderConfig, parse_args
from splitstream.recorder.core import RecorderCore
from splitstream.recorder.errors import StoreUnavailable
from splitstream.recorder.metrics import RecorderMetrics
from splitstream.recorder.redaction import Redactor
from splitstream.recorder.servicer import SERVICE, RecorderServicer
from splitstream.recorder.writer import RedisWriter

#: Threads for the CPU half of a batch (parse, redact, hash, serialize): enough to overlap two
#: routers' batches where hashing releases the GIL, few enough not to fight the event loop.
PREPARE_THREADS = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``splitstream-recorder``; exit codes as :mod:`splitstream.common.runtime` says."""
    config = parse_args(argv)
    configure_logging(config.server.log_level, service="recorder")
    if config.server.processes > 1:
        recorder_argv = sys.argv[1:] if argv is None else argv
        return supervise(
            config.server, module="splitstream.recorder", argv=recorder_argv, prog=PROG, service="recorder"
        )
    return run_service(config.server, lambda: Recorder(config), prog=PROG)


def connect_redis(config: RecorderConfig) -> RedisClient:
    """A client that fails fast: connect and reply timeouts of ``redis_timeout_s``, and one immediate
    reconnect on a broken connection (a Redis restart leaves stale pooled connections), never a retry
    on a timeout. Raises ValueError for a URL redis-py cannot use."""
    return open_redis(
        config.redis_url,
        security=config.redis_security,
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        client_name="splitstream-recorder",
    )


class Recorder(Service):
    """Batches in over gRPC, records out to Redis; health follows whether Redis answers."""

    prog = PROG
    grpc_services = (recorder_pb2.DESCRIPTOR.services_by_name["Recorder"].full_name,)

    def __init__(self, config: RecorderConfig) -> None:
        self.config = config
        self.log = structlog.get_logger()
        self.recorder_metrics = RecorderMetrics()
        self.metrics = self.recorder_metrics.registry
        try:
            self.redis = connect_redis(config)
        except ValueError as error:
            # redis-py's messages may quote the URL; the URL may hold a password.
            raise ConfigError(f"--redis-url {redact_url(config.redis_url)}: {redact_text(str(error))}") from None
        self.writer = RedisWriter(
            self.redis,
            retention_maxlen=config.retention_maxlen,
            retention_age_s=config.retention_age_s,
            blob_ttl_s=config.effective_blob_ttl_s,
            trim_archived=config.trim_archived,
            wait_replicas=config.redis_wait_replicas,
            wait_timeout_ms=max(1, int(config.redis_timeout_s * 500)),
        )
        self.executor = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        self.core = RecorderCore(
            writer=self.writer,
            redactor=Redactor(
                metadata=config.redact_metadata,
                inputs=config.redact_input,
                outputs=config.redact_output,
                hmac_key=config.hmac_key,
            ),
            blob_threshold_bytes=config.blob_threshold_bytes,
            decode_requests=config.needs_request_decoding,
            decode_responses=config.needs_response_decoding,
            metrics=self.recorder_metrics,
            executor=self.executor,
        )
        self._check_now = asyncio.Event()
        self.servicer = RecorderServicer(self.core, metrics=self.recorder_metrics, on_store_error=self._check_now.set)

    def health_names(self) -> Sequence[str]:
        return (SERVICE,)

    def interceptors(self) -> Sequence[aio.ServerInterceptor]:
        """Routers authenticate with the service token or an allowed client-certificate identity when either
        is set (refused before a message is read)."""
        auth = ServiceAuth(token=self.config.service_token, allowed_identities=self.config.allowed_client_identities)
        return [RouterAccess(auth, self.recorder_metrics)] if auth.enabled else []

    def register(self, server: aio.Server) -> None:
        server.add_generic_rpc_handlers(self.servicer.handlers())

    async def run(self, runtime: Runtime) -> None:
        """Serving, but NOT_SERVING until Redis answers PING: a Redis that is down at start is not a
        configuration error; the recorder waits for it, visibly."""
        self.log.info(
            "recorder listening",
            port=runtime.port,
            metrics_port=self.config.server.metrics_port,
            redis=redact_url(self.config.redis_url),
            retention_maxlen=self.config.retention_maxlen,
            retention_age_s=self.config.retention_age_s,
            trim_archived=self.config.trim_archived,
            blob_threshold_bytes=self.config.blob_threshold_bytes,
            blob_ttl_s=self.config.effective_blob_ttl_s,
            redact_metadata=[f"{r.name}:{r.action.value}" for r in self.config.redact_metadata],
            redact_input=[f"{r.name}:{r.action.value}" for r in self.config.redact_input],
            redact_output=[f"{r.name}:{r.action.value}" for r in self.config.redact_output],
            routers_authenticated=bool(self.config.service_token or self.config.allowed_client_identities),
            allowed_client_identities=sorted(self.config.allowed_client_identities),
        )
        if not self.config.service_token and not self.config.allowed_client_identities:
            self.log.warning(
                "no service token: records are taken from anyone who can connect (set --service-token-file)"
            )
        await self._watch_redis(runtime)

    async def _watch_redis(self, runtime: Runtime) -> None:
        """PING Redis every ``health_interval_s`` (and at once after a failed write); health follows it."""
        serving: bool | None = None
        while True:
            try:
                async with asyncio.timeout(2 * self.config.redis_timeout_s):
                    await self.writer.check()
                up, problem = True, ""
            except (StoreUnavailable, TimeoutError) as error:
                up, problem = False, redact_text(str(error)) or "redis PING timed out"
                self.recorder_metrics.redis_errors.inc()
            if up != serving:
                await runtime.set_serving(up)
                self.recorder_metrics.redis_up.set(1 if up else 0)
                if up:
                    self.log.info("redis reachable; serving")
                else:
                    self.log.warning("redis unreachable; not serving", error=problem)
                serving = up
            self._check_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._check_now.wait(), self.config.health_interval_s)

    async def before_stop(self) -> None:
        """Health is NOT_SERVING for good (the Redis watch was cancelled with it): drain the streams.
        One waiting for a batch ends now with UNAVAILABLE; one writing a batch finishes, acks it,
        then ends the same way. The server's stop then gives what is left the grace period."""
        self.servicer.drain()

    async def teardown(self) -> None:
        await self.redis.aclose()
        self.executor.shutdown(wait=False)
        self.log.info("recorder stopped")
