"""A scripted judge faithful to the OpenAI chat completions API, for tests: ``POST /v1/chat/completions``
takes and answers the same JSON shapes (``choices[0].message.content``, ``usage``), refuses a missing or
wrong bearer key with 401 and OpenAI's error object, and answers 429 with ``Retry-After`` when told to.
Its verdicts are scripted, not generated:

- ``--prefer FILE``: the answer that starts one of FILE's lines (JSON strings) wins; both or neither: a tie.
- ``--first``: always "Verdict: A" (a judge biased to the position shown first).
- ``--flip-every N``: with ``--prefer``, the verdict of one pair in N (by a hash of the two answers, whatever
  their order) goes the other way: a judge that mostly, not always, prefers one version.

``--answer KIND`` breaks it on purpose: ``not-json`` (a 200 of plain text), ``no-message`` (``message`` a string,
not an object), ``huge`` (a 200 of 64 MiB of JSON), ``500`` (every call an HTTP 500).

``--throttle N``: the first N calls answer 429 (``Retry-After: 0``, or ``--retry-after``'s text). ``GET /gaps``
answers the seconds between one call and the next. ``GET /stats`` answers the number of
completions asked and of 429s given, so a test can tell whether a run asked the judge at all; ``GET /prompts``
the prompts it was asked to judge, as it decoded them.

    python -m tests.judge_server --port 0 --key sk-judge --prefer preferred.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time
import zlib
from pathlib import Path

from aiohttp import web

_ANSWER = re.compile(r"Answer A:\n(?P<a>.*?)\n\nAnswer B:\n(?P<b>.*?)\n\n", re.DOTALL)


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}}, status=status)


def _broken(answer: str) -> web.Response:
    if answer == "not-json":
        return web.Response(text="<html>upstream says hello</html>", content_type="text/html")
    if answer == "no-message":
        return web.json_response({"choices": [{"index": 0, "message": "Verdict: A"}], "usage": {}})
    if answer == "huge":
        content = "x" * (64 << 20)
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})
    return _error(500, "The server had an error while processing your request.", "server_error")


def build(
    key: str,
    preferred: set[str],
    first: bool,
    throttle: int,
    flip_every: int = 0,
    answer: str = "",
    retry_after: str = "0",
) -> web.Application:
    counts = {"completions": 0, "throttled": 0}
    arrivals: list[float] = []
    prompts: list[str] = []

    async def completions(request: web.Request) -> web.Response:
        arrivals.append(time.monotonic())
        if request.headers.get("Authorization") != f"Bearer {key}":
            return _error(401, "Incorrect API key provided.", "invalid_request_error")
        if counts["throttled"] < throttle:
            counts["throttled"] += 1
            return web.json_response(
                {
                    "error": {
                        "message": "Rate limit reached.",
                        "type": "requests",
                        "param": None,
                        "code": "rate_limit_exceeded",
                    }
                },
                status=429,
                headers={"Retry-After": retry_after},
            )
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        prompts.append(prompt)
        counts["completions"] += 1
        if answer:
            return _broken(answer)
        match = _ANSWER.search(prompt)
        if match is None:
            return _error(400, "the prompt holds no 'Answer A:'/'Answer B:'", "invalid_request_error")
        if first:
            verdict = "A"
        else:
            a, b = (any(text.startswith(match[side]) for text in preferred) for side in ("a", "b"))
            verdict = "A" if a and not b else "B" if b and not a else "tie"
            both = "\n".join(sorted((match["a"], match["b"]))).encode()
            if flip_every and verdict != "tie" and zlib.crc32(both) % flip_every == 0:
                verdict = "B" if verdict == "A" else "A"
        content = f"Both answers were read carefully.\nVerdict: {verdict}"
        prompt_tokens, completion_tokens = len(prompt.split()), len(content.split())
        return web.json_response(
            {
                "id": f"chatcmpl-{counts['completions']}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(counts)

    async def gaps(_: web.Request) -> web.Response:
        return web.json_response([later - earlier for earlier, later in itertools.pairwise(arrivals)])

    async def asked(_: web.Request) -> web.Response:
        return web.json_response(prompts)

    app = web.Application()
    app.router.add_get("/prompts", asked)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/stats", stats)
    app.router.add_get("/gaps", gaps)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--prefer", default="")
    parser.add_argument("--first", action="store_true")
    parser.add_argument("--throttle", type=int, default=0)
    parser.add_argument("--retry-after", default="0")
    parser.add_argument("--flip-every", type=int, default=0)
    parser.add_argument("--answer", choices=("not-json", "no-message", "huge", "500"), default="")
    args = parser.parse_args()
    preferred = (
        {json.loads(line) for line in Path(args.prefer).read_text().splitlines() if line} if args.prefer else set()
    )
    web.run_app(
        build(args.key, preferred, args.first, args.throttle, args.flip_every, args.answer, args.retry_after),
        host="127.0.0.1",
        port=args.port,
        print=None,
    )


if __name__ == "__main__":
    main()
