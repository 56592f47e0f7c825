"""Checking each record of a RecordBatch before any of it is written.

A bad record is rejected alone, naming it (index and request id) and the problem,
and the rest of its batch is written: one malformed call (say, a request whose
head parses but whose tensors do not, under an input rule) must not cost other
callers' records. Only a message that is not a RecordBatch at all is refused
whole. Checks are about what the recorder needs to store and key a record safely;
the call's own content (a client's invalid request, an error status) is recorded
as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from splitstream.common import records
from splitstream.common.feedback import EventProblem, check_event
from splitstream.common.names import check_model_name
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import feedback_pb2, recorder_pb2
from splitstream.common.records import PAYLOAD_DROPPED_TAG, SCHEMA_VERSION
from splitstream.recorder.errors import BatchTooLarge, InvalidBatch

#: Tags under ``splitstream.`` are the system's own; a router may set only these, the rest (such as
#: ``splitstream.redacted-outputs``, which tells the replayer not to compare an output) are the recorder's.
ROUTER_TAGS = frozenset({PAYLOAD_DROPPED_TAG})
RESERVED_TAG_PREFIX = "splitstream."
#: Receive times a router's clock cannot give: before 2000, or more than a day ahead of this recorder's
#: clock (spooled records arrive late, never early; a day covers any clock a router could be allowed).
EARLIEST_RECEIVE_NS = 946_684_800 * 10**9
MAX_AHEAD_NS = 86_400 * 10**9
#: Records and events one batch may hold (routers send 256 of each at most by default). Each item, even an
#: empty one (2 bytes on the wire), costs the recorder about a kilobyte to reject and the ack ~60 bytes: a 2 MB
#: batch of a million empty records would take 12 s and 900 MB, its ack of 51 MB would be over the sender's
#: receive limit, and a batch at the 128 MiB receive limit would need some 60 GB. Counted on the wire before
#: parsing.
MAX_BATCH_ITEMS = records.MAX_BATCH_ITEMS
#: What of a rejected record's request id and reason the ack carries: bounded, so an ack of
#: :data:`MAX_BATCH_ITEMS` rejections stays well under a client's default 4 MiB receive limit.
MAX_ACK_REQUEST_ID = 200
MAX_ACK_REASON = 300


@dataclass(slots=True)
class CheckedRecord:
    #: Position in the batch (what a rejection names).
    index: int
    record: recorder_pb2.CallRecord
    #: The decoded request, when input redaction needs it (else None).
    request: oip.ModelInferRequest | None
    #: The decoded response, when output redaction needs it (else None).
    response: oip.ModelInferResponse | None = None
    #: Each shadow's decoded response, in the order of ``record.shadows``, when output redaction needs them.
    shadow_responses: tuple[oip.ModelInferResponse, ...] = ()
    #: A token stream's requests and responses decoded, in the order of ``record.stream``, when input
    #: (requests) or output (responses) redaction needs them.
    stream_requests: tuple[oip.ModelInferRequest, ...] = ()
    stream_responses: tuple[oip.ModelStreamInferResponse, ...] = ()


@dataclass(frozen=True, slots=True)
class Rejection:
    index: int
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class CheckedEvent:
    #: Position in the batch's ``feedback`` (what a rejection names).
    index: int
    event: feedback_pb2.FeedbackEvent


@dataclass(slots=True)
class ParsedBatch:
    sequence: int
    checked: list[CheckedRecord]
    rejected: list[Rejection]
    events: list[CheckedEvent] = field(default_factory=list)
    rejected_events: list[Rejection] = field(default_factory=list)


def parse_batch(data: bytes, *, decode_requests: bool, decode_responses: bool = False) -> ParsedBatch:
    """Parse and check every record of a serialized RecordBatch; bad records are set aside as rejections.

    Raises :class:`InvalidBatch` only when ``data`` is not a RecordBatch at all. The batch is framed
    first with records left as bytes, so even a record that does not parse is rejected alone.
    ``decode_requests``/``decode_responses``: decode (and so require decodable) requests, or responses
    and shadow responses, for the redaction that reads them."""
    items = count_items(data, MAX_BATCH_ITEMS + 1)
    if items > MAX_BATCH_ITEMS:
        raise BatchTooLarge(
            f"the batch holds more than {MAX_BATCH_ITEMS} records and events; send at most {MAX_BATCH_ITEMS} a batch"
        )
    try:
        framed = recorder_pb2.EncodedRecordBatch.FromString(data)
    except DecodeError as error:
        raise InvalidBatch(f"the message is not a splitstream.v1.RecordBatch ({error})") from None
    parsed = ParsedBatch(framed.sequence, [], [])
    for index, raw in enumerate(framed.records):
        try:
            record = recorder_pb2.CallRecord.FromString(raw)
        except DecodeError as error:
            parsed.rejected.append(Rejection(index, "", f"the record is not a splitstream.v1.CallRecord ({error})"))
            continue
        try:
            request = check_record(record, decode_request=decode_requests)
            responses = decode_record_responses(record) if decode_responses else None
            stream_requests, stream_responses = decode_stream(
                record, requests=decode_requests, responses=decode_responses
            )
        except ValueError as error:
            parsed.rejected.append(Rejection(index, record.request_id, str(error)))
            continue
        checked = CheckedRecord(
            index, record, request, stream_requests=stream_requests, stream_responses=stream_responses
        )
        if responses is not None:
            checked.response, checked.shadow_responses = responses[0], responses[1:]
        parsed.checked.append(checked)
    for index, raw in enumerate(framed.feedback):
        try:
            event = feedback_pb2.FeedbackEvent.FromString(raw)
        except DecodeError as error:
            parsed.rejected_events.append(
                Rejection(index, "", f"the event is not a splitstream.v1.FeedbackEvent ({error})")
            )
            continue
        try:
            check_stored_event(event)
        except EventProblem as error:
            parsed.rejected_events.append(Rejection(index, event.request_id[:200], str(error)))
            continue
        parsed.events.append(CheckedEvent(index, event))
    return parsed


def count_items(data: bytes, limit: int) -> int:
    """Records and events (fields 2 and 3) of a serialized RecordBatch, counted up to ``limit``: a walk over
    the top-level fields that stops there, so a batch of millions costs no more than one of ``limit``.
    Bytes that are no protobuf end the count early; the parse that follows names what is wrong."""
    count = position = 0
    end = len(data)
    while position < end and count < limit:
        key, position = _varint(data, position)
        if position < 0:
            break
        wire_type = key & 7
        if wire_type == 0:
            _, position = _varint(data, position)
        elif wire_type == 2:
            length, position = _varint(data, position)
            if position < 0:
                break
            position += length
            count += (key >> 3) in (2, 3)
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        else:
            break
        if position < 0:
            break
    return count


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at ``position`` and the position after it; (0, -1) when it runs past the end or on for
    more than ten bytes."""
    value = shift = 0
    for offset in range(10):
        if position + offset >= len(data):
            return 0, -1
        byte = data[position + offset]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position + offset + 1
        shift += 7
    return 0, -1


def check_stored_event(event: feedback_pb2.FeedbackEvent) -> None:
    """Raise :class:`EventProblem` unless ``event`` can be stored as it is: routers send the routing key's
    HMAC only, so an event that still carries the key itself is refused rather than stored or hashed here
    (whoever sent it may hash under another key, and the user id must not reach Redis either way)."""
    if event.routing_key:
        raise EventProblem("routing_key", "is set: routers send only routing_key_hmac, never the key itself")
    if event.receive_unix_ns <= 0:
        raise EventProblem("receive_unix_ns", f"is {event.receive_unix_ns}, expected unix time in ns (> 0)")
    check_event(event, receive_unix_ns=event.receive_unix_ns)


def check_record(record: recorder_pb2.CallRecord, *, decode_request: bool) -> oip.ModelInferRequest | None:
    """Raise ValueError naming the problem; return the decoded request when ``decode_request``."""
    if record.schema_version != SCHEMA_VERSION:
        raise ValueError(f"schema_version is {record.schema_version}, this recorder writes {SCHEMA_VERSION}")
    if not record.request_id:
        raise ValueError("request_id is empty")
    check_model_name(record.model)
    if record.receive_unix_ns <= 0:
        raise ValueError(f"receive_unix_ns is {record.receive_unix_ns}, expected unix time in ns (> 0)")
    if record.receive_unix_ns < EARLIEST_RECEIVE_NS:
        raise ValueError(f"receive_unix_ns is {record.receive_unix_ns}, before the year 2000: no router received it")
    if record.receive_unix_ns > time.time_ns() + MAX_AHEAD_NS:
        raise ValueError(f"receive_unix_ns is {record.receive_unix_ns}, more than a day ahead of the recorder's clock")
    if record.latency_ns < 0:
        raise ValueError(f"latency_ns is {record.latency_ns}, a latency cannot be negative")
    for index, shadow in enumerate(record.shadows):
        if shadow.latency_ns < 0:
            raise ValueError(f"shadows[{index}].latency_ns is {shadow.latency_ns}, a latency cannot be negative")
    for tag in record.tags:
        if tag.startswith(RESERVED_TAG_PREFIX) and tag not in ROUTER_TAGS:
            raise ValueError(f"tag {tag!r} is reserved to the recorder; a router cannot set it")
    check_payload(record.request, "request")
    check_payload(record.response, "response")
    for index, shadow in enumerate(record.shadows):
        check_payload(shadow.response, f"shadows[{index}].response")
    if record.HasField("stream"):
        check_stream(record)
    if record.HasField("http"):
        check_http(record.http)
    if not decode_request:
        return None
    try:
        return oip.ModelInferRequest.FromString(record.request.inline)
    except DecodeError:
        raise ValueError(
            "the request payload is not an inference.ModelInferRequest (input redaction needs to read it)"
        ) from None


def decode_record_responses(record: recorder_pb2.CallRecord) -> tuple[oip.ModelInferResponse, ...]:
    """The response, then each shadow's, decoded (an empty payload, as on errors, is an empty response).
    Raise ValueError naming the first that is not an inference.ModelInferResponse: storing it unread
    could store an output the rules say must not be."""
    payloads = [("response", record.response)]
    payloads += [(f"shadows[{i}].response", shadow.response) for i, shadow in enumerate(record.shadows)]
    decoded = []
    for what, payload in payloads:
        try:
            decoded.append(oip.ModelInferResponse.FromString(payload.inline))
        except DecodeError:
            raise ValueError(
                f"the {what} payload is not an inference.ModelInferResponse (output redaction needs to read it)"
            ) from None
    return tuple(decoded)


def check_stream(record: recorder_pb2.CallRecord) -> None:
    """A token stream's record: its messages in order (indices increasing, offsets from the stream's start
    never going back), its responses in ``stream`` (``response`` stays empty), counts that add up."""
    stream = record.stream
    if record.response.inline:
        raise ValueError("a stream record carries its responses in stream.responses; response must be empty")
    for what, messages in (("requests", stream.requests), ("responses", stream.responses)):
        last_index, last_offset = -1, 0
        for position, message in enumerate(messages):
            name = f"stream.{what}[{position}]"
            if message.index <= last_index:
                raise ValueError(f"{name}.index is {message.index}, after index {last_index}: indices must increase")
            if message.offset_ns < last_offset:
                raise ValueError(f"{name}.offset_ns is {message.offset_ns}, before the previous {last_offset}")
            last_index, last_offset = message.index, message.offset_ns
            check_payload(message.payload, f"{name}.payload")
    if stream.responses_total < len(stream.responses):
        raise ValueError(
            f"stream.responses_total is {stream.responses_total} but {len(stream.responses)} responses are kept"
        )
    if (
        stream.responses
        and stream.responses[0].index == 0
        and stream.first_response_ns != stream.responses[0].offset_ns
    ):
        raise ValueError(
            f"stream.first_response_ns is {stream.first_response_ns}, not the first response's offset "
            f"{stream.responses[0].offset_ns}"
        )


def check_http(http: recorder_pb2.HttpCall) -> None:
    """An HTTP call's exchange: a status HTTP has, bodies and events inline, events in order (indices
    increasing, offsets from the call's start never going back), counts that add up."""
    if not 100 <= http.status <= 599:
        raise ValueError(f"http.status is {http.status}, not an HTTP status (100-599)")
    check_payload(http.request_body, "http.request_body")
    check_payload(http.response_body, "http.response_body")
    last_index, last_offset = -1, 0
    for position, message in enumerate(http.events):
        name = f"http.events[{position}]"
        if message.index <= last_index:
            raise ValueError(f"{name}.index is {message.index}, after index {last_index}: indices must increase")
        if message.offset_ns < last_offset:
            raise ValueError(f"{name}.offset_ns is {message.offset_ns}, before the previous {last_offset}")
        last_index, last_offset = message.index, message.offset_ns
        check_payload(message.payload, f"{name}.payload")
    if http.events_total < len(http.events):
        raise ValueError(f"http.events_total is {http.events_total} but {len(http.events)} events are kept")
    if http.first_token_ns < 0:
        raise ValueError(f"http.first_token_ns is {http.first_token_ns}, a time cannot be negative")


def decode_stream(
    record: recorder_pb2.CallRecord, *, requests: bool, responses: bool
) -> tuple[tuple[oip.ModelInferRequest, ...], tuple[oip.ModelStreamInferResponse, ...]]:
    """A stream's requests (when ``requests``) and responses (when ``responses``) decoded, for redaction;
    ValueError naming the first that does not decode (storing it unread could keep what must not be)."""
    if not record.HasField("stream"):
        return (), ()
    decoded_requests = []
    decoded_responses = []
    try:
        for position, message in enumerate(record.stream.requests if requests else ()):
            what = f"stream.requests[{position}]"
            decoded_requests.append(oip.ModelInferRequest.FromString(message.payload.inline))
        for position, message in enumerate(record.stream.responses if responses else ()):
            what = f"stream.responses[{position}]"
            decoded_responses.append(oip.ModelStreamInferResponse.FromString(message.payload.inline))
    except DecodeError:
        raise ValueError(f"the {what} payload does not decode (redaction needs to read it)") from None
    return tuple(decoded_requests), tuple(decoded_responses)


def check_payload(payload: recorder_pb2.Payload, what: str) -> None:
    """Payloads arrive inline (or empty): only the recorder makes blob references, after redacting."""
    body = payload.WhichOneof("body")
    if body == "blob_sha256":
        raise ValueError(f"{what} payload is a blob reference; send the bytes inline (the recorder stores blobs)")
    size = len(payload.inline)
    if payload.size_bytes and payload.size_bytes != size:
        raise ValueError(f"{what} payload says size_bytes {payload.size_bytes} but carries {size} bytes")
