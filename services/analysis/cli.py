"""``splitstream analyze MODEL``: the A/B analysis on the command line (registered by the admin CLI).

Prints a table and one verdict line per metric and arm, and writes ``analysis.json`` and ``analysis.html``
to ``--output-dir``. Exit codes: 0 done (whatever the verdicts); 1 Redis or the archive unreachable or
failing; 2 a usage error (one line on stderr: a bad flag, a bad time, a model with no recorded calls, an
archive URL that names nothing usable or a bucket that does not exist).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
from redis.exceptions import RedisError

from splitstream.analysis import bayes
from splitstream.analysis.analyze import LONGEST_NOVELTY_BUCKET_NS, Query, analyze
from splitstream.analysis.loading import SEGMENT_FIELDS, Source, Window
from splitstream.analysis.model import Analysis, MetricSpec
from splitstream.analysis.noninferiority import Margin
from splitstream.analysis.report import render_html, render_table
from splitstream.analysis.sources import AggregatesSource, ArchiveSource, RedisSource, StraddlingSource
from splitstream.analysis.sql.aggregates import AggregatesError
from splitstream.analysis.sql.aggregation import DIALECTS, aggregation_of, aggregation_query
from splitstream.analysis.statistics import DEFAULT_TUNING_UNITS
from splitstream.analysis.usage import parse_prices
from splitstream.common.archive import CALLS, Archive, ArchiveError, check_archive, model_dirs, open_archive
from splitstream.common.durations import BadDuration, parse_duration_ns
from splitstream.common.errors import ConfigError
from splitstream.common.files import atomic_write
from splitstream.common.records import recorded_models, stream_key
from splitstream.common.redis_url import (
    NO_REDIS_SECURITY,
    RedisSecurity,
    add_redis_security_arguments,
    open_redis,
    redis_security_from_args,
)
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.timewindow import BadTime, parse_instant_ns

#: Flags whose value may be a relative time such as ``-2h`` (see :func:`join_relative_times`).
TIME_FLAGS = ("--since", "--until", "--cuped-pre-since", "--cuped-pre-until")
EXIT_FAILED = 1
EXIT_USAGE = 2
#: The longest --max-lateness and --attribution-window (ten years): times plus these are summed in int64 ns
#: (numpy, Parquet), which 100000000d would overflow (a traceback).
MAX_ALLOWANCE_NS = 3_650 * 86_400 * 10**9
#: Where a window is cut: the time flags take instants up to 9999-12-31, int64 ns end in 2262, and an end
#: past them (--until 9999-12-31T00:00:00Z for "everything") would overflow once lateness and attribution are
#: added. Nothing is recorded so late (this is about 2222), so an end past it reads as "until then".
LAST_INSTANT_NS = 2**63 - 1 - 4 * MAX_ALLOWANCE_NS


class AnalysisFailed(Exception):
    """Redis could not be read (exit 1)."""


class UsageError(Exception):
    """Input that cannot be analysed (exit 2), found after parsing: an unknown model, an unwritable directory."""


def metric_list(text: str) -> list[MetricSpec]:
    """``click:rate`` or ``click:rate,revenue:sum``; ValueError naming the bad one."""
    return [MetricSpec.parse(part) for part in text.split(",") if part.strip()]


class _AppendMetrics(argparse.Action):
    """``--metric`` (repeatable, or comma-separated): flags given replace the environment's list rather than
    extend it (argparse's ``append`` would try to append to the variable's string)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = list(current) if isinstance(current, list) else []
        try:
            items.extend(metric_list(str(values)))
        except ValueError as error:
            parser.error(str(error))
        setattr(namespace, self.dest, items)


class AppendPrices(argparse.Action):
    """``--price`` (repeatable): flags given replace the environment's value rather than extend it."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(current if isinstance(current, list) else []), str(values)])


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _alpha(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"alpha must be between 0 and 1, got {text!r}")
    return value


#: The most units a sizing flag takes: far past any experiment, short of a float's exact integers.
MAX_UNITS = 10**12


def _units(text: str) -> int:
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of units: {text!r}") from None
    if not 2 <= value <= MAX_UNITS:
        raise argparse.ArgumentTypeError(f"must be between 2 and {MAX_UNITS:,} units, got {text!r}")
    return value


def add_command(commands: Any, env_prefix: str) -> None:
    """Add ``analyze`` to the admin CLI's subcommands (``commands`` is argparse's subparsers action)."""
    parser = commands.add_parser(
        "analyze",
        env_prefix=env_prefix,
        help="A/B verdicts per metric from recorded calls and feedback (needs Redis, not the registry)",
        description=(
            "Compare the arms of a model's experiment, phase by phase, on business metrics from feedback, with "
            "latency and errors from the call records. Only randomized calls (hash, random) are compared; pins, "
            "spills and retries are shown apart. Writes analysis.json and analysis.html to --output-dir."
        ),
    )
    parser.add_argument("model")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the recorder's Redis", secret=True)
    add_redis_security_arguments(parser.add_argument_group("Redis TLS and ACL user (see docs/security.md)"))
    parser.set_defaults(redis_env_prefix=env_prefix)
    parser.add_argument(
        "--source",
        default="redis",
        help="where calls and feedback are read: redis (older parts of the window from --archive, if set), or "
        "archive:URL (only the archive written by splitstream-archive: a directory, s3://bucket/prefix, ...)",
    )
    parser.add_argument(
        "--archive",
        default="",
        help="the archive behind Redis: what is older than a stream's oldest entry is read from it, the rest "
        "from Redis (each entry once)",
    )
    parser.add_argument(
        "--s3-endpoint", default="", help="endpoint of an S3-compatible archive store: http://host:port"
    )
    parser.add_argument(
        "--archive-engine",
        default="python",
        help="how --source archive: is aggregated: python (read in pages like Redis) or duckdb (SQL over the "
        "Parquet, the same answers; --segment falls back to python; docs/analysis.md says why not yet the default)",
    )
    parser.add_argument(
        "--print-sql",
        action="store_true",
        help="print the per-unit aggregation query for the archive's tables in --dialect and exit (docs/analysis.md)",
    )
    parser.add_argument("--dialect", default="duckdb", help=f"the SQL dialect of --print-sql: {', '.join(DIALECTS)}")
    parser.add_argument(
        "--aggregates",
        default="",
        metavar="FILE",
        help="run the statistics on per-unit aggregates the --print-sql query produced elsewhere (Parquet or CSV) "
        "instead of reading Redis or the archive",
    )
    parser.add_argument(
        "--segment",
        choices=SEGMENT_FIELDS,
        default=None,
        help="also compare the arms per value of this call field (principal: the authenticated caller)",
    )
    parser.add_argument(
        "--since",
        required=True,
        help="window start, by router receive time (events by their time): ISO-8601 with timezone, -2h, epoch s",
    )
    parser.add_argument("--until", default="now", help="window end (exclusive), same forms as --since")
    parser.add_argument(
        "--metric",
        action=_AppendMetrics,
        required=True,
        help="NAME:KIND[:DIRECTION][:cap=CAP], KIND conversion (units with an event > 0, per unit), rate (calls with "
        "an event > 0, per call; proportion is its old name), mean (per event) or sum (per unit), DIRECTION higher "
        "(the default) or lower: which way is better (repeat, or comma-separate), e.g. buy:conversion, click:rate, "
        "latency_ms:mean:lower; mean and sum take a last :cap=P99 (a percentile of the units pooled over the arms) "
        "or :cap=250 (a value) capping each unit's value",
    )
    parser.add_argument(
        "--price",
        action=AppendPrices,
        default=None,
        help="a version's price per million tokens in and out, VERSION=IN/1M-in,OUT/1M-out (repeat per version, "
        "or comma-join them): each call's cost, per arm and as metric cost; a version without one has no cost",
    )
    parser.add_argument(
        "--unit",
        choices=("user", "call"),
        default="user",
        help="unit of analysis: user (routing-key HMAC; the call when a call has no key) or call",
    )
    parser.add_argument("--alpha", type=_alpha, default=0.05, help="significance level (1 - confidence)")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="always-valid p-values and confidence sequences (mSPRT): safe to check as often as you like",
    )
    parser.add_argument(
        "--sequential-tuning",
        type=_units,
        default=DEFAULT_TUNING_UNITS,
        metavar="N",
        help="units in both arms together at which the confidence sequence is narrowest (GrowthBook's default, "
        "5,000); set it near the size the experiment will reach",
    )
    parser.add_argument(
        "--correction",
        choices=("none", "holm", "bh"),
        default="none",
        help="adjust p-values and intervals over every comparison (metrics x arms x phases, and segments): holm "
        "(any false positive at most alpha) or bh (Benjamini-Hochberg: false discoveries at most alpha of those "
        "declared)",
    )
    parser.add_argument(
        "--non-inferiority",
        default=None,
        metavar="MARGIN",
        help="also test every metric one-sided against a margin on its bad side: relative to the control with %% "
        "(1%%) or absolute in the metric's unit (0.002); says non-inferior, inferior or not shown non-inferior",
    )
    parser.add_argument(
        "--novelty-bucket",
        default="1d",
        metavar="DURATION",
        help="the comparison again per bucket of time since each unit's first exposure, this wide (1d, 6h, 2s): "
        "over the units active in the bucket, on their calls and events of it, to see an effect that fades; off: not",
    )
    parser.add_argument(
        "--planned-units",
        type=_units,
        default=None,
        metavar="N",
        help="units the experiment is planned to reach in total: the minimum detectable effect is also given at "
        "that size, split as now",
    )
    parser.add_argument(
        "--engine",
        choices=bayes.ENGINES,
        default="frequentist",
        help="how verdicts are read: frequentist (p-values and confidence intervals) or bayes (GrowthBook's "
        "Gaussian effect model: chance to beat control, expected loss, credible interval of the lift)",
    )
    parser.add_argument(
        "--prior-mean",
        type=_finite,
        default=0.0,
        help="with --engine bayes and --prior-sd: the prior's mean relative lift (0.05: five percent up)",
    )
    parser.add_argument(
        "--prior-sd",
        type=_finite,
        default=None,
        help="with --engine bayes: a proper normal prior on the relative lift with this standard deviation (0.3: "
        "GrowthBook's suggestion); default a flat prior",
    )
    parser.add_argument(
        "--bayes-threshold",
        type=_finite,
        default=bayes.DEFAULT_THRESHOLD,
        help="with --engine bayes: the chance to beat control at which an arm is better (at 1 - it, worse); "
        "GrowthBook's default 0.95",
    )
    parser.add_argument("--cuped-pre-since", default=None, help="CUPED pre-period start (same forms as --since)")
    parser.add_argument("--cuped-pre-until", default=None, help="CUPED pre-period end (exclusive)")
    parser.add_argument(
        "--max-lateness",
        default="1h",
        help="how long after the window a call's record or an event may reach Redis (spooled in an outage)",
    )
    parser.add_argument(
        "--attribution-window",
        default=None,
        help="how long after --until, and after its call, an event naming a call of the window still counts for "
        "that call (a click an hour after the answer); default: --max-lateness (and never shorter than it, after "
        "the call). Events naming only a user are counted inside the window",
    )
    parser.add_argument("--output-dir", default="analysis-out", help="where analysis.json and analysis.html go")
    parser.add_argument("--connect-timeout-s", type=float, default=5.0, help="Redis connect timeout")


def query_from_args(args: argparse.Namespace, *, now_ns: int | None = None) -> Query:
    """The Query the flags describe; ValueError naming the flag otherwise."""
    now = time.time_ns() if now_ns is None else now_ns
    try:
        lateness = parse_duration_ns(args.max_lateness)
    except BadDuration as error:
        raise ValueError(f"--max-lateness: {error}") from None
    attribution_text = args.attribution_window if args.attribution_window is not None else args.max_lateness
    try:
        attribution = parse_duration_ns(attribution_text)
    except BadDuration as error:
        raise ValueError(f"--attribution-window: {error}") from None
    for flag, allowance in (("--max-lateness", lateness), ("--attribution-window", attribution)):
        if allowance > MAX_ALLOWANCE_NS:
            raise ValueError(f"{flag}: at most {MAX_ALLOWANCE_NS // (86_400 * 10**9)}d")
    since = _instant("--since", args.since, now)
    until = _instant("--until", args.until, now)
    if until <= since:
        raise ValueError("--until must be after --since")
    pre: Window | None = None
    if (args.cuped_pre_since is None) != (args.cuped_pre_until is None):
        raise ValueError("give both --cuped-pre-since and --cuped-pre-until, or neither")
    if args.cuped_pre_since is not None:
        pre_since = _instant("--cuped-pre-since", args.cuped_pre_since, now)
        pre_until = _instant("--cuped-pre-until", args.cuped_pre_until, now)
        if pre_until <= pre_since:
            raise ValueError("--cuped-pre-until must be after --cuped-pre-since")
        if args.unit == "call":
            raise ValueError("--cuped-pre-* needs --unit user: a call has no pre-period")
        pre = Window(pre_since, pre_until, max_lateness_ns=lateness)
    if not 0 < args.connect_timeout_s < math.inf:
        raise ValueError("--connect-timeout-s must be a positive number of seconds")
    metrics = args.metric if isinstance(args.metric, list) else metric_list(str(args.metric))  # from the environment
    price_texts = [args.price] if isinstance(args.price, str) else list(args.price or ())  # str: from the environment
    prices = parse_prices(price_texts)
    source = args.source.strip()
    if source != "redis" and not source.startswith("archive:"):
        raise ValueError(f"bad --source {source!r} (expected redis or archive:URL)")
    if source.startswith("archive:") and args.archive:
        raise ValueError("--archive goes with --source redis (the archive behind Redis), not archive:URL")
    urls = [source.removeprefix("archive:")] if source != "redis" else [args.archive] if args.archive else []
    for url in urls:
        try:
            open_archive(url, endpoint=args.s3_endpoint)
        except ArchiveError as error:
            raise ValueError(str(error)) from None
    if args.archive_engine not in ("duckdb", "python"):
        raise ValueError(f"bad --archive-engine {args.archive_engine!r} (expected duckdb or python)")
    if args.dialect not in DIALECTS:
        raise ValueError(f"bad --dialect {args.dialect!r} (expected one of {', '.join(DIALECTS)})")
    if args.aggregates:
        for flag, given in (
            ("--source archive:", source != "redis"),
            ("--archive", bool(args.archive)),
            ("--segment", args.segment is not None),
            ("--cuped-pre-since", args.cuped_pre_since is not None),
        ):
            if given:
                raise ValueError(f"--aggregates carries per-unit rows of one window: it does not go with {flag}")
    novelty = _novelty_bucket(args.novelty_bucket)
    margin = None
    if args.non_inferiority is not None:
        try:
            margin = Margin.parse(args.non_inferiority)
        except ValueError as error:
            raise ValueError(f"--non-inferiority: {error}") from None
    return Query(
        model=args.model,
        window=Window(since, until, max_lateness_ns=lateness, attribution_ns=attribution),
        metrics=tuple(metrics),
        unit=args.unit,
        alpha=args.alpha,
        sequential=args.sequential,
        tuning_units=args.sequential_tuning,
        planned_units=args.planned_units,
        correction=args.correction,
        non_inferiority=margin,
        novelty_bucket_ns=novelty,
        pre_window=pre,
        segment=args.segment,
        prices=prices,
        engine=args.engine,
        prior=bayes.Prior(args.prior_mean, args.prior_sd),
        bayes_threshold=args.bayes_threshold,
    )


def _novelty_bucket(text: str) -> int | None:
    """``--novelty-bucket``: its width in ns, or None for ``off`` (a rollout's guard reads need no novelty)."""
    if text.strip().lower() == "off":
        return None
    try:
        novelty = parse_duration_ns(text, unit_required=True)
    except BadDuration as error:
        raise ValueError(f"--novelty-bucket: {error}") from None
    if novelty <= 0:
        raise ValueError(f"--novelty-bucket: must be longer than 0, got {text!r}")
    if novelty > LONGEST_NOVELTY_BUCKET_NS:
        raise ValueError(f"--novelty-bucket: at most 100 years (36600d), got {text!r}")
    return novelty


def _instant(flag: str, text: str, now_ns: int) -> int:
    """The instant ``text`` names, an end past :data:`LAST_INSTANT_NS` cut to it; a start past it refused."""
    try:
        instant = parse_instant_ns(text, now_ns=now_ns)
    except BadTime as error:
        raise ValueError(f"{flag}: {error}") from None
    if instant < LAST_INSTANT_NS:
        return instant
    if flag.endswith("since"):
        last = datetime.fromtimestamp(LAST_INSTANT_NS // 10**9, tz=UTC)
        raise ValueError(
            f"{flag}: {text!r} is after anything recorded can be (the analysis reads up to {last:%Y-%m-%d})"
        )
    return LAST_INSTANT_NS


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        query = query_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    if args.print_sql:
        print(aggregation_query(aggregation_of(query), args.dialect))
        return 0
    try:
        analysis = asyncio.run(_analyze(args, query))
        output_dir = Path(args.output_dir)
        write_outputs(analysis, output_dir)
    except UsageError as error:
        return _fail(EXIT_USAGE, str(error))
    except AnalysisFailed as error:
        return _fail(EXIT_FAILED, str(error))
    print(render_table(analysis))
    print(f"wrote {output_dir / 'analysis.json'} and {output_dir / 'analysis.html'}", file=sys.stderr)
    return 0


def _fail(code: int, message: str) -> int:
    print(f"splitstream: error: {message}", file=sys.stderr)
    return code


def write_outputs(analysis: Analysis, output_dir: Path) -> None:
    """``analysis.json`` and ``analysis.html`` (atomically); UsageError when the directory cannot be written."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(output_dir / "analysis.json", analysis.model_dump_json(indent=2) + "\n")
        atomic_write(output_dir / "analysis.html", render_html(analysis))
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        raise UsageError(f"cannot write --output-dir {str(output_dir)!r}: {where}{error.strerror or error}") from None


async def _analyze(args: argparse.Namespace, query: Query) -> Analysis:
    source = args.source.strip()
    if args.aggregates:
        try:
            return await analyze(AggregatesSource(Path(args.aggregates)), query)
        except AggregatesError as error:
            raise UsageError(str(error)) from None
    if source.startswith("archive:"):
        archive = await _open_archive(source.removeprefix("archive:"), args.s3_endpoint)
        if not await asyncio.to_thread(_archived, archive, query.model):
            raise UsageError(f"unknown model {query.model!r}: no calls of it in the archive {archive.url!r}")
        try:
            return await analyze(ArchiveSource(archive, engine=args.archive_engine), query)
        except ArchiveError as error:
            raise AnalysisFailed(str(error)) from None
    try:
        security = redis_security_from_args(args, url=args.redis_url, env_prefix=args.redis_env_prefix)
    except ConfigError as error:
        raise UsageError(str(error)) from None
    behind = await _open_archive(args.archive, args.s3_endpoint) if args.archive else None
    return await _analyze_redis(args.redis_url, query, args.connect_timeout_s, behind, security)


def _archived(archive: Archive, model: str) -> bool:
    """Whether the archive holds calls of ``model`` (its partition directory exists). Blocking."""
    try:
        found = archive.filesystem.get_file_info(model_dirs(archive, CALLS, model))
        return any(info.type == pafs.FileType.Directory for info in found)
    except (OSError, pa.ArrowException) as error:
        raise AnalysisFailed(f"archive {archive.url!r} cannot be listed: {error}") from None


async def _open_archive(url: str, endpoint: str) -> Archive:
    """The archive, checked: UsageError (exit 2) when it names nothing that can be listed."""
    try:
        archive = open_archive(url, endpoint=endpoint)
        await asyncio.to_thread(check_archive, archive, create=False)
    except ArchiveError as error:
        raise UsageError(str(error)) from None
    return archive


async def _analyze_redis(
    url: str,
    query: Query,
    connect_timeout_s: float,
    archive: Archive | None,
    security: RedisSecurity = NO_REDIS_SECURITY,
) -> Analysis:
    try:
        redis = open_redis(
            url,
            security=security,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=max(connect_timeout_s, 30),
        )
    except ValueError as error:
        raise UsageError(f"bad --redis-url {redact_url(url)!r}: {redact_text(str(error))}") from None
    try:
        try:
            await redis.ping()
        except (RedisError, OSError) as error:
            raise AnalysisFailed(f"Redis at {redact_url(url)} is unreachable: {redact_text(str(error))}") from None
        try:
            kind = await redis.type(stream_key(query.model))
            recorded = kind in (b"stream", "stream")
            if not recorded and archive is not None:  # with an archive, a model may live only there
                recorded = await asyncio.to_thread(_archived, archive, query.model)
            if not recorded:
                known = await recorded_models(redis)
                raise UsageError(
                    f"unknown model {query.model!r}: no stream {stream_key(query.model)} in Redis "
                    f"(recorded models: {', '.join(known) or 'none'})"
                )
            source: Source = RedisSource(redis) if archive is None else StraddlingSource(redis, archive)
            return await analyze(source, query)
        except (RedisError, OSError) as error:
            raise AnalysisFailed(f"Redis at {redact_url(url)} failed: {redact_text(str(error))}") from None
        except ArchiveError as error:
            raise AnalysisFailed(str(error)) from None
    finally:
        await redis.aclose()
