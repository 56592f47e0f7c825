"""``python -m splitstream.common.healthcheck HOST:PORT [SERVICE]``: exit 0 when the server reports SERVING.

For container healthchecks and scripts: asks the standard grpc.health.v1 service,
so it works for every splitstream process (and any gRPC server that has one).
Exit codes: 0 SERVING, 1 anything else (NOT_SERVING, unreachable, no health service), 2 usage.

A server that serves TLS is checked over TLS when ``SPLITSTREAM_HEALTHCHECK_TLS_CA`` is set (with
``..._TLS_CERT``/``..._TLS_KEY`` for mutual TLS and ``..._TLS_SERVER_NAME``): environment, not
arguments, so a container's healthcheck line stays the same in the plaintext and the TLS stacks.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitstream.common.errors import ConfigError
from splitstream.common.tls import ClientTls


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2 or ":" not in args[0]:
        print("usage: python -m splitstream.common.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    address, service = args[0], (args[1] if len(args) == 2 else "")
    prefix = "SPLITSTREAM_HEALTHCHECK_TLS_"
    tls = ClientTls(
        enabled=bool(os.environ.get(f"{prefix}CA")),
        ca_file=os.environ.get(f"{prefix}CA", ""),
        cert_file=os.environ.get(f"{prefix}CERT", ""),
        key_file=os.environ.get(f"{prefix}KEY", ""),
        server_name=os.environ.get(f"{prefix}SERVER_NAME", ""),
        flag=f"{prefix}*",
    )
    try:
        tls.check()
    except ConfigError as error:
        print(f"healthcheck: {error}", file=sys.stderr)
        return 2
    try:
        with tls.channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3
            )
    except grpc.RpcError as error:
        print(f"{address}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{address}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main())
