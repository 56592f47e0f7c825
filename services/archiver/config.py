"""``splitstream-archive``'s configuration: its flags and environment (:func:`build_parser`), checked and
turned into an :class:`ArchiverConfig` (:func:`parse_args`); a value refused is a usage error naming the
flag (exit 2, one line). :class:`ArchiverSettings` is the part the archive loop
(:class:`splitstream.archiver.core.Archiver`) takes."""

from __future__ import annotations

import argparse
import math
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from splitstream.common.cli import EnvArgumentParser
from splitstream.common.errors import ConfigError
from splitstream.common.names import check_model_name
from splitstream.common.records import ARCHIVE_GROUP
from splitstream.common.redis_settings import RedisSecurity, add_redis_security_arguments, redis_security_from_args
from splitstream.common.runtime import ServerDefaults, ServerSettings, add_server_arguments, process_index, usable_cores

PROG = "splitstream-archive"
ENV_PREFIX = "SPLITSTREAM_ARCHIVE_"
#: The longest --claim-idle-s (ten years). Redis takes XAUTOCLAIM's idle time as int64 milliseconds: past
#: that, every claim failed and the archiver archived nothing, retrying forever (1e308: a traceback).
MAX_CLAIM_IDLE_S = 10 * 365 * 86_400


@dataclass(frozen=True, kw_only=True)
class ArchiverSettings:
    group: str
    consumer: str
    models: frozenset[str] = frozenset()  # empty: every model
    max_file_rows: int = 100_000
    max_file_bytes: int = 128 * 1024 * 1024
    flush_interval_s: float = 30.0
    claim_idle_s: float = 300.0
    read_count: int = 1000
    scan_interval_s: float = 5.0
    retry_max_s: float = 30.0
    #: Build and write files in a child process (False: a thread; see :mod:`splitstream.archiver.builder`).
    builder_process: bool = True


@dataclass(frozen=True, kw_only=True)
class ArchiverConfig:
    server: ServerSettings
    redis_url: str
    redis_timeout_s: float
    redis_security: RedisSecurity
    archive_url: str
    s3_endpoint: str
    settings: ArchiverSettings


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = EnvArgumentParser(
        prog=PROG,
        env_prefix=ENV_PREFIX,
        description=(
            "Read the recorder's call and feedback streams as a Redis consumer group and write them as "
            "zstd Parquet, partitioned by model/date/hour, to a directory or an S3-compatible store; entries "
            "are acknowledged only once their file is written."
        ),
    )
    add_server_arguments(parser, ServerDefaults(port=8005, metrics_port=8006, drain_delay_s=0.0), processes=True)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the recorder's Redis", secret=True)
    parser.add_argument("--redis-timeout-s", type=float, default=5.0, help="connect and reply timeout for Redis")
    add_redis_security_arguments(parser.add_argument_group("Redis TLS and ACL user (see docs/security.md)"))
    parser.add_argument(
        "--archive",
        default="./splitstream-archive",
        help="where files go: a directory (file:///path or a path), s3://bucket/prefix, or any URI pyarrow's "
        "filesystems know (gs://, hdfs://, abfs://); S3 credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
    )
    parser.add_argument(
        "--s3-endpoint",
        default="",
        help="endpoint of an S3-compatible store (MinIO, Ceph, R2): http://host:port (empty: AWS)",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="archive only this model, its name whole, commas included (repeat for several; "
        "default: every model; the environment variable is a comma-separated list)",
    )
    parser.add_argument("--group", default=ARCHIVE_GROUP, help="Redis consumer group archivers share")
    parser.add_argument(
        "--consumer",
        default="",
        help="this archiver's name in the group; keep it across restarts so its unacknowledged entries are "
        "re-archived under the same file names (empty: the hostname); with --processes N, process i is "
        "<consumer>-<i>",
    )
    parser.add_argument("--max-file-rows", type=int, default=100_000, help="entries per file at most")
    parser.add_argument(
        "--max-file-mb", type=float, default=128.0, help="a file is cut once its entries hold this many MiB"
    )
    parser.add_argument(
        "--flush-interval-s", type=float, default=30.0, help="a file is written once its oldest entry waited this long"
    )
    parser.add_argument(
        "--claim-idle-s",
        type=float,
        default=300.0,
        help="entries another archiver left unacknowledged this long are taken over (it crashed); must exceed "
        "--flush-interval-s plus an upload",
    )
    parser.add_argument("--read-count", type=int, default=1000, help="entries per XREADGROUP")
    parser.add_argument("--scan-interval-s", type=float, default=5.0, help="how often new streams are looked for")
    parser.add_argument(
        "--builder",
        choices=("auto", "process", "thread"),
        default="auto",
        help="where files are decoded, built and written: a child process, beside the loop reading Redis "
        "(two cores), or a thread of the archiver's own (one core); auto: a process when there are two "
        "usable cores per archiver process (--processes) or more, else a thread",
    )
    return parser


def consumer_name(base: str) -> str:
    """This process's name in the group: ``base``, or ``base-<index>`` in a ``--processes`` child, so the
    siblings' names differ and a restarted child (same index) resumes its own pending entries."""
    index = process_index()
    return base if index is None else f"{base}-{index}"


def builds_in_process(builder: str, processes: int) -> bool:
    """``--builder auto``: a builder process per archiver process only where each gets a second core.

    An archiver process keeps about one core busy reading and a builder process most of another; with
    fewer than two usable cores per archiver process they would only take turns (see docs/archive.md)."""
    if builder != "auto":
        return builder == "process"
    return usable_cores() >= 2 * processes


def parse_args(argv: Sequence[str] | None) -> ArchiverConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        server = ServerSettings.from_args(args)
        for flag, value in (
            ("--redis-timeout-s", args.redis_timeout_s),
            ("--flush-interval-s", args.flush_interval_s),
            ("--claim-idle-s", args.claim_idle_s),
            ("--scan-interval-s", args.scan_interval_s),
            ("--max-file-mb", args.max_file_mb),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag}: must be a positive number, got {value}")
        for flag, count in (("--max-file-rows", args.max_file_rows), ("--read-count", args.read_count)):
            if count < 1:
                raise ConfigError(f"{flag}: must be at least 1, got {count}")
        if args.claim_idle_s > MAX_CLAIM_IDLE_S:
            raise ConfigError(f"--claim-idle-s: at most {MAX_CLAIM_IDLE_S} (ten years), got {args.claim_idle_s}")
        if args.claim_idle_s <= args.flush_interval_s:
            raise ConfigError(
                f"--claim-idle-s ({args.claim_idle_s}) must exceed --flush-interval-s ({args.flush_interval_s}): "
                "entries waiting for their file would be taken over by another archiver"
            )
        # Each value one name: model names may hold commas, and ``a,b`` split in two left model "a,b" unarchivable.
        models = frozenset(args.model)
        for model in sorted(models):
            try:
                check_model_name(model)
            except ValueError as error:
                raise ConfigError(f"--model: {error}") from None
        settings = ArchiverSettings(
            group=args.group,
            consumer=consumer_name(args.consumer or socket.gethostname()),
            models=models,
            max_file_rows=args.max_file_rows,
            max_file_bytes=int(args.max_file_mb * 1024 * 1024),
            flush_interval_s=args.flush_interval_s,
            claim_idle_s=args.claim_idle_s,
            read_count=args.read_count,
            scan_interval_s=args.scan_interval_s,
            builder_process=builds_in_process(args.builder, server.processes),
        )
        security = redis_security_from_args(args, url=args.redis_url, env_prefix=ENV_PREFIX)
    except ConfigError as error:
        parser.error(str(error))
    return ArchiverConfig(
        server=server,
        redis_url=args.redis_url,
        redis_timeout_s=args.redis_timeout_s,
        redis_security=security,
        archive_url=args.archive,
        s3_endpoint=args.s3_endpoint,
        settings=settings,
    )
