"""The novelty comparison (lift by time since first exposure) as table lines and as a chart of ``analysis.html``."""

from __future__ import annotations

from html import escape

from splitstream.analysis.model import MetricComparison, NoveltyPoint, PhaseResult
from splitstream.common import charts
from splitstream.common.charts import fmt


def since_text(seconds: float) -> str:
    """A bucket's start as a duration: ``0s``, ``2d``, ``6h``, ``3s``."""
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _lift(c: MetricComparison, p: NoveltyPoint) -> tuple[float | None, float | None, float | None, bool]:
    """The point's lift and interval, relative when the comparison has one (as its verdict shows)."""
    if c.relative_lift is not None and p.relative is not None:
        return p.relative, p.relative_ci.low, p.relative_ci.high, True
    return p.absolute, p.absolute_ci.low, p.absolute_ci.high, False


def _shown(value: float | None, relative: bool) -> str:
    if value is None:
        return "-"
    return f"{value * 100:+.1f} %" if relative else f"{value:+.4g}"


def novelty_lines(phase: PhaseResult, bucket_ns: int | None) -> list[str]:
    """Per comparison with two buckets or more: the lift per bucket since first exposure."""
    if not bucket_ns:
        return []
    lines = []
    for c in phase.comparisons:
        if len(c.novelty) < 2:
            continue
        parts = []
        for p in c.novelty:
            value, low, high, relative = _lift(c, p)
            parts.append(
                f"+{since_text(p.since_first_s)} {_shown(value, relative)} [{_shown(low, relative)} .. "
                f"{_shown(high, relative)}] ({p.units_control}/{p.units_arm} units)"
            )
        width = since_text(bucket_ns / 1e9)
        lines.append(f"{c.arm} vs {c.control}: {c.metric} by {width} since first exposure: " + ", ".join(parts))
    return lines


def novelty_section(phase: PhaseResult, bucket_ns: int | None) -> str:
    """A chart per comparison with two buckets or more (the lift per bucket, its interval as a whisker), or
    nothing when every unit's data falls in one bucket (the overall lift says it all)."""
    shown = [c for c in phase.comparisons if len(c.novelty) >= 2]
    if not bucket_ns or not shown:
        return ""
    figures = "".join(_chart(c, bucket_ns) for c in shown)
    return (
        f"<h3>Lift by time since first exposure</h3><div class='charts novelty'>{figures}</div>"
        f"<p class='muted'>Each unit's calls and events by the {escape(since_text(bucket_ns / 1e9))} bucket they "
        "fall in counted from its first exposure, compared over the units active in the bucket: a lift that "
        "shrinks from the first bucket on is a novelty effect.</p>"
    )


def _chart(c: MetricComparison, bucket_ns: int) -> str:
    points = [(p, *_lift(c, p)) for p in c.novelty]
    values = [v for _, value, low, high, _ in points for v in (value, low, high) if v is not None] + [0.0]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    low, high = low - 0.05 * span, high + 0.05 * span
    plot_w = charts.WIDTH - charts.LEFT - charts.RIGHT
    plot_h = charts.HEIGHT - charts.TOP - charts.BOTTOM
    last = max(p.bucket for p in c.novelty)

    def x_of(bucket: int) -> float:
        return charts.LEFT + (bucket + 0.5) / (last + 1) * plot_w

    def y_of(v: float) -> float:
        return charts.TOP + (1 - (v - low) / (high - low)) * plot_h

    relative = points[0][4]
    title = (
        f"{c.metric}: {c.arm} vs {c.control} ({'relative' if relative else 'absolute'}) by time since first exposure"
    )
    out = [charts.svg_open(title)]
    ticks = [low, high] + ([0.0] if all(abs(y_of(0.0) - y_of(t)) > 14 for t in (low, high)) else [])
    for tick in ticks:  # zero's label left out where it would overlap an end's
        out.append(
            f"<text x='{charts.LEFT - 6}' y='{y_of(tick) + 4:.1f}' text-anchor='end'>"
            f"{escape(_shown(tick, relative) if relative else fmt(tick))}</text>"
        )
    zero = y_of(0.0)
    out.append(
        f"<line x1='{charts.LEFT}' y1='{zero:.1f}' x2='{charts.LEFT + plot_w}' y2='{zero:.1f}' stroke='#999' "
        "stroke-dasharray='3,3'/>"
    )
    for p, value, ci_low, ci_high, _ in points:
        x = x_of(p.bucket)
        label = f"+{since_text(p.since_first_s)}"
        if ci_low is not None and ci_high is not None:
            out.append(
                f"<line class='interval' data-bucket='{p.bucket}' x1='{x:.1f}' y1='{y_of(ci_low):.1f}' x2='{x:.1f}' "
                f"y2='{y_of(ci_high):.1f}' stroke='{charts.REFERENCE_COLOR}' stroke-width='3'/>"
            )
        if value is not None:
            out.append(
                f"<circle class='point' data-bucket='{p.bucket}' cx='{x:.1f}' cy='{y_of(value):.1f}' r='5' "
                f"fill='{charts.REFERENCE_COLOR}'><title>{escape(label)}: {escape(_shown(value, relative))} "
                f"({p.units_control}/{p.units_arm} units)</title></circle>"
            )
        out.append(
            f"<text x='{x:.1f}' y='{charts.HEIGHT - charts.BOTTOM + 18}' text-anchor='middle'>{escape(label)}</text>"
        )
    out.append(
        f"<text x='{charts.LEFT}' y='{charts.HEIGHT - 8}'>time since first exposure, buckets of "
        f"{escape(since_text(bucket_ns / 1e9))}</text>"
    )
    out.append(charts.legend(0, "lift and interval", charts.REFERENCE_COLOR))
    out.append("</svg>")
    return charts.figure(out, title)
