"""Bare OpenAI pass-throughs on several Python HTTP stacks: the floor any Python HTTP hop costs.

Each forwards ``POST /v1/chat/completions`` to one of its upstreams (picked at random, as a 50/50 split
picks) with the body as received, and relays the answer: a whole one read and written in one piece, a
server-sent event stream chunk by chunk as it arrives (never buffered). ``GET /v1/models`` is forwarded
likewise. No routing, metrics, checks or recording: what is left is the server's and the client's cost.

Stacks (``--stack``; the server and the client library):

- ``aiohttp``: aiohttp's server and its client, in one library on one asyncio loop (the router's stack);
- ``uvicorn-httpx``: uvicorn serving a Starlette app, httpx's AsyncClient calling;
- ``uvicorn-aiohttp``: uvicorn and Starlette, aiohttp's client calling (the server alone changed);
- ``granian-httpx`` and ``granian-aiohttp``: Granian (a Rust HTTP server) serving the same Starlette app
  over ASGI, one worker.

Every server runs on asyncio's own loop (not uvloop: the router's gRPC server needs asyncio's), HTTP/1.1
with keep-alive. Only the aiohttp stack's libraries are splitstream's dependencies; the others come from
``.venv-bench`` (``make bench-http``), so they are imported only by the stacks that use them.

    python bench/http_passthrough.py --stack aiohttp --port 8081 --upstream http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

STACKS = ("aiohttp", "uvicorn-httpx", "uvicorn-aiohttp", "granian-httpx", "granian-aiohttp")
#: Where a Granian worker (a process of its own, importing the app by name) finds its upstreams.
UPSTREAMS_ENV = "SPLITSTREAM_BENCH_UPSTREAMS"
JSON = {"Content-Type": "application/json"}


def aiohttp_app(upstreams: list[str]) -> Any:
    """aiohttp server + aiohttp client: the front door's stack with nothing of the router in it."""
    import aiohttp
    from aiohttp import web

    state: dict[str, aiohttp.ClientSession] = {}

    async def open_session(app: web.Application) -> None:
        state["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close_session(app: web.Application) -> None:
        await state["session"].close()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = random.choice(upstreams) + "/chat/completions"
        upstream = await state["session"].post(url, data=body, headers=JSON)
        try:
            content_type = upstream.headers.get("Content-Type", "")
            if not content_type.startswith("text/event-stream"):
                answer = await upstream.read()
                return web.Response(status=upstream.status, body=answer, headers={"Content-Type": content_type})
            response = web.StreamResponse(
                status=upstream.status, headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            upstream.release()

    async def models(request: web.Request) -> web.Response:
        async with state["session"].get(upstreams[0] + "/models") as upstream:
            return web.Response(status=upstream.status, body=await upstream.read(), headers=JSON)

    app = web.Application()
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def starlette_app(upstreams: list[str], client: str) -> Any:
    """A Starlette app calling with httpx's AsyncClient (``client`` ``httpx``) or aiohttp's (``aiohttp``)."""
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    state: dict[str, Any] = {}

    if client == "httpx":
        import httpx

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(limits=limits, timeout=None) as session:
                state["session"] = session
                yield

        async def chat(request: Request) -> Response:
            body = await request.body()
            session: httpx.AsyncClient = state["session"]
            call = session.build_request("POST", random.choice(upstreams) + "/chat/completions", content=body)
            call.headers["Content-Type"] = "application/json"
            upstream = await session.send(call, stream=True)
            content_type = upstream.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                answer = await upstream.aread()
                await upstream.aclose()
                return Response(answer, status_code=upstream.status_code, media_type=content_type)
            return StreamingResponse(
                upstream.aiter_raw(),
                status_code=upstream.status_code,
                media_type=content_type,
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(upstream.aclose),
            )

        async def models(request: Request) -> Response:
            upstream = await state["session"].get(upstreams[0] + "/models")
            return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    else:
        import aiohttp

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                state["session"] = session
                yield

        async def chat(request: Request) -> Response:
            body = await request.body()
            session: aiohttp.ClientSession = state["session"]
            upstream = await session.post(random.choice(upstreams) + "/chat/completions", data=body, headers=JSON)
            content_type = upstream.headers.get("Content-Type", "")
            if not content_type.startswith("text/event-stream"):
                try:
                    answer = await upstream.read()
                finally:
                    upstream.release()
                return Response(answer, status_code=upstream.status, media_type=content_type)
            return StreamingResponse(
                upstream.content.iter_any(),
                status_code=upstream.status,
                media_type=content_type,
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(upstream.release),
            )

        async def models(request: Request) -> Response:
            async with state["session"].get(upstreams[0] + "/models") as upstream:
                return Response(await upstream.read(), status_code=upstream.status, media_type="application/json")

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan)


def granian_httpx() -> Any:
    """Granian's app factory (its worker imports this by name; the upstreams come in the environment)."""
    return starlette_app(os.environ[UPSTREAMS_ENV].split(","), "httpx")


def granian_aiohttp() -> Any:
    return starlette_app(os.environ[UPSTREAMS_ENV].split(","), "aiohttp")


def serve(stack: str, host: str, port: int, upstreams: list[str]) -> None:
    server, _, client = stack.partition("-")
    if stack == "aiohttp":
        import asyncio

        from aiohttp import web

        web.run_app(
            aiohttp_app(upstreams), host=host, port=port, access_log=None, print=None, loop=asyncio.new_event_loop()
        )
    elif server == "uvicorn":
        import uvicorn

        uvicorn.run(
            starlette_app(upstreams, client),
            host=host,
            port=port,
            loop="asyncio",
            http="httptools",
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
    elif server == "granian":
        from granian.constants import HTTPModes, Interfaces, Loops
        from granian.server import Server

        os.environ[UPSTREAMS_ENV] = ",".join(upstreams)
        Server(
            f"bench.http_passthrough:granian_{client}",
            address=host,
            port=port,
            interface=Interfaces.ASGI,
            http=HTTPModes.http1,
            workers=1,
            loop=Loops.asyncio,
            factory=True,
            log_access=False,
        ).serve()
    else:
        raise ValueError(f"unknown stack {stack!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", choices=STACKS, default="aiohttp")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", action="append", required=True, help="an upstream's base URL (repeatable)")
    args = parser.parse_args(argv)
    # Granian's worker imports this module as bench.http_passthrough: from the repository's root.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    serve(args.stack, args.host, args.port, [url.rstrip("/") for url in args.upstream])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
