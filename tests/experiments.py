"""Writing A/B traffic into Redis the way the recorder does, for the analysis tests and benchmark.

Calls go to ``splitstream:calls:<model>`` as :func:`entry_fields` writes them (readable fields plus the
serialized CallRecord, with its phase and assignment); outcome events to ``splitstream:feedback:<model>`` as
:func:`feedback_entry_fields` writes them. Pipelined XADDs in batches, like the recorder's writer.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from splitstream.common.proto.splitstream.v1 import feedback_pb2, recorder_pb2
from splitstream.common.records import entry_fields, feedback_entry_fields, feedback_key, stream_key
from tests import launcher
from tests.harness import ROOT

ASSIGNMENTS = {
    "hash": recorder_pb2.ASSIGNMENT_HASH,
    "random": recorder_pb2.ASSIGNMENT_RANDOM,
    "pin": recorder_pb2.ASSIGNMENT_PIN,
    "spill": recorder_pb2.ASSIGNMENT_SPILL,
    "retry": recorder_pb2.ASSIGNMENT_RETRY,
    "unspecified": recorder_pb2.ASSIGNMENT_UNSPECIFIED,
}


def phase(weights: dict[str, float], control: str, salt: str = "salt") -> recorder_pb2.Phase:
    """A Phase message with an id derived from its contents (stand-in for the router's id)."""
    text = repr((salt, control, sorted(weights.items())))
    return recorder_pb2.Phase(id=hashlib.sha256(text.encode()).hexdigest()[:16], weights=weights, control=control)


@dataclass(frozen=True, slots=True)
class Call:
    request_id: str
    time_ns: int
    arm: str
    unit: str = ""
    assignment: str = "hash"
    status_code: int = 0
    latency_ms: float = 5.0
    version: str = ""
    #: The authenticated caller (``CallRecord.principal``).
    principal: str = ""
    #: A token stream: the responses it got (None: a unary call), and its time to first token (None: none came).
    tokens: int | None = None
    ttft_ms: float | None = None
    #: A generation's reported usage, prompt and completion tokens (``CallRecord.usage``; None: none reported).
    usage: tuple[int, int] | None = None


def call_record(
    model: str, call: Call, call_phase: recorder_pb2.Phase, payload: bytes = b""
) -> recorder_pb2.CallRecord:
    record = recorder_pb2.CallRecord(
        schema_version=1,
        request_id=call.request_id,
        receive_unix_ns=call.time_ns,
        model=model,
        version=call.version or call.arm,
        arm=call.arm,
        routing_key_hmac=call.unit,
        status_code=call.status_code,
        latency_ns=int(call.latency_ms * 1e6),
        request=recorder_pb2.Payload(inline=payload, size_bytes=len(payload)),
        phase=call_phase,
        assignment=ASSIGNMENTS[call.assignment],  # type: ignore[arg-type]
        pinned=call.assignment == "pin",
        fallback=call.assignment == "spill",
        principal=call.principal,
    )
    if call.usage is not None:
        record.usage.prompt_tokens, record.usage.completion_tokens = call.usage
    if call.tokens is not None:
        record.stream.CopyFrom(
            recorder_pb2.StreamCall(first_response_ns=int((call.ttft_ms or 0) * 1e6), responses_total=call.tokens)
        )
    return record


def write_calls(
    client: redis.Redis,
    model: str,
    calls: Iterable[Call],
    call_phase: recorder_pb2.Phase,
    *,
    payload: bytes = b"",
    batch: int = 2_000,
    written_at_ns: int | None = None,
) -> int:
    """XADD each call's entry, in time order, with the entry id Redis would have given it had the recorder
    written it when the call happened (``<ms>-*``), or at ``written_at_ns`` (a late, spooled delivery).
    Returns how many were written."""
    written = 0
    pipe = client.pipeline(transaction=False)
    for call in sorted(calls, key=lambda c: c.time_ns):
        fields = entry_fields(call_record(model, call, call_phase, payload))
        at_ms = (call.time_ns if written_at_ns is None else written_at_ns) // 1_000_000
        pipe.xadd(stream_key(model), fields, id=f"{at_ms}-*")  # type: ignore[arg-type]
        written += 1
        if written % batch == 0:
            pipe.execute()
    pipe.execute()
    return written


@dataclass(frozen=True, slots=True)
class Event:
    metric: str
    value: float
    event_ns: int
    request_id: str = ""
    unit: str = ""
    idempotency_key: str = ""


def feedback_message(model: str, event: Event) -> feedback_pb2.FeedbackEvent:
    """The event as the router hands it to the recorder (received at its event time)."""
    return feedback_pb2.FeedbackEvent(
        model=model,
        request_id=event.request_id,
        routing_key_hmac=event.unit,
        metric=event.metric,
        value=event.value,
        event_unix_ns=event.event_ns,
        idempotency_key=event.idempotency_key,
        receive_unix_ns=event.event_ns,
    )


def write_feedback(
    client: redis.Redis, model: str, events: Iterable[Event], *, batch: int = 2_000, written_at_ns: int | None = None
) -> int:
    """Like :func:`write_calls`, for outcome events (entry ids at their event time, or ``written_at_ns``)."""
    written = 0
    pipe = client.pipeline(transaction=False)
    for event in sorted(events, key=lambda e: e.event_ns):
        message = feedback_message(model, event)
        at_ms = (event.event_ns if written_at_ns is None else written_at_ns) // 1_000_000
        pipe.xadd(feedback_key(model), feedback_entry_fields(message), id=f"{at_ms}-*")  # type: ignore[arg-type]
        written += 1
        if written % batch == 0:
            pipe.execute()
    pipe.execute()
    return written


def write_arrivals(
    client: redis.Redis,
    model: str,
    arrivals: Iterable[tuple[int, Call | Event]],
    call_phase: recorder_pb2.Phase,
    *,
    batch: int = 2_000,
) -> int:
    """Calls and events into their streams in the order they reached Redis: each ``(arrival_ns, item)`` gets
    the entry id of its arrival, so a copy delivered a while after the original (at-least-once delivery)
    sits among the entries of that later time. Returns how many were written."""
    written = 0
    pipe = client.pipeline(transaction=False)
    for arrival_ns, item in sorted(arrivals, key=lambda pair: pair[0]):
        if isinstance(item, Call):
            key, fields = stream_key(model), entry_fields(call_record(model, item, call_phase))
        else:
            key, fields = feedback_key(model), feedback_entry_fields(feedback_message(model, item))
        pipe.xadd(key, fields, id=f"{arrival_ns // 1_000_000}-*")  # type: ignore[arg-type]
        written += 1
        if written % batch == 0:
            pipe.execute()
    pipe.execute()
    return written


def analyze_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``splitstream analyze ARGS`` as a user runs it, without this shell's SPLITSTREAM_ settings."""
    return launcher.run(
        [sys.executable, "-m", "splitstream.admin", "analyze", *args],
        env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
