"""The replayer's pure parts, in-process: time parsing, selection order and de-duplication, comparison,
histograms, the gate, the scheduler's clock, and the report's HTML."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.timewindow import BadTime, parse_instant_ns
from splitstream.replayer.compare import Answer, Tolerance, compare_answers
from splitstream.replayer.gate import Bound, evaluate, parse_gate
from splitstream.replayer.main import build_parser
from splitstream.replayer.report import render
from splitstream.replayer.schedule import OpenLoopClock, sleep_until
from splitstream.replayer.selection import RecentIds, ReorderBuffer, Selection, StatusFilter
from splitstream.replayer.sender import metadata_problem
from splitstream.replayer.stats import LogHistogram
from splitstream.replayer.summary import METRICS, Metrics, Summary

NOW = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z
TOL = Tolerance(rtol=1e-3, atol=1e-6)


def response(**outputs: Any) -> bytes:
    message = oip.ModelInferResponse(model_name="m", model_version="v1")
    for name, array in outputs.items():
        array = np.asarray(array)
        message.outputs.add(name=name, datatype=tensors.datatype_of(array), shape=list(array.shape))
        message.raw_output_contents.append(tensors.to_raw(array))
    return message.SerializeToString()


def ok(**outputs: Any) -> Answer:
    return Answer(0, response(**outputs))


# -- time window ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("now", NOW),
        ("-15m", NOW - 15 * 60 * 10**9),
        ("-2h", NOW - 2 * 3600 * 10**9),
        ("-1d", NOW - 86400 * 10**9),
        ("-90s", NOW - 90 * 10**9),
        ("1767225600", NOW),
        ("1767225600.25", NOW + 250_000_000),
        ("2026-01-01T00:00:00Z", NOW),
        ("2026-01-01T01:00:00+01:00", NOW),
        ("2025-12-31T23:59:59.5-00:00", NOW - 500_000_000),
    ],
)
def test_every_accepted_time_form_names_the_same_instant(text: str, expected: int) -> None:
    assert parse_instant_ns(text, now_ns=NOW) == expected


@pytest.mark.parametrize("text", ["2026-01-01T00:00:00", "yesterday", "-15x", "", "14:02", "-10", "-nanm"])
def test_naive_or_unreadable_times_are_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(BadTime, match="timezone|expected"):
        parse_instant_ns(text, now_ns=NOW)


# -- selection pieces ----------------------------------------------------------------------


def test_status_filters_read_ok_error_and_codes_by_name_or_number() -> None:
    mixed = StatusFilter.parse("ok, INVALID_ARGUMENT, 14")
    assert [mixed.matches(code) for code in (0, 3, 14)] == [True, True, True]
    assert not mixed.matches(13)
    errors = StatusFilter.parse("error")
    assert [errors.matches(code) for code in (3, 0)] == [True, False]
    with pytest.raises(ValueError, match="unknown gRPC status"):
        StatusFilter.parse("oops")


def test_a_late_item_is_released_in_receive_order_once_the_scan_has_passed_its_lateness() -> None:
    buffer: ReorderBuffer[str] = ReorderBuffer(horizon_ns=100, capacity=1000)
    released: list[str] = []
    # (receive time, stream position): "late" was received at 15 but written at 110, after "b".
    for name, receive, position in [("a", 10, 11), ("b", 20, 21), ("late", 15, 110), ("c", 120, 121), ("d", 300, 301)]:
        released += list(buffer.push(receive, name))
        released += list(buffer.release(position))
    released += list(buffer.drain())
    assert released == ["a", "late", "b", "c", "d"]
    assert buffer.out_of_order == 0


def test_a_full_reorder_buffer_releases_early_and_counts_what_then_arrives_out_of_order() -> None:
    buffer: ReorderBuffer[int] = ReorderBuffer(horizon_ns=10**9, capacity=3)
    released = []
    for receive in (10, 20, 30, 40, 50, 5):
        released += list(buffer.push(receive, receive))
    released += list(buffer.drain())
    assert released == [10, 20, 5, 30, 40, 50]  # 5 leaves at once, after 20: out of order
    assert buffer.released_early == 3
    assert buffer.out_of_order == 1
    assert buffer.max_buffered == 4


def test_the_reorder_buffer_is_also_capped_in_bytes() -> None:
    buffer: ReorderBuffer[int] = ReorderBuffer(horizon_ns=10**9, capacity=1000, max_bytes=100)
    released = []
    for receive in (10, 20, 30):
        released += list(buffer.push(receive, receive, size=40))
    assert released == [10]
    assert buffer.bytes == 80


def test_request_ids_are_remembered_for_the_lateness_horizon_and_then_forgotten() -> None:
    recent = RecentIds(horizon_ns=100, capacity=1000)
    assert not recent.seen_before("a", 0)
    assert recent.seen_before("a", 50)
    assert not recent.seen_before("b", 60)
    assert not recent.seen_before("a", 500)  # forgotten: beyond the horizon
    capped = RecentIds(horizon_ns=10**12, capacity=2)
    for request_id in ("x", "y", "z"):
        capped.seen_before(request_id, 0)
    assert len(capped) == 2


def test_sampling_is_a_fixed_choice_per_request_id_close_to_the_fraction() -> None:
    selection = Selection(models=("m",), since_ns=0, until_ns=1, sample=0.3, sample_seed=7)
    ids = [f"req-{i}" for i in range(20_000)]
    first = [selection.sampled(i) for i in ids]
    assert first == [selection.sampled(i) for i in ids]
    assert 0.28 < sum(first) / len(ids) < 0.32
    other_seed = Selection(models=("m",), since_ns=0, until_ns=1, sample=0.3, sample_seed=8)
    assert [other_seed.sampled(i) for i in ids] != first


def test_a_selection_refuses_an_empty_or_backwards_window() -> None:
    with pytest.raises(ValueError, match="--until must be after --since"):
        Selection(models=("m",), since_ns=10, until_ns=10)


# -- comparison ----------------------------------------------------------------------------


def test_integer_bool_and_bytes_outputs_must_be_exactly_equal() -> None:
    reference = ok(
        label=np.array([1, 2, 3], np.int64), flag=np.array([True, False]), text=np.array([b"a", b"b"], object)
    )
    same = compare_answers(reference, reference, TOL)
    assert same.outcome == "match"
    changed = ok(label=np.array([1, 2, 4], np.int64), flag=np.array([True, True]), text=np.array([b"a", b"c"], object))
    diff = compare_answers(reference, changed, TOL)
    by_name = {o.name: o for o in diff.outputs}
    assert diff.outcome == "mismatch"
    assert (by_name["label"].mismatches, by_name["label"].max_abs_error) == (1, 1.0)
    assert by_name["flag"].mismatches == 1
    assert by_name["text"].mismatches == 1


def test_identical_responses_match_with_the_same_statistics_as_a_full_comparison() -> None:
    outputs: dict[str, np.ndarray] = {"y": np.array([[0.1, 0.7, 0.2]], np.float32), "label": np.array([1], np.int64)}
    same = compare_answers(ok(**outputs), ok(**outputs), TOL)  # byte-identical: no tensor decoded
    almost = {"y": np.nextafter(outputs["y"], np.float32(1)), "label": outputs["label"]}  # one ulp: the full path
    full = compare_answers(ok(**outputs), ok(**almost), TOL)
    assert same.outcome == full.outcome == "match"
    for fast, slow in zip(same.outputs, full.outputs, strict=True):
        assert fast.as_dict() == {**slow.as_dict(), "max_abs_error": pytest.approx(0.0, abs=1e-7)}


def test_float_outputs_match_within_tolerance_and_nan_and_inf_compare_as_values() -> None:
    reference = ok(y=np.array([[1.0, np.nan, np.inf, -np.inf]], np.float32))
    close = ok(y=np.array([[1.0005, np.nan, np.inf, -np.inf]], np.float32))
    assert compare_answers(reference, close, TOL).outcome == "match"
    far = ok(y=np.array([[1.1, 0.0, np.inf, 5.0]], np.float32))
    (output,) = compare_answers(reference, far, TOL).outputs
    assert not output.match
    assert output.mismatches == 3
    assert output.nonfinite_mismatches == 2
    assert output.max_abs_error == pytest.approx(0.1, rel=1e-5)


def test_class_scores_report_argmax_and_top_k_agreement_per_row() -> None:
    reference = ok(scores=np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]], np.float32))
    candidate = ok(scores=np.array([[0.1, 0.6, 0.3], [0.2, 0.3, 0.5]], np.float32))
    (output,) = compare_answers(reference, candidate, Tolerance(top_k=2)).outputs
    assert output.argmax_agreement == 0.5
    assert output.topk_agreement == 0.5  # row 0 keeps {1, 2}; row 1 goes from {0, 1} to {1, 2}


def test_shape_dtype_and_missing_outputs_are_mismatches_with_a_reason_not_errors() -> None:
    reference = ok(y=np.zeros((2, 4), np.float32), label=np.zeros(2, np.int64))
    shape = compare_answers(reference, ok(y=np.zeros((2, 5), np.float32), label=np.zeros(2, np.int64)), TOL)
    assert {o.name: o.reason for o in shape.outputs} == {"y": "shape", "label": ""}
    dtype = compare_answers(reference, ok(y=np.zeros((2, 4), np.float64), label=np.zeros(2, np.int64)), TOL)
    assert {o.name: o.reason for o in dtype.outputs}["y"] == "dtype"
    missing = compare_answers(reference, ok(y=np.zeros((2, 4), np.float32), extra=np.zeros(1, np.int32)), TOL)
    assert {o.name: o.reason for o in missing.outputs} == {"y": "", "label": "missing", "extra": "extra"}
    garbage = compare_answers(reference, Answer(0, b"\xff\xff not a message"), TOL)
    assert garbage.outcome == "mismatch"
    assert garbage.outputs[0].reason == "undecodable"


def test_outputs_redacted_at_recording_are_left_out_on_both_sides_against_a_recording_only() -> None:
    y = np.array([[0.1, 0.7, 0.2]], np.float32)
    replayed = ok(y=y, face=np.array([[3.0, 4.0]], np.float32), token=np.array([42], np.int64))
    masked_and_dropped = response(y=y, face=np.zeros((1, 2), np.float32))  # token dropped, face zeroed
    recorded = Answer(0, masked_and_dropped, redacted=frozenset({"face", "token"}))

    fast = compare_answers(recorded, replayed, TOL)  # y byte for byte the same: no tensor decoded
    assert (fast.outcome, [o.name for o in fast.outputs], fast.not_compared) == ("match", ["y"], ("face", "token"))
    drifted = ok(y=y + 0.5, face=np.array([[3.0, 4.0]], np.float32), token=np.array([42], np.int64))
    full = compare_answers(recorded, drifted, TOL)
    assert (full.outcome, [o.name for o in full.outputs], full.not_compared) == ("mismatch", ["y"], ("face", "token"))
    # The same response as a live reference (--compare-to) is compared whole.
    live = compare_answers(Answer(0, masked_and_dropped), replayed, TOL)
    assert {o.name: o.reason for o in live.outputs} == {"y": "", "face": "values", "token": "extra"}
    assert live.not_compared == ()


def test_status_changes_are_told_apart_from_output_mismatches() -> None:
    good = ok(y=np.ones(2, np.float32))
    assert compare_answers(good, Answer(3), TOL).status_change_kind == "ok_to_error"
    assert compare_answers(Answer(14), good, TOL).status_change_kind == "error_to_ok"
    other = compare_answers(Answer(14), Answer(3), TOL)
    assert (other.outcome, other.status_change) == ("status_change", "UNAVAILABLE->INVALID_ARGUMENT")
    assert compare_answers(Answer(3), Answer(3), TOL).outcome == "match"


# -- stats, gate, schedule, report ---------------------------------------------------------


def test_histogram_quantiles_stay_within_two_percent_of_the_exact_ones() -> None:
    values = np.random.default_rng(3).lognormal(mean=-6, sigma=1.0, size=50_000)
    histogram = LogHistogram()
    for value in values:
        histogram.add(float(value))
    for q in (0.5, 0.95, 0.99):
        assert histogram.quantile(q) == pytest.approx(float(np.quantile(values, q)), rel=0.02)
    assert histogram.quantile(1.0) == pytest.approx(values.max())


def metrics(*, completed: int = 10, **values: float | None) -> Metrics:
    """Gate metrics: ``values``, every other rate not measured."""
    return Metrics.model_validate(
        dict.fromkeys(METRICS) | {"completed": completed, "failed_sends": 0, "skipped": 0} | values
    )


def test_gate_bounds_parse_and_fail_on_a_broken_bound_or_an_unmeasured_metric() -> None:
    bounds = parse_gate("mismatch_rate<=0.01, p99_ratio<=1.2,error_rate<=0.001")
    assert bounds == (
        Bound("mismatch_rate", "<=", 0.01),
        Bound("p99_ratio", "<=", 1.2),
        Bound("error_rate", "<=", 0.001),
    )
    passed = evaluate(bounds, metrics(mismatch_rate=0.0, p99_ratio=1.1, error_rate=0.0))
    assert passed.passed
    failed = evaluate(bounds, metrics(mismatch_rate=0.5, p99_ratio=None, error_rate=0.0))
    assert not failed.passed
    assert failed.failures == [
        "mismatch_rate=0.5 (bound mismatch_rate<=0.01)",
        "p99_ratio=not measured (bound p99_ratio<=1.2)",
    ]
    assert [(b.bound, b.value, b.passed) for b in failed.bounds] == [
        ("mismatch_rate<=0.01", 0.5, False),
        ("p99_ratio<=1.2", None, False),
        ("error_rate<=0.001", 0.0, True),
    ]
    with pytest.raises(ValueError, match="unknown gate metric 'latency'"):
        parse_gate("latency<=3")
    with pytest.raises(ValueError, match="bad gate bound"):
        parse_gate("mismatch_rate=<0.1")


def test_a_gate_fails_when_no_call_completed_whatever_it_bounds() -> None:
    bounds = parse_gate("skipped<=0,failed_sends<=0")
    nothing = evaluate(bounds, metrics(completed=0))
    assert not nothing.passed
    assert nothing.failures == ["no call completed, so nothing was measured"]
    assert all(b.passed for b in nothing.bounds)  # each bound held; the verdict still has no evidence


def test_the_gate_metrics_are_the_summary_metrics_fields_and_every_one_is_described() -> None:
    assert list(METRICS) == list(Metrics.model_fields)
    assert all(METRICS.values())
    help_text = " ".join(build_parser().format_help().split())
    assert all(name in help_text for name in METRICS)


def test_planned_times_keep_the_recorded_gaps_divided_by_the_speed() -> None:
    clock = OpenLoopClock(4.0, lead_s=0.0, clock=lambda: 100.0)
    assert clock.planned(5_000_000_000) == 100.0
    assert clock.planned(6_000_000_000) == pytest.approx(100.25)
    assert OpenLoopClock(None).planned(1) is None


def test_sleep_until_never_returns_before_the_deadline_and_stops_on_request() -> None:
    for delay in (0.0, 0.0004, 0.003):
        deadline = time.perf_counter() + delay
        assert sleep_until(deadline)
        assert time.perf_counter() >= deadline
    stop = threading.Event()
    stop.set()
    assert not sleep_until(time.perf_counter() + 10, stop=stop)


def test_the_report_is_one_offline_page_with_charts_and_tables() -> None:
    histogram = LogHistogram()
    for value in (0.001, 0.002, 0.004):
        histogram.add(value)
    latency = {"count": 3, "p50_ms": 2.0, "p95_ms": 4.0, "p99_ms": 4.0, "max_ms": 4.0, "mean_ms": 2.3}
    group = {
        "completed": 3,
        "compared": 3,
        "matches": 2,
        "mismatches": 1,
        "status_changes": 0,
        "mismatch_rate": 0.33,
        "reference_error_rate": 0.0,
        "candidate_error_rate": 0.0,
        "candidate_versions": {"v2": 3},
        "latency": {"reference": latency, "candidate": latency, "p50_ratio": 1.0, "p95_ratio": 1.0, "p99_ratio": 1.0},
    }
    metrics = dict.fromkeys(METRICS) | {"mismatch_rate": 0.33, "error_rate": 0.0, "p99_ratio": 1.0}
    summary = Summary.model_validate(
        {
            "interrupted": False,
            "started_unix_ns": NOW,
            "wall_s": 1.0,
            "window": {"models": ["m<x>"], "since_unix_ns": NOW, "until_unix_ns": NOW + 10**9, "max_lateness_s": 1.0},
            "target": "127.0.0.1:1",
            "compare_to": None,
            "reference": "recorded",
            "pin_version": "v2",
            "speed": 1.0,
            "concurrency": 4,
            "tolerance": {"rtol": 1e-5, "atol": 1e-6, "top_k": 5},
            "counts": {
                "selected": 3,
                "sent": 3,
                "completed": 3,
                "not_sent": 0,
                "send_errors": 0,
                "skipped": {"corrupt": 1},
            },
            "outcomes": {"match": 2, "mismatch": 1, "status_change": 0},
            "metrics": metrics | {"completed": 3, "failed_sends": 0, "skipped": 1},
            "selection": {
                "scanned": 4,
                "in_window": 4,
                "selected": 3,
                "duplicates": 0,
                "skipped": {"corrupt": 1},
                "released_early": 0,
                "out_of_order": 0,
                "max_buffered": 1,
            },
            "max_in_flight": 2,
            "sender_nice": None,
            "replay_rate_calls_per_s": 10.0,
            "latency": group["latency"],
            "send_lag": latency,
            "outputs": {
                "y": {
                    "calls": 3,
                    "mismatched_calls": 1,
                    "mismatch_rate": 0.33,
                    "element_mismatch_rate": 0.1,
                    "max_abs_error": 0.5,
                    "reasons": {"values": 1},
                },
                "face": {
                    "calls": 0,
                    "mismatched_calls": 0,
                    "mismatch_rate": None,
                    "element_mismatch_rate": None,
                    "max_abs_error": None,
                    "reasons": {},
                    "not_compared": {"redacted_at_recording": 3},
                },
            },
            "worst_calls": [
                {
                    "request_id": "req-<7>",
                    "replay_request_id": "req-<7>:replay",
                    "outcome": "mismatch",
                    "status_change": None,
                    "recorded": {"version": "v1"},
                    "replayed": {"version": "v2"},
                    "outputs": {
                        "y": {"match": False, "mismatches": 4, "elements": 4, "max_abs_error": 0.5, "reason": "values"}
                    },
                }
            ],
            "status_changes": {"ok_to_error": 0, "error_to_ok": 0, "error_to_other_error": 0, "transitions": {}},
            "versions": {"v1": group},
            "gate": {
                "passed": False,
                "bounds": [{"bound": "mismatch_rate<=0.01", "value": 0.33, "passed": False}],
                "failures": ["mismatch_rate=0.33"],
            },
        }
    )
    html = render(
        summary,
        {
            "reference_latency": histogram,
            "candidate_latency": histogram,
            "send_lag": histogram,
            "candidate_latency:v1": histogram,
        },
    )
    assert html.startswith("<!DOCTYPE html>")
    assert html.count("<svg") >= 5
    assert "req-&lt;7&gt;" in html  # escaped
    assert "req-<7>" not in html
    assert "mismatch_rate=0.33" in html
    face_row = html.split("<code>face</code>")[1].split("</tr>")[0]
    assert "<td>-</td><td>-</td><td>-</td>" in face_row  # never compared: no rates, no error
    assert "3 (redacted at recording)" in face_row
    assert "Not compared (redacted at recording)" in html
    for external in ("http://", "https://", "<script", "<link", "src="):
        assert external not in html


# -- what gRPC would refuse to send ---------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        ([("x-request-id", "a-1:replay"), ("x-tenant", "acme corp ~!")], ""),
        ([("x-trace-bin", b"\xff\x00")], ""),
        ([("x-request-id", "\u00fcn\u00efcode")], "not printable ASCII"),
        ([("x-request-id", "a\x01b")], "not printable ASCII"),
        ([("x-request-id", "tab\there")], "not printable ASCII"),
        ([("X-Tenant", "acme")], "not a valid gRPC header name"),
        ([("x tenant", "acme")], "not a valid gRPC header name"),
        ([("", "acme")], "not a valid gRPC header name"),
        ([("x-trace-bin", "text")], "must be bytes"),
    ],
)
def test_metadata_grpc_would_refuse_is_named_before_sending(
    metadata: list[tuple[str, str | bytes]], problem: str
) -> None:
    found = metadata_problem(metadata)
    if problem:
        assert problem in found
    else:
        assert found == ""


def test_the_report_of_a_run_with_no_calls_says_not_measured_instead_of_zero_rates() -> None:
    nothing = LogHistogram().quantiles_ms()
    no_latency = {"reference": nothing.model_dump(), "candidate": nothing.model_dump()}
    summary = Summary.model_validate(
        {
            "interrupted": False,
            "started_unix_ns": NOW,
            "wall_s": 0.1,
            "window": {"models": ["m"], "since_unix_ns": NOW, "until_unix_ns": NOW + 10**9, "max_lateness_s": 0.0},
            "target": "127.0.0.1:1",
            "compare_to": None,
            "reference": "recorded",
            "pin_version": None,
            "speed": "max",
            "concurrency": 4,
            "tolerance": {"rtol": 1e-5, "atol": 1e-6, "top_k": 5},
            "selection": dict.fromkeys(
                ("scanned", "in_window", "selected", "duplicates", "released_early", "out_of_order", "max_buffered"), 0
            )
            | {"skipped": {}},
            "counts": {"selected": 0, "sent": 0, "completed": 0, "not_sent": 0, "send_errors": 0, "skipped": {}},
            "outcomes": {"match": 0, "mismatch": 0, "status_change": 0},
            "status_changes": {"ok_to_error": 0, "error_to_ok": 0, "error_to_other_error": 0, "transitions": {}},
            "latency": no_latency | {"p50_ratio": None, "p95_ratio": None, "p99_ratio": None},
            "outputs": {},
            "versions": {},
            "send_lag": None,
            "max_in_flight": 0,
            "sender_nice": None,
            "replay_rate_calls_per_s": None,
            "metrics": metrics(completed=0),
            "worst_calls": [],
        }
    )
    empty = LogHistogram()
    html = render(summary, {"reference_latency": empty, "candidate_latency": empty, "send_lag": empty})
    overview = html.split("id='overview'")[1].split("</table>")[0]
    assert overview.count("not measured") == 3  # mismatch rate, error rate, p99 ratio
    assert "0.00 %" not in overview
    assert "No call completed" in html
