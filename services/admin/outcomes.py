"""Rollout guards on business outcomes: ``--guard 'click:lift>=-1%'`` judged from recorded calls and feedback.

A guard bounds the new version's lift over the control on one metric of ``splitstream analyze``:

    NAME[:KIND][:cap=CAP]:lift>=BOUND    the lift must not be significantly below BOUND (higher is better)
    NAME[:KIND][:cap=CAP]:lift<=BOUND    the lift must not be significantly above BOUND (lower is better)

The side of the bound is the metric's direction (the analysis's verdicts say "better" and "worse" by it);
``NAME:KIND:lower:lift<=BOUND`` may write it out, as ``--metric`` of ``analyze`` does, and must agree.
KIND is ``rate`` (the default; ``mean`` for the metrics of the calls: ``ttft_ms``, ``cost``, ``tokens_out``,
``tokens_in``), ``conversion``, ``mean`` or ``sum``, and ``:cap=P99`` (or a value) caps each unit's value of a
``mean`` or ``sum``: the metric part is read by ``analyze --metric``'s own parser (:meth:`MetricSpec.parse`); BOUND
is relative to the control's value with a ``%`` (``-1%``) or absolute in the metric's own unit without one
(``-0.002``). A rollout reads the analysis at every check, so the test must stay valid however often it is
looked at: the guards use the always-valid (mSPRT) confidence sequence of the absolute lift, which holds
at every check at once, where a fixed-horizon interval checked every second would cross any bound by
chance sooner or later.

Each weight change starts a new experiment phase (:class:`splitstream.common.experiment.Phase`) and a
guard judges the current step's phase only: units randomized at 10 % and at 50 % saw different
experiments, and mixing them would weigh the early step's users differently in each arm.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from splitstream.admin.constants import GUARD_SYNTAX as GUARD_SYNTAX
from splitstream.admin.quantile_guards import QuantileGuard
from splitstream.analysis.model import (
    Analysis,
    Direction,
    MetricComparison,
    MetricSpec,
    PhaseResult,
    written_direction,
)
from splitstream.analysis.statistics import MetricKind
from splitstream.analysis.usage import is_call_metric

_GUARD = re.compile(r"^(?P<metric>.+):lift\s*(?P<op>>=|<=)\s*(?P<bound>[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?)(?P<pct>%?)$")

#: ``non-inferior``: the sequence's bad-side edge has cleared the bound (no harm past it, always valid), no win yet.
State = Literal["harm", "win", "non-inferior", "open", "not judged"]
#: Pearson's chi-square is trusted once every arm expects this many units (the textbook rule): below it, a
#: 10 % arm's first handful of units would raise a false alarm (30 units split 20/10 gives p = 2e-5 where the
#: exact binomial test gives 0.008).
SRM_MIN_EXPECTED = 5


@dataclass(frozen=True, kw_only=True)
class OutcomeGuard:
    metric: MetricSpec
    #: ``>=``: higher is better, the lift must not fall below ``bound``; ``<=`` the other way round.
    op: Literal[">=", "<="]
    bound: float
    relative: bool
    text: str

    @staticmethod
    def parse(text: str) -> OutcomeGuard:
        """ValueError naming what is wrong, with the syntax."""
        match = _GUARD.match(text.strip().replace(" ", ""))
        if match is None:
            raise ValueError(f"--guard {text!r}: expected {GUARD_SYNTAX}; e.g. click:lift>=-1%")
        # The bound's side says which way is better; a direction written out must agree with it.
        implied: Direction = "higher" if match["op"] == ">=" else "lower"
        try:  # the parser of analyze --metric: kind, direction and cap read as it reads them
            written = written_direction(match["metric"])
            spec = MetricSpec.parse(match["metric"], default_kind=MetricKind.RATE)
        except ValueError as error:
            raise ValueError(f"--guard {text!r}: {error}") from None
        if written is not None and written != implied:
            raise ValueError(
                f"--guard {text!r}: a metric where {written} is better is bounded with "
                f"lift{'>=' if written == 'higher' else '<='}BOUND (its harm is a lift the other way)"
            )
        name, kind = spec.name, spec.kind.value
        if is_call_metric(name) and spec.kind.counts_positive_calls:
            raise ValueError(
                f"--guard {text!r}: {name} is measured on the calls: its kind is mean (per call) or sum, not {kind}"
            )
        bound = float(match["bound"])
        if not math.isfinite(bound):  # 1e400 reads as infinity: a bound nothing can cross
            raise ValueError(f"--guard {text!r}: the bound {match['bound']} is past any number")
        relative = bool(match["pct"])
        cap = "" if spec.cap is None else f":cap={spec.cap}"
        return OutcomeGuard(
            metric=spec.model_copy(update={"direction": implied}),
            op=">=" if match["op"] == ">=" else "<=",
            bound=bound / 100 if relative else bound,
            relative=relative,
            text=f"{name}:{kind}{cap}:lift{match['op']}{match['bound']}{match['pct']}",
        )

    @property
    def name(self) -> str:
        """The metric as a check line names it: with its cap, since the lift is of the capped values."""
        return self.metric.name if self.metric.cap is None else f"{self.metric.name} capped at {self.metric.cap}"

    #: What a reading's estimate is (a quantile guard's is a ratio).
    quantity = "lift"

    def lift_text(self, value: float | None) -> str:
        if value is None:
            return "n/a"
        return f"{value * 100:+.1f} %" if self.relative else f"{value:+.4g}"


#: A ``--guard``: on a lift of an outcome, or on a latency quantile's ratio (:mod:`splitstream.admin.quantile_guards`).
Guard: TypeAlias = OutcomeGuard | QuantileGuard


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One guard at one check: the lift and its always-valid interval on the guard's scale."""

    guard: Guard
    state: State
    estimate: float | None = None
    low: float | None = None
    high: float | None = None
    why: str = ""

    @property
    def text(self) -> str:
        g = self.guard
        if self.state == "not judged":
            return f"{g.name} not judged ({self.why})"
        interval = f"always-valid CI {g.lift_text(self.low)} .. {g.lift_text(self.high)}"
        bound = f"bound {g.op} {g.lift_text(g.bound)}"
        return f"{g.name} {g.quantity} {g.lift_text(self.estimate)} ({interval}), {bound}: {self.state}"


@dataclass(frozen=True, kw_only=True)
class Check:
    """The outcome guards at one check of a step: each guard's reading and the phase's SRM test."""

    readings: tuple[Reading, ...]
    units: dict[str, int]
    srm_p: float | None
    srm_flagged: bool
    srm_expected: dict[str, float]

    @property
    def text(self) -> str:
        units = ", ".join(f"{arm} {n}" for arm, n in self.units.items()) or "none yet"
        srm = f"SRM p = {self.srm_p:.3g}" if self.srm_p is not None else "SRM not tested yet"
        return f"units {units} | {srm} | " + " | ".join(r.text for r in self.readings)


def judge(
    analysis: Analysis,
    *,
    phase: str,
    version: str,
    guards: Sequence[Guard],
    min_units: int,
) -> Check:
    """The guards' readings for ``version`` against its phase's control in the phase ``phase``."""
    result = next((p for p in analysis.phases if p.id == phase), None)
    if result is None:
        return Check(
            readings=tuple(
                Reading(guard=g, state="not judged", why="no call of this step recorded yet") for g in guards
            ),
            units={},
            srm_p=None,
            srm_flagged=False,
            srm_expected={},
        )
    units = {arm.arm: arm.units for arm in result.arms}
    readings = tuple(_reading(result, version, guard, units, min_units) for guard in guards)
    srm = result.srm
    if srm is not None and min(srm.expected.values(), default=0) < SRM_MIN_EXPECTED:
        srm = None
    return Check(
        readings=readings,
        units=units,
        srm_p=srm.p_value if srm else None,
        srm_flagged=bool(srm and srm.flagged),
        srm_expected=dict(srm.expected) if srm else {},
    )


def _reading(result: PhaseResult, version: str, guard: Guard, units: dict[str, int], min_units: int) -> Reading:
    fewest = min(units.get(result.control, 0), units.get(version, 0))
    if fewest < min_units:
        return Reading(guard=guard, state="not judged", why=f"{fewest} units in an arm, fewer than {min_units}")
    if isinstance(guard, QuantileGuard):
        judged, ratio, ratio_low, ratio_high, why = guard.judge(result, version)
        return Reading(guard=guard, state=judged, estimate=ratio, low=ratio_low, high=ratio_high, why=why)
    comparison: MetricComparison | None = next(
        (c for c in result.comparisons if c.metric == guard.metric.name and c.arm == version), None
    )
    if comparison is None or comparison.sequential_ci is None or comparison.absolute_lift is None:
        return Reading(guard=guard, state="not judged", why="no comparison with the control")
    low, high = comparison.sequential_ci.low, comparison.sequential_ci.high
    if low is None or high is None:
        return Reading(guard=guard, state="not judged", why="no interval yet")
    estimate = comparison.absolute_lift
    if guard.relative:
        # The relative lift's own sequence (delta method): dividing the absolute one by the control's value
        # would leave out the control's variance and judge too early.
        relative = comparison.sequential_relative_ci
        if comparison.relative_lift is None or relative is None or relative.low is None or relative.high is None:
            return Reading(guard=guard, state="not judged", why="the control's value is 0: no relative lift")
        estimate, low, high = comparison.relative_lift, relative.low, relative.high
    if guard.op == ">=":
        harm, win, clear = high < guard.bound, low > 0, low > guard.bound
    else:
        harm, win, clear = low > guard.bound, high < 0, high < guard.bound
    # ``clear``: sequential non-inferiority at the bound (``analyze --sequential --non-inferiority`` with the
    # bound as margin and --guard-alpha as alpha says "non-inferior" on the same phase).
    state: State = "harm" if harm else "win" if win else "non-inferior" if clear else "open"
    return Reading(guard=guard, state=state, estimate=estimate, low=low, high=high)
