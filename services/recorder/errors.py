"""The recorder's domain errors; :func:`splitstream.common.errors.status_of` maps them to gRPC codes."""

from __future__ import annotations

import grpc

from splitstream.common.errors import InvalidInput, SplitstreamError


class InvalidBatch(InvalidInput):
    """A batch (or one of its records) is malformed; nothing of it was written → INVALID_ARGUMENT.

    Resending the same batch cannot succeed, so the router should drop it (and count it)."""


class StoreUnavailable(SplitstreamError):
    """Redis did not confirm the writes (unreachable, timed out, refused) → UNAVAILABLE.

    The batch was not acknowledged; some of its records may have been written, and the
    router's resend may duplicate them (readers drop duplicates by request id)."""

    code = grpc.StatusCode.UNAVAILABLE


class StoreRefused(SplitstreamError):
    """Redis answered an error reply about this batch's own keys (WRONGTYPE on one stream, say), while it
    still takes other writes → INTERNAL: the router resends it, then halves it down to the records at
    fault; the recorder stays SERVING for every other model."""


class BatchTooLarge(SplitstreamError):
    """A batch holds more records and events than one batch may (``validation.MAX_BATCH_ITEMS``)
    → RESOURCE_EXHAUSTED, before any of it is parsed or written: a router's shipper sends it again in
    smaller batches (it lowers its cap on that code), so nothing is lost."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
