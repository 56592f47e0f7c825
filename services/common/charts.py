"""Inline SVG charts and the page style for self-contained HTML reports (the replay report, the A/B analysis).

Reports must open from a CI artifact store, an e-mail attachment or an air-gapped laptop, so charts are SVG
drawn here (no script, nothing fetched) rather than a charting library from a CDN. Each chart is a
``<figure>`` whose drawn series carry ``class`` and ``data-label`` attributes, so tests can find them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

PAGE_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;
  color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:right}
th{background:#f4f4f4}td.l,th.l{text-align:left}code{font-size:12px}.muted{color:#777}.warn{color:#a40000}
.pass{color:#1a7f37;font-weight:600}.fail{color:#cf222e;font-weight:600}
.charts{display:flex;flex-wrap:wrap;gap:18px}
figure{margin:0}figcaption{font-size:12px;color:#555;text-align:center}
svg text{font:11px system-ui,sans-serif;fill:#333}
"""
REFERENCE_COLOR = "#4e79a7"
CANDIDATE_COLOR = "#e15759"
PALETTE = ("#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")

WIDTH, HEIGHT = 520, 300
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 28, 44


@dataclass(frozen=True, slots=True)
class CdfSeries:
    """One cumulative distribution: ``points`` are (value ms, cumulative fraction), rising; ``start_ms`` is the
    smallest value seen, where the curve leaves 0."""

    label: str
    color: str
    points: Sequence[tuple[float, float]]
    start_ms: float


def cdf_chart(series: Sequence[CdfSeries], *, title: str) -> str:
    """Cumulative distributions on a log time axis (ms), one polyline per series."""
    populated = [s for s in series if s.points]
    if not populated:
        return no_data()
    low = min(max(s.start_ms, 1e-3) for s in populated)
    high = max(s.points[-1][0] for s in populated)
    lo_exp = math.floor(math.log10(low))
    hi_exp = math.ceil(math.log10(high)) if high > low else lo_exp + 1
    if hi_exp <= lo_exp:
        hi_exp = lo_exp + 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x_of(ms: float) -> float:
        return LEFT + (math.log10(max(ms, 10.0**lo_exp)) - lo_exp) / (hi_exp - lo_exp) * plot_w

    def y_of(fraction: float) -> float:
        return TOP + (1 - fraction) * plot_h

    out = [svg_open(title)]
    for exp in range(lo_exp, hi_exp + 1):
        x = x_of(10.0**exp)
        out.append(f"<line x1='{x:.1f}' y1='{TOP}' x2='{x:.1f}' y2='{TOP + plot_h}' stroke='#eee'/>")
        out.append(f"<text x='{x:.1f}' y='{TOP + plot_h + 14}' text-anchor='middle'>{ms_label(10.0**exp)}</text>")
    for fraction in (0, 0.25, 0.5, 0.75, 0.9, 1):
        y = y_of(fraction)
        out.append(f"<line x1='{LEFT}' y1='{y:.1f}' x2='{LEFT + plot_w}' y2='{y:.1f}' stroke='#eee'/>")
        out.append(f"<text x='{LEFT - 6}' y='{y + 4:.1f}' text-anchor='end'>{fraction:g}</text>")
    out.append(f"<text x='{LEFT + plot_w / 2}' y='{HEIGHT - 8}' text-anchor='middle'>ms (log scale)</text>")
    for index, s in enumerate(populated):
        points = [(x_of(s.start_ms), y_of(0.0))] + [(x_of(ms), y_of(fraction)) for ms, fraction in s.points]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        out.append(
            f"<polyline class='series' data-label='{escape(s.label)}' points='{path}' fill='none' "
            f"stroke='{s.color}' stroke-width='2'/>"
        )
        out.append(legend(index, s.label, s.color))
    out.append("</svg>")
    return figure(out, title)


def grouped_bars(
    categories: Sequence[str], series: Sequence[tuple[str, str, Sequence[float | None]]], *, title: str
) -> str:
    """Vertical bars, one group per category and one bar per series (missing values drawn as nothing)."""
    values = [v for _, _, vs in series for v in vs if v is not None]
    top = max(values, default=0.0) or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    group_w = plot_w / max(len(categories), 1)
    bar_w = min(group_w * 0.8 / max(len(series), 1), 60)
    out = [svg_open(title)]
    for tick in (0, 0.5, 1):
        y = TOP + (1 - tick) * plot_h
        out.append(f"<line x1='{LEFT}' y1='{y:.1f}' x2='{LEFT + plot_w}' y2='{y:.1f}' stroke='#eee'/>")
        out.append(f"<text x='{LEFT - 6}' y='{y + 4:.1f}' text-anchor='end'>{fmt(top * tick)}</text>")
    for c, category in enumerate(categories):
        start = LEFT + c * group_w + (group_w - bar_w * len(series)) / 2
        for s, (label, color, vs) in enumerate(series):
            value = vs[c] if c < len(vs) else None
            if value is None:
                continue
            height = value / top * plot_h
            x = start + s * bar_w
            out.append(
                f"<rect class='bar' data-label='{escape(label)}' x='{x:.1f}' y='{TOP + plot_h - height:.1f}' "
                f"width='{bar_w - 2:.1f}' height='{height:.1f}' fill='{color}'><title>{escape(label)} "
                f"{escape(category)}: {fmt(value)}</title></rect>"
            )
        out.append(
            f"<text x='{LEFT + (c + 0.5) * group_w:.1f}' y='{TOP + plot_h + 14}' text-anchor='middle'>"
            f"{escape(category)}</text>"
        )
    for index, (label, color, _) in enumerate(series):
        out.append(legend(index, label, color))
    out.append("</svg>")
    return figure(out, title)


def no_data() -> str:
    return f"<figure><svg width='{WIDTH}' height='60' role='img'><text x='10' y='30'>no data</text></svg></figure>"


def figure(parts: Sequence[str], title: str) -> str:
    return f"<figure>{''.join(parts)}<figcaption>{escape(title)}</figcaption></figure>"


def svg_open(title: str, *, height: int = HEIGHT) -> str:
    return (
        f"<svg width='{WIDTH}' height='{height}' viewBox='0 0 {WIDTH} {height}' "
        f"role='img' aria-label='{escape(title)}'>"
        f"<rect x='{LEFT}' y='{TOP}' width='{WIDTH - LEFT - RIGHT}' height='{height - TOP - BOTTOM}' "
        "fill='none' stroke='#ccc'/>"
    )


def legend(index: int, label: str, color: str) -> str:
    x = LEFT + 8 + index * 150
    return (
        f"<rect x='{x}' y='8' width='12' height='12' fill='{color}'/><text x='{x + 16}' y='18'>{escape(label)}</text>"
    )


def ms_label(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1000:g} s"
    if ms >= 1:
        return f"{ms:g}"
    return f"{ms:g}".replace("e-0", "e-")


def fmt(value: float | int | None, *, none: str = "-") -> str:
    """A number for a table cell: integers whole, others to 3 significant digits."""
    if value is None:
        return none
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def fmt_rate(value: float | None, *, none: str = "-") -> str:
    return none if value is None else f"{value * 100:.2f} %"
