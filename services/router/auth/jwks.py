"""JWT bearer tokens verified against a JWKS (a file, or a URL fetched with PyJWT's ``PyJWKClient``).

What a token must be to be accepted: signed with one of the pinned algorithms (``none`` and the
symmetric HS* family are refused at startup: a JWKS is public, and an HMAC "public key" would let
anyone who read it sign), by a key of the set whose ``kid`` it names (or the set's only key when it
names none); ``exp`` present and not passed, ``nbf`` (when present) reached, ``aud`` containing the
configured audience and ``iss`` equal to the configured issuer, each within ``leeway_s``; and its
principal claim (``sub`` by default) a string.

Key rotation: the set is re-read every ``refresh_s``, and at once when a token names a ``kid`` the
set lacks (an issuer publishes the new key before it signs with it), at most once every
``min_refresh_s`` so a stream of tokens with made-up ``kid``s cannot turn the router into a load
generator for the JWKS endpoint. A failed read keeps the last good set.

Reading is blocking (a file, urllib): it runs in a thread, never on the event loop; verifying a
signature is CPU work of tens of microseconds (RSA-2048, ES256) and runs inline.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import structlog

from splitstream.common.errors import ConfigError
from splitstream.common.loopback import is_loopback_host
from splitstream.common.secrets import redact_text, redact_url

if TYPE_CHECKING:
    import jwt

log = structlog.get_logger()

#: Asymmetric algorithms PyJWT verifies with the ``cryptography`` package.
ASYMMETRIC_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)


class TokenRejected(Exception):
    """The token is not accepted; the message says why without quoting the token (→ UNAUTHENTICATED)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        #: A short fixed word for the failures metric (bounded cardinality).
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class JwtSettings:
    #: ``file:PATH`` or an ``http(s)://`` URL (which may hold credentials: never logged as is).
    jwks: str
    audience: str
    issuer: str
    algorithms: tuple[str, ...] = ("RS256", "ES256")
    principal_claim: str = "sub"
    leeway_s: float = 10.0
    refresh_s: float = 300.0
    min_refresh_s: float = 10.0
    fetch_timeout_s: float = 5.0
    #: ``--allow-insecure-jwks``: fetch an ``http://`` JWKS from another host (anyone on the path could swap keys).
    allow_insecure: bool = False

    def __post_init__(self) -> None:
        if not self.audience or not self.issuer:
            raise ConfigError("--jwt-jwks needs --jwt-audience and --jwt-issuer: tokens are checked against both")
        refused = [a for a in self.algorithms if a not in ASYMMETRIC_ALGORITHMS]
        if refused or not self.algorithms:
            raise ConfigError(
                f"--jwt-algorithms: {', '.join(refused) or 'none given'} refused; allowed: "
                f"{', '.join(sorted(ASYMMETRIC_ALGORITHMS))} (never 'none', never HS*: a JWKS is public)"
            )
        if not self.principal_claim:
            raise ConfigError("--jwt-principal-claim must not be empty")
        scheme = urlsplit(self.jwks).scheme
        if scheme not in ("file", "http", "https"):
            raise ConfigError(f"--jwt-jwks: expected file:PATH or an http(s):// URL, got {redact_url(self.jwks)!r}")
        if scheme == "http" and not self.allow_insecure and not is_loopback_host(urlsplit(self.jwks).hostname or ""):
            # Whoever is on the path could serve their own key and mint tokens for any principal.
            raise ConfigError(
                f"--jwt-jwks {redact_url(self.jwks)}: a JWKS over plain http:// can be swapped by anyone on the "
                "path; use https:// (or file:PATH), or --allow-insecure-jwks"
            )


class JwksKeys:
    """The current key set and the rules for re-reading it."""

    def __init__(self, settings: JwtSettings) -> None:
        import jwt  # PyJWT and its crypto on first use: a router without --jwt-jwks starts without them

        self.settings = settings
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._loaded_s = -float("inf")
        self._attempted_s = -float("inf")
        self._refreshing: asyncio.Task[None] | None = None
        self.description = redact_url(settings.jwks)
        self._client: jwt.PyJWKClient | None = None
        if not settings.jwks.startswith("file:"):
            url, headers = _url_and_headers(settings.jwks)
            # No caching inside the client: this class decides when to fetch (and fetches in a thread).
            self._client = jwt.PyJWKClient(
                url, cache_keys=False, cache_jwk_set=False, headers=headers, timeout=settings.fetch_timeout_s
            )

    async def load(self) -> None:
        """Read the set now; ConfigError when it cannot be read (at startup: the router must not serve
        with no way to verify anyone)."""
        try:
            await self._refresh()
        except Exception as error:
            raise ConfigError(f"--jwt-jwks {self.description}: {redact_text(str(error))}") from None

    async def key_for(self, kid: str | None) -> jwt.PyJWK | None:
        """The key a token's ``kid`` names. A set that lacks it is re-read before answering (the call
        waits for the read); a stale set that has it is re-read in the background (the call does not)."""
        key = self._find(kid)
        if key is None and time.monotonic() - self._attempted_s >= self.settings.min_refresh_s:
            await self._refresh_shared()
            return self._find(kid)
        self.refresh_if_stale()
        return key

    def refresh_if_stale(self) -> None:
        """Start a background re-read once the set is ``refresh_s`` old (none while one may not start)."""
        now = time.monotonic()
        if now - self._loaded_s >= self.settings.refresh_s and now - self._attempted_s >= self.settings.min_refresh_s:
            self._start_refresh()

    async def reload_now(self) -> None:
        """Read the set now, whatever ``min_refresh_s`` says (SIGHUP: an operator removed a key). Every
        remembered token is forgotten with the old key objects; a failed read keeps the last set. A read already
        under way may hold the set from before the change, and would install it after this one: it is waited
        for, and this read starts after it (calls that miss a kid meanwhile share this read)."""
        if self._refreshing is not None and not self._refreshing.done():
            await asyncio.shield(self._refreshing)
        await self._refresh_shared()  # a read begun since the held one ended began after the change: shared

    def key_ids(self) -> list[str]:
        """The kids of the set in force, sorted (what an operator checks after withdrawing a key)."""
        return sorted(kid for kid in self._keys if kid is not None)

    def holds(self, key: jwt.PyJWK) -> bool:
        """Whether ``key`` (the object) is in the current set: false after any re-read of the JWKS."""
        return self._keys.get(key.key_id) is key

    def _find(self, kid: str | None) -> jwt.PyJWK | None:
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        return self._keys.get(kid)

    async def _refresh_shared(self) -> None:
        """One read at a time: calls that need it while it runs wait for the same read."""
        await asyncio.shield(self._start_refresh())

    def _start_refresh(self) -> asyncio.Task[None]:
        """The read in progress, or a new one; kept in ``_refreshing`` (a task nobody holds could be
        collected mid-read)."""
        if self._refreshing is None or self._refreshing.done():
            self._attempted_s = time.monotonic()  # at once, so calls arriving meanwhile do not start another
            self._refreshing = asyncio.create_task(self._refresh_logged(), name="jwks-refresh")
        return self._refreshing

    async def _refresh_logged(self) -> None:
        try:
            await self._refresh()
        except Exception as error:  # keep the last good set; a token it cannot verify is refused
            log.warning(
                "JWKS could not be read; keeping the last key set",
                jwks=self.description,
                error=redact_text(str(error)),
            )

    async def _refresh(self) -> None:
        import jwt

        self._attempted_s = time.monotonic()
        data = await asyncio.to_thread(self._read)
        keys: dict[str | None, jwt.PyJWK] = {}
        for entry in data.get("keys", []) if isinstance(data, dict) else []:
            try:
                key = jwt.PyJWK.from_dict(entry)
            except jwt.PyJWTError as error:  # one unusable key (an unsupported kty) must not hide the others
                log.warning("JWKS key skipped", jwks=self.description, kid=entry.get("kid"), error=str(error))
                continue
            keys[key.key_id] = key
        if not keys:
            raise ValueError('the JWKS holds no usable key (expected {"keys": [...]})')
        if keys.keys() != self._keys.keys():
            log.info("JWKS loaded", jwks=self.description, kids=sorted(str(k) for k in keys))
        self._keys = keys
        self._loaded_s = time.monotonic()

    def _read(self) -> Any:
        if self._client is None:
            return json.loads(Path(self.settings.jwks.removeprefix("file:")).read_text())
        return self._client.fetch_data()


class JwtVerifier:
    """Verifies tokens, remembering the ones it verified.

    A client sends the same token with every call until it expires, and verifying an ES256
    signature cost the router ~35 % more CPU a call than no authentication (bench/auth_overhead.py).
    So a verified token is remembered by its exact text with the key that verified it and its
    ``exp``: it is accepted again without the signature check while ``exp`` (plus leeway) has not
    passed and that very key object is still in the set (any re-read of the JWKS builds new key
    objects, so a rotation or removal forgets every remembered token). At most ``cache_size``
    tokens are kept, the oldest dropped first."""

    def __init__(self, settings: JwtSettings, *, cache_size: int = 10_000) -> None:
        self.settings = settings
        self.keys = JwksKeys(settings)
        self._cache_size = cache_size
        self._verified: dict[str, tuple[str, float, jwt.PyJWK]] = {}

    async def verify(self, token: str) -> str:
        """The principal's name the token carries; :class:`TokenRejected` saying why it is refused."""
        remembered = self._verified.get(token)
        if remembered is not None:
            principal, valid_until, key = remembered
            if time.time() < valid_until and self.keys.holds(key):
                self.keys.refresh_if_stale()
                return principal
            del self._verified[token]
        principal, expires, key = await self._verify(token)
        if len(self._verified) >= self._cache_size:
            del self._verified[next(iter(self._verified))]
        self._verified[token] = (principal, expires + self.settings.leeway_s, key)
        return principal

    async def _verify(self, token: str) -> tuple[str, float, jwt.PyJWK]:
        import jwt

        settings = self.settings
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise TokenRejected("the bearer token is not a JWT", "malformed") from None
        algorithm = header.get("alg")
        if algorithm not in settings.algorithms:
            raise TokenRejected(
                f"the JWT's algorithm is not accepted (accepted: {', '.join(settings.algorithms)})", "algorithm"
            )
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise TokenRejected("the JWT's kid is not a string", "malformed")
        key = await self.keys.key_for(kid)
        if key is None:
            raise TokenRejected("the JWT is signed by a key the JWKS does not hold (unknown kid)", "unknown_key")
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=list(settings.algorithms),
                audience=settings.audience,
                issuer=settings.issuer,
                leeway=settings.leeway_s,
                options={"require": ["exp", "aud", "iss"]},
            )
        except jwt.ExpiredSignatureError:
            raise TokenRejected("the JWT has expired (exp)", "expired") from None
        except jwt.ImmatureSignatureError:
            raise TokenRejected("the JWT is not valid yet (nbf)", "not_yet_valid") from None
        except jwt.InvalidAudienceError:
            raise TokenRejected(f"the JWT's audience (aud) is not '{settings.audience}'", "audience") from None
        except jwt.InvalidIssuerError:
            raise TokenRejected(f"the JWT's issuer (iss) is not '{settings.issuer}'", "issuer") from None
        except jwt.MissingRequiredClaimError as error:
            raise TokenRejected(f"the JWT lacks the '{error.claim}' claim", "missing_claim") from None
        except jwt.InvalidSignatureError:
            raise TokenRejected("the JWT's signature does not verify", "signature") from None
        except jwt.PyJWTError:
            raise TokenRejected("the JWT is not valid", "invalid") from None
        principal = claims.get(settings.principal_claim)
        if not isinstance(principal, str) or not principal:
            raise TokenRejected(f"the JWT's '{settings.principal_claim}' claim is not a name", "missing_claim")
        return principal, float(claims["exp"]), key


def _url_and_headers(url: str) -> tuple[str, dict[str, str]]:
    """``https://user:pw@host/jwks`` → the URL without userinfo and a Basic ``Authorization`` header
    (urllib ignores userinfo; a JWKS behind a password is rare but must not leak into logs)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, {}
    userinfo, _, host = parts.netloc.rpartition("@")
    credentials = base64.b64encode(unquote(userinfo).encode()).decode()
    return urlunsplit(parts._replace(netloc=host)), {"Authorization": f"Basic {credentials}"}


def parse_algorithms(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def bearer_token(values: Sequence[str]) -> str | None:
    """The token of the first ``authorization: Bearer <token>`` value (scheme case-insensitive), or None."""
    for value in values:
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None
