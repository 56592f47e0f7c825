"""``report.html``: one self-contained page (inline CSS and SVG, no script, nothing fetched).

It has to open from a CI artifact store, an e-mail attachment or an air-gapped laptop, so
the charts are SVG drawn here from the summary's histograms rather than a charting library
from a CDN. Sections: verdict and counts, latency distributions (reference vs candidate, as
CDFs and as p50/p95/p99 bars), send lag, mismatches per output, the worst calls with their
request ids, status changes, the per-version breakdown, and (when the window held token streams)
the streams: token match rate, edit-distance histogram, TTFT and inter-token-gap CDFs, and a few
diverging streams with both texts side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

from splitstream.common import charts
from splitstream.common.files import atomic_write
from splitstream.common.timewindow import format_instant
from splitstream.replayer.compare import REDACTED_AT_RECORDING, RESPONSE_NOT_RECORDED
from splitstream.replayer.noise_report import noise_section
from splitstream.replayer.stats import LogHistogram
from splitstream.replayer.summary import REQUEST_NOT_RECORDED, Quantiles, Summary

#: Why an output was not compared, as the report words it.
_NOT_COMPARED = {
    REDACTED_AT_RECORDING: "redacted at recording",
    RESPONSE_NOT_RECORDED: "response not recorded (too large)",
}
#: Why a call was not replayed, as the report words it.
_NOT_REPLAYED = {REQUEST_NOT_RECORDED: "request not recorded (too large)"}

#: What the overview says of a metric with nothing to measure it on (tables show "-"): a 0 % would read
#: as "compared, all fine".
NOT_MEASURED = "not measured"
REFERENCE_COLOR = charts.REFERENCE_COLOR
CANDIDATE_COLOR = charts.CANDIDATE_COLOR
#: The streams section's own colours, so a test can tell its charts were drawn.
STREAM_REFERENCE_COLOR = "#17becf"
STREAM_CANDIDATE_COLOR = "#bcbd22"
PALETTE = charts.PALETTE[1:]

_CSS = charts.PAGE_CSS + "table.texts pre{white-space:pre-wrap;max-width:380px;margin:0;font-size:12px}\n"


def write_report(path: Path, summary: Summary, histograms: Mapping[str, LogHistogram]) -> None:
    atomic_write(path, render(summary, histograms))


def render(summary: Summary, histograms: Mapping[str, LogHistogram]) -> str:
    reference_label = "compare-to" if summary.reference == "compare_to" else "recorded"
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width,initial-scale=1'>",
        f"<title>splitstream replay: {escape(', '.join(summary.window.models))}</title>",
        f"<style>{_CSS}</style></head><body>",
        _header(summary),
        _overview(summary),
        "<h2 id='latency'>Latency: " + escape(reference_label) + " vs replayed</h2>",
        _latency_section(summary, histograms, reference_label),
        "<h2 id='send-lag'>Send lag (actual minus planned send time)</h2>",
        _send_lag_section(summary, histograms),
        "<h2 id='mismatches'>Mismatches per output</h2>",
        _outputs_section(summary),
        "<h2 id='worst'>Worst calls</h2>",
        _worst_section(summary),
        "<h2 id='status'>Status changes</h2>",
        _status_section(summary),
        "<h2 id='versions'>Per-version breakdown</h2>",
        _versions_section(summary, histograms, reference_label),
        *(
            ["<h2 id='streams'>Token streams</h2>", _streams_section(summary, histograms, reference_label)]
            if summary.streams is not None
            else []
        ),
        *(["<h2 id='http'>HTTP calls</h2>", _http_section(summary)] if summary.http is not None else []),
        *(["<h2 id='noise'>Noise floor</h2>", noise_section(summary.noise)] if summary.noise is not None else []),
        "</body></html>",
    ]
    return "\n".join(parts)


# -- sections ------------------------------------------------------------------------------


def _header(summary: Summary) -> str:
    window = summary.window
    gate = summary.gate
    verdict = ""
    if gate is not None:
        if gate.passed:
            verdict = "<p>Gate: <span class='pass'>passed</span> — " + escape(", ".join(b.bound for b in gate.bounds))
        else:
            verdict = "<p>Gate: <span class='fail'>failed</span> — " + escape("; ".join(gate.failures))
        verdict += "</p>"
    interrupted = "<p class='fail'>Interrupted: partial results.</p>" if summary.interrupted else ""
    nothing = (
        "<p class='fail'>No call completed: every rate below is not measured.</p>"
        if summary.counts.completed == 0
        else ""
    )
    target = escape(summary.target)
    compare = f" and <code>{escape(summary.compare_to)}</code>" if summary.compare_to else ""
    pin = f", pinned to <code>{escape(summary.pin_version)}</code>" if summary.pin_version else ""
    return (
        f"<h1>Replay of {escape(', '.join(window.models))}</h1>"
        f"<p class='muted'>Window {escape(format_instant(window.since_unix_ns))} → "
        f"{escape(format_instant(window.until_unix_ns))} (by router receive time); "
        f"target <code>{target}</code>{compare}{pin}; speed {escape(str(summary.speed))}, "
        f"concurrency {summary.concurrency}; rtol {summary.tolerance.rtol:g}, "
        f"atol {summary.tolerance.atol:g}.</p>{interrupted}{nothing}{verdict}"
    )


def _overview(summary: Summary) -> str:
    counts = summary.counts
    outcomes = summary.outcomes
    metrics = summary.metrics
    skipped = ", ".join(f"{k}: {v}" for k, v in counts.skipped.items()) or "0"
    rows: list[tuple[str, object]] = [
        ("calls selected", counts.selected),
        ("sent / completed / not sent", f"{counts.sent} / {counts.completed} / {counts.not_sent}"),
        ("send errors (never reached the target)", counts.send_errors),
        ("match / mismatch / status change", f"{outcomes.match} / {outcomes.mismatch} / {outcomes.status_change}"),
    ]
    # Records the router stored without a payload for size: shown only when there are some.
    rows += [(f"not replayed: {_NOT_REPLAYED.get(why, why)}", count) for why, count in counts.not_replayed.items()]
    if outcomes.not_compared:
        rows.append(("not compared: response not recorded (too large)", outcomes.not_compared))
    rows += [
        ("mismatch rate (of calls both answered OK)", _fmt_rate(metrics.mismatch_rate, none=NOT_MEASURED)),
        ("error rate (replayed)", _fmt_rate(metrics.error_rate, none=NOT_MEASURED)),
        ("p99 ratio (replayed / reference)", _fmt(metrics.p99_ratio, none=NOT_MEASURED)),
        ("entries skipped", skipped),
        ("duplicates dropped", summary.selection.duplicates),
        ("released out of order", summary.selection.out_of_order),
        ("max calls in flight", summary.max_in_flight),
        ("replay rate", f"{_fmt(summary.replay_rate_calls_per_s)} calls/s"),
    ]
    body = "".join(f"<tr><th class='l'>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f"<h2 id='overview'>Overview</h2><table>{body}</table>"


def _latency_section(summary: Summary, histograms: Mapping[str, LogHistogram], reference_label: str) -> str:
    latency = summary.latency
    quantiles = ("p50", "p95", "p99")
    cdf = cdf_chart(
        [
            (reference_label, REFERENCE_COLOR, histograms["reference_latency"]),
            ("replayed", CANDIDATE_COLOR, histograms["candidate_latency"]),
        ],
        title="latency CDF",
    )
    bars = grouped_bars(
        ["p50", "p95", "p99"],
        [
            (reference_label, REFERENCE_COLOR, [_ms(latency.reference, q) for q in quantiles]),
            ("replayed", CANDIDATE_COLOR, [_ms(latency.candidate, q) for q in quantiles]),
        ],
        title="latency percentiles (ms)",
    )
    rows = "".join(
        f"<tr><th class='l'>{q}</th><td>{_fmt(_ms(latency.reference, q))}</td>"
        f"<td>{_fmt(_ms(latency.candidate, q))}</td><td>{_fmt(getattr(latency, f'{q}_ratio'))}</td></tr>"
        for q in quantiles
    )
    note = (
        "<p class='muted'>Recorded latency is the router's receive-to-answer time; replayed latency is measured "
        "by the replayer (send to answer), so it includes the network hop and client overhead.</p>"
        if reference_label == "recorded"
        else ""
    )
    table = (
        f"<table><tr><th class='l'>quantile</th><th>{escape(reference_label)} ms</th><th>replayed ms</th>"
        f"<th>ratio</th></tr>{rows}</table>"
    )
    return f"<div class='charts'>{cdf}{bars}</div>{table}{note}"


def _send_lag_section(summary: Summary, histograms: Mapping[str, LogHistogram]) -> str:
    lag = summary.send_lag
    if lag is None:
        return (
            "<p class='muted'>Not timed (<code>--speed max</code>): calls left as fast as the concurrency allowed.</p>"
        )
    chart = cdf_chart([("send lag", CANDIDATE_COLOR, histograms["send_lag"])], title="send lag CDF")
    table = (
        "<table><tr><th>calls</th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th><th>max ms</th></tr>"
        f"<tr><td>{lag.count}</td><td>{_fmt(lag.p50_ms)}</td><td>{_fmt(lag.p95_ms)}</td>"
        f"<td>{_fmt(lag.p99_ms)}</td><td>{_fmt(lag.max_ms)}</td></tr></table>"
    )
    return f"<div class='charts'>{chart}</div>{table}"


def _outputs_section(summary: Summary) -> str:
    outputs = summary.outputs
    if not outputs:
        return "<p class='muted'>No call was answered OK on both sides, so no output was compared.</p>"
    # Outputs redacted at recording are listed with the calls they were left out of; an output
    # never compared has no rates to show (a 0 % would read as "compared, all fine").
    skipped = any(o.not_compared for o in outputs.values())
    rows = []
    for name, o in outputs.items():
        reasons = ", ".join(f"{k}: {v}" for k, v in o.reasons.items())
        not_compared = ", ".join(f"{count} ({_NOT_COMPARED.get(why, why)})" for why, count in o.not_compared.items())
        rows.append(
            f"<tr><td class='l'><code>{escape(name)}</code></td><td>{o.calls}</td><td>{o.mismatched_calls}</td>"
            f"<td>{_fmt_rate(o.mismatch_rate)}</td><td>{_fmt_rate(o.element_mismatch_rate)}</td>"
            f"<td>{_fmt(o.max_abs_error)}</td><td>{_fmt(o.argmax_agreement)}</td>"
            f"<td>{_fmt(o.topk_agreement)}</td><td class='l'>{escape(reasons)}</td>"
            + (f"<td class='l'>{escape(not_compared)}</td>" if skipped else "")
            + "</tr>"
        )
    chart = grouped_bars(
        list(outputs),
        [("mismatch rate", CANDIDATE_COLOR, [o.mismatch_rate for o in outputs.values()])],
        title="share of calls mismatched, per output",
    )
    table = (
        "<table><tr><th class='l'>output</th><th>calls</th><th>mismatched</th><th>mismatch rate</th>"
        "<th>element mismatch rate</th><th>max abs error</th><th>argmax agreement</th><th>top-k agreement</th>"
        "<th class='l'>reasons</th>"
        + ("<th class='l'>not compared</th>" if skipped else "")
        + f"</tr>{''.join(rows)}</table>"
    )
    reasons_seen = {why for o in outputs.values() for why in o.not_compared}
    note = "".join(
        f"<p class='muted'>{text}</p>"
        for why, text in (
            (
                REDACTED_AT_RECORDING,
                "Not compared (redacted at recording): the recorder dropped the output or zeroed its data, "
                "so the recorded answer does not hold what the model said.",
            ),
            (
                RESPONSE_NOT_RECORDED,
                "Not compared (response not recorded): the record was too large for the router's "
                "<code>--record-batch-max-bytes</code>, so it was stored without its response; the status "
                "is still compared.",
            ),
        )
        if why in reasons_seen
    )
    return f"<div class='charts'>{chart}</div>{table}{note}"


def _worst_section(summary: Summary) -> str:
    worst = summary.worst_calls
    if not worst:
        return "<p class='pass'>Every compared call matched.</p>"
    rows = []
    for line in worst:
        outputs = line.get("outputs", {})
        detail = "; ".join(
            f"{name}: {o['mismatches']}/{o['elements']} differ, max abs {_fmt(o['max_abs_error'])}"
            + (f" ({o['reason']}{': ' + o['detail'] if o.get('detail') else ''})" if o.get("reason") else "")
            for name, o in outputs.items()
            if not o["match"]
        )
        if line.get("kind") == "stream" and "stream" in line:
            stream = line["stream"]
            detail = (
                f"token stream: first divergence at token {_fmt(stream.get('first_divergence'))}, "
                f"edit distance {_fmt(stream.get('edit_distance'))}, "
                f"{stream.get('reference_tokens')} vs {stream.get('candidate_tokens')} tokens"
            )
        if line.get("status_change"):
            message = line["replayed"].get("message", "")
            detail = f"{line['status_change']} {message}".strip()
        rows.append(
            f"<tr><td class='l'><code>{escape(line['request_id'])}</code></td>"
            f"<td class='l'><code>{escape(line['replay_request_id'])}</code></td>"
            f"<td class='l'>{escape(line['outcome'])}</td>"
            f"<td class='l'>{escape(line['recorded']['version'])} → {escape(line['replayed']['version'])}</td>"
            f"<td class='l'>{escape(detail)}</td></tr>"
        )
    return (
        "<table><tr><th class='l'>request id</th><th class='l'>replay request id</th><th class='l'>outcome</th>"
        f"<th class='l'>versions</th><th class='l'>what differs</th></tr>{''.join(rows)}</table>"
        "<p class='muted'>Every call is in <code>results.jsonl</code>; these are the ones that differ most.</p>"
    )


def _status_section(summary: Summary) -> str:
    changes = summary.status_changes
    transitions = changes.transitions
    head = (
        f"<p>OK → error: <b>{changes.ok_to_error}</b>, error → OK: <b>{changes.error_to_ok}</b>, "
        f"error → another error: <b>{changes.error_to_other_error}</b>.</p>"
    )
    if not transitions:
        return head
    rows = "".join(f"<tr><td class='l'>{escape(k)}</td><td>{v}</td></tr>" for k, v in transitions.items())
    return head + f"<table><tr><th class='l'>transition</th><th>calls</th></tr>{rows}</table>"


def _versions_section(summary: Summary, histograms: Mapping[str, LogHistogram], reference_label: str) -> str:
    versions = summary.versions
    if not versions:
        return "<p class='muted'>No completed calls.</p>"
    rows = []
    for version, group in versions.items():
        served = ", ".join(f"{k}: {v}" for k, v in group.candidate_versions.items())
        lat = group.latency
        rows.append(
            f"<tr><td class='l'><code>{escape(version)}</code></td><td class='l'>{escape(served)}</td>"
            f"<td>{group.completed}</td><td>{group.matches}</td><td>{group.mismatches}</td>"
            f"<td>{group.status_changes}</td><td>{_fmt_rate(group.mismatch_rate)}</td>"
            f"<td>{_fmt_rate(group.candidate_error_rate)}</td><td>{_fmt(lat.reference.p99_ms)}</td>"
            f"<td>{_fmt(lat.candidate.p99_ms)}</td><td>{_fmt(lat.p99_ratio)}</td></tr>"
        )
    series = [
        (f"replayed ({version})", PALETTE[i % len(PALETTE)], histograms[f"candidate_latency:{version}"])
        for i, version in enumerate(versions)
        if f"candidate_latency:{version}" in histograms
    ]
    chart = cdf_chart(series, title="replayed latency CDF by reference version") if series else ""
    table = (
        f"<table><tr><th class='l'>{escape(reference_label)} version</th><th class='l'>replayed by</th>"
        "<th>calls</th><th>match</th><th>mismatch</th><th>status change</th><th>mismatch rate</th>"
        f"<th>error rate</th><th>{escape(reference_label)} p99 ms</th><th>replayed p99 ms</th><th>p99 ratio</th></tr>"
        f"{''.join(rows)}</table>"
    )
    return f"<div class='charts'>{chart}</div>{table}"


def _http_section(summary: Summary) -> str:
    """HTTP calls per route kind, and whether the usage their answers reported agrees (the text is compared in
    the streams section above, the statuses in the status changes)."""
    http = summary.http
    assert http is not None
    rows = "".join(
        f"<tr><td class='l'><code>{escape(api)}</code></td><td>{count}</td></tr>" for api, count in http.apis.items()
    )
    return (
        f"<p>HTTP calls: <b>{http.calls}</b>; usage compared on <b>{http.usage_compared}</b> (the reference "
        f"reported tokens), differing on <b>{http.usage_mismatches}</b> (usage mismatch rate "
        f"<b>{_fmt_rate(http.usage_mismatch_rate, none=NOT_MEASURED)}</b>: prompt tokens "
        f"{http.prompt_tokens_mismatches}, completion tokens {http.completion_tokens_mismatches}); bodies "
        f"differing (compared whole) <b>{http.body_mismatches}</b>.</p>"
        f"<table><tr><th class='l'>route</th><th>calls</th></tr>{rows}</table>"
    )


#: Diverging streams shown with their texts side by side.
STREAM_EXAMPLES = 5


def _streams_section(summary: Summary, histograms: Mapping[str, LogHistogram], reference_label: str) -> str:
    streams = summary.streams
    assert streams is not None
    rows = []
    for version, group in streams.versions.items():
        rows.append(
            f"<tr><td class='l'><code>{escape(version)}</code></td><td>{group.streams}</td><td>{group.compared}</td>"
            f"<td>{group.exact_matches}</td><td>{_fmt_rate(group.token_match_rate)}</td>"
            f"<td>{_fmt(group.mean_edit_distance)}</td><td>{_fmt(group.mean_text_edit_distance)}</td>"
            f"<td>{_fmt(group.first_divergence_p50)}</td>"
            f"<td>{_fmt(group.ttft.reference.p50_ms)} / {_fmt(group.ttft.candidate.p50_ms)}</td>"
            f"<td>{_fmt(group.ttft.reference.p99_ms)} / {_fmt(group.ttft.candidate.p99_ms)}</td>"
            f"<td>{_fmt(group.itl.reference.p50_ms)} / {_fmt(group.itl.candidate.p50_ms)}</td>"
            f"<td>{_fmt(group.itl.reference.p99_ms)} / {_fmt(group.itl.candidate.p99_ms)}</td></tr>"
        )
    head = (
        f"<p>Streams: <b>{streams.streams}</b>, compared <b>{streams.compared}</b>, exact token match "
        f"<b>{_fmt_rate(streams.token_match_rate, none=NOT_MEASURED)}</b>, mean edit distance "
        f"<b>{_fmt(streams.mean_edit_distance, none=NOT_MEASURED)}</b>, TTFT p99 ratio "
        f"<b>{_fmt(streams.ttft.p99_ratio, none=NOT_MEASURED)}</b>, ITL p99 ratio "
        f"<b>{_fmt(streams.itl.p99_ratio, none=NOT_MEASURED)}</b>, "
        f"{_fmt(streams.tokens_per_s)} tokens/s replayed.</p>"
    )
    edges = streams.edit_distance_edges
    labels = ["0"] + [f"≤{upper:g}" for upper in edges[2:]]
    histogram = grouped_bars(
        labels,
        [("streams", STREAM_CANDIDATE_COLOR, [float(count) for count in streams.edit_distance_bins])],
        title="streams by normalized edit distance",
    )
    ttft = cdf_chart(
        [
            (reference_label, STREAM_REFERENCE_COLOR, histograms["reference_ttft"]),
            ("replayed", STREAM_CANDIDATE_COLOR, histograms["candidate_ttft"]),
        ],
        title="time to first token CDF",
    )
    itl = cdf_chart(
        [
            (reference_label, STREAM_REFERENCE_COLOR, histograms["reference_itl"]),
            ("replayed", STREAM_CANDIDATE_COLOR, histograms["candidate_itl"]),
        ],
        title="inter-token gap CDF",
    )
    table = (
        f"<table><tr><th class='l'>{escape(reference_label)} version</th><th>streams</th><th>compared</th>"
        "<th>exact</th><th>token match rate</th><th>edit distance</th><th>text edit distance</th>"
        f"<th>first divergence p50</th><th>TTFT p50 ms ({escape(reference_label)} / replayed)</th>"
        "<th>TTFT p99 ms</th><th>ITL p50 ms</th><th>ITL p99 ms</th></tr>"
        f"{''.join(rows)}</table>"
    )
    examples = [line for line in summary.worst_calls if line.get("kind") == "stream" and "stream" in line]
    shown = []
    for line in examples[:STREAM_EXAMPLES]:
        diff = line["stream"]
        shown.append(
            f"<tr><td class='l'><code>{escape(line['request_id'])}</code></td>"
            f"<td class='l'>{escape(line['recorded']['version'])} → {escape(line['replayed']['version'])}</td>"
            f"<td>{_fmt(diff.get('first_divergence'))}</td><td>{_fmt(diff.get('edit_distance'))}</td>"
            f"<td class='l'><pre>{escape(str(diff.get('reference_text', '')))}</pre></td>"
            f"<td class='l'><pre>{escape(str(diff.get('candidate_text', '')))}</pre></td></tr>"
        )
    diverging = (
        "<h3>Diverging streams</h3><table class='texts'><tr><th class='l'>request id</th><th class='l'>versions</th>"
        f"<th>first divergence</th><th>edit distance</th><th class='l'>{escape(reference_label)} text</th>"
        f"<th class='l'>replayed text</th></tr>{''.join(shown)}</table>"
        if shown
        else "<p class='pass'>Every compared stream matched token for token.</p>"
    )
    note = (
        "<p class='muted'>A stream is compared token by token (a token: one response's <code>text_output</code>); "
        "a record cut by the per-stream cap, or cancelled by its client, is compared on its recorded prefix. "
        "Recorded TTFT and gaps are the router's clock; replayed ones the replayer's (they include the hop).</p>"
    )
    return f"{head}<div class='charts'>{histogram}{ttft}{itl}</div>{table}{diverging}{note}"


# -- charts (drawn by splitstream.common.charts) ----------------------------------------------


def cdf_chart(series: Sequence[tuple[str, str, LogHistogram]], *, title: str) -> str:
    """Cumulative distributions of histograms (seconds) on a log time axis (ms), one polyline per series."""
    return charts.cdf_chart(
        [
            charts.CdfSeries(label, color, [(s * 1000, f) for s, f in h.cdf_points()], max(h.min, 1e-6) * 1000)
            for label, color, h in series
            if h.count
        ],
        title=title,
    )


grouped_bars = charts.grouped_bars
_fmt = charts.fmt
_fmt_rate = charts.fmt_rate


def _ms(quantiles: Quantiles, q: str) -> float | None:
    """``p50`` → the ``p50_ms`` field."""
    value: float | None = getattr(quantiles, f"{q}_ms")
    return value
