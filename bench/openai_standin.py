"""A minimal OpenAI-compatible server, the shared upstream of the HTTP benchmarks.

It answers ``POST /v1/chat/completions`` whole (one ``chat.completion``) or, with ``"stream": true``, as
server-sent events: a role chunk, ``--tokens`` content chunks ``--gap-ms`` apart, a ``finish_reason``
chunk (with ``usage`` when ``stream_options.include_usage`` asks), then ``data: [DONE]``; and
``GET /v1/models``. Every answer's bytes are built once at start, so that what the stand-in costs per call
is aiohttp's own and the same for every path a benchmark puts in front of it (its CPU is not counted).
It echoes nothing of the request but reads and parses the body, as a real server would.

    .venv/bin/python bench/openai_standin.py --port 8080 [--tokens 16] [--gap-ms 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from aiohttp import web

MODEL = "standin"
#: One token's text: the same piece every time, so every path relays the same bytes.
PIECE = "tok "


def _event(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _chunk(delta: dict[str, str], finish_reason: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    chunk: dict[str, Any] = {
        "id": "chatcmpl-standin",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return _event(chunk)


class Standin:
    """The answers, made once; ``gap_s`` between a stream's tokens."""

    def __init__(self, tokens: int, gap_s: float) -> None:
        self.tokens = tokens
        self.gap_s = gap_s
        usage = {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}
        self.whole = json.dumps(
            {
                "id": "chatcmpl-standin",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": PIECE * tokens}, "finish_reason": "length"}
                ],
                "usage": usage,
            },
            separators=(",", ":"),
        ).encode()
        self.first = _chunk({"role": "assistant", "content": ""})
        self.token = _chunk({"content": PIECE})
        self.last = _chunk({}, "length")
        self.last_with_usage = _chunk({}, "length", usage)
        self.done = _event("[DONE]")
        self.models = json.dumps(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}
        ).encode()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=self.whole, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(self.first)
        for _ in range(self.tokens):
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
            await response.write(self.token)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage")
        await response.write((self.last_with_usage if include_usage else self.last) + self.done)
        await response.write_eof()
        return response

    async def list_models(self, request: web.Request) -> web.Response:
        return web.Response(body=self.models, content_type="application/json")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.list_models)
        return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=16, help="content chunks per answer (and tokens of a whole one)")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="time between a stream's tokens")
    args = parser.parse_args(argv)
    standin = Standin(args.tokens, args.gap_ms / 1000)
    web.run_app(standin.app(), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
