"""Reading a request's body with a bound on its time.

aiohttp waits for a body's bytes as long as the client takes to send them: a client that sends its headers
and then trickles the body (or stops) holds a handler, its memory and a connection forever. Every route
reads its body here, within ``--http-body-timeout-s``: past it the client gets a 408 and the handler ends.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from splitstream.router.http.errors import ApiError

#: The application's key of the bound, in seconds.
BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)


async def read_body(request: web.Request) -> bytes:
    """The whole body (aiohttp keeps it: a second call costs nothing); 408 when it takes too long."""
    if request.content.is_eof():  # all of it came with the headers (most calls): nothing to wait for, or bound
        return await request.read()
    timeout_s = request.config_dict[BODY_TIMEOUT_S]
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {timeout_s:g} s (--http-body-timeout-s)", code="timeout"
        ) from None
