"""Stream entries → Parquet tables, one per (model, hour) partition. Pure and blocking: run in a thread.

Call records are decoded once: for the readable columns (``principal`` is only in the record) and to
find payloads stored as blobs, which are inlined so a file stands alone. A record without blobs is
archived as the exact bytes Redis held (no re-encoding); one with blobs is re-serialized with the
blob bytes in ``Payload.inline`` (its ``size_bytes`` unchanged).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from splitstream.common.archive import CALL_SCHEMA, CALLS, FEEDBACK, FEEDBACK_SCHEMA, file_name, partition_dir
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import STATUS_NAMES, UnsupportedSchema, decode_record, status_code, stream_id_ms


@dataclass(frozen=True, slots=True)
class Entry:
    stream_id: str
    fields: dict[bytes, bytes]

    @property
    def size(self) -> int:
        """About the bytes it adds to a file: its record (the readable fields are a few dozen bytes)."""
        return len(self.fields.get(b"record", b"")) + 128


@dataclass(frozen=True, slots=True)
class PlannedFile:
    """One file to write: where, what, and which entries it acknowledges."""

    relative_path: str
    table: pa.Table
    stream_ids: tuple[str, ...]


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


@dataclass(slots=True)
class DecodedCalls:
    entries: list[Entry]
    #: Per entry, what only the record holds: the readable columns the entry's fields lack.
    principals: list[str]
    tags: list[list[tuple[str, str]]]
    streamed: list[bool]
    #: Token streams: time to the first response (None: none came, or not a stream) and responses received.
    ttft_ms: list[float | None]
    tokens: list[int | None]
    #: The records that reference blobs, by index (only these are kept decoded: holding every decoded
    #: record of a file alive made the garbage collector walk them all, several µs a record, measured),
    #: and the digests they reference.
    with_blobs: dict[int, recorder_pb2.CallRecord]
    blobs: set[str]
    #: Indexes of the entries whose record does not decode, has no request id or is of a newer layout:
    #: archived with what their readable fields say and the bytes as they are.
    unreadable: list[int]
    corrupt: int


def decode_calls(entries: Sequence[Entry]) -> DecodedCalls:
    """Decode ``entries`` (in stream id order: the buffer keeps them so), one pass."""
    decoded = DecodedCalls(list(entries), [], [], [], [], [], {}, set(), [], 0)
    principals, tags, streamed = decoded.principals, decoded.tags, decoded.streamed
    ttft_ms, tokens = decoded.ttft_ms, decoded.tokens
    for index, entry in enumerate(decoded.entries):
        try:
            record = decode_record(entry.fields.get(b"record", b""))
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
            principals.append("")
            tags.append([])
            streamed.append(False)
            ttft_ms.append(None)
            tokens.append(None)
            continue
        # Field reads, cheapest first (~1 µs together, measured; a byte search of the serialized record
        # for a field's tag costs about as much per search): only a record that can hold a blob
        # reference has its payloads looked at one by one.
        principals.append(record.principal)
        tags.append(list(record.tags.items()) if len(record.tags) else [])
        is_stream = record.HasField("stream")
        streamed.append(is_stream)
        first_ns = record.stream.first_response_ns if is_stream else 0
        ttft_ms.append(first_ns / 1e6 if first_ns > 0 else None)
        tokens.append(int(record.stream.responses_total) if is_stream else None)
        if record.request.blob_sha256 or record.response.blob_sha256 or len(record.shadows) or is_stream:
            digests = [payload.blob_sha256 for payload in blob_payloads(record)]
            if digests:
                decoded.with_blobs[index] = record
                decoded.blobs.update(digests)
    return decoded


def call_files(model: str, decoded: DecodedCalls, blob_bytes: dict[str, bytes]) -> tuple[list[PlannedFile], int]:
    """The files for ``model``'s decoded calls, and how many blob references could not be inlined.

    Column by column: the readable columns come from the entry's own fields (the recorder wrote them
    from the record) and are converted by pyarrow in one pass each; only ``principal``, ``tags``,
    ``streamed`` and blob references are taken from the decoded record. Measured: a row-by-row
    loop cost ~60 µs a record, this a few. An entry whose record does not decode, or whose fields
    do not convert, takes the slow path alone (:func:`_row_from_fields`)."""
    missing = 0
    data = [entry.fields.get(b"record", b"") for entry in decoded.entries]
    for index, record in decoded.with_blobs.items():
        for payload in blob_payloads(record):
            content = blob_bytes.get(payload.blob_sha256)
            if content is None:
                missing += 1
            else:
                payload.inline = content
        data[index] = record.SerializeToString()
    columns = (
        decoded.entries,
        data,
        decoded.principals,
        decoded.tags,
        decoded.streamed,
        decoded.ttft_ms,
        decoded.tokens,
    )
    slow = list(decoded.unreadable)
    if slow:
        bad = set(slow)
        keep = [index for index in range(len(data)) if index not in bad]
        columns = tuple([values[i] for i in keep] for values in columns)  # type: ignore[assignment]
    tables: list[pa.Table] = []
    if columns[0]:
        try:
            tables.append(_fast_table(*columns))
        except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError):
            slow = list(range(len(data)))  # a field that does not convert: row by row, with its own fallbacks
            tables = []
    if slow:
        rows = [
            _row_from_fields(
                decoded.entries[i],
                data[i],
                decoded.principals[i],
                decoded.tags[i],
                decoded.streamed[i],
                decoded.ttft_ms[i],
                decoded.tokens[i],
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


def _id_order(stream_ids: pa.ChunkedArray) -> pa.Table:
    parts = pc.split_pattern(stream_ids, "-")
    ms = pc.cast(pc.list_element(parts, 0), pa.int64())
    seq = pc.cast(pc.list_element(parts, 1), pa.int64())
    return pa.table({"ms": ms, "seq": seq})


_HOUR_NS = 3600 * 10**9


def _text_column(values: list[bytes]) -> pa.Array:
    return pa.array(values, type=pa.binary()).cast(pa.string())


def _fast_table(
    entries: list[Entry],
    data: list[bytes],
    principals: list[str],
    tags: list[list[tuple[str, str]]],
    streamed: list[bool],
    ttft_ms: list[float | None],
    tokens: list[int | None],
) -> pa.Table:
    fields = [entry.fields for entry in entries]

    def column(name: bytes) -> pa.Array:
        return _text_column([f.get(name, b"") for f in fields])

    status = column(b"status")
    codes = pc.index_in(status, value_set=pa.array(STATUS_NAMES))
    receive = _text_column([f[b"time_ns"] for f in fields]).cast(pa.int64())
    columns = {
        "request_id": column(b"request_id"),
        "receive_time": receive.cast(pa.timestamp("ns", tz="UTC")),
        "version": column(b"version"),
        "arm": column(b"arm"),
        "assignment": column(b"assignment"),
        "phase": column(b"phase"),
        "status": status,
        "status_code": pc.fill_null(codes, -1).cast(pa.int32()),
        "latency_ms": _text_column([f[b"latency_ms"] for f in fields]).cast(pa.float64()),
        "routing_key_hmac": column(b"unit"),
        "principal": pa.array(principals, type=pa.string()),
        "tags": pa.array(tags, type=CALL_SCHEMA.field("tags").type),
        "streamed": pa.array(streamed, type=pa.bool_()),
        "stream_id": pa.array([entry.stream_id for entry in entries], type=pa.string()),
        "record": pa.array(data, type=pa.binary()),
        "ttft_ms": pa.array(ttft_ms, type=pa.float64()),
        "tokens": pa.array(tokens, type=pa.int64()),
    }
    return pa.table(columns, schema=CALL_SCHEMA)


def _split_by_hour(kind: str, model: str, table: pa.Table, schema: pa.Schema) -> list[PlannedFile]:
    """One file per hour partition of the table's receive times, each named by its stream id range."""
    hours = pc.divide(table["receive_time"].cast(pa.int64()), _HOUR_NS)
    files = []
    distinct = pc.unique(hours).to_pylist()
    for hour in distinct:
        part = table.filter(pc.equal(hours, hour)) if len(distinct) > 1 else table
        ids = part["stream_id"].to_pylist()
        first, last = ids[0], ids[-1]  # rows are in stream id order
        directory = partition_dir(kind, model, int(hour) * _HOUR_NS)
        files.append(PlannedFile(f"{directory}/{file_name(first, last)}", part.cast(schema), tuple(ids)))
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
    return PlannedFile(f"{directory}/{file_name(first, last)}", table, ids)
