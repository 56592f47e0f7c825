"""Service-to-service authentication: which routers the recorder takes records from.

Two ways, either or both:

- a shared **service token**: the same secret on every router and recorder, read from a file
  (``--service-token-file``) or the ``SPLITSTREAM_SERVICE_TOKEN`` variable, never from argv. The
  router sends it as ``authorization: Bearer <token>`` on its Record stream; the recorder compares
  it in constant time and refuses anything else UNAUTHENTICATED before reading a message;
- a verified **client-certificate identity** (mTLS): :func:`~splitstream.common.cert_identity.peer_identities`
  reads the subject common name, DNS SANs and SPIFFE URI SANs of the certificate gRPC verified
  (``context.auth_context()``), each by its type, and :meth:`ServiceAuth.identity_allowed` checks them
  against an allow-list. The TLS setup that makes
  gRPC verify client certificates is the transport's; with it, an allow-list is one more setting.

The token is high-entropy (``openssl rand -hex 32``): at least 16 characters are required, so a
placeholder like ``changeme`` is refused at startup rather than trusted.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from splitstream.common.errors import ConfigError

#: The deployment-wide variable both routers and recorders read when ``--service-token-file`` is not given.
SERVICE_TOKEN_ENV = "SPLITSTREAM_SERVICE_TOKEN"
AUTHORIZATION_HEADER = "authorization"
MIN_TOKEN_CHARS = 16


def read_service_token(path: str, *, flag: str = "--service-token-file") -> str:
    """The token in ``path`` (surrounding whitespace, such as the file's final newline, removed), or
    the environment's when ``path`` is empty ("" when neither is set). ConfigError, never quoting the
    token, when it cannot be read or is too short to be a secret."""
    if path:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else "cannot be read as text"
            raise ConfigError(f"{flag} {path}: {reason}") from None
        where = f"{flag} {path}"
    else:
        token = os.environ.get(SERVICE_TOKEN_ENV, "").strip()
        where = SERVICE_TOKEN_ENV
    if token and (len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() or " " in token):
        raise ConfigError(
            f"{where}: the service token must be at least {MIN_TOKEN_CHARS} printable ASCII characters without "
            "spaces (e.g. openssl rand -hex 32)"
        )
    return token


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a router sends on its Record stream (none without a token)."""
    return ((AUTHORIZATION_HEADER, f"Bearer {token}"),) if token else ()


@dataclass(frozen=True, slots=True)
class ServiceAuth:
    """What the recorder accepts: a token (empty: none configured) and certificate identities."""

    token: str = ""
    allowed_identities: frozenset[str] = frozenset()
    #: How the certificate's identities are read; set only with an allow-list.
    _peer_identities: Callable[[Mapping[str, Iterable[bytes]]], frozenset[str]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # cert_identity parses certificates with cryptography (0.03 s of CPU to import): imported when the
        # allow-list is built at start, by the recorders that have one, never on a call.
        if self.allowed_identities:
            from splitstream.common.cert_identity import peer_identities

            object.__setattr__(self, "_peer_identities", peer_identities)

    @property
    def enabled(self) -> bool:
        return bool(self.token or self.allowed_identities)

    def token_problem(self, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        """Why the call's credentials are refused, or None when the token matches. The message never
        quotes what was sent."""
        values = [v for k, v in metadata if k == AUTHORIZATION_HEADER and isinstance(v, str)]
        if not values:
            return "missing"
        scheme, _, sent = values[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not sent:
            return "invalid"
        # Constant time: how long the comparison takes says nothing of how much of the token was right.
        return None if hmac.compare_digest(sent.strip().encode(), self.token.encode()) else "invalid"

    def identity_allowed(self, auth_context: Mapping[str, Iterable[bytes]]) -> bool:
        if self._peer_identities is None:  # no allow-list: no identity is allowed
            return False
        return bool(self._peer_identities(auth_context) & self.allowed_identities)
