"""The noise floor (``--noise-from VERSION`` / ``--noise-target ADDR``): differences beyond what the control shows
against itself.

A model compared with itself already differs (batching and kernels reorder float sums, sampled generation
differs every run), so a fixed ``--rtol/--atol`` either floods a report with noise or hides real changes.
As in Diffy (primary, secondary, candidate), each call also goes to a second pass of the control, and the
control-vs-reference differences set a floor per output field that the candidate's are judged against:

- **Tensors**, per output name: every element's absolute difference ``|control - reference|`` goes into a
  histogram (:class:`DiffHistogram`, 100 log bins a decade, exact zeros apart), and so does every
  ``|candidate - reference|``. The floor is the upper edge of the bin holding the control's ``quantile``
  (0.999) quantile. The candidate is *above the floor* when the share of its elements beyond the floor is
  larger than the control's own share with confidence: the lower bound of the Newcombe (hybrid score,
  method 10) interval for the difference of the two proportions is above 0. Because the floor is a bin
  edge, both counts beyond it are exact, not interpolated. Over F judged fields each interval is at
  ``1 - 0.01 / F`` (Bonferroni): at most 1 % of runs of a control against itself show any field above. A
  difference in shape, dtype or presence, or a non-finite disagreement, counts as infinitely large.
- **Generated text** (token streams, HTTP calls): sampled generation differs every run, so sequences are not
  compared against a floor; the rate at which the candidate's texts differ from the reference is compared
  with the control's own rate, with the same interval, one call one trial.
- **Token positions** (token streams): a long sampled text differs somewhere almost always, on both sides, so
  the per-text rate saturates and hides a changed model. Per token position ``i`` (the first
  :data:`MAX_POSITIONS`), over the calls whose reference has a token ``i``, the share where the control's token
  ``i`` differs (or is missing) is that position's floor, and the candidate's share is judged against it with
  the same interval; the positions above it are listed.

Every interval of a run (a tensor field, a text field, each trusted position) is one of its T tests, at
``1 - (1 - confidence) / T`` (Bonferroni); a text field is above the noise when its text rate or any of its
positions is.

A floor is trusted once the control has given ``min_calls`` pairs and, for a tensor, ``10 / (1 - quantile)``
elements (ten expected beyond the quantile); an untrusted field gets no verdict and weighs in no rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Final

import numpy as np
from pydantic import BaseModel, ConfigDict, PlainSerializer

from splitstream.replayer.compare import Answer, Tensor, decode_outputs

#: Bins of the difference histogram: 0 (exact), then log bins of 1e-12..1e12, then beyond (and infinite).
_LOW_DECADE: Final = -12
_HIGH_DECADE: Final = 12
_PER_DECADE: Final = 100
_LOG_BINS: Final = (_HIGH_DECADE - _LOW_DECADE) * _PER_DECADE
#: Upper edge of every bin: 0, the log edges, +inf.
UPPER_EDGES: Final = np.concatenate(
    ([0.0], 10.0 ** (_LOW_DECADE + np.arange(1, _LOG_BINS + 1) / _PER_DECADE), [math.inf])
)

#: Default quantile of the control's differences taken as the floor.
DEFAULT_QUANTILE: Final = 0.999
#: Default pairs of control answers before a field's floor is trusted.
DEFAULT_MIN_CALLS: Final = 30
#: Default two-sided confidence of the intervals that decide "above the floor", for the run as a whole: each of
#: a run's F judged fields gets ``1 - (1 - confidence) / F`` (Bonferroni), so a control judged against itself
#: shows a field above the noise in at most 1 % of runs, however many outputs the model has.
CONFIDENCE: Final = 0.99
#: The field name of generated text (token streams, HTTP generated text) and of whole HTTP bodies.
TEXT_FIELD: Final = "text"
#: Token positions judged one by one per text field (a fixed size however long the streams); later tokens weigh
#: only in the per-text rate.
MAX_POSITIONS: Final = 256


def _finite_or_inf(value: float | None) -> float | str | None:
    return "inf" if value is not None and math.isinf(value) else value


#: A difference that may be infinite (a shape, dtype or presence change): JSON has no infinity, and pydantic would
#: write ``null``, which reads as "not measured"; written as the string ``"inf"`` instead (read back as a float).
MaybeInfinite = Annotated[
    float | None, PlainSerializer(_finite_or_inf, return_type=float | str | None, when_used="json")
]


def newcombe_interval(k1: int, n1: int, k2: int, n2: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Newcombe's hybrid score interval (1998, method 10) for ``k1/n1 - k2/n2``: the Wilson intervals of both
    proportions combined. Chosen because it keeps its coverage at proportions near 0 (a floor's 0.1 %) where the
    Wald interval collapses to a point."""
    return _newcombe(k1, n1, k2, n2, _critical(1 - confidence))


def _critical(alpha: float) -> float:
    """The two-sided normal critical value at ``alpha``, from the tail itself: through ``ppf(1 - alpha / 2)`` a
    tail near 1e-16 (``--noise-confidence 0.9999999999999999``, or a small one split over the fields) rounds to
    ``ppf(1)``, an infinite z, whose intervals all hold 0: no field would ever be judged above the noise.

    scipy.stats is imported here, not at the top: it is 40 % of the replayer's start-up CPU, and only a replay
    with a noise floor needs it (a usage error, a plain replay, would pay it for nothing)."""
    from scipy.stats import norm

    return float(norm.isf(alpha / 2))


def _newcombe(k1: int, n1: int, k2: int, n2: int, z: float) -> tuple[float, float]:
    if n1 <= 0 or n2 <= 0:
        raise ValueError("both samples need at least one trial")
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = _wilson(k1, n1, z)
    l2, u2 = _wilson(k2, n2, z)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def _wilson(k: int, n: int, z: float) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class DiffHistogram:
    """Absolute differences of one side, binned so that a run of any length keeps a fixed size."""

    counts: np.ndarray = field(default_factory=lambda: np.zeros(len(UPPER_EDGES), dtype=np.int64))

    def add(self, differences: np.ndarray) -> None:
        values = np.nan_to_num(np.abs(differences.astype(np.float64).reshape(-1)), nan=math.inf)
        bins = np.searchsorted(UPPER_EDGES, values, side="left")  # v <= edge[i] and v > edge[i-1]
        self.counts += np.bincount(bins, minlength=len(UPPER_EDGES))

    def add_infinite(self, count: int) -> None:
        self.counts[-1] += count

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def floor_bin(self, quantile: float) -> int:
        """The bin holding the ``quantile`` quantile: its upper edge is the floor."""
        cumulative = np.cumsum(self.counts)
        return int(np.searchsorted(cumulative, quantile * cumulative[-1], side="left"))

    def beyond(self, bin_index: int) -> int:
        """Differences larger than the upper edge of ``bin_index``."""
        return int(self.counts[bin_index + 1 :].sum())

    def quantile(self, q: float) -> float | None:
        """The upper edge of the bin holding the ``q`` quantile (within a bin, 2.3 %); None when empty."""
        return float(UPPER_EDGES[self.floor_bin(q)]) if self.total else None


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Distribution(_Model):
    """One side's absolute differences from the reference (bin upper edges)."""

    elements: int
    p50: MaybeInfinite
    p99: MaybeInfinite
    p999: MaybeInfinite
    max: MaybeInfinite


class PositionNoise(_Model):
    """One token position of a text field: how often each side's token there differs from the reference's."""

    position: int
    #: Calls whose reference has a token at this position.
    calls: int
    trusted: bool
    control_rate: float
    candidate_rate: float
    excess_low: float
    excess_high: float
    above_noise: bool | None


class FieldNoise(_Model):
    """One output field judged against the control's floor."""

    #: ``tensor`` (element differences) or ``text`` (whether a call's text or body differs).
    kind: str
    #: Calls where the reference, the control and the candidate all answered OK and the field was compared.
    calls: int
    trusted: bool
    #: Tensors: the absolute difference at the floor (``"inf"`` in JSON: the control differs in shape or presence
    #: in more than ``1 - quantile`` of its elements).
    floor: MaybeInfinite = None
    #: Share of the control's elements (texts) beyond the floor (texts: that differ).
    control_rate: float | None
    candidate_rate: float | None
    #: Newcombe interval of ``candidate_rate - control_rate``.
    excess_low: float | None
    excess_high: float | None
    #: True: the candidate differs beyond the noise; None: no trusted floor yet.
    above_noise: bool | None
    control: Distribution | None = None
    candidate: Distribution | None = None
    #: Token streams' text: per token position with a compared call, the control's and the candidate's share
    #: differing there (None for tensors and for texts of HTTP calls, whose pieces are no tokens).
    positions: list[PositionNoise] | None = None
    #: The positions above the noise (a subset of ``positions``).
    positions_above: list[int] | None = None


class NoiseSummary(_Model):
    """``summary.json``'s ``noise`` section (only with ``--noise-from`` or ``--noise-target``)."""

    control: str
    quantile: float
    min_calls: int
    #: For the run as a whole; each field's interval is at ``field_confidence`` (Bonferroni over judged fields).
    confidence: float
    field_confidence: float
    fields: dict[str, FieldNoise]
    #: Fields above the floor / fields with a trusted floor (None when none is trusted).
    diff_above_noise_rate: float | None


@dataclass(frozen=True, slots=True)
class NoiseSettings:
    #: What the second pass of the control is: ``VERSION`` pinned at ``--target``, or an address.
    control: str
    quantile: float = DEFAULT_QUANTILE
    min_calls: int = DEFAULT_MIN_CALLS
    confidence: float = CONFIDENCE

    def __post_init__(self) -> None:
        if not 0.5 <= self.quantile < 1:  # NaN fails this too
            raise ValueError(f"--noise-quantile {self.quantile:g} must be at least 0.5 and below 1")
        if self.min_calls < 1:
            raise ValueError(f"--noise-min-calls {self.min_calls} must be at least 1")
        if not 0.5 <= self.confidence < 1:  # NaN fails this too
            raise ValueError(f"--noise-confidence {self.confidence:g} must be at least 0.5 and below 1")


@dataclass
class _TensorField:
    calls: int = 0
    control: DiffHistogram = field(default_factory=DiffHistogram)
    candidate: DiffHistogram = field(default_factory=DiffHistogram)


@dataclass
class _TextField:
    calls: int = 0
    control_differs: int = 0
    candidate_differs: int = 0
    #: Per token position: calls compared there, and how many differed on the control's and the candidate's side.
    position_calls: np.ndarray = field(default_factory=lambda: np.zeros(MAX_POSITIONS, dtype=np.int64))
    control_at: np.ndarray = field(default_factory=lambda: np.zeros(MAX_POSITIONS, dtype=np.int64))
    candidate_at: np.ndarray = field(default_factory=lambda: np.zeros(MAX_POSITIONS, dtype=np.int64))
    tokens_seen: bool = False

    def trusted_positions(self, min_calls: int) -> int:
        return int(np.count_nonzero(self.position_calls >= min_calls))


@dataclass
class NoiseTotals:
    """Both sides' differences from the reference, per field, over the run (fixed size per field)."""

    settings: NoiseSettings
    tensors: dict[str, _TensorField] = field(default_factory=dict)
    texts: dict[str, _TextField] = field(default_factory=dict)

    def add_differences(self, name: str, control: np.ndarray | None, candidate: np.ndarray | None, size: int) -> None:
        """One call's element differences of output ``name`` from the reference (None: that side differs in shape,
        dtype or presence, ``size`` infinite differences)."""
        totals = self.tensors.setdefault(name, _TensorField())
        totals.calls += 1
        for side, differences in ((totals.control, control), (totals.candidate, candidate)):
            if differences is None:
                side.add_infinite(max(size, 1))
            else:
                side.add(differences)

    def add_answers(self, reference: Answer, control: Answer, candidate: Answer) -> None:
        """A unary call all three answered OK with responses to compare (others carry no field's evidence)."""
        if not (reference.code == control.code == candidate.code == 0):
            return
        if not (reference.response_recorded and reference.response is not None):
            return
        skip = reference.redacted
        ref, ref_problem = decode_outputs(reference.response, skip)
        if ref_problem:
            return

        def decoded(side: Answer) -> tuple[dict[str, Tensor], str]:
            # The same bytes as the reference's (a deterministic model, the common case): the same outputs,
            # not decoded again.
            return (ref, "") if side.response == reference.response else decode_outputs(side.response, skip)

        ctrl, ctrl_problem = decoded(control)
        cand, cand_problem = decoded(candidate)
        for name, (ref_type, ref_array) in ref.items():
            sides: list[np.ndarray | None] = []
            for outputs, problem in ((ctrl, ctrl_problem), (cand, cand_problem)):
                other = None if problem else outputs.get(name)
                alike = other is not None and other[0] == ref_type and other[1].shape == ref_array.shape
                sides.append(_differences(ref_type, ref_array, other[1]) if alike and other is not None else None)
            self.add_differences(name, sides[0], sides[1], ref_array.size)

    def add_text(self, name: str, control_differs: bool, candidate_differs: bool) -> None:
        totals = self.texts.setdefault(name, _TextField())
        totals.calls += 1
        totals.control_differs += control_differs
        totals.candidate_differs += candidate_differs

    def add_positions(
        self, name: str, reference: Sequence[bytes], control: Sequence[bytes], candidate: Sequence[bytes]
    ) -> None:
        """One call's tokens, position by position (after :meth:`add_text` counted the call): at each position the
        reference has, whether the control's and the candidate's token there differs (a missing one does)."""
        totals = self.texts.setdefault(name, _TextField())
        totals.tokens_seen = True
        n = min(len(reference), MAX_POSITIONS)
        totals.position_calls[:n] += 1
        for side, counts in ((control, totals.control_at), (candidate, totals.candidate_at)):
            for index in range(n):
                counts[index] += index >= len(side) or side[index] != reference[index]

    def summary(self) -> NoiseSummary:
        settings = self.settings
        judged = sum(self._trusted(t) for t in self.tensors.values()) + sum(
            self._trusted(t) + (t.trusted_positions(settings.min_calls) if self._trusted(t) else 0)
            for t in self.texts.values()
        )
        alpha = (1 - settings.confidence) / max(judged, 1)
        z = _critical(alpha)
        fields: dict[str, FieldNoise] = {}
        for name, tensor in sorted(self.tensors.items()):
            fields[name] = self._tensor_summary(tensor, z)
        for name, text in sorted(self.texts.items()):
            fields[name] = self._text_summary(text, z)
        verdicts = [f.above_noise for f in fields.values() if f.above_noise is not None]
        return NoiseSummary(
            control=settings.control,
            quantile=settings.quantile,
            min_calls=settings.min_calls,
            confidence=settings.confidence,
            fields=fields,
            field_confidence=round(1 - alpha, 6),
            diff_above_noise_rate=round(sum(verdicts) / len(verdicts), 6) if verdicts else None,
        )

    def _trusted(self, totals: _TensorField | _TextField) -> bool:
        """Whether the field has enough control pairs (and, for a tensor, elements) for its floor to be judged."""
        if totals.calls < self.settings.min_calls:
            return False
        if isinstance(totals, _TextField):
            return True
        return totals.control.total * (1 - self.settings.quantile) >= 10 and totals.candidate.total > 0

    def _tensor_summary(self, tensor: _TensorField, z: float) -> FieldNoise:
        q = self.settings.quantile
        n_control, n_candidate = tensor.control.total, tensor.candidate.total
        trusted = self._trusted(tensor)
        floor_bin = tensor.control.floor_bin(q) if n_control else None
        control_rate = candidate_rate = low = high = None
        above = None
        if floor_bin is not None and n_candidate:
            k_control, k_candidate = tensor.control.beyond(floor_bin), tensor.candidate.beyond(floor_bin)
            control_rate, candidate_rate = k_control / n_control, k_candidate / n_candidate
            low, high = _newcombe(k_candidate, n_candidate, k_control, n_control, z)
            above = low > 0 if trusted else None
        return FieldNoise(
            kind="tensor",
            calls=tensor.calls,
            trusted=trusted,
            floor=None if floor_bin is None else float(UPPER_EDGES[floor_bin]),
            control_rate=_round(control_rate),
            candidate_rate=_round(candidate_rate),
            excess_low=_round(low),
            excess_high=_round(high),
            above_noise=above,
            control=_distribution(tensor.control),
            candidate=_distribution(tensor.candidate),
        )

    def _text_summary(self, text: _TextField, z: float) -> FieldNoise:
        trusted = self._trusted(text)
        if not text.calls:
            return FieldNoise(
                kind="text", calls=0, trusted=False, control_rate=None, candidate_rate=None,
                excess_low=None, excess_high=None, above_noise=None,
            )  # fmt: skip
        low, high = _newcombe(text.candidate_differs, text.calls, text.control_differs, text.calls, z)
        positions = self._positions(text, z) if text.tokens_seen else None
        above_at = [p.position for p in positions if p.above_noise] if positions is not None else None
        return FieldNoise(
            kind="text",
            calls=text.calls,
            trusted=trusted,
            control_rate=_round(text.control_differs / text.calls),
            candidate_rate=_round(text.candidate_differs / text.calls),
            excess_low=_round(low),
            excess_high=_round(high),
            above_noise=(low > 0 or bool(above_at)) if trusted else None,
            positions=positions,
            positions_above=above_at,
        )

    def _positions(self, text: _TextField, z: float) -> list[PositionNoise]:
        rows = []
        for index in np.flatnonzero(text.position_calls):
            n = int(text.position_calls[index])
            k_control, k_candidate = int(text.control_at[index]), int(text.candidate_at[index])
            low, high = _newcombe(k_candidate, n, k_control, n, z)
            trusted = n >= self.settings.min_calls
            rows.append(
                PositionNoise(
                    position=int(index),
                    calls=n,
                    trusted=trusted,
                    control_rate=round(k_control / n, 6),
                    candidate_rate=round(k_candidate / n, 6),
                    excess_low=round(low, 6),
                    excess_high=round(high, 6),
                    above_noise=(low > 0) if trusted else None,
                )
            )
        return rows


def _differences(datatype: str, reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Element-wise absolute differences; BYTES and BOOL differ by 1 or not at all; NaN equals NaN, and a
    non-finite disagreement is infinite."""
    if datatype in ("BYTES", "BOOL"):
        return np.array([a != b for a, b in zip(reference.reshape(-1), other.reshape(-1), strict=True)], dtype=float)
    a = reference.astype(np.float64)
    b = other.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    return np.where(same, 0.0, np.where(np.isfinite(diff), diff, math.inf))


def _distribution(histogram: DiffHistogram) -> Distribution:
    return Distribution(
        elements=histogram.total,
        p50=histogram.quantile(0.5),
        p99=histogram.quantile(0.99),
        p999=histogram.quantile(0.999),
        max=histogram.quantile(1.0),
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
