"""Capping (winsorizing) a metric's per-unit values: ``revenue:sum:cap=P99`` or ``revenue:sum:cap=250``.

One user who spends a thousand times the median can swing a revenue test either way and widen its interval
until nothing is ever significant. Statsig and Eppo cap such values: each unit's value is replaced by
``min(value, cap)`` before the test. A percentile cap is taken over the pooled units of every arm of the
phase, so the cap is the same for all arms and does not depend on which arm the outlier landed in.

What is capped is the unit's total of the metric (for ``sum``, the value compared; for ``mean``, the
numerator of the ratio, the unit's sum of values, as Statsig does; its event count is left alone). Kinds
that count positive events (``conversion``, ``rate``) have nothing to cap.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
CAP_SYNTAX = "cap=P99 (a percentile of the units' values: P95, P99, P99.9) or cap=250 (a fixed value)"
_PERCENTILE = re.compile(r"^[Pp](\d{1,2}(?:\.\d+)?|100)$")


@dataclass(frozen=True, slots=True)
class CapRule:
    """A percentile of the pooled units' values (``percentile`` in (0, 100]) or a fixed ``value``."""

    percentile: float | None = None
    value: float | None = None

    @staticmethod
    def parse(text: str) -> CapRule:
        """``P99``, ``P99.9`` or ``250``; ValueError saying what is wrong."""
        text = text.strip()
        match = _PERCENTILE.match(text)
        if match:
            percentile = float(match.group(1))
            if not 0 < percentile <= 100:
                raise ValueError(f"cap={text}: a percentile is above 0 and at most 100 ({CAP_SYNTAX})")
            return CapRule(percentile=percentile)
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"bad cap={text!r} (expected {CAP_SYNTAX})") from None
        if not math.isfinite(value):
            raise ValueError(f"bad cap={text!r}: the cap must be a finite number ({CAP_SYNTAX})")
        return CapRule(value=value)

    def __str__(self) -> str:
        """The rule as ``:cap=`` takes it, parsing back to the same rule (the report's metric names it so)."""
        return f"P{_exact(self.percentile)}" if self.percentile is not None else _exact(self.value)


def _exact(number: float | None) -> str:
    """``99.9`` or ``250`` as written where six digits say it, else every digit: ``P99.99999`` must not read back
    as ``P100``, nor a cap of ``1234567`` as ``1.23457e+06``."""
    assert number is not None
    short = f"{number:g}"
    return short if float(short) == number else repr(number)


def cap_value(rule: CapRule, pooled: FloatArray) -> float | None:
    """The cap for these pooled per-unit values: the fixed value, or the empirical percentile of the values
    ("lower" order statistic: the value of the unit at rank ``floor(p (n - 1))`` counted from the smallest, so
    the cap is a value some unit had; for the usual sizes the value scipy's ``mstats.winsorize`` keeps). None
    with no unit."""
    if rule.value is not None:
        return rule.value
    if not len(pooled):
        return None
    assert rule.percentile is not None
    return float(np.quantile(pooled, rule.percentile / 100, method="lower"))


def capped(values: FloatArray, cap: float | None) -> FloatArray:
    """The values with every one above ``cap`` set to it (unchanged when there is no cap)."""
    return values if cap is None else np.minimum(values, cap)


def units_capped(values: FloatArray, cap: float | None) -> int:
    """How many units the cap changes (values strictly above it)."""
    return 0 if cap is None else int((values > cap).sum())
