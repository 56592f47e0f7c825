"""Reading recorded calls back in tests: whole records, their requests and responses, without repeats.

These lived in ``splitstream.common.records`` though only tests used them; the layout itself
(stream and blob keys, entry fields, decoding) stays there, and these are built on it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from redis.asyncio import Redis

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import StoredRecord, decode_entry, payload_bytes, read_entries


async def read_records(
    redis: Redis, model: str, *, start: str = "-", end: str = "+", page_size: int = 500
) -> AsyncIterator[StoredRecord]:
    """Yield the records of ``model``'s stream between stream ids ``start`` and ``end`` (inclusive), oldest first.

    Paged like :func:`splitstream.common.records.read_entries`. Raises ``UnsupportedSchema`` on a record of a
    newer layout rather than misreading it, and ``CorruptEntry`` on an entry that is not a record.
    """
    async for entry in read_entries(redis, model, start=start, end=end, page_size=page_size):
        yield decode_entry(entry)


async def unique_by_request_id(records: AsyncIterator[StoredRecord]) -> AsyncIterator[StoredRecord]:
    """Drop records whose request id was already seen (the recorder's delivery is at least once, so a
    stream may hold the same call twice)."""
    seen: set[str] = set()
    async for stored in records:
        if stored.record.request_id not in seen:
            seen.add(stored.record.request_id)
            yield stored


async def request_of(redis: Redis, record: recorder_pb2.CallRecord) -> oip.ModelInferRequest:
    """The recorded (redacted) request as the Open Inference Protocol message."""
    return oip.ModelInferRequest.FromString(await payload_bytes(redis, record.request))


async def response_of(redis: Redis, record: recorder_pb2.CallRecord) -> oip.ModelInferResponse | None:
    """The recorded response, or None when the call failed (a failed call has no response)."""
    if record.status_code != 0:
        return None
    return oip.ModelInferResponse.FromString(await payload_bytes(redis, record.response))


@dataclass(frozen=True)
class RecordedStream:
    """A token stream's record read back: each kept request and response with its index and offset (ns)."""

    requests: list[tuple[int, int, oip.ModelInferRequest]]
    responses: list[tuple[int, int, oip.ModelStreamInferResponse]]


async def stream_of(redis: Redis, record: recorder_pb2.CallRecord) -> RecordedStream:
    """The messages of a stream record (``record.stream``), payloads fetched from their blobs when stored so."""
    requests = [
        (m.index, m.offset_ns, oip.ModelInferRequest.FromString(await payload_bytes(redis, m.payload)))
        for m in record.stream.requests
    ]
    responses = [
        (m.index, m.offset_ns, oip.ModelStreamInferResponse.FromString(await payload_bytes(redis, m.payload)))
        for m in record.stream.responses
    ]
    return RecordedStream(requests, responses)
