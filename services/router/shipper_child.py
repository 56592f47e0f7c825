"""The router's own ``splitstream-shipper`` (``--shipper child``): started with it, restarted when it dies,
stopped after the router's drain.

A child keeps single-host use to one command. It is told to die with the router (Linux's
parent-death signal: SIGTERM, so it still ships what it holds), and the shipper locks each log
directory it ships, so the child of a restarted router waits for the old one to finish instead
of shipping the same log twice. The router's appends never wait on the child: a dead shipper
only lets the log grow (up to its cap). With ``--processes N`` the supervising parent runs one for
the N children's logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

import structlog
from prometheus_client import CollectorRegistry, Counter

from splitstream.common.supervisor import die_with_parent

log = structlog.get_logger()

_RESTART_MAX_S = 5.0


class ShipperChild:
    def __init__(self, args: Sequence[str], registry: CollectorRegistry, *, stop_timeout_s: float) -> None:
        self.args = list(args)
        self.stop_timeout_s = stop_timeout_s
        self.restarts = Counter(
            "splitstream_router_shipper_restarts",
            "Times the router's child shipper exited on its own and was started again",
            registry=registry,
        )
        self._process: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name="shipper-child")

    async def _supervise(self) -> None:
        backoff_s = 0.2
        while not self._stopping:
            try:
                self._process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "splitstream.shipper", *self.args, preexec_fn=die_with_parent
                )
            except OSError as error:
                log.error("shipper not started; retrying", error=str(error)[:300])
                await asyncio.sleep(_RESTART_MAX_S)
                continue
            log.info("shipper started", pid=self._process.pid)
            code = await self._process.wait()
            if self._stopping:
                return
            self.restarts.inc()
            log.warning("shipper exited; starting it again", code=code, after_s=backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, _RESTART_MAX_S)

    async def stop(self) -> None:
        """SIGTERM (it ships what it can, keeps the rest on disk), then SIGKILL past the timeout."""
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.stop_timeout_s)
            except TimeoutError:
                log.error("shipper did not stop in time; killed")
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
