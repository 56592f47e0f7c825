"""How a command is told to reach Redis securely: the TLS and ACL flags, what they mean, the URL schemes.

Apart from :mod:`splitstream.common.redis_url` (the client factory) because every command's parser needs
these and redis-py costs a tenth of a second of CPU to import: a command that only parses its flags, or
fails on one, starts without it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from splitstream.common.errors import ConfigError

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
TLS_SCHEMES = ("rediss", "rediss+cluster")


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


@dataclass(frozen=True, kw_only=True)
class RedisSecurity:
    """TLS files and ACL credentials for a Redis client, beside its URL (which wins where both say).

    The password never has to be in argv: it comes from the URL, ``--redis-password-file`` or the
    process's ``<PREFIX>REDIS_PASSWORD`` variable (``SPLITSTREAM_RECORDER_REDIS_PASSWORD``, ...)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    username: str = ""
    password: str = field(default="", repr=False)

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for ``Redis.from_url`` (the URL's own userinfo and query still win)."""
        options: dict[str, Any] = {}
        if self.ca_file:
            options["ssl_ca_certs"] = self.ca_file
        if self.cert_file:
            options["ssl_certfile"] = self.cert_file
            options["ssl_keyfile"] = self.key_file
        if self.username:
            options["username"] = self.username
        if self.password:
            options["password"] = self.password
        return options


def add_redis_security_arguments(group: Any) -> None:
    """``--redis-tls-ca/-cert/-key``, ``--redis-username``, ``--redis-password-file`` on ``group``."""
    group.add_argument("--redis-tls-ca", default="", help="PEM CA bundle Redis's certificate must chain to (rediss://)")
    group.add_argument("--redis-tls-cert", default="", help="PEM client certificate for Redis (tls-auth-clients)")
    group.add_argument("--redis-tls-key", default="", help="PEM private key of --redis-tls-cert")
    group.add_argument("--redis-username", default="", help="Redis ACL user (else the URL's, else 'default')")
    group.add_argument(
        "--redis-password-file",
        default="",
        help="file holding the Redis password (else the URL's, else the REDIS_PASSWORD variable of this command)",
    )


def redis_security_from_args(args: Any, *, url: str, env_prefix: str) -> RedisSecurity:
    """The :class:`RedisSecurity` the flags describe; ConfigError naming the flag for what cannot be used."""
    from splitstream.common.tls import check_ca, check_key_pair  # one module checks PEM files for everyone

    ca, cert, key = args.redis_tls_ca, args.redis_tls_cert, args.redis_tls_key
    if (ca or cert or key) and urlsplit(url).scheme not in TLS_SCHEMES:
        raise ConfigError(
            "--redis-tls-ca/--redis-tls-cert/--redis-tls-key need a rediss:// or rediss+cluster:// --redis-url"
        )
    if bool(cert) != bool(key):
        raise ConfigError("--redis-tls-cert and --redis-tls-key go together")
    if ca:
        check_ca(ca, "--redis-tls-ca")
    if cert:
        check_key_pair(cert, key, cert_flag="--redis-tls-cert", key_flag="--redis-tls-key")
    password = os.environ.get(f"{env_prefix}REDIS_PASSWORD", "")
    if args.redis_password_file:
        try:
            with open(args.redis_password_file, encoding="utf-8") as handle:
                password = handle.read().strip()
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise ConfigError(f"--redis-password-file {args.redis_password_file}: {reason}") from None
        if not password:
            raise ConfigError(f"--redis-password-file {args.redis_password_file}: the file is empty")
    return RedisSecurity(ca_file=ca, cert_file=cert, key_file=key, username=args.redis_username, password=password)


#: No TLS files, no credentials beside the URL's.
NO_REDIS_SECURITY = RedisSecurity()
