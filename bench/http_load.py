"""OpenAI chat load for the HTTP benchmarks: closed-loop callers over keep-alive connections, latency,
time to first token, tokens, and the CPU of each path's proxy processes.

Each caller sends the same body bytes (no per-call encoding in the client) and reads the answer without
parsing it: a whole answer is read to its end, a stream chunk by chunk, its first token (``bench/
openai_standin.py``'s ``PIECE``) noted as it arrives and its tokens counted once it ended. So the client's
own cost stays small and equal across the paths a benchmark compares.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import cpu_seconds, rotated
from bench.openai_standin import PIECE

TOKEN = PIECE.encode()


def chat_body(model: str, *, stream: bool, max_tokens: int = 16) -> bytes:
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, as they are now (a server's workers, the router's shipper)."""
    found, queue = [pid], [pid]
    while queue:
        children = subprocess.run(["pgrep", "-P", str(queue.pop())], capture_output=True, text=True).stdout.split()
        found.extend(int(child) for child in children)
        queue.extend(int(child) for child in children)
    return found


@dataclass
class HttpPath:
    """One way to the upstream: a base URL (``.../v1``) and the processes whose CPU is the path's cost."""

    name: str
    base_url: str
    pids: list[int] = field(default_factory=list)
    #: Processes whose CPU counts in the path's but is also shown apart (the router's child shipper).
    apart: list[int] = field(default_factory=list)

    @property
    def all_pids(self) -> list[int]:
        return self.pids + self.apart


@dataclass
class HttpResult:
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    apart_cpu_s: float = 0.0
    errors: int = 0


@dataclass
class HttpSummary:
    """A path's rounds merged."""

    rate: float  # calls/s
    tokens_rate: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    cpu_us_per_call: float
    cpu_us_per_token: float
    apart_us_per_call: float
    calls: int
    errors: int

    @classmethod
    def of(cls, results: list[HttpResult]) -> HttpSummary:
        latencies = [x for r in results for x in r.latencies_s]
        ttfts = [x for r in results for x in r.ttfts_s]
        wall = sum(r.wall_s for r in results) or float("nan")
        cpu = sum(r.cpu_s for r in results)
        tokens = sum(r.tokens for r in results)
        return cls(
            rate=len(latencies) / wall,
            tokens_rate=tokens / wall,
            p50_ms=_ms(latencies, 50),
            p99_ms=_ms(latencies, 99),
            ttft_p50_ms=_ms(ttfts, 50),
            ttft_p99_ms=_ms(ttfts, 99),
            cpu_us_per_call=cpu / len(latencies) * 1e6 if latencies else float("nan"),
            cpu_us_per_token=cpu / tokens * 1e6 if tokens else float("nan"),
            apart_us_per_call=sum(r.apart_cpu_s for r in results) / len(latencies) * 1e6 if latencies else float("nan"),
            calls=len(latencies),
            errors=sum(r.errors for r in results),
        )


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


async def call(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], into: HttpResult
) -> None:
    """One chat call, whole or streamed (as ``body`` asks), its times added to ``into``."""
    start = time.perf_counter()
    first = 0.0
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.headers.get("Content-Type", "").startswith("text/event-stream"):
                received = bytearray()
                async for chunk in response.content.iter_any():
                    received += chunk
                    if not first and TOKEN in received[-len(chunk) - len(TOKEN) :]:
                        first = time.perf_counter()
                answer = bytes(received)
            else:
                answer = await response.read()
            ok = response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        ok, answer = False, b""
    end = time.perf_counter()
    if not ok or TOKEN not in answer:
        into.errors += 1
        return
    into.latencies_s.append(end - start)
    if first:
        into.ttfts_s.append(first - start)
        into.tokens += answer.count(TOKEN)


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60), auto_decompress=False
    )


async def _warm(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], n: int) -> None:
    """``n`` calls at once, then 20 one after the other: connections open, the path's caches warm."""
    scratch = HttpResult()
    await asyncio.gather(*(call(session, url, body, headers, scratch) for _ in range(n)))
    for _ in range(20):
        await call(session, url, body, headers, scratch)


async def alternate(
    paths: list[HttpPath], body: bytes, headers: dict[str, str], seconds: float
) -> dict[str, HttpResult]:
    """One call in flight, the paths taken in turn call by call (each cycle in a rotated order), for ``seconds``
    in all. Why: measured in blocks of seconds, two identical paths differ by more than the hop itself costs on a
    shared machine as the neighbours' load drifts; taken in turn, every path sees the same moments. CPU: each
    path's processes over the run, per call of that path (their idle work while the others are called counts
    alike for all)."""
    results = {path.name: HttpResult() for path in paths}
    sessions = {path.name: _session() for path in paths}
    urls = {path.name: path.base_url + "/chat/completions" for path in paths}
    try:
        for path in paths:
            await _warm(sessions[path.name], urls[path.name], body, headers, 1)
        cpu_before = {path.name: (cpu_seconds(path.all_pids), cpu_seconds(path.apart)) for path in paths}
        started = time.perf_counter()
        stop_at = started + seconds
        names, cycle = [path.name for path in paths], 0
        while time.perf_counter() < stop_at:
            for name in rotated(names, cycle):
                await call(sessions[name], urls[name], body, headers, results[name])
            cycle += 1
        wall = time.perf_counter() - started
        for path in paths:
            result = results[path.name]
            result.cpu_s = cpu_seconds(path.all_pids) - cpu_before[path.name][0]
            result.apart_cpu_s = cpu_seconds(path.apart) - cpu_before[path.name][1]
            result.wall_s = wall / len(paths)  # each path had a share of the time
    finally:
        for session in sessions.values():
            await session.close()
    return results


async def block(path: HttpPath, body: bytes, headers: dict[str, str], concurrency: int, seconds: float) -> HttpResult:
    """``concurrency`` closed-loop callers on one path for ``seconds``."""
    result = HttpResult()
    url = path.base_url + "/chat/completions"
    async with _session() as session:
        await _warm(session, url, body, headers, concurrency)
        cpu_before, apart_before = cpu_seconds(path.all_pids), cpu_seconds(path.apart)
        started = time.perf_counter()
        stop_at = started + seconds

        async def loop() -> None:
            while time.perf_counter() < stop_at:
                await call(session, url, body, headers, result)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - started
        result.cpu_s = cpu_seconds(path.all_pids) - cpu_before
        result.apart_cpu_s = cpu_seconds(path.apart) - apart_before
    return result


def measure(
    paths: list[HttpPath],
    body: bytes,
    headers: dict[str, str],
    *,
    concurrency: int,
    seconds: float,
    rounds: int,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, HttpSummary]:
    """Every path ``rounds`` times: at one in flight taken in turn call by call (``seconds`` per path and
    round), else each for ``seconds`` in turn, in a rotated order each round; each path's rounds merged."""
    merged: dict[str, list[HttpResult]] = {path.name: [] for path in paths}
    for round_index in range(rounds):
        progress(f"round {round_index + 1}/{rounds}")
        if concurrency == 1:
            for name, result in asyncio.run(alternate(paths, body, headers, seconds * len(paths))).items():
                merged[name].append(result)
            continue
        by_name = {path.name: path for path in paths}
        for name in rotated(list(by_name), round_index):
            merged[name].append(asyncio.run(block(by_name[name], body, headers, concurrency, seconds)))
    return {name: HttpSummary.of(results) for name, results in merged.items()}


def load_note() -> str:
    """The machine's load average and cores, printed with every table: the figures move with it."""
    one, five, fifteen = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {one:.2f} {five:.2f} {fifteen:.2f}"
