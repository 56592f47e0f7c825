"""Tokens in and out of one recorded call, and its time to first token, as the analysis reads them.

The recorder writes these as readable fields of each call entry (and the archiver as columns), so an
analysis of tokens, TTFT and cost per arm never parses a record. Where they come from, first found:

1. ``CallRecord.usage``: the answer reported its usage (an HTTP call's ``usage`` object, filled by the router);
2. a token stream's final responses: the ``prompt_tokens`` and ``completion_tokens`` outputs that our
   generating worker puts on every final response (summed over the stream's requests);
3. otherwise, for a token stream: completion tokens are the responses carrying text; prompt tokens are
   unknown (None), never guessed from the prompt's bytes.

A stream the recorder cut (``truncated``, or fewer responses kept than it counted), with a response
stored as a blob reference (its bytes are not in the record), or whose usage outputs were redacted says
nothing it can be trusted on: both unknown.
"""

from __future__ import annotations

import math

from splitstream.common import tensors
from splitstream.common.errors import InvalidInput
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2

PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
TEXT_OUTPUT = "text_output"
_COMPLETION_BYTES = COMPLETION_TOKENS.encode()
#: The record tag naming redacted outputs (:data:`splitstream.common.records.REDACTED_OUTPUTS_TAG`; not
#: imported: records imports this module).
_REDACTED_TAG = "splitstream.redacted-outputs"


def token_counts(record: recorder_pb2.CallRecord) -> tuple[int | None, int | None]:
    """``(prompt tokens, completion tokens)`` of the call, None where unknown (see the module docstring)."""
    if record.HasField("usage"):
        return int(record.usage.prompt_tokens), int(record.usage.completion_tokens)
    stream = record.stream
    if not record.HasField("stream") or stream.truncated or len(stream.responses) < stream.responses_total:
        return None, None
    redacted = set(record.tags.get(_REDACTED_TAG, "").split(","))
    if PROMPT_TOKENS in redacted or COMPLETION_TOKENS in redacted:
        return None, None
    payloads = []
    for message in stream.responses:  # one pass: each access to a record's message costs about half a µs
        payload = message.payload
        if payload.blob_sha256:
            return None, None
        payloads.append(payload.inline)
    try:
        # Only the responses that name a usage output are parsed for it (a byte search at C speed: a
        # 48-token stream costs one parse, not 48); the text is counted only when no response reports usage.
        usage = _reported_usage([data for data in payloads if _COMPLETION_BYTES in data])
        if usage is not None:
            return usage
        with_text = 0
        for data in payloads:
            response = _parsed(data)
            with_text += not response.error_message and _carries_text(response.infer_response)
    except _Unreadable:
        return None, None
    return None, with_text


class _Unreadable(Exception):
    """A response that does not parse, or whose usage does not decode: the call's tokens are unknown."""


def _reported_usage(payloads: list[bytes]) -> tuple[int, int] | None:
    """The usage summed over the responses that carry both usage outputs; None when none does."""
    prompt = completion = 0
    reported = False
    for data in payloads:
        response = _parsed(data)
        answer = response.infer_response
        names = {output.name for output in answer.outputs}
        if response.error_message or PROMPT_TOKENS not in names or COMPLETION_TOKENS not in names:
            continue
        usage = _usage(answer)
        if usage is None:
            raise _Unreadable
        prompt, completion, reported = prompt + usage[0], completion + usage[1], True
    return (prompt, completion) if reported else None


def _parsed(data: bytes) -> oip.ModelStreamInferResponse:
    try:
        return oip.ModelStreamInferResponse.FromString(data)
    except Exception:  # protobuf's DecodeError: the recorder checked the stream, not each payload
        raise _Unreadable from None


def ttft_ns(record: recorder_pb2.CallRecord) -> int:
    """Time to first token: an HTTP call's first event carrying text (what its client saw), else a token
    stream's first response; 0 when neither came."""
    if record.HasField("http") and record.http.first_token_ns > 0:
        return int(record.http.first_token_ns)
    return int(record.stream.first_response_ns) if record.HasField("stream") else 0


def _carries_text(answer: oip.ModelInferResponse) -> bool:
    """Whether the response's ``text_output`` holds any byte (an empty final response holds none)."""
    for index, output in enumerate(answer.outputs):
        if output.name != TEXT_OUTPUT:
            continue
        if answer.raw_output_contents:
            if index >= len(answer.raw_output_contents):
                return False
            elements = math.prod(output.shape) if output.shape else 1
            return len(answer.raw_output_contents[index]) > 4 * elements  # a 4-byte length per element
        return any(output.contents.bytes_contents)
    return False


def _usage(answer: oip.ModelInferResponse) -> tuple[int, int] | None:
    try:
        arrays = tensors.output_arrays(answer)
    except InvalidInput:
        return None
    prompt, completion = arrays[PROMPT_TOKENS].reshape(-1), arrays[COMPLETION_TOKENS].reshape(-1)
    if not prompt.size or not completion.size or prompt.dtype.kind not in "iu" or completion.dtype.kind not in "iu":
        return None
    return max(int(prompt[0]), 0), max(int(completion[0]), 0)
