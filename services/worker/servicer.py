"""``inference.GRPCInferenceService`` for one model version: protobuf in, protobuf out, nothing else.

This is the edge where messages become domain values (tensor headers and
NumPy arrays, through ``common.tensors``) and back, and where domain errors
become status codes (``common.errors.status_of``). Everything else is asked of
:class:`~splitstream.worker.model.ServedModel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import numpy as np
import structlog

import splitstream
from splitstream.common.errors import SplitstreamError, status_of
from splitstream.common.handlers import parse, typed_unary
from splitstream.common.headers import REQUEST_ID_HEADER, from_header_value
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.tensors import datatype_of, input_arrays, to_raw
from splitstream.worker.generation import (
    COMPLETION_TOKENS,
    CUM_LOG_PROBS,
    OUTPUT_LOG_PROBS,
    PROMPT_TOKENS,
    TEXT_OUTPUT,
    GenerationRequest,
    Reply,
    replies,
)
from splitstream.worker.metrics import WorkerMetrics
from splitstream.worker.model import ServedModel
from splitstream.worker.validation import InputHeader

SERVER_NAME = "splitstream-worker"
SERVICE = "inference.GRPCInferenceService"
#: Triton's decoupled-model conventions: set on every streamed response (true on a request's last one),
#: and a request parameter asking for an empty final response when the end comes after the last token.
FINAL_RESPONSE = "triton_final_response"
ENABLE_EMPTY_FINAL = "triton_enable_empty_final_response"
_LENGTH = struct.Struct("<I")
#: Responses one stream may have made and not yet handed to gRPC. Past it the stream's requests wait
#: to emit, so their generations fall behind and are paused (see :mod:`splitstream.worker.generation`):
#: a client that stops reading costs the worker this many responses (plus each generation's window),
#: not its whole answer.
STREAM_QUEUE_RESPONSES = 32


class InferenceServicer:
    """Answers the Open Inference Protocol for ``model``; counts ModelInfer outcomes in ``metrics``.

    Register it with :func:`add_to_server`, not the generated ``add_..._to_server``: ModelInfer takes
    the request as bytes, so a request that does not parse is counted like any other bad input."""

    def __init__(self, model: ServedModel, *, metrics: WorkerMetrics, logger: structlog.stdlib.BoundLogger) -> None:
        self._model = model
        self._metrics = metrics
        self._logger = logger
        #: Responses of every stream made and not yet handed to gRPC (the queues of ModelStreamInfer).
        self.queued_responses = 0
        metrics.watch_queued_responses(lambda: self.queued_responses)

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
        if model.generative:
            return await self._generate_whole(request)
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

    async def _generate_whole(self, request: oip.ModelInferRequest) -> oip.ModelInferResponse:
        """ModelInfer on a generative model: the whole generation in one response (``text_output`` holds
        all of it, whatever ``stream`` says: a unary call answers once), for clients that cannot stream;
        the same scheduler steps it."""
        generation = self._generation_request(request)
        response = self._response_head(request)
        async with (
            contextlib.aclosing(self._model.generate(generation)) as tokens,
            contextlib.aclosing(replies(tokens, generation, stream=False)) as answer,
        ):
            async for reply in answer:
                _add_reply(response, generation, reply, empty_final=False)
        return response

    def _generation_request(self, request: oip.ModelInferRequest) -> GenerationRequest:
        model = self._model
        requested = [o.name for o in request.outputs]
        model.check_generation([InputHeader(t.name, t.datatype, tuple(t.shape)) for t in request.inputs], requested)
        return model.generation_request(input_arrays(request), requested)

    def _response_head(self, request: oip.ModelInferRequest) -> oip.ModelInferResponse:
        return oip.ModelInferResponse(model_name=self._model.name, model_version=self._model.version, id=request.id)

    async def ModelStreamInfer(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """Triton's bidirectional stream: each request read is served concurrently with the others, its
        responses written as they come (a generative model: one per token or whole UTF-8 character, or
        one with the whole text when the request's ``stream`` is false, ``triton_final_response`` true
        on the last; a tensor model: one). A request that fails gets one response with ``error_message``
        and the stream goes on. The call ends OK once the client has closed its side and every request is
        answered; a client that cancels stops every generation of the stream at its next step. A client
        that stops reading fills the stream's queue (``STREAM_QUEUE_RESPONSES``), and its generations
        pause until it reads again; other streams are not held up.

        Requests arrive as bytes (no deserializer), so one that does not parse is an ``error_message``
        in the stream, like any other bad request, instead of aborting the stream."""
        outgoing: asyncio.Queue[bytes | None] = asyncio.Queue(STREAM_QUEUE_RESPONSES)
        served: set[asyncio.Task[None]] = set()
        header_id = _header_request_id(context)

        async def emit(data: bytes) -> None:
            await outgoing.put(data)
            self.queued_responses += 1

        async def read_requests() -> None:
            try:
                async for data in requests:
                    task = asyncio.create_task(self._stream_one(data, header_id, emit))
                    served.add(task)
                    task.add_done_callback(served.discard)
            except Exception:  # the client's side broke off: answer what was asked, then end
                self._logger.debug("reading a request stream failed", request_id=header_id, exc_info=True)
            finally:
                if served:
                    await asyncio.wait(set(served))
                await outgoing.put(None)

        reader = asyncio.create_task(read_requests())
        try:
            while (data := await outgoing.get()) is not None:
                self.queued_responses -= 1
                await context.write(data)
        finally:
            self.queued_responses -= sum(1 for data in _drain(outgoing) if data is not None)
            # The client went away or the server is stopping: withdraw every generation (each leaves at its
            # next step) and let them finish counting before the call ends.
            pending = (reader, *served)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _stream_one(self, data: bytes, header_id: str, emit: Callable[[bytes], Awaitable[None]]) -> None:
        """Serve one request of a stream; every response goes to ``emit`` serialized (which waits while the
        stream's queue is full: the generation then falls behind and is paused)."""
        started = time.perf_counter()
        request = oip.ModelInferRequest()
        code = grpc.StatusCode.OK
        try:
            request = parse(oip.ModelInferRequest, data)
            self._model.check(request.model_name, request.model_version)
            if not self._model.generative:
                response = await self._infer(request)
                response.parameters[FINAL_RESPONSE].bool_param = True
                await emit(oip.ModelStreamInferResponse(infer_response=response).SerializeToString())
                return
            generation = self._generation_request(request)
            empty_final = _bool_parameter(request, ENABLE_EMPTY_FINAL)
            async with (
                contextlib.aclosing(self._model.generate(generation)) as tokens,
                contextlib.aclosing(replies(tokens, generation, stream=generation.stream)) as answer,
            ):
                async for reply in answer:
                    await emit(self._reply_response(request, generation, reply, empty_final))
        except SplitstreamError as error:
            code, message = status_of(error)
            await emit(self._error_response(request, message))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as error:  # a bug of ours: log it, tell the client nothing about internals
            code, message = status_of(error)
            self._logger.exception("ModelStreamInfer request failed", request_id=header_id or request.id)
            await emit(self._error_response(request, message))
        finally:
            self._metrics.request_done(code)
            self._logger.debug(
                "ModelStreamInfer request",
                request_id=header_id or request.id,
                status=code.name,
                seconds=round(time.perf_counter() - started, 6),
            )

    def _reply_response(
        self, request: oip.ModelInferRequest, generation: GenerationRequest, reply: Reply, empty_final: bool
    ) -> bytes:
        """One reply's response (see :func:`_add_reply`), flagged final on the last."""
        response = self._response_head(request)
        _add_reply(response, generation, reply, empty_final=empty_final)
        response.parameters[FINAL_RESPONSE].bool_param = reply.final
        return oip.ModelStreamInferResponse(infer_response=response).SerializeToString()

    def _error_response(self, request: oip.ModelInferRequest, message: str) -> bytes:
        """``error_message`` with the failed request's id (and the final flag: nothing else will come for it)."""
        response = self._response_head(request)
        response.parameters[FINAL_RESPONSE].bool_param = True
        return oip.ModelStreamInferResponse(error_message=message, infer_response=response).SerializeToString()


def _add_reply(
    response: oip.ModelInferResponse, generation: GenerationRequest, reply: Reply, *, empty_final: bool
) -> None:
    """``reply`` as outputs: ``text_output`` (the shape of ``text_input``), with ``return_log_probs``
    ``cum_log_probs`` (the same shape) and ``output_log_probs`` (that shape plus one dimension, a value
    per token of the text), and on the final reply the usage, ``prompt_tokens`` and ``completion_tokens``
    (INT32, the same shape). A reply without text (the end token was picked after the last token was
    sent) has no text outputs when the request set ``triton_enable_empty_final_response``, as Triton's
    empty final response has none, and otherwise an empty ``text_output``, as TensorRT-LLM's last
    response is, so a client never waits for a final flag that does not come."""
    shape = generation.text_shape
    if reply.text is not None or not empty_final:
        text = reply.text or b""
        response.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=shape)
        response.raw_output_contents.append(_LENGTH.pack(len(text)) + text)
        if generation.log_probs:
            _add_array(response, CUM_LOG_PROBS, np.full(shape, reply.cum_log_prob, dtype=np.float32))
            log_probs = np.array(reply.log_probs, dtype=np.float32).reshape((*shape, len(reply.log_probs)))
            _add_array(response, OUTPUT_LOG_PROBS, log_probs)
    if reply.final:
        _add_array(response, PROMPT_TOKENS, np.full(shape, reply.prompt_tokens, dtype=np.int32))
        _add_array(response, COMPLETION_TOKENS, np.full(shape, reply.completion_tokens, dtype=np.int32))


def _add_array(response: oip.ModelInferResponse, name: str, array: np.ndarray) -> None:
    response.outputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
    response.raw_output_contents.append(to_raw(array))


def _drain(queue: asyncio.Queue[bytes | None]) -> list[bytes | None]:
    """What is left in ``queue``, taken out (a stream that ended: nothing will write it)."""
    left = []
    while not queue.empty():
        left.append(queue.get_nowait())
    return left


def _bool_parameter(request: oip.ModelInferRequest, name: str) -> bool:
    if name not in request.parameters:
        return False
    parameter = request.parameters[name]
    return parameter.WhichOneof("parameter_choice") == "bool_param" and parameter.bool_param


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
        # Requests and responses as bytes: the servicer parses each request and serializes each response.
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(servicer.ModelStreamInfer),
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
