"""``--gate``: bounds on summary metrics that turn a replay into a CI verdict.

``--gate 'mismatch_rate<=0.01,p99_ratio<=1.2,error_rate<=0.001'`` fails (exit 1) when any
bound does not hold, and lists which. A bound on a metric the run could not measure
(``p99_ratio`` when nothing completed) fails too: a gate that passes on no evidence would let
an empty or broken replay through CI.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: Every metric a gate can bound, with what it means (``--help`` and errors list them).
METRICS: Mapping[str, str] = {
    "mismatch_rate": "calls whose outputs differ / calls both sides answered OK",
    "status_change_rate": "calls whose status changed (OK <-> error, or another error) / completed calls",
    "divergence_rate": "calls that differ in outputs or status / completed calls",
    "error_rate": "candidate errors / completed calls",
    "reference_error_rate": "reference errors / completed calls",
    "p50_ratio": "candidate p50 latency / reference p50 latency",
    "p95_ratio": "candidate p95 latency / reference p95 latency",
    "p99_ratio": "candidate p99 latency / reference p99 latency",
    "p99_ms": "candidate p99 latency in ms",
    "max_abs_error": "largest absolute error of any float or integer output element",
    "argmax_agreement": "lowest share of rows whose argmax agrees, over the class-score outputs",
    "topk_agreement": "lowest share of rows whose top-k sets agree, over the class-score outputs",
    "send_lag_p99_ms": "p99 of actual minus planned send time, ms (timed replays)",
    "send_lag_max_ms": "largest send lag, ms (timed replays)",
    "completed": "calls that got an answer from every target",
    "failed_sends": "calls selected but not completed (missing blobs, send errors, interrupted)",
    "skipped": "stream entries skipped as corrupt or of an unknown schema",
}

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


@dataclass(frozen=True, slots=True)
class GateResult:
    passed: bool
    failures: tuple[str, ...]
    checked: tuple[dict[str, object], ...]


def evaluate(bounds: tuple[Bound, ...], metrics: Mapping[str, float | None]) -> GateResult:
    failures: list[str] = []
    checked: list[dict[str, object]] = []
    for bound in bounds:
        value = metrics.get(bound.metric)
        ok = bound.check(value)
        checked.append({"bound": str(bound), "value": value, "passed": ok})
        if not ok:
            shown = "not measured" if value is None else f"{value:g}"
            failures.append(f"{bound.metric}={shown} (bound {bound})")
    return GateResult(not failures, tuple(failures), tuple(checked))
