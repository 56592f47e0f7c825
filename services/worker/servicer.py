"""``inference.GRPCInferenceService`` for one model version: protobuf in, protobuf out, nothing else.

This is the edge where messages become domain values (tensor headers and
NumPy arrays, through ``common.tensors``) and back, and where domain errors
become status codes (``common.errors.status_of``). Everything else is asked of
:class:`~splitstream.worker.model.ServedModel`.
"""

from __future__ import annotations

import time

import grpc
import structlog

import splitstream
from splitstream.common.errors import SplitstreamError, status_of
from splitstream.common.handlers import parse, typed_unary
from splitstream.common.headers import REQUEST_ID_HEADER, from_header_value
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.tensors import datatype_of, input_arrays, to_raw
from splitstream.worker.metrics import WorkerMetrics
from splitstream.worker.model import ServedModel
from splitstream.worker.validation import InputHeader

SERVER_NAME = "splitstream-worker"
SERVICE = "inference.GRPCInferenceService"


class InferenceServicer:
    """Answers the Open Inference Protocol for ``model``; counts ModelInfer outcomes in ``metrics``.

    Register it with :func:`add_to_server`, not the generated ``add_..._to_server``: ModelInfer takes
    the request as bytes, so a request that does not parse is counted like any other bad input."""

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

    async def ModelInfer(self, data: bytes, context: grpc.aio.ServicerContext) -> oip.ModelInferResponse:
        """Takes the request as bytes and parses it here, inside the counted call: bytes that are not a
        ModelInferRequest are INVALID_ARGUMENT in the status counts like any other bad input."""
        started = time.perf_counter()
        request_id = ""
        code = grpc.StatusCode.OK
        message = ""
        try:
            request_id = _header_request_id(context)
            request = parse(oip.ModelInferRequest, data)
            request_id = request_id or request.id
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
    """Register ``servicer`` under the Open Inference Protocol's names. Every method receives bytes and
    parses them itself (see :mod:`splitstream.common.handlers`), so bytes that do not parse are
    INVALID_ARGUMENT naming the message, never grpc's UNKNOWN with a Python exception's name."""
    handlers = {
        "ServerLive": typed_unary(servicer.ServerLive, oip.ServerLiveRequest),
        "ServerReady": typed_unary(servicer.ServerReady, oip.ServerReadyRequest),
        "ModelReady": typed_unary(servicer.ModelReady, oip.ModelReadyRequest),
        "ServerMetadata": typed_unary(servicer.ServerMetadata, oip.ServerMetadataRequest),
        "ModelMetadata": typed_unary(servicer.ModelMetadata, oip.ModelMetadataRequest),
        "ModelInfer": grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfer, response_serializer=oip.ModelInferResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def _header_request_id(context: grpc.aio.ServicerContext) -> str:
    """The id for logs, as the router records it: the header decoded (the router percent-encodes ids
    that are not printable ASCII); empty when there is none, and then the request's ``id`` is used.
    The worker puts no id into metadata."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str):
            return from_header_value(value)
    return ""
