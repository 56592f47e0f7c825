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
_FINAL = "triton_final_response"
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
    prompt = completion = 0
    reported = False
    with_text = 0
    for message in record.stream.responses:
        if message.payload.WhichOneof("body") == "blob_sha256":
            return None, None
        try:
            response = oip.ModelStreamInferResponse.FromString(message.payload.inline)
        except Exception:  # protobuf's DecodeError: the recorder checked the stream, not each payload
            return None, None
        if response.error_message:
            continue
        answer = response.infer_response
        with_text += _carries_text(answer)
        names = {output.name for output in answer.outputs}
        if PROMPT_TOKENS in names and COMPLETION_TOKENS in names:
            usage = _usage(answer)
            if usage is None:
                return None, None
            prompt, completion, reported = prompt + usage[0], completion + usage[1], True
    if reported:
        return prompt, completion
    return None, with_text


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
