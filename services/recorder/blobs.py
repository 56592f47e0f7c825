"""Large payloads are stored once by content hash and referenced from records.

The same input replayed or sent by many clients (an image, a long prompt) is one
Redis value however many records point at it. Hashing happens after redaction,
so the hash and the stored bytes are of what may be kept.
"""

from __future__ import annotations

import hashlib

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import record_payloads


class BlobCollector:
    """Rewrites the oversized payloads of one batch's records to blob references and keeps their bytes.

    ``blobs`` maps SHA-256 hex → bytes, each distinct payload once, ready for the writer."""

    def __init__(self, threshold_bytes: int) -> None:
        self.threshold_bytes = threshold_bytes
        self.blobs: dict[str, bytes] = {}

    def externalize(self, record: recorder_pb2.CallRecord) -> None:
        """Every payload of ``record`` gets its size; those over the threshold become references."""
        for payload in record_payloads(record):  # a token stream's and an HTTP call's too
            self._payload(payload)

    def _payload(self, payload: recorder_pb2.Payload) -> None:
        data = payload.inline
        if payload.size_bytes != len(data):  # (assigning to an absent payload would make it present)
            payload.size_bytes = len(data)
        if len(data) > self.threshold_bytes:
            digest = hashlib.sha256(data).hexdigest()
            self.blobs.setdefault(digest, data)
            payload.blob_sha256 = digest  # the oneof drops the inline bytes
