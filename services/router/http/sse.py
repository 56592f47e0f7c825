"""The end of a server-sent event stream, the same for every route that streams.

A stream's last event (``data: [DONE]``, or the error event) is the whole answer as far as the client is
concerned: a client that closes its connection as soon as it reads it (OpenAI's clients do) must be
counted and recorded with the status it got, not as a 499 nor as a 500 from the terminating chunk that
aiohttp could no longer write.
"""

from __future__ import annotations

import contextlib

from aiohttp import web

from splitstream.router.http.call import CALL


async def end_stream(request: web.Request, sse: web.StreamResponse) -> None:
    """Close ``sse`` after its last event was written; a client already gone had its whole answer: the edge
    keeps the call's status then (:attr:`Call.complete`), even when the client leaves (and aiohttp cancels the
    handler) before the stream is closed."""
    request[CALL].complete = True
    with contextlib.suppress(ConnectionError):
        await sse.write_eof()
