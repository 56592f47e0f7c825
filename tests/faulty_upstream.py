"""An OpenAI-compatible upstream that misbehaves on purpose, as a real process: what a vLLM or a hosted API
does on a bad day, which no well-behaved server can be made to do on cue. The router's registry names the
behaviour as the upstream's own model name (``model:`` of an ``openai`` version), so one process serves
every fault:

- ``ok``: a whole answer, or a stream of three text events (10 ms apart) then ``data: [DONE]``;
- ``linger``: a stream whose ``data: [DONE]`` comes at once, but whose response then stays open until its
  client goes (an upstream slow to close: the client has its whole answer at ``[DONE]``);
- ``endless``: a stream of text events until its client goes;
- ``stall``: reads the request, then answers nothing, ever;
- ``stall-mid``: a stream of two text events, then nothing, ever;
- ``unauthorized`` / ``forbidden``: 401 / 403 with OpenAI's error object (its own credentials refused).

``GET /v1/models`` answers 200 (healthy); ``GET /stats`` says how many streamed calls it has seen their
client leave (``gone``), so a test can tell the router closed the upstream's connection.

    python -m tests.faulty_upstream --port P
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from aiohttp import web

_FOREVER_S = 3600.0


def _chunk(model: str, text: str) -> bytes:
    event = {"id": "cmpl-faulty", "object": "text_completion", "model": model, "choices": [{"index": 0, "text": text}]}
    return f"data: {json.dumps(event)}\n\n".encode()


class FaultyUpstream:
    def __init__(self) -> None:
        self.gone = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "ok", "object": "model"}]})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"gone": self.gone})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        model = str(body.get("model"))
        if model in ("unauthorized", "forbidden"):
            status = 401 if model == "unauthorized" else 403
            error = {"message": "Incorrect API key", "type": "invalid_request_error", "code": "invalid_api_key"}
            return web.json_response({"error": error}, status=status)
        if model == "stall":
            await asyncio.sleep(_FOREVER_S)
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "cmpl-faulty",
                    "object": "text_completion",
                    "model": model,
                    "choices": [{"index": 0, "text": "one two three", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            if model == "endless":
                while True:
                    await response.write(_chunk(model, "x"))
                    await asyncio.sleep(0.01)
            for word in ("one", " two", " three"):
                await response.write(_chunk(model, word))
                await asyncio.sleep(0.01)  # a token at a time, as a generation sends them
                if model == "stall-mid" and word == " two":
                    await asyncio.sleep(_FOREVER_S)
            await response.write(b"data: [DONE]\n\n")
            if model == "linger":
                await asyncio.sleep(_FOREVER_S)
        except (asyncio.CancelledError, ConnectionError):
            self.gone += 1
            raise
        await response.write_eof()
        return response


def main() -> None:
    parser = argparse.ArgumentParser(prog="faulty-upstream")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    upstream = FaultyUpstream()
    app = web.Application()
    app.router.add_get("/v1/models", upstream.models)
    app.router.add_get("/stats", upstream.stats)
    app.router.add_post("/v1/completions", upstream.completions)
    app.router.add_post("/v1/chat/completions", upstream.completions)
    web.run_app(app, host="127.0.0.1", port=args.port, handler_cancellation=True, print=None, access_log=None)


if __name__ == "__main__":
    main()
