"""TLS for every splitstream gRPC hop: server credentials that follow rotated files, client credentials.

Servers (router, worker, recorder) serve through ``grpc.dynamic_ssl_server_credentials``: gRPC asks
a certificate fetcher for the configuration at every TLS handshake, and :class:`CertificateFetcher`
answers ``None`` ("keep what you have") unless one of the files changed (size, mtime or inode,
then content). A certificate renewed in place, or replaced by a rename as cert-manager and most
tools do, is therefore served to the next connection without a restart; connections already open
keep the session they negotiated. A rotation caught half-written (a new certificate beside the old
key) is refused and logged, and the previous pair goes on being served until the files match again.
``grpc.aio`` servers accept these credentials (checked: a test reads the served serial before and
after a rotation).

Clients read their files each time they build a channel (:meth:`ClientTls.credentials`): gRPC's
Python API has no dynamic *channel* credentials, so a rotated client certificate is picked up by
the next channel. The router makes one for a newly listed endpoint and for each reconnect to the
recorder, and it polls its ``--upstream-tls-*`` files (:class:`ClientFilesWatch`, the same
size/mtime/inode-then-content check as the servers') to replace the channel of every worker it
keeps open, draining the old one, once they change.

Errors in what an operator gave (a file missing, unreadable, not PEM, a key that does not belong to
the certificate) are :class:`ConfigError` naming the flag, found when the process starts.
"""

from __future__ import annotations

import hashlib
import os
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
from grpc import aio

from splitstream.common.errors import ConfigError

log = structlog.get_logger()


def read_pem(path: str, flag: str) -> bytes:
    """The bytes of the PEM file ``path``; ConfigError naming ``flag`` when it cannot be used."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise ConfigError(f"{flag} {path}: {error.strerror or error}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file")
    return data


def check_key_pair(cert_file: str, key_file: str, *, cert_flag: str, key_flag: str) -> None:
    """ConfigError unless ``key_file`` is the private key of the certificate in ``cert_file``.

    The standard library's OpenSSL does the check (``load_cert_chain``); gRPC's own failure for a
    mismatched pair is a handshake that never completes, with a line of its C core on stderr."""
    read_pem(cert_file, cert_flag)
    read_pem(key_file, key_flag)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as error:
        reason = error.reason or str(error)
        if "KEY_VALUES_MISMATCH" in reason.upper() or "mismatch" in str(error).lower():
            raise ConfigError(f"{key_flag} {key_file}: not the private key of {cert_flag} {cert_file}") from None
        raise ConfigError(f"{cert_flag} {cert_file} / {key_flag} {key_file}: cannot be loaded ({reason})") from None
    except OSError as error:
        raise ConfigError(f"{cert_flag} {cert_file} / {key_flag} {key_file}: {error.strerror or error}") from None


def check_ca(path: str, flag: str) -> None:
    """ConfigError unless ``path`` holds at least one PEM certificate OpenSSL accepts as a trust root."""
    read_pem(path, flag)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as error:
        raise ConfigError(f"{flag} {path}: not a CA certificate bundle ({error})") from None


@dataclass(frozen=True, kw_only=True)
class ServerTls:
    """A server's TLS: its certificate and key, and for mutual TLS the CA its clients' certificates must
    chain to (a client without one is refused during the handshake)."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""
    mutual: bool = False

    def check(self) -> None:
        """ConfigError (naming the Triton-style flags) for a file that is missing, unreadable or mismatched."""
        check_key_pair(self.cert_file, self.key_file, cert_flag="--grpc-server-cert", key_flag="--grpc-server-key")
        if self.client_ca_file:
            check_ca(self.client_ca_file, "--grpc-root-cert")

    def credentials(self) -> grpc.ServerCredentials:
        """Dynamic credentials: the files are re-read by the fetcher when they change (module docstring)."""
        fetcher = CertificateFetcher(self)
        return grpc.dynamic_ssl_server_credentials(
            fetcher.initial(), fetcher, require_client_authentication=self.mutual
        )


class CertificateFetcher:
    """gRPC's certificate-configuration fetcher: called at every handshake, from gRPC's threads.

    Cheap when nothing changed (three ``stat`` calls); never raises (an exception inside gRPC's
    callback would fail the handshake); logs a rotation it could not use once per state of the files."""

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls
        self._lock = threading.Lock()
        self._stamp: tuple[tuple[int, int, int], ...] = ()
        self._digest = b""
        self._refused_stamp: tuple[tuple[int, int, int], ...] = ()
        self.serves = 0  # how many configurations were handed to gRPC (1 at start, +1 per rotation)

    def _files(self) -> list[str]:
        return [
            self._tls.cert_file,
            self._tls.key_file,
            *([self._tls.client_ca_file] if self._tls.client_ca_file else []),
        ]

    def _stamp_now(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in self._files():
            status = os.stat(path)
            stamps.append((status.st_mtime_ns, status.st_size, status.st_ino))
        return tuple(stamps)

    def _load(self) -> tuple[grpc.ServerCertificateConfiguration, bytes]:
        self._tls.check()
        cert = read_pem(self._tls.cert_file, "--grpc-server-cert")
        key = read_pem(self._tls.key_file, "--grpc-server-key")
        root = read_pem(self._tls.client_ca_file, "--grpc-root-cert") if self._tls.client_ca_file else None
        digest = hashlib.sha256(b"\0".join([cert, key, root or b""])).digest()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=root), digest

    def initial(self) -> grpc.ServerCertificateConfiguration:
        """The configuration to start with; ConfigError when the files cannot be used."""
        with self._lock:
            self._stamp = self._stamp_now()
            configuration, self._digest = self._load()
            self.serves = 1
            return configuration

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            with self._lock:
                stamp = self._stamp_now()
                if stamp == self._stamp or stamp == self._refused_stamp:
                    return None
                try:
                    configuration, digest = self._load()
                except ConfigError as error:
                    self._refused_stamp = stamp
                    log.warning("rotated TLS files not usable; serving the previous certificate", error=str(error))
                    return None
                self._stamp = stamp
                if digest == self._digest:  # touched, not changed
                    return None
                self._digest = digest
                self.serves += 1
                log.info("TLS certificate reloaded", cert_file=self._tls.cert_file)
                return configuration
        except Exception as error:  # a file gone mid-rotation: keep serving what we have
            log.warning("TLS files not readable; serving the previous certificate", error=str(error))
            return None


@dataclass(frozen=True, kw_only=True)
class ClientTls:
    """TLS for one kind of outgoing channel (off unless ``enabled``). ``ca_file`` empty: the system's
    roots; ``cert_file``/``key_file``: the client certificate for mutual TLS; ``server_name``: the name
    the server's certificate must carry when it is not the host dialled (``grpc.ssl_target_name_override``).
    ``flag`` is the flag prefix errors name (``--upstream-tls``)."""

    enabled: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    flag: str = "--tls"

    def check(self) -> None:
        """ConfigError naming the flag for a file that is missing, unreadable or mismatched."""
        if not self.enabled:
            return
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError(f"{self.flag}-cert and {self.flag}-key go together (mutual TLS needs both)")
        if self.ca_file:
            check_ca(self.ca_file, f"{self.flag}-ca")
        if self.cert_file:
            check_key_pair(self.cert_file, self.key_file, cert_flag=f"{self.flag}-cert", key_flag=f"{self.flag}-key")

    def credentials(self) -> grpc.ChannelCredentials:
        """Read from the files now (a rotated client certificate is used by the next channel made)."""
        root = read_pem(self.ca_file, f"{self.flag}-ca") if self.ca_file else None
        cert = read_pem(self.cert_file, f"{self.flag}-cert") if self.cert_file else None
        key = read_pem(self.key_file, f"{self.flag}-key") if self.key_file else None
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.enabled and self.server_name else []

    def aio_channel(self, address: str, options: Sequence[tuple[str, int | str]] = ()) -> aio.Channel:
        """A ``grpc.aio`` channel to ``address``: secure when enabled, plaintext otherwise."""
        if not self.enabled:
            return aio.insecure_channel(address, options=list(options))
        return aio.secure_channel(address, self.credentials(), options=[*options, *self.channel_options()])

    def channel(self, address: str, options: Sequence[tuple[str, int | str]] = ()) -> grpc.Channel:
        """A blocking channel to ``address`` (CLIs): secure when enabled, plaintext otherwise."""
        if not self.enabled:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self.credentials(), options=[*options, *self.channel_options()])


class ClientFilesWatch:
    """Whether a client's TLS files changed since the last look: three ``stat`` calls when they did not.

    A change is reported once the files' content differs (a ``touch`` is not one) and they form a usable
    set again (a certificate caught beside the old key is waited out, logged once per state of the files),
    so a channel is never rebuilt from half-rotated files. Never raises: a file gone mid-rotation is a
    rotation not finished yet."""

    def __init__(self, tls: ClientTls) -> None:
        self._tls = tls
        self._files = [path for path in (tls.ca_file, tls.cert_file, tls.key_file) if path]
        self._stamp = self._stamp_now()
        self._digest = self._digest_now()
        self._refused_stamp: tuple[tuple[int, int, int], ...] = ()

    @property
    def watching(self) -> bool:
        return self._tls.enabled and bool(self._files)

    def _stamp_now(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in self._files:
            try:
                status = os.stat(path)
            except OSError:
                stamps.append((-1, -1, -1))
                continue
            stamps.append((status.st_mtime_ns, status.st_size, status.st_ino))
        return tuple(stamps)

    def _digest_now(self) -> bytes:
        digest = hashlib.sha256()
        for path in self._files:
            try:
                with open(path, "rb") as handle:
                    digest.update(handle.read())
            except OSError:
                digest.update(b"\0missing")
            digest.update(b"\0")
        return digest.digest()

    def changed(self) -> bool:
        stamp = self._stamp_now()
        if stamp == self._stamp or stamp == self._refused_stamp:
            return False
        digest = self._digest_now()
        if digest == self._digest:  # touched, not changed
            self._stamp = stamp
            return False
        try:
            self._tls.check()
        except ConfigError as error:
            self._refused_stamp = stamp
            log.warning("rotated client TLS files not usable; channels keep the previous certificate", error=str(error))
            return False
        except Exception as error:  # never let a watcher's surprise stop the router's loop
            self._refused_stamp = stamp
            log.warning("client TLS files not readable; channels keep the previous certificate", error=str(error))
            return False
        self._stamp, self._digest = stamp, digest
        log.info("client TLS files changed", flag=self._tls.flag, cert_file=self._tls.cert_file)
        return True


#: Plaintext: the default of every client.
PLAINTEXT = ClientTls()


def add_client_tls_arguments(group: object, *, flag: str, what: str) -> None:
    """``{flag}``, ``{flag}-ca``, ``-cert``, ``-key``, ``-server-name`` on ``group`` (an argparse
    group of an EnvArgumentParser, so each reads its variable too). Any file flag turns TLS on."""
    add = group.add_argument  # type: ignore[attr-defined]
    add(flag, action="store_true", help=f"TLS to {what} (implied by any {flag}-* file flag)")
    add(f"{flag}-ca", default="", help=f"PEM CA bundle {what} must chain to (empty: the system's roots)")
    add(f"{flag}-cert", default="", help=f"PEM client certificate presented to {what} (mutual TLS)")
    add(f"{flag}-key", default="", help=f"PEM private key of {flag}-cert")
    add(
        f"{flag}-server-name",
        default="",
        help=f"name {what}'s certificate must carry when it is not the host dialled",
    )


def client_tls_from_args(args: object, *, flag: str) -> ClientTls:
    """The :class:`ClientTls` that :func:`add_client_tls_arguments` with the same ``flag`` describes, checked."""
    dest = flag.removeprefix("--").replace("-", "_")

    def value(suffix: str) -> str:
        return str(getattr(args, f"{dest}{suffix}"))

    ca, cert, key, name = value("_ca"), value("_cert"), value("_key"), value("_server_name")
    tls = ClientTls(
        enabled=bool(getattr(args, dest)) or bool(ca or cert or key or name),
        ca_file=ca,
        cert_file=cert,
        key_file=key,
        server_name=name,
        flag=flag,
    )
    tls.check()
    return tls
