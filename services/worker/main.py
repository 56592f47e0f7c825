"""``splitstream-worker``: serve one model version over gRPC until SIGTERM.

Wiring only: read the flags and the model's config.yaml, start the gRPC
server (inference, health, reflection) and the metrics endpoint, load and
warm up the model, then wait for a signal and run :meth:`Worker.shutdown`.

Exit codes: 0 after a clean shutdown, 2 for a bad flag or model config (one
line on stderr saying which), 1 when the worker cannot start (port in use).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry, start_http_server

from splitstream.common.cli import EnvArgumentParser, add_health_and_reflection, server_options
from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.worker.config import ModelConfig
from splitstream.worker.health import NOT_SERVING, SERVING, HealthServicer
from splitstream.worker.metrics import WorkerMetrics
from splitstream.worker.model import ServedModel
from splitstream.worker.registration import (
    ConsulRegistration,
    RegistrationSettings,
    add_registration_arguments,
    registration_settings,
)
from splitstream.worker.servicer import InferenceServicer, add_to_server

PROG = "splitstream-worker"
ENV_PREFIX = "SPLITSTREAM_WORKER_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Requests and responses up to this size; gRPC's 4 MiB default is too small for image batches.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class StartError(Exception):
    """The worker could not start (a port is taken); exit code 1."""


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """The worker's command line, validated."""

    model_repository: Path
    model: str
    version: str
    host: str = "0.0.0.0"
    port: int = 9000
    metrics_port: int = 9001
    log_level: str = "INFO"
    drain_delay_s: float = 0.5
    shutdown_grace_s: float = 30.0
    registration: RegistrationSettings | None = None  # Consul registration; None: not registered

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model: must not be empty")
        if not self.version:
            raise ConfigError("--version: must not be empty")
        for flag, port in (("--port", self.port), ("--metrics-port", self.metrics_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{flag}: must be within 0..65535, got {port}")
        if self.drain_delay_s < 0:
            raise ConfigError(f"--drain-delay-s: must be >= 0, got {self.drain_delay_s}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"--shutdown-grace-s: must be >= 0, got {self.shutdown_grace_s}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level: must be one of {list(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def model_directory(self) -> Path:
        return self.model_repository / self.model / self.version


def build_parser() -> argparse.ArgumentParser:
    parser = EnvArgumentParser(
        prog=PROG,
        env_prefix=ENV_PREFIX,
        description=(
            "Serve one model version over gRPC (Open Inference Protocol / KServe v2, the protocol Triton speaks), "
            "with dynamic batching, grpc.health.v1, server reflection and Prometheus metrics. The model lives in "
            "MODEL_REPOSITORY/MODEL/VERSION/ as model.onnx plus config.yaml (backend, max_batch_size, "
            "dynamic_batching, instance_count, ...)."
        ),
        epilog=(
            f"Every flag can also come from the environment variable shown beside it ({ENV_PREFIX}<FLAG>, "
            "dashes as underscores); a flag on the command line wins. Health is NOT_SERVING until a warm-up "
            "inference succeeded. On SIGTERM or SIGINT the worker turns health NOT_SERVING, keeps answering for "
            "--drain-delay-s, then stops taking calls and gives in-flight ones up to --shutdown-grace-s. "
            "Exit codes: 0 clean shutdown, 2 bad flag or model config, 1 cannot start (port taken)."
        ),
    )
    parser.add_argument(
        "--model-repository",
        type=Path,
        required=True,
        default=argparse.SUPPRESS,
        metavar="DIR",
        help="directory holding MODEL/VERSION/{model.onnx,config.yaml}",
    )
    parser.add_argument(
        "--model",
        required=True,
        default=argparse.SUPPRESS,
        metavar="NAME",
        help="model to serve; clients address it by name",
    )
    parser.add_argument(
        "--version",
        required=True,
        default=argparse.SUPPRESS,
        metavar="V",
        help="version of the model to serve, e.g. v1",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address the gRPC and metrics servers listen on")
    parser.add_argument(
        "--port", type=int, default=9000, metavar="P", help="gRPC port; 0 picks a free one (the log says which)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=9001, metavar="P", help="Prometheus /metrics port; 0 turns it off"
    )
    parser.add_argument(
        "--log-level", type=str.upper, default="INFO", choices=LOG_LEVELS, help="level of the JSON log on stderr"
    )
    parser.add_argument(
        "--drain-delay-s",
        type=float,
        default=0.5,
        metavar="S",
        help="on shutdown, seconds to keep serving after health turns NOT_SERVING, so routers stop sending first",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        metavar="S",
        help="on shutdown, seconds in-flight calls get to finish before they are cancelled",
    )
    add_registration_arguments(parser)
    return parser


class Worker:
    """The worker process's servers and model; :meth:`start`, :meth:`load`, then one awaited :meth:`shutdown`."""

    def __init__(self, settings: WorkerSettings, config: ModelConfig, *, logger: structlog.stdlib.BoundLogger) -> None:
        self._settings = settings
        self._logger = logger
        self.registry = CollectorRegistry()
        self._metrics = WorkerMetrics(self.registry, model=settings.model, version=settings.version)
        self.model = ServedModel(
            name=settings.model,
            version=settings.version,
            directory=settings.model_directory,
            config=config,
            metrics=self._metrics,
            logger=logger,
        )
        self._health = HealthServicer()
        self._server = grpc.aio.server(options=server_options(MAX_MESSAGE_BYTES))
        self._metrics_server: Any = None
        self._started = False
        self._shutting_down = False
        self._registration: ConsulRegistration | None = None
        self.port = 0

    async def start(self) -> None:
        """Listen for gRPC (health NOT_SERVING) and metrics; raises StartError if a port is taken."""
        settings = self._settings
        for service in ("", settings.model):
            await self._health.set(service, NOT_SERVING)
        add_to_server(InferenceServicer(self.model, metrics=self._metrics, logger=self._logger), self._server)
        add_health_and_reflection(
            self._server, self._health, oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
        )
        address = f"[{settings.host}]:{settings.port}" if ":" in settings.host else f"{settings.host}:{settings.port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as error:
            raise StartError(f"cannot listen for gRPC on {address} ({error})") from None
        if settings.metrics_port:
            try:
                self._metrics_server, _ = start_http_server(
                    settings.metrics_port, addr=settings.host, registry=self.registry
                )
            except OSError as error:
                raise StartError(f"cannot serve metrics on port {settings.metrics_port} ({error.strerror})") from None
        await self._server.start()
        self._started = True
        self._logger.info("listening", port=self.port, metrics_port=settings.metrics_port or None)

    async def load(self) -> None:
        """Load and warm up the model, then report SERVING.

        A bad model or config raises ConfigError. A failing warm-up is logged
        and leaves health NOT_SERVING: the process stays up and says so, and
        a registry keeps it out of rotation.
        """
        await self.model.load()
        try:
            await self.model.warm_up()
        except Exception:
            self._logger.exception("warm-up inference failed; health stays NOT_SERVING")
            return
        if self._shutting_down:
            return
        for service in ("", self._settings.model):
            await self._health.set(service, SERVING)
        self._logger.info("serving", batching=self.model.config.batching)
        registration = self._settings.registration
        if registration is not None and registration.consul is not None:
            self._registration = ConsulRegistration(
                registration,
                model=self._settings.model,
                version=self._settings.version,
                backend=self.model.config.backend,
                port=self.port,
                logger=self._logger,
            )
            self._registration.start()

    async def shutdown(self) -> None:
        """Leave rotation, then stop, in this order (calling it again does nothing):

        1. Health turns NOT_SERVING for every service; ServerReady and
           ModelReady answer false. Routers and Consul stop picking this worker.
           If registered in Consul, the worker deregisters (at most a few seconds).
        2. Calls keep being answered for ``drain_delay_s`` (skipped if the
           model never became ready), so calls routed before step 1 was seen
           still succeed.
        3. Health Watch streams end (they would otherwise hold step 4).
        4. ``server.stop(shutdown_grace_s)``: new calls are rejected; calls in
           flight have up to the grace period to finish, then are cancelled.
        5. The scheduler stops (running batches finish, anything still queued
           fails UNAVAILABLE); executor threads and the engine are released.
        6. The metrics endpoint stops.
        """
        if self._shutting_down:
            return
        self._shutting_down = True
        settings = self._settings
        was_ready = self.model.ready
        self._logger.info("shutting down", drain_delay_s=settings.drain_delay_s, grace_s=settings.shutdown_grace_s)
        await self._health.enter_graceful_shutdown()
        self.model.start_draining()
        if self._registration is not None:
            await self._registration.stop()
        if self._started:
            if was_ready and settings.drain_delay_s > 0:
                await asyncio.sleep(settings.drain_delay_s)
            self._health.end_watches()
            await self._server.stop(settings.shutdown_grace_s)
        await self.model.stop()
        if self._metrics_server is not None:
            await asyncio.to_thread(_stop_http_server, self._metrics_server)
        self._logger.info("stopped")


def _stop_http_server(server: Any) -> None:
    server.shutdown()
    server.server_close()


async def serve(settings: WorkerSettings, config: ModelConfig, logger: structlog.stdlib.BoundLogger) -> int:
    """Run the worker until SIGTERM/SIGINT; the return value is the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: signal.Signals) -> None:
        if stop.is_set():
            logger.warning("signal ignored, already shutting down", signal=signum.name)
            return
        logger.info("signal received, shutting down", signal=signum.name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    worker = Worker(settings, config, logger=logger)
    try:
        await worker.start()
        loading = asyncio.create_task(worker.load(), name="load-model")
        stopping = asyncio.create_task(stop.wait(), name="wait-for-signal")
        try:
            done, _ = await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if loading in done:
                loading.result()  # a bad model raises ConfigError here
                await stopping
        finally:
            for task in (loading, stopping):
                task.cancel()
            await asyncio.gather(loading, stopping, return_exceptions=True)
    finally:
        await worker.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``splitstream-worker`` and ``python -m splitstream.worker``."""
    args = build_parser().parse_args(argv)
    try:
        settings = WorkerSettings(
            model_repository=args.model_repository,
            model=args.model,
            version=args.version,
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            log_level=args.log_level,
            drain_delay_s=args.drain_delay_s,
            shutdown_grace_s=args.shutdown_grace_s,
            registration=registration_settings(args, host=args.host),
        )
        if not settings.model_directory.is_dir():
            raise ConfigError(f"--model-repository: no directory {settings.model_directory} for this model version")
        config = ModelConfig.from_file(settings.model_directory / "config.yaml")
    except ConfigError as error:
        return _fail(2, error)
    logger = configure_logging(settings.log_level, service="worker").bind(
        model=settings.model, version=settings.version
    )
    try:
        return asyncio.run(serve(settings, config, logger))
    except ConfigError as error:
        return _fail(2, error)
    except StartError as error:
        return _fail(1, error)


def _fail(code: int, error: Exception) -> int:
    print(f"{PROG}: error: {error}", file=sys.stderr)
    return code
