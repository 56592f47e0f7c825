"""``splitstream-replay``: re-send a recorded window to a router or a worker, diff the answers, gate CI.

Exit codes: 0 done (and the gate, if any, passed); 1 the gate failed (the failed bounds are
listed on stderr; with no completed call a gate always fails: there is nothing to pass on);
2 a usage or setup error, one line on stderr (bad time, ``--until`` not after ``--since``,
unknown model, Redis or a target unreachable, an output directory or summary that cannot be
written, Redis or the archive failing mid-read: the partial results are written first); 130
interrupted by Ctrl-C (SIGINT) or SIGTERM, after writing the partial results, summary and report.
1 means only "the gate failed", so CI can tell a verdict from a broken run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from splitstream.common.addresses import check_address
from splitstream.common.argv_secrets import give_warnings
from splitstream.common.cli import EnvArgumentParser, fail
from splitstream.common.durations import parse_duration_ns
from splitstream.common.errors import ConfigError
from splitstream.common.headers import header_value
from splitstream.common.records import recorded_models, routing_key_hmac, stream_key
from splitstream.common.redis_settings import (
    NO_REDIS_SECURITY,
    RedisSecurity,
    add_redis_security_arguments,
    redis_security_from_args,
)
from splitstream.common.redis_url import RedisClient, open_redis
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.timewindow import BadTime, join_relative_times, parse_instant_ns
from splitstream.common.tls import ClientTls, client_tls_from_args
from splitstream.replayer.compare import Tolerance
from splitstream.replayer.gate import Bound, evaluate, parse_gate
from splitstream.replayer.http_calls import TargetRefused, check_http_target, is_http_target
from splitstream.replayer.noise import CONFIDENCE, DEFAULT_MIN_CALLS, DEFAULT_QUANTILE, NoiseSettings
from splitstream.replayer.outputs import ResultsWriter, write_summary
from splitstream.replayer.report import write_report
from splitstream.replayer.runner import Replay, ReplaySettings
from splitstream.replayer.selection import Selection, StatusFilter
from splitstream.replayer.sender import Target, TargetUnreachable
from splitstream.replayer.summary import METRICS, NEEDS_GRPC_TARGET, NEEDS_HTTP_TARGET, REQUEST_NOT_RECORDED, Summary

if TYPE_CHECKING:
    from splitstream.common.archive import Archive
    from splitstream.replayer.http_sender import HttpTarget

PROG = "splitstream-replay"
EXIT_GATE_FAILED = 1
EXIT_INTERRUPTED = 130


class SetupError(Exception):
    """Something outside the command line is wrong (Redis, a target, a model): exit 2 with one line."""


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    redis_url: str
    #: ``--source archive:URL``: the archive's URL, and Redis is not used at all.
    source_archive: str
    #: ``--archive URL``: where calls older than Redis's retention are read from.
    archive: str
    s3_endpoint: str
    selection: Selection
    settings: ReplaySettings
    tls: ClientTls
    gate: tuple[Bound, ...] | None
    connect_timeout_s: float
    redis_security: RedisSecurity = NO_REDIS_SECURITY


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog=PROG,
        env_prefix="SPLITSTREAM_REPLAY_",
        description=(
            "Re-send recorded calls (selected by the time the router received them) to a router or a worker, "
            "open loop at the recorded pace or faster, compare every answer with the recorded one (or with a "
            "second target), and write results.jsonl, summary.json and report.html. Exit 0: done; 1: --gate "
            "failed; 2: usage or setup error; 130: interrupted (partial outputs written)."
        ),
    )
    source = parser.add_argument_group("source and selection")
    source.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the recorder's Redis", secret=True)
    add_redis_security_arguments(source)
    source.add_argument(
        "--source",
        default="redis",
        help="where calls are read: redis (older parts of the window from --archive, if set), or archive:URL "
        "(only the archive written by splitstream-archive: a directory, s3://bucket/prefix, ...)",
    )
    source.add_argument(
        "--archive",
        default="",
        help="the archive behind Redis: a window older than the stream's oldest entry is read from it, one "
        "straddling both from both (de-duplicated)",
    )
    source.add_argument(
        "--s3-endpoint", default="", help="endpoint of an S3-compatible archive store: http://host:port"
    )
    source.add_argument(
        "--model", action="append", required=True, help="model to replay (repeat or comma-separate for several)"
    )
    source.add_argument(
        "--since",
        required=True,
        help="window start, by router receive time: ISO-8601 with timezone, -15m/-2h/-1d, epoch seconds, or now",
    )
    source.add_argument("--until", default="now", help="window end (exclusive), same forms as --since")
    source.add_argument("--version", action="append", default=[], help="only calls the version answered (repeatable)")
    statuses = source.add_mutually_exclusive_group()
    statuses.add_argument(
        "--status",
        default="",
        help="only calls that ended so: ok, error, or gRPC codes (INVALID_ARGUMENT,14), comma-separated",
    )
    statuses.add_argument("--errors-only", action="store_true", help="only calls that failed (same as --status error)")
    source.add_argument(
        "--routing-key",
        action="append",
        default=[],
        help="only calls with this routing key (matched through its HMAC; repeatable)",
    )
    source.add_argument(
        "--principal",
        action="append",
        default=[],
        help="only calls made by this authenticated caller (the router's principal name; repeatable)",
    )
    source.add_argument(
        "--hmac-key",
        default="",
        help="the deployment's routing-key HMAC key; else SPLITSTREAM_HMAC_KEY",
        secret=True,
        file_flag="--hmac-key-file",
    )
    source.add_argument(
        "--sample", type=float, default=1.0, help="replay this fraction of the calls (fixed per request id)"
    )
    source.add_argument("--seed", type=int, default=0, help="seed of --sample's choice")
    source.add_argument("--limit", type=int, default=None, help="replay at most this many calls (the earliest)")
    source.add_argument(
        "--max-lateness",
        default="1h",
        help="how long after the router received a call its record may reach Redis (spooled during an outage)",
    )
    source.add_argument("--clock-skew", default="5s", help="allowed clock difference between routers and Redis")
    source.add_argument(
        "--reorder-buffer",
        type=int,
        default=100_000,
        help="calls held to restore receive-time order; past it a late call may go out of order (counted)",
    )
    source.add_argument(
        "--reorder-buffer-mb",
        type=float,
        default=256.0,
        help="the same cap in MiB of records (inline payloads included)",
    )
    source.add_argument(
        "--page-size",
        type=int,
        default=200,
        help="stream entries per XRANGE page (small pages keep each parse short, so sends stay on time)",
    )

    target = parser.add_argument_group("targets")
    target.add_argument(
        "--target",
        required=True,
        help="host:port of a router or a worker (gRPC: the window's gRPC calls are replayed), or "
        "http(s)://host:port of a router's HTTP port, a version or an OpenAI-compatible server (the window's "
        "HTTP calls are replayed); calls of the other kind are counted as not replayed",
    )
    target.add_argument(
        "--compare-to",
        default="",
        help="a second target of the same kind; its answers become the reference",
    )
    target.add_argument("--pin-version", default="", help="send x-splitstream-version: V (a router then serves V)")
    noise = target.add_mutually_exclusive_group()
    noise.add_argument(
        "--noise-from",
        default="",
        metavar="VERSION",
        help="also send each call to --target pinned to VERSION (a second pass of the control): its differences "
        "from the reference set a noise floor per output, and the candidate's are judged above or within it",
    )
    noise.add_argument(
        "--noise-target",
        default="",
        metavar="ADDR",
        help="the same with a second instance of the control at ADDR (same kind as --target)",
    )
    target.add_argument(
        "--noise-quantile",
        type=float,
        default=DEFAULT_QUANTILE,
        help="quantile of the control's absolute differences taken as an output's floor",
    )
    target.add_argument(
        "--noise-min-calls",
        type=int,
        default=DEFAULT_MIN_CALLS,
        help="control pairs an output needs before its floor is trusted (and judged)",
    )
    target.add_argument(
        "--noise-confidence",
        type=float,
        default=CONFIDENCE,
        help="confidence for the run that a field judged above the noise is: a control against itself flags "
        "a field in at most 1 - this of runs (split over the fields, Bonferroni)",
    )
    target.add_argument("--tls", action="store_true", help="TLS to the targets")
    target.add_argument("--tls-ca", default="", help="PEM CA bundle (default: the system's)")
    target.add_argument("--tls-cert", default="", help="PEM client certificate (mutual TLS)")
    target.add_argument("--tls-key", default="", help="PEM client key (mutual TLS)")
    target.add_argument("--tls-server-name", default="", help="expected server name, if not the target's host")
    target.add_argument(
        "--connect-timeout-s", type=float, default=5.0, help="how long Redis and targets get to answer at start"
    )
    target.add_argument(
        "--timeout-s",
        type=float,
        default=10.0,
        help="deadline of each replayed call (of a token stream: the whole stream)",
    )
    target.add_argument("--id-suffix", default=":replay", help="replayed x-request-id = recorded id + this suffix")
    target.add_argument(
        "--no-forward-metadata",
        action="store_true",
        help="do not re-send the recorded request metadata (ids, pins and masked values never are)",
    )
    target.add_argument(
        "--api-key-file",
        default="",
        help="file holding the replayer's own API key, sent on every call (gRPC: x-api-key; HTTP: "
        "Authorization: Bearer), for a target that authenticates callers; recorded credentials are then never "
        "re-sent. Without it, the key in the environment variable SPLITSTREAM_REPLAY_API_KEY, if set",
    )
    target.add_argument(
        "--drop-user",
        action="store_true",
        help="leave the body's user out of replayed HTTP calls (it is recorded as hmac:..., not as sent: "
        "re-sent, it routes and is billed as a user of its own)",
    )

    timing = parser.add_argument_group("timing (open loop)")
    timing.add_argument(
        "--speed", default="1", help="1: the recorded gaps; 4: four times faster; max: as fast as --concurrency allows"
    )
    timing.add_argument("--concurrency", type=int, default=64, help="calls in flight at most (per target)")
    timing.add_argument(
        "--sender-nice",
        type=int,
        default=-10,
        help="niceness of the sending thread, so it wakes on time on a busy machine (needs CAP_SYS_NICE "
        "to go below 0; without it the default stays); 0 leaves it alone",
    )

    comparing = parser.add_argument_group("comparison and outputs")
    comparing.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance for float outputs")
    comparing.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance for float outputs")
    comparing.add_argument("--top-k", type=int, default=5, help="k of the top-k agreement of class-score outputs")
    comparing.add_argument(
        "--output-dir", default="replay-out", help="where results.jsonl, summary.json, report.html go"
    )
    comparing.add_argument(
        "--no-progress", action="store_true", help="no progress bar (it is off anyway without a terminal)"
    )
    comparing.add_argument(
        "--gate",
        default="",
        help="bounds that fail the run (exit 1), e.g. 'mismatch_rate<=0.01,p99_ratio<=1.2,error_rate<=0.001'; "
        f"metrics: {', '.join(METRICS)}",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> ReplayConfig:
    parser = build_parser()
    args = parser.parse_args(join_relative_times(sys.argv[1:] if argv is None else list(argv)))
    now_ns = time.time_ns()
    try:
        models = tuple(dict.fromkeys(m.strip() for spec in args.model for m in spec.split(",") if m.strip()))
        since_ns = parse_instant_ns(args.since, now_ns=now_ns)
        until_ns = parse_instant_ns(args.until, now_ns=now_ns)
        if until_ns <= since_ns:
            raise ValueError(f"--until ({args.until}) must be after --since ({args.since})")
        statuses = (
            StatusFilter(any_error=True)
            if args.errors_only
            else (StatusFilter.parse(args.status) if args.status else None)
        )
        hmacs: frozenset[str] = frozenset()
        if args.routing_key:
            key = args.hmac_key or os.environ.get("SPLITSTREAM_HMAC_KEY", "")
            if not key:
                raise ValueError("--routing-key needs --hmac-key (or SPLITSTREAM_HMAC_KEY): records hold only its HMAC")
            hmacs = frozenset(routing_key_hmac(key.encode(), routing_key) for routing_key in args.routing_key)
        selection = Selection(
            models=models,
            since_ns=since_ns,
            until_ns=until_ns,
            versions=frozenset(args.version),
            statuses=statuses,
            routing_key_hmacs=hmacs,
            principals=frozenset(args.principal),
            sample=args.sample,
            sample_seed=args.seed,
            limit=args.limit,
            max_lateness_ns=parse_duration_ns(args.max_lateness),
            clock_skew_ns=parse_duration_ns(args.clock_skew),
            reorder_capacity=args.reorder_buffer,
            reorder_max_bytes=_mebibytes("--reorder-buffer-mb", args.reorder_buffer_mb),
            page_size=args.page_size,
        )
        speed = _speed(args.speed)
        # The same client TLS (and checks: readable PEM, a key that is the certificate's) as every client.
        tls = client_tls_from_args(args, flag="--tls")
        if args.pin_version != header_value(args.pin_version):
            # A version name is the registry's, never a client's: one gRPC would refuse is a typo, not a pin.
            raise ValueError(f"--pin-version {args.pin_version!r} is not a version name (printable ASCII, no %)")
        targets = (args.target,) + ((args.compare_to,) if args.compare_to else ())
        noise = _noise_settings(args)
        if noise is not None:
            targets += (args.noise_target or args.target,)
        http = is_http_target(args.target)
        for address in targets:
            if is_http_target(address) != http:
                flag = "--noise-target" if address == args.noise_target else "--compare-to"
                raise ValueError(
                    f"--target {args.target!r} and {flag} {address!r} must both be gRPC (host:port) "
                    "or both HTTP (http(s)://host:port)"
                )
            if http:
                check_http_target(address)
                continue
            try:
                check_address(address)
            except ValueError:
                raise ValueError(
                    f"bad target {address!r} (expected host:port, port 1..65535, unix:PATH, or http(s)://host:port)"
                ) from None
        settings = ReplaySettings(
            targets=targets,
            speed=speed,
            concurrency=args.concurrency,
            timeout_s=args.timeout_s,
            pin_version=args.pin_version,
            id_suffix=args.id_suffix,
            forward_metadata=not args.no_forward_metadata,
            tolerance=Tolerance(rtol=args.rtol, atol=args.atol, top_k=args.top_k),
            output_dir=Path(args.output_dir),
            progress=not args.no_progress,
            sender_nice=args.sender_nice,
            credentials=_credentials(args.api_key_file, http=http),
            drop_user=args.drop_user,
            noise=noise,
            noise_pin=args.noise_from,
        )
        gate = parse_gate(args.gate) if args.gate else None
        source = args.source.strip()
        if source != "redis" and not source.startswith("archive:"):
            raise ValueError(f"bad --source {source!r} (expected redis or archive:URL)")
        source_archive = source.removeprefix("archive:") if source != "redis" else ""
        for url in (source_archive, args.archive):
            if url:
                from splitstream.common.archive import ArchiveError, open_archive

                try:
                    open_archive(url, endpoint=args.s3_endpoint)
                except ArchiveError as error:
                    raise ValueError(str(error)) from None
        if not 0 < args.connect_timeout_s < math.inf:
            raise ValueError("--connect-timeout-s must be a positive number of seconds")
        redis_security = redis_security_from_args(args, url=args.redis_url, env_prefix=parser.env_prefix)
    except (BadTime, ValueError, ConfigError) as error:
        parser.error(str(error))
    return ReplayConfig(
        redis_url=args.redis_url,
        source_archive=source_archive,
        archive=args.archive,
        s3_endpoint=args.s3_endpoint,
        selection=selection,
        settings=settings,
        tls=tls,
        gate=gate,
        connect_timeout_s=args.connect_timeout_s,
        redis_security=redis_security,
    )


#: The replayer's own API key, when no --api-key-file names one: an environment variable, never a flag, so the
#: key is in no process listing.
API_KEY_VARIABLE = "SPLITSTREAM_REPLAY_API_KEY"


def _credentials(path: str, *, http: bool) -> tuple[tuple[str, str], ...]:
    """The credential header from ``path``, else from :data:`API_KEY_VARIABLE` (none without either):
    ``x-api-key`` to a gRPC target, ``Authorization: Bearer`` to an HTTP one (the header OpenAI's clients
    send). ValueError naming the flag or the variable, never the key."""
    if path:
        where = f"--api-key-file {path}"
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else "cannot be read as text"
            raise ValueError(f"{where}: {reason}") from None
    elif os.environ.get(API_KEY_VARIABLE, ""):  # set but empty reads as not set, as shells unset with VAR=
        where = API_KEY_VARIABLE
        key = os.environ[API_KEY_VARIABLE].strip()
    else:
        return ()
    if not key or not key.isascii() or not key.isprintable():
        raise ValueError(f"{where}: the key must be one line of printable ASCII")
    return (("authorization", f"Bearer {key}"),) if http else (("x-api-key", key),)


def _noise_settings(args: argparse.Namespace) -> NoiseSettings | None:
    """The noise floor's settings, None without ``--noise-from`` or ``--noise-target``."""
    if args.noise_from and args.noise_from != header_value(args.noise_from):
        raise ValueError(f"--noise-from {args.noise_from!r} is not a version name (printable ASCII, no %)")
    control = f"{args.noise_from} at --target" if args.noise_from else args.noise_target
    settings = NoiseSettings(  # checks its numbers, with the noise floor on or off
        control=control,
        quantile=args.noise_quantile,
        min_calls=args.noise_min_calls,
        confidence=args.noise_confidence,
    )
    return settings if args.noise_from or args.noise_target else None


def _mebibytes(flag: str, mib: float) -> int:
    if not 0 < mib < math.inf:
        raise ValueError(f"{flag} must be a positive number of MiB")
    return int(mib * 1024 * 1024)


def _speed(text: str) -> float | None:
    if text.strip().lower() == "max":
        return None
    try:
        speed = float(text.rstrip("xX"))
    except ValueError:
        raise ValueError(f"bad --speed {text!r} (a positive number such as 1 or 4, or max)") from None
    if not speed > 0 or speed == float("inf"):
        raise ValueError(f"bad --speed {text!r} (a positive number such as 1 or 4, or max)")
    return speed


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        code = asyncio.run(run(config))
        if code == 0:
            give_warnings()  # after the replay: a failed one's error line stays the only line
        return code
    except SetupError as error:
        fail(PROG, str(error))
    except KeyboardInterrupt:  # before the replay installed its own handler: nothing to write yet
        print(f"{PROG}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


async def run(config: ReplayConfig) -> int:
    archive = await _open_archive(config)
    redis = None if config.source_archive else await _open_redis(config)
    targets: list[Target | HttpTarget] = []
    try:
        try:
            if redis is not None:
                await _check_models(redis, config.selection.models, archive=archive)
            elif archive is not None:  # --source archive:URL
                await _check_archived_models(archive, config.selection.models)
        except RedisError as error:  # answered PING, refuses the rest (ACLs, a replica loading, ...)
            raise SetupError(f"Redis at {redact_url(config.redis_url)} failed: {redact_text(str(error))}") from None
        for address in config.settings.targets:
            target: Target | HttpTarget
            try:
                if is_http_target(address):
                    # aiohttp: an HTTP replay's, imported here, before the signal handlers are installed.
                    from splitstream.replayer.http_sender import HttpTarget

                    target = HttpTarget(address, tls=config.tls, concurrency=config.settings.concurrency)
                else:
                    target = Target(address, tls=config.tls)
            except OSError as error:  # a TLS file that cannot be read (permissions, gone since parsing)
                raise SetupError(f"cannot read a TLS file: {_os_reason(error)}") from None
            except ConfigError as error:  # the same, as the shared TLS module words it (names the flag)
                raise SetupError(f"cannot read a TLS file: {error}") from None
            targets.append(target)
            try:
                if isinstance(target, Target):
                    await asyncio.to_thread(target.wait_ready, config.connect_timeout_s)
                else:
                    probe = config.settings.credentials
                    await asyncio.to_thread(target.wait_ready, config.connect_timeout_s, probe)
            except (TargetUnreachable, TargetRefused) as error:
                raise SetupError(str(error)) from None
        results = _open_results(config.settings.output_dir)
        archive_errors = _archive_errors(archive)
        replay = Replay(redis, config.selection, config.settings, targets, archive=archive, archive_only=redis is None)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, replay.stop)
        source_failure = None
        try:
            await replay.run(results)
        except archive_errors as error:
            source_failure = f"the archive failed while reading: {error}"
        except RedisError as error:
            source_failure = f"Redis failed while reading: {redact_text(str(error))}"
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
        if source_failure is not None:
            # The source broke mid-read: still write what finished (flagged partial), and exit 2 like any other
            # broken run: not 130 (nobody pressed Ctrl-C) and not 1 (there is no verdict on a cut window).
            replay.interrupted = True
        return finish(replay, config, source_failure=source_failure)
    finally:
        for target in targets:
            target.close()
        if redis is not None:
            await redis.aclose()


def finish(replay: Replay, config: ReplayConfig, *, source_failure: str | None = None) -> int:
    """Write summary.json and report.html, print the outcome, and choose the exit code (``source_failure``:
    why reading the window stopped short, an exit 2 once the partial outputs are written)."""
    summary = replay.summary()
    if config.gate is not None:
        summary = summary.model_copy(update={"gate": evaluate(config.gate, summary.metrics)})
    output_dir = config.settings.output_dir
    try:
        write_summary(output_dir / "summary.json", summary)
        write_report(output_dir / "report.html", summary, replay.histograms())
    except OSError as error:
        # results.jsonl is complete by now; a disk that filled up (or a directory removed) mid-run is
        # the environment's fault, not a gate verdict: exit 2 with one line, never a traceback.
        raise SetupError(f"cannot write the summary or report in {output_dir}: {_os_reason(error)}") from None
    print(_one_line(summary, output_dir))
    if source_failure is not None:
        fail(PROG, f"{source_failure}; partial results written to {output_dir}")
    if replay.interrupted:
        print(f"{PROG}: interrupted; partial results written to {output_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if summary.gate is not None and not summary.gate.passed:
        print(f"{PROG}: gate failed: " + "; ".join(summary.gate.failures), file=sys.stderr)
        return EXIT_GATE_FAILED
    if summary.gate is not None:
        print(f"{PROG}: gate passed: " + ", ".join(str(b) for b in config.gate or ()))
    return 0


def _one_line(summary: Summary, output_dir: Path) -> str:
    counts = summary.counts
    outcomes = summary.outcomes
    lag = summary.send_lag
    lag_text = f", send lag p50 {lag.p50_ms} ms p99 {lag.p99_ms} ms" if lag else ""
    rate = summary.metrics.mismatch_rate
    rate_text = "not measured" if rate is None else f"{rate:.2%}"
    errors_text = f", {counts.send_errors} not sent (send errors)" if counts.send_errors else ""
    not_compared = f", {outcomes.not_compared} not compared (response not recorded)" if outcomes.not_compared else ""
    errors_text += not_compared + "".join(
        f", {count} not replayed ({_NOT_REPLAYED_WHY.get(why, why)})" for why, count in counts.not_replayed.items()
    )
    return (
        f"replayed {counts.completed} of {counts.selected} selected calls: {outcomes.match} match, "
        f"{outcomes.mismatch} mismatch, {outcomes.status_change} status change{errors_text} "
        f"(mismatch rate {rate_text}){lag_text}; outputs in {output_dir}/"
    )


#: How the one-line outcome says why calls were not replayed.
_NOT_REPLAYED_WHY = {
    REQUEST_NOT_RECORDED: "request not recorded",
    NEEDS_HTTP_TARGET: "HTTP calls: they need an http(s):// target",
    NEEDS_GRPC_TARGET: "gRPC calls: they need a host:port target",
}


def _open_results(output_dir: Path) -> ResultsWriter:
    """Create ``--output-dir`` and open its results.jsonl; SetupError (exit 2, one line) when either fails:
    a path under a file, a file in the way, no permission, a read-only disk."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        return ResultsWriter(output_dir / "results.jsonl")
    except OSError as error:
        raise SetupError(f"cannot write --output-dir {str(output_dir)!r}: {_os_reason(error)}") from None


def _os_reason(error: OSError) -> str:
    """``[Errno 20] Not a directory: 'x'`` → ``x: Not a directory`` (the path, then why)."""
    where = error.filename if error.filename is not None else ""
    return f"{where}: {error.strerror}" if where and error.strerror else str(error)


async def _open_redis(config: ReplayConfig) -> RedisClient:
    try:
        redis = open_redis(
            config.redis_url,
            security=config.redis_security,
            socket_connect_timeout=config.connect_timeout_s,
            socket_timeout=max(config.connect_timeout_s, 10.0),
        )
    except ValueError as error:
        raise SetupError(f"bad --redis-url {redact_url(config.redis_url)!r}: {redact_text(str(error))}") from None
    try:
        await redis.ping()
    except (RedisError, OSError) as error:
        await redis.aclose()
        raise SetupError(f"Redis at {redact_url(config.redis_url)} is unreachable: {redact_text(str(error))}") from None
    return redis


def _archive_errors(archive: Archive | None) -> tuple[type[Exception], ...]:
    """What a replay's read raises when its archive fails; nothing without an archive, whose module (pyarrow)
    a replay from Redis alone does without."""
    if archive is None:
        return ()
    from splitstream.common.archive import ArchiveError

    return (ArchiveError,)


async def _open_archive(config: ReplayConfig) -> Archive | None:
    """The archive to read (``--source archive:URL``, else ``--archive``), checked: SetupError when it
    cannot be listed (no such bucket, credentials refused, a directory that does not exist)."""
    url = config.source_archive or config.archive
    if not url:
        return None
    from splitstream.common.archive import ArchiveError, check_archive, open_archive

    try:
        archive = open_archive(url, endpoint=config.s3_endpoint)
        await asyncio.to_thread(check_archive, archive, create=False)
    except ArchiveError as error:
        raise SetupError(str(error)) from None
    return archive


async def _check_models(redis: RedisClient, models: Sequence[str], *, archive: Archive | None = None) -> None:
    """Each model has a stream; with an archive behind Redis, a model may live only there."""
    for model in models:
        kind = await redis.type(stream_key(model))
        if kind in (b"stream", "stream") or (archive is not None and await _archived(archive, model)):
            continue
        known = await recorded_models(redis)
        raise SetupError(
            f"unknown model {model!r}: no stream {stream_key(model)} in Redis "
            f"(recorded models: {', '.join(known) or 'none'})"
            + (f" nor calls in the archive {archive.url!r}" if archive else "")
        )


async def _check_archived_models(archive: Archive, models: Sequence[str]) -> None:
    """Each model has calls in the archive (``--source archive:URL``): a misspelt model was replayed as an
    empty window, exit 0, where Redis's "unknown model" says what is wrong."""
    for model in models:
        if not await _archived(archive, model):
            raise SetupError(f"unknown model {model!r}: no calls of it in the archive {archive.url!r}")


async def _archived(archive: Archive, model: str) -> bool:
    from splitstream.common.archive import ArchiveError, holds_model  # loaded already: the archive was opened

    try:
        return await asyncio.to_thread(holds_model, archive, model)
    except ArchiveError as error:
        raise SetupError(str(error)) from None
