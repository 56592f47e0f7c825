"""Comparing token streams: what a replay of a recorded stream reports as matching or diverging.

Odd cases on purpose: empty streams, error_message responses, truncated and cancelled records,
bytes that are no UTF-8, streams of different lengths, outputs redacted at recording."""

from __future__ import annotations

import numpy as np
import pytest

from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.replayer.gate import evaluate, parse_gate
from splitstream.replayer.stats import StreamTotals
from splitstream.replayer.stream_compare import (
    CANCELLED,
    StreamAnswer,
    compare_streams,
    first_divergence,
    read_tokens,
)
from splitstream.replayer.summary import METRICS, Metrics

OK = 0
INTERNAL = 13


def token(text: bytes, *, final: bool = False, request_id: str = "") -> bytes:
    response = oip.ModelStreamInferResponse()
    response.infer_response.id = request_id
    output = response.infer_response.outputs.add(name="text_output", datatype="BYTES", shape=[1, 1])
    response.infer_response.raw_output_contents.append(tensors.to_raw(np.array([[text]], dtype=np.object_)))
    del output
    if final:
        response.infer_response.parameters["triton_final_response"].bool_param = True
    return response.SerializeToString()


def empty_final() -> bytes:
    response = oip.ModelStreamInferResponse()
    response.infer_response.parameters["triton_final_response"].bool_param = True
    return response.SerializeToString()


def error(message: str) -> bytes:
    return oip.ModelStreamInferResponse(error_message=message).SerializeToString()


def answer(text: bytes, code: int = OK, **kwargs: object) -> StreamAnswer:
    responses = tuple(token(bytes((byte,))) for byte in text)
    times = tuple(0.01 * (i + 1) for i in range(len(responses)))
    return StreamAnswer(code, responses, times, times[0] if times else None, **kwargs)  # type: ignore[arg-type]


def test_the_same_tokens_match_exactly_with_no_divergence_and_zero_distance() -> None:
    diff = compare_streams(answer(b"hello there"), answer(b"hello there"))
    assert diff.outcome == "match"
    assert (diff.first_divergence, diff.edit_distance, diff.text_edit_distance) == (None, 0.0, 0.0)
    assert diff.reference_tokens == diff.candidate_tokens == 11


def test_a_different_token_is_a_mismatch_at_its_index_with_a_normalized_edit_distance() -> None:
    diff = compare_streams(answer(b"the cat sat"), answer(b"the cow sat"))
    assert diff.outcome == "mismatch"
    assert diff.first_divergence == 5
    assert diff.edit_distance == pytest.approx(2 / 11)
    assert (diff.reference_text, diff.candidate_text) == ("the cat sat", "the cow sat")


def test_streams_of_different_lengths_diverge_where_the_shorter_one_ends() -> None:
    diff = compare_streams(answer(b"abcdef"), answer(b"abc"))
    assert (diff.outcome, diff.first_divergence) == ("mismatch", 3)
    assert diff.edit_distance == pytest.approx(0.5)
    assert first_divergence([b"a"], [b"a", b"b"]) == 1
    assert first_divergence([], []) is None


def test_two_empty_streams_match_and_an_empty_one_against_text_is_all_different() -> None:
    assert compare_streams(answer(b""), answer(b"")).outcome == "match"
    diff = compare_streams(answer(b""), answer(b"xyz"))
    assert (diff.outcome, diff.first_divergence, diff.edit_distance) == ("mismatch", 0, 1.0)


def test_empty_final_responses_carry_no_token() -> None:
    with_final = StreamAnswer(OK, (token(b"a"), token(b"b"), empty_final()))
    diff = compare_streams(answer(b"ab"), with_final)
    assert diff.outcome == "match"
    assert read_tokens(with_final.responses).tokens == (b"a", b"b")


def test_error_message_responses_are_no_tokens_and_differing_messages_do_not_match() -> None:
    reference = StreamAnswer(OK, (token(b"a"), error("model 'x' is not served here")))
    same = StreamAnswer(OK, (token(b"a"), error("model 'x' is not served here")))
    other = StreamAnswer(OK, (token(b"a"), error("something else")))
    assert compare_streams(reference, same).outcome == "match"
    diff = compare_streams(reference, other)
    assert (diff.outcome, diff.first_divergence, diff.edit_distance) == ("mismatch", 1, 0.0)
    assert diff.candidate_errors == ("something else",)


def test_non_utf8_bytes_are_compared_as_tokens_and_read_as_replacement_characters_in_the_text() -> None:
    reference = StreamAnswer(OK, (token(b"a"), token(b"\xff"), token(b"b")))
    candidate = StreamAnswer(OK, (token(b"a"), token(b"\xfe"), token(b"b")))
    diff = compare_streams(reference, candidate)
    assert (diff.outcome, diff.first_divergence) == ("mismatch", 1)
    assert diff.reference_text == diff.candidate_text == "a\ufffdb"  # the texts read the same ...
    assert diff.text_edit_distance == 0.0
    assert diff.edit_distance == pytest.approx(1 / 3)  # ... the tokens do not


def test_two_requests_of_one_stream_interleaved_differently_still_match_request_by_request() -> None:
    def interleaved(order: str) -> StreamAnswer:
        counters = {"a": 0, "b": 0}
        texts = {"a": b"hello", "b": b"world"}
        responses = []
        for request in order:
            responses.append(token(texts[request][counters[request] : counters[request] + 1], request_id=request))
            counters[request] += 1
        return StreamAnswer(OK, tuple(responses))

    recorded = interleaved("aabbabbaab")
    assert compare_streams(recorded, interleaved("ababababab")).outcome == "match"
    assert compare_streams(recorded, interleaved("bbbbbaaaaa")).outcome == "match"
    changed = StreamAnswer(OK, (*interleaved("aaaaabbbb").responses, token(b"X", request_id="b")))
    diff = compare_streams(recorded, changed)
    assert (diff.outcome, diff.first_divergence) == ("mismatch", 9)


def test_a_truncated_record_is_compared_on_its_prefix_only() -> None:
    recorded = answer(b"hello", prefix_only=True)
    diff = compare_streams(recorded, answer(b"hello world"))
    assert (diff.outcome, diff.prefix_compared, diff.candidate_tokens) == ("match", True, 5)
    assert compare_streams(recorded, answer(b"help me")).first_divergence == 3


def test_a_cancelled_record_is_compared_on_its_prefix_and_its_status_is_not_compared() -> None:
    recorded = answer(b"abc", CANCELLED)
    assert compare_streams(recorded, answer(b"abc", CANCELLED)).outcome == "match"
    assert compare_streams(recorded, answer(b"abcdef", OK)).outcome == "match"
    assert compare_streams(recorded, answer(b"abd", OK)).first_divergence == 2


def test_a_different_final_status_is_a_status_change_not_a_token_comparison() -> None:
    diff = compare_streams(answer(b"abc"), answer(b"", INTERNAL))
    assert diff.outcome == "status_change"
    assert diff.edit_distance is None


def test_a_redacted_text_output_is_not_compared() -> None:
    diff = compare_streams(answer(b"abc", redacted=frozenset({"text_output"})), answer(b"xyz"))
    assert (diff.outcome, diff.not_compared_why) == ("not_compared", "redacted_at_recording")


def test_outputs_other_than_text_output_are_compared_as_raw_bytes() -> None:
    def logits(value: float) -> bytes:
        response = oip.ModelStreamInferResponse()
        response.infer_response.outputs.add(name="score", datatype="FP32", shape=[1])
        response.infer_response.raw_output_contents.append(np.float32(value).tobytes())
        return response.SerializeToString()

    same = compare_streams(StreamAnswer(OK, (logits(1.0),)), StreamAnswer(OK, (logits(1.0),)))
    differs = compare_streams(StreamAnswer(OK, (logits(1.0),)), StreamAnswer(OK, (logits(2.0),)))
    assert (same.outcome, differs.outcome, differs.text_edit_distance) == ("match", "mismatch", None)


def test_undecodable_responses_are_counted_and_never_raise() -> None:
    tokens = read_tokens([b"\xff\xff\xff", token(b"a")])
    assert (tokens.tokens, tokens.undecodable) == ((b"a",), 1)


def test_aggregates_give_the_gate_match_rate_edit_distance_divergence_and_ttft_itl_ratios() -> None:
    totals = StreamTotals()
    pairs = [(b"same", b"same"), (b"abcd", b"abXY"), (b"wxyz", b"wxyz")]
    for reference_text, candidate_text in pairs:
        reference = answer(reference_text)
        slow = StreamAnswer(
            OK,
            answer(candidate_text).responses,
            tuple(0.02 * (i + 1) for i in range(len(candidate_text))),
            0.02,
        )
        totals.add("v1", compare_streams(reference, slow), reference, slow)
    summary = totals.summary(active_s=1.0)
    assert summary is not None
    assert summary.token_match_rate == pytest.approx(2 / 3, abs=1e-6)
    assert summary.mean_edit_distance == pytest.approx((0 + 0.5 + 0) / 3, abs=1e-6)
    assert summary.first_divergence_p50 == 2.0
    assert summary.ttft.p50_ratio == pytest.approx(2.0, rel=0.05)
    assert summary.itl.p99_ratio == pytest.approx(2.0, rel=0.05)
    assert sum(summary.edit_distance_bins) == 3
    assert summary.versions["v1"].streams == 3
    assert summary.tokens_per_s == 12.0
    assert StreamTotals().summary(active_s=1.0) is None


def test_the_gate_bounds_the_stream_metrics_by_name() -> None:
    for name in ("token_match_rate", "mean_edit_distance", "first_divergence_p50", "ttft_p99_ratio", "itl_p99_ratio"):
        assert name in METRICS
    metrics = Metrics(**(dict.fromkeys(METRICS) | {"completed": 3, "failed_sends": 0, "skipped": 0}))
    unmeasured = evaluate(parse_gate("token_match_rate>=0.9"), metrics)
    assert not unmeasured.passed, "a replay without streams has no evidence for a stream bound"
    measured = metrics.model_copy(update={"token_match_rate": 0.5, "ttft_p99_ratio": 1.1})
    assert not evaluate(parse_gate("token_match_rate>=0.9"), measured).passed
    assert evaluate(parse_gate("token_match_rate>=0.5,ttft_p99_ratio<=1.2"), measured).passed
