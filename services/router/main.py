"""``splitstream-router``: serve the Open Inference Protocol and split traffic between model versions."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import structlog
from grpc import aio
from grpc_health.v1 import health, health_pb2
from prometheus_client import start_http_server

from splitstream.common.cli import EnvArgumentParser, add_health_and_reflection, fail, server_options
from splitstream.common.logs import configure_logging
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import router_pb2
from splitstream.common.registry import ConsulRegistry, FileRegistry, Registry, RegistryUpdate, parse_consul_spec
from splitstream.router.core import EndpointSettings, RouterCore
from splitstream.router.metrics import RouterMetrics
from splitstream.router.mirror import MirrorSettings, RecordMirror
from splitstream.router.servicer import RouterServicer
from splitstream.router.shadows import ShadowRunner
from splitstream.router.spool import Spool


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    registry: str
    host: str
    port: int
    metrics_port: int
    router_id: str
    eject_after_failures: int
    eject_duration_s: float
    max_message_bytes: int
    drain_delay_s: float
    shutdown_grace_s: float
    log_level: str
    recorder: str
    spool_dir: str
    spool_max_bytes: int
    hmac_key: str
    record_batch_size: int
    record_batch_interval_ms: float
    record_queue_size: int
    shadow_timeout_s: float
    shadow_max_in_flight: int

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise ValueError("ports must be within 0..65535")
        if self.eject_after_failures < 1:
            raise ValueError("--eject-after-failures must be at least 1")
        if min(self.eject_duration_s, self.drain_delay_s, self.shutdown_grace_s) < 0:
            raise ValueError("durations must not be negative")
        if self.recorder and not self.hmac_key:
            raise ValueError("--recorder needs --hmac-key (or SPLITSTREAM_HMAC_KEY) for routing-key HMACs")
        if min(self.record_batch_size, self.record_queue_size, self.spool_max_bytes) < 1:
            raise ValueError("--record-batch-size, --record-queue-size and --spool-max-bytes must be positive")


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog="splitstream-router",
        env_prefix="SPLITSTREAM_ROUTER_",
        description=(
            "Serve the Open Inference Protocol (KServe v2 gRPC) and splitstream.v1.Router on one port, "
            "split each model's traffic between its versions by a sticky hash of the routing key, and "
            "forward calls to the workers the registry lists."
        ),
    )
    parser.add_argument(
        "--registry",
        required=True,
        help=(
            "where endpoints and experiments come from: file:PATH (a YAML file, re-read on change) or "
            "consul://HOST:PORT (watched with blocking queries; ACL token from CONSUL_HTTP_TOKEN)"
        ),
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8001, help="gRPC port (Triton's default; 0 picks a free one)")
    parser.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics port (0: off)")
    parser.add_argument(
        "--router-id",
        default="",
        help="this router's name in logs, Status and records (empty: hostname-pid)",
    )
    parser.add_argument(
        "--eject-after-failures",
        type=int,
        default=3,
        help="consecutive UNAVAILABLE answers that take an endpoint out of rotation",
    )
    parser.add_argument(
        "--eject-duration-s",
        type=float,
        default=5.0,
        help="how long an ejected endpoint stays out before it is tried again",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="largest request or response accepted and forwarded",
    )
    parser.add_argument(
        "--drain-delay-s",
        type=float,
        default=0.5,
        help="on SIGTERM: seconds to keep serving after reporting NOT_SERVING, for balancers to notice",
    )
    parser.add_argument(
        "--shutdown-grace-s", type=float, default=30.0, help="on SIGTERM: seconds calls in flight get to finish"
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument(
        "--shadow-timeout-s",
        type=float,
        default=5.0,
        help="deadline of a shadow copy (shadows are set per experiment in the registry)",
    )
    parser.add_argument(
        "--shadow-max-in-flight",
        type=int,
        default=256,
        help="shadow copies in flight at most; past it new ones are skipped and counted",
    )
    recording = parser.add_argument_group("recording (off unless --recorder is set)")
    recording.add_argument("--recorder", default="", help="recorder address host:port; every call is mirrored to it")
    recording.add_argument(
        "--spool-dir",
        default="splitstream-spool",
        help="where record batches wait on disk while the recorder is unreachable",
    )
    recording.add_argument(
        "--spool-max-bytes",
        type=int,
        default=1 << 30,
        help="spool cap; past it new records are dropped and counted, never blocking calls",
    )
    recording.add_argument(
        "--hmac-key",
        default="",
        help="key for the routing-key HMAC in records; else SPLITSTREAM_HMAC_KEY (shared with recorder and replayer)",
    )
    recording.add_argument("--record-batch-size", type=int, default=256, help="records per batch")
    recording.add_argument(
        "--record-batch-interval-ms",
        type=float,
        default=200.0,
        help="longest a record waits for its batch to fill (fewer, larger batches cost the hot path less)",
    )
    recording.add_argument(
        "--record-queue-size",
        type=int,
        default=100_000,
        help="calls held in memory for recording; past it new ones are dropped and counted",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> RouterConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.router_id = args.router_id or f"{socket.gethostname()}-{os.getpid()}"
    # One deployment-wide key serves router, recorder and replayer alike.
    args.hmac_key = args.hmac_key or os.environ.get("SPLITSTREAM_HMAC_KEY", "")
    try:
        return RouterConfig(**vars(args))
    except ValueError as error:
        parser.error(str(error))
    raise AssertionError("unreachable: parser.error exits")


def open_registry(spec: str) -> Registry:
    scheme, _, location = spec.partition(":")
    if scheme == "file" and location:
        if not os.path.isfile(location):
            raise ValueError(f"registry file '{location}' does not exist")
        return FileRegistry(location)
    if scheme == "consul":
        return ConsulRegistry(parse_consul_spec(spec))
    raise ValueError(f"unknown registry '{spec}' (expected file:PATH or consul://HOST:PORT)")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        configure_logging(config.log_level, service="router")
        registry = open_registry(config.registry)
    except ValueError as error:
        fail("splitstream-router", str(error))
    return asyncio.run(serve(config, registry))


async def serve(config: RouterConfig, registry: Registry) -> int:
    """Run until SIGTERM/SIGINT, then shut down in order (see :meth:`Router.shutdown`)."""
    router = Router(config, registry)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await router.shutdown()
    return 0


class Router:
    def __init__(self, config: RouterConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.log = structlog.get_logger().bind(router_id=config.router_id)
        self.metrics = RouterMetrics()
        self.core = RouterCore(
            settings=EndpointSettings(
                channel_options=(
                    ("grpc.max_receive_message_length", config.max_message_bytes),
                    ("grpc.max_send_message_length", config.max_message_bytes),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 2000),
                ),
                eject_after_failures=config.eject_after_failures,
                eject_duration_s=config.eject_duration_s,
                drain_timeout_s=config.shutdown_grace_s,
            ),
            metrics=self.metrics,
        )
        self.servicer = RouterServicer(self.core, router_id=config.router_id, registry_description=registry.description)
        self.mirror: RecordMirror | None = None
        if config.recorder:
            settings = MirrorSettings(
                recorder_address=config.recorder,
                router_id=config.router_id,
                hmac_key=config.hmac_key.encode(),
                queue_size=config.record_queue_size,
                batch_size=config.record_batch_size,
                batch_interval_s=config.record_batch_interval_ms / 1000,
            )
            spool = Spool(config.spool_dir, max_bytes=config.spool_max_bytes)
            self.mirror = RecordMirror(settings, spool, self.metrics.registry)
        self.shadows = ShadowRunner(
            self.core,
            self.metrics,
            self.mirror,
            timeout_s=config.shadow_timeout_s,
            max_in_flight=config.shadow_max_in_flight,
        )
        self.servicer.after_answer = self.shadows.after_answer
        self.health = health.aio.HealthServicer()
        self.server = aio.server(
            interceptors=self.servicer.interceptors(), options=server_options(config.max_message_bytes)
        )
        self._watch_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load the registry, then listen. Exits 2 with one line if the registry is unusable at start."""
        updates = self.registry.watch()
        first = await anext(updates)
        if first.state is None:
            fail("splitstream-router", f"registry {self.registry.description}: {first.error}")
        self._apply(first)
        self.server.add_generic_rpc_handlers(self.servicer.handlers())
        add_health_and_reflection(
            self.server,
            self.health,
            oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
            router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
        )
        port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        await self.server.start()
        if self.config.metrics_port:
            start_http_server(self.config.metrics_port, registry=self.metrics.registry)
        self._watch_task = asyncio.create_task(self._follow(updates), name="registry-watch")
        if self.mirror is not None:
            self.mirror.start()
        self.servicer.ready = True
        for service in ("", "splitstream.v1.Router", "inference.GRPCInferenceService"):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.log.info(
            "router serving",
            port=port,
            metrics_port=self.config.metrics_port,
            registry=self.registry.description,
            models=self.core.model_names(),
        )

    async def _follow(self, updates: AsyncIterator[RegistryUpdate]) -> None:
        async for update in updates:
            self._apply(update)

    def _apply(self, update: RegistryUpdate) -> None:
        if update.state is None:
            self.servicer.registry_error = update.error or "unknown error"
            self.metrics.registry_updates.labels("error").inc()
            self.metrics.registry_healthy.set(0)
            self.log.error("registry update rejected; keeping the last good state", error=update.error)
            return
        self.core.apply(update.state)
        self.servicer.registry_error = update.error or ""
        self.metrics.registry_updates.labels("partial" if update.error else "ok").inc()
        self.metrics.registry_healthy.set(0 if update.error else 1)
        self.log.info("registry applied", generation=self.core.generation, models=sorted(update.state.models))
        if update.error:
            self.log.error("registry state applied with parts kept from before", error=update.error)

    async def shutdown(self) -> None:
        """Stop in order: report NOT_SERVING; keep serving ``drain_delay_s`` so balancers move away;
        stop accepting and give calls in flight ``shutdown_grace_s``; flush recorded calls to the
        recorder or the spool; stop watching the registry; close worker channels once their calls are done."""
        self.log.info("router draining", drain_delay_s=self.config.drain_delay_s)
        self.servicer.ready = False
        await self.health.enter_graceful_shutdown()
        await asyncio.sleep(self.config.drain_delay_s)
        await self.server.stop(self.config.shutdown_grace_s)
        await self.shadows.close()  # shadows in flight finish, so their calls are recorded whole
        if self.mirror is not None:
            await self.mirror.close()  # every answered call is queued by now: flush to recorder or spool
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        await self.core.close()
        self.log.info("router stopped")
