"""``splitstream judge MODEL``: recorded chat calls of a window judged pairwise against another version.

Not ``rollout --judge`` (the canary judge of a rollout's metrics): this asks a judge *model* which of two
answers to one prompt is better (:mod:`splitstream.admin.pairwise`), writes each pair and a summary
(:mod:`splitstream.admin.pairwise_stats`), and, with ``--feedback-router``, each verdict as a feedback
event on the recorded call, so ``splitstream analyze --metric judge:rate`` reads it as it reads clicks.

Exit codes: 0 done; 1 the judge, the other version or Redis failed (what was judged before is written);
2 usage error (one line naming the flag).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import grpc
from redis.exceptions import RedisError

from splitstream.admin import feedback_import
from splitstream.admin.pairwise import (
    DEFAULT_RUBRIC,
    Budget,
    JudgeFailed,
    JudgeSettings,
    Judging,
    OtherSide,
    check_rubric,
    cut_torn_line,
    load_cache,
)
from splitstream.admin.pairwise_stats import Judged, position_summary, version_summary
from splitstream.common.addresses import check_address
from splitstream.common.errors import ConfigError
from splitstream.common.feedback import METRIC_PATTERN
from splitstream.common.files import atomic_write
from splitstream.common.proto.splitstream.v1 import feedback_pb2, feedback_pb2_grpc
from splitstream.common.redis_settings import redis_security_from_args
from splitstream.common.redis_url import open_redis
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.timewindow import BadTime, parse_instant_ns
from splitstream.common.tls import client_tls_from_args
from splitstream.replayer.http_calls import check_http_target
from splitstream.replayer.selection import Selection, SelectionStats, StatusFilter, select_calls

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
PROG = "splitstream judge"


class Usage(ValueError):
    """A flag that cannot be used; the message starts with the flag."""


def _positive(name: str, value: float | None, *, integer: bool = True) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise Usage(f"{name}: must be {'an integer' if integer else 'a number'} > 0, got {value}")


def _key(path: str, variable: str, flag: str) -> str:
    if not path:
        return os.environ.get(variable, "")
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise Usage(f"{flag} {path}: {getattr(error, 'strerror', None) or error}") from None


def _settings(args: argparse.Namespace) -> tuple[Selection, JudgeSettings, dict[str, OtherSide]]:
    now = time.time_ns()
    try:
        since, until = parse_instant_ns(args.since, now_ns=now), parse_instant_ns(args.until, now_ns=now)
    except BadTime as error:
        raise Usage(f"--since/--until: {error}") from None
    for name in ("max_pairs", "max_tokens", "judge_max_tokens", "concurrency"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    _positive("--timeout-s", args.timeout_s, integer=False)
    if args.retries < 0 or not (math.isfinite(args.backoff_s) and args.backoff_s >= 0):
        raise Usage("--retries/--backoff-s: must not be negative")
    if not 0 < args.alpha < 1:
        raise Usage(f"--alpha: must be within (0, 1), got {args.alpha}")
    if args.version == args.other_version:
        raise Usage("--other-version: must differ from --version")
    if bool(args.target) == bool(args.other_target):
        raise Usage("--target: give one of --target (a router, pinned) and --other-target")
    for flag, url in (
        ("--target", args.target),
        ("--other-target", args.other_target),
        ("--judge-url", args.judge_url),
    ):
        if url:
            try:
                check_http_target(url)
            except ValueError as error:
                raise Usage(f"{flag}: {error}") from None
    if args.grpc_target:
        if not args.target:
            raise Usage("--grpc-target: needs --target (both versions behind one router)")
        try:
            check_address(args.grpc_target)
        except ValueError as error:
            raise Usage(f"--grpc-target: {error}") from None
    if not METRIC_PATTERN.fullmatch(args.metric):
        raise Usage(f"--metric: {args.metric!r} is not a metric name (letters, digits and _ . : -)")
    if args.feedback_router:
        try:
            check_address(args.feedback_router)
        except ValueError as error:
            raise Usage(f"--feedback-router: {error}") from None
    rubric = DEFAULT_RUBRIC
    if args.rubric:
        try:
            rubric = Path(args.rubric).read_text(encoding="utf-8")
            check_rubric(rubric)
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise Usage(f"--rubric {args.rubric}: {getattr(error, 'strerror', None) or error}") from None
    try:
        selection = Selection(
            models=(args.model,),
            since_ns=since,
            until_ns=until,
            versions=frozenset({args.version, args.other_version} if args.target else {args.version}),
            statuses=StatusFilter(ok=True),
            sample=args.sample,
            sample_seed=args.seed,
        )
    except ValueError as error:
        raise Usage(str(error)) from None
    target_key = _key(args.api_key_file, "SPLITSTREAM_JUDGE_TARGET_API_KEY", "--api-key-file")
    judge = JudgeSettings(
        url=args.judge_url,
        model=args.judge_model,
        api_key=_key(args.judge_api_key_file, "SPLITSTREAM_JUDGE_API_KEY", "--judge-api-key-file"),
        rubric=rubric,
        max_tokens=args.judge_max_tokens,
        retries=args.retries,
        backoff_s=args.backoff_s,
        timeout_s=args.timeout_s,
    )
    if args.target:
        others = {
            args.version: OtherSide(url=args.target, version=args.other_version, pin=True, api_key=target_key),
            args.other_version: OtherSide(url=args.target, version=args.version, pin=True, api_key=target_key),
        }
    else:
        others = {
            args.version: OtherSide(url=args.other_target, version=args.other_version, pin=False, api_key=target_key)
        }
    return selection, judge, others


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        selection, judge, others = _settings(args)
        security = redis_security_from_args(args, url=args.redis_url, env_prefix=args.redis_env_prefix)
        tls = client_tls_from_args(args, flag="--tls")
    except (Usage, ConfigError) as error:
        print(f"{PROG}: error: {error}", file=err)
        return EXIT_USAGE
    output = Path(args.output_dir)
    cache_path = Path(args.cache) if args.cache else output / "cache.jsonl"
    try:
        output.mkdir(parents=True, exist_ok=True)
        cache_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"{PROG}: error: --output-dir {output}: {error.strerror}", file=err)
        return EXIT_USAGE
    try:
        pairs, judging = asyncio.run(_judge_all(args, selection, judge, others, security, cache_path, output, tls))
    except Usage as error:
        print(f"{PROG}: error: {error}", file=err)
        return EXIT_USAGE
    except (JudgeFailed, RedisError, OSError) as error:
        print(
            f"{PROG}: error: {redact_text(str(error))} (pairs judged so far are in {output / 'pairs.jsonl'})", file=err
        )
        return EXIT_FAILED
    summary = summarize(pairs, judging, args)
    if args.feedback_router:
        try:
            summary["feedback"] = send_feedback(pairs, args, tls)
        except feedback_import.RouterFailed as error:
            print(f"{PROG}: error: --feedback-router {args.feedback_router}: {error}", file=err)
            atomic_write(output / "summary.json", json.dumps(summary, indent=2) + "\n")
            return EXIT_FAILED
    atomic_write(output / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(render(summary), file=out)
    return EXIT_OK


async def _judge_all(
    args: argparse.Namespace,
    selection: Selection,
    judge: JudgeSettings,
    others: dict[str, OtherSide],
    security: Any,
    cache_path: Path,
    output: Path,
    tls: Any,
) -> tuple[list[dict[str, Any]], Judging]:
    try:
        redis = open_redis(args.redis_url, security=security, socket_connect_timeout=5, socket_timeout=30)
    except ValueError as error:  # the flag's value, not a Redis that failed: a usage error
        raise Usage(f"bad --redis-url {redact_url(args.redis_url)!r}: {redact_text(str(error))}") from None
    pairs: list[dict[str, Any]] = []
    cache = load_cache(cache_path)
    cut_torn_line(cache_path)
    with (
        (output / "pairs.jsonl").open("w", encoding="utf-8") as results,
        cache_path.open("a", encoding="utf-8") as cached,
    ):

        def write(pair: dict[str, Any]) -> None:
            line = json.dumps(pair, sort_keys=True)
            results.write(line + "\n")
            results.flush()
            if pair.get("cache_key") and pair["cache_key"] not in cache:
                cache[pair["cache_key"]] = pair
                cached.write(line + "\n")
                cached.flush()

        async with aiohttp.ClientSession() as session:
            judging = Judging(
                session=session,
                redis=redis,
                judge=judge,
                others=others,
                seed=args.seed,
                cache=cache,
                write_pair=write,
                budget=Budget(args.max_tokens),
            )
            if args.grpc_target:
                judging.grpc_channel = tls.aio_channel(args.grpc_target)
                judging.grpc_key = others[args.version].api_key
            slots = asyncio.Semaphore(args.concurrency)
            tasks: list[asyncio.Task[None]] = []

            async def one(call: Any) -> None:
                try:
                    pair = await judging.pair(call)
                    if pair is not None:
                        write(pair)
                        if "error" not in pair:
                            pairs.append(pair)
                finally:
                    slots.release()

            stats = SelectionStats()
            try:
                async for call in select_calls(redis, selection, stats):
                    if args.max_pairs is not None and len(tasks) >= args.max_pairs:
                        break
                    record = call.record
                    if record.HasField("http") and record.http.api != "chat":
                        judging.count("not_http_chat")
                        continue
                    if not judging.answerable(record):  # counted before a slot: --max-pairs counts pairs
                        judging.count("no_grpc_target")
                        continue
                    await slots.acquire()
                    tasks.append(asyncio.create_task(one(call)))
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await redis.aclose()
                if judging.grpc_channel is not None:
                    await judging.grpc_channel.close()
    judging.counts["selected"] = stats.selected
    return pairs, judging


def summarize(pairs: list[dict[str, Any]], judging: Judging, args: argparse.Namespace) -> dict[str, Any]:
    """The summary.json: counts, per-version win/tie/loss with intervals, and the position check."""
    a, b = args.version, args.other_version
    judged = [
        Judged(
            score=0 if pair["winner"] == "tie" else (1 if pair["winner"] == a else -1),
            cluster=pair["routing_key_hmac"] or "call:" + pair["request_id"],
            a_first=pair["order"]["A"] == a,
        )
        for pair in pairs
        if pair.get("winner") is not None
    ]
    return {
        "model": args.model,
        "judge_model": args.judge_model,
        "versions": [a, b],
        "alpha": args.alpha,
        "interval": "cluster-robust (by user) t interval, users - 1 df, of the preference (wins + ties/2) / pairs",
        "counts": dict(sorted(judging.counts.items())),
        "unparsed": sum(1 for pair in pairs if pair.get("verdict") is None),
        "judge_calls": judging.budget.judge_calls,
        "judge_retries": judging.budget.retries,
        "judge_tokens": judging.budget.spent,
        "by_version": {
            a: version_summary(judged, sign=1, alpha=args.alpha),
            b: version_summary(judged, sign=-1, alpha=args.alpha),
        },
        "position": position_summary(judged),
    }


def send_feedback(pairs: list[dict[str, Any]], args: argparse.Namespace, tls: Any) -> dict[str, int]:
    """Each verdict as a feedback event on the recorded call: 1 when its version's answer won, else 0 (a tie
    is no win), a millisecond after the call was received, with an idempotency key per pair so a re-run
    counts once."""
    rows: list[feedback_import.Row] = []
    for pair in pairs:
        if pair.get("winner") is None:
            continue
        event = feedback_pb2.FeedbackEvent(
            model=args.model,
            request_id=pair["request_id"],
            metric=args.metric,
            value=1.0 if pair["winner"] == pair["recorded_version"] else 0.0,
            event_unix_ns=int(pair["receive_unix_ns"]) + 1_000_000,
            idempotency_key=f"pairwise:{pair['cache_key'][:32]}",
        )
        rows.append(feedback_import.Row(line=len(rows) + 1, event=event))
    accepted = rejected = 0
    key = _key(args.api_key_file, "SPLITSTREAM_JUDGE_TARGET_API_KEY", "--api-key-file")
    metadata = (("x-api-key", key),) if key else ()
    with tls.channel(args.feedback_router) as channel:
        stub = feedback_pb2_grpc.FeedbackStub(channel)
        for start in range(0, len(rows), feedback_import.MAX_BATCH):
            request = feedback_pb2.FeedbackReport(
                events=[row.event for row in rows[start : start + feedback_import.MAX_BATCH]]
            )
            reply = _report(stub, request, metadata, args.timeout_s)
            accepted += reply.accepted
            rejected += len(reply.rejected)
    return {"events": len(rows), "accepted": accepted, "rejected": rejected}


def _report(
    stub: feedback_pb2_grpc.FeedbackStub,
    request: feedback_pb2.FeedbackReport,
    metadata: tuple[tuple[str, str], ...],
    timeout_s: float,
) -> feedback_pb2.FeedbackReply:
    """One report, with the key the router wants; a full queue or a router briefly away is tried again."""
    delay_s = 0.5
    for attempt in range(6):
        try:
            reply: feedback_pb2.FeedbackReply = stub.Report(request, timeout=timeout_s, metadata=metadata)
            return reply
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            if code not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) or attempt == 5:
                raise feedback_import.RouterFailed(f"{code.name}: {details}") from None
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 4.0)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render(summary: dict[str, Any]) -> str:
    """The report printed at the end: one line per version, then the position check."""
    level = round(100 * (1 - summary["alpha"]))
    lines = [f"{summary['model']}: judged by {summary['judge_model']}; counts {summary['counts']}"]
    lines.append(
        f"{'version':<12} {'pairs':>5} {'win':>6} {'tie':>6} {'loss':>6} {'pref':>6}  {level}% interval (by user)"
    )
    for version, row in summary["by_version"].items():
        interval = row["preference_interval"]
        shown = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "-"
        lines.append(
            f"{version:<12} {row['pairs']:>5} {_rate(row['win_rate']):>6} {_rate(row['tie_rate']):>6} "
            f"{_rate(row['loss_rate']):>6} {_rate(row['preference']):>6}  {shown}"
        )
    position = summary["position"]
    lines.append(
        f"position: the answer shown first won {position['first_won']} of {position['decided']} decided pairs "
        f"({_rate(position['first_win_rate'])}); unparsed verdicts {summary['unparsed']}; judge calls "
        f"{summary['judge_calls']} ({summary['judge_retries']} retries), tokens {summary['judge_tokens']}"
    )
    if "feedback" in summary:
        fb = summary["feedback"]
        lines.append(f"feedback: {fb['events']} events, {fb['accepted']} accepted, {fb['rejected']} rejected")
    return "\n".join(lines)
