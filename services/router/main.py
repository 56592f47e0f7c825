"""``splitstream-router``: serve the Open Inference Protocol and split traffic between model versions.

Wiring only: flags → :class:`RouterConfig` (:mod:`splitstream.router.config`), the registry, and a
:class:`Router` that the shared runtime (:mod:`splitstream.common.runtime`) serves, drains and stops.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import structlog
from grpc import aio
from prometheus_client import CollectorRegistry

from splitstream.common.cli import fail
from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import feedback_pb2, router_pb2
from splitstream.common.registry import ConsulRegistry, FileRegistry, Registry, RegistryUpdate, parse_consul_spec
from splitstream.common.runtime import Runtime, Service, process_index, run_service
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.supervisor import SharedPort, supervise
from splitstream.router.config import (
    ENV_PREFIX,
    LOG_DIR_DEFAULT,
    PROG,
    RENAMED_FLAGS,
    RouterConfig,
    child_log_dir,
    parse_args,
)
from splitstream.router.core import EndpointSettings, RouterCore
from splitstream.router.feedback import FeedbackService
from splitstream.router.metrics import RouterMetrics
from splitstream.router.recording import CallLog
from splitstream.router.servicer import RouterServicer
from splitstream.router.shadows import ShadowRunner
from splitstream.router.shipper_child import ShipperChild
from splitstream.router.streams import StreamProxy

if TYPE_CHECKING:
    from splitstream.router.auth.credentials import PrincipalsStore
    from splitstream.router.auth.interceptor import AuthInterceptor
    from splitstream.router.auth.jwks import JwtVerifier
    from splitstream.router.auth.policy import Policy
    from splitstream.router.auth.reload import CredentialReloader
    from splitstream.router.auth.revocation import RevocationStore
    from splitstream.router.http.app import HttpFrontDoor

#: After the registry watch failed in a way its backend did not report as an update (an exception,
#: or the watch ending), wait this long before watching again: long enough not to spin on a file
#: that keeps failing the same way, short next to the time an operator takes to fix it.
WATCH_RESTART_DELAY_S = 1.0
#: How often the --upstream-tls-* files are looked at (three stat calls) for a rotation to apply to open channels.
UPSTREAM_TLS_POLL_S = 2.0


def open_registry(spec: str) -> Registry:
    """The registry ``spec`` names; ConfigError when it names none that can be opened."""
    scheme, _, location = spec.partition(":")
    if scheme == "file" and location:
        if not os.path.isfile(location):
            raise ConfigError(f"--registry: file '{location}' does not exist")
        return FileRegistry(location)
    if scheme == "consul":
        try:
            return ConsulRegistry(parse_consul_spec(spec))
        except ValueError as error:
            raise ConfigError(f"--registry: {redact_text(str(error))}") from None
    raise ConfigError(f"--registry: unknown registry '{redact_url(spec)}' (expected file:PATH or consul://HOST:PORT)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``splitstream-router``; exit codes as :mod:`splitstream.common.runtime` says."""
    config = parse_args(argv)
    log = configure_logging(config.server.log_level, service="router")
    for old in config.deprecated if process_index() is None else ():  # said once, by the parent of --processes
        new = RENAMED_FLAGS[old]
        log.warning(
            f"{old} is deprecated and will be removed in the next release: use {new}",
            deprecated=f"{old} ({_variable(old)})",
            use=f"{new} ({_variable(new)})",
        )
    try:
        registry = open_registry(config.registry)
    except ConfigError as error:
        fail(PROG, str(error))
    if config.server.processes > 1:
        return _supervise(config, sys.argv[1:] if argv is None else argv)
    return run_service(config.server, lambda: Router(config, registry), prog=PROG)


def _variable(flag: str) -> str:
    return ENV_PREFIX + flag.removeprefix("--").upper().replace("-", "_")


def _supervise(config: RouterConfig, argv: Sequence[str]) -> int:
    """``--processes N``: N routers on one port; with ``--shipper child`` one shipper for their N logs."""
    companion = None
    if config.recorder and config.shipper == "child":
        try:
            for index in range(config.server.processes):  # the shipper opens them before the children start
                os.makedirs(child_log_dir(config.log_dir, index), exist_ok=True)
        except OSError as error:
            fail(PROG, f"--log-dir {config.log_dir}: {error.strerror or error}")

        def companion(registry: CollectorRegistry) -> ShipperChild:
            return ShipperChild(config.shipper_args, registry, stop_timeout_s=15.0)

    # Every child serves the HTTP port too, as it serves --port.
    shared = [SharedPort("--http-port", "HTTP", config.http_port)] if config.http_port else []
    return supervise(
        config.server,
        module="splitstream.router",
        argv=argv,
        prog=PROG,
        service="router",
        companion=companion,
        # The children re-read their credentials on SIGHUP; one signal to the parent reaches them all.
        forward_sighup=bool(config.auth_principals),
        shared_ports=shared,
    )


class Router(Service):
    """The router's parts, wired for the shared runtime: the registry feeds the routing core; calls go
    through the servicer; answered calls go to shadows and the recording mirror."""

    prog = PROG
    grpc_services = (
        oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
        router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
        feedback_pb2.DESCRIPTOR.services_by_name["Feedback"].full_name,
    )

    def __init__(self, config: RouterConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.log = structlog.get_logger().bind(router_id=config.router_id)
        self.router_metrics = RouterMetrics()
        self.metrics = self.router_metrics.registry
        server = config.server
        self.core = RouterCore(
            settings=EndpointSettings(
                channel_options=(
                    ("grpc.max_receive_message_length", server.max_message_bytes),
                    ("grpc.max_send_message_length", server.max_message_bytes),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 2000),
                ),
                eject_after_failures=config.eject_after_failures,
                eject_duration_s=config.eject_duration_s,
                drain_timeout_s=server.shutdown_grace_s,
                tls=config.upstream_tls,
            ),
            metrics=self.router_metrics,
        )
        self.streams = StreamProxy(self.core, record_max_bytes=config.record_stream_max_bytes)
        self.servicer = RouterServicer(
            self.core, router_id=config.router_id, registry_description=registry.description, streams=self.streams
        )
        self.mirror: CallLog | None = None
        self.shipper: ShipperChild | None = None
        if config.recorder:
            try:
                self.mirror = CallLog(
                    config.log_dir,
                    self.metrics,
                    router_id=config.router_id,
                    hmac_key=config.hmac_key.encode(),
                    max_bytes=config.spool_max_bytes,
                    segment_bytes=config.log_segment_bytes,
                    flush_interval_s=config.log_flush_interval_s,
                    record_credential_headers=config.record_credential_headers,
                )
            except OSError as error:  # a directory that cannot be created or read is the operator's to fix
                raise ConfigError(f"--log-dir {config.log_dir}: {error.strerror or error}") from None
            if process_index() is None:  # a --processes child's siblings are its sibling routers' logs
                self.mirror.warn_stranded(also=[LOG_DIR_DEFAULT])
            if config.shipper == "child":
                # It stops after the router's drain: its SIGTERM drain gets the recorder's ack timeout and some.
                self.shipper = ShipperChild(config.shipper_args, self.metrics, stop_timeout_s=15.0)
        self.shadows = ShadowRunner(
            self.core,
            self.router_metrics,
            self.mirror,
            timeout_s=config.shadow_timeout_s,
            max_in_flight=config.shadow_max_in_flight,
        )
        self.servicer.after_answer = self.shadows.after_answer
        self.feedback = FeedbackService(
            mirror=self.mirror,
            hmac_key=config.hmac_key.encode(),
            serves=self.core.serves,
            registry=self.metrics,
        )
        if self.mirror is not None:
            self.streams.on_end = self.mirror.offer  # streams have no shadows: recorded as they end
        self._updates: AsyncIterator[RegistryUpdate] | None = None
        self.principals: PrincipalsStore | None = None
        self.jwt: JwtVerifier | None = None
        self.auth: AuthInterceptor | None = None
        self.revocations: RevocationStore | None = None
        if config.revoked_file:
            from splitstream.router.auth.revocation import RevocationStore

            self.revocations = RevocationStore(config.revoked_file)
        self.reloader: CredentialReloader | None = None
        if config.auth_principals:
            # The authentication stack (policies as pydantic models, credentials, limits: 0.02 s of CPU) is
            # imported here, at start, by the routers that authenticate callers; the others never load it.
            from splitstream.router.auth.credentials import PrincipalsStore, open_principals
            from splitstream.router.auth.interceptor import Authenticator, AuthInterceptor, AuthMetrics
            from splitstream.router.auth.jwks import JwtVerifier
            from splitstream.router.auth.ratelimit import RateLimiter
            from splitstream.router.auth.reload import CredentialReloader

            self.auth_metrics = AuthMetrics(self.metrics)
            self.limiter = RateLimiter()
            self.principals = PrincipalsStore(open_principals(config.auth_principals), on_update=self._on_principals)
            self.principals.api_key_secret = config.api_key_secret
            self.jwt = JwtVerifier(config.jwt) if config.jwt is not None else None
            authenticator = Authenticator(self.principals, jwt=self.jwt, api_keys=True, limiter=self.limiter)
            authenticator.revocations = self.revocations
            self.reloader = CredentialReloader(self.principals, self.jwt, self.revocations)
            self.servicer.reload = self.reloader.reload_everywhere
            self.auth = AuthInterceptor(authenticator, self.auth_metrics)
        # The HTTP front door: started after the gRPC server, stopped beside it (before_stop → teardown).
        self.http: HttpFrontDoor | None = None
        self._http_stop: asyncio.Task[None] | None = None
        if config.http_port:
            # aiohttp and the front door on first use: a third of a router's imports, for a port most leave off.
            from splitstream.router.http.app import HttpFrontDoor

            self.http = HttpFrontDoor(
                self.core,
                self.metrics,
                max_body_bytes=server.max_message_bytes,
                shutdown_grace_s=server.shutdown_grace_s,
                recording=self.mirror,
                feedback=self.feedback,
                record_max_bytes=config.record_stream_max_bytes,
                gate=self.auth.gate if self.auth is not None else None,  # the same checks as gRPC's
                servicer=self.servicer,
                upstream_idle_timeout_s=config.upstream_idle_timeout_s,
                body_timeout_s=config.http_body_timeout_s,
            )

    def interceptors(self) -> list[aio.ServerInterceptor]:
        """Calls are counted first (refused ones too), then authenticated and authorized."""
        return [*self.servicer.interceptors(), *([self.auth] if self.auth is not None else [])]

    def _on_principals(self, policy: Policy | None, error: str) -> None:
        if policy is None:
            self.auth_metrics.reloads.labels("error").inc()
            return
        self.auth_metrics.reloads.labels("ok").inc()
        if policy.key_owners:
            self.log.warning(
                "api_keys_sha256 (unsalted SHA-256) is deprecated and read for one more release: re-issue these "
                "keys with 'splitstream keys add' (docs/upgrading.md)",
                principals=sorted({name for name in policy.key_owners.values()}),
            )
        if policy.hmac_owners and not self.config.api_key_secret:
            self.log.error("api_keys_hmac_sha256 digests cannot be checked without --api-key-secret-file")
        self.auth_metrics.principals.set(len(policy.principals))
        self.limiter.forget_except(frozenset(policy.principals))

    def register(self, server: aio.Server) -> None:
        server.add_generic_rpc_handlers(self.servicer.handlers())
        server.add_generic_rpc_handlers(self.feedback.handlers())

    async def prepare(self, runtime: Runtime) -> None:
        """Load the registry before the first call can arrive; unusable at start → ConfigError (exit 2)."""
        self._updates = self.registry.watch()
        try:
            first = await anext(self._updates)
        except Exception as error:  # a backend bug must still be one line, not a traceback
            raise ConfigError(f"registry {self.registry.description}: {error}") from None
        if first.state is None:
            raise ConfigError(f"registry {self.registry.description}: {first.error}")
        self._apply(first)
        if self.principals is not None:
            await self.principals.load()
            policy = self.principals.policy
            if policy is not None and policy.hmac_owners and not self.config.api_key_secret:
                raise ConfigError(
                    "--api-key-secret-file is needed: the principals document lists api_keys_hmac_sha256 digests"
                )
            if self.jwt is not None:
                await self.jwt.keys.load()
            if self.revocations is not None:
                await self.revocations.load()
                self.revocations.start()
            self.principals.start()
            if self.reloader is not None:
                self.reloader.install()
        if self.mirror is not None:
            self.mirror.start()
        if self.shipper is not None:
            self.shipper.start()
            await self.shipper.started()

    async def run(self, runtime: Runtime) -> None:
        if self.http is not None:
            server = self.config.server
            port = await self.http.start(server.host, self.config.http_port, server.tls)
            index = process_index()
            self.log.info(
                "HTTP listening",
                host=server.host,
                http_port=port,
                **({"process_index": index} if index is not None else {}),
            )
        self.servicer.ready = True
        await runtime.set_serving(True)
        self.log.info("router serving", registry=self.registry.description, models=self.core.model_names())
        renewal = asyncio.create_task(
            self.core.follow_upstream_credentials(poll_s=UPSTREAM_TLS_POLL_S), name="upstream TLS rotation"
        )
        try:
            await self._follow()
        finally:
            renewal.cancel()

    async def _follow(self) -> None:
        """Apply registry updates until cancelled, whatever goes wrong.

        An exception out of the backend's watch (or the watch ending) is logged, marks the registry
        unhealthy, shows in Status, keeps the last good state, and the watch starts again after
        :data:`WATCH_RESTART_DELAY_S` (its first update is the whole current state)."""
        last_problem = ""
        while True:
            if self._updates is None:
                self._updates = self.registry.watch()
            try:
                async for update in self._updates:
                    self._apply(update)
                    last_problem = ""
                problem = "the registry watch ended"
                trace = False
            except Exception as error:
                problem = f"the registry watch failed: {type(error).__name__}: {error}"
                trace = True
            self._updates = None
            self._report_error(problem)
            if problem != last_problem:  # once per distinct failure, not once a second while it lasts
                self.log.error(
                    "registry watch stopped; keeping the last good state and watching again",
                    error=problem,
                    exc_info=trace,
                )
            last_problem = problem
            await asyncio.sleep(WATCH_RESTART_DELAY_S)

    def _apply(self, update: RegistryUpdate) -> None:
        if update.state is None:
            self._report_error(update.error or "unknown error")
            self.log.error("registry update rejected; keeping the last good state", error=update.error)
            return
        try:
            self.core.apply(update.state)
        except Exception as error:
            self._report_error(f"cannot apply the registry state: {type(error).__name__}: {error}")
            self.log.exception("registry state could not be applied; keeping the last good state")
            return
        self.servicer.registry_error = redact_text(update.error or "")
        self.router_metrics.registry_updates.labels("partial" if update.error else "ok").inc()
        self.router_metrics.registry_healthy.set(0 if update.error else 1)
        self.log.info("registry applied", generation=self.core.generation, models=sorted(update.state.models))
        if update.error:
            self.log.error("registry state applied with parts kept from before", error=update.error)

    def _report_error(self, error: str) -> None:
        self.servicer.registry_error = redact_text(error)  # Status is read by anyone who can call the router
        self.router_metrics.registry_updates.labels("error").inc()
        self.router_metrics.registry_healthy.set(0)

    async def draining(self) -> None:
        self.servicer.ready = False  # ServerReady/ModelReady say false, beside health's NOT_SERVING

    async def before_stop(self) -> None:
        if self.http is not None:  # stops accepting now; its calls in flight get the grace beside gRPC's
            self._http_stop = asyncio.create_task(self.http.stop(), name="HTTP stop")

    async def teardown(self) -> None:
        """After the server stopped: shadows in flight finish (so their calls are recorded whole);
        every answered call is queued by now, so the mirror flushes to the recorder or the spool;
        worker channels close once their calls are done."""
        if self._http_stop is not None:  # HTTP streams end before the worker channels close
            await self._http_stop
        await self.shadows.close()
        if self.principals is not None:
            await self.principals.close()
        if self.revocations is not None:
            await self.revocations.close()
        if self.reloader is not None:
            await self.reloader.close()
        if self.mirror is not None:
            await self.mirror.close()
        if self.shipper is not None:
            await self.shipper.stop()
        if self._updates is not None and hasattr(self._updates, "aclose"):
            await self._updates.aclose()
        await self.core.close()
        self.log.info("router stopped")
