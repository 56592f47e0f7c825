"""``splitstream-shipper``: read the routers' write-ahead logs and ship them to the recorder as CallRecords.

Wiring only: flags → :class:`ShipperConfig`, and a :class:`Shipper` that the shared runtime
(:mod:`splitstream.common.runtime`) serves (health and metrics; no API of its own), drains and stops.
A router starts one as its child by default (``--shipper child``); one per host may instead ship
several routers' log directories (``--shipper external`` on the routers, ``--log-dir`` repeated here).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from grpc import aio
from prometheus_client import CollectorRegistry

from splitstream.common.addresses import check_address
from splitstream.common.cli import EnvArgumentParser
from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.common.records import MAX_BATCH_ITEMS, MAX_RECORD_BATCH_INTERVAL_MS, MAX_RECORD_BATCH_SIZE
from splitstream.common.runtime import (
    Runtime,
    ServerDefaults,
    ServerSettings,
    Service,
    add_server_arguments,
    run_service,
)
from splitstream.common.service_auth import SERVICE_TOKEN_ENV, read_service_token
from splitstream.common.tls import PLAINTEXT, ClientTls, add_client_tls_arguments, client_tls_from_args
from splitstream.common.wal import WRITER_LOCK_FILE, segments
from splitstream.shipper.batch_cutter import MIN_BATCH_BYTES
from splitstream.shipper.mirror import MirrorSettings, RecordMirror
from splitstream.shipper.spool import leftover
from splitstream.shipper.tail import Tail

PROG = "splitstream-shipper"


@dataclass(frozen=True, kw_only=True)
class ShipperConfig:
    server: ServerSettings
    log_dirs: tuple[str, ...]
    recorder: str
    spool_dir: str
    record_batch_size: int
    record_batch_interval_ms: float
    record_queue_size: int
    record_batch_max_bytes: int
    shadow_wait_s: float
    flush_timeout_s: float
    exit_with_parent: bool = False
    #: A pipe's write end (-1: none) written once the configuration is taken: a router's child says so.
    ready_fd: int = -1
    recorder_tls: ClientTls = PLAINTEXT
    service_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        try:
            check_address(self.recorder)
        except ValueError as error:
            raise ConfigError(f"--recorder: {error}") from None
        seen: dict[str, str] = {}
        for directory in self.log_dirs:
            if not directory.strip():  # ``--log-dir "$UNSET"`` shipped (and wrote a cursor into) the working directory
                raise ConfigError("--log-dir: must name a directory, got an empty value")
            # Twice (``spool`` and ``spool/``, or through a link), the shipper waited for ever on the lock it
            # held itself and shipped nothing.
            # Missing, it was created, and a typo (``--log-dir /var/lib/splitsream``) shipped nothing, silently: a
            # router creates its log directory, the shipper only ships one.
            if not os.path.exists(directory):
                raise ConfigError(f"--log-dir {directory}: no such directory (give a router's --spool-dir)")
            if not os.path.isdir(directory):
                raise ConfigError(f"--log-dir {directory}: not a directory (give a router's --spool-dir)")
            real = os.path.realpath(directory)
            if real in seen:
                raise ConfigError(f"--log-dir: {directory} is the same directory as {seen[real]}: give each log once")
            seen[real] = directory
        for flag, value in (
            ("--record-batch-size", self.record_batch_size),
            ("--record-queue-size", self.record_queue_size),
            ("--record-batch-max-bytes", self.record_batch_max_bytes),
            ("--record-batch-interval-ms", self.record_batch_interval_ms),
            ("--flush-timeout-s", self.flush_timeout_s),
        ):
            if not value > 0:
                raise ConfigError(f"{flag}: must be positive, got {value}")
        if self.record_batch_size > MAX_RECORD_BATCH_SIZE:
            # The recorder refuses a batch of more than MAX_BATCH_ITEMS records and events, unparsed.
            raise ConfigError(
                f"--record-batch-size: at most {MAX_RECORD_BATCH_SIZE} (a batch carries as many events; the "
                f"recorder takes {MAX_BATCH_ITEMS} a batch), got {self.record_batch_size}"
            )
        if self.shadow_wait_s < 0:
            raise ConfigError(f"--shadow-wait-s: must not be negative, got {self.shadow_wait_s}")
        for flag, seconds in (
            ("--record-batch-interval-ms", self.record_batch_interval_ms),
            ("--shadow-wait-s", self.shadow_wait_s),
            ("--flush-timeout-s", self.flush_timeout_s),
        ):
            # nan shipped every call at once without its shadows; inf held records (or a SIGTERM) for ever.
            if not math.isfinite(seconds):
                raise ConfigError(f"{flag}: must be a finite number, got {seconds}")
        if self.record_batch_interval_ms > MAX_RECORD_BATCH_INTERVAL_MS:
            raise ConfigError(
                f"--record-batch-interval-ms: at most {MAX_RECORD_BATCH_INTERVAL_MS:.0f} (a minute), "
                f"got {self.record_batch_interval_ms}"
            )
        if self.record_batch_max_bytes < MIN_BATCH_BYTES:
            # Below it every record is too large even without its payloads: each call would be dropped.
            raise ConfigError(
                f"--record-batch-max-bytes: must be at least {MIN_BATCH_BYTES} (64 KiB), "
                f"got {self.record_batch_max_bytes}"
            )


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog=PROG,
        env_prefix="SPLITSTREAM_SHIPPER_",
        description="Read routers' write-ahead logs (--log-dir, one per router) and ship every logged call, "
        "shadow outcome and feedback event to the recorder, at least once, in order.",
    )
    parser.add_argument(
        "--log-dir",
        action="append",
        required=True,
        help="a router's log directory (its --spool-dir, which the router creates: a directory that does not exist "
        "is refused); repeat for several routers on this host",
    )
    parser.add_argument("--recorder", required=True, help="recorder address host:port")
    add_server_arguments(parser, ServerDefaults(port=0, metrics_port=8012, drain_delay_s=0.0, shutdown_grace_s=1.0))
    parser.add_argument(
        "--spool-dir",
        default="",
        help="where a shipper or router from before the log may have left a spool (default: the first --log-dir): "
        "shipped first, then removed; nothing is spooled any more, the log is the spool",
    )
    parser.add_argument(
        "--record-batch-size", type=int, default=256, help=f"records per batch (at most {MAX_RECORD_BATCH_SIZE})"
    )
    parser.add_argument(
        "--record-batch-interval-ms",
        type=float,
        default=200.0,
        help="longest a record waits for its batch to fill, at most 60000",
    )
    parser.add_argument("--record-queue-size", type=int, default=100_000, help="feedback events held in memory at most")
    parser.add_argument(
        "--record-batch-max-bytes",
        type=int,
        default=MirrorSettings.batch_max_bytes,
        help="largest record batch sent to the recorder; keep it below the recorder's --max-message-bytes",
    )
    parser.add_argument(
        "--shadow-wait-s",
        type=float,
        default=10.0,
        help="longest a call logged with shadows waits for their outcomes before it is shipped without them",
    )
    parser.add_argument(
        "--flush-timeout-s",
        type=float,
        default=5.0,
        help="on SIGTERM: seconds to wait for the recorder's acks; what is not acknowledged stays on disk",
    )
    add_client_tls_arguments(
        parser.add_argument_group("TLS to the recorder"), flag="--recorder-tls", what="the recorder"
    )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="drain and exit once the process that started this one is gone (a router's child shipper)",
    )
    # Set by a router for its child: told on this pipe that the configuration was taken, it can refuse to start
    # (exit 2, the child's line) when the child refuses it, instead of restarting it for ever.
    argparse.ArgumentParser.add_argument(parser, "--ready-fd", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument(
        "--service-token-file",
        default="",
        help=f"file holding the service token sent to the recorder (else {SERVICE_TOKEN_ENV})",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> ShipperConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return ShipperConfig(
            server=ServerSettings.from_args(args),
            log_dirs=tuple(args.log_dir),
            recorder=args.recorder,
            spool_dir=args.spool_dir or args.log_dir[0],
            record_batch_size=args.record_batch_size,
            record_batch_interval_ms=args.record_batch_interval_ms,
            record_queue_size=args.record_queue_size,
            record_batch_max_bytes=args.record_batch_max_bytes,
            shadow_wait_s=args.shadow_wait_s,
            flush_timeout_s=args.flush_timeout_s,
            exit_with_parent=args.exit_with_parent,
            ready_fd=args.ready_fd,
            recorder_tls=client_tls_from_args(args, flag="--recorder-tls"),
            service_token=read_service_token(args.service_token_file),
        )
    except ConfigError as error:
        parser.error(str(error))
    raise AssertionError("unreachable: parser.error exits")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging(config.server.log_level, service="shipper")
    return run_service(config.server, lambda: Shipper(config), prog=PROG)


class Shipper(Service):
    """The tail feeding the mirror; SIGTERM stops reading, ships what is queued within ``--flush-timeout-s``
    and leaves the rest in the logs (their cursors say where to resume)."""

    prog = PROG
    grpc_services = ()

    def __init__(self, config: ShipperConfig) -> None:
        self.config = config
        self.metrics = CollectorRegistry()
        self.log = structlog.get_logger()
        settings = MirrorSettings(
            recorder_address=config.recorder,
            queue_size=config.record_queue_size,
            batch_size=config.record_batch_size,
            batch_interval_s=config.record_batch_interval_ms / 1000,
            batch_max_bytes=config.record_batch_max_bytes,
            flush_timeout_s=config.flush_timeout_s,
            recorder_tls=config.recorder_tls,
            service_token=config.service_token,
        )
        try:
            spool = leftover(config.spool_dir)
            self.mirror = RecordMirror(settings, spool, self.metrics)
            self.tail = Tail(config.log_dirs, self.mirror, self.metrics, shadow_wait_s=config.shadow_wait_s)
        except OSError as error:
            raise ConfigError(f"--log-dir/--spool-dir: {error.strerror or error}: {error.filename}") from None
        self._tailing: asyncio.Task[None] | None = None
        # An existing directory mistaken for a log: said, not refused (a router's child ships what its router named).
        for directory in () if config.exit_with_parent else config.log_dirs:
            if not (os.path.exists(os.path.join(directory, WRITER_LOCK_FILE)) or segments(Path(directory))):
                self.log.warning(
                    "no router has logged to this directory: is it a router's --spool-dir?", log_dir=directory
                )

    def register(self, server: aio.Server) -> None:
        pass

    async def prepare(self, runtime: Runtime) -> None:
        self.tail.open_locks()
        self.mirror.start()
        self._tailing = asyncio.create_task(self.tail.run(), name="log-tail")

    async def run(self, runtime: Runtime) -> None:
        await runtime.set_serving(True)
        if self.config.ready_fd >= 0:
            with contextlib.suppress(OSError):  # the router gone meanwhile: --exit-with-parent sees to it
                os.write(self.config.ready_fd, b"ready\n")
            with contextlib.suppress(OSError):  # not a descriptor of ours (given by hand): nothing to tell
                os.close(self.config.ready_fd)
        self.log.info("shipper shipping", logs=list(self.config.log_dirs), recorder=self.config.recorder)
        parent = os.getppid()
        while True:
            await asyncio.sleep(1.0)
            if self._tailing is not None and self._tailing.done():
                # The tail stopped on its own (its log's lock file unusable): a shipper that ships nothing must
                # not go on saying it serves. Raises the tail's error: the runtime exits with it.
                self._tailing.result()
            # Beside Linux's parent-death signal (which the router asks for): where that is missing, a child
            # whose router died would ship on, and hold the log's lock from the restarted router's own child.
            if self.config.exit_with_parent and os.getppid() != parent:
                self.log.warning("the router that started this shipper is gone; draining")
                os.kill(os.getpid(), signal.SIGTERM)
                return

    async def teardown(self) -> None:
        await self.tail.close()
        if self._tailing is not None:
            self._tailing.cancel()
            await asyncio.gather(self._tailing, return_exceptions=True)  # its failure, if any, was raised by run()
        await self.mirror.close()
        await self.tail.commit()
        self.log.info("shipper stopped")
