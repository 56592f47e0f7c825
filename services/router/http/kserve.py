"""KServe v2 REST (Open Inference Protocol over HTTP) and Triton's generate extension on the HTTP port.

Clients written for Triton's HTTP port (``tritonclient.http``, curl scripts, KServe's own clients) call
the router as they would call Triton; every call is translated at this edge into the gRPC Open Inference
Protocol the workers speak, and routed by the router's own core, never here:

- ``POST /v2/models/{m}[/versions/{v}]/infer``: the JSON request (and the binary tensors after it, Triton's
  binary tensor data extension) becomes one ``inference.ModelInferRequest`` (:func:`parse_infer`), handed
  to :meth:`RouterCore.infer` exactly as a gRPC ``ModelInfer`` is (same split, pin, health, retry), then
  to the same ``after_answer`` hook (shadows, then recording), so the call is recorded as a gRPC call is
  and replays alike. The versions path pins the version, as gRPC's ``model_version`` does. The answer
  (:func:`infer_answer`) has JSON or binary outputs as the request asked.
- ``POST /v2/models/{m}[/versions/{v}]/generate`` and ``/generate_stream``: Triton's generate extension; the
  JSON fields become the generating worker's inputs (:func:`parse_generate`) on one ``ModelStreamInfer``
  stream through the front door's :class:`~splitstream.router.streams.StreamProxy`, as the OpenAI routes.
- Health and metadata (``/v2/health/live|ready``, ``/v2``, ``/v2/models/{m}[/versions/{v}][/ready]``)
  answer as the gRPC ServerLive/ServerReady/ModelMetadata/ModelReady of the router's servicer do.

Errors are KServe's ``{"error": "..."}`` with Triton's statuses: 400 bad input, 404 unknown model or
version, 503 no healthy endpoint (the gRPC codes map as for the OpenAI routes: :func:`from_status`).
Health answers 200 for true and 400 for false, as Triton does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from aiohttp import web
from grpc import aio

import splitstream
from splitstream.common import tensors
from splitstream.common.errors import InvalidInput, SplitstreamError, status_of
from splitstream.common.headers import REQUEST_ID_HEADER, VERSION_HEADER, from_header_value, header_value
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.router.core import UNKNOWN_MODEL, CallOutcome
from splitstream.router.http.body import read_body
from splitstream.router.http.call import CALL
from splitstream.router.http.errors import ApiError, from_status
from splitstream.router.http.headers import as_text, header_text
from splitstream.router.http.openai_api import parse_body
from splitstream.router.http.recording import stream_response
from splitstream.router.http.sse import end_stream

if TYPE_CHECKING:
    from splitstream.router.http.app import HttpFrontDoor

#: Triton's binary tensor data extension: the length of the JSON part of a body that has binary tensors.
HEADER_LENGTH = "Inference-Header-Content-Length"
#: What the router's ServerMetadata says it is, over HTTP with the extensions this module adds.
EXTENSIONS = ("binary_tensor_data", "generate")
#: The routes this module serves (for the front door's 404 message).
ROUTES = (
    "/v2",
    "/v2/health/live",
    "/v2/health/ready",
    "/v2/models/{m}[/versions/{v}]",
    "/v2/models/{m}[/versions/{v}]/ready",
    "/v2/models/{m}[/versions/{v}]/infer",
    "/v2/models/{m}[/versions/{v}]/generate",
    "/v2/models/{m}[/versions/{v}]/generate_stream",
)
#: BF16 has no NumPy type: it travels as binary data only, two bytes an element.
_BF16 = "BF16"
#: HTTP's own headers: not the call's metadata (a replay re-sends recorded metadata over gRPC).
_TRANSPORT_HEADERS = frozenset(
    {
        "host",
        "connection",
        "keep-alive",
        "content-length",
        "content-type",
        "content-encoding",
        "transfer-encoding",
        "accept",
        "accept-encoding",
        "user-agent",
        "te",
        "trailer",
        "upgrade",
        "expect",
        HEADER_LENGTH.lower(),
    }
)


class KServeError(ApiError):
    """A refusal in KServe's shape, ``{"error": "..."}``, with the status of :class:`ApiError`."""

    def body(self) -> dict[str, Any]:
        return {"error": self.message}


def bad_input(message: str) -> KServeError:
    return KServeError(400, message)


def kserve_error(error: ApiError) -> KServeError:
    """Any refusal of the front door (aiohttp's, the core's, the auth middleware's) in KServe's shape, with the
    headers it needs (``WWW-Authenticate``, ``Retry-After``)."""
    if isinstance(error, KServeError):
        return error
    return KServeError(error.status, error.message, headers=error.headers)


# -- /infer: JSON (and binary) tensors → ModelInferRequest ------------------------------------------


@dataclass(frozen=True, slots=True)
class OutputChoice:
    """Which outputs the client wants as binary data: ``binary_data_output`` for all, ``binary_data`` per output."""

    default: bool = False
    per_output: Mapping[str, bool] = field(default_factory=dict)

    def binary(self, name: str) -> bool:
        return self.per_output.get(name, self.default)


def parse_infer(
    model: str, version: str, body: bytes, header_length: str | None
) -> tuple[oip.ModelInferRequest, OutputChoice]:
    """A KServe v2 inference request (its JSON, then the binary tensors after ``header_length`` bytes when
    given) as the gRPC request a worker takes, with every tensor in ``raw_input_contents``; 400 naming what
    is wrong."""
    if header_length is None:
        head, binary = body, b""
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise bad_input(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise bad_input(f"{HEADER_LENGTH} {length} is outside the body's {len(body)} bytes")
        head, binary = body[:length], body[length:]
    document = _json_object(head)
    _only(document, {"id", "parameters", "inputs", "outputs"}, "the request")
    request = oip.ModelInferRequest(model_name=model, model_version=version)
    request.id = _string(document.get("id", ""), "id")
    parameters = _object(document.get("parameters", {}), "parameters")
    default = parameters.pop("binary_data_output", False)
    if not isinstance(default, bool):
        raise bad_input(f"parameter 'binary_data_output' must be a boolean, got {json.dumps(default)}")
    _set_parameters(request.parameters, parameters, "request")
    inputs = document.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise bad_input("'inputs' must be a non-empty array of tensors")
    offset = 0
    for index, tensor in enumerate(inputs):
        offset = _add_input(request, _object(tensor, f"inputs[{index}]"), index, binary, offset)
    if offset != len(binary):
        raise bad_input(f"{len(binary) - offset} bytes of binary data follow the tensors that use them")
    per_output: dict[str, bool] = {}
    outputs = document.get("outputs", [])
    if not isinstance(outputs, list):
        raise bad_input("'outputs' must be an array of requested outputs")
    for index, wanted in enumerate(outputs):
        wanted = _object(wanted, f"outputs[{index}]")
        _only(wanted, {"name", "parameters"}, f"outputs[{index}]")
        name = _string(wanted.get("name"), f"outputs[{index}].name")
        output_parameters = _object(wanted.get("parameters", {}), f"outputs[{index}].parameters")
        if "classification" in output_parameters:
            raise bad_input(f"output '{name}': the classification extension is not supported")
        if "binary_data" in output_parameters:
            binary_data = output_parameters.pop("binary_data")
            if not isinstance(binary_data, bool):
                raise bad_input(f"output '{name}': 'binary_data' must be a boolean, got {json.dumps(binary_data)}")
            per_output[name] = binary_data
        requested = request.outputs.add(name=name)
        _set_parameters(requested.parameters, output_parameters, f"output '{name}'")
    return request, OutputChoice(default, per_output)


def _add_input(request: oip.ModelInferRequest, tensor: dict[str, Any], index: int, binary: bytes, offset: int) -> int:
    """Append one input as raw contents; returns the offset of the next binary tensor."""
    _only(tensor, {"name", "shape", "datatype", "parameters", "data"}, f"inputs[{index}]")
    name = _string(tensor.get("name"), f"inputs[{index}].name")
    where = f"input '{name}'"
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(_is_int(dim) and dim >= 0 for dim in shape):
        raise bad_input(f"{where}: 'shape' must be an array of non-negative integers, got {json.dumps(shape)}")
    datatype = _string(tensor.get("datatype"), f"{where}: 'datatype'")
    if datatype not in tensors.NUMPY_DTYPES and datatype != _BF16:
        known = ", ".join([*tensors.NUMPY_DTYPES, _BF16])
        raise bad_input(f"{where}: unknown datatype {datatype!r} (one of {known})")
    parameters = _object(tensor.get("parameters", {}), f"{where}: 'parameters'")
    size = parameters.pop("binary_data_size", None)
    count = tensors.element_count(shape)
    if size is not None:
        if "data" in tensor:
            raise bad_input(f"{where}: give 'data' or the 'binary_data_size' parameter, not both")
        if not _is_int(size) or size < 0:
            raise bad_input(f"{where}: 'binary_data_size' must be a non-negative integer, got {json.dumps(size)}")
        if offset + size > len(binary):
            raise bad_input(
                f"{where}: 'binary_data_size' {size} runs past the binary data ({len(binary) - offset} bytes left)"
            )
        raw = binary[offset : offset + size]
        _check_raw(where, name, datatype, shape, count, raw)
        offset += size
    else:
        if "data" not in tensor:
            raise bad_input(f"{where}: 'data' is required (or the 'binary_data_size' parameter)")
        raw = tensors.to_raw(_json_array(where, datatype, shape, count, tensor["data"]))
    added = request.inputs.add(name=name, datatype=datatype, shape=shape)
    _set_parameters(added.parameters, parameters, where)
    request.raw_input_contents.append(raw)
    return offset


def _check_raw(where: str, name: str, datatype: str, shape: list[int], count: int, raw: bytes) -> None:
    """Binary data must hold exactly the shape's elements (BYTES: each a 4-byte length, then its bytes)."""
    if datatype == _BF16:
        if len(raw) != 2 * count:
            raise bad_input(f"{where}: {len(raw)} bytes of binary data, but BF16 with shape {shape} needs {2 * count}")
        return
    try:
        tensors.from_raw(name, datatype, shape, raw)
    except InvalidInput as error:
        raise bad_input(str(error).replace("raw content", "binary data")) from None


def _json_array(where: str, datatype: str, shape: list[int], count: int, data: Any) -> np.ndarray:
    """``data`` (row-major, flat or nested) as an array of ``datatype``, each element checked for its type."""
    if datatype == _BF16:
        raise bad_input(f"{where}: BF16 has no JSON form; send it as binary data")
    values = list(_leaves(data))
    if len(values) != count:
        raise bad_input(f"{where}: {len(values)} elements in 'data', but shape {shape} needs {count}")
    kind = tensors.NUMPY_DTYPES[datatype].kind
    accepted = {"b": (bool,), "O": (str,), "f": (int, float)}.get(kind, (int,))
    for value in values:
        if not isinstance(value, accepted) or (kind != "b" and isinstance(value, bool)):
            raise bad_input(f"{where}: {json.dumps(value)} in 'data' is not a {datatype} value")
    if kind == "O":
        array = np.empty(count, dtype=np.object_)
        array[:] = [value.encode() for value in values]
        return array.reshape(shape)
    try:
        return np.array(values, dtype=tensors.NUMPY_DTYPES[datatype]).reshape(shape)
    except OverflowError:
        raise bad_input(f"{where}: a value in 'data' does not fit {datatype}") from None


def _leaves(data: Any) -> Iterator[Any]:
    if not isinstance(data, list):
        raise bad_input(f"'data' must be an array, got {json.dumps(data)[:64]}")
    for item in data:
        if isinstance(item, list):
            yield from _leaves(item)
        else:
            yield item


# -- /infer: ModelInferResponse → JSON (and binary) outputs -----------------------------------------


def infer_answer(response: oip.ModelInferResponse, choice: OutputChoice) -> tuple[bytes, int | None]:
    """The response body and, when binary outputs follow the JSON, the JSON's length (the
    ``Inference-Header-Content-Length`` to send)."""
    raw = list(response.raw_output_contents)
    if raw and len(raw) != len(response.outputs):
        raise KServeError(502, "the model's answer has a raw content count that does not match its outputs")
    outputs = []
    binaries = []
    for index, output in enumerate(response.outputs):
        shape = [int(dim) for dim in output.shape]
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype, "shape": shape}
        parameters = _parameters_json(output.parameters)
        payload = raw[index] if raw else None
        if choice.binary(output.name):
            if payload is None:
                payload = tensors.to_raw(_decoded(output, None))
            parameters["binary_data_size"] = len(payload)
            binaries.append(payload)
        else:
            entry["data"] = _json_data(_decoded(output, payload))
        if parameters:
            entry["parameters"] = parameters
        outputs.append(entry)
    document: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        document["id"] = response.id
    parameters = _parameters_json(response.parameters)
    if parameters:
        document["parameters"] = parameters
    document["outputs"] = outputs
    head = json.dumps(document, separators=(",", ":")).encode()
    if not binaries:
        return head, None
    return b"".join([head, *binaries]), len(head)


def _decoded(output: oip.ModelInferResponse.InferOutputTensor, raw: bytes | None) -> np.ndarray:
    try:
        if raw is None:
            return tensors.from_contents(output.name, output.datatype, output.shape, output.contents, kind="output")
        return tensors.from_raw(output.name, output.datatype, output.shape, raw, kind="output")
    except InvalidInput as error:
        if output.datatype == _BF16:
            raise bad_input(f"output '{output.name}' is BF16, which has no JSON form: ask for binary data") from None
        raise KServeError(502, f"the model's answer cannot be read: {error}") from None


def _json_data(array: np.ndarray) -> list[Any]:
    """Row-major, flattened; BYTES elements as strings."""
    flat = array.reshape(-1)
    if flat.dtype.kind == "O":
        return [bytes(item).decode("utf-8", errors="replace") for item in flat]
    values: list[Any] = flat.tolist()
    return values


def _parameters_json(parameters: Mapping[str, oip.InferParameter]) -> dict[str, Any]:
    return {
        key: getattr(value, value.WhichOneof("parameter_choice") or "bool_param") for key, value in parameters.items()
    }


def _set_parameters(target: Any, parameters: Mapping[str, Any], where: str) -> None:
    """JSON parameters as InferParameters (a boolean, an integer, a number or a string each)."""
    for key, value in parameters.items():
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise bad_input(f"{where}: parameter '{key}' does not fit an int64")
            target[key].int64_param = value
        elif isinstance(value, float):
            target[key].double_param = value
        elif isinstance(value, str):
            target[key].string_param = value
        else:
            raise bad_input(f"{where}: parameter '{key}' must be a boolean, number or string, got {json.dumps(value)}")


# -- /generate: Triton's generate extension → the generating worker's inputs ------------------------

#: The inputs of TensorRT-LLM's Triton ensemble (what a generating worker takes), by datatype. A field of a
#: generate request (or of its ``parameters``) with one of these names becomes that input, as Triton maps
#: fields onto the model's inputs; any other field is a request parameter.
GENERATE_INPUTS: Mapping[str, str] = {
    "text_input": "BYTES",
    "max_tokens": "INT32",
    "temperature": "FP32",
    "top_k": "INT32",
    "top_p": "FP32",
    "repetition_penalty": "FP32",
    "random_seed": "UINT64",
    "stop_words": "BYTES",
    "bad_words": "BYTES",
    "end_id": "INT32",
    "pad_id": "INT32",
    "beam_width": "INT32",
    "exclude_input_in_output": "BOOL",
    "return_log_probs": "BOOL",
    "stream": "BOOL",
}
#: Inputs that hold a list of words (a string or an array of strings); every other input holds one value.
_WORD_LISTS = frozenset({"stop_words", "bad_words"})


def parse_generate(model: str, version: str, body: bytes, *, stream: bool, request_id: str) -> bytes:
    """A generate request as the worker's ``ModelInferRequest`` (serialized). ``stream``: the route
    (``generate_stream``) asks for a response per token unless the request sets ``stream`` itself; ``generate``
    asks for the whole text in one response unless it does."""
    document = _json_object(body)
    fields = dict(document)
    parameters = _object(fields.pop("parameters", {}), "parameters")
    for key in parameters:
        if key in fields:
            raise bad_input(f"'{key}' is given both as a field and as a parameter")
    fields.update(parameters)
    if "text_input" not in fields:
        raise bad_input("'text_input' is required")
    fields.setdefault("stream", stream)
    request = oip.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    rest: dict[str, Any] = {}
    for key, value in fields.items():
        if key not in GENERATE_INPUTS:
            rest[key] = value
            continue
        array = _generate_input(key, value)
        request.inputs.add(name=key, datatype=GENERATE_INPUTS[key], shape=list(array.shape))
        request.raw_input_contents.append(tensors.to_raw(array))
    _set_parameters(request.parameters, rest, "the request")
    return request.SerializeToString()


def _generate_input(key: str, value: Any) -> np.ndarray:
    datatype = GENERATE_INPUTS[key]
    if key in _WORD_LISTS:
        words = [value] if isinstance(value, str) else value
        if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
            raise bad_input(f"'{key}' must be a string or an array of strings, got {json.dumps(value)}")
        array = np.empty((1, len(words)), dtype=np.object_)
        array[0, :] = [word.encode() for word in words]
        return array
    return _json_array(f"'{key}'", datatype, [1, 1], 1, [value])


@dataclass(slots=True)
class GenerateAnswer:
    """A generate call's answer fields from the worker's responses: each output a field (one element: the
    value; more: the flat array), with ``text_output`` the text so far for ``generate`` (gathered)."""

    model: str
    version: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    final: bool = False

    def read(self, payload: bytes, *, gather: bool) -> dict[str, Any] | None:
        """One worker response: its answer object (None when it has no outputs, or reports an error)."""
        response = oip.ModelStreamInferResponse.FromString(payload)
        if response.error_message:
            self.error = self.error or response.error_message
            return None
        answer = response.infer_response
        final = answer.parameters.get("triton_final_response")
        self.final = final is None or final.bool_param
        if not answer.outputs:
            return None
        try:
            outputs = tensors.output_arrays(answer)
        except InvalidInput as error:
            self.error = self.error or f"the model's answer cannot be read: {error}"
            return None
        event: dict[str, Any] = {"model_name": self.model, "model_version": answer.model_version or self.version}
        for name, array in outputs.items():
            data = _json_data(array)
            value: Any = data[0] if len(data) == 1 else data
            if gather and name == "text_output" and isinstance(value, str):
                value = self.fields.get(name, "") + value
            event[name] = value
        self.fields.update(event)
        return event

    def usage(self) -> tuple[int, int] | None:
        """(prompt, completion) tokens as the last response reported them (our workers and TensorRT-LLM's
        ensemble send both outputs); None when it reported none."""
        prompt, completion = self.fields.get("prompt_tokens"), self.fields.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            return prompt, completion
        return None


# -- the routes -------------------------------------------------------------------------------------


class KServeRoutes:
    """The routes above on the front door's app; the front door's ``_edge`` counts and times them and
    answers their :class:`KServeError` refusals."""

    def __init__(self, front: HttpFrontDoor) -> None:
        self.front = front

    def register(self, app: web.Application) -> None:
        add = app.router
        add.add_get("/v2", self.server_metadata)
        add.add_get("/v2/health/live", self.live)
        add.add_get("/v2/health/ready", self.ready)
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            add.add_get(prefix, self.model_metadata)
            add.add_get(prefix + "/ready", self.model_ready)
            add.add_post(prefix + "/infer", self.infer)
            add.add_post(prefix + "/generate", self.generate)
            add.add_post(prefix + "/generate_stream", self.generate_stream)

    # -- health and metadata ----------------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)  # the process answers: live, as gRPC ServerLive says

    async def ready(self, request: web.Request) -> web.Response:
        servicer = self.front.servicer
        return web.Response(status=200 if servicer is not None and servicer.ready else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"name": "splitstream-router", "version": splitstream.__version__, "extensions": list(EXTENSIONS)}
        )

    async def model_ready(self, request: web.Request) -> web.Response:
        model, version = self._model(request)
        servicer = self.front.servicer
        ready = servicer is not None and servicer.ready and self.front.core.is_ready(model, version)
        return web.Response(status=200 if ready else 400)

    async def model_metadata(self, request: web.Request) -> web.Response:
        model, version = self._model(request)
        servicer = self.front.servicer
        if servicer is None:
            raise KServeError(503, "the router is not ready")
        try:
            metadata = await servicer.fetch_model_metadata(model, version, None)
        except SplitstreamError as error:
            code, details = status_of(error)
            raise kserve_error(from_status(code, details)) from None
        except aio.AioRpcError as error:
            raise kserve_error(from_status(error.code(), error.details() or "")) from None
        request[CALL].label_version = version
        return web.json_response(
            {
                "name": metadata.name or model,
                "versions": list(metadata.versions),
                "platform": metadata.platform,
                "inputs": [_tensor_metadata(tensor) for tensor in metadata.inputs],
                "outputs": [_tensor_metadata(tensor) for tensor in metadata.outputs],
            }
        )

    def _model(self, request: web.Request) -> tuple[str, str]:
        """The path's model (404 when not served) and version ('' when the path has none; 404 when unknown)."""
        model = request.match_info["model"]
        version = request.match_info.get("version", "")
        views = self.front.core.views(model) if self.front.core.serves(model) else []
        if not views:
            served = ", ".join(self.front.core.model_names()) or "none"
            raise KServeError(404, f"unknown model '{model}' (served: {served})")
        request[CALL].model = model
        if version and version not in views[0].pools:
            known = ", ".join(sorted(views[0].pools))
            raise KServeError(404, f"unknown version '{version}' of model '{model}' (versions: {known})")
        return model, version

    # -- inference ------------------------------------------------------------------------------

    async def infer(self, request: web.Request) -> web.Response:
        """One KServe inference, routed and recorded as a gRPC ModelInfer."""
        model, version = self._model(request)
        infer_request, choice = parse_infer(
            model, version, await read_body(request), request.headers.get(HEADER_LENGTH)
        )
        payload = infer_request.SerializeToString()
        headers = self._routing_headers(request)
        outcome = await self.front.core.infer(payload, headers, None)
        call = request[CALL]
        outcome.principal = call.principal  # recorded as a gRPC call's (auth's middleware set it)
        call.served(outcome.version)
        call.request_id = outcome.request_id
        servicer = self.front.servicer
        if outcome.model != UNKNOWN_MODEL and servicer is not None and servicer.after_answer is not None:
            servicer.after_answer(outcome, payload, self._metadata(request))
        if outcome.response is None:
            raise kserve_error(from_status(outcome.code, outcome.details))
        body, header_length = infer_answer(oip.ModelInferResponse.FromString(outcome.response), choice)
        response_headers = self._answer_headers(outcome)
        if header_length is None:
            answer = web.Response(body=body, content_type="application/json", headers=response_headers)
        else:
            response_headers[HEADER_LENGTH] = str(header_length)  # of the JSON before compression, as Triton's
            answer = web.Response(body=body, content_type="application/octet-stream", headers=response_headers)
        if request.headers.get("Accept-Encoding"):
            answer.enable_compression()  # gzip or deflate when the client accepts one (tritonclient may ask)
        return answer

    def _routing_headers(self, request: web.Request) -> dict[str, str]:
        """What the core reads, as the gRPC servicer passes it: the request id (decoded), the routing-key
        headers and the pin."""
        headers: dict[str, str] = {}
        sent_id = header_text(request, REQUEST_ID_HEADER)
        if sent_id:
            headers[REQUEST_ID_HEADER] = from_header_value(sent_id)
        for name in self.front.core.routing_key_headers:
            key = header_text(request, name)
            if key is not None:
                headers[name] = key
        pin = header_text(request, VERSION_HEADER)
        if pin:
            headers[VERSION_HEADER] = pin
        return headers

    @staticmethod
    def _metadata(request: web.Request) -> list[tuple[str, str | bytes]]:
        """The client's headers as the call's metadata (the recorder drops credentials and routing keys as for
        gRPC), less HTTP's own, which are no gRPC metadata."""
        return [
            (key.lower(), as_text(value))  # odd bytes must not cost the call its record
            for key, value in request.headers.items()
            if key.lower() not in _TRANSPORT_HEADERS
        ]

    @staticmethod
    def _answer_headers(outcome: CallOutcome) -> dict[str, str]:
        headers = {VERSION_HEADER: header_value(outcome.version)}
        request_id = header_value(outcome.request_id)
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        return headers

    # -- generate -------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, stream=False)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, stream=True)

    async def _generate(self, request: web.Request, *, stream: bool) -> web.StreamResponse:
        model, version = self._model(request)
        headers = self._routing_headers(request)
        request_id = headers.get(REQUEST_ID_HEADER) or _new_id()
        headers[REQUEST_ID_HEADER] = request[CALL].request_id = request_id
        exchange = self.front.recorded(request, "generate-stream" if stream else "generate")
        raw = await read_body(request)
        if exchange is not None:
            exchange.received(raw, request.headers.get("Content-Type", ""))
        payload = request[CALL].worker_request = parse_generate(
            model, version, raw, stream=stream, request_id=request_id
        )
        answer = GenerateAnswer(model, version)
        relay = _GenerateRelay(self.front, request, answer, stream=stream)
        outcome = await self.front.streams.relay(
            _one(payload), relay.write, headers, (), None, on_start=relay.bind, idle_timeout_s=self.front.idle_timeout_s
        )
        assert outcome is not None  # one request was sent
        if exchange is not None:
            exchange.usage = answer.usage()
        return await relay.finish(outcome)


class _GenerateRelay:
    """One generate call's answer as the worker's responses arrive: SSE events (``generate_stream``), or one
    JSON object at the end (``generate``)."""

    def __init__(self, front: HttpFrontDoor, request: web.Request, answer: GenerateAnswer, *, stream: bool) -> None:
        self.front = front
        self.request = request
        self.call = request[CALL]
        self.answer = answer
        self.stream = stream
        self.outcome: CallOutcome | None = None
        self.sse: web.StreamResponse | None = None
        self.gone = False

    @property
    def _request_id(self) -> str:
        request_id = self.call.request_id
        assert request_id is not None  # set before the relay began
        return request_id

    def bind(self, outcome: CallOutcome) -> None:
        self.outcome = self.call.outcome = outcome  # the front door records and counts the call by it

    async def write(self, payload: bytes) -> None:
        if self.gone:
            return
        event = self.answer.read(payload, gather=not self.stream)
        if event is None or not self.stream or self.answer.error:
            return
        try:
            if self.sse is None:
                self.sse = await self._open()
            await self._event(event)
        except ConnectionError:
            # The client went away between two tokens: stop the worker's stream as a cancel would.
            self.gone = True
            task = asyncio.current_task()
            if task is not None:
                task.cancel()
            return
        call = self.call
        if not call.ttft:
            call.ttft = True
            self.front.metrics.first_token(
                self.answer.model, self.answer.version, call.route, time.monotonic() - call.started
            )

    async def _open(self) -> web.StreamResponse:
        version = self.outcome.version if self.outcome is not None else ""
        self.answer.version = self.answer.version or version
        self.call.served(version)
        response = stream_response(
            self.request,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                VERSION_HEADER: header_value(version),
                REQUEST_ID_HEADER: header_value(self._request_id),
            },
        )
        await response.prepare(self.request)
        return response

    async def _event(self, data: dict[str, Any]) -> None:
        assert self.sse is not None
        await self.sse.write(f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode())

    async def finish(self, outcome: CallOutcome) -> web.StreamResponse:
        self.outcome = outcome
        self.call.served(outcome.version)
        failure: KServeError | None = None
        if outcome.code != grpc.StatusCode.OK:
            failure = kserve_error(from_status(outcome.code, outcome.details))
        elif self.answer.error:
            failure = bad_input(self.answer.error)
        if self.sse is not None:  # the stream began: an error is its last event, as Triton sends it
            if failure is not None:
                self.call.status = failure.status
                await self._event(failure.body())
            await end_stream(self.request, self.sse)
            return self.sse
        if failure is not None:
            raise failure
        if self.stream:  # no response had outputs: an empty stream, as the client asked for a stream
            self.sse = await self._open()
            await end_stream(self.request, self.sse)
            return self.sse
        fields = {"model_name": self.answer.model, "model_version": outcome.version, **self.answer.fields}
        fields["model_version"] = fields["model_version"] or outcome.version
        return web.json_response(
            fields,
            headers={
                VERSION_HEADER: header_value(outcome.version),
                REQUEST_ID_HEADER: header_value(self._request_id),
            },
        )


# -- helpers ----------------------------------------------------------------------------------------


async def _one(request: bytes) -> AsyncIterator[bytes]:
    yield request


def _new_id() -> str:
    return uuid.uuid4().hex


def _tensor_metadata(tensor: oip.ModelMetadataResponse.TensorMetadata) -> dict[str, Any]:
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": [int(dim) for dim in tensor.shape]}


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body's JSON object, checked as the OpenAI routes check theirs: a body nested past the limit or
    holding a lone surrogate (which fails where it is encoded, as a BYTES element) is bad input, not a 500."""
    try:
        return parse_body(raw)
    except ApiError as error:
        raise bad_input(error.message) from None


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_input(f"'{where}' must be a JSON object, got {json.dumps(value)[:64]}")
    return dict(value)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_input(f"{where} must be a string, got {json.dumps(value)[:64]}")
    return value


def _only(document: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for key in document:
        if key not in allowed:
            raise bad_input(f"{where}: unknown field '{key}'")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
