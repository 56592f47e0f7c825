"""Registering the worker in Consul, so routers find it without anyone editing their config.

Off unless ``--registry consul://HOST:PORT`` is given (with the file registry,
workers are listed in the file). Once the model is SERVING the worker registers
one instance of service ``splitstream-<model>``:

- ID ``splitstream-<model>-<version>-<host>-<port>``; tags ``<version>`` and the
  engine tag; meta ``model``, ``version``, ``engine_tag``, ``backend``, ``precision``.
- A gRPC health check on ``<address>/<model>`` (the worker's grpc.health.v1
  service) every ``--check-interval-s``, initially passing (the worker registers
  only once its warm-up succeeded), deregistered by Consul after
  ``--deregister-critical-after-s`` of failing checks (Consul's own minimum is 1 minute).
- Every ``--reregister-interval-s`` it asks the agent whether it still knows the
  instance and registers again if not (an agent restarted without its state).
  Consul being unreachable is logged and retried; it never stops the worker.

On shutdown (after health turned NOT_SERVING) it deregisters, so routers drop
the endpoint before the worker stops taking calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import structlog

from splitstream.common.consul_agent import (
    ConsulAddress,
    consul_errors,
    describe_error,
    parse_consul_spec,
    run_blocking,
    service_name,
)
from splitstream.common.errors import ConfigError

#: Consul calls from the worker give up after this long (they are small; Consul is a local agent).
CALL_TIMEOUT_S = 2.0


@dataclass(frozen=True, kw_only=True)
class RegistrationSettings:
    """The registration flags, validated; ``consul`` is None when the worker does not register."""

    consul: ConsulAddress | None
    advertise_host: str = ""
    advertise_port: int = 0
    engine_tag: str = ""
    precision: str = "fp32"
    check_interval_s: float = 1.0
    deregister_critical_after_s: float = 60.0
    reregister_interval_s: float = 10.0

    def __post_init__(self) -> None:
        for flag, value in (
            ("--check-interval-s", self.check_interval_s),
            ("--deregister-critical-after-s", self.deregister_critical_after_s),
            ("--reregister-interval-s", self.reregister_interval_s),
        ):
            if value <= 0:
                raise ConfigError(f"{flag}: must be > 0, got {value}")


def add_registration_arguments(parser: argparse.ArgumentParser) -> None:
    """Registration flags (each also read from its SPLITSTREAM_WORKER_* environment variable)."""
    parser.add_argument(
        "--registry",
        default="",
        metavar="consul://HOST:PORT",
        help="Consul registration: register in this Consul agent once serving, deregister on shutdown "
        "(ACL token from CONSUL_HTTP_TOKEN); empty: do not register",
    )
    parser.add_argument(
        "--advertise-address",
        default="",
        metavar="HOST[:PORT]",
        help="address routers use to reach this worker; default: --host unless it is a wildcard "
        "(then Consul uses its node's address), and the gRPC port",
    )
    parser.add_argument(
        "--engine-tag",
        default="",
        metavar="TAG",
        help="engine tag to publish, e.g. resnet-v2-fp16-dyn; empty: MODEL-VERSION-PRECISION",
    )
    parser.add_argument("--precision", default="fp32", metavar="P", help="precision to publish: fp32, fp16, int8")
    parser.add_argument(
        "--check-interval-s", type=float, default=1.0, metavar="S", help="how often Consul checks the worker's health"
    )
    parser.add_argument(
        "--deregister-critical-after-s",
        type=float,
        default=60.0,
        metavar="S",
        help="Consul removes the worker after its check failed this long",
    )
    parser.add_argument(
        "--reregister-interval-s",
        type=float,
        default=10.0,
        metavar="S",
        help="how often the worker checks that Consul still knows it, registering again if not",
    )


def registration_settings(args: argparse.Namespace, *, host: str) -> RegistrationSettings:
    """Build the settings from parsed flags; raises ConfigError naming the flag at fault."""
    consul_address = None
    if args.registry:
        try:
            consul_address = parse_consul_spec(args.registry)
        except ValueError as error:
            raise ConfigError(f"--registry: {error}") from None
    advertise_host, advertise_port = host, 0
    if args.advertise_address:
        advertise_host, advertise_port = _split_address(args.advertise_address)
    if advertise_host in {"", "0.0.0.0", "::", "[::]"}:
        advertise_host = ""
    return RegistrationSettings(
        consul=consul_address,
        advertise_host=advertise_host,
        advertise_port=advertise_port,
        engine_tag=args.engine_tag,
        precision=args.precision,
        check_interval_s=args.check_interval_s,
        deregister_critical_after_s=args.deregister_critical_after_s,
        reregister_interval_s=args.reregister_interval_s,
    )


def _split_address(text: str) -> tuple[str, int]:
    host, port = text, 0
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            port = _port(rest.removeprefix(":"), text)
    elif text.count(":") == 1:
        host, _, raw = text.partition(":")
        port = _port(raw, text)
    if not host:
        raise ConfigError(f"--advertise-address: no host in {text!r}")
    return host, port


def _port(raw: str, text: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) <= 65535:
        raise ConfigError(f"--advertise-address: bad port in {text!r}")
    return int(raw)


def _duration(seconds: float) -> str:
    """Consul's duration syntax."""
    return f"{round(seconds * 1000)}ms"


class ConsulRegistration:
    """Keeps one worker registered while it serves; :meth:`start` once, :meth:`stop` once."""

    def __init__(
        self,
        settings: RegistrationSettings,
        *,
        model: str,
        version: str,
        backend: str,
        port: int,
        logger: structlog.stdlib.BoundLogger,
        use_tls: bool = False,
    ) -> None:
        """``use_tls``: the worker serves TLS, so Consul's gRPC check must dial it over TLS (the agent
        verifies it with its own CA and presents its own certificate where the worker wants one)."""
        assert settings.consul is not None
        self.settings = settings
        self.consul = settings.consul
        self.model = model
        self.port = settings.advertise_port or port
        host = settings.advertise_host
        self.service_id = f"{service_name(model)}-{version}-{host or 'node'}-{self.port}"
        engine_tag = settings.engine_tag or f"{model}-{version}-{settings.precision}"
        self.meta = {
            "model": model,
            "version": version,
            "engine_tag": engine_tag,
            "backend": backend,
            "precision": settings.precision,
        }
        self.tags = list(dict.fromkeys([version, engine_tag]))
        self.host = host
        # The agent runs the check; with no advertised host it is on this node, so loopback reaches us.
        self.check: dict[str, Any] = {
            "GRPC": f"{host or '127.0.0.1'}:{self.port}/{model}",
            "Interval": _duration(settings.check_interval_s),
            "Timeout": _duration(min(settings.check_interval_s, 5.0)),
            "DeregisterCriticalServiceAfter": _duration(settings.deregister_critical_after_s),
            "Status": "passing",
            **({"GRPCUseTLS": True} if use_tls else {}),
        }
        self._logger = logger.bind(consul=self.consul.description, service_id=self.service_id)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Register now and keep registered, in the background (Consul being down never blocks the worker)."""
        self._task = asyncio.create_task(self._keep_registered(), name="consul-registration")

    async def stop(self) -> None:
        """Stop re-registering, then deregister (bounded by the call timeout; failures are logged)."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        try:
            await asyncio.wait_for(run_blocking(self._deregister), CALL_TIMEOUT_S + 1)
        except (*consul_errors(), TimeoutError) as error:
            self._logger.warning("could not deregister from consul", error=describe_error(error))
        else:
            self._logger.info("deregistered from consul")

    async def _keep_registered(self) -> None:
        registered = False
        delay = 0.2
        while True:
            try:
                if not registered or not await run_blocking(self._is_known):
                    if registered:
                        self._logger.warning("consul no longer knows this worker; registering again")
                    await run_blocking(self._register)
                    if not registered:
                        self._logger.info("registered in consul", service=service_name(self.model), meta=self.meta)
                    registered = True
                delay = 0.2
                await asyncio.sleep(self.settings.reregister_interval_s)
            except consul_errors() as error:
                self._logger.warning("consul unreachable; will retry", error=describe_error(error), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.reregister_interval_s)

    def _register(self) -> None:
        client = self.consul.client(timeout_s=CALL_TIMEOUT_S)
        client.agent.service.register(
            service_name(self.model),
            service_id=self.service_id,
            address=self.host or None,
            port=self.port,
            tags=self.tags,
            meta=self.meta,
            check=self.check,
        )

    def _is_known(self) -> bool:
        client = self.consul.client(timeout_s=CALL_TIMEOUT_S)
        return self.service_id in (client.agent.services() or {})

    def _deregister(self) -> None:
        self.consul.client(timeout_s=CALL_TIMEOUT_S).agent.service.deregister(self.service_id)
