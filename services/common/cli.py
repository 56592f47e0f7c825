"""Command-line helpers shared by every service's entry point.

Each flag can also come from an environment variable ``SPLITSTREAM_<SERVICE>_<FLAG>``
(``--metrics-port`` of the router → ``SPLITSTREAM_ROUTER_METRICS_PORT``), which is
how containers are configured. A flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to ``SPLITSTREAM_<SERVICE>_<FLAG>`` when set."""

    def __init__(self, *args: Any, env_prefix: str, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        self.env_prefix = env_prefix
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        return super().add_argument(*names, **self._from_environment(names, kwargs))

    def add_argument_group(self, *args: Any, **kwargs: Any) -> argparse._ArgumentGroup:
        """Groups read the environment too (argparse's groups have their own ``add_argument``)."""
        group = super().add_argument_group(*args, **kwargs)
        add = group.add_argument

        def add_argument(*names: Any, **options: Any) -> argparse.Action:
            return add(*names, **self._from_environment(names, options))

        group.add_argument = add_argument  # type: ignore[method-assign]
        return group

    def _from_environment(self, names: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        long_names = [n for n in names if isinstance(n, str) and n.startswith("--")]
        if not long_names or "help" not in kwargs or kwargs.get("action") == "help":
            return kwargs
        variable = self.env_prefix + long_names[0][2:].upper().replace("-", "_")
        if variable in os.environ:
            raw = os.environ[variable]
            if kwargs.get("action") == "store_true":
                kwargs["default"] = raw.strip().lower() in {"1", "true", "yes", "on"}
            else:
                try:
                    kwargs["default"] = kwargs["type"](raw) if "type" in kwargs else raw
                except (TypeError, ValueError):
                    self.error(f"{variable}: invalid value {raw!r} for {long_names[0]}")
            kwargs["required"] = False
        kwargs["help"] = f"{kwargs['help']} [env {variable}]"
        return kwargs

    def error(self, message: str) -> NoReturn:
        """Usage errors: one line on stderr and exit code 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str) -> NoReturn:
    """Exit 2 with one clear line (configuration errors found after parsing)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


#: Server options every splitstream gRPC server uses. SO_REUSEPORT off: two
#: processes must never silently share a port.
def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def add_health_and_reflection(server: Any, health_servicer: Any, *service_names: str) -> None:
    """Register grpc.health.v1 and server reflection for ``service_names`` (full names) on ``server``.

    Every splitstream server offers both: health for routers, Consul and container checks;
    reflection so `grpcurl` and friends can call it without the .proto files.
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
