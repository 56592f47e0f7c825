"""Shadow traffic: a sampled copy of a call goes to a shadow version after the client has its answer.

The copy runs in a tracked background task, so the client never waits for it
and never sees its result; its output, status and latency join the call's
record, which is handed to the recorder once every shadow of the call is done.
The copy is the client's request bytes with ``model_version`` overridden by
appending that one field: protobuf keeps the last value of a singular field,
so this re-targets the request without decoding its tensors.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
from grpc import aio

from splitstream.common.proto.splitstream.v1 import router_pb2
from splitstream.common.wal import ShadowEntry
from splitstream.router.core import CallOutcome, RouterCore
from splitstream.router.metrics import RouterMetrics
from splitstream.router.recording import CallLog

log = structlog.get_logger()


@dataclass(slots=True)
class ShadowOutcome:
    version: str
    endpoint: str
    code: grpc.StatusCode
    details: str
    latency_s: float
    response: bytes | None


class ShadowRunner:
    def __init__(
        self,
        core: RouterCore,
        metrics: RouterMetrics,
        mirror: CallLog | None,
        *,
        timeout_s: float,
        max_in_flight: int,
    ) -> None:
        self.core = core
        self.metrics = metrics
        self.mirror = mirror
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self._tasks: set[asyncio.Task[None]] = set()

    def after_answer(self, outcome: CallOutcome, request: bytes, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """Start the sampled shadows of a finished call (if any), then record it. Never blocks."""
        versions = self._sample(outcome)
        if versions and len(self._tasks) >= self.max_in_flight:
            self.metrics.shadows_skipped.labels(outcome.model, "too_many_in_flight").inc(len(versions))
            versions = []
        if self.mirror is not None:  # logged now, so a router killed before its shadows end loses no call
            self.mirror.offer(outcome, request, metadata, shadows_expected=len(versions))
        if not versions:
            return
        task = asyncio.create_task(self._run(outcome, request, metadata, versions))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _sample(self, outcome: CallOutcome) -> list[str]:
        if not outcome.version:  # never routed (bad request, unknown model): nothing to compare
            return []
        return [
            s.version
            for s in self.core.shadows_of(outcome.model)
            if s.version != outcome.version and random.random() < s.sample_rate
        ]

    async def _run(
        self,
        outcome: CallOutcome,
        request: bytes,
        metadata: Sequence[tuple[str, str | bytes]],
        versions: list[str],
    ) -> None:
        outcome.shadows = list(await asyncio.gather(*(self._shadow(outcome, request, v) for v in versions)))
        if self.mirror is not None:
            self.mirror.offer_shadows(
                outcome.request_id,
                [
                    ShadowEntry(s.version, s.endpoint, s.code, s.details, s.latency_s, s.response)
                    for s in outcome.shadows
                ],
            )

    async def _shadow(self, outcome: CallOutcome, request: bytes, version: str) -> ShadowOutcome:
        started = time.perf_counter()
        endpoint = self.core.shadow_endpoint(outcome.model, version)
        if endpoint is None:
            result = ShadowOutcome(
                version,
                "",
                grpc.StatusCode.UNAVAILABLE,
                f"shadow version '{version}' has no healthy endpoint",
                0.0,
                None,
            )
        else:
            retargeted = request + router_pb2.InferRequestHead(model_version=version).SerializeToString()
            try:
                response = await endpoint.call(retargeted, timeout_s=self.timeout_s, request_id=outcome.request_id)
                result = ShadowOutcome(
                    version, endpoint.address, grpc.StatusCode.OK, "", time.perf_counter() - started, response
                )
            except aio.AioRpcError as error:
                result = ShadowOutcome(
                    version, endpoint.address, error.code(), error.details() or "", time.perf_counter() - started, None
                )
        self.metrics.shadow_requests.labels(outcome.model, version, result.code.name).inc()
        self.metrics.shadow_latency.labels(outcome.model, version).observe(result.latency_s)
        return result

    async def close(self) -> None:
        """Let shadows in flight finish (each is bounded by the shadow timeout) so their records are kept."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
