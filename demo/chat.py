"""The OpenAI act of ``make demo-llm``: chat users call the router's HTTP front door with OpenAI's own client.

Each simulated user (``user=`` set, so the router's split is sticky by user) asks a few short questions with
``openai.AsyncOpenAI``, streamed with ``stream_options.include_usage``, sampled (a seed per chat, so a run
is repeatable). The user's satisfaction comes from the answer itself: a thumbs-up with a probability equal
to the answer's share of real words (words of the corpus the models were counted from). The trigram (v2)
writes more real words than the bigram (v1), so it earns more thumbs-up: the demo plants v2 as the better
version through its model, not through a coin weighted by the version's name. Every answer's rating (1 or
0) is reported with ``POST /v1/feedback`` under the chat's response id, the way a page's front end would.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import openai

#: The feedback metric the act reports and analyses (1: thumbs-up, 0: none).
THUMBS_UP = "thumbs_up"
#: Sampling temperature of every chat: greedy n-grams write the same text after any prompt.
TEMPERATURE = 0.7
QUESTIONS = (
    "Hi! Tell me a story.",
    "How do I learn a language?",
    "Why do stars shine?",
    "A poem about the sea, please.",
    "How do I bake bread?",
    "What is a list?",
    "Any ideas for dinner?",
    "What does this word mean?",
)
_WORD = re.compile(rb"[a-z]+")


class FeedbackAnswer(openai.BaseModel):
    """The router's answer to ``POST /v1/feedback`` (docs/http.md)."""

    object: str
    accepted: bool
    request_id: str
    model: str
    metric: str


def vocabulary(text: bytes) -> frozenset[bytes]:
    """The lower-case words of ``text`` longer than one letter: what a user takes for real words."""
    return frozenset(word for word in _WORD.findall(text.lower()) if len(word) > 1)


def real_word_share(answer: str, words: frozenset[bytes]) -> float:
    """The share of the answer's words that are real words (0 for an answer without any word)."""
    found = _WORD.findall(answer.encode().lower())
    return sum(word in words for word in found) / len(found) if found else 0.0


@dataclass
class Chats:
    """What the chat users saw and reported, per served version (client clock)."""

    users: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    chats: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tokens_in: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tokens_out: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ttft_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    thumbs_up: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Feedback events the router answered ``"accepted": true``.
    feedback_accepted: int = 0
    #: Users served by more than one version (the split is sticky by ``user``: none).
    switched_users: int = 0
    errors: list[str] = field(default_factory=list)


async def chat_users(
    base_url: str,
    model: str,
    words: frozenset[bytes],
    *,
    users: int,
    chats_per_user: int,
    max_tokens: int,
    concurrency: int,
    seed: int,
) -> Chats:
    """``users`` users (``concurrency`` at a time), each asking ``chats_per_user`` questions in turn."""
    seen = Chats()
    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30) as client:

        async def one_user(index: int) -> None:
            user = f"chat-user-{index}"
            draws = random.Random(f"{seed}:{user}")  # the same ratings whatever order the users run in
            versions: set[str] = set()
            async with gate:
                for _ in range(chats_per_user):
                    try:
                        version = await _chat(client, seen, model, user, draws, words, max_tokens, seed)
                    except (openai.OpenAIError, KeyError) as error:
                        seen.errors.append(f"{user}: {error!r}")
                        continue
                    versions.add(version)
            seen.switched_users += len(versions) > 1

        await asyncio.gather(*(one_user(index) for index in range(users)))
    return seen


async def _chat(
    client: openai.AsyncOpenAI,
    seen: Chats,
    model: str,
    user: str,
    draws: random.Random,
    words: frozenset[bytes],
    max_tokens: int,
    seed: int,
) -> str:
    """One streamed chat, then its rating posted as feedback; returns the version that answered."""
    started = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": draws.choice(QUESTIONS)}],
        max_tokens=max_tokens,
        temperature=TEMPERATURE,
        seed=draws.randrange(2**32) + seed,
        user=user,
        stream=True,
        stream_options={"include_usage": True},
    )
    version = raw.headers["x-splitstream-version"]
    pieces: list[str] = []
    response_id = ""
    async for chunk in raw.parse():
        response_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            if not pieces:
                seen.ttft_s[version].append(time.perf_counter() - started)
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            seen.tokens_in[version] += chunk.usage.prompt_tokens
            seen.tokens_out[version] += chunk.usage.completion_tokens
    seen.users[version].add(user)
    seen.chats[version] += 1
    liked = draws.random() < real_word_share("".join(pieces), words)
    seen.thumbs_up[version] += liked
    # OpenAI's API has no such route: ``client.post`` is the client's documented way to call one.
    answer = await client.post(
        "/feedback",
        cast_to=FeedbackAnswer,
        body={"id": response_id, "metric": THUMBS_UP, "value": float(liked)},
    )
    seen.feedback_accepted += answer.accepted
    return version
