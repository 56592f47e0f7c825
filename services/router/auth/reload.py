"""SIGHUP: read every credential source again now, not at its next poll.

The JWKS is otherwise re-read every ``--jwks-refresh-s`` (300 s) or on an unknown ``kid``, so a key an
issuer withdrew (a leaked signing key) keeps verifying tokens until then; the revocation list and a
``file:`` principals document are polled every quarter second, and SIGHUP reads them too so that one
``kill -HUP`` is all an operator has to remember: ``kill -HUP <router pid>`` (the parent's under
``--processes``: it sends the signal on to every child).

From another host, where no signal reaches, ``splitstream credentials reload`` calls
``splitstream.v1.Router/ReloadCredentials`` (a principal with the ``reload`` grant), which
:meth:`CredentialReloader.reload_everywhere` serves: the same reload, in this process or, in a
``--processes`` child, in all of them by way of SIGHUP to the supervisor, which holds no credentials
itself and sends the signal on. An RPC rather than a second port: the router's callers are already
authenticated and authorized per method on its gRPC port, with TLS, and a reload is one more grant.
"""

from __future__ import annotations

import asyncio
import os
import signal

import structlog

from splitstream.common.proto.splitstream.v1 import router_pb2
from splitstream.common.runtime import PROCESSES_ENV, process_index
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
        #: Reloads finished, each begun after every request before it: what an RPC waits on.
        self.completed = 0
        self._finished = asyncio.Condition()

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
                async with self._finished:
                    self.completed += 1
                    self._finished.notify_all()
                return

    async def reload_everywhere(self, timeout_s: float = 30.0) -> router_pb2.ReloadCredentialsResponse:
        """The RPC's reload: this process's, and its siblings' under ``--processes`` (SIGHUP to the supervisor,
        which sends it on to every child, this one included). Returns once this process has read everything
        again (TimeoutError after ``timeout_s``: a JWKS that does not answer), with what is now in force."""
        async with self._finished:
            before = self.completed
        index = process_index()
        if index is None:
            self.request()
        else:
            os.kill(os.getppid(), signal.SIGHUP)  # a --processes child's parent is the supervisor
        async with asyncio.timeout(timeout_s), self._finished:
            await self._finished.wait_for(lambda: self.completed > before)
        return router_pb2.ReloadCredentialsResponse(
            jwks_key_ids=self.jwt.keys.key_ids() if self.jwt is not None else [],
            revoked_entries=self._revoked_entries(),
            processes=1 if index is None else _siblings(),
        )

    def _revoked_entries(self) -> int:
        if self.revocations is None:
            return 0
        revoked = self.revocations.revoked
        return len(revoked.jtis) + len(revoked.principals)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _siblings() -> int:
    """How many children the supervisor runs (it names the count for them), or 0 when it is not known."""
    value = os.environ.get(PROCESSES_ENV, "")
    return int(value) if value.isdigit() else 0
