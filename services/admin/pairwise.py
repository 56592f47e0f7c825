"""Pairwise judging of recorded chat calls: the recorded answer against another version's, by a judge model.

For each HTTP chat call of a window recorded on one of two versions, the prompt is sent again to the other
version (through a router's HTTP port with the version pinned, or to a URL serving it), or, when the record holds
the other version's answer already (a shadow of a unary call), that answer is read; then a judge model
behind an OpenAI-compatible ``/chat/completions`` is asked which of the two answers is better. The two
answers go in as A and B in an order drawn per pair (a hash of the request id and ``--seed``, so a re-run
draws the same), so a judge that prefers a position favours neither version; the order and the judge's raw
answer are kept with each pair.

A pair already judged (same request id, other version, judge model and rubric) is read from the cache file
instead: a re-run neither replays nor asks the judge again. The judge is asked again after a 429 or a 5xx,
waiting its ``Retry-After`` when it gives one, else an exponential backoff.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import xxhash

from splitstream.common import tensors
from splitstream.common.headers import VERSION_HEADER
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.records import payload_bytes
from splitstream.common.redis_url import RedisClient
from splitstream.common.sse import EventData
from splitstream.replayer.http_compare import HttpAnswer, read_text
from splitstream.replayer.selection import SelectedCall
from splitstream.replayer.stream_compare import read_tokens

#: The token streams' method (a stream record is always one): requests and responses go as recorded bytes.
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
#: A unary call's method: its recorded request goes out as recorded bytes.
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
#: ``why`` of a unary call without ``text_input`` or ``text_output``: nothing for a judge to read.
NOT_TEXT = "not_text"

#: The rubric used without ``--rubric``: its placeholders are replaced by the conversation and the answers.
DEFAULT_RUBRIC = """You are judging two answers of AI assistants to the same conversation.

Conversation:
{{conversation}}

Answer A:
{{answer_a}}

Answer B:
{{answer_b}}

Which answer serves the user better: more helpful, correct, relevant and clear? Do not let the order
of the answers or their length sway you. Explain briefly, then end with one line that is exactly
"Verdict: A", "Verdict: B" or "Verdict: tie".
"""
PLACEHOLDERS = ("{{conversation}}", "{{answer_a}}", "{{answer_b}}")
#: The last "verdict: X" wins (a judge may quote the instructions first); else an answer that is only the letter.
_VERDICT = re.compile(r"verdict\s*[:=\-]?\s*[\*\[\"'(]*\s*(A|B|tie)\b", re.IGNORECASE)
_BARE = re.compile(r"^\W*(A|B|tie)\W*$", re.IGNORECASE)
_RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
#: A judge's answer longer than this is refused: a verdict is a few lines, and each pair keeps the raw answer.
MAX_JUDGE_ANSWER_BYTES = 16 << 20


class JudgeFailed(RuntimeError):
    """The judge endpoint could not be used (refused, unreachable after every retry, an answer of no JSON)."""


def parse_verdict(answer: str) -> str | None:
    """``"A"``, ``"B"`` or ``"tie"`` from the judge's raw answer; None when it names none."""
    found = _VERDICT.findall(answer)
    if found:
        choice = found[-1]
    elif match := _BARE.match(answer.strip()):
        choice = match.group(1)
    else:
        return None
    return "tie" if choice.lower() == "tie" else choice.upper()


def check_rubric(text: str) -> None:
    """ValueError naming the placeholders a rubric lacks: without them the judge never sees the answers."""
    missing = [name for name in PLACEHOLDERS if name not in text]
    if missing:
        raise ValueError(f"the rubric lacks {', '.join(missing)}")


class UnreadableRequest(ValueError):
    """A recorded request the judge cannot show (a body an upstream took as it was, not a chat request)."""


def render_conversation(body: bytes) -> str:
    """A chat request's messages as ``role: content`` lines (text parts of multi-part contents joined).

    UnreadableRequest when the body is no chat request: an ``openai`` upstream gets the body as the client sent
    it, so a record may hold what our own front door would have refused (``"messages": ["hi"]``)."""
    try:
        request = json.loads(body)
    except ValueError:
        raise UnreadableRequest("the request body is not JSON") from None
    if not isinstance(request, dict):
        raise UnreadableRequest("the request body is not a JSON object")
    messages = request.get("messages") or []
    if not isinstance(messages, list):
        raise UnreadableRequest("'messages' is not an array")
    lines = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UnreadableRequest(f"messages[{index}] is not an object")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        lines.append(f"{message.get('role', 'user')}: {content or ''}")
    return "\n".join(lines)


def recorded_first(request_id: str, seed: int) -> bool:
    """Whether the recorded answer is shown as A: drawn per pair, fixed by the request id and the seed."""
    return xxhash.xxh3_64_intdigest(request_id.encode(), seed=seed) % 2 == 0


def cache_key(request_id: str, other: str, judge_model: str, rubric: str) -> str:
    text = json.dumps([request_id, other, judge_model, hashlib.sha256(rubric.encode()).hexdigest()])
    return hashlib.sha256(text.encode()).hexdigest()


def load_cache(path: Path | None) -> dict[str, dict[str, Any]]:
    """The pairs a former run judged, by cache key (a torn last line, from a run killed mid-write, is skipped)."""
    pairs: dict[str, dict[str, Any]] = {}
    if path is None or not path.exists():
        return pairs
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            pair = json.loads(line)
        except ValueError:
            continue
        if isinstance(pair, dict) and "cache_key" in pair:
            pairs[pair["cache_key"]] = pair
    return pairs


def cut_torn_line(path: Path) -> None:
    """Cut off a last line without its newline (a run killed mid-write), so the next pair appended to the cache
    starts a line of its own rather than ending the torn one (and being lost with it)."""
    if not path.exists():
        return
    with path.open("rb+") as file:
        data = file.read()
        if data and not data.endswith(b"\n"):
            file.truncate(data.rfind(b"\n") + 1)


@dataclass(frozen=True, kw_only=True)
class JudgeSettings:
    url: str
    model: str
    api_key: str
    rubric: str
    max_tokens: int | None
    retries: int
    backoff_s: float
    timeout_s: float


@dataclass(frozen=True, kw_only=True)
class OtherSide:
    """Where the other version's answer comes from: ``url`` (a router's HTTP port, pinned to ``version``, or a
    server of that version alone), with the key it wants."""

    url: str
    version: str
    pin: bool
    api_key: str


@dataclass
class Budget:
    """Judge tokens spent (prompt + completion, as the judge reports them) against ``--max-tokens``."""

    limit: int | None
    spent: int = 0
    judge_calls: int = 0
    retries: int = 0

    def exhausted(self) -> bool:
        return self.limit is not None and self.spent >= self.limit


@dataclass
class Judging:
    """One run's state: the HTTP session, the cache, the budget, and where pairs are written."""

    session: aiohttp.ClientSession
    redis: RedisClient
    judge: JudgeSettings
    others: dict[str, OtherSide]
    seed: int
    cache: dict[str, dict[str, Any]]
    write_pair: Callable[[dict[str, Any]], None]
    budget: Budget
    #: A router's gRPC channel for token streams (``--grpc-target``), pinned like ``--target``; None: not judged.
    grpc_channel: grpc.aio.Channel | None = None
    grpc_key: str = ""
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def answerable(self, record: Any) -> bool:
        """Whether the other version's answer can be had: an HTTP call is replayed at ``--target``; a gRPC call (a
        stream, a unary call) needs ``--grpc-target``, unless the record holds the other version's shadow."""
        if record.HasField("http") or self.grpc_channel is not None:
            return True
        other = self.others.get(record.version)
        return not record.HasField("stream") and other is not None and _shadow_of(record, other.version) is not None

    async def pair(self, call: SelectedCall) -> dict[str, Any] | None:
        """The judged pair of ``call`` (from the cache, or replayed and judged), None when it cannot be one."""
        record = call.record
        recorded_version = record.version
        other = self.others.get(recorded_version)
        if other is None:
            self.count("other_version")
            return None
        streamed = record.HasField("stream") and not record.HasField("http")
        unary = not streamed and not record.HasField("http")
        shadow = _shadow_of(record, other.version) if unary else None
        if not self.answerable(record):
            self.count("no_grpc_target")
            return None
        if record.HasField("http") and record.http.api != "chat":
            self.count("not_http_chat")
            return None
        key = cache_key(record.request_id, other.version, self.judge.model, self.judge.rubric)
        if key in self.cache:
            self.count("cached")
            return self.cache[key]
        if self.budget.exhausted():
            self.count("over_budget")
            return None
        source = "shadow" if shadow is not None else "replay"
        if streamed:
            conversation, recorded_text, other_text, why = await self._stream_pair(record, other)
        elif unary:
            conversation, recorded_text, other_text, why = await self._unary_pair(record, other, shadow)
            if why == NOT_TEXT:
                self.count("not_text")
                return None
        else:
            http = record.http
            body = await payload_bytes(self.redis, http.request_body)
            try:
                conversation = render_conversation(body)
            except UnreadableRequest:
                self.count("unreadable_request")
                return None
            recorded_text = read_text("chat", await self._recorded_answer(record)).text
            if not (200 <= http.status < 300):
                recorded_text = ""
            other_text, why = None, ""
            if recorded_text:
                other_text, why = await self._other_answer(other, http.path, body, record.request_id)
        if not recorded_text:
            self.count("recorded_no_text")
            return None
        if other_text is None:
            self.count("other_failed")
            return {"request_id": record.request_id, "error": why}
        first = recorded_first(record.request_id, self.seed)
        answer_a, answer_b = (recorded_text, other_text) if first else (other_text, recorded_text)
        prompt = self.judge.rubric
        for name, value in zip(PLACEHOLDERS, (conversation, answer_a, answer_b), strict=True):
            prompt = prompt.replace(name, value)
        raw, usage = await self._ask(prompt)
        verdict = parse_verdict(raw)
        winner = None
        if verdict == "tie":
            winner = "tie"
        elif verdict is not None:
            winner = recorded_version if (verdict == "A") == first else other.version
        self.count("judged")
        return {
            "cache_key": key,
            "request_id": record.request_id,
            "receive_unix_ns": call.receive_ns,
            "routing_key_hmac": record.routing_key_hmac,
            "recorded_version": recorded_version,
            "other_version": other.version,
            "order": {
                "A": recorded_version if first else other.version,
                "B": other.version if first else recorded_version,
            },
            "verdict": verdict,
            "winner": winner,
            "judge_model": self.judge.model,
            "judge_raw": raw,
            "judge_usage": usage,
            "recorded_answer": recorded_text,
            "other_answer": other_text,
            "other_source": source,
        }

    async def _stream_pair(self, record: Any, other: OtherSide) -> tuple[str, str, str | None, str]:
        """A token stream's prompt (its first request's ``text_input``), recorded text, and the other version's
        text: the recorded requests sent again on a stream to ``--grpc-target``, pinned."""
        stream = record.stream
        requests = [await payload_bytes(self.redis, message.payload) for message in stream.requests]
        if not requests:
            requests = [await payload_bytes(self.redis, record.request)]
        prompt = ""
        first = oip.ModelInferRequest.FromString(requests[0])
        for tensor, raw in zip(first.inputs, first.raw_input_contents, strict=False):
            if tensor.name == "text_input":
                prompt = raw[4:].decode(errors="replace")  # one BYTES element: 4-byte length, then the text
        responses = [await payload_bytes(self.redis, message.payload) for message in stream.responses]
        recorded = b"".join(read_tokens(responses).tokens).decode(errors="replace") if record.status_code == 0 else ""
        if not recorded:
            return "", "", None, ""
        assert self.grpc_channel is not None
        metadata = [(VERSION_HEADER, other.version), ("x-request-id", f"{record.request_id}:judge")]
        if self.grpc_key:
            metadata.append(("x-api-key", self.grpc_key))
        call = self.grpc_channel.stream_stream(STREAM_METHOD)(
            iter(requests), metadata=metadata, timeout=self.judge.timeout_s
        )
        answered: list[bytes] = []
        try:
            async for response in call:
                answered.append(response)
        except grpc.aio.AioRpcError as error:
            return "", recorded, None, f"--grpc-target: {error.code().name}: {error.details()}"
        text = b"".join(read_tokens(answered).tokens).decode(errors="replace")
        return f"user: {prompt}", recorded, (text or None), "" if text else "--grpc-target answered no tokens"

    async def _unary_pair(self, record: Any, other: OtherSide, shadow: Any | None) -> tuple[str, str, str | None, str]:
        """A unary generation call (``text_input`` in, ``text_output`` out): its prompt, recorded text and the other
        version's text, read from ``shadow`` (the other version's answer recorded with the call) when there is
        one, else the recorded request sent again to ``--grpc-target``, pinned. ``why`` is :data:`NOT_TEXT` when
        the call carries no text."""
        request_bytes = await payload_bytes(self.redis, record.request)
        prompt = _text_of(oip.ModelInferRequest.FromString(request_bytes), TEXT_INPUT)
        recorded: str | None = ""
        if record.status_code == 0:
            recorded = _text_of(
                oip.ModelInferResponse.FromString(await payload_bytes(self.redis, record.response)), TEXT_OUTPUT
            )
        if prompt is None or recorded is None:
            return "", "", None, NOT_TEXT
        if not recorded:
            return "", "", None, ""
        if shadow is not None:
            answer = _text_of(
                oip.ModelInferResponse.FromString(await payload_bytes(self.redis, shadow.response)), TEXT_OUTPUT
            )
            return f"user: {prompt}", recorded, answer or None, "" if answer else "the shadow answered no text"
        assert self.grpc_channel is not None
        metadata = [(VERSION_HEADER, other.version), ("x-request-id", f"{record.request_id}:judge")]
        if self.grpc_key:
            metadata.append(("x-api-key", self.grpc_key))
        try:
            raw = await self.grpc_channel.unary_unary(INFER_METHOD)(
                request_bytes, metadata=metadata, timeout=self.judge.timeout_s
            )
        except grpc.aio.AioRpcError as error:
            return "", recorded, None, f"--grpc-target: {error.code().name}: {error.details()}"
        answer = _text_of(oip.ModelInferResponse.FromString(raw), TEXT_OUTPUT)
        return f"user: {prompt}", recorded, answer or None, "" if answer else "--grpc-target answered no text"

    async def _recorded_answer(self, record: Any) -> HttpAnswer:
        http = record.http
        streamed = bool(http.events_total) or http.response_content_type == "text/event-stream"
        if streamed:
            events = tuple([await payload_bytes(self.redis, event.payload) for event in http.events])
            return HttpAnswer(status=http.status, events=events)
        body = await payload_bytes(self.redis, http.response_body) if http.HasField("response_body") else b""
        return HttpAnswer(status=http.status, body=body)

    async def _other_answer(self, other: OtherSide, path: str, body: bytes, request_id: str) -> tuple[str | None, str]:
        """The other version's text for the recorded request, sent as recorded (streamed if it was)."""
        headers = {"content-type": "application/json", "x-request-id": f"{request_id}:judge"}
        if other.pin:
            headers[VERSION_HEADER] = other.version
        if other.api_key:
            headers["authorization"] = f"Bearer {other.api_key}"
        try:
            async with self.session.post(
                other.url.rstrip("/") + path,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.judge.timeout_s),
            ) as response:
                if not 200 <= response.status < 300:
                    return None, f"{other.url} answered HTTP {response.status}"
                if response.headers.get("content-type", "").startswith("text/event-stream"):
                    reader = EventData()
                    events: list[bytes] = []
                    async for chunk in response.content.iter_any():
                        events += reader.feed(chunk)
                    if (last := reader.rest()) is not None:
                        events.append(last)
                    answer = HttpAnswer(status=response.status, events=tuple(events))
                else:
                    answer = HttpAnswer(status=response.status, body=await response.read())
        except (aiohttp.ClientError, TimeoutError) as error:
            return None, f"{other.url}: {type(error).__name__}: {error}"
        text = read_text("chat", answer).text
        return (text, "") if text else (None, f"{other.url} answered no text")

    async def _ask(self, prompt: str) -> tuple[str, dict[str, int]]:
        """The judge's raw answer and token usage; retried on 429/5xx/connection errors with backoff."""
        request: dict[str, Any] = {
            "model": self.judge.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
        }
        if self.judge.max_tokens is not None:
            request["max_tokens"] = self.judge.max_tokens
        headers = {"authorization": f"Bearer {self.judge.api_key}"} if self.judge.api_key else {}
        url = self.judge.url.rstrip("/") + "/chat/completions"
        why = ""
        for attempt in range(self.judge.retries + 1):
            wait_s = self.judge.backoff_s * 2**attempt * (0.5 + random.random())
            self.budget.judge_calls += 1
            try:
                async with self.session.post(
                    url, json=request, headers=headers, timeout=aiohttp.ClientTimeout(total=self.judge.timeout_s)
                ) as response:
                    if response.status in _RETRIED_STATUSES:
                        why = f"HTTP {response.status}"
                        wait_s = _retry_after(response.headers.get("retry-after"), wait_s)
                    elif response.status != 200:
                        raise JudgeFailed(
                            f"the judge at {url} answered HTTP {response.status}: {await response.text()}"
                        )
                    else:
                        raw, spent = _completion(await _read_bounded(response, url))
                        self.budget.spent += spent["prompt_tokens"] + spent["completion_tokens"]
                        return raw, spent
            except (aiohttp.ClientConnectionError, TimeoutError) as error:
                why = f"{type(error).__name__}: {error}"
            except (ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError) as error:
                shown = " ".join(str(error).split())[:200]
                raise JudgeFailed(f"the judge at {url} answered no chat completion: {shown}") from None
            if attempt < self.judge.retries:
                self.budget.retries += 1
                await asyncio.sleep(wait_s)
        raise JudgeFailed(f"the judge at {url} failed {self.judge.retries + 1} times, last: {why}")


def _shadow_of(record: Any, version: str) -> Any | None:
    """The other version's answer recorded with the call (a shadow that answered OK), None when there is none."""
    for shadow in record.shadows:
        if shadow.version == version and shadow.status_code == 0 and shadow.HasField("response"):
            return shadow
    return None


def _text_of(message: oip.ModelInferRequest | oip.ModelInferResponse, name: str) -> str | None:
    """The BYTES tensor ``name``'s elements joined and decoded (UTF-8, bad bytes as U+FFFD); None without it."""
    try:
        arrays = (
            tensors.input_arrays(message)
            if isinstance(message, oip.ModelInferRequest)
            else tensors.output_arrays(message)
        )
    except Exception:  # InvalidInput: contents that do not decode are no text to judge
        return None
    if name not in arrays:
        return None
    return b"".join(bytes(item) for item in arrays[name].reshape(-1)).decode(errors="replace")


async def _read_bounded(response: aiohttp.ClientResponse, url: str) -> bytes:
    """The answer's body; JudgeFailed past :data:`MAX_JUDGE_ANSWER_BYTES` (read no further)."""
    too_large = f"the judge at {url} answered more than {MAX_JUDGE_ANSWER_BYTES >> 20} MiB: larger than any verdict"
    if (response.content_length or 0) > MAX_JUDGE_ANSWER_BYTES:
        raise JudgeFailed(too_large)
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > MAX_JUDGE_ANSWER_BYTES:
            raise JudgeFailed(too_large)
    return bytes(body)


def _completion(body: bytes) -> tuple[str, dict[str, int]]:
    """The raw answer and token usage of an OpenAI chat completion; ValueError, KeyError, TypeError or
    AttributeError when ``body`` is not one."""
    reply = json.loads(body)
    raw = reply["choices"][0]["message"].get("content") or ""
    usage = reply.get("usage") or {}
    return str(raw), {k: int(usage.get(k, 0)) for k in ("prompt_tokens", "completion_tokens")}


def _retry_after(value: str | None, default_s: float) -> float:
    """Seconds from a ``Retry-After`` of delta-seconds, at most 60 (an HTTP date is rare from APIs, and NaN or an
    infinity is no delay at all: the backoff then; a NaN given to asyncio.sleep would wait on unrelated timers)."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return default_s
    return min(max(seconds, 0.0), 60.0) if math.isfinite(seconds) else default_s


def now_ns() -> int:
    return time.time_ns()
