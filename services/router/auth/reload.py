"""SIGHUP: read every credential source again now, not at its next poll.

The JWKS is otherwise re-read every ``--jwks-refresh-s`` (300 s) or on an unknown ``kid``, so a key an
issuer withdrew (a leaked signing key) keeps verifying tokens until then; the revocation list and a
``file:`` principals document are polled every quarter second, and SIGHUP reads them too so that one
``kill -HUP`` is all an operator has to remember. The router has no control channel of its own (its
gRPC and HTTP ports serve callers), so the signal is the interface: ``kill -HUP <router pid>``, or
each child's pid under ``--processes``.
"""

from __future__ import annotations

import asyncio
import signal

import structlog

from splitstream.router.auth.credentials import PrincipalsStore
from splitstream.router.auth.jwks import JwtVerifier
from splitstream.router.auth.revocation import RevocationStore

log = structlog.get_logger()


class CredentialReloader:
    """Installs the SIGHUP handler; each signal starts one reload of every source (in order, not at once)."""

    def __init__(
        self, principals: PrincipalsStore, jwt: JwtVerifier | None, revocations: RevocationStore | None
    ) -> None:
        self.principals = principals
        self.jwt = jwt
        self.revocations = revocations
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def install(self) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.request)

    def request(self) -> None:
        """A reload now; one asked for while another runs follows it (it may have read a source already)."""
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.create_task(self._run(), name="credentials-reload")

    async def _run(self) -> None:
        while True:
            self._again = False
            log.info("SIGHUP: reading the JWKS, revocation list and principals again")
            try:
                if self.revocations is not None:
                    await self.revocations.reload(force=True)
                await self.principals.reread()
                if self.jwt is not None:
                    await self.jwt.keys.reload_now()
            except Exception:  # a reload must never end the process
                log.exception("credentials reload failed; keeping what was in force")
            if not self._again:
                return

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
