"""``python -m splitstream.common.healthcheck HOST:PORT [SERVICE]``: exit 0 when the server reports SERVING.

For container healthchecks and scripts: asks the standard grpc.health.v1 service,
so it works for every splitstream process (and any gRPC server that has one).
Exit codes: 0 SERVING, 1 anything else (NOT_SERVING, unreachable, no health service), 2 usage.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2 or ":" not in args[0]:
        print("usage: python -m splitstream.common.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    address, service = args[0], (args[1] if len(args) == 2 else "")
    try:
        with grpc.insecure_channel(address) as channel:
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
