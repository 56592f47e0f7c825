"""grpc.health.v1 from grpcio-health-checking, plus ending Watch streams at shutdown.

The library's aio servicer keeps every ``Watch`` stream open forever. During
shutdown that would hold ``server.stop(grace)`` for the whole grace period
whenever anything watches the server (routers watch workers; Consul, balancers
and other routers may watch any splitstream server). :meth:`HealthServicer.end_watches`
closes those streams (with OK, after they have seen NOT_SERVING), so only
inference calls are waited for.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health, health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health.aio.HealthServicer):
    """The standard servicer (Check, Watch, set, enter_graceful_shutdown) with closable Watch streams."""

    def __init__(self) -> None:
        super().__init__()
        self._watches_ended = asyncio.Event()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        watching = asyncio.ensure_future(super().Watch(request, context))
        ended = asyncio.ensure_future(self._watches_ended.wait())
        try:
            await asyncio.wait({watching, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            ended.cancel()
            await asyncio.gather(watching, ended, return_exceptions=True)

    def end_watches(self) -> None:
        """End every open Watch stream now and any opened later."""
        self._watches_ended.set()
