"""Generative models: a next-token graph stepped for every active sequence at once (in-flight batching).

A generative model (``generation:`` in config.yaml) is a graph that maps the last ``n`` tokens of
each row (INT64 [batch, n]) to next-token logits (FP32 [batch, 256]) over a byte vocabulary: token
id = byte value, so a UTF-8 prompt is its own token sequence and a token's text is one byte.

Requests follow TensorRT-LLM's Triton ensemble (``all_models/inflight_batcher_llm/ensemble``), so
clients written for it (its ``end_to_end_grpc_client.py``) work unchanged: ``text_input`` (BYTES,
one element), ``max_tokens``, and the optional sampling and output inputs of :data:`INPUT_DATATYPES`;
the answer is ``text_output`` (BYTES), with ``cum_log_probs`` / ``output_log_probs`` when asked and
the token usage (``prompt_tokens``, ``completion_tokens``) on the final response.
:func:`read_request` turns decoded tensors into a :class:`GenerationRequest`, raising InvalidInput
that names the input; a value the worker cannot honour (a beam width above 1) is refused, never
ignored. :func:`replies` turns a generation's tokens into what its responses carry: whole UTF-8
characters each (a byte-level model makes a multi-byte character over several steps), or the whole
text at once when the request does not stream.

:class:`GenerationScheduler` owns one thread that loops: admit waiting sequences (up to
``max_sequences``), run the backend once over all active rows, pick each row's token (greedy, or
sampled with the sequence's own seeded generator, so a sequence's text does not depend on which
others share its steps), hand the step's tokens to the event loop in one callback, drop finished
and cancelled sequences. A new request therefore joins at the next step and a cancelled one leaves
at the next step; the event loop never waits on the backend.

Backpressure: a sequence may be at most ``window`` tokens ahead of its consumer (tokens made that
the consumer has not come back for). One whose client stops reading (its stream's writes block,
so the consumer stops asking) is left out of the steps, paused, until the consumer is back within
half the window (so paused sequences rejoin many tokens at a time, in shared steps, not one step
of one row per token taken); the other sequences go on stepping without it. Without this, a client
that does not read would have the worker make and buffer its whole ``max_tokens`` answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from splitstream.common.errors import ConfigError, InvalidInput, ModelNotReady
from splitstream.worker.batching import BackendError, RunFn
from splitstream.worker.metadata import DYNAMIC, ModelMetadata, TensorSpec
from splitstream.worker.metrics import WorkerMetrics
from splitstream.worker.validation import InputHeader

#: Byte vocabulary: the graph's logits have one column per byte value.
VOCABULARY = 256
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"

_INTEGERS = ("INT32", "INT64", "UINT32", "UINT64")
_FLOATS = ("FP32", "FP64")
#: Input name → datatypes accepted. TensorRT-LLM's ensemble has declared max_tokens as UINT32 and
#: later INT32, random_seed as UINT64, top_k and beam_width as UINT32 or INT32: any integer type is
#: taken for them.
INPUT_DATATYPES: Mapping[str, tuple[str, ...]] = {
    TEXT_INPUT: ("BYTES",),
    "max_tokens": _INTEGERS,
    "temperature": _FLOATS,
    "top_k": _INTEGERS,
    "top_p": _FLOATS,
    "repetition_penalty": _FLOATS,
    "random_seed": _INTEGERS,
    "seed": _INTEGERS,
    "stop_words": ("BYTES",),
    "bad_words": ("BYTES",),
    "end_id": _INTEGERS,
    "pad_id": _INTEGERS,
    "beam_width": _INTEGERS,
    "exclude_input_in_output": ("BOOL",),
    "return_log_probs": ("BOOL",),
    "stream": ("BOOL",),
    "streaming": ("BOOL",),
}
#: Inputs that hold a list of words (any number of elements); every other input holds one value.
_WORD_LISTS = ("stop_words", "bad_words")
_SCALARS = tuple(name for name in INPUT_DATATYPES if name not in _WORD_LISTS)
#: The same setting under an older name of the ensemble (``streaming`` until it became ``stream``) or of
#: the tensorrt_llm model behind it (``seed``): either is taken, not both.
_ALIASES: Mapping[str, str] = {"streaming": "stream", "seed": "random_seed"}

CUM_LOG_PROBS = "cum_log_probs"
OUTPUT_LOG_PROBS = "output_log_probs"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
#: Outputs a request may name; ``cum_log_probs`` and ``output_log_probs`` need ``return_log_probs``.
OUTPUT_NAMES = (TEXT_OUTPUT, CUM_LOG_PROBS, OUTPUT_LOG_PROBS, PROMPT_TOKENS, COMPLETION_TOKENS)
_LOG_PROB_OUTPUTS = (CUM_LOG_PROBS, OUTPUT_LOG_PROBS)

#: What ModelMetadata shows for a generative model: the request interface, not the graph's tensors.
METADATA = ModelMetadata(
    inputs=(
        TensorSpec(name=TEXT_INPUT, datatype="BYTES", shape=(DYNAMIC, 1)),
        TensorSpec(name="max_tokens", datatype="INT32", shape=(DYNAMIC, 1)),
        TensorSpec(name="temperature", datatype="FP32", shape=(DYNAMIC, 1)),
        TensorSpec(name="top_k", datatype="INT32", shape=(DYNAMIC, 1)),
        TensorSpec(name="top_p", datatype="FP32", shape=(DYNAMIC, 1)),
        TensorSpec(name="repetition_penalty", datatype="FP32", shape=(DYNAMIC, 1)),
        TensorSpec(name="random_seed", datatype="UINT64", shape=(DYNAMIC, 1)),
        TensorSpec(name="stop_words", datatype="BYTES", shape=(DYNAMIC, DYNAMIC)),
        TensorSpec(name="bad_words", datatype="BYTES", shape=(DYNAMIC, DYNAMIC)),
        TensorSpec(name="end_id", datatype="INT32", shape=(DYNAMIC, 1)),
        TensorSpec(name="pad_id", datatype="INT32", shape=(DYNAMIC, 1)),
        TensorSpec(name="beam_width", datatype="INT32", shape=(DYNAMIC, 1)),
        TensorSpec(name="exclude_input_in_output", datatype="BOOL", shape=(DYNAMIC, 1)),
        TensorSpec(name="return_log_probs", datatype="BOOL", shape=(DYNAMIC, 1)),
        TensorSpec(name="stream", datatype="BOOL", shape=(DYNAMIC, 1)),
    ),
    outputs=(
        TensorSpec(name=TEXT_OUTPUT, datatype="BYTES", shape=(DYNAMIC, 1)),
        TensorSpec(name=CUM_LOG_PROBS, datatype="FP32", shape=(DYNAMIC, 1)),
        TensorSpec(name=OUTPUT_LOG_PROBS, datatype="FP32", shape=(DYNAMIC, 1, DYNAMIC)),
        TensorSpec(name=PROMPT_TOKENS, datatype="INT32", shape=(DYNAMIC, 1)),
        TensorSpec(name=COMPLETION_TOKENS, datatype="INT32", shape=(DYNAMIC, 1)),
    ),
)

#: How many tokens a sequence may be ahead of its consumer before it is left out of the steps (see the
#: module's docstring): enough that a consumer a few steps behind never stalls its sequence.
DEFAULT_WINDOW = 32

#: Why a generation ended, as the generations metric counts it.
OUTCOMES = ("length", "stop_word", "end_id", "cancelled", "error")


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """A validated request: what to continue, how far, how to pick tokens and what to answer."""

    prompt: bytes
    max_tokens: int
    #: 0: greedy (the most likely token); > 0: sample from softmax(logits / temperature).
    temperature: float = 0.0
    #: Sampling only: draw from the ``top_k`` most likely tokens; 0: from all of them.
    top_k: int = 0
    #: Sampling only: draw from the fewest most likely tokens whose probabilities add up to ``top_p``
    #: (nucleus sampling); 1: from all of them.
    top_p: float = 1.0
    #: Every token already in the prompt or the text has its logit divided by this (a positive logit)
    #: or multiplied by it (a negative one) before picking, as TensorRT-LLM does; 1: no penalty.
    repetition_penalty: float = 1.0
    #: Sampling only: the same seed gives the same text.
    seed: int = 0
    #: Generation stops once its text ends with one of these (the stop word is part of the text).
    stop_words: tuple[bytes, ...] = ()
    #: Never generated: the token that would complete one of these (after the prompt and the text so
    #: far) is never picked.
    bad_words: tuple[bytes, ...] = ()
    #: Generation stops when this token is picked (it is not sent).
    end_id: int | None = None
    #: Pads a prompt shorter than the graph's context; None: the model's ``pad_id``.
    pad_id: int | None = None
    #: False: a whole (non-streamed) answer starts with the prompt, as TensorRT-LLM's does.
    exclude_input: bool = True
    #: Answer the generated tokens' log-probabilities (``cum_log_probs``, ``output_log_probs``).
    log_probs: bool = False
    #: True: a response per token (per UTF-8 character); False: one response with the whole text.
    stream: bool = True
    #: ``text_input``'s shape, so ``text_output`` has the same rank ([1] or [1, 1]).
    text_shape: tuple[int, ...] = (1, 1)


def check_headers(inputs: Sequence[InputHeader], requested_outputs: Sequence[str]) -> None:
    """Names, datatypes and element counts, before any payload is decoded; InvalidInput naming the input."""
    seen: set[str] = set()
    for header in inputs:
        accepted = INPUT_DATATYPES.get(header.name)
        if accepted is None:
            raise InvalidInput(f"unknown input '{header.name}'; a generative model takes {list(INPUT_DATATYPES)}")
        if header.name in seen:
            raise InvalidInput(f"input '{header.name}' appears more than once")
        seen.add(header.name)
        if header.datatype not in accepted:
            raise InvalidInput(
                f"input '{header.name}': wrong datatype, expected {' or '.join(accepted)}, "
                f"got {header.datatype or '(empty)'}"
            )
        if any(dim < 0 for dim in header.shape):
            raise InvalidInput(f"input '{header.name}': shape {list(header.shape)} has a negative dimension")
        if header.name in _SCALARS and math.prod(header.shape) != 1:
            raise InvalidInput(
                f"input '{header.name}': needs exactly one value (shape [1] or [1, 1]), got shape {list(header.shape)}"
            )
    for alias, name in _ALIASES.items():
        if alias in seen and name in seen:
            raise InvalidInput(f"inputs '{alias}' and '{name}' are one setting under two names; send one of them")
    for required in (TEXT_INPUT, "max_tokens"):
        if required not in seen:
            raise InvalidInput(f"missing input '{required}'; a generative model needs {TEXT_INPUT} and max_tokens")
    for name in requested_outputs:
        if name not in OUTPUT_NAMES:
            raise InvalidInput(f"unknown requested output '{name}'; a generative model returns {list(OUTPUT_NAMES)}")


def read_request(
    arrays: Mapping[str, np.ndarray], *, max_tokens_limit: int, requested_outputs: Sequence[str] = ()
) -> GenerationRequest:
    """Decoded inputs (headers already checked) → a GenerationRequest; InvalidInput naming a bad value."""
    prompt = bytes(arrays[TEXT_INPUT].reshape(-1)[0])
    try:
        prompt.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = f"byte {error.start} is {prompt[error.start]:#04x}"
        raise InvalidInput(f"input '{TEXT_INPUT}': not UTF-8 text ({bad})") from None
    arrays = {_ALIASES.get(name, name): array for name, array in arrays.items()}
    max_tokens = _integer(arrays, "max_tokens")
    if not 1 <= max_tokens <= max_tokens_limit:
        raise InvalidInput(f"input 'max_tokens': must be between 1 and {max_tokens_limit}, got {max_tokens}")
    if "beam_width" in arrays and (beam_width := _integer(arrays, "beam_width")) != 1:
        raise InvalidInput(f"input 'beam_width': beam search is not supported, beam_width must be 1, got {beam_width}")
    temperature = _number(arrays, "temperature", 0.0)
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidInput(f"input 'temperature': must be a finite number >= 0, got {temperature}")
    top_k = _integer(arrays, "top_k") if "top_k" in arrays else 0
    if top_k < 0:
        raise InvalidInput(f"input 'top_k': must be >= 0 (0: no limit), got {top_k}")
    top_p = _number(arrays, "top_p", 1.0)
    if not 0 <= top_p <= 1:  # NaN fails too
        raise InvalidInput(f"input 'top_p': must be between 0 and 1 (0 or 1: no limit), got {top_p}")
    repetition_penalty = _number(arrays, "repetition_penalty", 1.0)
    if not math.isfinite(repetition_penalty) or repetition_penalty <= 0:
        raise InvalidInput(
            f"input 'repetition_penalty': must be a finite number > 0 (1: no penalty), got {repetition_penalty}"
        )
    seed = _integer(arrays, "random_seed") if "random_seed" in arrays else 0
    if seed < 0:
        raise InvalidInput(f"input 'random_seed' (or 'seed'): must be >= 0, got {seed}")
    end_id = _token(arrays, "end_id")
    pad_id = _token(arrays, "pad_id")
    log_probs = _flag(arrays, "return_log_probs", False)
    for name in requested_outputs:
        if name in _LOG_PROB_OUTPUTS and not log_probs:
            raise InvalidInput(f"requested output '{name}' needs the input 'return_log_probs' set to true")
    return GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p if top_p > 0 else 1.0,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop_words=_words(arrays, "stop_words"),
        bad_words=_words(arrays, "bad_words"),
        end_id=end_id,
        pad_id=pad_id,
        exclude_input=_flag(arrays, "exclude_input_in_output", True),
        log_probs=log_probs,
        stream=_flag(arrays, "stream", True),
        text_shape=tuple(int(dim) for dim in arrays[TEXT_INPUT].shape),
    )


def _integer(arrays: Mapping[str, np.ndarray], name: str) -> int:
    return int(arrays[name].reshape(-1)[0])


def _number(arrays: Mapping[str, np.ndarray], name: str, default: float) -> float:
    return float(arrays[name].reshape(-1)[0]) if name in arrays else default


def _flag(arrays: Mapping[str, np.ndarray], name: str, default: bool) -> bool:
    return bool(arrays[name].reshape(-1)[0]) if name in arrays else default


def _token(arrays: Mapping[str, np.ndarray], name: str) -> int | None:
    if name not in arrays:
        return None
    token = _integer(arrays, name)
    if not 0 <= token < VOCABULARY:
        raise InvalidInput(f"input '{name}': must be a token id between 0 and {VOCABULARY - 1}, got {token}")
    return token


def _words(arrays: Mapping[str, np.ndarray], name: str) -> tuple[bytes, ...]:
    """A word list as TensorRT-LLM's preprocessing reads it: each element holds one or more words,
    comma-separated (CSV: a word with a comma is quoted)."""
    if name not in arrays:
        return ()
    words: list[bytes] = []
    for index, element in enumerate(arrays[name].reshape(-1)):
        try:
            text = bytes(element).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"input '{name}': element {index} is not UTF-8 text") from None
        fields = next(csv.reader([text]), [])
        if not fields or not all(fields):
            raise InvalidInput(f"input '{name}': element {index} has an empty word ({text!r})")
        words.extend(field.encode() for field in fields)
    return tuple(words)


def step_interface(engine: ModelMetadata, source: str) -> tuple[str, str, int]:
    """The next-token graph's input name, output name and context length; ConfigError when it is not one."""
    if len(engine.inputs) != 1 or len(engine.outputs) != 1:
        raise ConfigError(
            f"{source}: generation: needs a graph with one input (INT64 [batch, n]: the last n tokens) and one "
            f"output (FP32 [batch, {VOCABULARY}]: next-token logits), got inputs {list(engine.input_names)} and "
            f"outputs {list(engine.output_names)}"
        )
    tokens, logits = engine.inputs[0], engine.outputs[0]
    if tokens.datatype != "INT64" or len(tokens.shape) != 2 or tokens.shape[1] < 1:
        raise ConfigError(
            f"{source}: generation: input '{tokens.name}' must be INT64 [batch, n] with a fixed n >= 1 (the last n "
            f"tokens), got {tokens.datatype} {list(tokens.shape)}"
        )
    if logits.datatype != "FP32" or len(logits.shape) != 2 or logits.shape[1] != VOCABULARY:
        raise ConfigError(
            f"{source}: generation: output '{logits.name}' must be FP32 [batch, {VOCABULARY}] (one logit per byte), "
            f"got {logits.datatype} {list(logits.shape)}"
        )
    return tokens.name, logits.name, tokens.shape[1]


@dataclass(frozen=True, slots=True)
class Token:
    """One step's result for one sequence. ``text`` None: the generation ended without a new token
    (its end token was picked), ``final`` is then True. ``log_prob``: the token's log-probability,
    when the request asked for them."""

    text: bytes | None
    final: bool
    log_prob: float | None = None


@dataclass(eq=False)
class _Sequence:
    """One generation's state; after admission only the step thread touches it (``cancelled`` aside)."""

    request: GenerationRequest
    context: list[int]
    deliver: Callable[[Token | BaseException], None]
    rng: np.random.Generator
    generated: int = 0
    #: Events handed to the consumer (written by the step thread only) and events the consumer has
    #: finished with (written by the event loop only): their difference is how far it is behind.
    produced: int = 0
    taken: int = 0
    #: Left out of the steps since it reached the window (step thread only, under the condition).
    paused: bool = False
    tail: bytes = b""
    #: The last bytes of the prompt and text, as many as the longest bad word needs to be matched.
    recent: bytes = b""
    #: Tokens in the prompt or the text so far (the repetition penalty applies to them); None: no penalty.
    seen: np.ndarray | None = None
    cancelled: bool = False
    done: bool = False
    admitted_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        request = self.request
        if request.bad_words:
            self.recent = _last(request.prompt, self._recent_size)
        if request.repetition_penalty != 1.0:
            self.seen = np.zeros(VOCABULARY, dtype=np.bool_)
            self.seen[np.frombuffer(request.prompt, dtype=np.uint8)] = True

    @property
    def _recent_size(self) -> int:
        return max(len(word) for word in self.request.bad_words) - 1 if self.request.bad_words else 0

    def pick(self, logits: np.ndarray) -> tuple[int, float | None]:
        """The next token and, when the request asks for log-probabilities, its log-probability under
        the distribution it was picked from (after the repetition penalty, bad words and temperature;
        before top-k and top-p narrow it)."""
        request = self.request
        scores = logits.astype(np.float64)
        if self.seen is not None:
            penalty = request.repetition_penalty
            repeated = scores[self.seen]
            scores[self.seen] = np.where(repeated > 0, repeated / penalty, repeated * penalty)
        if request.bad_words:
            banned = [word[-1] for word in request.bad_words if self.recent.endswith(word[:-1])]
            scores[banned] = -np.inf
        token: int | None = None
        if request.temperature > 0:
            with np.errstate(over="ignore", invalid="ignore"):
                scaled = scores / request.temperature
            # A temperature so close to 0 that the scaled logits overflow is greedy in the limit;
            # sampling from the overflowed values would draw the last token (an invalid UTF-8 byte).
            if np.isfinite(scaled.max()):
                token, scores = self._sample(scaled), scaled
        if token is None:
            token = int(np.argmax(scores))
        if not request.log_probs:
            return token, None
        top = scores.max()
        with np.errstate(invalid="ignore", divide="ignore"):
            log_prob = float(scores[token] - top - np.log(np.sum(np.exp(scores - top))))
        return token, log_prob

    def _sample(self, scaled: np.ndarray) -> int:
        request = self.request
        candidates: np.ndarray | None = None
        if 0 < request.top_k < len(scaled):
            candidates = np.argpartition(scaled, -request.top_k)[-request.top_k :]
            scaled = scaled[candidates]
        weights = np.exp(scaled - scaled.max())
        if request.top_p < 1:
            order = np.argsort(-weights, kind="stable")
            kept = np.cumsum(weights[order])
            nucleus = order[: int(np.searchsorted(kept, request.top_p * kept[-1], side="left")) + 1]
            narrowed = np.zeros_like(weights)
            narrowed[nucleus] = weights[nucleus]
            weights = narrowed
        cumulative = np.cumsum(weights)
        drawn = self.rng.random() * cumulative[-1]
        chosen = min(int(np.searchsorted(cumulative, drawn, side="right")), len(scaled) - 1)
        return int(candidates[chosen]) if candidates is not None else chosen

    def advance(self, token: int, log_prob: float | None = None) -> tuple[Token, str | None]:
        """The event for ``token`` and, when the generation ends with it, why."""
        request = self.request
        if request.end_id is not None and token == request.end_id:
            return Token(text=None, final=True), "end_id"
        self.generated += 1
        self.context.append(token)
        del self.context[0]
        text = bytes((token,))
        if self.seen is not None:
            self.seen[token] = True
        if request.bad_words:
            self.recent = _last(self.recent + text, self._recent_size)
        if request.stop_words:
            longest = max(len(word) for word in request.stop_words)
            self.tail = (self.tail + text)[-longest:]
            if any(self.tail.endswith(word) for word in request.stop_words):
                return Token(text=text, final=True, log_prob=log_prob), "stop_word"
        if self.generated >= request.max_tokens:
            return Token(text=text, final=True, log_prob=log_prob), "length"
        return Token(text=text, final=False, log_prob=log_prob), None


@dataclass(frozen=True, slots=True)
class Reply:
    """What one response carries: text that is whole UTF-8 characters (a byte-level model makes a
    multi-byte character over several tokens: they are held until it is complete; the final reply
    carries whatever is left, complete or not), its tokens' log-probabilities and, on the final reply,
    the token usage."""

    #: None: the generation ended with no text left to send (its end token was picked).
    text: bytes | None
    final: bool
    #: One per token in ``text`` (empty unless the request asked for log-probabilities).
    log_probs: tuple[float, ...] = ()
    #: The sum of the log-probabilities of every token so far.
    cum_log_prob: float = 0.0
    #: Final reply only: tokens of the prompt and tokens generated (the end token is not counted).
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def replies(tokens: AsyncIterator[Token], request: GenerationRequest, *, stream: bool) -> AsyncIterator[Reply]:
    """``tokens`` as responses: with ``stream``, one reply per complete UTF-8 character or run of them
    (tokens that leave a character unfinished make no reply), the last one ``final``; without, one final
    reply with the whole text, preceded by the prompt unless the request excludes it. A streamed answer
    never repeats the prompt (TensorRT-LLM's streamed responses hold new tokens only)."""
    pending = bytearray(request.prompt if not stream and not request.exclude_input else b"")
    log_probs: list[float] = []
    cumulative = 0.0
    completion = 0
    async for token in tokens:
        if token.text is not None:
            completion += 1
            pending += token.text
            if token.log_prob is not None:
                log_probs.append(token.log_prob)
                cumulative += token.log_prob
        if token.final:
            text = bytes(pending) if pending or token.text is not None or not stream else None
            yield Reply(
                text=text,
                final=True,
                log_probs=tuple(log_probs),
                cum_log_prob=cumulative,
                prompt_tokens=len(request.prompt),
                completion_tokens=completion,
            )
            return
        if not stream or token.text is None:
            continue
        whole = len(pending) - _unfinished(pending)
        if whole:
            held = len(pending) - whole
            yield Reply(
                text=bytes(pending[:whole]),
                final=False,
                log_probs=tuple(log_probs[: len(log_probs) - held]),
                cum_log_prob=cumulative - sum(log_probs[len(log_probs) - held :]),
            )
            del pending[:whole]
            del log_probs[: len(log_probs) - held]


def _last(data: bytes, size: int) -> bytes:
    """The last ``size`` bytes of ``data`` (all of it when shorter; none for 0)."""
    return data[max(0, len(data) - size) :]


def _unfinished(data: bytes | bytearray) -> int:
    """How many bytes at the end of ``data`` begin a UTF-8 character without finishing it (0 to 3).
    A byte that can begin no character (or a sequence that is already invalid) is not held: it could
    never be completed."""
    for size in range(1, min(3, len(data)) + 1):
        if data[-size] & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
            try:
                bytes(data[-size:]).decode("utf-8")
            except UnicodeDecodeError as error:
                return size if error.reason == "unexpected end of data" else 0
            return 0
    return 0


class GenerationScheduler:
    """Steps every active sequence in one backend run per step, in a thread of its own.

    Life cycle: :meth:`start` once inside the event loop; :meth:`generate` per request; :meth:`stop`
    once: the running step finishes, every sequence still active or waiting fails ModelNotReady.
    """

    def __init__(
        self,
        run: RunFn,
        *,
        input_name: str,
        output_name: str,
        context: int,
        max_sequences: int,
        pad_id: int,
        metrics: WorkerMetrics,
        logger: structlog.stdlib.BoundLogger,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._window = window
        self._resume_at = window // 2
        self._run = run
        self._input = input_name
        self._output = output_name
        self._context = context
        self._max_sequences = max_sequences
        self._pad_id = pad_id
        self._metrics = metrics
        self._logger = logger
        self._condition = threading.Condition()
        self._waiting: list[_Sequence] = []
        self._active = 0
        self._paused = 0
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._step_forever, name="generation-steps", daemon=True)
        self._thread.start()

    def depth(self) -> int:
        """Sequences waiting to join a step (read from the metrics thread)."""
        return len(self._waiting)

    def active(self) -> int:
        """Sequences being stepped (read from the metrics thread)."""
        return self._active

    def paused(self) -> int:
        """Active sequences left out of the last step because their consumer is behind (read from the
        metrics thread)."""
        return self._paused

    def _runnable(self, sequence: _Sequence) -> bool:
        """Whether ``sequence`` takes part in the next step (step thread only, under the condition, so
        :meth:`generate` sees ``paused`` as it was decided)."""
        if sequence.cancelled:
            return True
        behind = sequence.produced - sequence.taken
        if sequence.paused:
            sequence.paused = behind > self._resume_at
        else:
            sequence.paused = behind >= self._window
        return not sequence.paused

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Token]:
        """The request's tokens as they are made, the last one ``final``. Leaving the iteration early (the
        caller cancelled, or closed it) withdraws the sequence: it leaves at the next step."""
        if self._stopped or self._loop is None:
            raise ModelNotReady("the worker is shutting down")
        queue: asyncio.Queue[Token | BaseException] = asyncio.Queue()
        prompt = list(request.prompt[-self._context :])
        sequence = _Sequence(
            request=request,
            context=[self._pad_id if request.pad_id is None else request.pad_id] * (self._context - len(prompt))
            + prompt,
            deliver=queue.put_nowait,
            rng=np.random.default_rng(request.seed),
        )
        with self._condition:
            self._waiting.append(sequence)
            self._condition.notify()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.final:
                    return
                # The consumer came back for more: it has finished with ``item``.
                sequence.taken += 1
                if sequence.produced - sequence.taken == self._resume_at:
                    self._wake(sequence)  # if it is paused, it may go on; the step thread may be waiting
        finally:
            if not sequence.done:
                sequence.cancelled = True
                self._wake()  # a paused sequence leaves at once, not when some other one steps

    def _wake(self, paused: _Sequence | None = None) -> None:
        """Wake the step thread (only if ``paused`` is, when given). Under the condition, so a sequence
        the step thread pauses after this take is judged on it, and one paused before is woken."""
        with self._condition:
            if paused is None or paused.paused:
                self._condition.notify()

    async def stop(self) -> None:
        with self._condition:
            self._stopped = True
            self._condition.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _step_forever(self) -> None:
        active: list[_Sequence] = []
        while True:
            with self._condition:
                # Wait for a new sequence, or for a paused one to be let go or cancelled (see _wake).
                while not self._stopped and not self._waiting and not any(map(self._runnable, active)):
                    self._paused = len(active)
                    self._condition.wait()
                if self._stopped:
                    self._fail(active + self._waiting, ModelNotReady("the worker is shutting down"))
                    self._waiting.clear()
                    self._active = 0
                    return
                room = self._max_sequences - len(active)
                active.extend(self._waiting[:room])
                del self._waiting[:room]
                stepped = [sequence for sequence in active if self._runnable(sequence)]
            try:
                for sequence in stepped:
                    if sequence.cancelled:
                        self._finish(sequence, "cancelled")
                active = [sequence for sequence in active if not sequence.done]
                stepped = [sequence for sequence in stepped if not sequence.done]
                self._active = len(active)
                self._paused = len(active) - len(stepped)
                if stepped:
                    self._step(stepped)
                    active = [sequence for sequence in active if not sequence.done]
            except Exception:  # a failed step fails its sequences, never the thread every stream waits on
                self._logger.exception("generation step failed", sequences=len(active))
                for sequence in active:
                    if not sequence.done:
                        self._finish(sequence, "error")
                self._fail(active, BackendError("inference failed"))
                active = []
                self._active = 0

    def _step(self, active: list[_Sequence]) -> None:
        """One backend run over ``active``; the sequences it ends are marked done."""
        tokens = np.array([sequence.context for sequence in active], dtype=np.int64)
        began = time.perf_counter()
        logits = self._run({self._input: tokens}, [self._output])[self._output]
        if logits.shape != (len(active), VOCABULARY):
            raise ValueError(f"logits of shape {list(logits.shape)} for {len(active)} sequences")
        seconds = time.perf_counter() - began
        events: list[tuple[_Sequence, Token]] = []
        ended_now = 0
        for row, sequence in enumerate(active):
            token, ended = sequence.advance(*sequence.pick(logits[row]))
            events.append((sequence, token))
            sequence.produced += 1
            if ended is not None:
                self._finish(sequence, ended)
                ended_now += 1
        # Before the tokens are handed over: a client that saw its last token sees the gauge without it.
        self._active -= ended_now
        made = sum(token.text is not None for _, token in events)
        self._metrics.step_ran(sequences=len(active), tokens=made, seconds=seconds)
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
            self._loop.call_soon_threadsafe(_deliver, events)

    def _finish(self, sequence: _Sequence, outcome: str) -> None:
        sequence.done = True
        self._metrics.generation_ended(outcome=outcome, tokens=sequence.generated)
        if outcome == "cancelled":
            self._logger.debug("generation cancelled", tokens=sequence.generated, asked=sequence.request.max_tokens)

    def _fail(self, sequences: list[_Sequence], error: BaseException) -> None:
        if self._loop is None or not sequences:
            return
        failed = [(sequence, error) for sequence in sequences]
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(_deliver, failed)


def _deliver(events: Sequence[tuple[_Sequence, Any]]) -> None:
    """On the event loop: each step's tokens to their consumers, in one callback per step."""
    for sequence, event in events:
        sequence.deliver(event)
