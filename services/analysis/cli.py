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

import pyarrow as pa
import pyarrow.fs as pafs
from redis.exceptions import RedisError

from splitstream.analysis import bayes
from splitstream.analysis.analyze import LONGEST_NOVELTY_BUCKET_NS, Query, analyze
from splitstream.analysis.flags import metric_list
from splitstream.analysis.loading import Source, Window
from splitstream.analysis.model import Analysis
from splitstream.analysis.noninferiority import Margin
from splitstream.analysis.report import render_html, render_table
from splitstream.analysis.sources import AggregatesSource, ArchiveSource, RedisSource, StraddlingSource
from splitstream.analysis.sql import DIALECTS, AggregatesError
from splitstream.analysis.usage import parse_prices
from splitstream.common.archive import CALLS, Archive, ArchiveError, check_archive, model_dirs, open_archive
from splitstream.common.durations import BadDuration, parse_duration_ns
from splitstream.common.errors import ConfigError
from splitstream.common.files import atomic_write
from splitstream.common.records import recorded_models, stream_key
from splitstream.common.redis_settings import NO_REDIS_SECURITY, RedisSecurity, redis_security_from_args
from splitstream.common.redis_url import open_redis
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.timewindow import BadTime, parse_instant_ns

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
        from splitstream.analysis.sql.aggregation import aggregation_of, aggregation_query  # sqlglot: only here

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
