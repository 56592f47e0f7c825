"""Credentials refused before they expire: the revocation list (``--revoked-file``).

A JWT is valid until its ``exp`` and a key removed from the JWKS is noticed only at the next read of
the set, so a leaked token, or a principal that must lose access now, needs a list the router checks on
every call. The file holds one entry a line::

    # comments and blank lines are ignored
    jti:4f1c2a...            # one JWT, by its jti claim
    principal:web-frontend   # every credential of a principal: its API keys and its JWTs

It is polled as the principals file is (a stat every ``poll_interval_s``; re-read when its inode, size
or mtime changes) and re-read at once on SIGHUP. A file that cannot be read or parsed keeps the last
good list (revoked stays revoked) and is logged once per distinct problem; at startup it is exit 2.

A revoked credential is refused UNAUTHENTICATED (HTTP 401) with a message that says nothing of the
list; the server log says which entry matched.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from splitstream.common.errors import ConfigError
from splitstream.common.files import FileSignature, read_if_changed
from splitstream.router.auth.jwks import bearer_token
from splitstream.router.auth.policy import Principal

log = structlog.get_logger()

#: What the caller is told: the same words as for a credential that does not verify.
REVOKED_MESSAGE = "the credential is not valid"


@dataclass(frozen=True, slots=True)
class RevocationList:
    jtis: frozenset[str] = field(default_factory=frozenset)
    principals: frozenset[str] = field(default_factory=frozenset)

    def matches(self, principal: str, jti: str | None) -> str | None:
        """The entry that revokes this credential (``principal:NAME`` or ``jti:ID``), or None."""
        if principal in self.principals:
            return f"principal:{principal}"
        if jti is not None and jti in self.jtis:
            return f"jti:{jti}"
        return None


def parse_revocations(text: str, *, source: str) -> RevocationList:
    """The list in ``text``; ConfigError naming ``source``, the line and what was wrong."""
    jtis: set[str] = set()
    principals: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, sep, value = line.partition(":")
        kind, value = kind.strip(), value.strip()
        if not sep or not value or kind not in ("jti", "principal") or any(c.isspace() for c in value):
            raise ConfigError(
                f"--revoked-file {source}: line {number}: expected 'jti:<id>' or 'principal:<name>' "
                f"(one a line, # comments), got {line[:80]!r}"
            )
        (jtis if kind == "jti" else principals).add(value)
    return RevocationList(frozenset(jtis), frozenset(principals))


def token_jti(token: str) -> str | None:
    """The ``jti`` claim of a JWT already verified (the signature is not checked again: only its payload
    is read), or None when it has none or ``token`` is no JWT (an API key)."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError:
        return None
    jti = payload.get("jti") if isinstance(payload, dict) else None
    return jti if isinstance(jti, str) else None


class RevocationStore:
    """The list in force, kept by polling its file."""

    def __init__(self, path: str, *, poll_interval_s: float = 0.25) -> None:
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.revoked = RevocationList()
        self._signature: FileSignature | None = None
        self._last_error = ""
        self._task: asyncio.Task[None] | None = None

    async def load(self) -> None:
        """The first list, before any call is served; ConfigError when it cannot be read or parsed."""
        try:
            await self.reload(force=True, strict=True)
        except OSError as error:
            raise ConfigError(f"--revoked-file {self.path}: {error.strerror or error}") from None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="revocations-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def reload(self, *, force: bool = False, strict: bool = False) -> None:
        """Read the file if it changed (``force``: whatever its signature). A problem raises when
        ``strict`` (at startup), else it is logged once and the last good list stays."""
        try:
            try:
                signature, text = await asyncio.to_thread(
                    read_if_changed, self.path, None if force else self._signature
                )
            except UnicodeDecodeError as error:  # a ConfigError: exit 2 naming the flag at startup, not a traceback
                raise ConfigError(f"--revoked-file {self.path}: not UTF-8 text (byte {error.start})") from None
            if text is None:
                return
            revoked = parse_revocations(text, source=str(self.path))
        except (OSError, ConfigError) as error:
            if strict:
                raise
            problem = str(error) if not isinstance(error, OSError) else f"{self.path}: {error.strerror or error}"
            if problem != self._last_error:
                log.error("revocation list refused; keeping the last good one", error=problem)
            self._last_error = problem
            self._signature = None  # read again once it is back
            return
        self._signature = signature
        self._last_error = ""
        if revoked != self.revoked:
            log.info(
                "revocation list loaded",
                path=str(self.path),
                jtis=len(revoked.jtis),
                principals=len(revoked.principals),
            )
        self.revoked = revoked

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.reload()
            except Exception:  # a watch must outlive any bug
                log.exception("revocation watch failed; keeping the last list")

    def check(self, principal: Principal, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        """The entry revoking this call's credential, or None. The token's ``jti`` is read only while the list
        names some (a few microseconds a call otherwise saved)."""
        revoked = self.revoked
        jti = None
        if revoked.jtis:
            token = bearer_token([v for k, v in metadata if k == "authorization" and isinstance(v, str)])
            jti = token_jti(token) if token is not None else None
        return revoked.matches(principal.name, jti)
