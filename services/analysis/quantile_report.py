"""The quantile comparisons of a phase as terminal lines and as a table of ``analysis.html``."""

from __future__ import annotations

from html import escape

from splitstream.analysis import statistics as st
from splitstream.analysis.model import Interval, PhaseResult, QuantileComparison
from splitstream.common.charts import fmt

HEADER = ["METRIC", "Q", "ARM", "CONTROL MS", "ARM MS", "DIFF MS [CI]", "RATIO [CI]", "P (RATIO=1)"]


def _ms(interval: Interval) -> str:
    return f"[{fmt(interval.low)}, {fmt(interval.high)}]"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def cells(q: QuantileComparison) -> list[str]:
    ratio = "-" if q.ratio is None else f"{_ratio(q.ratio)} [{_ratio(q.ratio_ci.low)}, {_ratio(q.ratio_ci.high)}]"
    diff = "-" if q.difference is None else f"{q.difference:+.4g} {_ms(q.difference_ci)}"
    return [
        q.metric,
        q.name,
        f"{q.arm} vs {q.control}",
        fmt(q.control_value),
        fmt(q.arm_value),
        diff,
        ratio,
        st.p_text(q.p_value),
    ]


def quantile_lines(phase: PhaseResult) -> list[str]:
    """A table of the phase's quantile comparisons, with a line naming the method; nothing without any."""
    if not phase.quantiles:
        return []
    rows = [HEADER] + [cells(q) for q in phase.quantiles]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["quantiles of the calls pooled per arm, intervals clustered by unit (delta method):"]
    lines += [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return lines


def quantile_section(phase: PhaseResult) -> str:
    """The same table for ``analysis.html``."""
    if not phase.quantiles:
        return ""
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADER)
    body = "".join(
        f"<tr class='{'fail' if q.ratio_ci.low is not None and q.ratio_ci.low > 1 else ''}'>"
        + "".join(f"<td>{escape(c)}</td>" for c in cells(q))
        + "</tr>"
        for q in phase.quantiles
    )
    return (
        "<h3>Latency quantiles</h3>"
        "<p class='muted'>p50, p90 and p99 of the calls pooled per arm; the intervals of the difference and of the "
        "ratio are clustered by unit (delta method for quantiles, Deng, Knoblich &amp; Lu 2018).</p>"
        f"<table class='quantiles'><tr>{head}</tr>{body}</table>"
    )
