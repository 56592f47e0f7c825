"""Diffing two answers to one recorded HTTP call: the reference (recorded, or ``--compare-to``) and the
candidate (the replay).

What a user relies on an HTTP answer for decides what is compared:

- **Generated text** (``chat``, ``completion``, Triton's ``generate`` and ``generate-stream``): the text the
  client read, whether it came as one body or as server-sent events (OpenAI's ``message.content``,
  ``delta.content`` or ``text``, choices in index order; Triton's ``text_output``). Events are chunked as
  the server pleases (a router and an upstream cut them differently), so texts are compared as text: exact
  match, the first divergence as a character offset, and the normalized edit distance (Levenshtein over
  the longer text, 0: same, 1: nothing in common). An event that is an error object counts as an error
  message, compared like a token stream's. A reference recorded ``truncated`` (the per-call cap) or 499 (the
  client left) holds a prefix only: the candidate's text is cut to its length, and a 499's status is not
  compared.
- **KServe v2 infer**: the JSON answer's ``outputs`` by name: datatype, shape, and data, floats within
  ``--rtol``/``--atol`` as the gRPC tensors are (NaN equal to NaN); ids, model name and version are the
  target's own and left out. A body that is no JSON (Triton's binary tensor extension) is compared byte for
  byte.
- **Anything else**: the body byte for byte.
- **Status**: different HTTP statuses are a status change (``200->401``), counted apart like gRPC's; the
  same error status on both sides is a match.
- **Usage** (prompt and completion tokens as the answers reported them): compared when the reference
  reported some. A candidate that reported none, or other numbers, is a usage mismatch. It is counted
  apart (``usage_mismatch_rate``) and does not make the call a mismatch: the text is what the call is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitstream.replayer.compare import FLOAT_DATATYPES, Tolerance
from splitstream.replayer.stream_compare import StreamDiff, compare_texts

TEXT_APIS = frozenset({"chat", "completion", "generate", "generate-stream"})
#: The HTTP status the router records for a client that went away: what it recorded is a prefix.
CLIENT_LEFT = 499
#: Why a recorded answer was not compared: its body or events are not in the record.
RESPONSE_NOT_RECORDED = "response_not_recorded"


def status_code(status: int) -> int:
    """An HTTP status as the replay's outcome code: 0 for success, else the status itself."""
    return 0 if 200 <= status < 300 else status


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """One side: the HTTP status, a whole body or each event's data with its time from the request (s)."""

    status: int
    body: bytes | None = None
    events: tuple[bytes, ...] = ()
    event_times_s: tuple[float, ...] = ()
    #: Time to the first event carrying text (None: none did, or the answer was not streamed).
    ttft_s: float | None = None
    #: (prompt tokens, completion tokens) as the answer reported them.
    usage: tuple[int, int] | None = None
    #: Holds only the start of its answer (recorded truncated, or the client left).
    prefix_only: bool = False
    #: False when the answer's body and events are not in the record (dropped for size, or redacted).
    recorded: bool = True


@dataclass(frozen=True, slots=True)
class Text:
    """An answer's generated text, and the pieces it came in (one per event carrying text) with their times."""

    text: str
    pieces: tuple[str, ...]
    times_s: tuple[float, ...]
    errors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class UsageDiff:
    reference: tuple[int, int] | None
    candidate: tuple[int, int] | None

    @property
    def compared(self) -> bool:
        return self.reference is not None

    @property
    def match(self) -> bool:
        return self.reference == self.candidate

    def as_dict(self) -> dict[str, Any]:
        def side(usage: tuple[int, int] | None) -> dict[str, int] | None:
            return None if usage is None else {"prompt_tokens": usage[0], "completion_tokens": usage[1]}

        return {"reference": side(self.reference), "candidate": side(self.candidate), "match": self.match}


@dataclass(frozen=True, slots=True)
class HttpDiff:
    #: ``match``, ``mismatch``, ``status_change`` or ``not_compared``.
    outcome: str
    reference_status: int
    candidate_status: int
    usage: UsageDiff
    #: The text comparison of a generating call (None for other calls, or when not compared).
    text: StreamDiff | None = None
    #: Why two bodies differ ("" when they do not, or were not compared).
    body_difference: str = ""
    not_compared_why: str = ""


def read_text(api: str, answer: HttpAnswer) -> Text:
    """The generated text of an answer (rules in the module docstring)."""
    if answer.body is not None:
        chunk = _json(answer.body)
        errors = _errors(chunk)
        text = "".join(_pieces(api, chunk, streamed=False))
        return Text(text, (text,) if text else (), (), errors)
    pieces: list[str] = []
    times: list[float] = []
    errors_seen: list[str] = []
    for position, data in enumerate(answer.events):
        chunk = _json(data)
        errors_seen += _errors(chunk)
        piece = "".join(_pieces(api, chunk, streamed=True))
        if piece:
            pieces.append(piece)
            if position < len(answer.event_times_s):
                times.append(answer.event_times_s[position])
    return Text("".join(pieces), tuple(pieces), tuple(times), tuple(errors_seen))


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:  # "[DONE]", or no JSON at all
        return None


def _errors(chunk: Any) -> tuple[str, ...]:
    if isinstance(chunk, dict) and "error" in chunk:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        return (str(message),)
    return ()


def _pieces(api: str, chunk: Any, *, streamed: bool) -> list[str]:
    if not isinstance(chunk, dict):
        return []
    if api in ("generate", "generate-stream"):
        text = chunk.get("text_output")
        return [text] if isinstance(text, str) else []
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return []
    ordered = sorted(
        (choice for choice in choices if isinstance(choice, dict)),
        key=lambda choice: choice.get("index", 0) if isinstance(choice.get("index"), int) else 0,
    )
    out = []
    for choice in ordered:
        if api == "chat":
            holder = choice.get("delta") if streamed else choice.get("message")
            text = holder.get("content") if isinstance(holder, dict) else None
        else:
            text = choice.get("text")
        if isinstance(text, str):
            out.append(text)
    return out


def reported_usage(answer: HttpAnswer) -> tuple[int, int] | None:
    """The usage an answer reported: a whole body's, or the last event's that has one (OpenAI's ``usage``;
    Triton's generate puts ``prompt_tokens`` and ``completion_tokens`` beside ``text_output``)."""
    bodies = [answer.body] if answer.body is not None else list(reversed(answer.events))
    for body in bodies:
        chunk = _json(body)
        usage = chunk.get("usage", chunk) if isinstance(chunk, dict) else None
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                return prompt, completion
    return None


def compare_http(api: str, reference: HttpAnswer, candidate: HttpAnswer, tolerance: Tolerance) -> HttpDiff:
    """Compare two answers to one recorded HTTP call (rules in the module docstring)."""
    usage = UsageDiff(reference.usage, candidate.usage)
    left = reference.status == CLIENT_LEFT
    ref_code, cand_code = status_code(reference.status), status_code(candidate.status)
    if ref_code != cand_code and not left:
        return HttpDiff("status_change", reference.status, candidate.status, usage)
    if ref_code != 0 and not left:  # the same error on both sides
        return HttpDiff("match", reference.status, candidate.status, usage)
    if not reference.recorded:
        return HttpDiff(
            "not_compared", reference.status, candidate.status, usage, not_compared_why=RESPONSE_NOT_RECORDED
        )
    if api in TEXT_APIS:
        ref, cand = read_text(api, reference), read_text(api, candidate)
        text = compare_texts(
            ref.text,
            cand.text,
            reference_pieces=len(ref.pieces),
            candidate_pieces=len(cand.pieces),
            prefix=reference.prefix_only or left,
            reference_errors=ref.errors,
            candidate_errors=cand.errors,
        )
        return HttpDiff(text.outcome, reference.status, candidate.status, usage, text=text)
    difference = _body_difference(api, reference, candidate, tolerance)
    outcome = "mismatch" if difference else "match"
    return HttpDiff(outcome, reference.status, candidate.status, usage, body_difference=difference)


def _body_difference(api: str, reference: HttpAnswer, candidate: HttpAnswer, tolerance: Tolerance) -> str:
    ref_body = reference.body if reference.body is not None else b"\n\n".join(reference.events)
    cand_body = candidate.body if candidate.body is not None else b"\n\n".join(candidate.events)
    if ref_body == cand_body:
        return ""
    if api == "kserve-infer":
        ref_json, cand_json = _json(ref_body), _json(cand_body)
        if isinstance(ref_json, dict) and isinstance(cand_json, dict):
            return _outputs_difference(ref_json, cand_json, tolerance)
    return f"bodies differ ({len(ref_body)} vs {len(cand_body)} bytes)"


def _outputs_difference(reference: dict[str, Any], candidate: dict[str, Any], tolerance: Tolerance) -> str:
    """Why two KServe v2 JSON answers' outputs differ ("" when they agree), output by output."""
    ref_outputs = _outputs_by_name(reference)
    cand_outputs = _outputs_by_name(candidate)
    problems = []
    for name, ref in ref_outputs.items():
        cand = cand_outputs.get(name)
        if cand is None:
            problems.append(f"{name}: missing")
        elif ref.get("datatype") != cand.get("datatype"):
            problems.append(f"{name}: dtype {ref.get('datatype')} vs {cand.get('datatype')}")
        elif ref.get("shape") != cand.get("shape"):
            problems.append(f"{name}: shape {ref.get('shape')} vs {cand.get('shape')}")
        elif not _same_data(str(ref.get("datatype")), ref.get("data"), cand.get("data"), tolerance):
            problems.append(f"{name}: values")
    problems += [f"{name}: extra" for name in cand_outputs if name not in ref_outputs]
    return "; ".join(problems)


def _outputs_by_name(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    outputs = answer.get("outputs")
    if not isinstance(outputs, list):
        return {}
    return {str(o.get("name")): o for o in outputs if isinstance(o, dict)}


def _same_data(datatype: str, reference: Any, candidate: Any, tolerance: Tolerance) -> bool:
    if datatype not in FLOAT_DATATYPES:
        return bool(reference == candidate)
    try:
        ref = np.asarray(reference, dtype=np.float64).reshape(-1)
        cand = np.asarray(candidate, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return bool(reference == candidate)
    if ref.shape != cand.shape:
        return False
    return bool(np.allclose(cand, ref, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True)) and not any(
        math.isinf(a) and a != b for a, b in zip(ref.tolist(), cand.tolist(), strict=True)
    )
