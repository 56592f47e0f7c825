"""``--gate``: bounds on summary metrics that turn a replay into a CI verdict.

``--gate 'mismatch_rate<=0.01,p99_ratio<=1.2,error_rate<=0.001'`` fails (exit 1) when any
bound does not hold, and lists which. A bound on a metric the run could not measure
(``p99_ratio`` when nothing completed) fails too: a gate that passes on no evidence would let
an empty or broken replay through CI. For the same reason a gate fails when no call completed
at all (an empty window, every send refused), whatever it bounds: the run is exit 1, with that
reason first on stderr, rather than a pass on nothing.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from splitstream.replayer.summary import METRICS, BoundResult, GateSummary, Metrics

_OPERATORS: Mapping[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
}
_BOUND = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|==|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


@dataclass(frozen=True, slots=True)
class Bound:
    metric: str
    op: str
    limit: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.limit:g}"

    def check(self, value: float | None) -> bool:
        return value is not None and _OPERATORS[self.op](value, self.limit)


def parse_gate(text: str) -> tuple[Bound, ...]:
    """Parse ``metric<op>number`` bounds separated by commas. Raises ValueError naming the bad part."""
    bounds = []
    for part in text.split(","):
        if not part.strip():
            continue
        match = _BOUND.match(part)
        if match is None:
            raise ValueError(f"bad gate bound {part.strip()!r} (expected metric<=number, e.g. mismatch_rate<=0.01)")
        metric, op, number = match.groups()
        if metric not in METRICS:
            raise ValueError(f"unknown gate metric {metric!r} (known: {', '.join(METRICS)})")
        bounds.append(Bound(metric, op, float(number)))
    if not bounds:
        raise ValueError("empty --gate")
    return tuple(bounds)


def evaluate(bounds: tuple[Bound, ...], metrics: Metrics) -> GateSummary:
    """Check every bound; a metric that was not measured fails its bound, and no completed call fails the gate."""
    failures: list[str] = []
    checked: list[BoundResult] = []
    if metrics.completed == 0:
        failures.append("no call completed, so nothing was measured")
    for bound in bounds:
        value = metrics.value(bound.metric)
        ok = bound.check(value)
        checked.append(BoundResult(bound=str(bound), value=value, passed=ok))
        if not ok:
            shown = "not measured" if value is None else f"{value:g}"
            failures.append(f"{bound.metric}={shown} (bound {bound})")
    return GateSummary(passed=not failures, bounds=checked, failures=failures)
