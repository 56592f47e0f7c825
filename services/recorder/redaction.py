"""Redaction: sensitive metadata and input tensors are dropped or masked before anything is stored.

It runs before blobs are hashed, so not even a blob holds unredacted bytes.
Masked metadata becomes ``hmac:<hex HMAC-SHA256(key, value)>``, so equal values
stay comparable (and match the routers' routing_key_hmac under the same key)
without being readable. A masked input keeps its name, datatype and shape with
its data zeroed, so a replay still sends a well-formed request; a dropped input
disappears with its raw_input_contents slot.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.recorder.config import Action, Rule

_BYTES_LENGTH_PREFIX = 4


class Redactor:
    def __init__(self, *, metadata: Sequence[Rule], inputs: Sequence[Rule], hmac_key: bytes) -> None:
        self._metadata = {rule.name.lower(): rule.action for rule in metadata}
        self._inputs = {rule.name: rule.action for rule in inputs}
        self._key = hmac_key

    @property
    def active(self) -> bool:
        return bool(self._metadata or self._inputs)

    def mask_value(self, value: str) -> str:
        return "hmac:" + hmac.new(self._key, value.encode(), hashlib.sha256).hexdigest()

    def redact(self, record: recorder_pb2.CallRecord, request: oip.ModelInferRequest | None) -> None:
        """Redact ``record`` in place; ``request`` is its decoded request (needed when inputs are redacted).

        The request payload is re-serialized only when an input rule matched, so untouched requests
        are stored byte for byte as the client sent them."""
        if self._metadata:
            for key in [k for k in record.metadata if k.lower() in self._metadata]:
                if self._metadata[key.lower()] is Action.DROP:
                    del record.metadata[key]
                else:
                    record.metadata[key] = self.mask_value(record.metadata[key])
        if self._inputs and request is not None and self.redact_request(request):
            data = request.SerializeToString()
            record.request.inline = data
            record.request.size_bytes = len(data)

    def redact_request(self, request: oip.ModelInferRequest) -> bool:
        """Drop or mask configured inputs in place; returns whether anything changed."""
        matched = [(i, self._inputs[t.name]) for i, t in enumerate(request.inputs) if t.name in self._inputs]
        if not matched:
            return False
        raw = request.raw_input_contents
        # The protocol wants one raw slot per input (or none). If a client sent a mismatched
        # count we cannot tell which slot is the sensitive tensor's, so no raw data is kept.
        if raw and len(raw) != len(request.inputs):
            del raw[:]
        for index, action in matched:
            if action is Action.MASK:
                _zero(request, index)
        for index, action in reversed(matched):
            if action is Action.DROP:
                del request.inputs[index]
                if raw:
                    del raw[index]
        return True


def _zero(request: oip.ModelInferRequest, index: int) -> None:
    """Replace input ``index``'s data with zeros of the same element count (BYTES: empty elements)."""
    tensor = request.inputs[index]
    raw = request.raw_input_contents
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
