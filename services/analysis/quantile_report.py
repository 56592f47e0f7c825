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


#: How the table's added columns name a correction.
_ADJUSTED = {"holm": "HOLM-ADJ.", "bh": "BH-ADJ."}


def _corrected(phase: PhaseResult) -> str | None:
    """The correction the phase's quantiles were adjusted by (``holm``, ``bh``), None if none."""
    return next((q.correction for q in phase.quantiles if q.correction != "none"), None)


def header(phase: PhaseResult) -> list[str]:
    """The columns; with a correction, the adjusted ratio interval and p-value added (``HOLM-ADJ. RATIO CI``)."""
    method = _corrected(phase)
    return HEADER if method is None else [*HEADER, f"{_ADJUSTED[method]} RATIO CI", f"{_ADJUSTED[method]} P"]


def _ratio_interval(interval: Interval | None) -> str:
    return "-" if interval is None else f"[{_ratio(interval.low)}, {_ratio(interval.high)}]"


def cells(q: QuantileComparison, corrected: bool = False) -> list[str]:
    ratio = "-" if q.ratio is None else f"{_ratio(q.ratio)} {_ratio_interval(q.ratio_ci)}"
    diff = "-" if q.difference is None else f"{q.difference:+.4g} {_ms(q.difference_ci)}"
    row = [
        q.metric,
        q.name,
        f"{q.arm} vs {q.control}",
        fmt(q.control_value),
        fmt(q.arm_value),
        diff,
        ratio,
        st.p_text(q.p_value),
    ]
    if corrected:
        row += [_ratio_interval(q.adjusted_ratio_ci), st.p_text(q.adjusted_p_value)]
    return row


def quantile_lines(phase: PhaseResult) -> list[str]:
    """A table of the phase's quantile comparisons, with a line naming the method; nothing without any."""
    if not phase.quantiles:
        return []
    columns = header(phase)
    corrected = _corrected(phase) is not None
    rows = [columns] + [cells(q, corrected) for q in phase.quantiles]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    intro = "quantiles of the calls pooled per arm, intervals clustered by unit (delta method)"
    if corrected:
        intro += f"; {_ADJUSTED[_corrected(phase) or '']} columns: adjusted in the analysis's family"
    lines = [intro + ":"]
    lines += [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return lines


def quantile_section(phase: PhaseResult) -> str:
    """The same table for ``analysis.html``."""
    if not phase.quantiles:
        return ""
    corrected = _corrected(phase) is not None
    head = "".join(f"<th>{escape(h)}</th>" for h in header(phase))
    body = "".join(
        f"<tr class='{'fail' if q.ratio_ci.low is not None and q.ratio_ci.low > 1 else ''}'>"
        + "".join(f"<td>{escape(c)}</td>" for c in cells(q, corrected))
        + "</tr>"
        for q in phase.quantiles
    )
    return (
        "<h3>Latency quantiles</h3>"
        "<p class='muted'>p50, p90 and p99 of the calls pooled per arm; the intervals of the difference and of the "
        "ratio are clustered by unit (delta method for quantiles, Deng, Knoblich &amp; Lu 2018).</p>"
        f"<table class='quantiles'><tr>{head}</tr>{body}</table>"
    )
