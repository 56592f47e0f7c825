"""``splitstream-recorder``: receive call records from routers and write them to Redis Streams."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog
from grpc import aio
from grpc_health.v1 import health, health_pb2
from prometheus_client import start_http_server
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from splitstream.common.cli import add_health_and_reflection, fail, server_options
from splitstream.common.logs import configure_logging
from splitstream.common.proto.splitstream.v1 import recorder_pb2
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
    config = parse_args(argv)
    try:
        configure_logging(config.log_level, service="recorder")
    except ValueError as error:
        fail(PROG, str(error))
    return asyncio.run(serve(config))


async def serve(config: RecorderConfig) -> int:
    """Run until SIGTERM/SIGINT, then shut down in order (see :meth:`Recorder.shutdown`)."""
    recorder = Recorder(config)
    await recorder.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await recorder.shutdown()
    return 0


def connect_redis(config: RecorderConfig) -> Redis:
    """A client that fails fast: connect and reply timeouts of ``redis_timeout_s``, and one immediate
    reconnect on a broken connection (a Redis restart leaves stale pooled connections), never a retry
    on a timeout. Raises ValueError for a URL redis-py cannot use."""
    return Redis.from_url(
        config.redis_url,
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        client_name="splitstream-recorder",
    )


class Recorder:
    def __init__(self, config: RecorderConfig) -> None:
        self.config = config
        self.log = structlog.get_logger()
        self.metrics = RecorderMetrics()
        try:
            self.redis = connect_redis(config)
        except ValueError as error:
            fail(PROG, f"--redis-url: {error}")
        self.writer = RedisWriter(
            self.redis,
            retention_maxlen=config.retention_maxlen,
            retention_age_s=config.retention_age_s,
            blob_ttl_s=config.effective_blob_ttl_s,
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
            metrics=self.metrics,
            executor=self.executor,
        )
        self._check_now = asyncio.Event()
        self.servicer = RecorderServicer(self.core, metrics=self.metrics, on_store_error=self._check_now.set)
        self.health = health.aio.HealthServicer()
        self.server = aio.server(options=server_options(config.max_message_bytes))
        self._watch_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen, then report SERVING as soon as Redis answers PING (NOT_SERVING until then).

        A Redis that is down at start is not a configuration error: the recorder waits for it,
        visibly NOT_SERVING. Exits 2 with one line if the ports cannot be bound."""
        self.server.add_generic_rpc_handlers(self.servicer.handlers())
        add_health_and_reflection(
            self.server, self.health, recorder_pb2.DESCRIPTOR.services_by_name["Recorder"].full_name
        )
        for service in ("", SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        except RuntimeError as error:
            fail(PROG, f"cannot listen on {self.config.host}:{self.config.port}: {error}")
        await self.server.start()
        if self.config.metrics_port:
            try:
                start_http_server(self.config.metrics_port, registry=self.metrics.registry)
            except OSError as error:
                fail(PROG, f"cannot serve metrics on port {self.config.metrics_port}: {error}")
        self._watch_task = asyncio.create_task(self._watch_redis(), name="redis-watch")
        self.log.info(
            "recorder listening",
            port=port,
            metrics_port=self.config.metrics_port,
            redis=_redacted_url(self.config.redis_url),
            retention_maxlen=self.config.retention_maxlen,
            retention_age_s=self.config.retention_age_s,
            blob_threshold_bytes=self.config.blob_threshold_bytes,
            blob_ttl_s=self.config.effective_blob_ttl_s,
            redact_metadata=[f"{r.name}:{r.action.value}" for r in self.config.redact_metadata],
            redact_input=[f"{r.name}:{r.action.value}" for r in self.config.redact_input],
            redact_output=[f"{r.name}:{r.action.value}" for r in self.config.redact_output],
        )

    async def _watch_redis(self) -> None:
        """PING Redis every ``health_interval_s`` (and at once after a failed write); health follows it."""
        serving: bool | None = None
        while True:
            try:
                async with asyncio.timeout(2 * self.config.redis_timeout_s):
                    await self.writer.check()
                up, problem = True, ""
            except (StoreUnavailable, TimeoutError) as error:
                up, problem = False, str(error) or "redis PING timed out"
                self.metrics.redis_errors.inc()
            if up != serving:
                status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
                for service in ("", SERVICE):
                    await self.health.set(service, status)
                self.metrics.redis_up.set(1 if up else 0)
                if up:
                    self.log.info("redis reachable; serving")
                else:
                    self.log.warning("redis unreachable; not serving", error=problem)
                serving = up
            self._check_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._check_now.wait(), self.config.health_interval_s)

    async def shutdown(self) -> None:
        """Stop in order: report NOT_SERVING (and stop watching Redis, so it stays so); drain the streams
        (one waiting for a batch ends now with UNAVAILABLE, one writing a batch finishes, acks it, then
        ends the same way); stop the server, giving what is left ``shutdown_grace_s`` before it is
        cancelled; close the Redis connections; stop the prepare threads."""
        self.log.info("recorder draining")
        await self.health.enter_graceful_shutdown()
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        self.servicer.drain()
        await self.server.stop(self.config.shutdown_grace_s)
        await self.redis.aclose()
        self.executor.shutdown(wait=False)
        self.log.info("recorder stopped")


def _redacted_url(url: str) -> str:
    """The Redis URL without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    credentials, at, location = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at and credentials else ''}{location}" if at else url
