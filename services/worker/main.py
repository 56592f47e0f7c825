"""``splitstream-worker``: serve one model version over gRPC until SIGTERM.

Wiring only: read the flags and the model's config.yaml, and hand a
:class:`Worker` to the shared runtime (:mod:`splitstream.common.runtime`),
which serves it (inference, health, reflection, metrics), loads and warms up
the model in the background, and drains it in order on SIGTERM.

Exit codes: 0 after a clean shutdown; 2 for a bad flag or model config, or a
taken port (one line on stderr saying which); 1 when the worker failed otherwise.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from prometheus_client import CollectorRegistry

from splitstream.common.caller_identities import (
    ALLOWED_IDENTITIES_FLAG,
    IdentityGate,
    add_allowed_identities_argument,
    parse_identities,
)
from splitstream.common.cli import EnvArgumentParser, fail
from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.common.protected_mode import check_protected_mode
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.runtime import (
    Runtime,
    ServerDefaults,
    ServerSettings,
    Service,
    add_server_arguments,
    run_service,
)
from splitstream.worker.config import ModelConfig, add_model_repository_argument
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


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """The worker's command line, validated."""

    server: ServerSettings
    model_repository: Path
    model: str
    version: str
    registration: RegistrationSettings | None = None  # Consul registration; None: not registered
    #: Verified client-certificate identities served (mutual TLS); empty: any caller.
    allowed_client_identities: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model: must not be empty")
        if not self.version:
            raise ConfigError("--version: must not be empty")
        check_protected_mode(
            host=self.server.host,
            tls=self.server.tls is not None,
            authenticated=bool(self.allowed_client_identities),
            insecure=self.server.insecure,
            auth_flag=f"{ALLOWED_IDENTITIES_FLAG} (with mutual TLS)",
        )

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
            "Exit codes: 0 clean shutdown, 2 bad flag or model config or a taken port, 1 failed otherwise."
        ),
    )
    add_model_repository_argument(parser)
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
    add_server_arguments(parser, ServerDefaults(port=9000, metrics_port=9001))
    add_allowed_identities_argument(parser, callers="routers")
    add_registration_arguments(parser)
    return parser


class Worker(Service):
    """One model version: loaded and warmed up while serving (health NOT_SERVING until then)."""

    prog = PROG
    grpc_services = (oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,)

    def __init__(self, settings: WorkerSettings, config: ModelConfig, *, logger: structlog.stdlib.BoundLogger) -> None:
        self._settings = settings
        self._logger = logger
        self.metrics = CollectorRegistry()
        self._metrics = WorkerMetrics(self.metrics, model=settings.model, version=settings.version)
        self.model = ServedModel(
            name=settings.model,
            version=settings.version,
            directory=settings.model_directory,
            config=config,
            metrics=self._metrics,
            logger=logger,
        )
        self._registration: ConsulRegistration | None = None

    def interceptors(self) -> Sequence[grpc.aio.ServerInterceptor]:
        allowed = self._settings.allowed_client_identities
        return [IdentityGate(allowed)] if allowed else []

    def health_names(self) -> Sequence[str]:
        return (self._settings.model,)

    def register(self, server: grpc.aio.Server) -> None:
        add_to_server(InferenceServicer(self.model, metrics=self._metrics, logger=self._logger), server)

    async def run(self, runtime: Runtime) -> None:
        """Load and warm up the model, then report SERVING (and register in Consul if asked).

        A bad model or config raises ConfigError (exit 2). A failing warm-up is logged and
        leaves health NOT_SERVING: the process stays up and says so, and a registry keeps
        it out of rotation.
        """
        if not self._settings.allowed_client_identities:
            # Whoever reaches this port skips the router's permissions and its recording: say so where it is read
            # (here, once listening: a worker that fails its start has one error line, nothing else).
            self._logger.warning(
                f"any caller is served: a call sent here directly skips the router's permissions and recording; "
                f"{ALLOWED_IDENTITIES_FLAG} (with --grpc-use-ssl-mutual) serves only the routers named",
                host=runtime.settings.host,
            )
        await self.model.load()
        try:
            await self.model.warm_up()
        except Exception:
            self._logger.exception("warm-up inference failed; health stays NOT_SERVING")
            return
        await runtime.set_serving(True)
        self._logger.info("serving", batching=self.model.config.batching)
        registration = self._settings.registration
        if registration is not None and registration.consul is not None:
            self._registration = ConsulRegistration(
                registration,
                model=self._settings.model,
                version=self._settings.version,
                backend=self.model.config.backend,
                port=runtime.port,
                logger=self._logger,
                use_tls=runtime.settings.tls is not None,
            )
            self._registration.start()

    async def draining(self) -> None:
        """Leave rotation: ServerReady and ModelReady answer false (health is NOT_SERVING already);
        if registered in Consul, deregister (at most a few seconds), so routers drop this worker
        before it stops taking calls."""
        self.model.start_draining()
        if self._registration is not None:
            await self._registration.stop()

    async def teardown(self) -> None:
        """The scheduler stops (running batches finish, anything still queued fails UNAVAILABLE);
        executor threads and the engine are released."""
        await self.model.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``splitstream-worker`` and ``python -m splitstream.worker``."""
    args = build_parser().parse_args(argv)
    try:
        server = ServerSettings.from_args(args)
        settings = WorkerSettings(
            server=server,
            model_repository=args.model_repository,
            model=args.model,
            version=args.version,
            registration=registration_settings(args, host=server.host),
            allowed_client_identities=parse_identities(
                args.allowed_client_identities, mutual=server.grpc_use_ssl_mutual
            ),
        )
        if not settings.model_directory.is_dir():
            raise ConfigError(f"--model-repository: no directory {settings.model_directory} for this model version")
        config = ModelConfig.from_file(settings.model_directory / "config.yaml")
    except ConfigError as error:
        fail(PROG, str(error))
    logger = configure_logging(server.log_level, service="worker").bind(model=settings.model, version=settings.version)
    return run_service(server, lambda: Worker(settings, config, logger=logger), prog=PROG)
