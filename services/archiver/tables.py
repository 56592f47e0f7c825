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

from splitstream.common.archive import CALL_SCHEMA, CALLS, FEEDBACK, FEEDBACK_SCHEMA, file_name, partition_dir
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import (
    UnsupportedSchema,
    assignment_name,
    decode_record,
    status_code,
    status_name,
    stream_id_ms,
)


@dataclass(frozen=True, slots=True)
class Entry:
    stream_id: str
    fields: dict[bytes, bytes]

    @property
    def size(self) -> int:
        return sum(len(key) + len(value) for key, value in self.fields.items())


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
    records: list[recorder_pb2.CallRecord | None]
    #: Digests of the blobs the records reference.
    blobs: set[str]
    corrupt: int


def decode_calls(entries: Sequence[Entry]) -> DecodedCalls:
    ordered = sorted(entries, key=lambda entry: id_key(entry.stream_id))
    records: list[recorder_pb2.CallRecord | None] = []
    blobs: set[str] = set()
    corrupt = 0
    for entry in ordered:
        try:
            record: recorder_pb2.CallRecord | None = decode_record(entry.fields.get(b"record", b""))
        except UnsupportedSchema:
            record = None  # newer than this code: archived as is, readable columns from the entry
        except Exception:  # protobuf's DecodeError and friends
            record = None
            corrupt += 1
        if record is not None and not record.request_id:
            record, corrupt = None, corrupt + 1
        if record is not None:
            blobs.update(payload.blob_sha256 for payload in blob_payloads(record))
        records.append(record)
    return DecodedCalls(ordered, records, blobs, corrupt)


def call_files(model: str, decoded: DecodedCalls, blob_bytes: dict[str, bytes]) -> tuple[list[PlannedFile], int]:
    """The files for ``model``'s decoded calls, and how many blob references could not be inlined."""
    missing = 0
    columns: dict[str, dict[str, list]] = defaultdict(lambda: {name: [] for name in CALL_SCHEMA.names})
    for entry, record in zip(decoded.entries, decoded.records, strict=True):
        if record is None:
            row = _row_from_fields(entry)
        else:
            data = entry.fields[b"record"]
            references = list(blob_payloads(record))
            if references:
                for payload in references:
                    body = blob_bytes.get(payload.blob_sha256)
                    if body is None:
                        missing += 1
                    else:
                        payload.inline = body
                data = record.SerializeToString()
            row = (
                record.request_id,
                record.receive_unix_ns,
                record.version,
                record.arm,
                assignment_name(record.assignment),
                record.phase.id,
                status_name(record.status_code),
                record.status_code,
                record.latency_ns / 1e6,
                record.routing_key_hmac,
                record.principal,
                list(record.tags.items()),
                record.HasField("stream"),
                entry.stream_id,
                data,
            )
        target = columns[partition_dir(CALLS, model, int(row[1]))]
        for name, value in zip(CALL_SCHEMA.names, row, strict=True):
            target[name].append(value)
    return [_planned(directory, CALL_SCHEMA, values) for directory, values in columns.items()], missing


def _row_from_fields(entry: Entry) -> tuple:
    """A row for an entry whose record does not decode: what its readable fields say, the raw bytes kept."""

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
        "",
        [],
        False,
        entry.stream_id,
        entry.fields.get(b"record", b""),
    )


def feedback_files(model: str, entries: Sequence[Entry]) -> list[PlannedFile]:
    columns: dict[str, dict[str, list]] = defaultdict(lambda: {name: [] for name in FEEDBACK_SCHEMA.names})
    for entry in sorted(entries, key=lambda item: id_key(item.stream_id)):
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
    first, last = min(ids, key=id_key), max(ids, key=id_key)
    return PlannedFile(f"{directory}/{file_name(first, last)}", table, ids)
