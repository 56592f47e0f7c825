"""The router's configuration: :class:`RouterConfig`, filled from flags and environment by :func:`parse_args`;
any value it refuses is a usage error naming the flag (exit 2, one line)."""

from __future__ import annotations

import argparse
import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from splitstream.common.cli import EnvArgumentParser
from splitstream.common.errors import ConfigError
from splitstream.common.protected_mode import check_protected_mode
from splitstream.common.runtime import ServerDefaults, ServerSettings, add_server_arguments, process_index
from splitstream.common.service_auth import SERVICE_TOKEN_ENV, read_service_token
from splitstream.common.shipping import (
    RecordBatchSettings,
    add_record_batch_arguments,
    check_recorder_address,
)
from splitstream.common.tls import PLAINTEXT, ClientTls, add_client_tls_arguments, client_tls_from_args
from splitstream.common.token_transport import (
    INSECURE_TOKEN_FLAG,
    INSECURE_TOKEN_HELP,
    check_token_accepted,
    check_token_sent,
)
from splitstream.router.auth.jwks import JwtSettings, parse_algorithms
from splitstream.router.auth.keys import read_api_key_secret
from splitstream.router.streams import DEFAULT_RECORD_STREAM_MAX_BYTES

PROG = "splitstream-router"
ENV_PREFIX = "SPLITSTREAM_ROUTER_"
#: Where a router logs unless told (--log-dir): looked at for a log left there by an earlier router. Its name
#: is from when the directory was called the spool; a router upgraded in place finds its log there.
LOG_DIR_DEFAULT = "splitstream-spool"
#: The log directory's flag before --log-dir (the shipper's name for it); taken, with a warning, for a release.
DEPRECATED_LOG_DIR_FLAG = "--spool-dir"
#: Deprecated flag → the flag that replaces it (their variables likewise: SPLITSTREAM_ROUTER_<FLAG>).
RENAMED_FLAGS = {DEPRECATED_LOG_DIR_FLAG: "--log-dir"}
#: An ``openai`` upstream's silence that ends a call (--upstream-idle-timeout-s): long enough for a long
#: prompt's prefill on a loaded server, and at most an hour, so a stalled upstream never holds a client forever.
DEFAULT_UPSTREAM_IDLE_TIMEOUT_S = 300.0
MAX_UPSTREAM_IDLE_TIMEOUT_S = 3600.0
#: How long a request body may take to arrive (--http-body-timeout-s): a trickled body must not hold a handler
#: forever; a minute carries the largest body (--max-message-bytes) over any link a client should use.
DEFAULT_HTTP_BODY_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """The router's flags, validated (ConfigError naming the flag). ``server`` holds the shared ones."""

    server: ServerSettings
    registry: str
    router_id: str
    eject_after_failures: int
    eject_duration_s: float
    recorder: str
    log_dir: str
    spool_max_bytes: int
    hmac_key: str
    #: Passed to the child shipper (the router batches nothing itself), checked here as the shipper does.
    record_batch: RecordBatchSettings
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
    #: ``--revoked-file``: JWTs (by jti) and principals refused before their credentials expire ("": none).
    revoked_file: str = ""
    #: ``--api-key-secret-file``'s secret: the key of the principals document's ``api_keys_hmac_sha256``.
    api_key_secret: bytes = field(default=b"", repr=False)
    #: Sent to the recorder on the Record stream ("": none).
    service_token: str = field(default="", repr=False)
    #: ``--allow-insecure-token``: send the token to a plaintext recorder on another host, and take callers'
    #: keys and JWTs on a plaintext port beyond loopback.
    allow_insecure_token: bool = False
    #: The HTTP front door's port (OpenAI-compatible API; 0: off).
    http_port: int = 0
    #: How long an ``openai`` upstream may send nothing (before its answer's first byte or between two)
    #: before the front door gives up on it: 504 to the client, or an error event mid-stream.
    upstream_idle_timeout_s: float = DEFAULT_UPSTREAM_IDLE_TIMEOUT_S
    #: How long a request's body may take to arrive before the front door answers 408.
    http_body_timeout_s: float = DEFAULT_HTTP_BODY_TIMEOUT_S
    #: Deprecated flags (of :data:`RENAMED_FLAGS`, or their variables) that were used: main() says so once
    #: logging is set up.
    deprecated: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_http()
        if self.eject_after_failures < 1:
            raise ConfigError("--eject-after-failures must be at least 1")
        for flag, value in (
            ("--eject-duration-s", self.eject_duration_s),
            ("--shadow-timeout-s", self.shadow_timeout_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{flag}: must be a finite number >= 0, got {value}")
        # A float, not a count: under a second is fine (0.2 bounds a machine crash's loss tighter); nan must be
        # refused explicitly (every comparison with it is false) or the flusher's first sleep would raise.
        if not (math.isfinite(self.log_flush_interval_s) and self.log_flush_interval_s > 0):
            raise ConfigError(f"--log-flush-interval-s: must be a finite number > 0, got {self.log_flush_interval_s}")
        if self.recorder:
            check_recorder_address(self.recorder)
            check_token_sent(
                token=self.service_token,
                target=self.recorder,
                tls=self.recorder_tls.enabled,
                allow_insecure=self.allow_insecure_token,
            )
        if self.recorder and not self.log_dir.strip():
            # ``--log-dir "$UNSET"`` would put the log (segments, cursor, lock) in the working directory.
            raise ConfigError("--log-dir: must name a directory, got an empty value")
        if self.recorder and not self.hmac_key:
            raise ConfigError("--recorder needs --hmac-key (or SPLITSTREAM_HMAC_KEY) for routing-key HMACs")
        if self.jwt is not None and not self.auth_principals:
            raise ConfigError("--jwt-jwks needs --auth-principals: a JWT's principal takes its grants from it")
        if self.api_key_secret and not self.auth_principals:
            raise ConfigError("--api-key-secret-file needs --auth-principals: it keys the document's API key digests")
        if self.revoked_file and not self.auth_principals:
            raise ConfigError("--revoked-file needs --auth-principals: without it no caller is authenticated")
        if self.auth_principals and self.record_credential_headers:
            raise ConfigError(
                "--record-credential-headers cannot be used with --auth-principals: records would keep callers' "
                "keys and tokens"
            )
        for flag, count in (
            ("--spool-max-bytes", self.spool_max_bytes),
            ("--log-segment-bytes", self.log_segment_bytes),
            ("--shadow-max-in-flight", self.shadow_max_in_flight),
        ):
            if count < 1:
                raise ConfigError(f"{flag}: must be positive, got {count}")
        if self.record_stream_max_bytes < 1:
            raise ConfigError(f"--record-stream-max-bytes: must be positive, got {self.record_stream_max_bytes}")
        if self.record_stream_max_bytes > self.record_batch.max_bytes // 2:
            # A stream record over the batch cap could only be dropped (the mirror's fitting keeps unary
            # payloads, not stream messages): keep it well inside.
            raise ConfigError(
                f"--record-stream-max-bytes {self.record_stream_max_bytes} must be at most half of "
                f"--record-batch-max-bytes ({self.record_batch.max_bytes})"
            )
        check_token_accepted(
            taken=bool(self.auth_principals),
            host=self.server.host,
            tls=self.server.tls is not None,
            allow_insecure=self.allow_insecure_token,
            what="--auth-principals",
        )
        check_protected_mode(
            host=self.server.host,
            tls=self.server.tls is not None,
            authenticated=bool(self.auth_principals),
            insecure=self.server.insecure,
            auth_flag="--auth-principals",
        )

    def _check_http(self) -> None:
        """--http-port: a port; --upstream-idle-timeout-s: bounded, so a stalled upstream always ends a call."""
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"--http-port: must be within 0..65535, got {self.http_port}")
        for flag, value in (
            ("--upstream-idle-timeout-s", self.upstream_idle_timeout_s),
            ("--http-body-timeout-s", self.http_body_timeout_s),
        ):
            if not (math.isfinite(value) and 0 < value <= MAX_UPSTREAM_IDLE_TIMEOUT_S):
                raise ConfigError(
                    f"{flag}: must be a number of seconds in (0, {MAX_UPSTREAM_IDLE_TIMEOUT_S:g}], got {value}"
                )


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog=PROG,
        env_prefix=ENV_PREFIX,
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
        "--http-body-timeout-s",
        type=float,
        default=DEFAULT_HTTP_BODY_TIMEOUT_S,
        help="how long a request's body may take to arrive on the HTTP port before the answer is a 408 "
        f"(at most {MAX_UPSTREAM_IDLE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--upstream-idle-timeout-s",
        type=float,
        default=DEFAULT_UPSTREAM_IDLE_TIMEOUT_S,
        help="how long an openai upstream, or a generating worker behind the HTTP front door, may send nothing, "
        "before its answer or between two pieces of a stream, before the front door gives up on it: 504 to the "
        "client, or an error event mid-stream "
        f"(at most {MAX_UPSTREAM_IDLE_TIMEOUT_S:g})",
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
        "--log-dir",
        default=LOG_DIR_DEFAULT,
        help="the write-ahead log directory: every answered call is appended here and shipped to the recorder "
        "by splitstream-shipper (its --log-dir; one directory per router process; with --processes N, child i "
        "logs to LOG_DIR/proc-i)",
    )
    recording.add_argument(
        DEPRECATED_LOG_DIR_FLAG,
        default=None,
        help="deprecated: the old name of --log-dir, taken with a warning until the next release",
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
        "this --log-dir with other routers'",
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
        file_flag="--hmac-key-file",
    )
    add_record_batch_arguments(recording, passed=" (passed to the child shipper)")
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
    auth.add_argument(
        "--allow-insecure-jwks",
        action="store_true",
        help="fetch an http:// --jwt-jwks from a host other than loopback (refused by default: anyone on the "
        "path could swap in their key)",
    )
    auth.add_argument(INSECURE_TOKEN_FLAG, action="store_true", help=INSECURE_TOKEN_HELP)
    auth.add_argument(
        "--api-key-secret-file",
        default="",
        help="file holding the secret (at least 32 characters: openssl rand -hex 32) that keys the HMAC-SHA256 of "
        "API keys in the principals document (api_keys_hmac_sha256, written by 'splitstream keys add')",
    )
    auth.add_argument(
        "--revoked-file",
        default="",
        help="revocation list: one 'jti:<id>' or 'principal:<name>' a line (# comments); re-read on change and "
        "on SIGHUP (which re-reads the JWKS too); a listed credential is refused UNAUTHENTICATED",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> RouterConfig:
    """Flags (and SPLITSTREAM_ROUTER_* variables) → config; a usage error exits 2 with one line.

    The one place flags map to settings: a new flag is added in :func:`build_parser` and here."""
    parser = build_parser()
    args = parser.parse_args(argv)
    index = process_index()
    router_id = args.router_id or f"{socket.gethostname()}-{os.getpid()}"
    deprecated: tuple[str, ...] = ()
    if args.spool_dir is not None:
        if args.log_dir not in (LOG_DIR_DEFAULT, args.spool_dir):
            parser.error(f"{DEPRECATED_LOG_DIR_FLAG} is the old name of --log-dir: give --log-dir only")
        args.log_dir = args.spool_dir
        deprecated = (DEPRECATED_LOG_DIR_FLAG,)
    log_dir = args.log_dir
    shipper = args.shipper
    if index is not None:
        # A --processes child: its own log (resumed when it is restarted) and name; the parent runs the shipper.
        log_dir = child_log_dir(args.log_dir, index)
        router_id = f"{args.router_id}-{index}" if args.router_id else router_id
        shipper = "external"
    try:
        record_batch = RecordBatchSettings.from_args(args)
        return RouterConfig(
            server=ServerSettings.from_args(args),
            registry=args.registry,
            router_id=router_id,
            eject_after_failures=args.eject_after_failures,
            eject_duration_s=args.eject_duration_s,
            recorder=args.recorder,
            log_dir=log_dir,
            spool_max_bytes=args.spool_max_bytes,
            # One deployment-wide key serves router, recorder and replayer alike.
            hmac_key=args.hmac_key or os.environ.get("SPLITSTREAM_HMAC_KEY", ""),
            record_batch=record_batch,
            record_credential_headers=args.record_credential_headers,
            shipper=shipper,
            log_flush_interval_s=args.log_flush_interval_s,
            log_segment_bytes=args.log_segment_bytes,
            shipper_args=_shipper_args(args, record_batch),
            shadow_timeout_s=args.shadow_timeout_s,
            shadow_max_in_flight=args.shadow_max_in_flight,
            record_stream_max_bytes=(
                args.record_stream_max_bytes
                if args.record_stream_max_bytes is not None
                else min(DEFAULT_RECORD_STREAM_MAX_BYTES, record_batch.max_bytes // 2)
            ),
            upstream_tls=client_tls_from_args(args, flag="--upstream-tls"),
            recorder_tls=client_tls_from_args(args, flag="--recorder-tls"),
            auth_principals=args.auth_principals,
            jwt=_jwt_settings(args),
            revoked_file=args.revoked_file,
            api_key_secret=read_api_key_secret(args.api_key_secret_file) if args.api_key_secret_file else b"",
            service_token=read_service_token(args.service_token_file),
            allow_insecure_token=args.allow_insecure_token,
            http_port=args.http_port,
            upstream_idle_timeout_s=args.upstream_idle_timeout_s,
            http_body_timeout_s=args.http_body_timeout_s,
            deprecated=deprecated,
        )
    except ConfigError as error:
        parser.error(str(error))
    raise AssertionError("unreachable: parser.error exits")


def child_log_dir(log_dir: str, index: int) -> str:
    """The write-ahead log directory of ``--processes`` child ``index``."""
    return os.path.join(log_dir, f"proc-{index}")


def _shipper_args(args: argparse.Namespace, record_batch: RecordBatchSettings) -> tuple[str, ...]:
    """The child shipper's flags: what concerns shipping passes through as the router was given it. With
    ``--processes N`` the parent's one shipper ships every child's log directory, and the top directory
    first: what a router of another ``--processes`` (or an older router's spool) left is shipped, not stranded."""
    processes = getattr(args, "processes", 1)
    children = {child_log_dir(args.log_dir, i) for i in range(processes)} if processes > 1 else set()
    # A router that ran with another --processes left its children's logs here: ship them too.
    children |= {str(path) for path in Path(args.log_dir).glob("proc-*") if path.is_dir()}
    log_dirs = [args.log_dir, *sorted(children)]
    out = [
        "--recorder", args.recorder,
        *(flag for log_dir in log_dirs for flag in ("--log-dir", log_dir)),
        *record_batch.flags(),
        "--shadow-wait-s", str(args.shadow_timeout_s + 5.0),
        "--log-level", args.log_level,
        "--host", "127.0.0.1",
        "--port", "0",
        "--metrics-port", str(args.shipper_metrics_port),
        "--exit-with-parent",
    ]  # fmt: skip
    if args.metrics_host:  # where Prometheus reaches the router's own; else the shipper's loopback default
        out += ["--metrics-host", args.metrics_host]
    if args.service_token_file:
        out += ["--service-token-file", args.service_token_file]
    if args.allow_insecure_token:
        out.append(INSECURE_TOKEN_FLAG)
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
        allow_insecure=args.allow_insecure_jwks,
    )
