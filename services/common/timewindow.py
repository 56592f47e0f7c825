"""Turning what users type for ``--since``/``--until`` into unix nanoseconds (the replayer, ``splitstream analyze``).

Incidents are reported in wall-clock time ("14:02 to 14:05 UTC"), CI jobs think in
relative terms ("the last 2 hours"), and scripts pass epoch seconds, so all three are
accepted. ISO-8601 times must carry their timezone: a naive "14:02" means different
instants on a laptop and on a CI runner, which would silently replay the wrong window.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from splitstream.common.durations import BadDuration, parse_duration_ns

_EPOCH = re.compile(r"^\s*\d+(?:\.\d+)?\s*$")
_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The first instant :func:`format_instant` cannot write (year 10000).
_LAST_NS = (datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC) - _UNIX_EPOCH) // timedelta(seconds=1) * 1_000_000_000


class BadTime(ValueError):
    """A time or duration that cannot be read; the message says what forms are accepted."""


def parse_instant_ns(text: str, *, now_ns: int) -> int:
    """One point in time as unix nanoseconds.

    Accepted: ``now``; relative to ``now_ns`` (``-15m``, ``-2h``, ``-30s``, ``-1d``, also ``+5m``);
    epoch seconds (``1767225600`` or ``1767225600.25``); ISO-8601 with a timezone
    (``2026-01-01T14:02:00Z``, ``2026-01-01T14:02:00+01:00``). Refused outside 1970..9999: stream ids
    start at the epoch, and the report cannot render a time past either end (``-999999d``).
    """
    unix_ns = _parse_instant_ns(text, now_ns=now_ns)
    if not 0 <= unix_ns < _LAST_NS:
        raise BadTime(f"bad time {text!r}: outside 1970-01-01 .. 9999-12-31")
    return unix_ns


def _parse_instant_ns(text: str, *, now_ns: int) -> int:
    stripped = text.strip()
    if stripped.lower() == "now":
        return now_ns
    if stripped[:1] in "+-" and stripped[1:2].isdigit():
        try:
            offset = parse_duration_ns(stripped[1:], unit_required=True)
        except BadDuration as error:
            raise BadTime(f"bad time {text!r}: {error}") from None
        return now_ns - offset if stripped[0] == "-" else now_ns + offset
    if _EPOCH.match(stripped):
        seconds, _, fraction = stripped.partition(".")
        return int(seconds) * 1_000_000_000 + int((fraction + "000000000")[:9])
    try:
        moment = datetime.fromisoformat(stripped)
    except ValueError:
        raise BadTime(
            f"bad time {text!r} (expected now, -15m/-2h/-1d, epoch seconds, or ISO-8601 with a timezone "
            "such as 2026-01-01T14:02:00Z)"
        ) from None
    if moment.tzinfo is None:
        raise BadTime(f"time {text!r} has no timezone; add one (Z, +00:00, +01:00, ...) so the window is unambiguous")
    return (moment - _UNIX_EPOCH) // timedelta(microseconds=1) * 1000


def format_instant(unix_ns: int) -> str:
    """Unix nanoseconds as ISO-8601 UTC with milliseconds (for reports and error messages)."""
    moment = _UNIX_EPOCH + timedelta(microseconds=unix_ns // 1000)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def join_relative_times(argv: Sequence[str], flags: Sequence[str] = ("--since", "--until")) -> list[str]:
    """``--since -15m`` → ``--since=-15m``: argparse would take ``-15m`` for an option, and relative
    times are the common case."""
    joined: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        following = argv[index + 1] if index + 1 < len(argv) else ""
        if arg in flags and following.startswith("-") and following[1:2].isdigit():
            joined.append(f"{arg}={following}")
            index += 2
            continue
        joined.append(arg)
        index += 1
    return joined
