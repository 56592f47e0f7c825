"""The shipper's configuration: :class:`ShipperConfig`, filled from flags and environment by :func:`parse_args`;
any value it refuses is a usage error naming the flag (exit 2, one line)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitstream.common.cli import EnvArgumentParser
from splitstream.common.errors import ConfigError
from splitstream.common.runtime import ServerDefaults, ServerSettings, add_server_arguments
from splitstream.common.service_auth import SERVICE_TOKEN_ENV, read_service_token
from splitstream.common.shipping import RecordBatchSettings, add_record_batch_arguments, check_recorder_address
from splitstream.common.tls import PLAINTEXT, ClientTls, add_client_tls_arguments, client_tls_from_args
from splitstream.common.token_transport import INSECURE_TOKEN_FLAG, INSECURE_TOKEN_HELP, check_token_sent

PROG = "splitstream-shipper"


@dataclass(frozen=True, kw_only=True)
class ShipperConfig:
    server: ServerSettings
    log_dirs: tuple[str, ...]
    recorder: str
    spool_dir: str
    record_batch: RecordBatchSettings
    shadow_wait_s: float
    flush_timeout_s: float
    exit_with_parent: bool = False
    #: A pipe's write end (-1: none) written once the configuration is taken: a router's child says so.
    ready_fd: int = -1
    recorder_tls: ClientTls = PLAINTEXT
    service_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        check_recorder_address(self.recorder)
        seen: dict[str, str] = {}
        for directory in self.log_dirs:
            if not directory.strip():  # ``--log-dir "$UNSET"`` would ship (and write a cursor into) the working dir
                raise ConfigError("--log-dir: must name a directory, got an empty value")
            # A missing directory is refused, not created: a router creates its log directory, the shipper only
            # ships one, so a typo (``--log-dir /var/lib/splitsream``) would silently ship nothing.
            # One given twice (``spool`` and ``spool/``, or through a link) is refused: the shipper would wait for
            # ever on the lock it holds itself, and ship nothing.
            if not os.path.exists(directory):
                raise ConfigError(f"--log-dir {directory}: no such directory (give a router's --log-dir)")
            if not os.path.isdir(directory):
                raise ConfigError(f"--log-dir {directory}: not a directory (give a router's --log-dir)")
            real = os.path.realpath(directory)
            if real in seen:
                raise ConfigError(f"--log-dir: {directory} is the same directory as {seen[real]}: give each log once")
            seen[real] = directory
        if not self.flush_timeout_s > 0:
            raise ConfigError(f"--flush-timeout-s: must be positive, got {self.flush_timeout_s}")
        if self.shadow_wait_s < 0:
            raise ConfigError(f"--shadow-wait-s: must not be negative, got {self.shadow_wait_s}")
        for flag, seconds in (("--shadow-wait-s", self.shadow_wait_s), ("--flush-timeout-s", self.flush_timeout_s)):
            # nan would ship every call at once without its shadows; inf would hold a call (or a SIGTERM) for ever.
            if not math.isfinite(seconds):
                raise ConfigError(f"{flag}: must be a finite number, got {seconds}")


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
        help="a router's log directory (its --log-dir, which the router creates: a directory that does not exist "
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
    add_record_batch_arguments(parser)
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
    parser.add_argument(INSECURE_TOKEN_FLAG, action="store_true", help=INSECURE_TOKEN_HELP)
    return parser


def parse_args(argv: Sequence[str] | None) -> ShipperConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = ShipperConfig(
            server=ServerSettings.from_args(args),
            log_dirs=tuple(args.log_dir),
            recorder=args.recorder,
            spool_dir=args.spool_dir or args.log_dir[0],
            record_batch=RecordBatchSettings.from_args(args),
            shadow_wait_s=args.shadow_wait_s,
            flush_timeout_s=args.flush_timeout_s,
            exit_with_parent=args.exit_with_parent,
            ready_fd=args.ready_fd,
            recorder_tls=client_tls_from_args(args, flag="--recorder-tls"),
            service_token=read_service_token(args.service_token_file),
        )
        check_token_sent(
            token=config.service_token,
            target=config.recorder,
            tls=config.recorder_tls.enabled,
            allow_insecure=args.allow_insecure_token,
        )
        return config
    except ConfigError as error:
        parser.error(str(error))
    raise AssertionError("unreachable: parser.error exits")
