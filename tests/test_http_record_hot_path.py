"""The HTTP record's shortcuts on the answering path read what the whole parse and the generic encoder would.

A whole answer's ``usage`` is read from its last member when it is there (:func:`_tail_usage`), and the log
entry is packed by hand (:meth:`CallLog._encode_http`): both are checked against the slow way, computed here
independently (``json.loads`` of the whole answer; ``wal.encode_call``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.wal import HTTP, RETRIED, decode_call, encode_call, iter_entries
from splitstream.router.core import CallOutcome
from splitstream.router.http.errors import ApiError
from splitstream.router.http.openai_api import parse_body
from splitstream.router.http.recording import HttpExchange
from splitstream.router.recording import CallLog
from splitstream.router.routing import Assignment


def _whole_parse(body: bytes) -> tuple[int, int] | None:
    """The usage as the whole answer parsed says it (the reference)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt, completion) if isinstance(prompt, int) and isinstance(completion, int) else None


USAGE = {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
CHOICES = [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]
BODIES: list[Any] = [
    {"id": "x", "choices": CHOICES, "usage": USAGE},  # OpenAI's order: usage last
    {"usage": USAGE, "id": "x", "choices": CHOICES},  # usage first
    {"id": "x", "choices": [{**CHOICES[0], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}]},  # nested only
    {"usage": USAGE, "x": {"usage": {"prompt_tokens": 1, "completion_tokens": 2}}},  # a nested one last
    {'say "usage': {"prompt_tokens": 1, "completion_tokens": 2}},  # a key ending in the word, escaped quote
    {"id": "x", "usage": {"prompt_tokens": "5", "completion_tokens": 16}},  # not integers
    {"id": "x", "usage": None},
    {"id": "x", "content": 'the "usage": {"prompt_tokens": 1, "completion_tokens": 2}}'},  # in the text
    [{"usage": USAGE}],  # not an object
]


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("body", BODIES)
def test_reported_usage_matches_the_whole_parse(body: Any, indent: int | None) -> None:
    raw = json.dumps(body, indent=indent).encode()
    exchange = HttpExchange("POST", "/v1/chat/completions", "chat", max_bytes=1 << 20, started_ns=0)
    exchange.answered(raw, "application/json")
    assert exchange.reported_usage() == _whole_parse(raw)


def test_reported_usage_of_an_answer_that_is_not_json() -> None:
    exchange = HttpExchange("POST", "/v1/chat/completions", "chat", max_bytes=1 << 20, started_ns=0)
    exchange.answered(b"\xff upstream error", "text/plain")
    assert exchange.reported_usage() is None


def test_http_entry_is_the_generic_encoders(tmp_path: Path) -> None:
    """The hand-packed entry holds byte for byte what ``wal.encode_call`` makes of the same call."""
    log = CallLog(
        str(tmp_path),
        CollectorRegistry(),
        router_id="router-1",
        hmac_key=b"k" * 32,
        max_bytes=1 << 30,
        segment_bytes=1 << 24,
        flush_interval_s=1.0,
    )
    outcome = CallOutcome(
        "req-1",
        "chat",
        grpc.StatusCode.INVALID_ARGUMENT,
        "upstream answered 400",
        None,
        version="v2",
        arm="v2",
        endpoint="127.0.0.1:1",
        retried=True,
        receive_unix_ns=1_700_000_000_000_000_000,
        latency_s=0.0125,
        assignment=Assignment.PIN,
        routing_key="user-7",
        routing_key_header="x-user",
        principal="team-a",
    )
    metadata = [("content-type", "application/json"), ("x-user", "user-7"), ("authorization", "Bearer s")]
    log.offer_http(outcome, b"worker-request", metadata, b"record-fields")
    log.writer.close()
    [entry] = list(iter_entries(tmp_path))
    assert entry.kind == HTTP
    expected = encode_call(
        kind=HTTP,
        request_id="req-1",
        model="chat",
        version="v2",
        arm="v2",
        code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
        details="upstream answered 400",
        endpoint="127.0.0.1:1",
        router_id="router-1",
        principal="team-a",
        receive_unix_ns=1_700_000_000_000_000_000,
        latency_ns=12_500_000,
        flags=RETRIED,
        assignment=recorder_pb2.Assignment.Value("ASSIGNMENT_PIN"),
        shadows_expected=0,
        routing_key_hmac=log.routing_key_hmac("user-7"),
        phase=b"",
        metadata=b"content-type\0application/json\0",
        stream=b"",
        request=b"worker-request",
        response=None,
        record_fields=b"record-fields",
    )
    assert entry.payload == expected
    assert decode_call(HTTP, entry.payload).record_fields == b"record-fields"


@pytest.mark.parametrize(
    ("raw", "refused"),
    [
        (b'{"model":"m","user":"\\ud800"}', "not valid Unicode"),  # an ASCII body spelling a lone surrogate
        (b'{"model":"m","x":' + b"[" * 64 + b"]" * 64 + b"}", "nested too deeply"),  # 65 levels
        (b'{"model":"m","x":' + b"[" * 63 + b"]" * 63 + b"}", None),  # 64 levels: the most allowed
        (b'{"model":"m","user":"caf\\u00e9"}', None),
        ('{"model":"m","user":"\\ud800"}'.encode("utf-16-le"), "not valid Unicode"),  # every byte ASCII
        ('{"model":"m","user":"\\ud800"}'.encode("utf-32-be"), "not valid Unicode"),
    ],
)
def test_the_body_check_skipped_for_plain_bodies_still_refuses(raw: bytes, refused: str | None) -> None:
    """A plain body is not walked (:func:`_plain`); the ones the walk refuses are never taken for plain."""
    if refused is None:
        assert parse_body(raw)["model"] == "m"
        return
    with pytest.raises(ApiError) as error:
        parse_body(raw)
    assert refused in error.value.message
