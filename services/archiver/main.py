"""``splitstream-archive``: keep every recorded call and outcome event as Parquet on a filesystem or object store.

Wiring only: flags → :class:`ArchiverSettings` and an :class:`Archiver` (see :mod:`splitstream.archiver.core`
for the delivery guarantees) that the shared runtime serves (grpc health, Prometheus), drains and stops.
Exit codes as :mod:`splitstream.common.runtime` says: 2 and one line for an archive URL that names
nothing usable, a bucket that does not exist or credentials the store refuses.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from grpc import aio
from redis.exceptions import NoPermissionError, RedisError

from splitstream.archiver.core import Archiver, ArchiverSettings
from splitstream.archiver.metrics import ArchiverMetrics
from splitstream.common.archive import Archive, ArchiveError, check_archive, open_archive
from splitstream.common.cli import EnvArgumentParser
from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.common.names import check_model_name
from splitstream.common.records import ARCHIVE_GROUP, archive_group_key, stream_key
from splitstream.common.redis_url import (
    RedisSecurity,
    add_redis_security_arguments,
    open_redis,
    redis_security_from_args,
)
from splitstream.common.runtime import (
    Runtime,
    ServerDefaults,
    ServerSettings,
    Service,
    add_server_arguments,
    process_index,
    run_service,
    usable_cores,
)
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.supervisor import supervise

PROG = "splitstream-archive"
ENV_PREFIX = "SPLITSTREAM_ARCHIVE_"
#: The longest --claim-idle-s (ten years). Redis takes XAUTOCLAIM's idle time as int64 milliseconds: past
#: that, every claim failed and the archiver archived nothing, retrying forever (1e308: a traceback).
MAX_CLAIM_IDLE_S = 10 * 365 * 86_400


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``splitstream-archive``."""
    config = parse_args(argv)
    configure_logging(config.server.log_level, service="archiver")
    if config.server.processes > 1:
        # Each child is a whole archiver (its own consumer in the group, its own builder): see consumer_name.
        # --builder resolved here, where --processes is known (each child is told --processes 1).
        builder = "process" if config.settings.builder_process else "thread"
        archiver_argv = [*(sys.argv[1:] if argv is None else argv), "--builder", builder]
        return supervise(
            config.server, module="splitstream.archiver", argv=archiver_argv, prog=PROG, service="archiver"
        )
    return run_service(config.server, lambda: ArchiverService(config), prog=PROG)


class ArchiverService(Service):
    """No gRPC API of its own: the runtime gives it health (SERVING once Redis and the archive answer),
    metrics and the ordered SIGTERM drain (the buffered entries are written and acknowledged)."""

    prog = PROG

    def __init__(self, config: ArchiverConfig) -> None:
        self.config = config
        self.log = structlog.get_logger()
        self.archiver_metrics = ArchiverMetrics()
        self.metrics = self.archiver_metrics.registry
        try:
            self.archive: Archive = open_archive(config.archive_url, endpoint=config.s3_endpoint)
        except ArchiveError as error:
            raise ConfigError(f"--archive: {error}") from None
        try:
            self.redis = open_redis(
                config.redis_url,
                security=config.redis_security,
                socket_timeout=config.redis_timeout_s + 2.0,  # XREADGROUP blocks up to a second
                socket_connect_timeout=config.redis_timeout_s,
                client_name="splitstream-archive",
            )
        except ValueError as error:
            raise ConfigError(f"--redis-url {redact_url(config.redis_url)}: {redact_text(str(error))}") from None
        self.archiver = Archiver(self.redis, self.archive, config.settings, self.archiver_metrics)
        #: The drain ran out of time with a write still under way (its builder is then not waited for).
        self._drain_cut = False

    def register(self, server: aio.Server) -> None:
        """Health and reflection only (added by the runtime)."""

    async def prepare(self, runtime: Runtime) -> None:
        """An archive that cannot be listed or written is a configuration error: exit 2, one line."""
        try:
            await asyncio.to_thread(check_archive, self.archive, create=True)
        except ArchiveError as error:
            raise ConfigError(str(error)) from None

    async def run(self, runtime: Runtime) -> None:
        self.log.info(
            "archiver started",
            archive=self.config.archive_url,
            redis=redact_url(self.config.redis_url),
            group=self.config.settings.group,
            consumer=self.config.settings.consumer,
        )
        while True:
            try:
                await self.redis.ping()
                break
            except (RedisError, OSError) as error:
                self.log.warning("redis unreachable; waiting", error=redact_text(str(error)))
                await asyncio.sleep(1.0)
        await self._claim_group()
        await runtime.set_serving(True)
        for model in sorted(m for m in self.config.settings.models if "," in m):
            if not await self.redis.exists(stream_key(model)):  # an old command line's ``--model a,b``, perhaps
                self.log.warning(
                    "--model names one model, commas included, and Redis holds no calls of it yet: "
                    "give --model once per model to archive several",
                    model=model,
                )
        await self.archiver.run()

    def archive_identity(self) -> str:
        """Which archive this is, as the group records it: the store and the path in it (a path resolved, so
        ``./a`` and its absolute path are one archive), never a URL's credentials or query."""
        archive = self.archive
        where = os.path.realpath(archive.base) if archive.is_local else archive.base
        endpoint = f" at {self.config.s3_endpoint}" if self.config.s3_endpoint else ""
        return f"{archive.filesystem.type_name}:{where}{endpoint}"

    async def _claim_group(self) -> None:
        """Refuse a group that another archive's archivers read: the group hands each entry to one consumer, so
        two archives sharing it each missed what the other's archiver was handed. The first archiver of a group
        names its archive in Redis; one with another archive is exit 2 and one line."""
        key = archive_group_key(self.config.settings.group)
        mine = self.archive_identity()
        try:
            await self.redis.set(key, mine, nx=True)
            recorded = await self.redis.get(key)
        except NoPermissionError:
            # An ACL written before this check (docs/security.md's set then) lacks the key: archiving as before beats
            # an archiver that stops at its upgrade while retention trims what it has not archived yet.
            self.log.warning(
                "cannot check which archive this consumer group writes to: the Redis user may not use the key; "
                "add ~splitstream:archive-group:* to its ACL",
                key=key,
            )
            return
        theirs = recorded.decode(errors="replace") if isinstance(recorded, bytes) else str(recorded)
        if recorded is not None and theirs != mine:
            raise ConfigError(
                f"--group {self.config.settings.group}: its archivers write to {theirs}, this one to {mine}: each "
                f"archive needs its own --group (or delete the key {key} in Redis to move the group to this archive)"
            )

    async def draining(self) -> None:
        """The drain gets ``--shutdown-grace-s``: a store that stopped answering would hold a SIGTERM for
        minutes (each write waits out its own timeouts and retries). Whatever is not written by then stays
        pending in Redis, for this consumer's next start or another archiver's claim."""
        grace_s = self.config.server.shutdown_grace_s
        try:
            await asyncio.wait_for(self.archiver.drain(), grace_s)
        except TimeoutError:
            self._drain_cut = True
            self.log.warning(
                "the archive did not take the buffered entries within --shutdown-grace-s; they stay pending",
                shutdown_grace_s=grace_s,
                entries=self.archiver.unwritten(),
            )

    async def teardown(self) -> None:
        await self.archiver.close(abandon=self._drain_cut)
        await self.redis.aclose()
