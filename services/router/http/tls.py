"""TLS for the HTTP port: the gRPC port's files (``--grpc-server-cert``/``-key``, ``--grpc-root-cert`` for
mutual TLS), followed through rotation as the gRPC port follows them.

The standard library has no certificate fetcher, but it lets a server pick the context of a connection
while it reads the client's hello (``sni_callback``, called for every handshake, with or without SNI).
:class:`RotatingContext` looks at the files there (three ``stat`` calls, no read unless one changed:
size, mtime or inode) and, after a change, loads a new context for this and later connections; those
already open keep the session they negotiated. A rotation caught half-written (a certificate beside the
old key) does not load: it is logged, the previous pair goes on being served, and the files are tried
again at the next handshake until they match.
"""

from __future__ import annotations

import os
import ssl

import structlog

from splitstream.common.tls import ServerTls

log = structlog.get_logger()


def load_context(tls: ServerTls) -> ssl.SSLContext:
    """A server context from ``tls``'s files (checked at start by :meth:`ServerTls.check`)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.mutual:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=tls.client_ca_file)
    return context


class RotatingContext:
    """``context`` is what the server listens with; each handshake is served the newest pair that loads."""

    def __init__(self, tls: ServerTls) -> None:
        self.tls = tls
        self._stamp = self._stamp_now()
        self.current = load_context(tls)
        self.context = load_context(tls)
        self.context.sni_callback = self._hello

    def _files(self) -> list[str]:
        return [self.tls.cert_file, self.tls.key_file, *([self.tls.client_ca_file] if self.tls.mutual else [])]

    def _stamp_now(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in self._files():
            status = os.stat(path)
            stamps.append((status.st_size, status.st_mtime_ns, status.st_ino))
        return tuple(stamps)

    def _hello(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        try:
            stamp = self._stamp_now()
        except OSError as error:  # a file renamed away for a moment: keep serving what loaded last
            log.warning("HTTP TLS files cannot be read; serving the previous certificate", error=str(error))
            stamp = self._stamp
        if stamp != self._stamp:
            try:
                self.current = load_context(self.tls)
            except (ssl.SSLError, OSError) as error:
                log.error("HTTP TLS files do not load; serving the previous certificate", error=str(error))
            else:
                self._stamp = stamp
                log.info("HTTP TLS certificate reloaded", cert=self.tls.cert_file)
        connection.context = self.current
