"""How the Bayesian reading shows: the title's note on the engine and prior, and the report's table of it."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from splitstream.analysis import bayes
from splitstream.analysis.model import Analysis, Interval, MetricComparison


def engine_text(analysis: Analysis) -> str:
    """``Bayesian (flat prior; better at 95 % chance to beat control)``."""
    prior = bayes.Prior(analysis.prior_mean or 0.0, analysis.prior_sd)
    threshold = analysis.bayes_threshold or bayes.DEFAULT_THRESHOLD
    return f"Bayesian ({prior}; better at {threshold * 100:g} % chance to beat control)"


def html_table(comparisons: Sequence[MetricComparison]) -> str:
    """The posterior per comparison; empty when no comparison has one (``--engine frequentist``)."""
    read = [c for c in comparisons if c.bayes is not None]
    if not read:
        return ""
    rows = []
    for c in read:
        b = c.bayes
        assert b is not None
        rows.append(
            f"<tr><td class='l'>{escape(c.arm)} vs {escape(c.control)}</td><td class='l'>{escape(c.metric)} "
            f"({escape(c.direction)} is better)</td><td>{b.relative_mean * 100:+.2f} %</td>"
            f"<td>{escape(_pct_interval(b.relative_credible_interval))}</td>"
            f"<td>{_num(b.absolute_mean)}</td><td>{escape(_interval(b.absolute_credible_interval))}</td>"
            f"<td>{escape(bayes.percent(b.chance_to_beat_control))}</td>"
            f"<td>{escape(bayes.percent(b.expected_loss_choosing_arm))}</td>"
            f"<td>{escape(bayes.percent(b.expected_loss_keeping_control))}</td>"
            f"<td class='l'>{escape(c.verdict)}</td></tr>"
        )
    return (
        "<h4>Bayesian reading</h4><table class='bayes'><tr><th class='l'>comparison</th><th class='l'>metric</th>"
        "<th>rel. lift (posterior mean)</th><th>credible interval</th><th>abs. lift</th><th>credible interval</th>"
        "<th>chance to beat control</th><th>expected loss, choosing the arm</th>"
        "<th>expected loss, keeping the control</th><th class='l'>verdict</th></tr>"
        f"{''.join(rows)}</table>"
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4g}"


def _interval(interval: Interval) -> str:
    if interval.low is None or interval.high is None:
        return "-"
    return f"{interval.low:+.4g} .. {interval.high:+.4g}"


def _pct_interval(interval: Interval) -> str:
    if interval.low is None or interval.high is None:
        return "-"
    return f"{interval.low * 100:+.2f} .. {interval.high * 100:+.2f} %"
