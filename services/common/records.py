"""Reading recorded calls back from Redis: the one place that knows the recorder's layout.

The recorder writes each call to the stream ``splitstream:calls:<model>`` (fields
``request_id``, ``time_ns``, ``model``, ``version``, ``status``, ``latency_ms``, ``arm``,
``assignment``, ``phase``, ``unit``, ``principal``, ``ttft_ms``, ``tokens``, ``prompt_tokens``,
``completion_tokens``, ``blobs``, ``tags`` and ``record``, the serialized CallRecord), payloads over
its threshold once to ``splitstream:blob:<sha256>``, and each outcome event to the stream
``splitstream:feedback:<model>`` (fields of :func:`feedback_entry_fields`, no protobuf: the
analysis reads them column by column). The readable fields let readers filter and analyse
without parsing records. The recorder, the replayer and tests read and write through
these helpers so the layout lives in one module. Clients must use ``decode_responses=False``:
records and blobs are binary. (Helpers only tests need, such as reading whole records back,
live in ``tests/records.py``.)
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, cast

from splitstream.common.proto.splitstream.v1 import feedback_pb2, recorder_pb2

if TYPE_CHECKING:
    from splitstream.common.redis_url import RedisClient

STREAM_PREFIX = "splitstream:calls:"
FEEDBACK_PREFIX = "splitstream:feedback:"
#: ``splitstream:feedback-seen:{splitstream:feedback:<model>}:<metric>:<idempotency_key>``: set (NX, with a
#: TTL) by the recorder with the entry it writes, so an event re-sent with the same key is not written twice.
#: The braces are a Redis Cluster hash tag: the key hashes to the slot of the feedback stream it guards, so
#: the script that sets it and adds the entry touches one slot (model names hold no braces, see
#: :func:`splitstream.common.names.check_model_name`).
FEEDBACK_SEEN_PREFIX = "splitstream:feedback-seen:"
BLOB_PREFIX = "splitstream:blob:"
#: ``splitstream:archived:{<stream key>}``: the archive's low-water mark of one stream, a stream id such
#: that every entry with a smaller id is in the archive. Archivers only ever raise it (computed from the
#: consumer group's own state, so several archivers agree); the recorder's ``--trim-archived`` retention
#: never trims at or past it. The hash tag puts it in its stream's slot (the scripts reading both).
ARCHIVED_PREFIX = "splitstream:archived:"
#: The consumer group archivers read the call and feedback streams with.
ARCHIVE_GROUP = "splitstream-archive"
#: The tag (``CallRecord.tags``) in which the recorder names, comma-separated, the outputs it dropped
#: or masked in the record's ``response``: their recorded values are not what the model answered, so a
#: replay must not compare them. Deployment tags are free-form; ``splitstream.`` names are the recorder's.
REDACTED_OUTPUTS_TAG = "splitstream.redacted-outputs"
#: The tag in which the router names the payloads it left out of a record too large to send whole
#: (over its ``--record-batch-max-bytes`` alone): ``name:bytes`` of each, comma-separated, names being
#: ``request``, ``response`` and ``shadows[<i>].response``. A replay cannot send a request that is not
#: there, nor compare an answer that is not.
PAYLOAD_DROPPED_TAG = "splitstream.payload-dropped"
#: The tag in which the recorder names the parts of an HTTP call it dropped under input or output rules
#: (``request_body``, ``response_body``, ``events``, comma-separated): JSON bodies hold what the rules'
#: tensors hold, and no rule masks a JSON field.
REDACTED_HTTP_TAG = "splitstream.redacted-http"
#: The CallRecord layout this code reads and the recorder writes.
SCHEMA_VERSION = 1
#: Records and events one RecordBatch may hold: the recorder refuses more unparsed (RESOURCE_EXHAUSTED).
MAX_BATCH_ITEMS = 4096

#: gRPC status code numbers → names, as the ``status`` field of each stream entry spells them.
STATUS_NAMES: tuple[str, ...] = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)


class MissingBlob(LookupError):
    """A record references a blob that is not in Redis (expired, evicted or deleted)."""


class UnsupportedSchema(ValueError):
    """A record was written in a newer layout than this code reads."""


class CorruptEntry(ValueError):
    """A stream entry that is not a readable record (a field missing or malformed, undecodable bytes).

    Streams are written by recorders only, but anyone with Redis access can XADD, and a
    reader that meets such an entry skips and counts it rather than giving up on the window."""


@dataclass(frozen=True, slots=True)
class RawEntry:
    """One stream entry as Redis returned it: its id and its fields, nothing decoded yet.

    Readers that filter on the readable fields (``time_ns``, ``version``, ``status``) before
    paying for the protobuf decode start here."""

    stream_id: str
    fields: dict[bytes, bytes]


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """A CallRecord and the id Redis gave its stream entry (``<ms>-<seq>``, usable as an XRANGE bound)."""

    stream_id: str
    record: recorder_pb2.CallRecord


def stream_key(model: str) -> str:
    return STREAM_PREFIX + model


def feedback_key(model: str) -> str:
    return FEEDBACK_PREFIX + model


def feedback_seen_key(model: str, metric: str, idempotency_key: str) -> str:
    """The key that marks an idempotency key as seen, readable in ``redis-cli``. Model and metric names may
    hold ``:``, so two triples can share a key only when one's model ends where the other's metric
    begins (model ``a:b`` metric ``c`` against model ``a`` metric ``b:c``, same idempotency key):
    the later event then counts as a duplicate."""
    return f"{FEEDBACK_SEEN_PREFIX}{{{feedback_key(model)}}}:{metric}:{idempotency_key}"


def archive_mark_key(stream: str) -> str:
    """The key holding the archive's low-water mark of stream key ``stream`` (:data:`ARCHIVED_PREFIX`)."""
    return f"{ARCHIVED_PREFIX}{{{stream}}}"


def archive_group_key(group: str) -> str:
    """The key naming the archive an archiver consumer group writes to (set by its first archiver)."""
    return f"splitstream:archive-group:{group}"


#: Lua: whether stream id ARGV-style ``a`` sorts before ``b`` (``ms`` alone reads as ``ms-0``). Shared by
#: the scripts that compare ids inside Redis (the archiver's mark, the recorder's archive-aware trim).
LUA_ID_LESS = """
local function parse_id(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if not ms then return tonumber(id) or 0, 0 end
  return tonumber(ms), tonumber(seq)
end
local function id_less(a, b)
  local am, as = parse_id(a)
  local bm, bs = parse_id(b)
  return am < bm or (am == bm and as < bs)
end
"""


def assignment_name(assignment: int) -> str:
    """``ASSIGNMENT_HASH`` → ``"hash"``; records older than the field read ``"unspecified"``."""
    return recorder_pb2.Assignment.Name(assignment).removeprefix("ASSIGNMENT_").lower()


def blob_key(sha256_hex: str) -> str:
    return BLOB_PREFIX + sha256_hex


def stream_id_at(unix_ns: int) -> str:
    """An XRANGE bound for a wall-clock time. Entry ids are the time Redis *wrote* a record, which is
    at or after the call's ``receive_unix_ns`` (later still if the router spooled it during an outage),
    so read a window with some slack past its end and filter on ``time_ns``/``receive_unix_ns``."""
    return str(unix_ns // 1_000_000)


def stream_id_ms(stream_id: str) -> int:
    """The millisecond part of a stream id (``"1700000000123-4"`` → ``1700000000123``): when Redis wrote it."""
    return int(stream_id.partition("-")[0])


def entry_fields(record: recorder_pb2.CallRecord) -> dict[str, str | bytes]:
    """The stream entry the recorder writes for ``record``: readable fields beside the serialized record.
    (Tools and tests that write records, e.g. to stand in for a spooled record arriving late, use it too.)"""
    # Imported here, not with the module: token_usage decodes tensors with NumPy (0.15 s of CPU to import),
    # which the routers and shippers that import this module for its names never need. The recorder, the
    # one service that calls this, imports token_usage at start (splitstream.recorder.core).
    from splitstream.common.token_usage import token_counts, ttft_ns

    first_token_ns = ttft_ns(record)
    prompt_tokens, completion_tokens = token_counts(record)
    return {
        "request_id": record.request_id,
        "time_ns": str(record.receive_unix_ns),
        "model": record.model,
        "version": record.version,
        "status": status_name(record.status_code),
        "latency_ms": f"{record.latency_ns / 1e6:.3f}",
        "arm": record.arm,
        "assignment": assignment_name(record.assignment),
        "phase": record.phase.id,
        # The unit of analysis: the routing key's HMAC; empty for a call without a key.
        "unit": record.routing_key_hmac,
        # The authenticated caller (a configured principal's name; empty when callers are not authenticated).
        "principal": record.principal,
        # Token streams: time to the first token and responses received (empty for a unary call,
        # TTFT empty when no token came), so the analysis need not parse records.
        "ttft_ms": f"{first_token_ns / 1e6:.3f}" if first_token_ns > 0 else "",
        "tokens": str(record.stream.responses_total) if record.HasField("stream") else "",
        # Tokens in and out of a generation (splitstream.common.token_usage); empty where unknown.
        "prompt_tokens": "" if prompt_tokens is None else str(prompt_tokens),
        "completion_tokens": "" if completion_tokens is None else str(completion_tokens),
        # Payloads stored as blob references, and the record's tag names: a reader that needs neither (the
        # archiver, for most records) keeps the record's bytes as they are without parsing them.
        "blobs": str(blob_references(record)),
        "tags": ",".join(sorted(record.tags)),
        "record": record.SerializeToString(),
    }


def record_payloads(record: recorder_pb2.CallRecord) -> list[recorder_pb2.Payload]:
    """Every payload ``record`` holds: request, response, shadows' responses, a token stream's messages, an HTTP
    call's bodies and events. The recorder stores each over its threshold as a blob, the archive inlines them
    back: one list, so a payload field added to the record is covered by both."""
    payloads = [record.request, record.response, *(shadow.response for shadow in record.shadows)]
    if record.HasField("stream"):
        payloads += [message.payload for message in record.stream.requests]
        payloads += [message.payload for message in record.stream.responses]
    if record.HasField("http"):
        payloads += [record.http.request_body, record.http.response_body]
        payloads += [message.payload for message in record.http.events]
    return payloads


def blob_references(record: recorder_pb2.CallRecord) -> int:
    """How many of ``record``'s payloads (:func:`record_payloads`) are blob references."""
    return sum(1 for payload in record_payloads(record) if payload.blob_sha256)


def feedback_entry_fields(event: feedback_pb2.FeedbackEvent) -> dict[str, str | bytes]:
    """The stream entry the recorder writes for one outcome event (its routing key already an HMAC)."""
    return {
        "request_id": event.request_id,
        "unit": event.routing_key_hmac,
        "metric": event.metric,
        "value": repr(event.value),
        "event_ns": str(event.event_unix_ns or event.receive_unix_ns),
        "receive_ns": str(event.receive_unix_ns),
        "idempotency_key": event.idempotency_key,
    }


def mark_redacted_outputs(record: recorder_pb2.CallRecord, names: Iterable[str]) -> None:
    """Name ``names`` in the record's :data:`REDACTED_OUTPUTS_TAG` (nothing when there are none)."""
    joined = ",".join(sorted(set(names)))
    if joined:
        record.tags[REDACTED_OUTPUTS_TAG] = joined


def redacted_outputs(record: recorder_pb2.CallRecord) -> frozenset[str]:
    """The outputs the recorder redacted in the record's response (empty for most records)."""
    return frozenset(name for name in record.tags.get(REDACTED_OUTPUTS_TAG, "").split(",") if name)


def dropped_payloads(record: recorder_pb2.CallRecord) -> dict[str, int]:
    """The payloads left out of the record for size (:data:`PAYLOAD_DROPPED_TAG`), by name, with their sizes
    (empty for most records). An item that does not parse keeps its name with size -1: it was dropped all
    the same, and a reader must not take the payload's absence for an empty one."""
    dropped: dict[str, int] = {}
    for item in record.tags.get(PAYLOAD_DROPPED_TAG, "").split(","):
        name, _, size = item.strip().partition(":")
        if name:
            dropped[name] = int(size) if size.isdigit() else -1
    return dropped


def status_name(code: int) -> str:
    """``3`` → ``"INVALID_ARGUMENT"``; numbers outside gRPC's table stay readable as ``CODE_<n>``."""
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else f"CODE_{code}"


def status_code(name: str) -> int:
    """The inverse of :func:`status_name` (case-insensitive; ``CODE_<n>`` and plain numbers too).
    Raises ValueError for a name gRPC does not have."""
    upper = name.strip().upper()
    if upper in STATUS_NAMES:
        return STATUS_NAMES.index(upper)
    number = upper.removeprefix("CODE_")
    if number.isdigit():
        return int(number)
    raise ValueError(f"unknown gRPC status {name!r} (expected a name such as INVALID_ARGUMENT, or a number)")


def routing_key_hmac(key: bytes, routing_key: str) -> str:
    """HMAC-SHA256 (hex) of a routing key: records and replay filters match on this, never on the key."""
    # hmac.digest is the one-shot C path: about 1 µs against 4 µs for hmac.new(...).hexdigest(), on every call.
    return hmac.digest(key, routing_key.encode(), "sha256").hex()


async def recorded_models(redis: RedisClient) -> list[str]:
    """The models that have a stream, sorted (a SCAN, so cheap enough for an error message or a listing)."""
    models = []
    async for key in redis.scan_iter(match=STREAM_PREFIX + "*", count=1000, _type="stream"):
        name = key.decode() if isinstance(key, bytes) else str(key)
        models.append(name.removeprefix(STREAM_PREFIX))
    return sorted(models)


async def read_entries(
    redis: RedisClient, model: str, *, start: str = "-", end: str = "+", page_size: int = 500
) -> AsyncIterator[RawEntry]:
    """Yield the raw entries of ``model``'s stream between stream ids ``start`` and ``end`` (inclusive), oldest first.

    Reads in pages of ``page_size`` entries (XRANGE ... COUNT), so a long window never sits in memory at once.
    """
    key = stream_key(model)
    lower = start
    while True:
        page = cast(
            list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(key, min=lower, max=end, count=page_size)
        )
        for raw_id, fields in page:
            yield RawEntry(raw_id.decode(), fields)
        if len(page) < page_size:
            return
        lower = "(" + page[-1][0].decode()


def entry_time_ns(entry: RawEntry) -> int:
    """The entry's ``time_ns`` field (router receive time), read without decoding the record.
    Raises :class:`CorruptEntry` when it is missing or not an integer."""
    raw = entry.fields.get(b"time_ns")
    try:
        return int(raw) if raw is not None else _missing(entry, "time_ns")
    except ValueError:
        raise CorruptEntry(f"entry {entry.stream_id}: time_ns {raw!r} is not an integer") from None


def entry_text(entry: RawEntry, field: str) -> str:
    """A readable field of the entry (``version``, ``status``, ``request_id``, ...); "" when absent."""
    raw = entry.fields.get(field.encode())
    return raw.decode(errors="replace") if raw is not None else ""


def decode_entry(entry: RawEntry) -> StoredRecord:
    """Decode the entry's ``record`` field. Raises :class:`CorruptEntry` or :class:`UnsupportedSchema`."""
    data = entry.fields.get(b"record")
    if data is None:
        _missing(entry, "record")
    try:
        return StoredRecord(entry.stream_id, decode_record(data))
    except UnsupportedSchema:
        raise
    except Exception as error:  # protobuf's DecodeError and friends: the bytes are not a CallRecord
        raise CorruptEntry(f"entry {entry.stream_id}: record does not decode ({type(error).__name__})") from None


def _missing(entry: RawEntry, field: str) -> NoReturn:
    raise CorruptEntry(f"entry {entry.stream_id}: no {field} field")


def decode_record(data: bytes) -> recorder_pb2.CallRecord:
    record = recorder_pb2.CallRecord.FromString(data)
    if record.schema_version > SCHEMA_VERSION:
        raise UnsupportedSchema(
            f"record {record.request_id!r} has schema version {record.schema_version}; "
            f"this reader knows up to {SCHEMA_VERSION}"
        )
    return record


async def payload_bytes(redis: RedisClient, payload: recorder_pb2.Payload) -> bytes:
    """The payload's bytes, inline or fetched from its blob. Raises :class:`MissingBlob` if the blob is gone."""
    if payload.WhichOneof("body") != "blob_sha256":
        return payload.inline
    data = cast(bytes | None, await redis.get(blob_key(payload.blob_sha256)))
    if data is None:
        raise MissingBlob(
            f"blob {payload.blob_sha256} ({payload.size_bytes} bytes) is not in Redis; "
            "it expired or was evicted (blob TTL shorter than the stream's retention?)"
        )
    return data
