"""OpenAI's chat and completions requests → one generation request for a worker, and its answer's shapes.

Convert at the edge: a JSON body becomes a :class:`Generation` (checked field by field; a wrong one is a
400 naming it), a ``Generation`` becomes the ``inference.ModelInferRequest`` a generating worker (or
TensorRT-LLM's Triton ensemble) takes, and the worker's responses become OpenAI's objects:
``chat.completion`` / ``chat.completion.chunk`` and ``text_completion``.

The prompt of a chat is a plain join (a model's own chat template can come later)::

    system: You are terse.
    user: Say hi.
    assistant:

one ``role: content`` line per message, then ``assistant:`` (:func:`join_messages`).

Fields: ``model``; ``messages`` (chat) or ``prompt`` (completions); ``max_tokens`` or
``max_completion_tokens`` → ``max_tokens``; ``temperature``; ``top_p``; ``seed`` → ``random_seed``;
``stop`` (a string or a list of up to 4) → ``stop_words``; ``stream``; ``stream_options.include_usage``;
``user`` (the routing key when no routing-key header came). ``n`` (1), ``logprobs`` (false),
``presence_penalty``/``frequency_penalty`` (0) and ``echo`` (false) are accepted at those values only;
any other field is refused, never ignored. A null is an absent field.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitstream.common import tensors
from splitstream.common.errors import InvalidInput
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.router.http.errors import ApiError, bad_request

CHAT = "chat"
COMPLETION = "completion"
#: ``max_tokens`` when a request gives none: OpenAI's own default for /v1/completions, and a short answer for
#: chat (OpenAI's is the model's context, which the router does not know; a worker refuses past its limit).
DEFAULT_MAX_TOKENS = {CHAT: 256, COMPLETION: 16}
#: OpenAI takes at most four stop sequences.
MAX_STOP_WORDS = 4
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "user",
        "n",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
    }
)
_FIELDS = {CHAT: _COMMON | {"messages", "max_completion_tokens"}, COMPLETION: _COMMON | {"prompt", "echo"}}
#: Accepted at OpenAI's default value only (what the worker does anyway).
_ONLY_DEFAULT: dict[str, Any] = {
    "n": 1,
    "logprobs": False,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "echo": False,
}


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One checked request: what the worker is asked, and how the answer is shaped."""

    kind: str
    model: str
    prompt: str
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    user: str | None = None

    def inference_request(self, request_id: str) -> bytes:
        """The ``ModelInferRequest`` for a generating worker, streamed (a response per token), new text only."""
        request = oip.ModelInferRequest(model_name=self.model, id=request_id)
        _add(request, "text_input", np.array([[self.prompt.encode()]], dtype=np.object_))
        _add(request, "max_tokens", np.array([[self.max_tokens]], dtype=np.int32))
        if self.temperature is not None:
            _add(request, "temperature", np.array([[self.temperature]], dtype=np.float32))
        if self.top_p is not None:
            _add(request, "top_p", np.array([[self.top_p]], dtype=np.float32))
        if self.seed is not None:
            _add(request, "random_seed", np.array([[self.seed]], dtype=np.uint64))
        if self.stop:
            _add(request, "stop_words", np.array([[word.encode() for word in self.stop]], dtype=np.object_))
        _add(request, "stream", np.array([[True]], dtype=np.bool_))
        _add(request, "exclude_input_in_output", np.array([[True]], dtype=np.bool_))
        return request.SerializeToString()


def _add(request: oip.ModelInferRequest, name: str, array: np.ndarray) -> None:
    request.inputs.add(name=name, datatype=tensors.datatype_of(array), shape=list(array.shape))
    request.raw_input_contents.append(tensors.to_raw(array))


# -- requests -------------------------------------------------------------------------------------


#: The deepest nesting of arrays and objects a body may have: OpenAI's requests need a few levels, and Python's
#: own limits (the parser's, ``json.dumps``' in an error message) are near 1,000.
MAX_DEPTH = 64


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; 400 when it is not one, or is nested deeper than :data:`MAX_DEPTH`."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    except RecursionError:  # a hundred thousand nested arrays: the parser's own limit
        raise bad_request(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    if not _plain(raw):
        _check_values(body)
    return body


def _plain(raw: bytes) -> bool:
    """Whether :func:`_check_values` cannot refuse this body, so need not walk it (most calls): it holds too few
    ``[`` and ``{`` to nest past :data:`MAX_DEPTH`, and no string that is not ASCII (every byte ASCII, and no
    ``\\u`` escape, which is how JSON spells a lone surrogate), and is UTF-8: ``json.loads`` also reads UTF-16
    and UTF-32, whose ASCII text is every byte ASCII with a NUL beside each character, and whose ``\\u`` is not the
    two bytes looked for (a NUL is in no UTF-8 JSON: JSON forbids raw control characters)."""
    return raw.isascii() and b"\0" not in raw and b"\\u" not in raw and raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH


def _check_values(body: dict[str, Any]) -> None:
    """400 for a body nested deeper than :data:`MAX_DEPTH`, or holding a string that is not Unicode text: JSON's
    ``"\\ud800"`` is a lone UTF-16 surrogate, which parses but cannot be encoded (as the prompt sent to the
    worker, a routing key hashed, a stop word), and failed the request with a 500 there. The field is named
    (``messages[0].content``). Walked without recursion."""
    todo: list[tuple[Any, str, int]] = [(body, "", 1)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, f"{where}.{key}" if where else key, key=True)
                place = f"{where}.{key}" if where else key
            else:
                place = f"{where}[{key}]"
            if isinstance(item, str):
                _check_text(item, place)
            elif isinstance(item, dict | list):
                todo.append((item, place, depth + 1))


def _check_text(text: str, where: str, *, key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode()
    except UnicodeEncodeError:
        what = "a field name" if key else "the string"
        raise bad_request(
            f"{what} at '{where}' is not valid Unicode text (UTF-8): it holds a lone UTF-16 surrogate", where
        ) from None


def parse_generation(kind: str, body: Mapping[str, Any]) -> Generation:
    """A :class:`Generation` from a chat (``kind`` CHAT) or completions (COMPLETION) body; 400 naming the field."""
    body = {key: value for key, value in body.items() if value is not None}
    for key in body:
        if key not in _FIELDS[kind]:
            raise bad_request(f"unsupported parameter '{key}'", key)
    for key, default in _ONLY_DEFAULT.items():
        if key in body and (body[key] != default or isinstance(body[key], bool) != isinstance(default, bool)):
            raise bad_request(f"'{key}' is supported only as {json.dumps(default)}, got {json.dumps(body[key])}", key)
    model = _string(body, "model", required=True)
    if not model:
        raise bad_request("'model' must not be empty", "model")
    prompt = join_messages(body.get("messages")) if kind == CHAT else _prompt(body)
    stream = _bool(body, "stream")
    options = body.get("stream_options", {})
    if "stream_options" in body and not stream:
        raise bad_request("'stream_options' is allowed only when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request(f"'stream_options' must be an object, got {_json_type(options)}", "stream_options")
    for key in options:
        if key != "include_usage":
            raise bad_request(f"unsupported parameter 'stream_options.{key}'", f"stream_options.{key}")
    return Generation(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=_max_tokens(kind, body),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        seed=_seed(body),
        stop=_stop(body),
        stream=stream,
        include_usage=_bool(options, "include_usage", param="stream_options.include_usage"),
        user=_string(body, "user"),
    )


def join_messages(messages: Any) -> str:
    """The prompt of a chat: ``role: content`` per message, one a line, then ``assistant:``."""
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list):
        raise bad_request(f"'messages' must be an array of messages, got {_json_type(messages)}", "messages")
    if not messages:
        raise bad_request("'messages' must hold at least one message", "messages")
    lines = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object, got {_json_type(message)}", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list or an object is not even hashable
            got = json.dumps(role) if isinstance(role, str) or role is None else _json_type(role)
            raise bad_request(f"'{where}.role' must be one of {', '.join(sorted(ROLES))}, got {got}", f"{where}.role")
        lines.append(f"{role}: {_content(message.get('content'), f'{where}.content')}")
    lines.append("assistant:")
    return "\n".join(lines)


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or an array of ``{"type": "text", "text": ...}`` parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or an array of text parts, got {_json_type(content)}", where)
    texts = []
    for index, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise bad_request(f'\'{where}[{index}]\' must be a text part ({{"type": "text", "text": ...}})', where)
        texts.append(part["text"])
    return "".join(texts)


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, str):
        return prompt
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    raise bad_request(f"'prompt' must be a string (or an array of one string), got {_json_type(prompt)}", "prompt")


def _max_tokens(kind: str, body: Mapping[str, Any]) -> int:
    given = [key for key in ("max_tokens", "max_completion_tokens") if key in body]
    if len(given) > 1:
        raise bad_request("give 'max_tokens' or 'max_completion_tokens', not both", given[1])
    if not given:
        return DEFAULT_MAX_TOKENS[kind]
    key = given[0]
    value = body[key]
    if not _is_int(value) or value < 1:
        raise bad_request(f"'{key}' must be an integer >= 1, got {json.dumps(value)}", key)
    if value > np.iinfo(np.int32).max:
        raise bad_request(f"'{key}' must be at most {np.iinfo(np.int32).max}, got {value}", key)
    return int(value)


def _seed(body: Mapping[str, Any]) -> int | None:
    if "seed" not in body:
        return None
    value = body["seed"]
    if not _is_int(value) or not 0 <= value < 2**64:
        raise bad_request(f"'seed' must be an integer within 0..2^64-1, got {json.dumps(value)}", "seed")
    return int(value)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop", [])
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
        raise bad_request(f"'stop' must be a string or an array of strings, got {_json_type(stop)}", "stop")
    if len(words) > MAX_STOP_WORDS:
        raise bad_request(f"'stop' holds at most {MAX_STOP_WORDS} sequences, got {len(words)}", "stop")
    if any(not word for word in words):
        raise bad_request("'stop' sequences must not be empty", "stop")
    return tuple(words)


def _number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    if key not in body:
        return None
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number, got {json.dumps(value)}", key)
    if not low <= value <= high:
        raise bad_request(f"'{key}' must be within {low:g}..{high:g}, got {value}", key)
    return float(value)


def _string(body: Mapping[str, Any], key: str, *, required: bool = False) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise bad_request(f"'{key}' is required", key)
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string, got {_json_type(value)}", key)
    return value


def _bool(body: Mapping[str, Any], key: str, *, param: str = "") -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise bad_request(f"'{param or key}' must be a boolean, got {json.dumps(value)}", param or key)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


# -- the worker's responses -----------------------------------------------------------------------


#: The worker's input names → the OpenAI field a refusal of it is about.
WORKER_INPUTS = {
    "text_input": "messages",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "random_seed": "seed",
    "stop_words": "stop",
}


@dataclass(frozen=True, slots=True)
class Piece:
    """One worker response: its text (may be empty), whether it is the last, and the usage on the last."""

    text: str
    final: bool
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def read_response(payload: bytes) -> Piece | ApiError:
    """A worker's ``ModelStreamInferResponse`` as a :class:`Piece`, or the error it reports (``error_message``)."""
    response = oip.ModelStreamInferResponse.FromString(payload)
    if response.error_message:
        param = None
        for name, field in WORKER_INPUTS.items():
            if f"'{name}'" in response.error_message:
                param = field
        return bad_request(f"the model refused the request: {response.error_message}", param)
    answer = response.infer_response
    final = "triton_final_response" in answer.parameters and answer.parameters["triton_final_response"].bool_param
    if not answer.outputs:
        return Piece("", final or "triton_final_response" not in answer.parameters)
    try:
        outputs = tensors.output_arrays(answer)
    except InvalidInput as error:
        return ApiError(502, f"the model's answer cannot be read: {error}", type="server_error")
    text = outputs.get("text_output")
    words = b"".join(bytes(item) for item in text.reshape(-1)) if text is not None else b""
    return Piece(
        words.decode("utf-8", errors="replace"),
        final or "triton_final_response" not in answer.parameters,
        _count(outputs.get("prompt_tokens")),
        _count(outputs.get("completion_tokens")),
    )


def _count(array: np.ndarray | None) -> int | None:
    return None if array is None or array.size == 0 else int(array.reshape(-1)[0])


class StopFilter:
    """Keeps stop sequences out of the text, as OpenAI does (the worker sends them: generation ends *with*
    one). Text that could be the start of a stop sequence is held back until the next piece tells; what
    is held back when the generation ends is dropped if it is a whole stop sequence, else let out."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.stop:
            return text
        pending = self.held + text
        keep = 0
        for word in self.stop:
            for size in range(min(len(word), len(pending)), 0, -1):
                if pending.endswith(word[:size]):
                    keep = max(keep, size)
                    break
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def end(self) -> str:
        held, self.held = self.held, ""
        for word in self.stop:
            if held.endswith(word):
                return held[: len(held) - len(word)]
        return held


# -- OpenAI's objects -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Shapes:
    """The fields every object of one answer shares: id, creation time (s) and model."""

    kind: str
    id: str
    model: str
    created: int

    @classmethod
    def of(cls, generation: Generation, request_id: str) -> Shapes:
        prefix = "chatcmpl-" if generation.kind == CHAT else "cmpl-"
        return cls(kind=generation.kind, id=prefix + request_id, model=generation.model, created=int(time.time()))

    def _head(self, object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        """The non-streamed answer: ``chat.completion`` or ``text_completion``."""
        if self.kind == CHAT:
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def chunk(
        self, *, text: str | None = None, role: bool = False, finish_reason: str | None = None, usage: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk (``usage`` ``null`` in it when the client asked for usage: the last chunk has it)."""
        if self.kind == CHAT:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            chunk = {**self._head("text_completion"), "choices": [choice]}
        if usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        object = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        return {**self._head(object), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
