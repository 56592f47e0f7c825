"""The analysis as a terminal table and as ``analysis.html`` (one self-contained page, like the replay report).

The page's sections: verdicts and counts; per phase, the sample-ratio panel (observed against expected units),
the arms (units, calls, errors, latency, metric values), the lift of every metric with its interval, the
cumulative lift over time with its confidence band (and the always-valid sequence with ``--sequential``), and
the latency CDF of each arm; then the calls that were not randomized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from splitstream.analysis import bayes_text
from splitstream.analysis import statistics as st
from splitstream.analysis.model import (
    Analysis,
    Interval,
    MetricComparison,
    MetricSpec,
    PhaseResult,
    QuantileComparison,
    Segment,
)
from splitstream.analysis.novelty_report import novelty_lines, novelty_section
from splitstream.analysis.quantile_report import quantile_lines, quantile_section
from splitstream.common import charts
from splitstream.common.charts import fmt, fmt_rate
from splitstream.common.timewindow import format_instant

# -- terminal ------------------------------------------------------------------------------


def render_table(analysis: Analysis) -> str:
    lines = [_title(analysis), _calls_line(analysis), _feedback_line(analysis)]
    if analysis.unit_warning:
        lines += [f"warning: {analysis.unit_warning}"]
    if analysis.correction != "none":
        lines += [_correction_line(analysis)]
    for phase in analysis.phases:
        lines += _phase_lines(analysis, phase, indent="")
    if analysis.non_randomized:
        lines += ["", "Not randomized (shown apart, never compared):"]
        rows = [["PHASE", "ASSIGNMENT", "ARM", "CALLS", "ERROR RATE", "P50 MS", "P99 MS"]]
        rows += [
            [r.phase or "-", r.assignment, r.arm, str(r.calls), fmt_rate(r.error_rate), fmt(r.latency_p50_ms),
             fmt(r.latency_p99_ms)]
            for r in analysis.non_randomized
        ]  # fmt: skip
        lines += ["  " + line for line in _columns(rows)]
    if not analysis.phases:
        lines += ["", "No randomized call in the window: nothing to compare."]
    if analysis.segment_field:
        lines += ["", _segments_line(analysis)]
        for segment in analysis.segments:
            lines += ["", f"segment {analysis.segment_field} = {segment.value or '(none)'}:"]
            lines += ["  " + _calls_line(segment), "  " + _feedback_line(segment)]
            for phase in segment.phases:
                lines += _phase_lines(analysis, phase, indent="  ")
    return "\n".join(lines)


def _correction_line(analysis: Analysis) -> str:
    method = "Holm (family-wise)" if analysis.correction == "holm" else "Benjamini-Hochberg (false discovery rate)"
    quantiles = (
        f", {analysis.quantiles_in_family} of them latency and TTFT quantiles: their table adds the adjusted ratio "
        "intervals and p-values"
        if analysis.quantiles_in_family
        else ""
    )
    return (
        f"Verdicts adjusted by {method} over {analysis.family_size} comparisons (metrics x arms x phases"
        f"{' x segments' if analysis.segment_field else ''}{quantiles}); the tables show unadjusted p-values and "
        "intervals."
    )


def _segments_line(analysis: Analysis) -> str:
    return (
        f"Per {analysis.segment_field} ({len(analysis.segments)} segments; a call counts in its own, so "
        f"{analysis.units_in_several_segments} units seen under several count in each):"
    )


def _has_streams(phase: PhaseResult) -> bool:
    return any(arm.streams for arm in phase.arms)


def _has_ttft(phase: PhaseResult) -> bool:
    return any(arm.ttft_p50_ms is not None for arm in phase.arms)


def _has_tokens(phase: PhaseResult) -> bool:
    return any(arm.generations for arm in phase.arms)


def _cost(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def usage_lines(phase: PhaseResult) -> list[str]:
    """Per arm: its generations' tokens in and out (totals and per call) and their cost, saying what is not
    counted: prompts whose tokens are unknown, an arm without a price."""
    lines = []
    for arm in phase.arms:
        if not arm.generations:
            continue
        line = (
            f"{arm.arm}: {arm.generations} generations, tokens in {arm.tokens_in} "
            f"({_num(arm.tokens_in_per_call)}/call), out {arm.tokens_out} ({_num(arm.tokens_out_per_call)}/call)"
        )
        if arm.prompt_tokens_unknown:
            line += f"; prompt tokens unknown for {arm.prompt_tokens_unknown} (not counted in, nor costed)"
        if arm.price is None:
            line += "; no --price for it: no cost"
        else:
            per_call = f"{_cost(arm.cost_per_call)}/call, {arm.costed_calls} calls"
            line += f"; cost {_cost(arm.cost)} ({per_call}) at {arm.price}"
        lines.append(line)
    return lines


def _phase_lines(analysis: Analysis, phase: PhaseResult, *, indent: str) -> list[str]:
    lines = ["", indent + _phase_title(phase)]
    pad = indent + "  "
    if phase.srm is not None:
        srm = phase.srm
        observed = ", ".join(f"{arm} {count}" for arm, count in srm.observed.items())
        expected = ", ".join(f"{arm} {count:.0f}" for arm, count in srm.expected.items())
        flag = "SAMPLE RATIO MISMATCH" if srm.flagged else "ok"
        lines.append(
            f"{pad}units per arm: observed {observed}; expected {expected}; "
            f"chi2 {srm.chi2:.2f}, {st.p_clause(srm.p_value)}: {flag}"
        )
    if phase.crossover_units:
        lines.append(f"{pad}units seen in two arms (excluded): {phase.crossover_units}")
    streams, ttft, tokens = _has_streams(phase), _has_ttft(phase), _has_tokens(phase)
    header = ["ARM", "WEIGHT", "UNITS", "CALLS", "ERROR RATE", "P50 MS", "P99 MS"]
    if streams:
        header += ["STREAMS"]
    if streams or ttft:
        header += ["TTFT P50 MS", "TTFT P99 MS"]
    if streams:
        header += ["TOKENS/S"]
    if tokens:
        header += ["IN/CALL", "OUT/CALL", "COST/CALL"]
    rows = [header + list(analysis.metrics)]
    for arm in phase.arms:
        cells = [
            arm.arm + (" (control)" if arm.arm == phase.control else ""),
            "-" if arm.weight is None else f"{arm.weight:g} %",
            str(arm.units),
            str(arm.calls),
            fmt_rate(arm.error_rate),
            fmt(arm.latency_p50_ms),
            fmt(arm.latency_p99_ms),
        ]
        if streams:
            cells += [str(arm.streams)]
        if streams or ttft:
            cells += [fmt(arm.ttft_p50_ms), fmt(arm.ttft_p99_ms)]
        if streams:
            cells += [fmt(arm.tokens_per_s)]
        if tokens:
            cells += [_num(arm.tokens_in_per_call), _num(arm.tokens_out_per_call), _cost(arm.cost_per_call)]
        for spec in analysis.metrics:
            metric = arm.metrics.get(MetricSpec.parse(spec).name)
            cells.append(
                "-"
                if metric is None or metric.value is None
                else f"{_num(metric.value)} [{_num(metric.ci.low)}, {_num(metric.ci.high)}]"
            )
        rows.append(cells)
    lines += [pad + line for line in _columns(rows)]
    lines += [pad + line for line in usage_lines(phase)]
    lines += [pad + line for line in cap_lines(analysis, phase)]
    lines += [pad + line for line in novelty_lines(phase, analysis.novelty_bucket_ns)]
    lines += [pad + c.verdict_line for c in phase.comparisons]
    lines += [pad + line for line in quantile_lines(phase)]
    return lines


def cap_lines(analysis: Analysis, phase: PhaseResult) -> list[str]:
    """Per capped metric: the cap (and its rule) and the units it lowered in each arm."""
    lines = []
    for text in analysis.metrics:
        spec = MetricSpec.parse(text)
        if spec.cap is None:
            continue
        arms = [(arm.arm, arm.metrics.get(spec.name)) for arm in phase.arms]
        cap = next((m.cap for _, m in arms if m is not None and m.cap is not None), None)
        if cap is None:
            lines.append(f"{spec.name} capped at {spec.cap}: no unit with a value")
            continue
        counts = ", ".join(f"{arm} {m.capped_units}" for arm, m in arms if m is not None)
        rule = f" ({spec.cap}, pooled over the arms)" if spec.cap.startswith("P") else ""
        lines.append(f"{spec.name} capped at {cap:.4g}{rule} per unit; units capped: {counts}")
    return lines


def _title(analysis: Analysis) -> str:
    extras = [f"unit {analysis.unit}", f"alpha {analysis.alpha:g}"]
    if analysis.attribution_ns:
        extras.append(
            f"events of its calls counted until {format_instant(analysis.until_ns + analysis.attribution_ns)}"
        )
    if analysis.sequential:
        extras.append("always-valid (mSPRT)")
    if analysis.engine == "bayes":
        extras.append(bayes_text.engine_text(analysis))
    if analysis.cuped_since_ns is not None and analysis.cuped_until_ns is not None:
        extras.append(
            f"CUPED pre-period {format_instant(analysis.cuped_since_ns)} .. {format_instant(analysis.cuped_until_ns)}"
        )
    return (
        f"{analysis.model}: {format_instant(analysis.since_ns)} .. {format_instant(analysis.until_ns)}; "
        + "; ".join(extras)
    )


def _calls_line(analysis: Analysis | Segment) -> str:
    c = analysis.calls
    return (
        f"calls: {c.calls} in the window ({c.randomized} randomized, {c.not_randomized} not); "
        f"{c.duplicates} duplicates and {c.corrupt} unreadable entries skipped"
    )


def _feedback_line(analysis: Analysis | Segment) -> str:
    f = analysis.feedback
    return (
        f"feedback: {f.used} events used; {f.duplicates} duplicates, {f.unknown} unknown request id or unit, "
        f"{f.not_randomized} of calls not randomized, {f.crossover} of crossover units, "
        f"{f.outside_window} outside the window, {f.corrupt} unreadable"
    )


def _phase_title(phase: PhaseResult) -> str:
    weights = ", ".join(f"{arm}={weight:g}" for arm, weight in sorted(phase.weights.items())) or "unknown"
    return (
        f"phase {phase.id or '(none recorded)'}: control {phase.control or 'unknown'}, weights {weights}, "
        f"{phase.units} units, from {format_instant(phase.first_ns)}"
    )


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


# -- HTML ----------------------------------------------------------------------------------


def render_html(analysis: Analysis) -> str:
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width,initial-scale=1'>",
        f"<title>splitstream analysis: {escape(analysis.model)}</title>",
        f"<style>{charts.PAGE_CSS}</style></head><body>",
        f"<h1>A/B analysis of {escape(analysis.model)}</h1>",
        f"<p class='muted'>{escape(_title(analysis))}</p>",
        "<h2 id='verdicts'>Verdicts</h2>",
        _verdicts(analysis),
        "<h2 id='counts'>Counts</h2>",
        f"<p>{escape(_calls_line(analysis))}</p><p>{escape(_feedback_line(analysis))}</p>",
        f"<p class='warn'>{escape(analysis.unit_warning)}</p>" if analysis.unit_warning else "",
        f"<p>{escape(_correction_line(analysis))}</p>" if analysis.correction != "none" else "",
    ]
    for index, phase in enumerate(analysis.phases):
        parts.append(_phase_section(analysis, phase, index))
    parts.append("<h2 id='not-randomized'>Calls not randomized</h2>")
    parts.append(_non_randomized(analysis))
    if analysis.segment_field:
        parts.append(_segments_section(analysis))
    parts.append("</body></html>")
    return "\n".join(parts)


def _verdicts(analysis: Analysis) -> str:
    if not analysis.verdicts:
        return "<p class='muted'>No comparison: no phase had randomized units in a control and another arm.</p>"
    items = []
    for phase in analysis.phases:
        for c in phase.comparisons:
            css = "pass" if c.verdict == "better" else "fail" if c.verdict == "worse" else "muted"
            items.append(f"<li class='{css}'>{escape(c.verdict_line)}</li>")
    return f"<ul>{''.join(items)}</ul>"


def _phase_section(analysis: Analysis, phase: PhaseResult, index: int) -> str:
    out = [f"<h2 id='phase-{index}'>{escape(_phase_title(phase))}</h2>"]
    out.append("<h3>Sample ratio</h3>")
    out.append(_srm_panel(phase))
    out.append("<h3>Arms</h3>")
    out.append(_arms_table(analysis, phase))
    out.append("<h3>Lift per metric</h3>")
    out.append(_lift_section(phase))
    out.append(quantile_section(phase))
    out.append("<h3>Cumulative lift over time</h3>")
    timelines = [_timeline_chart(c) for c in phase.comparisons if c.timeline]
    timelines += [_quantile_timeline_chart(q) for q in phase.quantiles if q.timeline]
    out.append(f"<div class='charts'>{''.join(timelines)}</div>" if timelines else "<p class='muted'>No data.</p>")
    if analysis.sequential:
        out.append(
            "<p class='muted'>Dashed: the always-valid confidence sequence (mSPRT, normal mixture), valid "
            "however often the analysis is looked at; the band is the fixed-horizon interval at each point.</p>"
        )
    out.append(novelty_section(phase, analysis.novelty_bucket_ns))
    out.append("<h3>Latency</h3>")
    series = [
        charts.CdfSeries(arm.arm, charts.PALETTE[i % len(charts.PALETTE)], arm.latency_cdf, arm.latency_cdf[0][0])
        for i, arm in enumerate(phase.arms)
        if arm.latency_cdf
    ]
    cdf = charts.cdf_chart(series, title="latency CDF per arm (randomized calls)")
    out.append(f"<div class='charts latency-cdf'>{cdf}</div>")
    return "\n".join(out)


def _segments_section(analysis: Analysis) -> str:
    out = [
        f"<h2 id='segments'>Per {escape(analysis.segment_field or '')}</h2>",
        f"<p>{escape(_segments_line(analysis))}</p>",
    ]
    for index, segment in enumerate(analysis.segments):
        name = f"{analysis.segment_field} = {segment.value or '(none)'}"
        out.append(f"<h3 id='segment-{index}' class='segment'>{escape(name)}</h3>")
        out.append(f"<p>{escape(_calls_line(segment))}</p><p>{escape(_feedback_line(segment))}</p>")
        verdicts = "".join(f"<li>{escape(line)}</li>" for line in segment.verdicts)
        out.append(f"<ul>{verdicts}</ul>" if verdicts else "<p class='muted'>No comparison in this segment.</p>")
        for phase in segment.phases:
            out.append(f"<h4>{escape(_phase_title(phase))}</h4>")
            out.append(_arms_table(analysis, phase))
            out.append(_lift_section(phase))
    return "\n".join(out)


def _srm_panel(phase: PhaseResult) -> str:
    srm = phase.srm
    crossover = (
        f"<p>Units seen in two arms of this phase (excluded everywhere): <b>{phase.crossover_units}</b>.</p>"
        if phase.crossover_units
        else ""
    )
    if srm is None:
        return (
            "<p class='muted'>No check: the phase's weights are unknown or fewer than two arms carry weight.</p>"
            + crossover
        )
    arms = list(srm.expected)
    bars = charts.grouped_bars(
        arms,
        [
            ("expected", charts.REFERENCE_COLOR, [srm.expected[a] for a in arms]),
            ("observed", charts.CANDIDATE_COLOR, [float(srm.observed.get(a, 0)) for a in arms]),
        ],
        title="units per arm: expected vs observed",
    )
    rows = "".join(
        f"<tr><td class='l'>{escape(a)}</td><td>{phase.weights.get(a, 0):g} %</td><td>{srm.expected[a]:.0f}</td>"
        f"<td>{srm.observed.get(a, 0)}</td></tr>"
        for a in arms
    )
    verdict = (
        "<p class='fail'>Sample ratio mismatch (p &lt; 0.001): the split is not what the weights say; "
        "do not trust this phase's comparisons until the cause is found.</p>"
        if srm.flagged
        else "<p class='pass'>No sample ratio mismatch.</p>"
    )
    table = (
        "<table><tr><th class='l'>arm</th><th>weight</th><th>expected units</th><th>observed units</th></tr>"
        f"{rows}</table><p>chi-square {srm.chi2:.2f}, {escape(st.p_clause(srm.p_value))}</p>"
    )
    return f"<div class='srm'>{verdict}<div class='charts'>{bars}</div>{table}{crossover}</div>"


def _arms_table(analysis: Analysis, phase: PhaseResult) -> str:
    names = [MetricSpec.parse(m).name for m in analysis.metrics]  # "wait_s:mean:lower" → "wait_s"
    streams, ttft, tokens = _has_streams(phase), _has_ttft(phase), _has_tokens(phase)
    head = (
        "<tr><th class='l'>arm</th><th>weight</th><th>units</th><th>calls</th><th>error rate</th><th>p50 ms</th>"
        "<th>p99 ms</th>"
        + ("<th>streams</th>" if streams else "")
        + ("<th>TTFT p50 ms</th><th>TTFT p99 ms</th>" if streams or ttft else "")
        + ("<th>tokens/s</th>" if streams else "")
        + (
            "<th>generations</th><th>tokens in</th><th>in/call</th><th>tokens out</th><th>out/call</th>"
            "<th>cost</th><th>cost/call</th>"
            if tokens
            else ""
        )
        + "".join(f"<th>{escape(m)}</th>" for m in analysis.metrics)
        + "</tr>"
    )
    rows = []
    for arm in phase.arms:
        cells = []
        for name in names:
            metric = arm.metrics.get(name)
            cells.append(
                "<td>-</td>"
                if metric is None or metric.value is None
                else f"<td>{_num(metric.value)} <span class='muted'>[{_num(metric.ci.low)}, "
                f"{_num(metric.ci.high)}]</span></td>"
            )
        label = escape(arm.arm) + (" (control)" if arm.arm == phase.control else "")
        rows.append(
            f"<tr><td class='l'>{label}</td><td>{'-' if arm.weight is None else f'{arm.weight:g} %'}</td>"
            f"<td>{arm.units}</td><td>{arm.calls}</td><td>{fmt_rate(arm.error_rate)}</td>"
            f"<td>{fmt(arm.latency_p50_ms)}</td><td>{fmt(arm.latency_p99_ms)}</td>"
            + (f"<td>{arm.streams}</td>" if streams else "")
            + (f"<td>{fmt(arm.ttft_p50_ms)}</td><td>{fmt(arm.ttft_p99_ms)}</td>" if streams or ttft else "")
            + (f"<td>{fmt(arm.tokens_per_s)}</td>" if streams else "")
            + (
                f"<td>{arm.generations}</td><td>{arm.tokens_in}</td><td>{_num(arm.tokens_in_per_call)}</td>"
                f"<td>{arm.tokens_out}</td><td>{_num(arm.tokens_out_per_call)}</td><td>{_cost(arm.cost)}</td>"
                f"<td>{_cost(arm.cost_per_call)}</td>"
                if tokens
                else ""
            )
            + f"{''.join(cells)}</tr>"
        )
    notes = "".join(f"<p class='muted'>{escape(line)}</p>" for line in usage_lines(phase))
    return f"<table class='arms'>{head}{''.join(rows)}</table>{notes}"


def _lift_section(phase: PhaseResult) -> str:
    if not phase.comparisons:
        return "<p class='muted'>No comparison: the control or every other arm has no randomized unit.</p>"
    chart = _lift_chart(phase.comparisons)
    rows = []
    for c in phase.comparisons:
        seq = "<td>-</td><td>-</td>"
        if c.sequential_ci is not None:
            sequence = _interval(c.sequential_ci)
            if c.sequential_relative_ci is not None:
                sequence += f" ({_pct_interval(c.sequential_relative_ci)})"
            seq = f"<td>{escape(st.p_text(c.sequential_p_value))}</td><td>{escape(sequence)}</td>"
        cuped = "-" if c.cuped_theta is None else f"θ {c.cuped_theta:.3g}, unadjusted {_interval(c.unadjusted_ci)}"
        rows.append(
            f"<tr><td class='l'>{escape(c.arm)} vs {escape(c.control)}</td><td class='l'>{escape(c.metric)} "
            f"({escape(c.kind.value)})</td><td>{_num(c.control_value)}</td><td>{_num(c.arm_value)}</td>"
            f"<td>{_num(c.absolute_lift)}</td><td>{escape(_interval(c.absolute_ci))}</td>"
            f"<td>{_pct(c.relative_lift)}</td><td>{escape(_pct_interval(c.relative_ci))}</td>"
            f"<td>{escape(st.p_text(c.p_value))}</td>{seq}<td>{escape(_detectable(c))}</td>"
            f"<td class='l'>{escape(c.test)}</td>"
            f"<td class='l'>{escape(cuped)}</td><td class='l'>{escape(c.verdict)}</td></tr>"
        )
    table = (
        "<table><tr><th class='l'>comparison</th><th class='l'>metric</th><th>control</th><th>arm</th>"
        "<th>abs. lift</th><th>CI</th><th>rel. lift</th><th>CI</th><th>p</th><th>always-valid p</th>"
        "<th>confidence sequence</th><th>detectable (80 %)</th><th class='l'>test</th><th class='l'>CUPED</th>"
        "<th class='l'>verdict</th></tr>"
        f"{''.join(rows)}</table>"
    )
    caps = "".join(
        f"<p class='cap'>{escape(c.metric)}: {escape(c.arm)} vs {escape(c.control)} capped at {c.cap:.4g} per unit; "
        f"units capped: {escape(', '.join(f'{arm} {n}' for arm, n in c.capped_units.items()))}</p>"
        for c in phase.comparisons
        if c.cap is not None
    )
    margins = "".join(
        f"<p class='non-inferiority'>{escape(c.metric)}: {escape(c.arm)} vs {escape(c.control)} "
        f"{escape(c.non_inferiority.text)}</p>"
        for c in phase.comparisons
        if c.non_inferiority is not None
    )
    return f"<div class='charts lift'>{chart}</div>{table}{caps}{margins}{bayes_text.html_table(phase.comparisons)}"


def _lift_chart(comparisons: Sequence[MetricComparison]) -> str:
    """Relative lift per comparison with its interval (a forest plot), zero marked."""
    shown = [c for c in comparisons if c.relative_lift is not None and c.relative_ci.low is not None]
    if not shown:
        return charts.no_data()
    lows = [c.relative_ci.low or 0.0 for c in shown] + [0.0]
    highs = [c.relative_ci.high or 0.0 for c in shown] + [0.0]
    low, high = min(lows), max(highs)
    span = (high - low) or 1.0
    low, high = low - 0.1 * span, high + 0.1 * span
    row_h = 34
    height = charts.TOP + charts.BOTTOM + row_h * len(shown)
    left, plot_w = 150, charts.WIDTH - 150 - charts.RIGHT

    def x_of(value: float) -> float:
        return left + (value - low) / (high - low) * plot_w

    out = [
        f"<svg width='{charts.WIDTH}' height='{height}' viewBox='0 0 {charts.WIDTH} {height}' role='img' "
        "aria-label='relative lift per metric'>"
    ]
    zero = x_of(0.0)
    out.append(f"<line x1='{zero:.1f}' y1='{charts.TOP - 6}' x2='{zero:.1f}' y2='{height - charts.BOTTOM + 6}' "
               "stroke='#999' stroke-dasharray='3,3'/>")  # fmt: skip
    for tick, anchor in ((low, "start"), ((low + high) / 2, "middle"), (high, "end")):
        out.append(
            f"<text x='{x_of(tick):.1f}' y='{height - charts.BOTTOM + 20}' text-anchor='{anchor}'>"
            f"{tick * 100:+.1f} %</text>"
        )
    for row, c in enumerate(shown):
        y = charts.TOP + row_h * row + row_h / 2
        color = charts.CANDIDATE_COLOR if c.verdict == "worse" else "#1a7f37" if c.verdict == "better" else "#555"
        ci_low, ci_high = c.relative_ci.low or 0.0, c.relative_ci.high or 0.0
        label = f"{c.metric}: {c.arm} vs {c.control}"
        out.append(f"<text x='{left - 8}' y='{y + 4:.1f}' text-anchor='end'>{escape(label)}</text>")
        out.append(
            f"<line class='interval' data-label='{escape(label)}' x1='{x_of(ci_low):.1f}' y1='{y:.1f}' "
            f"x2='{x_of(ci_high):.1f}' y2='{y:.1f}' stroke='{color}' stroke-width='3'/>"
        )
        out.append(
            f"<circle cx='{x_of(c.relative_lift or 0.0):.1f}' cy='{y:.1f}' r='5' fill='{color}'>"
            f"<title>{escape(label)}: {_pct(c.relative_lift)} [{escape(_pct_interval(c.relative_ci))}]</title></circle>"
        )
    out.append("</svg>")
    return charts.figure(out, "relative lift with its interval")


def _timeline_chart(c: MetricComparison) -> str:
    """The absolute lift as it stood at the end of each time bucket, its fixed-horizon band, and the
    always-valid sequence (dashed) when there is one."""
    points = [
        _Point(
            p.until_ns,
            p.absolute,
            p.absolute_ci.low,
            p.absolute_ci.high,
            p.sequential_ci.low if p.sequential_ci else None,
            p.sequential_ci.high if p.sequential_ci else None,
        )
        for p in c.timeline
        if p.absolute is not None
    ]
    return _series_chart(f"{c.metric}: {c.arm} - {c.control} (absolute), cumulative", points, reference=0.0)


def _quantile_timeline_chart(q: QuantileComparison) -> str:
    """A quantile's ratio (arm over control) at the end of each time bucket, with its clustered interval and its
    always-valid sequence: how a slowdown showed up over the window, as the metrics' lift does."""
    points = [
        _Point(
            p.until_ns,
            p.ratio,
            p.ratio_ci.low,
            p.ratio_ci.high,
            p.sequential_ratio_ci.low if p.sequential_ratio_ci else None,
            p.sequential_ratio_ci.high if p.sequential_ratio_ci else None,
        )
        for p in q.timeline
        if p.ratio is not None
    ]
    return _series_chart(f"{q.metric} {q.name}: {q.arm} / {q.control} (ratio), cumulative", points, reference=1.0)


@dataclass(frozen=True, slots=True)
class _Point:
    """One point of a timeline chart: the estimate, its fixed-horizon interval and its always-valid sequence."""

    until_ns: int
    value: float
    low: float | None
    high: float | None
    sequence_low: float | None
    sequence_high: float | None


def _series_chart(title: str, points: Sequence[_Point], *, reference: float) -> str:
    """An estimate over time, its band, the sequence's edges (dashed) and a dotted line at ``reference`` (no effect:
    0 for a lift, 1 for a ratio)."""
    if not points:
        return charts.no_data()
    values: list[float] = [reference]
    for p in points:
        values += [v for v in (p.value, p.low, p.high, p.sequence_low, p.sequence_high) if v is not None]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    low, high = low - 0.05 * span, high + 0.05 * span
    start, end = points[0].until_ns, points[-1].until_ns
    plot_w = charts.WIDTH - charts.LEFT - charts.RIGHT
    plot_h = charts.HEIGHT - charts.TOP - charts.BOTTOM

    def x_of(t: int) -> float:
        return charts.LEFT + ((t - start) / (end - start) if end > start else 1.0) * plot_w

    def y_of(v: float) -> float:
        return charts.TOP + (1 - (v - low) / (high - low)) * plot_h

    out = [charts.svg_open(title)]
    for tick in (low, reference, high):
        out.append(f"<text x='{charts.LEFT - 6}' y='{y_of(tick) + 4:.1f}' text-anchor='end'>{fmt(tick)}</text>")
    zero = y_of(reference)
    out.append(f"<line x1='{charts.LEFT}' y1='{zero:.1f}' x2='{charts.LEFT + plot_w}' y2='{zero:.1f}' stroke='#999' "
               "stroke-dasharray='3,3'/>")  # fmt: skip
    band = _band(points, x_of, y_of)
    if band:
        out.append(f"<polygon class='band' points='{band}' fill='#4e79a7' fill-opacity='0.18' stroke='none'/>")
    line = " ".join(f"{x_of(p.until_ns):.1f},{y_of(p.value):.1f}" for p in points)
    out.append(
        f"<polyline class='series' data-label='lift' points='{line}' fill='none' stroke='#4e79a7' stroke-width='2'/>"
    )
    for side in ("low", "high"):
        sequence = [(p.until_ns, value) for p in points if (value := getattr(p, f"sequence_{side}")) is not None]
        if sequence:
            path = " ".join(f"{x_of(t):.1f},{y_of(v):.1f}" for t, v in sequence)
            out.append(
                f"<polyline class='sequence' data-label='confidence sequence {side}' points='{path}' fill='none' "
                "stroke='#e15759' stroke-width='1.5' stroke-dasharray='5,3'/>"
            )
    out.append(
        f"<text x='{charts.LEFT}' y='{charts.HEIGHT - 8}'>{escape(format_instant(start))}</text>"
        f"<text x='{charts.LEFT + plot_w}' y='{charts.HEIGHT - 8}' text-anchor='end'>"
        f"{escape(format_instant(end))}</text>"
    )
    out.append(charts.legend(0, "lift and interval" if reference == 0.0 else "ratio and interval", "#4e79a7"))
    if any(p.sequence_low is not None or p.sequence_high is not None for p in points):
        out.append(charts.legend(1, "always-valid", "#e15759"))
    out.append("</svg>")
    return charts.figure(out, title)


def _band(points: Sequence[_Point], x_of: Callable[[int], float], y_of: Callable[[float], float]) -> str:
    """The fixed-horizon interval at each point as one polygon: along the upper bounds, back along the lower."""
    upper: list[str] = []
    lower: list[str] = []
    for p in points:
        if p.low is None or p.high is None:
            continue
        upper.append(f"{x_of(p.until_ns):.1f},{y_of(p.high):.1f}")
        lower.append(f"{x_of(p.until_ns):.1f},{y_of(p.low):.1f}")
    return " ".join(upper + lower[::-1])


def _non_randomized(analysis: Analysis) -> str:
    if not analysis.non_randomized:
        return "<p class='muted'>None: every call in the window was randomized (hash or random).</p>"
    rows = "".join(
        f"<tr><td class='l'><code>{escape(r.phase or '-')}</code></td><td class='l'>{escape(r.assignment)}</td>"
        f"<td class='l'>{escape(r.arm)}</td><td>{r.calls}</td><td>{fmt_rate(r.error_rate)}</td>"
        f"<td>{fmt(r.latency_p50_ms)}</td><td>{fmt(r.latency_p99_ms)}</td></tr>"
        for r in analysis.non_randomized
    )
    return (
        "<p class='muted'>Pinned, spilled and retried calls (and records without an assignment): counted here, never "
        "in a comparison, since their arm was not chosen at random.</p>"
        "<table class='non-randomized'><tr><th class='l'>phase</th><th class='l'>assignment</th><th class='l'>arm</th>"
        f"<th>calls</th><th>error rate</th><th>p50 ms</th><th>p99 ms</th></tr>{rows}</table>"
    )


def _interval(interval: Interval | None) -> str:
    if interval is None or interval.low is None or interval.high is None:
        return "-"
    return f"{interval.low:+.4g} .. {interval.high:+.4g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.2f} %"


def _detectable(c: MetricComparison) -> str:
    """The minimum detectable effect at the arms' sizes, relative when the control's value allows."""
    if c.minimum_detectable_relative_effect is not None:
        return f"±{c.minimum_detectable_relative_effect * 100:.2f} %"
    return "-" if c.minimum_detectable_effect is None else f"±{c.minimum_detectable_effect:.4g}"


def _pct_interval(interval: Interval | None) -> str:
    if interval is None or interval.low is None or interval.high is None:
        return "-"
    return f"{interval.low * 100:+.2f} .. {interval.high * 100:+.2f} %"
