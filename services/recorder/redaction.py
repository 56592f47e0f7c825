"""Redaction: sensitive metadata, input tensors and output tensors are dropped or masked before anything is stored.

It runs before blobs are hashed, so not even a blob holds unredacted bytes.
Masked metadata becomes ``hmac:<hex HMAC-SHA256(key, value)>``, so equal values
stay comparable (and match the routers' routing_key_hmac under the same key)
without being readable. A masked tensor keeps its name, datatype and shape with
its data zeroed, so a replay still sends a well-formed request and the recorded
answer still decodes; a dropped tensor disappears with its raw contents slot.
Output rules apply to the answer the client got and to every shadow's answer;
the outputs redacted in the former are named in the record's tags, so a replay
does not mistake the zeros (or the gap) for the model's answer.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, MutableSequence, Sequence
from typing import TypeVar

from google.protobuf.message import Message

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import REDACTED_HTTP_TAG, mark_redacted_outputs
from splitstream.common.tensors import Tensor
from splitstream.recorder.config import Action, Rule

_BYTES_LENGTH_PREFIX = 4


class Redactor:
    def __init__(
        self, *, metadata: Sequence[Rule], inputs: Sequence[Rule], outputs: Sequence[Rule] = (), hmac_key: bytes
    ) -> None:
        self._metadata = {rule.name.lower(): rule.action for rule in metadata}
        self._inputs = {rule.name: rule.action for rule in inputs}
        self._outputs = {rule.name: rule.action for rule in outputs}
        self._key = hmac_key

    @property
    def active(self) -> bool:
        return bool(self._metadata or self._inputs or self._outputs)

    def mask_value(self, value: str) -> str:
        return "hmac:" + hmac.new(self._key, value.encode(), hashlib.sha256).hexdigest()

    def redact(
        self,
        record: recorder_pb2.CallRecord,
        request: oip.ModelInferRequest | None,
        response: oip.ModelInferResponse | None = None,
        shadow_responses: Sequence[oip.ModelInferResponse] = (),
        stream_requests: Sequence[oip.ModelInferRequest] = (),
        stream_responses: Sequence[oip.ModelStreamInferResponse] = (),
    ) -> None:
        """Redact ``record`` in place; ``request``, ``response`` and ``shadow_responses`` are its decoded
        payloads (needed when inputs or outputs are redacted; the shadows' in the order of ``record.shadows``;
        a token stream's in the order of ``record.stream``: input rules apply to each request of the stream,
        output rules to each response's ``infer_response``, and the outputs redacted are named in the tags).

        A payload is re-serialized only when a rule matched one of its tensors, so untouched requests
        and responses are stored byte for byte as they were sent and answered."""
        if self._metadata:
            for key in [k for k in record.metadata if k.lower() in self._metadata]:
                if self._metadata[key.lower()] is Action.DROP:
                    del record.metadata[key]
                else:
                    record.metadata[key] = self.mask_value(record.metadata[key])
        inputs_matched = False
        if self._inputs and request is not None and self.redact_request(request):
            _store(record.request, request)
            inputs_matched = True
        if self._inputs:
            for message, stream_request in zip(record.stream.requests, stream_requests, strict=True):
                if self.redact_request(stream_request):
                    _store(message.payload, stream_request)
                    inputs_matched = True
        outputs_matched = self._redact_outputs(record, response, shadow_responses, stream_responses)
        if record.HasField("http"):
            self._redact_http(record, inputs_matched, outputs_matched)

    def _redact_outputs(
        self,
        record: recorder_pb2.CallRecord,
        response: oip.ModelInferResponse | None,
        shadow_responses: Sequence[oip.ModelInferResponse],
        stream_responses: Sequence[oip.ModelStreamInferResponse],
    ) -> bool:
        """Output rules on the answer, a stream's responses and the shadows'; whether one matched the answer's."""
        if not self._outputs:
            return False
        redacted: list[str] = []
        for message, stream_response in zip(record.stream.responses, stream_responses, strict=True):
            names = self.redact_response(stream_response.infer_response)
            if names:
                _store(message.payload, stream_response)
                redacted += names
        if redacted:
            mark_redacted_outputs(record, redacted)
        if response is not None:
            names = self.redact_response(response)
            if names:
                _store(record.response, response)
                mark_redacted_outputs(record, names)
                redacted += names
        for shadow, shadow_response in zip(record.shadows, shadow_responses, strict=True):
            if self.redact_response(shadow_response):
                _store(shadow.response, shadow_response)
        return bool(redacted)

    def _redact_http(self, record: recorder_pb2.CallRecord, inputs_matched: bool, outputs_matched: bool) -> None:
        """An HTTP call's bodies hold, as JSON, what its translated messages hold as tensors, and no rule can
        mask a field of them: a body is dropped when a rule redacted its translated side, and when there is
        no translated side to tell (a call passed through to an HTTP upstream) while rules of its kind are
        set. What was dropped is named in :data:`REDACTED_HTTP_TAG`."""
        http = record.http
        dropped = []
        translated_in = bool(record.request.inline) or len(record.stream.requests) > 0
        if self._inputs and (inputs_matched or not translated_in) and http.HasField("request_body"):
            http.ClearField("request_body")
            dropped.append("request_body")
        translated_out = bool(record.response.inline) or len(record.stream.responses) > 0
        if self._outputs and (outputs_matched or not translated_out):
            if http.HasField("response_body"):
                http.ClearField("response_body")
                dropped.append("response_body")
            if http.events:
                del http.events[:]
                dropped.append("events")
        if dropped:
            record.tags[REDACTED_HTTP_TAG] = ",".join(dropped)

    def redact_request(self, request: oip.ModelInferRequest) -> bool:
        """Drop or mask configured inputs in place; returns whether anything changed."""
        return bool(_redact_tensors(request.inputs, request.raw_input_contents, self._inputs))

    def redact_response(self, response: oip.ModelInferResponse) -> list[str]:
        """Drop or mask configured outputs in place; returns the names of those redacted."""
        return _redact_tensors(response.outputs, response.raw_output_contents, self._outputs)


_T = TypeVar("_T", bound=Tensor)


def _redact_tensors(items: MutableSequence[_T], raw: MutableSequence[bytes], rules: Mapping[str, Action]) -> list[str]:
    """Drop or mask the tensors of ``items`` named in ``rules`` (with their slots of ``raw``, the message's
    raw contents); returns the names redacted, in message order."""
    if not rules:
        return []
    matched = [(i, rules[t.name]) for i, t in enumerate(items) if t.name in rules]
    if not matched:
        return []
    names = [items[i].name for i, _ in matched]
    # The protocol wants one raw slot per tensor (or none). If a message has a mismatched count
    # we cannot tell which slot is the sensitive tensor's, so no raw data is kept.
    if raw and len(raw) != len(items):
        del raw[:]
    for index, action in matched:
        if action is Action.MASK:
            _zero(items[index], raw, index)
    for index, action in reversed(matched):
        if action is Action.DROP:
            del items[index]
            if raw:
                del raw[index]
    return names


def _zero(tensor: Tensor, raw: MutableSequence[bytes], index: int) -> None:
    """Replace the data of ``tensor`` (slot ``index`` of ``raw`` when the message has raw contents)
    with zeros of the same element count (BYTES: empty elements)."""
    if raw:
        if tensor.datatype == "BYTES":
            count = max(tensors.element_count(tensor.shape), 0)
            raw[index] = b"\x00" * (_BYTES_LENGTH_PREFIX * count)
        else:
            raw[index] = b"\x00" * len(raw[index])
    for field, values in tensor.contents.ListFields():
        zero: object = b"" if field.name == "bytes_contents" else (False if field.name == "bool_contents" else 0)
        count = len(values)
        tensor.contents.ClearField(field.name)  # type: ignore[arg-type]
        getattr(tensor.contents, field.name).extend([zero] * count)


def _store(payload: recorder_pb2.Payload, message: Message) -> None:
    data = message.SerializeToString()
    payload.inline = data
    payload.size_bytes = len(data)
