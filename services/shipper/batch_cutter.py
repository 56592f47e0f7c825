"""Cutting record batches into what the recorder will take, so that no batch can block the rest.

A batch goes as it was built unless one of three things says otherwise: it is over the
byte cap (cut into batches under it; a record over the cap alone loses its largest
payloads, named in :data:`PAYLOAD_DROPPED_TAG`), the recorder kept refusing it (cut in
halves, each resent on its own, down to the one record at fault), or a part of it was
dropped before (skipped). Cutting is deterministic: a spool entry resent is cut the same
way, so its parts keep their identity (:func:`batch_key`) across resends and restarts of
the stream.

Batches and records stay serialized throughout (``EncodedRecordBatch``): only a record
over the cap is parsed. A batch also carries outcome events (``feedback``); they are cut,
halved and dropped like records (items in order: records, then events), and every part is
counted as ``(bytes, records, events)``.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Sequence

import structlog

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import PAYLOAD_DROPPED_TAG
from splitstream.common.shipping import MIN_BATCH_BYTES

log = structlog.get_logger()

#: Framing bytes around a record in a batch (field tag + length varint) and for the sequence, at most.
RECORD_OVERHEAD = 6
BATCH_OVERHEAD = 16
#: gRPC's refusal of a message over the receiver's limit names the limit.
_LIMIT = re.compile(r"larger than max \(\d+ vs\. (\d+)\)")
#: Kept under a limit learned that way: the cap counts framing bytes by estimate, not exactly.
_LIMIT_MARGIN = 4096


class BatchCutter:
    def __init__(
        self,
        max_bytes: int,
        *,
        on_payloads_dropped: Callable[[], None] = lambda: None,
        on_too_large: Callable[[], None] = lambda: None,
        on_event_too_large: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_payloads_dropped``/``on_too_large``: told of each record sent without payloads, or
        dropped because even that is over the cap (the mirror counts them)."""
        #: Largest batch sent; lowered when the recorder says its limit is under it.
        self.max_bytes = max_bytes
        self._on_payloads_dropped = on_payloads_dropped
        self._on_too_large = on_too_large
        self._on_event_too_large = on_event_too_large
        self._dropped: set[int] = set()
        self._halved: set[int] = set()

    def as_is(self, batch: bytes) -> bool:
        """Whether ``batch`` goes as it is (cheap: no checksum unless something was dropped or halved)."""
        if len(batch) + BATCH_OVERHEAD > self.max_bytes:
            return False
        if not (self._dropped or self._halved):
            return True
        key = batch_key(batch)
        return key not in self._dropped and key not in self._halved

    def parts(
        self, batch: bytes, records: int | None = None, events: int | None = None
    ) -> list[tuple[bytes, int, int]]:
        """``batch`` as the batches to send, each with its record and event counts (may be none at all).
        CPU-bound on large batches: call it off the event loop."""
        key = batch_key(batch)
        if key in self._dropped:
            return []
        if key in self._halved:
            framed = recorder_pb2.EncodedRecordBatch.FromString(batch)
            items = [*((False, r) for r in framed.records), *((True, e) for e in framed.feedback)]
            if len(items) > 1:
                half = len(items) // 2
                return [*self.parts(frame_items(items[:half])), *self.parts(frame_items(items[half:]))]
        if len(batch) + BATCH_OVERHEAD > self.max_bytes:
            return [part for piece, r, e in self._split(batch) for part in self.parts(piece, r, e)]
        if records is None or events is None:
            records, events = count_items(batch)
        return [(batch, records, events)]

    @property
    def record_limit(self) -> int:
        """The largest serialized record a batch of one can hold under the cap."""
        return self.max_bytes - BATCH_OVERHEAD - RECORD_OVERHEAD

    def fit(self, record: bytes) -> bytes | None:
        """``record`` as it can be sent alone: itself if under the cap, else without its largest payloads
        (named in :data:`PAYLOAD_DROPPED_TAG`), else None (dropped: too large even so)."""
        limit = self.record_limit
        if len(record) <= limit:
            return record
        message = recorder_pb2.CallRecord.FromString(record)
        holders: list[tuple[str, recorder_pb2.CallRecord | recorder_pb2.ShadowResult | recorder_pb2.HttpCall, str]] = [
            ("request", message, "request"),
            ("response", message, "response"),
        ]
        if message.HasField("http"):  # an HTTP call's bodies as the client sent and got them
            holders += [
                ("http.request_body", message.http, "request_body"),
                ("http.response_body", message.http, "response_body"),
            ]
        holders += [(f"shadows[{i}].response", shadow, "response") for i, shadow in enumerate(message.shadows)]
        holders.sort(key=lambda h: -len(getattr(h[1], h[2]).inline))
        dropped = []
        for name, holder, field in holders:
            if message.ByteSize() <= limit:
                break
            size = len(getattr(holder, field).inline)
            if not size:
                break
            holder.ClearField(field)  # type: ignore[arg-type]
            dropped.append(f"{name}:{size}")
        message.tags[PAYLOAD_DROPPED_TAG] = ",".join(dropped)
        fitted = message.SerializeToString()
        if len(fitted) > limit:
            log.error("record too large even without payloads; dropped", request_id=message.request_id[:200])
            self._on_too_large()
            return None
        log.warning(
            "record over batch_max_bytes; recorded without its largest payloads",
            request_id=message.request_id[:200],
            dropped=dropped,
            batch_max_bytes=self.max_bytes,
        )
        self._on_payloads_dropped()
        return fitted

    def overflows(self, batch_bytes: int, record: bytes) -> bool:
        """Whether adding ``record`` to a batch of ``batch_bytes`` (framing counted) passes the cap."""
        return batch_bytes + len(record) + RECORD_OVERHEAD > self.max_bytes

    def refused_as_too_large(self, details: str, largest_in_flight: int) -> None:
        """Lower the cap after the recorder refused a message as too large: to the limit gRPC names in
        ``details``, else to half the largest batch in flight (the refused one is among them)."""
        match = _LIMIT.search(details)
        lowered = int(match.group(1)) - _LIMIT_MARGIN if match else largest_in_flight // 2
        self.max_bytes = min(self.max_bytes, max(lowered, MIN_BATCH_BYTES))

    def halve(self, batch: bytes) -> None:
        """From now on, send ``batch`` (wherever it comes from) as two halves."""
        self._halved.add(batch_key(batch))

    def drop(self, batch: bytes) -> None:
        """From now on, skip ``batch`` (a part of a spool entry whose other parts are still to send)."""
        self._dropped.add(batch_key(batch))

    def forget(self) -> None:
        """Nothing dropped or halved is pending any more (nothing left to resend, no old spool)."""
        self._dropped.clear()
        self._halved.clear()

    def _split(self, batch: bytes) -> list[tuple[bytes, int, int]]:
        """``batch`` cut into batches under the cap, records (then events) in order."""
        parts: list[tuple[bytes, int, int]] = []
        items: list[tuple[bool, bytes]] = []
        size = BATCH_OVERHEAD
        framed = recorder_pb2.EncodedRecordBatch.FromString(batch)
        for is_event, raw in [*((False, r) for r in framed.records), *((True, e) for e in framed.feedback)]:
            fitted = self._fit_event(raw) if is_event else self.fit(raw)
            if fitted is None:
                continue
            if items and self.overflows(size, fitted):
                parts.append(_counted(items))
                items, size = [], BATCH_OVERHEAD
            items.append((is_event, fitted))
            size += len(fitted) + RECORD_OVERHEAD
        if items:
            parts.append(_counted(items))
        return parts

    def _fit_event(self, event: bytes) -> bytes | None:
        """An event alone over the cap (its fields are bounded at a few KiB: only a cap set absurdly low)."""
        if len(event) <= self.record_limit:
            return event
        log.error("feedback event larger than batch_max_bytes; dropped", event_bytes=len(event))
        self._on_event_too_large()
        return None


def batch_key(batch: bytes) -> int:
    """Identifies a batch across resends (crc32 runs at GB/s: cheap beside sending it)."""
    return zlib.crc32(batch) ^ (len(batch) << 32)


def frame(records: Sequence[bytes], feedback: Sequence[bytes] = ()) -> bytes:
    """A batch (without sequence) of serialized records and events."""
    return recorder_pb2.EncodedRecordBatch(records=records, feedback=feedback).SerializeToString()


def frame_items(items: Sequence[tuple[bool, bytes]]) -> bytes:
    """A batch of ``(is_event, serialized)`` items."""
    return frame([raw for is_event, raw in items if not is_event], [raw for is_event, raw in items if is_event])


def _counted(items: Sequence[tuple[bool, bytes]]) -> tuple[bytes, int, int]:
    events = sum(1 for is_event, _ in items if is_event)
    return frame_items(items), len(items) - events, events


def count_records(batch: bytes) -> int:
    return len(recorder_pb2.EncodedRecordBatch.FromString(batch).records)  # records stay bytes: no parse


def count_items(batch: bytes) -> tuple[int, int]:
    """The records and the events a serialized batch holds (framing parsed, items left as bytes)."""
    framed = recorder_pb2.EncodedRecordBatch.FromString(batch)
    return len(framed.records), len(framed.feedback)
