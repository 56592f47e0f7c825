"""The router's gRPC edge: raw-bytes handlers for inference, typed ones for the rest.

ModelInfer (Open Inference Protocol) and splitstream.v1.Router/Infer share one
handler that receives the request as bytes (no deserializer), so tensors are
never decoded on the way through; the worker's response bytes go back as they
came. The other Open Inference Protocol methods answer for the router itself
(live/ready/server metadata) or ask a worker of the model (model metadata).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc import aio

import splitstream
from splitstream.common.errors import ModelNotFound, ModelNotReady, SplitstreamError, status_of
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import router_pb2
from splitstream.router.core import (
    PIN_HEADER,
    REQUEST_ID_HEADER,
    UNKNOWN_MODEL,
    VERSION_HEADER,
    CallOutcome,
    RouterCore,
)

#: Headers the core reads; everything else in the client's metadata is ignored.
_WANTED_HEADERS = frozenset({REQUEST_ID_HEADER, PIN_HEADER})


class RouterServicer:
    def __init__(self, core: RouterCore, *, router_id: str, registry_description: str) -> None:
        self.core = core
        self.router_id = router_id
        self.registry_description = registry_description
        self.registry_error = ""
        self.ready = False
        #: Gets every finished call of a known model (shadows, then recording); None when both are off.
        self.after_answer: Callable[[CallOutcome, bytes, Sequence[tuple[str, str | bytes]]], None] | None = None

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        raw_infer = grpc.unary_unary_rpc_method_handler(self.infer)  # bytes in, bytes out
        return [
            grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService",
                {
                    "ModelInfer": raw_infer,
                    "ServerLive": _typed(self.server_live, oip.ServerLiveRequest),
                    "ServerReady": _typed(self.server_ready, oip.ServerReadyRequest),
                    "ModelReady": _typed(self.model_ready, oip.ModelReadyRequest),
                    "ServerMetadata": _typed(self.server_metadata, oip.ServerMetadataRequest),
                    "ModelMetadata": _typed(self.model_metadata, oip.ModelMetadataRequest),
                },
            ),
            grpc.method_handlers_generic_handler(
                "splitstream.v1.Router",
                {"Infer": raw_infer, "Status": _typed(self.status, router_pb2.StatusRequest)},
            ),
        ]

    async def infer(self, request: bytes, context: aio.ServicerContext[bytes, bytes]) -> bytes:
        metadata = context.invocation_metadata() or ()
        outcome = await self.core.infer(request, self._headers(metadata), context.time_remaining())
        if outcome.model != UNKNOWN_MODEL and self.after_answer is not None:
            self.after_answer(outcome, request, metadata)
        if outcome.response is not None:
            # Trailing, not initial, metadata: it rides with the status, while sending initial
            # metadata early costs an extra batch of operations (~0.1 ms a call, measured).
            context.set_trailing_metadata(((VERSION_HEADER, outcome.version), (REQUEST_ID_HEADER, outcome.request_id)))
            return outcome.response
        trailers: tuple[tuple[str, str], ...] = ((REQUEST_ID_HEADER, outcome.request_id),)
        if outcome.version:
            trailers = ((VERSION_HEADER, outcome.version), *trailers)
        await context.abort(outcome.code, outcome.details, trailing_metadata=trailers)
        raise AssertionError("unreachable: abort raises")

    def _headers(self, metadata: Sequence[tuple[str, str | bytes]]) -> dict[str, str]:
        routing_headers = self.core.routing_key_headers
        headers: dict[str, str] = {}
        for key, value in metadata:
            if (key in _WANTED_HEADERS or key in routing_headers) and isinstance(value, str):
                headers[key] = value
        return headers

    async def server_live(self, request: oip.ServerLiveRequest, context: Any) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=True)

    async def server_ready(self, request: oip.ServerReadyRequest, context: Any) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=self.ready)

    async def model_ready(self, request: oip.ModelReadyRequest, context: Any) -> oip.ModelReadyResponse:
        routes = self.core.table.models.get(request.name)
        if routes is None or not self.ready:
            return oip.ModelReadyResponse(ready=False)
        if request.version:
            pool = routes.pools.get(request.version)
            return oip.ModelReadyResponse(ready=pool is not None and pool.has_eligible())
        control = routes.pools.get(routes.experiment.control)
        return oip.ModelReadyResponse(ready=control is not None and control.has_eligible())

    async def server_metadata(self, request: oip.ServerMetadataRequest, context: Any) -> oip.ServerMetadataResponse:
        return oip.ServerMetadataResponse(name="splitstream-router", version=splitstream.__version__)

    async def model_metadata(
        self, request: oip.ModelMetadataRequest, context: aio.ServicerContext[Any, Any]
    ) -> oip.ModelMetadataResponse:
        """Ask a worker of the requested version (else the control) and list every version the router knows."""
        try:
            routes = self.core.table.model(request.name)
            version = request.version or routes.experiment.control
            pool = routes.pools.get(version)
            if pool is None:
                raise ModelNotFound(f"model '{request.name}' has no version '{version}'")
            endpoint = pool.pick()
            if endpoint is None:
                raise ModelNotReady(f"model '{request.name}' version '{version}' has no healthy endpoint")
        except SplitstreamError as error:
            await context.abort(*status_of(error))
            raise AssertionError("unreachable: abort raises") from error
        stub = endpoint.channel.unary_unary(
            "/inference.GRPCInferenceService/ModelMetadata",
            request_serializer=oip.ModelMetadataRequest.SerializeToString,
            response_deserializer=oip.ModelMetadataResponse.FromString,
        )
        try:
            response: oip.ModelMetadataResponse = await stub(
                oip.ModelMetadataRequest(name=request.name, version=version), timeout=context.time_remaining()
            )
        except aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
            raise AssertionError("unreachable: abort raises") from error
        del response.versions[:]
        response.versions.extend(sorted(routes.pools))
        return response

    async def status(self, request: router_pb2.StatusRequest, context: Any) -> router_pb2.StatusResponse:
        table = self.core.table
        response = router_pb2.StatusResponse(
            router_id=self.router_id,
            registry=self.registry_description,
            registry_generation=self.core.generation,
            registry_applied_unix_ns=self.core.applied_unix_ns,
            registry_error=self.registry_error,
        )
        now = time.monotonic()
        for model, routes in sorted(table.models.items()):
            if request.model and model != request.model:
                continue
            experiment = routes.experiment
            status = response.models.add(model=model)
            status.experiment.salt = experiment.salt
            status.experiment.control = experiment.control
            status.experiment.routing_key_header = experiment.routing_key_header
            for arm in experiment.arms:
                status.experiment.arms.add(
                    version=arm.version, weight=arm.weight, bucket_start=arm.bucket_start, bucket_end=arm.bucket_end
                )
            for shadow in experiment.shadows:
                status.experiment.shadows.add(version=shadow.version, sample_rate=shadow.sample_rate)
            for version, pool in routes.pools.items():
                pool_status = status.versions.add(version=version)
                for endpoint in pool.endpoints:
                    pool_status.endpoints.add(
                        address=endpoint.address,
                        health=int(endpoint.health),
                        outstanding=endpoint.outstanding,
                        ejected=endpoint.ejected,
                        ejected_for_s=max(endpoint.ejected_until - now, 0.0),
                        calls=endpoint.calls,
                        failures=endpoint.failures,
                    )
        if request.model and not response.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model '{request.model}'")
        return response


def _typed(handler: Callable[..., Any], request_type: Any) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        handler, request_deserializer=request_type.FromString, response_serializer=lambda m: m.SerializeToString()
    )
