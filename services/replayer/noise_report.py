"""The report's noise-floor section: per output, the control's and the candidate's differences from the
reference side by side, the floor between them, and the verdict (see :mod:`splitstream.replayer.noise`)."""

from __future__ import annotations

from html import escape

from splitstream.common.charts import grouped_bars
from splitstream.replayer.noise import Distribution, FieldNoise, NoiseSummary

CONTROL_COLOR = "#1f77b4"
CANDIDATE_COLOR = "#d62728"


def noise_section(noise: NoiseSummary) -> str:
    if not noise.fields:
        return "<p class='muted'>No call was answered OK by the reference, the control and the candidate.</p>"
    rows = "".join(_row(name, field) for name, field in noise.fields.items())
    names = list(noise.fields)
    chart = grouped_bars(
        names,
        [
            ("control", CONTROL_COLOR, [f.control_rate for f in noise.fields.values()]),
            ("candidate", CANDIDATE_COLOR, [f.candidate_rate for f in noise.fields.values()]),
        ],
        title="share of elements beyond the floor (texts: share that differ), control vs candidate",
    )
    rate = noise.diff_above_noise_rate
    shown = "not measured (no trusted floor)" if rate is None else f"{rate:.2%}"
    return (
        f"<p>Control: <code>{escape(noise.control)}</code>; floor: the {noise.quantile:g} quantile of the "
        f"control's absolute differences per output; trusted after {noise.min_calls} calls; "
        f"Newcombe intervals at {noise.field_confidence:.4g} each ({noise.confidence:.0%} for the run). "
        f"Fields above the noise: {escape(shown)}.</p>"
        "<table><tr><th class='l'>field</th><th>calls</th><th>floor</th><th>control beyond</th>"
        "<th>candidate beyond</th><th>excess (interval)</th><th>control p50 / p99 / p99.9 / max</th>"
        "<th>candidate p50 / p99 / p99.9 / max</th><th class='l'>verdict</th></tr>"
        f"{rows}</table>{chart}"
    )


def _row(name: str, field: FieldNoise) -> str:
    if field.above_noise is None:
        verdict = "<span class='muted'>floor not trusted yet</span>"
    elif field.above_noise:
        verdict = "<span class='fail'>above the noise</span>"
    else:
        verdict = "<span class='pass'>within the noise</span>"
    interval = (
        ""
        if field.excess_low is None or field.excess_high is None
        else f"{field.excess_low:+.4%} … {field.excess_high:+.4%}"
    )
    if field.positions:
        above = field.positions_above or []
        shown = ", ".join(str(p) for p in above[:20]) + (" …" if len(above) > 20 else "")
        verdict += f"<br><span class='muted'>token positions above the noise: {escape(shown or 'none')}</span>"
    return (
        f"<tr><td class='l'><code>{escape(name)}</code></td><td>{field.calls}</td><td>{_number(field.floor)}</td>"
        f"<td>{_rate(field.control_rate)}</td><td>{_rate(field.candidate_rate)}</td><td>{escape(interval)}</td>"
        f"<td>{_distribution(field.control)}</td><td>{_distribution(field.candidate)}</td>"
        f"<td class='l'>{verdict}</td></tr>"
    )


def _distribution(distribution: Distribution | None) -> str:
    if distribution is None:
        return ""
    values = (distribution.p50, distribution.p99, distribution.p999, distribution.max)
    return escape(" / ".join(_number(v) for v in values))


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3%}"
