"""Diffing two token streams answering the same recorded stream: the reference (recorded, or
``--compare-to``) and the candidate (the replay).

A stream's answer is read as a sequence of tokens, one per response that carries outputs, in the
order the responses arrived: the ``text_output`` element's bytes when the response has that output
(TensorRT-LLM's ensemble, our generating worker), otherwise the response's raw output bytes. An
empty final response (``triton_enable_empty_final_response``) carries no token. A response with
``error_message`` (a failed request of a decoupled stream) is no token: its message is kept apart,
and two streams whose error messages differ do not match.

Rules:

- Tokens are taken request by request: a stream carrying several requests (each response names
  its request in ``id``) may interleave their responses differently on replay, so the candidate's
  are put in the order the reference's requests first answered; within a request, arrival order.
- Exact match: same tokens, in the same order, and the same error messages. The first divergence
  is the index of the first token that differs, or the shorter length when one is a prefix of the
  other; None when they match.
- Edit distance: Levenshtein distance of the token sequences over the longer length (0: same,
  1: nothing in common), from ``rapidfuzz``, which takes sequences of any hashable items. When the
  tokens are ``text_output`` bytes the decoded texts are compared too (UTF-8; bytes that are no
  UTF-8 are read as U+FFFD, so one bad byte is one differing character, never an exception).
- A reference recorded ``truncated`` (the per-stream cap cut it) or CANCELLED (the client left)
  holds only a prefix of what its stream answered: the candidate's tokens are compared up to the
  reference's length, and a CANCELLED reference's status is not compared (the replay ends the
  stream itself once it has that many responses, so its status says nothing either).
- Status: different final statuses are a status change, counted apart like unary calls'.
- A reference whose ``text_output`` the recorder redacted has no tokens to compare: ``not_compared``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from rapidfuzz.distance import Levenshtein

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip

TEXT_OUTPUT = "text_output"
#: gRPC's CANCELLED: the client left the recorded stream; what was recorded is a prefix.
CANCELLED = 1
#: Characters of each text kept in a diff for the report's examples.
EXAMPLE_CHARS = 400


@dataclass(frozen=True, slots=True)
class StreamAnswer:
    """One side of a stream comparison.

    ``response_times_s`` are the responses' times from the stream's start (its first request), one
    per entry of ``responses``; ``prefix_only`` marks a side that holds only the start of its stream."""

    code: int
    responses: tuple[bytes, ...] = ()
    response_times_s: tuple[float, ...] = ()
    #: Time to the first response, from the stream's start; None when none came.
    ttft_s: float | None = None
    prefix_only: bool = False
    redacted: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Tokens:
    """A stream's answer read as tokens (see the module docstring)."""

    tokens: tuple[bytes, ...]
    errors: tuple[str, ...]
    #: True when every token came from ``text_output``: the tokens are text, and the texts are compared.
    text: bool
    undecodable: int = 0
    #: The tokens of each request of the stream (by the responses' ``id``), requests in order of first response.
    by_request: tuple[tuple[str, tuple[bytes, ...]], ...] = ()

    def ordered_as(self, reference: Tokens) -> tuple[bytes, ...]:
        """These tokens, request by request in the order ``reference``'s requests first answered (then any
        request the reference has not): two requests of one stream answered at once interleave their
        responses differently from run to run, and that is no divergence of either's text."""
        if len(self.by_request) <= 1 and len(reference.by_request) <= 1:
            return self.tokens
        mine = dict(self.by_request)
        order = [request for request, _ in reference.by_request if request in mine]
        order += [request for request, _ in self.by_request if request not in order]
        return tuple(token for request in order for token in mine[request])


def read_tokens(responses: Iterable[bytes], skip: frozenset[str] = frozenset()) -> Tokens:
    """The tokens of serialized ``ModelStreamInferResponse`` messages; outputs in ``skip`` are left out."""
    tokens: list[bytes] = []
    errors: list[str] = []
    by_request: dict[str, list[bytes]] = {}
    text = True
    undecodable = 0
    for raw in responses:
        try:
            message = oip.ModelStreamInferResponse.FromString(raw)
        except DecodeError:
            undecodable += 1
            continue
        if message.error_message:
            errors.append(message.error_message)
            continue
        response = message.infer_response
        names = [output.name for output in response.outputs if output.name not in skip]
        if not names:
            continue
        token = _text_output(response) if TEXT_OUTPUT in names else None
        if token is None:
            text = False
            token = b"".join(_raw_outputs(response, skip))
        tokens.append(token)
        by_request.setdefault(response.id, []).append(token)
    return Tokens(
        tuple(tokens),
        tuple(errors),
        text and bool(tokens),
        undecodable,
        tuple((request, tuple(kept)) for request, kept in by_request.items()),
    )


def _text_output(response: oip.ModelInferResponse) -> bytes | None:
    """The bytes of ``text_output``'s elements joined (None when the tensor does not decode)."""
    try:
        array = tensors.output_arrays(response)[TEXT_OUTPUT]
    except Exception:  # InvalidInput: bad raw lengths; the raw bytes then stand for the token
        return None
    return b"".join(bytes(item) for item in array.reshape(-1))


def _raw_outputs(response: oip.ModelInferResponse, skip: frozenset[str]) -> list[bytes]:
    if len(response.raw_output_contents) == len(response.outputs):
        pairs = zip(response.outputs, response.raw_output_contents, strict=True)
        return [output.name.encode() + b"=" + raw for output, raw in pairs if output.name not in skip]
    return [output.SerializeToString() for output in response.outputs if output.name not in skip]


@dataclass(frozen=True, slots=True)
class StreamDiff:
    #: ``match``, ``mismatch``, ``status_change`` or ``not_compared``.
    outcome: str
    reference_code: int
    candidate_code: int
    #: Tokens of the reference compared (after cutting the candidate to a prefix reference's length).
    reference_tokens: int = 0
    candidate_tokens: int = 0
    first_divergence: int | None = None
    #: Normalized Levenshtein distance of the token sequences (None when not compared).
    edit_distance: float | None = None
    text_edit_distance: float | None = None
    reference_text: str = ""
    candidate_text: str = ""
    prefix_compared: bool = False
    reference_errors: tuple[str, ...] = ()
    candidate_errors: tuple[str, ...] = ()
    not_compared_why: str = ""
    #: The token sequences compared (token streams only; the noise floor reads them position by position).
    reference_sequence: tuple[bytes, ...] = ()
    candidate_sequence: tuple[bytes, ...] = ()

    @property
    def exact(self) -> bool:
        return self.outcome == "match"

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "reference_tokens": self.reference_tokens,
            "candidate_tokens": self.candidate_tokens,
            "first_divergence": self.first_divergence,
            "edit_distance": None if self.edit_distance is None else round(self.edit_distance, 6),
        }
        if self.text_edit_distance is not None:
            out["text_edit_distance"] = round(self.text_edit_distance, 6)
        if self.outcome == "mismatch" and (self.reference_text or self.candidate_text):
            out["reference_text"] = self.reference_text
            out["candidate_text"] = self.candidate_text
        if self.prefix_compared:
            out["prefix_compared"] = True
        if self.reference_errors or self.candidate_errors:
            out["reference_errors"] = list(self.reference_errors)
            out["candidate_errors"] = list(self.candidate_errors)
        if self.not_compared_why:
            out["not_compared"] = self.not_compared_why
        return out


def first_divergence(reference: Sequence[bytes], candidate: Sequence[bytes]) -> int | None:
    """Index of the first token that differs (the shorter length when one is a prefix of the other)."""
    for index, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return index
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def compare_streams(reference: StreamAnswer, candidate: StreamAnswer) -> StreamDiff:
    """Compare two answers to one recorded stream (rules in the module docstring)."""
    cancelled = reference.code == CANCELLED
    if reference.code != candidate.code and not cancelled:
        return StreamDiff("status_change", reference.code, candidate.code)
    if TEXT_OUTPUT in reference.redacted:
        return StreamDiff("not_compared", reference.code, candidate.code, not_compared_why="redacted_at_recording")
    skip = reference.redacted
    ref = read_tokens(reference.responses, skip)
    cand = read_tokens(candidate.responses, skip)
    prefix = reference.prefix_only or cancelled
    ref_tokens = ref.ordered_as(ref)
    ordered = cand.ordered_as(ref)
    cand_tokens = ordered[: len(ref_tokens)] if prefix else ordered
    divergence = first_divergence(ref_tokens, cand_tokens)
    errors_differ = ref.errors != (cand.errors[: len(ref.errors)] if prefix else cand.errors)
    if divergence is None and errors_differ:
        divergence = len(ref_tokens)
    edit = Levenshtein.normalized_distance(list(ref_tokens), list(cand_tokens))
    text_edit = None
    ref_text = cand_text = ""
    if ref.text or cand.text or not (ref_tokens or cand_tokens):
        ref_text = b"".join(ref_tokens).decode("utf-8", errors="replace")
        cand_text = b"".join(cand_tokens).decode("utf-8", errors="replace")
        text_edit = Levenshtein.normalized_distance(ref_text, cand_text)
    return StreamDiff(
        "match" if divergence is None else "mismatch",
        reference.code,
        candidate.code,
        reference_tokens=len(ref_tokens),
        candidate_tokens=len(cand_tokens),
        first_divergence=divergence,
        edit_distance=edit,
        text_edit_distance=text_edit,
        reference_text=ref_text[:EXAMPLE_CHARS],
        candidate_text=cand_text[:EXAMPLE_CHARS],
        prefix_compared=prefix,
        reference_errors=ref.errors,
        candidate_errors=cand.errors,
        reference_sequence=ref_tokens,
        candidate_sequence=cand_tokens,
    )


def gaps_s(times_s: Sequence[float]) -> list[float]:
    """Inter-token gaps: between consecutive response times."""
    return [later - earlier for earlier, later in itertools.pairwise(times_s)]


def compare_texts(
    reference: str,
    candidate: str,
    *,
    reference_pieces: int,
    candidate_pieces: int,
    prefix: bool,
    reference_errors: tuple[str, ...] = (),
    candidate_errors: tuple[str, ...] = (),
) -> StreamDiff:
    """Compare two generated texts as text (an HTTP answer's: its events are cut where the server pleases,
    so pieces are counted but not compared). ``first_divergence`` is a character offset; both edit distances
    are the texts'. ``prefix``: the reference holds only the start of its answer, so the candidate is cut to
    its length."""
    compared = candidate[: len(reference)] if prefix else candidate
    divergence = None
    if reference != compared:
        common = next((i for i, (a, b) in enumerate(zip(reference, compared, strict=False)) if a != b), None)
        divergence = common if common is not None else min(len(reference), len(compared))
    errors_differ = reference_errors != (candidate_errors[: len(reference_errors)] if prefix else candidate_errors)
    if divergence is None and errors_differ:
        divergence = len(reference)
    edit = Levenshtein.normalized_distance(reference, compared)
    return StreamDiff(
        "match" if divergence is None else "mismatch",
        0,
        0,
        reference_tokens=reference_pieces,
        candidate_tokens=candidate_pieces,
        first_divergence=divergence,
        edit_distance=edit,
        text_edit_distance=edit,
        reference_text=reference[:EXAMPLE_CHARS],
        candidate_text=compared[:EXAMPLE_CHARS],
        prefix_compared=prefix,
        reference_errors=reference_errors,
        candidate_errors=candidate_errors,
    )
