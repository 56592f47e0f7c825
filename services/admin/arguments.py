"""argparse ``type=`` readers shared by the admin CLI's subcommands (``rollout``, ``bandit``): one grammar and one
error message per kind of value, wherever it is typed."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from splitstream.common.durations import BadDuration, parse_duration_s

if TYPE_CHECKING:
    from splitstream.analysis.model import MetricSpec


def duration_s(text: str) -> float:
    """``60s``, ``2m``, ``500ms``, or plain seconds: the replayer's grammar (:mod:`splitstream.common.durations`)."""
    try:
        return parse_duration_s(text)
    except BadDuration as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def fraction(text: str) -> float:
    """``0.01`` or ``1%`` (the range is the flag's own check)."""
    try:
        return float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a fraction or percentage: {text!r} (e.g. 0.01 or 1%)") from None


def metric(text: str) -> MetricSpec:
    """``NAME:KIND[:DIRECTION]``, as ``analyze --metric`` takes it."""
    from splitstream.analysis.model import MetricSpec  # numpy and pydantic: only once a --metric is given

    try:
        return MetricSpec.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
