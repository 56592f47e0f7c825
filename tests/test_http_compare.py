"""The comparison of two answers to one recorded HTTP call, on answers shaped as the router and OpenAI-compatible
servers write them: text read the same from a body or from events cut anywhere, a prefix when the reference
was cut, statuses, usage, KServe outputs within tolerance."""

from __future__ import annotations

import json

from splitstream.replayer.compare import Tolerance
from splitstream.replayer.http_compare import HttpAnswer, compare_http, read_text, reported_usage


def chat_body(text: str, usage: tuple[int, int] | None = (5, 3)) -> bytes:
    body: dict[str, object] = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
    if usage is not None:
        body["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    return json.dumps(body).encode()


def chat_events(pieces: list[str], usage: tuple[int, int] | None = None) -> tuple[bytes, ...]:
    events = [json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}).encode()]
    events += [json.dumps({"choices": [{"index": 0, "delta": {"content": piece}}]}).encode() for piece in pieces]
    if usage is not None:
        events.append(
            json.dumps({"choices": [], "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]}}).encode()
        )
    return (*events, b"[DONE]")


def test_a_text_cut_into_other_events_is_the_same_text() -> None:
    reference = HttpAnswer(200, events=chat_events(["Hel", "lo there"]), usage=(5, 3))
    candidate = HttpAnswer(200, events=chat_events(["H", "ello ", "there"], usage=(5, 3)), usage=(5, 3))
    diff = compare_http("chat", reference, candidate, Tolerance())
    assert diff.outcome == "match"
    assert diff.text is not None
    assert (diff.text.first_divergence, diff.text.edit_distance) == (None, 0.0)
    assert (diff.text.reference_tokens, diff.text.candidate_tokens) == (2, 3)
    assert diff.usage.match


def test_a_streamed_answer_and_a_whole_one_with_the_same_text_match() -> None:
    reference = HttpAnswer(200, body=chat_body("Hello there"))
    candidate = HttpAnswer(200, events=chat_events(["Hello", " there"]))
    assert compare_http("chat", reference, candidate, Tolerance()).outcome == "match"


def test_diverging_texts_give_the_first_differing_character_and_the_normalised_distance() -> None:
    reference = HttpAnswer(200, body=chat_body("the cat sat"))
    candidate = HttpAnswer(200, body=chat_body("the car sat"))
    diff = compare_http("chat", reference, candidate, Tolerance())
    assert diff.outcome == "mismatch"
    assert diff.text is not None
    assert diff.text.first_divergence == 6
    assert diff.text.edit_distance == 1 / 11


def test_a_prefix_reference_compares_the_candidate_up_to_its_length_and_499_is_no_status_change() -> None:
    reference = HttpAnswer(499, events=chat_events(["Once up"]), prefix_only=False)
    candidate = HttpAnswer(200, events=chat_events(["Once upon a time"]))
    diff = compare_http("chat", reference, candidate, Tolerance())
    assert diff.outcome == "match"
    assert diff.text is not None
    assert diff.text.prefix_compared
    truncated = HttpAnswer(200, events=chat_events(["Once up"]), prefix_only=True)
    assert compare_http("chat", truncated, candidate, Tolerance()).outcome == "match"


def test_statuses_are_compared_as_http_statuses_and_the_same_error_matches() -> None:
    ok = HttpAnswer(200, body=chat_body("x"))
    refused = HttpAnswer(401, body=b'{"error": {"message": "no key"}}')
    assert compare_http("chat", ok, refused, Tolerance()).outcome == "status_change"
    assert compare_http("chat", refused, refused, Tolerance()).outcome == "match"


def test_usage_differs_when_the_numbers_differ_or_the_candidate_reports_none_and_the_text_still_decides() -> None:
    reference = HttpAnswer(200, body=chat_body("same"), usage=(5, 3))
    other = compare_http("chat", reference, HttpAnswer(200, body=chat_body("same"), usage=(6, 3)), Tolerance())
    assert (other.outcome, other.usage.compared, other.usage.match) == ("match", True, False)
    none = compare_http("chat", reference, HttpAnswer(200, body=chat_body("same")), Tolerance())
    assert (none.usage.compared, none.usage.match) == (True, False)
    unreported = compare_http("chat", HttpAnswer(200, body=chat_body("same")), reference, Tolerance())
    assert not unreported.usage.compared


def test_usage_is_read_from_a_body_the_last_event_with_it_or_generates_own_fields() -> None:
    assert reported_usage(HttpAnswer(200, body=chat_body("x", (7, 2)))) == (7, 2)
    assert reported_usage(HttpAnswer(200, events=chat_events(["x"], usage=(4, 1)))) == (4, 1)
    generated = json.dumps({"text_output": "abc", "prompt_tokens": 3, "completion_tokens": 9}).encode()
    assert reported_usage(HttpAnswer(200, body=generated)) == (3, 9)
    assert read_text("generate", HttpAnswer(200, body=generated)).text == "abc"


def test_an_error_event_mid_stream_is_a_divergence_even_with_the_same_text() -> None:
    reference = HttpAnswer(200, events=chat_events(["abc"]))
    failing = HttpAnswer(200, events=(*chat_events(["abc"])[:-1], b'{"error": {"message": "worker lost"}}'))
    diff = compare_http("chat", reference, failing, Tolerance())
    assert diff.outcome == "mismatch"
    assert diff.text is not None
    assert diff.text.candidate_errors == ("worker lost",)


def kserve(data: list[float], *, version: str = "v1", datatype: str = "FP32") -> bytes:
    return json.dumps(
        {
            "model_name": "m",
            "model_version": version,
            "id": version,
            "outputs": [{"name": "y", "datatype": datatype, "shape": [len(data)], "data": data}],
        }
    ).encode()


def test_kserve_outputs_match_within_tolerance_whatever_the_version_and_id() -> None:
    tolerance = Tolerance(rtol=1e-3, atol=1e-6)
    reference = HttpAnswer(200, body=kserve([1.0, 2.0]))
    close = compare_http(
        "kserve-infer", reference, HttpAnswer(200, body=kserve([1.0005, 2.0], version="v2")), tolerance
    )
    assert close.outcome == "match"
    far = compare_http("kserve-infer", reference, HttpAnswer(200, body=kserve([1.1, 2.0])), tolerance)
    assert (far.outcome, far.body_difference) == ("mismatch", "y: values")
    shape = compare_http("kserve-infer", reference, HttpAnswer(200, body=kserve([1.0])), tolerance)
    assert shape.body_difference.startswith("y: shape")
    ints = compare_http(
        "kserve-infer",
        HttpAnswer(200, body=kserve([1, 2], datatype="INT64")),
        HttpAnswer(200, body=kserve([1, 3], datatype="INT64")),
        tolerance,
    )
    assert ints.outcome == "mismatch"


def test_a_body_that_is_no_json_is_compared_byte_for_byte() -> None:
    reference = HttpAnswer(200, body=b"\x00\x01binary")
    assert (
        compare_http("kserve-infer", reference, HttpAnswer(200, body=b"\x00\x01binary"), Tolerance()).outcome == "match"
    )
    differs = compare_http("kserve-infer", reference, HttpAnswer(200, body=b"\x00\x02binary"), Tolerance())
    assert differs.body_difference == "bodies differ (8 vs 8 bytes)"
