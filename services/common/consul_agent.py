"""Reaching a Consul agent: its address and credentials as the ``consul`` CLI reads them, a call's errors
in one line, and calls run off the event loop.

Apart from :mod:`splitstream.common.registry.consul` (a router's Consul registry), so that a worker
registering itself, and a router reading its principals from Consul, import neither the registry's
experiment schemas (pydantic models, 0.05 s of a worker's start) nor py-consul until they talk to Consul.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from splitstream.common.errors import ConfigError
from splitstream.common.tls import check_ca, check_key_pair

if TYPE_CHECKING:
    import consul

SERVICE_PREFIX = "splitstream-"
DEFAULT_ADDRESS = "127.0.0.1:8500"
TOKEN_VARIABLE = "CONSUL_HTTP_TOKEN"
#: Consul's own variable for a token kept in a file (read once, at start).
TOKEN_FILE_VARIABLE = "CONSUL_HTTP_TOKEN_FILE"
#: Consul's own variables for HTTPS, read as the ``consul`` CLI reads them.
SSL_VARIABLE = "CONSUL_HTTP_SSL"
SSL_VERIFY_VARIABLE = "CONSUL_HTTP_SSL_VERIFY"
CA_VARIABLE = "CONSUL_CACERT"
CLIENT_CERT_VARIABLE = "CONSUL_CLIENT_CERT"
CLIENT_KEY_VARIABLE = "CONSUL_CLIENT_KEY"

T = TypeVar("T")


def service_name(model: str) -> str:
    return SERVICE_PREFIX + model


@dataclass(frozen=True, kw_only=True)
class ConsulAddress:
    """Where the Consul agent's HTTP API is, and how to reach it: HTTPS (``scheme``), the CA its
    certificate must chain to (``ca_file``; empty: the system's roots), a client certificate for
    Consul's ``verify_incoming`` (``cert_file``/``key_file``). The ACL token travels only as the
    ``X-Consul-Token`` header (py-consul's default), never in a query string a proxy would log."""

    host: str
    port: int
    scheme: str = "http"
    token: str | None = field(default=None, repr=False)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    verify: bool = True

    @property
    def description(self) -> str:
        return f"consul://{self.host}:{self.port}" + (" (https)" if self.scheme == "https" else "")

    def client(self, *, timeout_s: float | None = 10.0) -> consul.Consul:
        """A new client (one per thread of use: a requests session is not shared between threads).

        ``timeout_s`` bounds connecting and answering; a blocking query adds its wait to it.
        """
        import consul  # py-consul and requests on first use: most processes never talk to Consul

        verify: bool | str = (self.ca_file or True) if self.verify else False
        cert = (self.cert_file, self.key_file) if self.cert_file else None
        return consul.Consul(
            host=self.host,
            port=self.port,
            scheme=self.scheme,
            token=self.token,
            verify=verify,
            cert=cert,
            connections_timeout=timeout_s,
        )


def parse_consul_spec(spec: str) -> ConsulAddress:
    """``consul://HOST:PORT``, ``consul:HOST:PORT`` or ``consul:`` (``CONSUL_HTTP_ADDR``, else 127.0.0.1:8500).

    HTTPS as the ``consul`` CLI configures it: ``CONSUL_HTTP_ADDR=https://...`` or ``CONSUL_HTTP_SSL=true``,
    ``CONSUL_CACERT``, ``CONSUL_CLIENT_CERT``/``CONSUL_CLIENT_KEY``, ``CONSUL_HTTP_SSL_VERIFY=false`` (tests
    only). Raises ValueError saying what is wrong (a TLS file that cannot be used included).
    """
    scheme, _, rest = spec.partition(":")
    if scheme != "consul":
        raise ValueError(f"not a consul registry: '{spec}'")
    rest = rest.removeprefix("//").rstrip("/")
    http_scheme = "http"
    if not rest:
        rest = os.environ.get("CONSUL_HTTP_ADDR", DEFAULT_ADDRESS)
        if "://" in rest:
            http_scheme, _, rest = rest.partition("://")
    parsed = urllib.parse.urlsplit(f"//{rest}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None or parsed.path:
        raise ValueError(f"registry '{spec}': expected consul://HOST:PORT")
    ssl = os.environ.get(SSL_VARIABLE, "").strip().lower()
    if ssl:
        http_scheme = "https" if ssl in {"1", "true", "yes", "on"} else "http"
    if http_scheme not in {"http", "https"}:
        raise ValueError(f"CONSUL_HTTP_ADDR: scheme must be http or https, got {http_scheme!r}")
    ca, cert, key = (os.environ.get(v, "") for v in (CA_VARIABLE, CLIENT_CERT_VARIABLE, CLIENT_KEY_VARIABLE))
    if (ca or cert or key) and http_scheme != "https":
        raise ValueError(
            f"{CA_VARIABLE}/{CLIENT_CERT_VARIABLE} are set but Consul is reached over http (set {SSL_VARIABLE}=true)"
        )
    if bool(cert) != bool(key):
        raise ValueError(f"{CLIENT_CERT_VARIABLE} and {CLIENT_KEY_VARIABLE} go together")
    try:
        if ca:
            check_ca(ca, CA_VARIABLE)
        if cert:
            check_key_pair(cert, key, cert_flag=CLIENT_CERT_VARIABLE, key_flag=CLIENT_KEY_VARIABLE)
    except ConfigError as error:
        raise ValueError(str(error)) from None
    return ConsulAddress(
        host=parsed.hostname,
        port=port,
        scheme=http_scheme,
        token=os.environ.get(TOKEN_VARIABLE) or _token_from_file(),
        ca_file=ca,
        cert_file=cert,
        key_file=key,
        verify=os.environ.get(SSL_VERIFY_VARIABLE, "true").strip().lower() not in {"0", "false", "no", "off"},
    )


def _token_from_file() -> str | None:
    """The token in ``CONSUL_HTTP_TOKEN_FILE``, or None; ValueError (never quoting the file's content)."""
    path = os.environ.get(TOKEN_FILE_VARIABLE, "")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{TOKEN_FILE_VARIABLE} {path}: {getattr(error, 'strerror', None) or error}") from None
    if not token:
        raise ValueError(f"{TOKEN_FILE_VARIABLE} {path}: the file is empty")
    return token


def describe_error(error: BaseException) -> str:
    """A one-line reason for a failed Consul call (requests' own messages run to several hundred characters)."""
    import consul
    import requests

    if isinstance(error, requests.Timeout):
        return "timed out"
    if isinstance(error, requests.ConnectionError):
        text = str(error)
        return "connection refused" if "refused" in text.lower() else "cannot connect"
    if isinstance(error, consul.ACLPermissionDenied):
        return f"permission denied (is {TOKEN_VARIABLE} set?)"
    return " ".join(str(error).split())[:300] or type(error).__name__


def consul_errors() -> tuple[type[Exception], ...]:
    """What a Consul call can raise when Consul is down, slow or refuses (``except consul_errors():``).

    A function, so that importing this module does not import py-consul and requests (a third of a
    router's start) in processes that never talk to Consul."""
    import consul
    import requests

    return (consul.ConsulException, requests.RequestException)


async def run_blocking(function: Callable[[], T]) -> T:
    """Run ``function`` in a new daemon thread and await its result.

    Cancelling the await abandons the thread: it finishes its HTTP call (a
    blocking query ends at its wait) and its result is dropped.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = function()
        except BaseException as error:
            outcome: tuple[T | None, BaseException | None] = (None, error)
        else:
            outcome = (result, None)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="consul-call", daemon=True).start()
    return await future
