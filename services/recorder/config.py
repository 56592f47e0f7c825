"""The recorder's configuration: one pydantic schema (:class:`RecorderConfig`), filled from flags and
environment in ``main()``; any value it refuses is a usage error naming the flag (exit 2, one line)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, InstanceOf, model_validator

from splitstream.common.caller_identities import parse_identities
from splitstream.common.cli import EnvArgumentParser
from splitstream.common.errors import ConfigError
from splitstream.common.protected_mode import check_protected_mode
from splitstream.common.redis_settings import RedisSecurity, add_redis_security_arguments, redis_security_from_args
from splitstream.common.runtime import SERVER_ARGUMENTS, ServerDefaults, ServerSettings, add_server_arguments
from splitstream.common.schema import Document, validate
from splitstream.common.secrets import redact_url
from splitstream.common.service_auth import SERVICE_TOKEN_ENV, read_service_token
from splitstream.common.token_transport import INSECURE_TOKEN_FLAG, INSECURE_TOKEN_HELP, check_token_accepted

PROG = "splitstream-recorder"
#: The HMAC key is shared with the routers (they HMAC routing keys with it), hence a
#: deployment-wide variable beside the recorder's own SPLITSTREAM_RECORDER_HMAC_KEY.
SHARED_HMAC_KEY_ENV = "SPLITSTREAM_HMAC_KEY"
DAY_S = 86400.0
#: The longest --retention-age-s and --blob-ttl-s (about 31,700 years): Redis refuses an expiry past
#: int64 milliseconds (every batch with a blob, every feedback event with a key), so a longer one is
#: refused at start rather than losing records at the first write. Longer than any retention is meant.
MAX_KEEP_S = 10**12
#: --redis-timeout-s and --health-interval-s: from a millisecond (below it every PING times out and the recorder
#: never serves; an interval of 1e-300 would PING Redis in a busy loop) to an hour (past it a dead Redis would hold
#: a batch, and the router's stream, for ever; 1e300 makes each WAIT's timeout one Redis refuses, so with
#: --redis-wait-replicas every batch would be refused and routers would drop its records).
MIN_REDIS_WAIT_S = 0.001
MAX_REDIS_WAIT_S = 3600.0
#: --redis-wait-replicas: more replicas than any deployment has (WAIT for more than exist fails every batch).
MAX_WAIT_REPLICAS = 100
#: Redis reads counts (MAXLEN) as a signed 64-bit integer: past it every XADD is refused ("value is not an
#: integer or out of range") and routers, halving the refused batches, would drop every record.
MAX_REDIS_INT = 2**63 - 1
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


class Action(Enum):
    """What redaction does to a sensitive value."""

    DROP = "drop"
    #: Metadata: replaced by ``hmac:<hex>`` (equal values stay comparable). Inputs, outputs: data zeroed.
    MASK = "mask"


@dataclass(frozen=True, slots=True)
class Rule:
    """One redaction rule; a plain value (built positionally by the redactor's tests and callers)."""

    name: str
    action: Action

    @classmethod
    def parse(cls, spec: str, *, what: str) -> Rule:
        """``NAME``, ``NAME:drop`` or ``NAME:mask``; a bare name drops. Tensor names may contain ':'
        (``input:0``), so only a trailing ``:drop``/``:mask`` is read as the action. Raises ConfigError."""
        name, sep, suffix = spec.strip().rpartition(":")
        if sep and suffix in {a.value for a in Action}:
            action = Action(suffix)
        else:
            name, action = spec.strip(), Action.DROP
        if not name:
            raise ConfigError(f"{what} rule {spec!r} names nothing (expected NAME[:drop|mask])")
        return cls(name, action)


RedisSeconds = Annotated[float, Field(ge=MIN_REDIS_WAIT_S, le=MAX_REDIS_WAIT_S)]


class RecorderConfig(Document):
    """Validated settings; each field is the flag of the same name (``redis_url`` ← ``--redis-url``); the
    flags every server shares are validated by the runtime's :class:`ServerSettings`."""

    server: InstanceOf[ServerSettings]
    redis_url: str
    redis_timeout_s: RedisSeconds
    health_interval_s: RedisSeconds
    retention_maxlen: Annotated[int, Field(ge=0, le=MAX_REDIS_INT)]
    retention_age_s: Annotated[float, Field(ge=0, le=MAX_KEEP_S)]
    blob_threshold_bytes: Annotated[int, Field(ge=0, le=MAX_REDIS_INT)]
    blob_ttl_s: Annotated[int, Field(ge=0, le=MAX_KEEP_S)]
    trim_archived: bool = False
    redis_wait_replicas: Annotated[int, Field(ge=0, le=MAX_WAIT_REPLICAS)] = 0
    redact_metadata: tuple[Rule, ...]
    redact_input: tuple[Rule, ...]
    redact_output: tuple[Rule, ...]
    hmac_key: bytes
    redis_security: InstanceOf[RedisSecurity] = RedisSecurity()
    #: The routers' shared service token ("": the recorder takes records from anyone who can reach it).
    service_token: str = Field(default="", repr=False)
    #: Subject CNs / DNS SANs of the routers' client certificates taken (empty: any the CA signed).
    allowed_client_identities: frozenset[str] = frozenset()

    @model_validator(mode="after")
    def _consistent(self) -> RecorderConfig:
        try:
            scheme = urlsplit(self.redis_url).scheme
        except ValueError as error:  # "Invalid IPv6 URL": the flag named, as the other commands name it
            raise ValueError(f"--redis-url {redact_url(self.redis_url)}: {error}") from None
        if scheme not in REDIS_SCHEMES:
            raise ValueError(
                "--redis-url must start with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster:// "
                f"(got scheme {scheme or 'none'!r})"
            )
        # Masked metadata becomes an HMAC of its value; masked tensors are zeroed and need no key.
        masks = [r for r in self.redact_metadata if r.action is Action.MASK]
        if masks and not self.hmac_key:
            raise ValueError(
                f"masking metadata ({', '.join(r.name for r in masks)}) needs an HMAC key: set {SHARED_HMAC_KEY_ENV} "
                "or --hmac-key"
            )
        return self

    @property
    def effective_blob_ttl_s(self) -> int:
        """Blobs outlive the records that reference them: at least the age retention plus a day.

        0 keeps blobs without expiry (only sensible when streams are not trimmed by age either)."""
        if self.blob_ttl_s == 0:
            return 0
        if self.retention_age_s:
            return max(self.blob_ttl_s, int(self.retention_age_s + DAY_S))
        return self.blob_ttl_s

    @property
    def needs_request_decoding(self) -> bool:
        return bool(self.redact_input)

    @property
    def needs_response_decoding(self) -> bool:
        return bool(self.redact_output)


class _Repeatable(argparse.Action):
    """Append each use of the flag; the first use on the command line replaces a value from the environment."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        current = getattr(namespace, self.dest, None)
        items = current if isinstance(current, list) else []
        setattr(namespace, self.dest, [*items, values])


def _rules(value: str | list[str] | None, *, what: str) -> tuple[Rule, ...]:
    """Rules from repeated flags or from one comma-separated environment value."""
    specs = value if isinstance(value, list) else [value or ""]
    parts = [part for spec in specs for part in spec.split(",") if part.strip()]
    return tuple(Rule.parse(part, what=what) for part in parts)


ENV_PREFIX = "SPLITSTREAM_RECORDER_"


def build_parser() -> argparse.ArgumentParser:
    # Typed as the base class: its error() is known to exit (NoReturn).
    parser: argparse.ArgumentParser = EnvArgumentParser(
        prog=PROG,
        env_prefix=ENV_PREFIX,
        description=(
            "Receive batches of call records from routers (splitstream.v1.Recorder/Record), redact them, "
            "and write them to Redis Streams (splitstream:calls:<model>), large payloads once by SHA-256."
        ),
    )
    # No drain delay by default: routers stream to the recorder and retry or spool, they do not balance on health.
    add_server_arguments(
        parser,
        ServerDefaults(
            port=8003, metrics_port=8004, max_message_bytes=128 * 1024 * 1024, drain_delay_s=0.0, shutdown_grace_s=10.0
        ),
        processes=True,
    )
    parser.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="Redis to write to: redis://[:PASSWORD@]HOST:PORT/DB, rediss://... for TLS, unix:///PATH?db=N",
        secret=True,
    )
    add_redis_security_arguments(parser.add_argument_group("Redis TLS and ACL user (see docs/security.md)"))
    parser.add_argument(
        "--redis-timeout-s",
        type=float,
        default=2.0,
        help="connect and reply timeout for Redis; a dead Redis fails a batch within about this long "
        f"({MIN_REDIS_WAIT_S:g}..{MAX_REDIS_WAIT_S:g})",
    )
    parser.add_argument(
        "--redis-wait-replicas",
        type=int,
        default=0,
        help="a batch is acknowledged only once this many replicas of each master it wrote to hold it "
        f"(WAIT; 0: once the master does; at most {MAX_WAIT_REPLICAS}). With 1, a master lost in a failover loses "
        "no acknowledged record",
    )
    parser.add_argument(
        "--health-interval-s",
        type=float,
        default=1.0,
        help="how often Redis is PINGed for the health status (NOT_SERVING while it does not answer; "
        f"{MIN_REDIS_WAIT_S:g}..{MAX_REDIS_WAIT_S:g})",
    )
    parser.add_argument(
        "--retention-maxlen",
        type=int,
        default=0,
        help="keep about this many records per model stream (XADD MAXLEN ~; 0: no count limit)",
    )
    parser.add_argument(
        "--retention-age-s",
        type=float,
        default=0.0,
        help="drop records older than this many seconds (XADD MINID ~; 0: no age limit)",
    )
    parser.add_argument(
        "--trim-archived",
        action="store_true",
        help="retention trims only what splitstream-archive has archived (its mark in Redis); with the "
        "archiver down, Redis keeps everything past the retention (trims held back are counted)",
    )
    parser.add_argument(
        "--blob-threshold-bytes",
        type=int,
        default=65536,
        help="payloads larger than this are stored once at splitstream:blob:<sha256> and referenced",
    )
    parser.add_argument(
        "--blob-ttl-s",
        type=int,
        default=7 * 86400,
        help="blob expiry, refreshed on every reference; raised to --retention-age-s + 1 day if shorter "
        "(0: never expire)",
    )
    parser.add_argument(
        "--redact-metadata",
        action=_Repeatable,
        default=None,
        metavar="KEY[:drop|mask]",
        help="request metadata key to drop, or mask as hmac:<HMAC-SHA256 hex> (repeatable; "
        "comma-separated in the environment)",
    )
    parser.add_argument(
        "--redact-input",
        action=_Repeatable,
        default=None,
        metavar="NAME[:drop|mask]",
        help="input tensor to drop from recorded requests, or keep with its data zeroed (repeatable; "
        "comma-separated in the environment)",
    )
    parser.add_argument(
        "--redact-output",
        action=_Repeatable,
        default=None,
        metavar="NAME[:drop|mask]",
        help="output tensor to drop from recorded responses (shadows' too), or keep with its data zeroed; "
        "replay does not compare it (repeatable; comma-separated in the environment)",
    )
    parser.add_argument(
        "--hmac-key",
        default=None,
        help=f"key for masking metadata (prefer the environment: {SHARED_HMAC_KEY_ENV}, shared with the routers)",
        secret=True,
        file_flag="--hmac-key-file",
    )
    parser.add_argument(
        "--service-token-file",
        default="",
        help=f"file holding the routers' shared service token; records are then taken only from calls that "
        f"carry it (else {SERVICE_TOKEN_ENV}; neither: records are taken from anyone who can connect)",
    )
    parser.add_argument(
        "--allowed-client-identities",
        action=_Repeatable,
        default=None,
        metavar="NAME[,NAME...]",
        help="with --grpc-use-ssl-mutual: take records only from routers whose verified client certificate "
        "names one of these (subject CN, a DNS SAN, or a spiffe:// URI SAN; no other SAN type); others are "
        "refused UNAUTHENTICATED before a message is read (repeatable; comma-separated in the environment). A call "
        "carrying the service token is taken too",
    )
    parser.add_argument(INSECURE_TOKEN_FLAG, action="store_true", help=INSECURE_TOKEN_HELP)
    return parser


def parse_args(argv: Sequence[str] | None) -> RecorderConfig:
    """Parse flags (and SPLITSTREAM_RECORDER_* variables); usage errors exit 2 with one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        security = {"redis_tls_ca", "redis_tls_cert", "redis_tls_key", "redis_username", "redis_password_file"}
        values = {
            name: value for name, value in vars(args).items() if name not in SERVER_ARGUMENTS and name not in security
        }
        values["redis_security"] = redis_security_from_args(args, url=args.redis_url, env_prefix=ENV_PREFIX)
        values["server"] = ServerSettings.from_args(args)
        values["redact_metadata"] = tuple(
            Rule(rule.name.lower(), rule.action) for rule in _rules(args.redact_metadata, what="--redact-metadata")
        )
        values["redact_input"] = _rules(args.redact_input, what="--redact-input")
        values["redact_output"] = _rules(args.redact_output, what="--redact-output")
        values.pop("hmac_key_file")  # read into hmac_key by the parser
        key = args.hmac_key if args.hmac_key is not None else os.environ.get(SHARED_HMAC_KEY_ENV, "")
        values["hmac_key"] = key.encode()
        values["service_token"] = read_service_token(values.pop("service_token_file"))
        check_token_accepted(
            taken=bool(values["service_token"]),
            host=values["server"].host,
            tls=args.grpc_use_ssl or args.grpc_use_ssl_mutual,
            allow_insecure=values.pop("allow_insecure_token"),
        )
        values["allowed_client_identities"] = _identities(args.allowed_client_identities, args.grpc_use_ssl_mutual)
        check_protected_mode(
            host=values["server"].host,
            tls=values["server"].tls is not None,
            authenticated=bool(values["service_token"] or values["allowed_client_identities"]),
            insecure=values["server"].insecure,
            auth_flag="--service-token-file",
        )
        return validate(RecorderConfig, values, rename=_flag)
    except ConfigError as error:
        parser.error(str(error))


def _identities(value: str | list[str] | None, mutual: bool) -> frozenset[str]:
    """The allow-list, matched as the workers' (:mod:`splitstream.common.caller_identities`)."""
    return parse_identities(value, mutual=mutual)


def _flag(field: str) -> str:
    """``redis_timeout_s`` → ``--redis-timeout-s``: errors name what the user typed."""
    return "--" + field.replace("_", "-")
