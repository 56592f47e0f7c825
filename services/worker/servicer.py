"""``inference.GRPCInferenceService`` for one model version: protobuf in, protobuf out, nothing else.

This is the edge where messages become domain values (tensor headers and
NumPy arrays, through ``common.tensors``) and back, and where domain errors
become status codes (``common.errors.status_of``). Everything else is asked of
:class:`~splitstream.worker.model.ServedModel`.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

import splitstream
from splitstream.common.errors import SplitstreamError, status_of
from splitstream.common.headers import REQUEST_ID_HEADER, from_header_value
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from splitstream.common.tensors import datatype_of, input_arrays, to_raw
from splitstream.worker.metrics import WorkerMetrics
from splitstream.worker.model import ServedModel
from splitstream.worker.validation import InputHeader

SERVER_NAME = "splitstream-worker"
SERVICE = "inference.GRPCInferenceService"


class InferenceServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers the Open Inference Protocol for ``model``; counts ModelInfer outcomes in ``metrics``."""

    def __init__(self, model: ServedModel, *, metrics: WorkerMetrics, logger: structlog.stdlib.BoundLogger) -> None:
        self._model = model
        self._metrics = metrics
        self._logger = logger

    async def ServerLive(
        self, request: oip.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: oip.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=self._model.ready)

    async def ModelReady(
        self, request: oip.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelReadyResponse:
        return oip.ModelReadyResponse(ready=self._model.serves(request.name, request.version) and self._model.ready)

    async def ServerMetadata(
        self, request: oip.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerMetadataResponse:
        return oip.ServerMetadataResponse(name=SERVER_NAME, version=splitstream.__version__, extensions=[])

    async def ModelMetadata(
        self, request: oip.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelMetadataResponse:
        try:
            self._model.check(request.name, request.version)
            metadata = self._model.metadata
        except SplitstreamError as error:
            await context.abort(*status_of(error))
        TensorMetadata = oip.ModelMetadataResponse.TensorMetadata
        return oip.ModelMetadataResponse(
            name=self._model.name,
            versions=[self._model.version],
            platform=self._model.platform,
            inputs=[TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape) for s in metadata.inputs],
            outputs=[TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape) for s in metadata.outputs],
        )

    async def ModelInfer(
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        started = time.perf_counter()
        request_id = _request_id(request, context)
        code = grpc.StatusCode.OK
        message = ""
        try:
            return await self._infer(request)
        except SplitstreamError as error:
            code, message = status_of(error)
        except Exception as error:  # a bug of ours: log it, tell the client nothing about internals
            code, message = status_of(error)
            self._logger.exception("ModelInfer failed", request_id=request_id)
        finally:
            # Cancellation lands here too: the client went away, so the call never finishes as OK.
            if code is grpc.StatusCode.OK and context.cancelled():
                code = grpc.StatusCode.CANCELLED
            self._metrics.request_done(code)
            self._logger.debug(
                "ModelInfer", request_id=request_id, status=code.name, seconds=round(time.perf_counter() - started, 6)
            )
        await context.abort(code, message)

    async def model_infer_bytes(self, data: bytes, context: grpc.aio.ServicerContext) -> oip.ModelInferResponse:
        """ModelInfer on the wire: parse here, so a corrupt message is INVALID_ARGUMENT (and counted)."""
        try:
            request = oip.ModelInferRequest.FromString(data)
        except DecodeError:
            self._metrics.request_done(grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request is not a valid inference.ModelInferRequest")
        return await self.ModelInfer(request, context)

    async def _infer(self, request: oip.ModelInferRequest) -> oip.ModelInferResponse:
        model = self._model
        model.check(request.model_name, request.model_version)
        plan = model.plan(
            [InputHeader(t.name, t.datatype, tuple(t.shape)) for t in request.inputs],
            [o.name for o in request.outputs],
        )
        outputs = await model.infer(input_arrays(request), plan)
        response = oip.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id)
        for name in plan.output_names:
            array = outputs[name]
            response.outputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
            response.raw_output_contents.append(to_raw(array))
        return response


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as the generated ``add_GRPCInferenceServiceServicer_to_server`` does, but with
    ModelInfer taking raw bytes: grpc answers a message it cannot parse with UNKNOWN and the name of a
    Python exception, where a client deserves INVALID_ARGUMENT."""

    def unary(method: Any, request_type: Any, response_type: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            method, request_deserializer=request_type.FromString, response_serializer=response_type.SerializeToString
        )

    handlers = {
        "ServerLive": unary(servicer.ServerLive, oip.ServerLiveRequest, oip.ServerLiveResponse),
        "ServerReady": unary(servicer.ServerReady, oip.ServerReadyRequest, oip.ServerReadyResponse),
        "ModelReady": unary(servicer.ModelReady, oip.ModelReadyRequest, oip.ModelReadyResponse),
        "ServerMetadata": unary(servicer.ServerMetadata, oip.ServerMetadataRequest, oip.ServerMetadataResponse),
        "ModelMetadata": unary(servicer.ModelMetadata, oip.ModelMetadataRequest, oip.ModelMetadataResponse),
        "ModelInfer": grpc.unary_unary_rpc_method_handler(
            servicer.model_infer_bytes, response_serializer=oip.ModelInferResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def _request_id(request: oip.ModelInferRequest, context: grpc.aio.ServicerContext) -> str:
    """The id for logs, as the router records it: the header decoded (the router percent-encodes ids
    that are not printable ASCII), else the request's ``id``. The worker puts no id into metadata."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str):
            return from_header_value(value)
    return request.id
