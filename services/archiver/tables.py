"""Stream entries → Parquet tables, one per (model, hour) partition. Pure and blocking: run in the
builder process (:mod:`splitstream.archiver.builder`).

The columns come from the entries' readable fields, each built by pyarrow from one list per batch. A
record is archived as the exact bytes Redis held, unparsed, when its entry says it references no blob
and has no tags (the ``blobs`` and ``tags`` fields) and it starts as its request id says; the rest are
parsed: payloads stored as blobs are inlined so a file stands alone (the record re-serialized with the
blob bytes in ``Payload.inline``, its ``size_bytes`` unchanged), tags read, undecodable records counted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from splitstream.common.archive import CALL_SCHEMA, CALLS, FEEDBACK, FEEDBACK_SCHEMA, file_name, partition_dir
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import (
    SCHEMA_VERSION,
    STATUS_NAMES,
    UnsupportedSchema,
    decode_record,
    status_code,
    stream_id_ms,
)


@dataclass(slots=True)
class Entry:
    """A stream entry as Redis sent it: its fields a flat name, value, name, value... list (redis-py's
    dict per entry cost ~3 µs an entry, measured: more than the rest of archiving a record)."""

    stream_id: str
    flat: list[bytes]

    @classmethod
    def from_dict(cls, stream_id: str, fields: dict[bytes, bytes]) -> Entry:
        return cls(stream_id, [part for item in fields.items() for part in item])

    @property
    def fields(self) -> dict[bytes, bytes]:
        flat = self.flat
        return dict(zip(flat[::2], flat[1::2], strict=False))

    @property
    def size(self) -> int:
        """About the bytes it adds to a file: its fields (the record, and a few dozen readable bytes)."""
        return sum(map(len, self.flat)) + 64


@dataclass(frozen=True, slots=True)
class PlannedFile:
    """One file to write: where, what, and which entries it acknowledges."""

    relative_path: str
    table: pa.Table


def id_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def blob_payloads(record: recorder_pb2.CallRecord) -> Iterator[recorder_pb2.Payload]:
    """Every payload of ``record`` stored as a blob reference (request, response, shadows, stream messages)."""
    payloads = [record.request, record.response, *(shadow.response for shadow in record.shadows)]
    if record.HasField("stream"):
        payloads += [message.payload for message in record.stream.requests]
        payloads += [message.payload for message in record.stream.responses]
    for payload in payloads:
        if payload.WhichOneof("body") == "blob_sha256":
            yield payload


#: The entry fields the call columns are made of (``blobs``, ``tags``: whether the record must be parsed).
_CALL_FIELDS = (
    b"request_id",
    b"time_ns",
    b"version",
    b"arm",
    b"assignment",
    b"phase",
    b"status",
    b"latency_ms",
    b"unit",
    b"principal",
    b"ttft_ms",
    b"tokens",
    b"blobs",
    b"tags",
    b"record",
)


@dataclass(slots=True)
class DecodedCalls:
    entries: list[Entry]
    #: Per field of :data:`_CALL_FIELDS`, its value in each entry (None where an entry lacks it).
    fields: dict[bytes, Sequence[bytes | None]]
    #: Per entry, what the record's columns say (``principal``, ``ttft_ms`` and ``tokens`` as the entry
    #: fields write them, ``b""`` for none). Taken from the entry's fields, except for the records parsed.
    principals: list[bytes]
    tags: list[list[tuple[str, str]]]
    streamed: list[bool]
    ttft_ms: list[bytes]
    tokens: list[bytes]
    #: The records that reference blobs, by index (only these are kept decoded: holding every decoded
    #: record of a file alive made the garbage collector walk them all, several µs a record, measured),
    #: and the digests they reference.
    with_blobs: dict[int, recorder_pb2.CallRecord]
    blobs: set[str]
    #: Indexes of the entries whose record does not decode, has no request id or is of a newer layout:
    #: archived with what their readable fields say and the bytes as they are.
    unreadable: list[int]
    corrupt: int
    #: How many records were parsed (the rest kept as the bytes Redis held, unparsed).
    parsed: int = 0


def entry_columns(entries: Sequence[Entry], names: Sequence[bytes]) -> dict[bytes, Sequence[bytes | None]]:
    """The values of ``names`` in every entry, as lists (None where an entry lacks one).

    Entries written by one recorder version share one layout, so each field is taken by its position in
    the first entry, and every entry is checked to have that name there (a C-speed ``list.count``);
    entries of mixed layouts (a recorder upgrade, a hand-written entry) fall back to a dict per entry."""
    first = entries[0].flat
    positions = {first[i]: i + 1 for i in range(0, len(first) - 1, 2)}
    out: dict[bytes, Sequence[bytes | None]] = {}
    flats = [entry.flat for entry in entries]
    if all(len(flat) == len(first) for flat in flats):
        transposed = list(zip(*flats, strict=True))  # one C-speed pass (measured: half of a list per field)
        for name in names:
            at = positions.get(name)
            if at is None:
                out[name] = [None] * len(flats)
                continue
            if transposed[at - 1].count(name) != len(flats):
                break
            out[name] = transposed[at]
        else:
            return out
    dicts = [entry.fields for entry in entries]
    return {name: [fields.get(name) for fields in dicts] for name in names}


#: CallRecord's first bytes as serialized (fields in number order): ``schema_version`` (field 1, a varint),
#: then ``request_id`` (field 2, length-delimited).
_SCHEMA_TAG = 0x08
_REQUEST_ID_TAG = 0x12


def decode_calls(entries: Sequence[Entry]) -> DecodedCalls:
    """Columns of ``entries`` (in stream id order: the buffer keeps them so), one pass.

    A record is parsed only when its entry does not say what the columns need: an entry written before
    the ``blobs``/``tags`` fields existed, one whose record references blobs (to inline them) or has tags,
    or one whose record does not start as its fields say."""
    fields = entry_columns(entries, _CALL_FIELDS)
    records = fields[b"record"]
    blob_counts, tag_names = fields[b"blobs"], fields[b"tags"]
    tokens = [value or b"" for value in fields[b"tokens"]]
    decoded = DecodedCalls(
        list(entries),
        fields,
        [value or b"" for value in fields[b"principal"]],
        [[] for _ in entries],
        [value != b"" for value in tokens],
        [value or b"" for value in fields[b"ttft_ms"]],
        tokens,
        {},
        set(),
        [],
        0,
    )
    # Whether a record starts as a CallRecord of a known layout with its entry's request id (under 128
    # bytes): a byte-level check instead of parsing it (~2 µs a record, measured), catching a record that
    # is not one (garbage, a newer schema, another request's) but not one cut short after its request id.
    # A record that fails it is parsed (a longer request id, a schema version 0, a corrupt record).
    version = SCHEMA_VERSION
    slow = [
        index
        for index, (count, names, record, request_id) in enumerate(
            zip(blob_counts, tag_names, records, fields[b"request_id"], strict=True)
        )
        if count != b"0"
        or names != b""
        or not record
        or not request_id
        or len(record) < 4
        or record[0] != _SCHEMA_TAG
        or record[1] > version
        or record[2] != _REQUEST_ID_TAG
        or record[3] != len(request_id)
        or not record.startswith(request_id, 4)
    ]
    decoded.parsed = len(slow)
    for index in slow:
        _decode_one(decoded, index, records[index] or b"")
    return decoded


def _decode_one(decoded: DecodedCalls, index: int, data: bytes) -> None:
    try:
        record = decode_record(data)
    except UnsupportedSchema:  # newer than this code: archived as is
        record = None
    except Exception:  # protobuf's DecodeError and friends
        record = None
        decoded.corrupt += 1
    if record is not None and not record.request_id:
        record = None
        decoded.corrupt += 1
    if record is None:
        decoded.unreadable.append(index)
        decoded.principals[index] = b""
        decoded.streamed[index] = False
        decoded.ttft_ms[index] = b""
        decoded.tokens[index] = b""
        return
    decoded.principals[index] = record.principal.encode()
    decoded.tags[index] = list(record.tags.items()) if len(record.tags) else []
    is_stream = record.HasField("stream")
    decoded.streamed[index] = is_stream
    first_ns = record.stream.first_response_ns if is_stream else 0
    decoded.ttft_ms[index] = f"{first_ns / 1e6!r}".encode() if first_ns > 0 else b""
    decoded.tokens[index] = str(int(record.stream.responses_total)).encode() if is_stream else b""
    digests = [payload.blob_sha256 for payload in blob_payloads(record)]
    if digests:
        decoded.with_blobs[index] = record
        decoded.blobs.update(digests)


def call_files(model: str, decoded: DecodedCalls, blob_bytes: dict[str, bytes]) -> tuple[list[PlannedFile], int]:
    """The files for ``model``'s decoded calls, and how many blob references could not be inlined.

    Column by column, each built by pyarrow from a list in one go: the readable columns from the
    entries' own fields (the recorder wrote them from the record), the record's bytes as Redis held
    them unless blobs were inlined. An entry whose record does not decode, or whose fields do not
    convert, takes the slow path alone (:func:`_row_from_fields`)."""
    missing = 0
    data = [value or b"" for value in decoded.fields[b"record"]]
    for index, record in decoded.with_blobs.items():
        for payload in blob_payloads(record):
            content = blob_bytes.get(payload.blob_sha256)
            if content is None:
                missing += 1
            else:
                payload.inline = content
        data[index] = record.SerializeToString()
    n = len(data)
    slow = list(decoded.unreadable)
    keep = list(range(n))
    if slow:
        bad = set(slow)
        keep = [index for index in range(n) if index not in bad]
    tables: list[pa.Table] = []
    if keep:
        try:
            tables.append(_fast_table(decoded, data, keep if slow else None))
        except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError):
            slow = list(range(n))  # a field that does not convert: row by row, with its own fallbacks
            tables = []
    if slow:
        rows = [
            _row_from_fields(
                decoded.entries[i],
                data[i],
                decoded.principals[i].decode(errors="replace"),
                decoded.tags[i],
                decoded.streamed[i],
                _float_or_none(decoded.ttft_ms[i]),
                _int_or_none(decoded.tokens[i]),
            )
            for i in slow
        ]
        named = [dict(zip(CALL_SCHEMA.names, row, strict=True)) for row in rows]
        tables.append(pa.Table.from_pylist(named, CALL_SCHEMA))
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if len(tables) > 1:  # the slow rows came last: back to stream id order
        order = pc.sort_indices(_id_order(table["stream_id"]), sort_keys=[("ms", "ascending"), ("seq", "ascending")])
        table = table.take(order)
    return _split_by_hour(CALLS, model, table, CALL_SCHEMA), missing


def _float_or_none(value: bytes) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _int_or_none(value: bytes) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _id_order(stream_ids: pa.ChunkedArray) -> pa.Table:
    parts = pc.split_pattern(stream_ids, "-")
    ms = pc.cast(pc.list_element(parts, 0), pa.int64())
    seq = pc.cast(pc.list_element(parts, 1), pa.int64())
    return pa.table({"ms": ms, "seq": seq})


_HOUR_NS = 3600 * 10**9


def _text_column(values: Sequence[bytes | None]) -> pa.Array:
    return pa.array(values, type=pa.binary()).cast(pa.string())


def _optional_number(values: Sequence[bytes], kind: pa.DataType) -> pa.Array:
    """``b""`` is none (a unary call's ``ttft_ms`` and ``tokens``)."""
    text = _text_column(values)
    return pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), text).cast(kind)


def _fast_table(decoded: DecodedCalls, data: list[bytes], keep: list[int] | None) -> pa.Table:
    """The table of the entries ``keep`` (all with None). Raises KeyError for an entry without
    ``time_ns`` or ``latency_ms`` (the slow path gives it a time from its stream id)."""

    def pick(values: Sequence[Any]) -> Sequence[Any]:
        return values if keep is None else [values[i] for i in keep]

    fields = {name: pick(values) for name, values in decoded.fields.items()}

    def column(name: bytes) -> pa.Array:
        return _text_column([value or b"" for value in fields[name]])

    def required(name: bytes) -> pa.Array:
        values = fields[name]
        if None in values:
            raise KeyError(name)
        return _text_column(values)

    status = column(b"status")
    codes = pc.index_in(status, value_set=pa.array(STATUS_NAMES))
    receive = required(b"time_ns").cast(pa.int64())
    columns = {
        "request_id": column(b"request_id"),
        "receive_time": receive.cast(pa.timestamp("ns", tz="UTC")),
        "version": column(b"version"),
        "arm": column(b"arm"),
        "assignment": column(b"assignment"),
        "phase": column(b"phase"),
        "status": status,
        "status_code": pc.fill_null(codes, -1).cast(pa.int32()),
        "latency_ms": required(b"latency_ms").cast(pa.float64()),
        "routing_key_hmac": column(b"unit"),
        "principal": _text_column(pick(decoded.principals)),
        "tags": pa.array(pick(decoded.tags), type=CALL_SCHEMA.field("tags").type),
        "streamed": pa.array(pick(decoded.streamed), type=pa.bool_()),
        "stream_id": pa.array(pick([entry.stream_id for entry in decoded.entries]), type=pa.string()),
        "record": pa.array(pick(data), type=pa.binary()),
        "ttft_ms": _optional_number(pick(decoded.ttft_ms), pa.float64()),
        "tokens": _optional_number(pick(decoded.tokens), pa.int64()),
    }
    return pa.table(columns, schema=CALL_SCHEMA)


def _split_by_hour(kind: str, model: str, table: pa.Table, schema: pa.Schema) -> list[PlannedFile]:
    """One file per hour partition of the table's receive times, each named by its stream id range."""
    hours = pc.divide(table["receive_time"].cast(pa.int64()), _HOUR_NS)
    files = []
    distinct = pc.unique(hours).to_pylist()
    for hour in distinct:
        part = table.filter(pc.equal(hours, hour)) if len(distinct) > 1 else table
        ids = part["stream_id"]
        first, last = ids[0].as_py(), ids[-1].as_py()  # rows are in stream id order
        directory = partition_dir(kind, model, int(hour) * _HOUR_NS)
        files.append(PlannedFile(f"{directory}/{file_name(first, last)}", part.cast(schema)))
    return files


def _row_from_fields(
    entry: Entry,
    data: bytes,
    principal: str,
    tags: list[tuple[str, str]],
    streamed: bool,
    ttft_ms: float | None = None,
    tokens: int | None = None,
) -> tuple:
    """A row for an entry whose record does not decode (or whose fields do not convert): what its
    readable fields say, with every conversion's own fallback, and the record's bytes kept."""

    def text(name: str) -> str:
        return entry.fields.get(name.encode(), b"").decode(errors="replace")

    try:
        receive_ns = int(text("time_ns"))
    except ValueError:
        receive_ns = stream_id_ms(entry.stream_id) * 1_000_000
    try:
        code = status_code(text("status")) if text("status") else -1
    except ValueError:
        code = -1
    try:
        latency_ms = float(text("latency_ms"))
    except ValueError:
        latency_ms = float("nan")
    return (
        text("request_id") or f"stream:{entry.stream_id}",
        receive_ns,
        text("version"),
        text("arm"),
        text("assignment"),
        text("phase"),
        text("status"),
        code,
        latency_ms,
        text("unit"),
        principal,
        tags,
        streamed,
        entry.stream_id,
        data,
        ttft_ms,
        tokens,
    )


def feedback_files(model: str, entries: Sequence[Entry]) -> list[PlannedFile]:
    """Outcome events (in stream id order) row by row: their volume is a fraction of the calls'."""
    columns: dict[str, dict[str, list]] = defaultdict(lambda: {name: [] for name in FEEDBACK_SCHEMA.names})
    for entry in entries:
        fields = entry.fields

        def text(name: str, fields: dict[bytes, bytes] = fields) -> str:
            return fields.get(name.encode(), b"").decode(errors="replace")

        receive_ns = _int(text("receive_ns"), stream_id_ms(entry.stream_id) * 1_000_000)
        try:
            value = float(text("value"))
        except ValueError:
            value = float("nan")
        row = (
            text("request_id"),
            text("unit"),
            text("metric"),
            value,
            _int(text("event_ns"), receive_ns),
            receive_ns,
            text("idempotency_key"),
            entry.stream_id,
        )
        target = columns[partition_dir(FEEDBACK, model, receive_ns)]
        for name, item in zip(FEEDBACK_SCHEMA.names, row, strict=True):
            target[name].append(item)
    return [_planned(directory, FEEDBACK_SCHEMA, values) for directory, values in columns.items()]


def _int(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def _planned(directory: str, schema: pa.Schema, values: dict[str, list]) -> PlannedFile:
    ids = tuple(values["stream_id"])
    table = pa.table({field.name: pa.array(values[field.name], type=field.type) for field in schema}, schema=schema)
    first, last = ids[0], ids[-1]
    return PlannedFile(f"{directory}/{file_name(first, last)}", table)
