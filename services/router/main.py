"""``splitstream-router``: serve the Open Inference Protocol and split traffic between model versions.

Wiring only: flags → :class:`RouterConfig`, the registry, and a :class:`Router` that the shared
runtime (:mod:`splitstream.common.runtime`) serves, drains and stops.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from grpc import aio
from prometheus_client import CollectorRegistry

from splitstream.common.addresses import check_address
from splitstream.common.cli import EnvArgumentParser, fail
from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.splitstream.v1 import feedback_pb2, router_pb2
from splitstream.common.records import MAX_BATCH_ITEMS, MAX_RECORD_BATCH_INTERVAL_MS, MAX_RECORD_BATCH_SIZE
from splitstream.common.registry import ConsulRegistry, FileRegistry, Registry, RegistryUpdate, parse_consul_spec
from splitstream.common.runtime import (
    Runtime,
    ServerDefaults,
    ServerSettings,
    Service,
    add_server_arguments,
    process_index,
    run_service,
)
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.service_auth import SERVICE_TOKEN_ENV, read_service_token
from splitstream.common.supervisor import supervise
from splitstream.common.tls import PLAINTEXT, ClientTls, add_client_tls_arguments, client_tls_from_args
from splitstream.router.auth.credentials import PrincipalsStore, open_principals
from splitstream.router.auth.interceptor import Authenticator, AuthInterceptor, AuthMetrics
from splitstream.router.auth.jwks import JwtSettings, JwtVerifier, parse_algorithms
from splitstream.router.auth.policy import Policy
from splitstream.router.auth.ratelimit import RateLimiter
from splitstream.router.core import EndpointSettings, RouterCore
from splitstream.router.feedback import FeedbackService
from splitstream.router.http.app import HttpFrontDoor
from splitstream.router.metrics import RouterMetrics
from splitstream.router.recording import CallLog
from splitstream.router.servicer import RouterServicer
from splitstream.router.shadows import ShadowRunner
from splitstream.router.shipper_child import ShipperChild
from splitstream.router.streams import DEFAULT_RECORD_STREAM_MAX_BYTES, StreamProxy
from splitstream.shipper.batch_cutter import MIN_BATCH_BYTES

PROG = "splitstream-router"
#: Where a router logs unless told (--spool-dir): looked at for a log left there by an earlier router.
SPOOL_DIR_DEFAULT = "splitstream-spool"
#: After the registry watch failed in a way its backend did not report as an update (an exception,
#: or the watch ending), wait this long before watching again: long enough not to spin on a file
#: that keeps failing the same way, short next to the time an operator takes to fix it.
WATCH_RESTART_DELAY_S = 1.0
#: How often the --upstream-tls-* files are looked at (three stat calls) for a rotation to apply to open channels.
UPSTREAM_TLS_POLL_S = 2.0


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """The router's flags, validated (ConfigError naming the flag). ``server`` holds the shared ones."""

    server: ServerSettings
    registry: str
    router_id: str
    eject_after_failures: int
    eject_duration_s: float
    recorder: str
    spool_dir: str
    spool_max_bytes: int
    hmac_key: str
    record_batch_size: int
    record_batch_interval_ms: float
    record_queue_size: int
    record_batch_max_bytes: int
    record_credential_headers: bool
    shadow_timeout_s: float
    shadow_max_in_flight: int
    record_stream_max_bytes: int
    shipper: str = "child"
    log_flush_interval_s: float = 1.0
    log_segment_bytes: int = 16 << 20
    #: Flags the child shipper gets beside those the router derives (TLS to the recorder, token file, ...).
    shipper_args: tuple[str, ...] = ()
    upstream_tls: ClientTls = PLAINTEXT
    recorder_tls: ClientTls = PLAINTEXT
    #: Where the principals document is ("": callers are not authenticated).
    auth_principals: str = ""
    jwt: JwtSettings | None = None
    #: Sent to the recorder on the Record stream ("": none).
    service_token: str = field(default="", repr=False)
    #: The HTTP front door's port (OpenAI-compatible API; 0: off).
    http_port: int = 0

    def __post_init__(self) -> None:
        self._check_http()
        if self.eject_after_failures < 1:
            raise ConfigError("--eject-after-failures must be at least 1")
        for flag, value in (
            ("--eject-duration-s", self.eject_duration_s),
            ("--shadow-timeout-s", self.shadow_timeout_s),
            ("--record-batch-interval-ms", self.record_batch_interval_ms),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{flag}: must be a finite number >= 0, got {value}")
        if self.record_batch_interval_ms > MAX_RECORD_BATCH_INTERVAL_MS:
            raise ConfigError(
                f"--record-batch-interval-ms: at most {MAX_RECORD_BATCH_INTERVAL_MS:.0f} (a minute), "
                f"got {self.record_batch_interval_ms}"
            )
        # A float, checked as one: it was checked with the counts (>= 1), so 0.2 was refused as "not positive"
        # while nan passed (nan < 1 is false) and the flusher's first sleep raised.
        if not (math.isfinite(self.log_flush_interval_s) and self.log_flush_interval_s > 0):
            raise ConfigError(f"--log-flush-interval-s: must be a finite number > 0, got {self.log_flush_interval_s}")
        if self.recorder:
            # A typo here ("recorder:80o3", "a b") was accepted: the router served, spooled every call
            # and only logged that the recorder was unreachable (found by probing).
            try:
                check_address(self.recorder)
            except ValueError as error:
                raise ConfigError(f"--recorder: {error}") from None
        if self.recorder and not self.spool_dir.strip():
            # ``--spool-dir "$UNSET"``: the log (segments, cursor, lock) went into the working directory.
            raise ConfigError("--spool-dir: must name a directory, got an empty value")
        if self.recorder and not self.hmac_key:
            raise ConfigError("--recorder needs --hmac-key (or SPLITSTREAM_HMAC_KEY) for routing-key HMACs")
        if self.jwt is not None and not self.auth_principals:
            raise ConfigError("--jwt-jwks needs --auth-principals: a JWT's principal takes its grants from it")
        if self.auth_principals and self.record_credential_headers:
            raise ConfigError(
                "--record-credential-headers cannot be used with --auth-principals: records would keep callers' "
                "keys and tokens"
            )
        for flag, count in (
            ("--record-batch-size", self.record_batch_size),
            ("--record-queue-size", self.record_queue_size),
            ("--record-batch-max-bytes", self.record_batch_max_bytes),
            ("--spool-max-bytes", self.spool_max_bytes),
            ("--log-segment-bytes", self.log_segment_bytes),
            ("--shadow-max-in-flight", self.shadow_max_in_flight),
        ):
            if count < 1:
                raise ConfigError(f"{flag}: must be positive, got {count}")
        if self.record_batch_size > MAX_RECORD_BATCH_SIZE:
            # The recorder refuses a batch of more than MAX_BATCH_ITEMS records and events, unparsed.
            raise ConfigError(
                f"--record-batch-size: at most {MAX_RECORD_BATCH_SIZE} (a batch carries as many events; the "
                f"recorder takes {MAX_BATCH_ITEMS} a batch), got {self.record_batch_size}"
            )
        if self.record_batch_max_bytes < MIN_BATCH_BYTES:
            # Passed to the child shipper, which refuses it (below it every record would be dropped as too large):
            # refused here, once, rather than by a child restarted for ever.
            raise ConfigError(
                f"--record-batch-max-bytes: must be at least {MIN_BATCH_BYTES} (64 KiB), "
                f"got {self.record_batch_max_bytes}"
            )
        if self.record_stream_max_bytes < 1:
            raise ConfigError(f"--record-stream-max-bytes: must be positive, got {self.record_stream_max_bytes}")
        if self.record_stream_max_bytes > self.record_batch_max_bytes // 2:
            # A stream record over the batch cap could only be dropped (the mirror's fitting keeps unary
            # payloads, not stream messages): keep it well inside.
            raise ConfigError(
                f"--record-stream-max-bytes {self.record_stream_max_bytes} must be at most half of "
                f"--record-batch-max-bytes ({self.record_batch_max_bytes})"
            )

    def _check_http(self) -> None:
        """--http-port: a port, and not (yet) where HTTP would bypass what gRPC enforces or shares."""
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"--http-port: must be within 0..65535, got {self.http_port}")
        if self.http_port and self.auth_principals:
            raise ConfigError("--http-port cannot be used with --auth-principals yet: HTTP calls are not authenticated")
        if self.http_port and self.server.processes > 1:
            raise ConfigError("--http-port cannot be used with --processes above 1 yet: serve HTTP from one process")


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog="splitstream-router",
        env_prefix="SPLITSTREAM_ROUTER_",
        description=(
            "Serve the Open Inference Protocol (KServe v2 gRPC) and splitstream.v1.Router on one port, "
            "split each model's traffic between its versions by a sticky hash of the routing key, and "
            "forward calls to the workers the registry lists."
        ),
    )
    parser.add_argument(
        "--registry",
        required=True,
        help=(
            "where endpoints and experiments come from: file:PATH (a YAML file, re-read on change) or "
            "consul://HOST:PORT (watched with blocking queries; ACL token from CONSUL_HTTP_TOKEN)"
        ),
    )
    # Triton's ports, so Triton clients work with defaults.
    add_server_arguments(parser, ServerDefaults(port=8001, metrics_port=8002), processes=True)
    parser.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="HTTP port of the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) on --host, "
        "TLS as the gRPC port (0: off; Triton's HTTP port is 8000)",
    )
    parser.add_argument(
        "--router-id",
        default="",
        help="this router's name in logs, Status and records (empty: hostname-pid)",
    )
    parser.add_argument(
        "--eject-after-failures",
        type=int,
        default=3,
        help="consecutive UNAVAILABLE answers that take an endpoint out of rotation",
    )
    parser.add_argument(
        "--eject-duration-s",
        type=float,
        default=5.0,
        help="how long an ejected endpoint stays out before it is tried again",
    )
    parser.add_argument(
        "--shadow-timeout-s",
        type=float,
        default=5.0,
        help="deadline of a shadow copy (shadows are set per experiment in the registry)",
    )
    parser.add_argument(
        "--shadow-max-in-flight",
        type=int,
        default=256,
        help="shadow copies in flight at most; past it new ones are skipped and counted",
    )
    add_client_tls_arguments(
        parser.add_argument_group("TLS to workers (every endpoint and shadow the registry lists)"),
        flag="--upstream-tls",
        what="the workers",
    )
    recording = parser.add_argument_group("recording (off unless --recorder is set)")
    recording.add_argument(
        "--recorder",
        default="",
        help="recorder address host:port; every call, and every event reported to Feedback/Report, is mirrored to it",
    )
    recording.add_argument(
        "--spool-dir",
        default=SPOOL_DIR_DEFAULT,
        help="the write-ahead log directory: every answered call is appended here and shipped to the recorder "
        "by splitstream-shipper (one directory per router process; with --processes N, child i logs to "
        "SPOOL_DIR/proc-i)",
    )
    recording.add_argument(
        "--spool-max-bytes",
        type=int,
        default=1 << 30,
        help="cap of the log not yet shipped (the log is the spool while the recorder is away); past it new "
        "calls are dropped and "
        "counted, never blocking calls",
    )
    recording.add_argument(
        "--shipper",
        choices=("child", "external"),
        default="child",
        help="child: the router runs its own splitstream-shipper (restarted if it dies, stopped after the "
        "router's drain; with --processes N one shipper for all N logs); external: one shipper per host ships "
        "this --spool-dir with other routers'",
    )
    recording.add_argument(
        "--shipper-metrics-port",
        type=int,
        default=0,
        help="Prometheus port of the child shipper (0: none)",
    )
    recording.add_argument(
        "--log-flush-interval-s",
        type=float,
        default=1.0,
        help="how often the log is fdatasync'd: what a machine crash may lose (a router crash loses nothing)",
    )
    recording.add_argument(
        "--log-segment-bytes",
        type=int,
        default=16 << 20,
        help="log segment size: a segment is deleted once all of it is shipped",
    )
    recording.add_argument(
        "--hmac-key",
        default="",
        help="key for the routing-key HMAC in records; else SPLITSTREAM_HMAC_KEY (shared with recorder and replayer)",
        secret=True,
    )
    recording.add_argument(
        "--record-batch-size",
        type=int,
        default=256,
        help=f"records per batch, at most {MAX_RECORD_BATCH_SIZE} (passed to the child shipper)",
    )
    recording.add_argument(
        "--record-batch-interval-ms",
        type=float,
        default=200.0,
        help="longest a record waits for its batch to fill, at most 60000 (passed to the child shipper)",
    )
    recording.add_argument(
        "--record-queue-size",
        type=int,
        default=100_000,
        help="passed to the child shipper: feedback events it holds in memory at most (calls wait in the log)",
    )
    recording.add_argument(
        "--record-batch-max-bytes",
        type=int,
        default=64 << 20,
        help="largest record batch sent to the recorder; keep it below the recorder's --max-message-bytes "
        "(128 MiB); a call whose record is larger alone is recorded without its largest payloads "
        "(tag splitstream.payload-dropped)",
    )
    recording.add_argument(
        "--record-stream-max-bytes",
        type=int,
        default=None,
        help="payload bytes kept per recorded token stream (ModelStreamInfer); later messages are counted, "
        "not kept, and the record is flagged truncated; at most half of --record-batch-max-bytes "
        f"(default: {DEFAULT_RECORD_STREAM_MAX_BYTES >> 20} MiB, or half the batch cap when that is smaller)",
    )
    recording.add_argument(
        "--record-credential-headers",
        action="store_true",
        help="keep authorization, cookie, x-api-key and other credential headers in recorded metadata "
        "(dropped by default, so a replay never re-sends someone's token)",
    )
    add_client_tls_arguments(
        parser.add_argument_group("TLS to the recorder"), flag="--recorder-tls", what="the recorder"
    )
    recording.add_argument(
        "--service-token-file",
        default="",
        help=f"file holding the service token sent to the recorder (else {SERVICE_TOKEN_ENV}); needed when the "
        "recorder checks one",
    )
    auth = parser.add_argument_group(
        "caller authentication (off unless --auth-principals is set; grpc health and reflection stay open)"
    )
    auth.add_argument(
        "--auth-principals",
        default="",
        help="the principals document (API key hashes and grants per principal): file:PATH (YAML or JSON, "
        "re-read on change) or consul://HOST:PORT/KEY (a KV key, watched; ACL token from CONSUL_HTTP_TOKEN); "
        "callers then send x-api-key: KEY or authorization: Bearer JWT",
    )
    auth.add_argument(
        "--jwt-jwks",
        default="",
        help="accept JWTs signed by a key of this JWKS: file:PATH or an http(s):// URL (re-read on an unknown kid "
        "and every --jwks-refresh-s)",
        secret=True,
    )
    auth.add_argument("--jwt-audience", default="", help="the aud a JWT must carry (required with --jwt-jwks)")
    auth.add_argument("--jwt-issuer", default="", help="the iss a JWT must carry (required with --jwt-jwks)")
    auth.add_argument(
        "--jwt-algorithms",
        default="RS256,ES256",
        help="signature algorithms accepted, comma-separated (asymmetric only: none and HS* are refused)",
    )
    auth.add_argument(
        "--jwt-principal-claim", default="sub", help="the claim naming the principal (an entry of --auth-principals)"
    )
    auth.add_argument("--jwt-leeway-s", type=float, default=10.0, help="clock skew allowed on exp and nbf")
    auth.add_argument("--jwks-refresh-s", type=float, default=300.0, help="how often the JWKS is re-read")
    auth.add_argument(
        "--jwks-min-refresh-s",
        type=float,
        default=10.0,
        help="shortest time between two reads of the JWKS (a token with an unknown kid triggers one)",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> RouterConfig:
    """Flags (and SPLITSTREAM_ROUTER_* variables) → config; a usage error exits 2 with one line.

    The one place flags map to settings: a new flag is added in :func:`build_parser` and here."""
    parser = build_parser()
    args = parser.parse_args(argv)
    index = process_index()
    router_id = args.router_id or f"{socket.gethostname()}-{os.getpid()}"
    spool_dir = args.spool_dir
    shipper = args.shipper
    if index is not None:
        # A --processes child: its own log (resumed when it is restarted) and name; the parent runs the shipper.
        spool_dir = child_spool_dir(args.spool_dir, index)
        router_id = f"{args.router_id}-{index}" if args.router_id else router_id
        shipper = "external"
    try:
        return RouterConfig(
            server=ServerSettings.from_args(args),
            registry=args.registry,
            router_id=router_id,
            eject_after_failures=args.eject_after_failures,
            eject_duration_s=args.eject_duration_s,
            recorder=args.recorder,
            spool_dir=spool_dir,
            spool_max_bytes=args.spool_max_bytes,
            # One deployment-wide key serves router, recorder and replayer alike.
            hmac_key=args.hmac_key or os.environ.get("SPLITSTREAM_HMAC_KEY", ""),
            record_batch_size=args.record_batch_size,
            record_batch_interval_ms=args.record_batch_interval_ms,
            record_queue_size=args.record_queue_size,
            record_batch_max_bytes=args.record_batch_max_bytes,
            record_credential_headers=args.record_credential_headers,
            shipper=shipper,
            log_flush_interval_s=args.log_flush_interval_s,
            log_segment_bytes=args.log_segment_bytes,
            shipper_args=_shipper_args(args),
            shadow_timeout_s=args.shadow_timeout_s,
            shadow_max_in_flight=args.shadow_max_in_flight,
            record_stream_max_bytes=(
                args.record_stream_max_bytes
                if args.record_stream_max_bytes is not None
                else min(DEFAULT_RECORD_STREAM_MAX_BYTES, args.record_batch_max_bytes // 2)
            ),
            upstream_tls=client_tls_from_args(args, flag="--upstream-tls"),
            recorder_tls=client_tls_from_args(args, flag="--recorder-tls"),
            auth_principals=args.auth_principals,
            jwt=_jwt_settings(args),
            service_token=read_service_token(args.service_token_file),
            http_port=args.http_port,
        )
    except ConfigError as error:
        parser.error(str(error))
    raise AssertionError("unreachable: parser.error exits")


def child_spool_dir(spool_dir: str, index: int) -> str:
    """The write-ahead log directory of ``--processes`` child ``index``."""
    return os.path.join(spool_dir, f"proc-{index}")


def _shipper_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The child shipper's flags: what concerns shipping passes through as the router was given it. With
    ``--processes N`` the parent's one shipper ships every child's log directory, and the top directory
    first: what a router of another ``--processes`` (or an older router's spool) left is shipped, not stranded."""
    processes = getattr(args, "processes", 1)
    children = {child_spool_dir(args.spool_dir, i) for i in range(processes)} if processes > 1 else set()
    # A router that ran with another --processes left its children's logs here: ship them too.
    children |= {str(path) for path in Path(args.spool_dir).glob("proc-*") if path.is_dir()}
    log_dirs = [args.spool_dir, *sorted(children)]
    out = [
        "--recorder", args.recorder,
        *(flag for log_dir in log_dirs for flag in ("--log-dir", log_dir)),
        "--record-batch-size", str(args.record_batch_size),
        "--record-batch-interval-ms", str(args.record_batch_interval_ms),
        "--record-queue-size", str(args.record_queue_size),
        "--record-batch-max-bytes", str(args.record_batch_max_bytes),
        "--shadow-wait-s", str(args.shadow_timeout_s + 5.0),
        "--log-level", args.log_level,
        "--host", "127.0.0.1",
        "--port", "0",
        "--metrics-port", str(args.shipper_metrics_port),
        "--exit-with-parent",
    ]  # fmt: skip
    out += ["--metrics-host", args.metrics_host or args.host]  # where Prometheus reaches the router's own
    if args.service_token_file:
        out += ["--service-token-file", args.service_token_file]
    if args.recorder_tls:
        out.append("--recorder-tls")
    for suffix in ("ca", "cert", "key", "server_name"):
        value = getattr(args, f"recorder_tls_{suffix}")
        if value:
            out += [f"--recorder-tls-{suffix.replace('_', '-')}", value]
    return tuple(out)


def _jwt_settings(args: argparse.Namespace) -> JwtSettings | None:
    if not args.jwt_jwks:
        return None
    for flag, value in (
        ("--jwt-leeway-s", args.jwt_leeway_s),
        ("--jwks-refresh-s", args.jwks_refresh_s),
        ("--jwks-min-refresh-s", args.jwks_min_refresh_s),
    ):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{flag}: must be a finite number >= 0, got {value}")
    return JwtSettings(
        jwks=args.jwt_jwks,
        audience=args.jwt_audience,
        issuer=args.jwt_issuer,
        algorithms=parse_algorithms(args.jwt_algorithms),
        principal_claim=args.jwt_principal_claim,
        leeway_s=args.jwt_leeway_s,
        refresh_s=args.jwks_refresh_s,
        min_refresh_s=args.jwks_min_refresh_s,
    )


def open_registry(spec: str) -> Registry:
    """The registry ``spec`` names; ConfigError when it names none that can be opened."""
    scheme, _, location = spec.partition(":")
    if scheme == "file" and location:
        if not os.path.isfile(location):
            raise ConfigError(f"--registry: file '{location}' does not exist")
        return FileRegistry(location)
    if scheme == "consul":
        try:
            return ConsulRegistry(parse_consul_spec(spec))
        except ValueError as error:
            raise ConfigError(f"--registry: {redact_text(str(error))}") from None
    raise ConfigError(f"--registry: unknown registry '{redact_url(spec)}' (expected file:PATH or consul://HOST:PORT)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``splitstream-router``; exit codes as :mod:`splitstream.common.runtime` says."""
    config = parse_args(argv)
    configure_logging(config.server.log_level, service="router")
    try:
        registry = open_registry(config.registry)
    except ConfigError as error:
        fail(PROG, str(error))
    if config.server.processes > 1:
        return _supervise(config, sys.argv[1:] if argv is None else argv)
    return run_service(config.server, lambda: Router(config, registry), prog=PROG)


def _supervise(config: RouterConfig, argv: Sequence[str]) -> int:
    """``--processes N``: N routers on one port; with ``--shipper child`` one shipper for their N logs."""
    companion = None
    if config.recorder and config.shipper == "child":
        try:
            for index in range(config.server.processes):  # the shipper opens them before the children start
                os.makedirs(child_spool_dir(config.spool_dir, index), exist_ok=True)
        except OSError as error:
            fail(PROG, f"--spool-dir {config.spool_dir}: {error.strerror or error}")

        def companion(registry: CollectorRegistry) -> ShipperChild:
            return ShipperChild(config.shipper_args, registry, stop_timeout_s=15.0)

    return supervise(
        config.server, module="splitstream.router", argv=argv, prog=PROG, service="router", companion=companion
    )


class Router(Service):
    """The router's parts, wired for the shared runtime: the registry feeds the routing core; calls go
    through the servicer; answered calls go to shadows and the recording mirror."""

    prog = PROG
    grpc_services = (
        oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
        router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
        feedback_pb2.DESCRIPTOR.services_by_name["Feedback"].full_name,
    )

    def __init__(self, config: RouterConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.log = structlog.get_logger().bind(router_id=config.router_id)
        self.router_metrics = RouterMetrics()
        self.metrics = self.router_metrics.registry
        server = config.server
        self.core = RouterCore(
            settings=EndpointSettings(
                channel_options=(
                    ("grpc.max_receive_message_length", server.max_message_bytes),
                    ("grpc.max_send_message_length", server.max_message_bytes),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 2000),
                ),
                eject_after_failures=config.eject_after_failures,
                eject_duration_s=config.eject_duration_s,
                drain_timeout_s=server.shutdown_grace_s,
                tls=config.upstream_tls,
            ),
            metrics=self.router_metrics,
        )
        self.streams = StreamProxy(self.core, record_max_bytes=config.record_stream_max_bytes)
        self.servicer = RouterServicer(
            self.core, router_id=config.router_id, registry_description=registry.description, streams=self.streams
        )
        self.mirror: CallLog | None = None
        self.shipper: ShipperChild | None = None
        if config.recorder:
            try:
                self.mirror = CallLog(
                    config.spool_dir,
                    self.metrics,
                    router_id=config.router_id,
                    hmac_key=config.hmac_key.encode(),
                    max_bytes=config.spool_max_bytes,
                    segment_bytes=config.log_segment_bytes,
                    flush_interval_s=config.log_flush_interval_s,
                    record_credential_headers=config.record_credential_headers,
                )
            except OSError as error:  # a directory that cannot be created or read is the operator's to fix
                raise ConfigError(f"--spool-dir {config.spool_dir}: {error.strerror or error}") from None
            if process_index() is None:  # a --processes child's siblings are its sibling routers' logs
                self.mirror.warn_stranded(also=[SPOOL_DIR_DEFAULT])
            if config.shipper == "child":
                # It stops after the router's drain: its SIGTERM drain gets the recorder's ack timeout and some.
                self.shipper = ShipperChild(config.shipper_args, self.metrics, stop_timeout_s=15.0)
        self.shadows = ShadowRunner(
            self.core,
            self.router_metrics,
            self.mirror,
            timeout_s=config.shadow_timeout_s,
            max_in_flight=config.shadow_max_in_flight,
        )
        self.servicer.after_answer = self.shadows.after_answer
        self.feedback = FeedbackService(
            mirror=self.mirror,
            hmac_key=config.hmac_key.encode(),
            serves=self.core.serves,
            registry=self.metrics,
        )
        if self.mirror is not None:
            self.streams.on_end = self.mirror.offer  # streams have no shadows: recorded as they end
        self._updates: AsyncIterator[RegistryUpdate] | None = None
        # The HTTP front door: started after the gRPC server, stopped beside it (before_stop → teardown).
        self.http: HttpFrontDoor | None = None
        self._http_stop: asyncio.Task[None] | None = None
        if config.http_port:
            self.http = HttpFrontDoor(
                self.core,
                self.metrics,
                max_body_bytes=server.max_message_bytes,
                shutdown_grace_s=server.shutdown_grace_s,
            )
        self.principals: PrincipalsStore | None = None
        self.jwt: JwtVerifier | None = None
        self.auth: AuthInterceptor | None = None
        if config.auth_principals:
            self.auth_metrics = AuthMetrics(self.metrics)
            self.limiter = RateLimiter()
            self.principals = PrincipalsStore(open_principals(config.auth_principals), on_update=self._on_principals)
            self.jwt = JwtVerifier(config.jwt) if config.jwt is not None else None
            authenticator = Authenticator(self.principals, jwt=self.jwt, api_keys=True, limiter=self.limiter)
            self.auth = AuthInterceptor(authenticator, self.auth_metrics)

    def interceptors(self) -> list[aio.ServerInterceptor]:
        """Calls are counted first (refused ones too), then authenticated and authorized."""
        return [*self.servicer.interceptors(), *([self.auth] if self.auth is not None else [])]

    def _on_principals(self, policy: Policy | None, error: str) -> None:
        if policy is None:
            self.auth_metrics.reloads.labels("error").inc()
            return
        self.auth_metrics.reloads.labels("ok").inc()
        self.auth_metrics.principals.set(len(policy.principals))
        self.limiter.forget_except(frozenset(policy.principals))

    def register(self, server: aio.Server) -> None:
        server.add_generic_rpc_handlers(self.servicer.handlers())
        server.add_generic_rpc_handlers(self.feedback.handlers())

    async def prepare(self, runtime: Runtime) -> None:
        """Load the registry before the first call can arrive; unusable at start → ConfigError (exit 2)."""
        self._updates = self.registry.watch()
        try:
            first = await anext(self._updates)
        except Exception as error:  # a backend bug must still be one line, not a traceback
            raise ConfigError(f"registry {self.registry.description}: {error}") from None
        if first.state is None:
            raise ConfigError(f"registry {self.registry.description}: {first.error}")
        self._apply(first)
        if self.principals is not None:
            await self.principals.load()
            if self.jwt is not None:
                await self.jwt.keys.load()
            self.principals.start()
        if self.mirror is not None:
            self.mirror.start()
        if self.shipper is not None:
            self.shipper.start()
            await self.shipper.started()

    async def run(self, runtime: Runtime) -> None:
        if self.http is not None:
            server = self.config.server
            port = await self.http.start(server.host, self.config.http_port, server.tls)
            self.log.info("HTTP listening", host=server.host, http_port=port)
        self.servicer.ready = True
        await runtime.set_serving(True)
        self.log.info("router serving", registry=self.registry.description, models=self.core.model_names())
        renewal = asyncio.create_task(
            self.core.follow_upstream_credentials(poll_s=UPSTREAM_TLS_POLL_S), name="upstream TLS rotation"
        )
        try:
            await self._follow()
        finally:
            renewal.cancel()

    async def _follow(self) -> None:
        """Apply registry updates until cancelled, whatever goes wrong.

        An exception out of the backend's watch (or the watch ending) is logged, marks the registry
        unhealthy, shows in Status, keeps the last good state, and the watch starts again after
        :data:`WATCH_RESTART_DELAY_S` (its first update is the whole current state)."""
        last_problem = ""
        while True:
            if self._updates is None:
                self._updates = self.registry.watch()
            try:
                async for update in self._updates:
                    self._apply(update)
                    last_problem = ""
                problem = "the registry watch ended"
                trace = False
            except Exception as error:
                problem = f"the registry watch failed: {type(error).__name__}: {error}"
                trace = True
            self._updates = None
            self._report_error(problem)
            if problem != last_problem:  # once per distinct failure, not once a second while it lasts
                self.log.error(
                    "registry watch stopped; keeping the last good state and watching again",
                    error=problem,
                    exc_info=trace,
                )
            last_problem = problem
            await asyncio.sleep(WATCH_RESTART_DELAY_S)

    def _apply(self, update: RegistryUpdate) -> None:
        if update.state is None:
            self._report_error(update.error or "unknown error")
            self.log.error("registry update rejected; keeping the last good state", error=update.error)
            return
        try:
            self.core.apply(update.state)
        except Exception as error:
            self._report_error(f"cannot apply the registry state: {type(error).__name__}: {error}")
            self.log.exception("registry state could not be applied; keeping the last good state")
            return
        self.servicer.registry_error = redact_text(update.error or "")
        self.router_metrics.registry_updates.labels("partial" if update.error else "ok").inc()
        self.router_metrics.registry_healthy.set(0 if update.error else 1)
        self.log.info("registry applied", generation=self.core.generation, models=sorted(update.state.models))
        if update.error:
            self.log.error("registry state applied with parts kept from before", error=update.error)

    def _report_error(self, error: str) -> None:
        self.servicer.registry_error = redact_text(error)  # Status is read by anyone who can call the router
        self.router_metrics.registry_updates.labels("error").inc()
        self.router_metrics.registry_healthy.set(0)

    async def draining(self) -> None:
        self.servicer.ready = False  # ServerReady/ModelReady say false, beside health's NOT_SERVING

    async def before_stop(self) -> None:
        if self.http is not None:  # stops accepting now; its calls in flight get the grace beside gRPC's
            self._http_stop = asyncio.create_task(self.http.stop(), name="HTTP stop")

    async def teardown(self) -> None:
        """After the server stopped: shadows in flight finish (so their calls are recorded whole);
        every answered call is queued by now, so the mirror flushes to the recorder or the spool;
        worker channels close once their calls are done."""
        if self._http_stop is not None:  # HTTP streams end before the worker channels close
            await self._http_stop
        await self.shadows.close()
        if self.principals is not None:
            await self.principals.close()
        if self.mirror is not None:
            await self.mirror.close()
        if self.shipper is not None:
            await self.shipper.stop()
        if self._updates is not None and hasattr(self._updates, "aclose"):
            await self._updates.aclose()
        await self.core.close()
        self.log.info("router stopped")
