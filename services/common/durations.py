"""Durations as people type them on a command line (``250ms``, ``90s``, ``15m``, ``2h``, ``1d``, ``60``), read one way.

The admin CLI (``rollout --interval``) and the replayer (``--max-lateness``, ``--clock-skew``,
``--since -15m``) read durations with this one grammar, and say the one error message: bare
seconds and days alike, wherever a duration is typed.

Values are read exactly (a decimal fraction, not a float), so ``0.1s`` is 100,000,000 ns, not
99,999,999. Negative, NaN, infinite and exponent forms are refused: none is a duration anyone
means, and ``float()`` would quietly accept the last three.
"""

from __future__ import annotations

import re
from fractions import Fraction

#: Nanoseconds per unit; a number without a unit is seconds.
UNITS_NS: dict[str, int] = {
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
    "d": 86_400_000_000_000,
}
# ASCII: without it \d also takes other scripts' digits ("\u0661", Arabic-Indic one).
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$", re.ASCII)
FORMS = "a number of seconds or a number and a unit: 250ms, 90s, 15m, 2h, 1d"


class BadDuration(ValueError):
    """Text that is not a duration; the message quotes it and lists the accepted forms."""


def parse_duration_ns(text: str, *, unit_required: bool = False) -> int:
    """``text`` as whole nanoseconds (rounded down below 1 ns). ``unit_required``: a bare number is refused,
    where it would mean something else (``--since 1767225600`` is an epoch time, not a duration)."""
    match = _DURATION.match(text)
    if match is None or (unit_required and match.group(2) is None and Fraction(match.group(1)) != 0):
        forms = "a number and a unit: 250ms, 90s, 15m, 2h, 1d" if unit_required else FORMS
        raise BadDuration(f"bad duration {text!r} (expected {forms})")
    number, unit = match.groups()
    return int(Fraction(number) * UNITS_NS[unit or "s"])


def parse_duration_s(text: str) -> float:
    """``text`` as seconds (for timers and sleeps, which take floats)."""
    return parse_duration_ns(text) / 1e9
