"""The demo's judge: a small deterministic stand-in for a judge model, speaking OpenAI's chat completions API.

``make demo-llm`` cannot download a model, so ``splitstream judge`` asks this process instead. It takes and
answers what OpenAI's ``POST /v1/chat/completions`` does (``messages`` in; ``choices[0].message.content`` and
``usage`` out) and reads the two answers out of the default rubric (docs/replay.md, "The judge").

Its rule, stated in every answer it gives: the answer with the larger share of real words (the lower-case words
of more than one letter of the language models' training text, :func:`demo.chat.real_word_share`, the same rule
by which the OpenAI act's users give a thumbs-up) wins; shares within :data:`TIE_WITHIN` of each other are a tie.
It is no language model: a judge whose preference is known, so the judged win rate can be read against it.

    python -m demo.judge --port 8090
"""

from __future__ import annotations

import argparse
import re
from typing import Final

from aiohttp import web

from demo import chat, language

#: Shares of real words closer than this are a tie.
TIE_WITHIN: Final = 0.05
RULE: Final = (
    f"the answer with the larger share of real words wins (ties within {TIE_WITHIN}); a rule, not a language model"
)
_ANSWERS = re.compile(r"Answer A:\n(?P<a>.*?)\n\nAnswer B:\n(?P<b>.*?)\n\nWhich answer", re.DOTALL)


def verdict(answer_a: str, answer_b: str, words: frozenset[bytes]) -> tuple[str, float, float]:
    """``"A"``, ``"B"`` or ``"tie"`` by :data:`RULE`, with both shares."""
    a, b = chat.real_word_share(answer_a, words), chat.real_word_share(answer_b, words)
    if abs(a - b) < TIE_WITHIN:
        return "tie", a, b
    return ("A" if a > b else "B"), a, b


def _error(status: int, message: str) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return web.json_response({"error": error}, status=status)


def build(words: frozenset[bytes]) -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            prompt = str(body["messages"][-1]["content"])
            model = str(body.get("model", "demo-judge"))
        except (ValueError, KeyError, IndexError, TypeError):
            return _error(400, "expected an OpenAI chat completion request with messages")
        found = _ANSWERS.search(prompt)
        if found is None:
            return _error(400, "the prompt holds no 'Answer A:' / 'Answer B:' of the default rubric")
        choice, a, b = verdict(found["a"], found["b"], words)
        content = f"Rule: {RULE}. Real words: A {a:.2f}, B {b:.2f}.\nVerdict: {choice}"
        prompt_tokens, completion_tokens = len(prompt.split()), len(content.split())
        return web.json_response(
            {
                "id": "chatcmpl-demo-judge",
                "object": "chat.completion",
                "created": 0,
                "model": model,
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

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "demo-judge", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="demo-judge", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(build(chat.vocabulary(language.corpus())), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
