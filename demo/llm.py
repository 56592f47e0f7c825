"""``make demo-llm``: token streams through the router, recorded, then replayed against v2, in seconds.

1. Count the two n-gram language models (v1 bigram, v2 trigram) from the demo corpus, export them to ONNX.
2. Start redis-server, the recorder, a generating worker per version and the router (file registry, 50/50).
3. Simulated users (sticky routing keys) open chat-like streams (``ModelStreamInfer``); every stream is
   recorded as one record with its requests, responses and their timing.
4. ``splitstream analyze``: per arm the tokens in and out, TTFT p50/p99 and the cost per call at a price per
   version (v2, the larger model, priced at twice v1), with verdicts on ``ttft_ms`` and ``cost``.
5. Replay the window against v2 (through the router, pinned) and write the HTML report. Then the streams v1
   wrote again, against v2 with v1 itself as the control (``--noise-from v1``): the noise floor, per text and
   per token position.
6. The OpenAI act: the router's HTTP port (``--http-port``, OpenAI's API) serves chat users calling it with
   ``openai.AsyncOpenAI`` (``user=`` set: the split is sticky by user), streamed with usage; each answer is
   rated (a thumbs-up more likely the more real words it has: v2's trigram writes more) and the rating
   reported with ``POST /v1/feedback`` under the chat's id; ``splitstream analyze`` then gives the verdict on
   ``thumbs_up`` with TTFT, tokens and cost per arm.
7. ``splitstream judge`` of the chats: each recorded request answered by the other version too, both answers
   judged pairwise in random order by the demo's judge (:mod:`demo.judge`, a stated rule standing in for a
   judge model, which the demo cannot download), for a judged win rate of v2 over v1.
8. Print TTFT and inter-token gaps per version, as the users saw them, the analysis, how the texts agree
   on replay (streams v2 wrote come back token for token; those v1 wrote diverge, and the report shows
   where), then the OpenAI act's chats and its verdict.

Greedy decoding, so each version's text is a function of the prompt. Everything it starts is stopped at the
end, on an error or on Ctrl-C; a second run starts afresh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
from grpc import aio

from demo import chat, judge, language
from demo.processes import Supervisor, free_port, fresh_workdir, interruptible, stepper, write_registry
from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import feedback_key, stream_key

MODEL = "chat"
#: ``splitstream analyze --price`` per version, per million tokens in and out: v2, the larger model, costs twice.
PRICES = ("v1=0.15/1M-in,0.60/1M-out", "v2=0.30/1M-in,1.20/1M-out")
PROMPTS = (
    "Hello! Can you tell me a story? ",
    "What is the best way to learn a language? ",
    "Why do the stars shine at night? ",
    "Write me a short poem about the sea. ",
    "How do I bake bread at home? ",
    "What should I see in the old town? ",
    "Tell me something about the king. ",
    "Is it going to rain tomorrow? ",
    "Give me three ideas for dinner. ",
    "What is the meaning of this word? ",
    "Explain how a ship stays afloat. ",
    "Who wrote the first great novel? ",
)


@dataclass
class Observed:
    """What the simulated users saw, per served version (client clock)."""

    streams: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ttft_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    gaps_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: int = 0


def stream_request(prompt: str, max_tokens: int, request_id: str) -> oip.ModelInferRequest:
    """A request as clients of TensorRT-LLM's Triton ensemble send it: ``text_input`` and ``max_tokens``."""
    request = oip.ModelInferRequest(model_name=MODEL, id=request_id)
    for name, array in (
        ("text_input", np.array([[prompt.encode()]], dtype=np.object_)),
        ("max_tokens", np.array([[max_tokens]], dtype=np.int32)),
    ):
        request.inputs.add(name=name, datatype=tensors.datatype_of(array), shape=list(array.shape))
        request.raw_input_contents.append(tensors.to_raw(array))
    return request


async def users(address: str, *, streams: int, users: int, tokens: int, concurrency: int, seed: int) -> Observed:
    """``streams`` conversations from ``users`` sticky keys, ``concurrency`` at a time."""
    observed = Observed()
    chooser = random.Random(seed)
    plan = [(f"user-{chooser.randrange(users)}", chooser.choice(PROMPTS)) for _ in range(streams)]
    queue = list(enumerate(plan))
    async with aio.insecure_channel(address) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def one_user() -> None:
            while queue:
                index, (user, prompt) = queue.pop(0)
                started = time.perf_counter()
                call = stub.ModelStreamInfer(
                    iter([stream_request(prompt, tokens, f"chat-{index}")]),
                    metadata=(("x-routing-key", user),),
                    timeout=30,
                )
                times = []
                try:
                    async for response in call:
                        if response.infer_response.outputs:
                            times.append(time.perf_counter() - started)
                except aio.AioRpcError:
                    observed.errors += 1
                    continue
                version = dict(await call.trailing_metadata() or ()).get("x-splitstream-version", "?")
                observed.streams[str(version)] += 1
                observed.tokens[str(version)] += len(times)
                if times:
                    observed.ttft_s[str(version)].append(times[0])
                    observed.gaps_s[str(version)] += list(np.diff(times))

        await asyncio.gather(*(one_user() for _ in range(concurrency)))
    return observed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="demo-llm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, default=Path(".demo-llm"), help="where models, logs and reports go")
    parser.add_argument("--streams", type=int, default=40, help="streams the simulated users open")
    parser.add_argument("--users", type=int, default=200, help="simulated users (sticky routing keys)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens each stream asks for")
    parser.add_argument("--concurrency", type=int, default=4, help="streams open at once")
    parser.add_argument("--replay-speed", default="1", help="the replay's --speed (1: as recorded)")
    parser.add_argument("--chat-users", type=int, default=200, help="users of the OpenAI act (HTTP, openai client)")
    parser.add_argument("--chats-per-user", type=int, default=2, help="questions each chat user asks in turn")
    parser.add_argument("--chat-tokens", type=int, default=24, help="tokens each chat answer asks for")
    parser.add_argument("--chat-concurrency", type=int, default=16, help="chat users at once")
    parser.add_argument("--judge-pairs", type=int, default=120, help="recorded chats `splitstream judge` judges")
    args = parser.parse_args(argv)
    summary = interruptible(lambda: run(args))
    if summary is None:
        return 130
    print_summary(summary)
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = fresh_workdir(args.workdir)
    step = stepper()
    step("counting the language models: v1 bigram, v2 trigram")
    language.write_versions(workdir / "models", MODEL)
    # From a file, not the command line, where every local user could read it (ps).
    hmac_key_file = workdir / "hmac-key"
    hmac_key_file.touch(mode=0o600)
    hmac_key_file.write_text(secrets.token_hex(16) + "\n")
    with Supervisor(workdir) as supervisor:
        step("starting redis-server, recorder, generating workers v1 and v2, router (50/50)")
        redis_url = supervisor.start_redis()
        recorder = supervisor.start_recorder(redis_url, "--hmac-key-file", str(hmac_key_file), wait=False)
        models = workdir / "models"
        workers = {version: supervisor.start_worker(models, MODEL, version, wait=False) for version in language.ORDERS}
        supervisor.wait_started()  # the router's health watch finds both workers serving from its start
        experiment = {
            "salt": "demo-llm",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        }
        registry = write_registry(workdir, MODEL, workers, experiment)
        http_port = free_port()
        router = supervisor.start_router(
            registry, recorder, "--hmac-key-file", str(hmac_key_file), "--http-port", str(http_port)
        )

        since = time.time()
        step(f"{args.streams} chat streams from {args.users} users, {args.tokens} tokens each")
        observed = asyncio.run(
            users(
                router,
                streams=args.streams,
                users=args.users,
                tokens=args.tokens,
                concurrency=args.concurrency,
                seed=1,
            )
        )
        until = time.time()
        recorded = _wait_entries(redis_url, stream_key(MODEL), args.streams - observed.errors)

        step("tokens, TTFT and cost per arm with `splitstream analyze` (verdicts on ttft_ms and cost)")
        analysis_dir = workdir / "analysis"
        analysis = supervisor.run(
            "analyze",
            [
                "splitstream",
                *("analyze", MODEL, "--redis-url", redis_url, "--since", f"{since - 1:.3f}"),
                *("--metric", "ttft_ms", "--metric", "cost", "--price", PRICES[0], "--price", PRICES[1]),
                *("--output-dir", str(analysis_dir)),
            ],
            timeout_s=300,
            log="analysis",
        )

        step(f"replaying the streams against v2 (router, pinned; speed {args.replay_speed}) and writing the report")
        replay_dir = workdir / "replay"
        replay_summary = supervisor.replay(
            redis_url,
            MODEL,
            replay_dir,
            *("--since", f"{since - 1:.3f}", "--until", f"{until:.3f}"),
            *("--target", router, "--pin-version", "v2", "--speed", args.replay_speed, "--concurrency", "8"),
            timeout_s=300,
        )
        window = ("--since", f"{since - 1:.3f}", "--until", f"{until:.3f}")
        noise = _noise_floor(supervisor, step, redis_url, router, workdir, window)
        chats_since = time.time()
        chats, chat_analysis = _openai_act(args, supervisor, step, redis_url, http_port, workdir)
        chat_window = ("--since", f"{chats_since:.3f}", "--until", f"{time.time():.3f}")
        judged = _judged(supervisor, step, redis_url, http_port, workdir, chat_window, args.judge_pairs)
        step("stopping everything")

    summary = {
        "users": _users_table(observed),
        "errors": observed.errors,
        "streams_sent": sum(observed.streams.values()) + observed.errors,
        "recorded": recorded,
        "replay": replay_summary.get("streams"),
        "noise": noise,
        "judge": judged,
        "analysis": _analysis(json.loads((analysis_dir / "analysis.json").read_text())),
        "analysis_table": analysis.stdout,
        "analysis_report": str(analysis_dir / "analysis.html"),
        "report": str(replay_dir / "report.html"),
        "logs": str(workdir / "logs"),
        "openai": chats,
        "openai_analysis": chat_analysis,
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _noise_floor(
    supervisor: Supervisor,
    step: Callable[[str], None],
    redis_url: str,
    router: str,
    workdir: Path,
    window: tuple[str, ...],
) -> dict[str, Any]:
    """The streams v1 wrote, replayed against v2 with v1 itself as the control (``--noise-from v1``): what v1
    shows against its own recording is the floor, per text and per token position, and v2 is judged against
    it. v1's streams only: against a stream v2 wrote, v1 would differ by being another model, not by noise."""
    step("the noise floor: v1's streams replayed against v2, and against v1 itself (--noise-from v1)")
    out = workdir / "noise"
    summary = supervisor.replay(
        redis_url,
        MODEL,
        out,
        *window,
        *("--version", "v1", "--target", router, "--pin-version", "v2", "--noise-from", "v1"),
        *("--noise-min-calls", "5", "--speed", "max", "--concurrency", "8"),
        timeout_s=300,
    )
    text = summary["noise"]["fields"].get("text", {})
    return {
        "calls": text.get("calls", 0),
        "control_rate": text.get("control_rate"),
        "candidate_rate": text.get("candidate_rate"),
        "above_noise": text.get("above_noise"),
        "positions": len(text.get("positions") or []),
        "positions_above": text.get("positions_above") or [],
        "diff_above_noise_rate": summary["metrics"]["diff_above_noise_rate"],
        "report": str(out / "report.html"),
    }


def _judged(
    supervisor: Supervisor,
    step: Callable[[str], None],
    redis_url: str,
    http_port: int,
    workdir: Path,
    window: tuple[str, ...],
    pairs: int,
) -> dict[str, Any]:
    """``splitstream judge`` of the OpenAI act's recorded chats (the first ``pairs``): each request sent again to
    the other version (pinned, at the router's HTTP port; its seed makes the other answer what that version
    would have said) and both answers shown, in random order, to the demo's own judge (:mod:`demo.judge`, a
    rule, not a model: nothing is downloaded)."""
    judge_port = free_port()
    supervisor.start("demo-judge", ["python", "-m", "demo.judge", "--port", str(judge_port)])
    _wait_http(f"http://127.0.0.1:{judge_port}/v1/models")
    step(f"judging {pairs} recorded chats pairwise with `splitstream judge` (demo judge: {judge.RULE})")
    out = workdir / "judge"
    supervisor.run(
        "judge",
        [
            "splitstream",
            *("judge", MODEL, "--redis-url", redis_url, *window, "--version", "v1", "--other-version", "v2"),
            *("--target", f"http://127.0.0.1:{http_port}", "--max-pairs", str(pairs)),
            *("--judge-url", f"http://127.0.0.1:{judge_port}/v1", "--judge-model", "demo-judge"),
            *("--output-dir", str(out)),
        ],
        timeout_s=300,
    )
    supervisor.stop("demo-judge")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "rule": judge.RULE,
        "pairs": summary["counts"].get("judged", 0),
        "by_version": summary["by_version"],
        "position": summary["position"],
        "pairs_file": str(out / "pairs.jsonl"),
    }


def _wait_http(url: str, timeout_s: float = 30.0) -> None:
    """Until ``url`` answers 200 (a process that serves HTTP only has no gRPC health to wait on)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout_s}s") from None
        time.sleep(0.1)


def _openai_act(
    args: argparse.Namespace,
    supervisor: Supervisor,
    step: Callable[[str], None],
    redis_url: str,
    http_port: int,
    workdir: Path,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Chat users over the router's HTTP port with OpenAI's client, each answer rated and the rating reported
    with ``POST /v1/feedback``; then ``splitstream analyze`` of that window: thumbs-up, TTFT, tokens, cost."""
    chats_wanted = args.chat_users * args.chats_per_user
    step(
        f"the OpenAI act: {args.chat_users} chat users x {args.chats_per_user} streamed chats over HTTP "
        f"(openai.AsyncOpenAI, user=..., include_usage), each answer's thumbs-up or not sent to POST /v1/feedback"
    )
    since = time.time()
    chats = asyncio.run(
        chat.chat_users(
            f"http://127.0.0.1:{http_port}",
            MODEL,
            chat.vocabulary(language.corpus()),
            users=args.chat_users,
            chats_per_user=args.chats_per_user,
            max_tokens=args.chat_tokens,
            concurrency=args.chat_concurrency,
            seed=2,
        )
    )
    until = time.time()
    served = sum(chats.chats.values())
    recorded = _wait_http_records(redis_url, int(since * 1e9), served)
    feedback = _wait_entries(redis_url, feedback_key(MODEL), chats.feedback_accepted)

    step("thumbs-up, TTFT, tokens and cost per arm of the chats with `splitstream analyze`")
    analysis_dir = workdir / "openai-analysis"
    analysis = supervisor.run(
        "analyze-openai",
        [
            "splitstream",
            *("analyze", MODEL, "--redis-url", redis_url, "--since", f"{since:.3f}", "--until", f"{until + 1:.3f}"),
            *("--metric", f"{chat.THUMBS_UP}:rate", "--metric", "ttft_ms", "--metric", "cost"),
            *("--price", PRICES[0], "--price", PRICES[1], "--output-dir", str(analysis_dir)),
        ],
        timeout_s=300,
        log="analysis-openai",
    )
    versions = sorted(chats.chats)
    table = {
        version: {
            "users": len(chats.users[version]),
            "chats": chats.chats[version],
            "tokens_in": chats.tokens_in[version],
            "tokens_out": chats.tokens_out[version],
            "ttft_p50_ms": _ms(chats.ttft_s[version], 50),
            "thumbs_up_rate": round(chats.thumbs_up[version] / chats.chats[version], 4),
        }
        for version in versions
    }
    summary = {
        "versions": table,
        "chats_wanted": chats_wanted,
        "chats": served,
        "errors": chats.errors[:10],
        "error_count": len(chats.errors),
        "switched_users": chats.switched_users,
        "feedback_accepted": chats.feedback_accepted,
        "feedback_in_redis": feedback,
        "recorded_http": recorded,
    }
    return summary, {
        **_analysis(json.loads((analysis_dir / "analysis.json").read_text())),
        "table": analysis.stdout,
        "report": str(analysis_dir / "analysis.html"),
    }


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 3) if values else None


def _users_table(observed: Observed) -> dict[str, dict[str, float | int | None]]:
    return {
        version: {
            "streams": observed.streams[version],
            "tokens": observed.tokens[version],
            "ttft_p50_ms": _ms(observed.ttft_s[version], 50),
            "ttft_p99_ms": _ms(observed.ttft_s[version], 99),
            "itl_p50_ms": _ms(observed.gaps_s[version], 50),
            "itl_p99_ms": _ms(observed.gaps_s[version], 99),
        }
        for version in sorted(observed.streams)
    }


def _analysis(document: dict[str, Any]) -> dict[str, Any]:
    """Per arm of the analysis's 50/50 phase: tokens in and out, TTFT and cost; and the verdict lines."""
    keys = ("generations", "tokens_in", "tokens_out", "ttft_p50_ms", "ttft_p99_ms", "cost_per_call", "price")
    arms = {arm["arm"]: {key: arm[key] for key in keys} for phase in document["phases"] for arm in phase["arms"]}
    return {"arms": arms, "verdicts": document["verdicts"]}


def _wait_entries(redis_url: str, key: str, expected: int, timeout_s: float = 20.0) -> int:
    """Entries of the stream ``key`` in Redis once the router's last batches landed (or what is there after
    ``timeout_s``)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            count = int(client.xlen(key))
            if count >= expected or time.monotonic() > deadline:
                return count
            time.sleep(0.1)
    finally:
        client.close()


def _wait_http_records(redis_url: str, since_ns: int, expected: int, timeout_s: float = 20.0) -> dict[str, int]:
    """Per version, the HTTP calls recorded from ``since_ns`` on (the calls stream also holds the gRPC streams
    and their replay), once ``expected`` of them landed or ``timeout_s`` passed."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            versions: dict[str, int] = defaultdict(int)
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(stream_key(MODEL)))
            for _, fields in entries:
                if int(fields[b"time_ns"]) < since_ns:
                    continue
                record = recorder_pb2.CallRecord.FromString(fields[b"record"])
                if record.HasField("http"):
                    versions[record.version] += 1
            if sum(versions.values()) >= expected or time.monotonic() > deadline:
                return dict(sorted(versions.items()))
            time.sleep(0.1)
    finally:
        client.close()


def _fmt(value: object) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def print_summary(summary: dict[str, Any]) -> None:
    print("\nsplitstream demo-llm: chat streams, v1 (bigram, control) vs v2 (trigram), 50/50\n")
    print("as the users saw them (ms):")
    print(f"{'version':<8} {'streams':>7} {'tokens':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for version, row in summary["users"].items():
        print(
            f"{version:<8} {row['streams']:>7} {row['tokens']:>7} {_fmt(row['ttft_p50_ms']):>9} "
            f"{_fmt(row['ttft_p99_ms']):>9} {_fmt(row['itl_p50_ms']):>8} {_fmt(row['itl_p99_ms']):>8}"
        )
    print(
        f"streams sent {summary['streams_sent']}, client errors {summary['errors']}, records in Redis "
        f"{summary['recorded']}"
    )
    print("\nsplitstream analyze: tokens, TTFT (router clock) and cost per arm, v2 against v1\n")
    print(summary["analysis_table"])
    streams = summary["replay"]
    if not streams:
        print("\nreplay: no stream was replayed")
    else:
        print("\nreplayed against v2, by the version that answered when recorded:")
        print(
            f"{'recorded':<9} {'streams':>7} {'exact':>6} {'match':>7} {'edit dist':>9} {'1st diff p50':>12} "
            f"{'TTFT p50 ms rec/replay':>23} {'ITL p50 ms rec/replay':>22}"
        )
        for version, group in streams["versions"].items():
            rate = group["token_match_rate"]
            ttft, itl = group["ttft"], group["itl"]
            print(
                f"{version:<9} {group['streams']:>7} {group['exact_matches']:>6} "
                f"{'-' if rate is None else f'{rate:.0%}':>7} {_fmt(group['mean_edit_distance']):>9} "
                f"{_fmt(group['first_divergence_p50']):>12} "
                f"{_fmt(ttft['reference']['p50_ms']) + ' / ' + _fmt(ttft['candidate']['p50_ms']):>23} "
                f"{_fmt(itl['reference']['p50_ms']) + ' / ' + _fmt(itl['candidate']['p50_ms']):>22}"
            )
        print(
            "(greedy decoding: v2's own streams come back token for token; v1's diverge where the bigram's "
            "text leaves the trigram's)"
        )
    print_noise(summary["noise"])
    print_openai_act(summary["openai"], summary["openai_analysis"])
    print_judged(summary["judge"])
    print(f"\nreport:   {summary['report']}")
    print(f"analysis: {summary['analysis_report']}")
    print(f"          {summary['openai_analysis']['report']}")
    print(f"logs:     {summary['logs']}")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _positions(positions: list[int]) -> str:
    """``0-5, 9`` for [0, 1, 2, 3, 4, 5, 9]."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and position == runs[-1][-1] + 1:
            runs[-1].append(position)
        else:
            runs.append([position])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "none"


def print_noise(noise: dict[str, Any]) -> None:
    """The noise floor of v2 over v1 in one line."""
    verdicts = {True: "above the noise", False: "within the noise", None: "floor not trusted yet"}
    verdict = verdicts[noise["above_noise"]]
    print(
        f"\nnoise floor (v1's {noise['calls']} streams; control: v1 against itself, --noise-from v1): texts that "
        f"differ from the recording: v1 {_percent(noise['control_rate'])}, v2 {_percent(noise['candidate_rate'])}; "
        f"token positions above the floor: {_positions(noise['positions_above'])} of {noise['positions']}; "
        f"v2 {verdict}"
    )


def print_judged(judged: dict[str, Any]) -> None:
    """The judged win rate of v2 over v1, with its interval and the position check."""
    v1, v2 = judged["by_version"]["v1"], judged["by_version"]["v2"]
    interval = v2["preference_interval"]
    shown = f"[{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "(no interval: fewer than two users)"
    position = judged["position"]
    print(
        f"\njudged win rate (splitstream judge, {judged['pairs']} of the chats, order random): v2 preferred "
        f"{v2['preference']:.2f} {shown}, wins {v2['win_rate']:.0%} / ties {v2['tie_rate']:.0%} / losses "
        f"{v2['loss_rate']:.0%}; v1 preferred {v1['preference']:.2f}; the answer shown first won "
        f"{position['first_won']} of {position['decided']}"
    )
    print(f"(the demo's judge: {judged['rule']})")


def print_openai_act(chats: dict[str, Any], analysis: dict[str, Any]) -> None:
    """The OpenAI act in a few lines: who chatted with which version, what they rated, then the verdicts."""
    print(
        "\nthe OpenAI act: chat users over HTTP with openai.AsyncOpenAI (streamed, include_usage), split by user=, "
        "each answer's thumbs-up (1) or not (0) sent to POST /v1/feedback"
    )
    print(
        f"{'version':<8} {'users':>6} {'chats':>6} {'tokens in':>9} {'tokens out':>10} {'TTFT p50':>9} {'thumbs-up':>9}"
    )
    for version, row in chats["versions"].items():
        print(
            f"{version:<8} {row['users']:>6} {row['chats']:>6} {row['tokens_in']:>9} {row['tokens_out']:>10} "
            f"{_fmt(row['ttft_p50_ms']):>9} {row['thumbs_up_rate']:>9.1%}"
        )
    print(
        f"chats {chats['chats']} of {chats['chats_wanted']}, client errors {chats['error_count']}, users served by "
        f"two versions {chats['switched_users']}, feedback accepted {chats['feedback_accepted']}, HTTP calls recorded "
        f"{sum(chats['recorded_http'].values())} ({', '.join(f'{v} {n}' for v, n in chats['recorded_http'].items())})"
    )
    print("(a thumbs-up is as likely as the answer's share of real words: v2's trigram writes more of them)")
    print(
        "\nsplitstream analyze: thumbs-up, TTFT (router clock), tokens and cost per arm of the chats, v2 against v1\n"
    )
    print(analysis["table"])


if __name__ == "__main__":
    sys.exit(main())
