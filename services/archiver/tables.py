"""Stream entries → Parquet tables, one per (model, hour) partition. Pure and blocking: run in the
builder process (:mod:`splitstream.archiver.builder`).

The columns come from the entries' readable fields, each built by pyarrow from one list per file. A
record is archived as the exact bytes Redis held, unparsed, when its entry says it references no blob
and has no tags (the ``blobs`` and ``tags`` fields) and it starts as its request id says; the rest are
parsed: payloads stored as blobs are inlined so a file stands alone (the record re-serialized with the
blob bytes in ``Payload.inline``, its ``size_bytes`` unchanged), tags read, undecodable records counted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from splitstream.common.archive import CALL_SCHEMA, CALLS, FEEDBACK, FEEDBACK_SCHEMA, file_name, partition_dir
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import (
    SCHEMA_VERSION,
    STATUS_NAMES,
    UnsupportedSchema,
    decode_record,
    record_payloads,
    status_code,
    stream_id_ms,
)
from splitstream.common.token_usage import token_counts, ttft_ns


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
    """Every payload of ``record`` stored as a blob reference (:func:`record_payloads`: request, response,
    shadows, stream messages, an HTTP call's bodies and events)."""
    for payload in record_payloads(record):
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
    b"prompt_tokens",
    b"completion_tokens",
    b"blobs",
    b"tags",
    b"record",
)

#: ``(stream id, [name, value, name, value, ...])``, as Redis's XREADGROUP reply holds an entry.
Pair = tuple[bytes, list[bytes]] | list[Any]


def entry_columns(pairs: Sequence[Pair], names: Sequence[bytes]) -> dict[bytes, pa.Array]:
    """The values of ``names`` in every entry, one Arrow binary array each (null where an entry lacks one).

    Entries written by one recorder version share one layout: the entries' fields are joined into one
    list and each field taken from it by its position in the first entry with a step (C-speed slices),
    after checking that every entry has that name there (a C-speed ``list.count``); pyarrow then builds
    each column from its list in one call. No Python object per entry or value is made on the way
    (what the build cost most, measured). Entries of mixed layouts (a recorder upgrade, a hand-written
    entry) fall back to a dict per entry."""
    flats = [pair[1] for pair in pairs]
    first = flats[0]
    width = len(first)
    count = len(flats)
    if width and len(set(map(len, flats))) == 1:
        flat = list(chain.from_iterable(flats))
        positions = {first[i]: i + 1 for i in range(0, width - 1, 2)}
        out: dict[bytes, pa.Array] = {}
        for name in names:
            at = positions.get(name)
            if at is None:
                out[name] = pa.nulls(count, pa.binary())
                continue
            if flat[at - 1 :: width].count(name) != count:
                break
            out[name] = pa.array(flat[at::width], type=pa.binary())
        else:
            return out
    dicts = [dict(zip(flat[::2], flat[1::2], strict=False)) for flat in flats]
    return {name: pa.array([fields.get(name) for fields in dicts], type=pa.binary()) for name in names}


@dataclass(slots=True)
class Parsed:
    """What a parsed record's columns say (``principal``, ``ttft_ms`` and ``tokens`` as the entry fields
    write them, ``b""`` for none)."""

    principal: bytes = b""
    tags: list[tuple[str, str]] = field(default_factory=list)
    streamed: bool = False
    ttft_ms: bytes = b""
    tokens: bytes = b""
    prompt_tokens: bytes = b""
    completion_tokens: bytes = b""


@dataclass(slots=True)
class DecodedCalls:
    pairs: Sequence[Pair]
    #: Per field of :data:`_CALL_FIELDS`, its values (binary; null where an entry lacks it).
    fields: dict[bytes, pa.Array]
    #: The records parsed (by index, ascending): what they say, overriding the entry's fields. The rest
    #: are kept as the bytes Redis held, unparsed, their columns taken from the entry's fields.
    parsed: dict[int, Parsed]
    #: The records that reference blobs, by index (only these are kept decoded: holding every decoded
    #: record of a file alive made the garbage collector walk them all, several µs a record, measured),
    #: and the digests they reference.
    with_blobs: dict[int, recorder_pb2.CallRecord]
    blobs: set[str]
    #: Indexes of the entries whose record does not decode, has no request id or is of a newer layout:
    #: archived with what their readable fields say and the bytes as they are.
    unreadable: list[int]
    corrupt: int

    def entry(self, index: int) -> Entry:
        raw_id, flat = self.pairs[index][0], self.pairs[index][1]
        return Entry(raw_id.decode(), list(flat))


#: CallRecord's first bytes as serialized (fields in number order): ``schema_version`` (field 1, a varint),
#: then ``request_id`` (field 2, length-delimited).
_SCHEMA_TAG = 0x08
_REQUEST_ID_TAG = 0x12


def decode_calls(pairs: Sequence[Pair]) -> DecodedCalls:
    """Columns of the entries ``pairs`` (in stream id order: the buffer keeps them so), one pass.

    A record is parsed only when its entry does not say what the columns need: an entry written before
    the ``blobs``/``tags`` fields existed, one whose record references blobs (to inline them) or has tags,
    or one whose record does not start as its fields say."""
    fields = entry_columns(pairs, _CALL_FIELDS)
    records = fields[b"record"]
    slow = ~_starts_as_its_request_id(records, fields[b"request_id"])
    slow |= _flag(pc.not_equal(fields[b"blobs"], b"0"))
    slow |= _flag(pc.not_equal(fields[b"tags"], b""))
    decoded = DecodedCalls(pairs, fields, {}, {}, set(), [], 0)
    for index in np.flatnonzero(slow).tolist():
        _decode_one(decoded, index, records[index].as_py() or b"")
    return decoded


def _flag(condition: pa.Array) -> np.ndarray:
    """A boolean Arrow array as numpy, null (the field absent) as True: the record must be parsed."""
    return np.asarray(pc.fill_null(condition, True).to_numpy(zero_copy_only=False), dtype=bool)


def _offsets_and_data(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A binary array's value offsets (int64, one more than its rows) and its bytes, as numpy views."""
    buffers = values.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int32)[values.offset : values.offset + len(values) + 1]
    data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    return offsets.astype(np.int64), data


def _starts_as_its_request_id(records: pa.Array, request_ids: pa.Array) -> np.ndarray:
    """Per entry, whether its record starts as a CallRecord of a known layout with the entry's request id
    (under 128 bytes): a byte-level check instead of parsing it (~2 µs a record, measured), catching a
    record that is not one (garbage, a newer schema, another request's) but not one cut short after its
    request id. Vectorized over the columns' buffers (numpy), no Python object per record."""
    offsets, data = _offsets_and_data(records)
    id_offsets, id_data = _offsets_and_data(request_ids)
    starts, lengths = offsets[:-1], np.diff(offsets)
    id_starts, id_lengths = id_offsets[:-1], np.diff(id_offsets)
    # Nulls (a field absent) have no bytes: they fail on their lengths.
    ok = (id_lengths > 0) & (id_lengths < 128) & (lengths >= 4 + id_lengths)
    rows = np.flatnonzero(ok)
    if not len(rows):
        return ok
    head = starts[rows]
    ok[rows] = (
        (data[head] == _SCHEMA_TAG)
        & (data[head + 1] <= SCHEMA_VERSION)
        & (data[head + 2] == _REQUEST_ID_TAG)
        & (data[head + 3] == id_lengths[rows])
    )
    rows = np.flatnonzero(ok)
    sizes = id_lengths[rows]
    within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    same = data[np.repeat(starts[rows] + 4, sizes) + within] == id_data[np.repeat(id_starts[rows], sizes) + within]
    ok[np.repeat(rows, sizes)[~same]] = False
    return ok


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
        decoded.parsed[index] = Parsed()
        return
    is_stream = record.HasField("stream")
    first_ns = ttft_ns(record)
    prompt, completion = token_counts(record)
    decoded.parsed[index] = Parsed(
        record.principal.encode(),
        list(record.tags.items()) if len(record.tags) else [],
        is_stream,
        f"{first_ns / 1e6!r}".encode() if first_ns > 0 else b"",
        str(int(record.stream.responses_total)).encode() if is_stream else b"",
        b"" if prompt is None else str(prompt).encode(),
        b"" if completion is None else str(completion).encode(),
    )
    digests = [payload.blob_sha256 for payload in blob_payloads(record)]
    if digests:
        decoded.with_blobs[index] = record
        decoded.blobs.update(digests)


def call_files(model: str, decoded: DecodedCalls, blob_bytes: dict[str, bytes]) -> tuple[list[PlannedFile], int]:
    """The files for ``model``'s decoded calls, and how many blob references could not be inlined.

    Column by column, each an Arrow array: the readable columns from the entries' own fields (the
    recorder wrote them from the record), the record's bytes as Redis held them unless blobs were
    inlined, what a parsed record says put in its rows. An entry whose record does not decode, or
    whose fields do not convert, takes the slow path alone (:func:`_row_from_fields`)."""
    missing = 0
    data = _filled(decoded.fields[b"record"])
    inlined: dict[int, bytes] = {}
    for index, record in decoded.with_blobs.items():
        for payload in blob_payloads(record):
            content = blob_bytes.get(payload.blob_sha256)
            if content is None:
                missing += 1
            else:
                payload.inline = content
        inlined[index] = record.SerializeToString()
    data = _patched(data, inlined, pa.binary())
    n = len(decoded.pairs)
    slow = list(decoded.unreadable)
    keep: np.ndarray | None = None
    if slow:
        keep = np.setdiff1d(np.arange(n), np.asarray(slow, dtype=np.int64))
    tables: list[pa.Table] = []
    if keep is None or len(keep):
        try:
            tables.append(_fast_table(decoded, data, keep))
        except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError):
            slow = list(range(n))  # a field that does not convert: row by row, with its own fallbacks
            tables = []
    if slow:
        rows = []
        for i in slow:
            parsed = decoded.parsed.get(i)
            if parsed is None:  # an entry's fields: as the fast path reads them
                entry = decoded.entry(i)
                tokens = entry.fields.get(b"tokens") or b""
                parsed = Parsed(
                    entry.fields.get(b"principal") or b"",
                    [],
                    tokens != b"",
                    entry.fields.get(b"ttft_ms") or b"",
                    tokens,
                    entry.fields.get(b"prompt_tokens") or b"",
                    entry.fields.get(b"completion_tokens") or b"",
                )
            rows.append(
                _row_from_fields(
                    decoded.entry(i),
                    data[i].as_py(),
                    parsed.principal.decode(errors="replace"),
                    parsed.tags,
                    parsed.streamed,
                    _float_or_none(parsed.ttft_ms),
                    _int_or_none(parsed.tokens),
                    _int_or_none(parsed.prompt_tokens),
                    _int_or_none(parsed.completion_tokens),
                )
            )
        named = [dict(zip(CALL_SCHEMA.names, row, strict=True)) for row in rows]
        tables.append(pa.Table.from_pylist(named, CALL_SCHEMA))
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if len(tables) > 1:  # the slow rows came last: back to stream id order
        order = pc.sort_indices(_id_order(table["stream_id"]), sort_keys=[("ms", "ascending"), ("seq", "ascending")])
        table = table.take(order)
    return _split_by_hour(CALLS, model, table, CALL_SCHEMA), missing


def _filled(values: pa.Array) -> pa.Array:
    """Null (an entry without the field) as ``b""``."""
    return pc.fill_null(values, b"") if values.null_count else values


def _patched(values: pa.Array, replacements: dict[int, Any], kind: pa.DataType) -> pa.Array:
    """``values`` with the rows of ``replacements`` (index → value) replaced."""
    if not replacements:
        return values
    mask = np.zeros(len(values), dtype=bool)
    order = sorted(replacements)
    mask[order] = True
    return pc.replace_with_mask(values, pa.array(mask), pa.array([replacements[i] for i in order], type=kind))


def _float_or_none(value: bytes) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _int_or_none(value: bytes | str) -> int | None:
    """The integer ``value`` says, or None when it says none an int64 column can hold: an entry's fields
    are text anyone with Redis may have written, and one past int64 (``time_ns`` of 2**64) failed its
    whole file on every retry, killing the archiver at each restart."""
    try:
        number = int(value) if value else None
    except ValueError:
        return None
    return number if number is not None and _INT64_MIN <= number <= _INT64_MAX else None


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _id_order(stream_ids: pa.ChunkedArray) -> pa.Table:
    parts = pc.split_pattern(stream_ids, "-")
    ms = pc.cast(pc.list_element(parts, 0), pa.int64())
    seq = pc.cast(pc.list_element(parts, 1), pa.int64())
    return pa.table({"ms": ms, "seq": seq})


_HOUR_NS = 3600 * 10**9


def _optional_number(values: pa.Array, kind: pa.DataType) -> pa.Array:
    """``b""`` is none (a unary call's ``ttft_ms`` and ``tokens``)."""
    text = values.cast(pa.string())
    return pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), text).cast(kind)


def _fast_table(decoded: DecodedCalls, data: pa.Array, keep: np.ndarray | None) -> pa.Table:
    """The table of the entries ``keep`` (all with None). Raises KeyError for an entry without
    ``time_ns`` or ``latency_ms`` (the slow path gives it a time from its stream id)."""
    parsed = decoded.parsed

    def pick(values: pa.Array) -> pa.Array:
        return values if keep is None else values.take(keep)

    def column(name: bytes) -> pa.Array:
        return pick(_filled(decoded.fields[name])).cast(pa.string())

    def required(name: bytes) -> pa.Array:
        values = pick(decoded.fields[name])
        if values.null_count:
            raise KeyError(name)
        return values.cast(pa.string())

    def of_parsed(name: bytes, attribute: str) -> pa.Array:
        values = {index: getattr(row, attribute) for index, row in parsed.items()}
        return pick(_patched(_filled(decoded.fields[name]), values, pa.binary()))

    tokens = _filled(decoded.fields[b"tokens"])
    streamed = pc.not_equal(tokens, b"")
    streamed = _patched(streamed, {index: row.streamed for index, row in parsed.items()}, pa.bool_())
    status = column(b"status")
    codes = pc.index_in(status, value_set=pa.array(STATUS_NAMES))
    receive = required(b"time_ns").cast(pa.int64())
    stream_ids = pa.array([pair[0] for pair in decoded.pairs], type=pa.binary())
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
        "principal": of_parsed(b"principal", "principal").cast(pa.string()),
        "tags": _tags(decoded, keep),
        "streamed": pick(streamed),
        "stream_id": pick(stream_ids).cast(pa.string()),
        "record": pick(data),
        "ttft_ms": _optional_number(of_parsed(b"ttft_ms", "ttft_ms"), pa.float64()),
        "tokens": _optional_number(of_parsed(b"tokens", "tokens"), pa.int64()),
        "prompt_tokens": _optional_number(of_parsed(b"prompt_tokens", "prompt_tokens"), pa.int64()),
        "completion_tokens": _optional_number(of_parsed(b"completion_tokens", "completion_tokens"), pa.int64()),
    }
    return pa.table(columns, schema=CALL_SCHEMA)


def _tags(decoded: DecodedCalls, keep: np.ndarray | None) -> pa.Array:
    """The ``tags`` column: empty maps, but for parsed records that carry tags."""
    kind = CALL_SCHEMA.field("tags").type
    indexes = range(len(decoded.pairs)) if keep is None else keep.tolist()
    if not any(decoded.parsed[i].tags for i in decoded.parsed):
        offsets = pa.array(np.zeros(len(indexes) + 1, dtype=np.int32))
        return pa.MapArray.from_arrays(offsets, pa.array([], pa.string()), pa.array([], pa.string()), type=kind)
    empty: list[tuple[str, str]] = []
    return pa.array([decoded.parsed[i].tags if i in decoded.parsed else empty for i in indexes], type=kind)


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
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
) -> tuple:
    """A row for an entry whose record does not decode (or whose fields do not convert): what its
    readable fields say, with every conversion's own fallback, and the record's bytes kept."""

    def text(name: str) -> str:
        return entry.fields.get(name.encode(), b"").decode(errors="replace")

    receive_ns = _int(text("time_ns"), stream_id_ms(entry.stream_id) * 1_000_000)
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
        prompt_tokens,
        completion_tokens,
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
    """``text`` as an int64, else ``default`` (see :func:`_int_or_none`)."""
    number = _int_or_none(text)
    return default if number is None else number


def _planned(directory: str, schema: pa.Schema, values: dict[str, list]) -> PlannedFile:
    ids = tuple(values["stream_id"])
    table = pa.table({field.name: pa.array(values[field.name], type=field.type) for field in schema}, schema=schema)
    first, last = ids[0], ids[-1]
    return PlannedFile(f"{directory}/{file_name(first, last)}", table)
