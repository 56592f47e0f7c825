"""Diffing two answers to the same request: the reference (recorded, or ``--compare-to``) and the candidate.

Rules, chosen so a gate means the same thing for every model:

- Integer, bool and BYTES tensors must be equal element for element.
- Float tensors (FP16/FP32/FP64) match element-wise when ``|cand - ref| <= atol + rtol * |ref|``;
  NaN matches NaN, +Inf matches +Inf (and nothing else), so a model that legitimately
  outputs them does not read as drifting. ``max_abs_error`` is taken over elements finite
  on both sides; non-finite disagreements are counted apart.
- Float outputs whose last axis has more than one element are also read as class scores:
  per row, whether the argmax agrees and whether the top-k sets agree. These are reported
  (and gateable) but do not make a call mismatch by themselves.
- A missing or extra output, a shape or dtype change, or a response that does not decode is
  a mismatch of that output with a reason, never an exception.
- Status: OK vs an error (either way), or two different error codes, is a status change,
  counted apart from output mismatches; the same error on both sides is a match.
- Outputs the recorder redacted (dropped, or kept with zeroed data) in a recorded reference are
  left out on both sides and listed as not compared: the recorded values are not what the model
  answered. A live reference (``--compare-to``) is compared whole.
- A recorded reference whose response the router left out for size (tag ``splitstream.payload-dropped``)
  has no values to compare: the call's status is still compared, its outputs are all listed as not
  compared, and a call both sides answered OK is ``not_compared``, neither a match nor a mismatch, so
  it weighs in no mismatch rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.records import status_name

FLOAT_DATATYPES = frozenset({"FP16", "FP32", "FP64"})


@dataclass(frozen=True, slots=True)
class Tolerance:
    rtol: float = 1e-5
    atol: float = 1e-6
    top_k: int = 5

    def __post_init__(self) -> None:
        if not (0 <= self.rtol < math.inf and 0 <= self.atol < math.inf):  # NaN fails this too
            raise ValueError("--rtol and --atol must be finite and not negative")
        if self.top_k < 1:
            raise ValueError("--top-k must be at least 1")


#: Why an output was not compared: the recorder redacted it in the recorded reference.
REDACTED_AT_RECORDING = "redacted_at_recording"
#: Why outputs were not compared: the recorded reference has no response (left out for size).
RESPONSE_NOT_RECORDED = "response_not_recorded"


@dataclass(frozen=True, slots=True)
class Answer:
    """One side of a comparison: the gRPC status code and, when OK, the serialized response."""

    code: int
    response: bytes | None = None
    #: Outputs whose values in ``response`` are not the model's (redacted at recording): never compared.
    redacted: frozenset[str] = frozenset()
    #: False when the call was answered OK but its response was left out of the record for size.
    response_recorded: bool = True


@dataclass(frozen=True, slots=True)
class OutputDiff:
    name: str
    match: bool
    #: Why it does not match (``values``, ``shape``, ``dtype``, ``missing``, ``extra``, ``undecodable``) or "".
    reason: str
    elements: int
    mismatches: int
    max_abs_error: float | None
    nonfinite_mismatches: int = 0
    argmax_agreement: float | None = None
    topk_agreement: float | None = None
    detail: str = ""

    @property
    def mismatch_rate(self) -> float:
        return self.mismatches / self.elements if self.elements else (0.0 if self.match else 1.0)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "match": self.match,
            "elements": self.elements,
            "mismatches": self.mismatches,
            "mismatch_rate": round(self.mismatch_rate, 6),
            "max_abs_error": self.max_abs_error,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.nonfinite_mismatches:
            out["nonfinite_mismatches"] = self.nonfinite_mismatches
        if self.argmax_agreement is not None:
            out["argmax_agreement"] = round(self.argmax_agreement, 6)
        if self.topk_agreement is not None:
            out["topk_agreement"] = round(self.topk_agreement, 6)
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True, slots=True)
class CallDiff:
    #: ``match``, ``mismatch`` (an output differs), ``status_change``, or ``not_compared`` (both answered
    #: OK and the recorded response is not there to compare with).
    outcome: str
    reference_code: int
    candidate_code: int
    outputs: tuple[OutputDiff, ...] = ()
    #: Outputs left out (only when both sides answered OK), all for the one reason ``not_compared_why``.
    not_compared: tuple[str, ...] = ()
    not_compared_why: str = REDACTED_AT_RECORDING
    #: How the two statuses are written when they are not gRPC codes (an HTTP call's ``("200", "401")``).
    status_labels: tuple[str, str] | None = None

    @property
    def status_change(self) -> str | None:
        """``"OK->INVALID_ARGUMENT"``-style transition (``"200->401"`` for HTTP), or None when the status stayed."""
        if self.reference_code == self.candidate_code:
            return None
        if self.status_labels is not None:
            return "->".join(self.status_labels)
        return f"{status_name(self.reference_code)}->{status_name(self.candidate_code)}"

    @property
    def status_change_kind(self) -> str | None:
        if self.reference_code == self.candidate_code:
            return None
        if self.reference_code == 0:
            return "ok_to_error"
        return "error_to_ok" if self.candidate_code == 0 else "error_to_other_error"

    def severity(self) -> tuple[int, float, float]:
        """Sort key for "worst calls": status changes first, then the share of mismatched elements, then error size."""
        if self.outcome == "status_change":
            return (2, 1.0, 0.0)
        rate = max((o.mismatch_rate for o in self.outputs), default=0.0)
        error = max((o.max_abs_error or 0.0 for o in self.outputs), default=0.0)
        return (1 if self.outcome == "mismatch" else 0, rate, error)


def compare_answers(reference: Answer, candidate: Answer, tolerance: Tolerance) -> CallDiff:
    if reference.code != candidate.code:
        return CallDiff("status_change", reference.code, candidate.code)
    if reference.code != 0:
        return CallDiff("match", reference.code, candidate.code)
    if not (reference.response_recorded and candidate.response_recorded):
        answered = reference.response if reference.response_recorded else candidate.response
        return CallDiff("not_compared", 0, 0, (), _output_names(answered), RESPONSE_NOT_RECORDED)
    skip = reference.redacted | candidate.redacted
    not_compared = tuple(sorted(skip))
    identical = _identical_outputs(reference.response, candidate.response, skip)
    if identical is not None:
        return CallDiff("match", 0, 0, identical, not_compared)
    ref_outputs, ref_problem = _decode(reference.response, skip)
    cand_outputs, cand_problem = _decode(candidate.response, skip)
    if ref_problem or cand_problem:
        diff = OutputDiff(
            name="*",
            match=False,
            reason="undecodable",
            elements=0,
            mismatches=0,
            max_abs_error=None,
            detail=f"{'reference' if ref_problem else 'candidate'} response: {ref_problem or cand_problem}",
        )
        return CallDiff("mismatch", 0, 0, (diff,), not_compared)
    diffs = [compare_output(name, ref_outputs[name], cand_outputs.get(name), tolerance) for name in ref_outputs]
    for name in cand_outputs:
        if name not in ref_outputs:
            array = cand_outputs[name][1]
            diffs.append(OutputDiff(name, False, "extra", array.size, array.size, None, detail="not in the reference"))
    outcome = "match" if all(d.match for d in diffs) else "mismatch"
    return CallDiff(outcome, 0, 0, tuple(diffs), not_compared)


Tensor = tuple[str, np.ndarray]  # (protocol datatype, array)


def compare_output(name: str, reference: Tensor, candidate: Tensor | None, tolerance: Tolerance) -> OutputDiff:
    ref_type, ref = reference
    if candidate is None:
        return OutputDiff(name, False, "missing", ref.size, ref.size, None, detail="not in the candidate")
    cand_type, cand = candidate
    if ref_type != cand_type:
        return OutputDiff(name, False, "dtype", ref.size, ref.size, None, detail=f"{ref_type} -> {cand_type}")
    if ref.shape != cand.shape:
        return OutputDiff(
            name, False, "shape", ref.size, ref.size, None, detail=f"{list(ref.shape)} -> {list(cand.shape)}"
        )
    if ref_type in FLOAT_DATATYPES:
        return _compare_floats(name, ref, cand, tolerance)
    if ref_type == "BYTES":
        unequal = np.array([a != b for a, b in zip(ref.reshape(-1), cand.reshape(-1), strict=True)], dtype=bool)
        count = int(unequal.sum())
        return OutputDiff(name, count == 0, "values" if count else "", ref.size, count, None)
    unequal = ref != cand
    count = int(np.count_nonzero(unequal))
    max_error: float | None = None
    if ref_type != "BOOL" and ref.size:
        max_error = float(np.max(np.abs(ref.astype(np.float64) - cand.astype(np.float64))))
    return OutputDiff(name, count == 0, "values" if count else "", ref.size, count, max_error)


def _compare_floats(name: str, ref: np.ndarray, cand: np.ndarray, tolerance: Tolerance) -> OutputDiff:
    a = ref.astype(np.float64)
    b = cand.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        close = np.isclose(b, a, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True)
        finite = np.isfinite(a) & np.isfinite(b)
        errors = np.abs(a - b)
    count = int(np.count_nonzero(~close))
    nonfinite = int(np.count_nonzero(~close & ~finite))
    max_error = float(errors[finite].max()) if finite.any() else 0.0
    argmax = topk = None
    if a.ndim >= 1 and a.shape[-1] > 1 and a.size:
        rows_a = a.reshape(-1, a.shape[-1])
        rows_b = b.reshape(-1, b.shape[-1])
        argmax = float(np.mean(_argmax(rows_a) == _argmax(rows_b)))
        k = min(tolerance.top_k, a.shape[-1])
        top_a = np.sort(_top_k(rows_a, k), axis=1)
        top_b = np.sort(_top_k(rows_b, k), axis=1)
        topk = float(np.mean(np.all(top_a == top_b, axis=1)))
    return OutputDiff(
        name,
        count == 0,
        "values" if count else "",
        a.size,
        count,
        max_error,
        nonfinite_mismatches=nonfinite,
        argmax_agreement=argmax,
        topk_agreement=topk,
    )


def _argmax(rows: np.ndarray) -> np.ndarray:
    # NaN never wins a class: treat it as the lowest score.
    return np.argmax(np.nan_to_num(rows, nan=-np.inf), axis=1)


def _top_k(rows: np.ndarray, k: int) -> np.ndarray:
    scores = np.nan_to_num(rows, nan=-np.inf)
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def _identical_outputs(
    reference: bytes | None, candidate: bytes | None, skip: frozenset[str] = frozenset()
) -> tuple[OutputDiff, ...] | None:
    """The diff of two responses whose outputs (but those in ``skip``) are byte for byte the same, without
    decoding a tensor (the common case of a replay against the version that answered, and most of a
    replay's CPU otherwise); None when they differ anywhere or do not parse, so the full comparison decides."""
    if reference is None or candidate is None:
        return None
    try:
        ref = oip.ModelInferResponse.FromString(reference) if reference != candidate else None
        cand = oip.ModelInferResponse.FromString(candidate)
    except Exception:  # DecodeError: the full comparison reports it
        return None
    ref = ref or cand
    if (
        not cand.raw_output_contents
        or len(ref.raw_output_contents) != len(ref.outputs)
        or len(cand.raw_output_contents) != len(cand.outputs)
    ):
        return None
    kept_ref = _kept(ref, skip)
    kept_cand = _kept(cand, skip)
    if [(o.name, o.datatype, list(o.shape), raw) for o, raw in kept_ref] != [
        (o.name, o.datatype, list(o.shape), raw) for o, raw in kept_cand
    ]:
        return None
    diffs = []
    for output, _ in kept_cand:
        elements = tensors.element_count(output.shape)
        scores = output.datatype in FLOAT_DATATYPES and len(output.shape) >= 1 and output.shape[-1] > 1
        diffs.append(
            OutputDiff(
                output.name,
                True,
                "",
                elements,
                0,
                None if output.datatype in ("BOOL", "BYTES") else 0.0,
                argmax_agreement=1.0 if scores and elements else None,
                topk_agreement=1.0 if scores and elements else None,
            )
        )
    return tuple(diffs)


def _kept(
    response: oip.ModelInferResponse, skip: frozenset[str]
) -> list[tuple[oip.ModelInferResponse.InferOutputTensor, bytes]]:
    """(output, raw slot) pairs of a response whose raw slots line up with its outputs, but those in ``skip``."""
    pairs = zip(response.outputs, response.raw_output_contents, strict=True)
    return [(output, raw) for output, raw in pairs if output.name not in skip]


def _output_names(response: bytes | None) -> tuple[str, ...]:
    """The names of the response's outputs, sorted (none when it does not parse): what was not compared."""
    try:
        return tuple(sorted({output.name for output in oip.ModelInferResponse.FromString(response or b"").outputs}))
    except DecodeError:  # nothing to name
        return ()


def _decode(response: bytes | None, skip: frozenset[str] = frozenset()) -> tuple[dict[str, Tensor], str]:
    """The response's outputs (but those in ``skip``) as ``{name: (datatype, array)}``, or ``({}, why)``
    when it cannot be read."""
    if response is None:
        return {}, "no response bytes"
    try:
        message = oip.ModelInferResponse.FromString(response)
        arrays = tensors.output_arrays(message)
    except Exception as error:  # DecodeError, InvalidInput (bad raw lengths, unknown dtype): report, never crash
        return {}, f"{type(error).__name__}: {error}"
    datatypes = {output.name: output.datatype for output in message.outputs}
    return {name: (datatypes[name], array) for name, array in arrays.items() if name not in skip}, ""


def decode_outputs(response: bytes | None, skip: frozenset[str] = frozenset()) -> tuple[dict[str, Tensor], str]:
    """The response's outputs but those in ``skip``, or ``({}, why)``: for the noise floor's element differences."""
    return _decode(response, skip)
