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
import os
import signal
import sys
from collections.abc import Sequence

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitstream.common.errors import ConfigError
from splitstream.common.interrupts import interrupts_held
from splitstream.common.runtime import EXIT_CONFIG, parent_env

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
        self.refused = Gauge(
            "splitstream_router_shipper_refused",
            "1 once the child shipper exited 2 (it refused its configuration): it is not started again and "
            "nothing is shipped until the router is restarted; its line is in the router's log",
            registry=registry,
        )
        self._process: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        #: The first child's verdict on its configuration: done once it took it (or died of something else).
        self._first: asyncio.Future[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._supervise(), name="shipper-child")

    async def started(self) -> None:
        """Wait until the first child took its configuration; ConfigError (the router exits 2) when it refused
        it: an exit 2 cannot be mended by starting it again, and a child restarted for ever would ship nothing."""
        assert self._first is not None, "start() first"
        await asyncio.shield(self._first)

    async def _supervise(self) -> None:
        backoff_s = 0.2
        while not self._stopping:
            ready, code = await self._run_once()
            if code is None:  # not started
                await asyncio.sleep(_RESTART_MAX_S)
                continue
            if self._stopping:
                return
            if code == EXIT_CONFIG:
                self.refused.set(1)
                log.error(
                    "the child shipper refused its configuration (its line is above); it is not started again: "
                    "calls are logged but not shipped until the router is restarted",
                    code=code,
                )
                if self._first is not None and not self._first.done():
                    refused = "--shipper child: splitstream-shipper refused its configuration (its line is above)"
                    self._first.set_exception(ConfigError(refused))
                return
            if self._first is not None and not self._first.done():
                self._first.set_result(None)  # a crash, not a refusal: the router serves, the child is restarted
            self.restarts.inc()
            log.warning("shipper exited; starting it again", code=code, after_s=backoff_s, took_config=ready)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, _RESTART_MAX_S)

    async def _run_once(self) -> tuple[bool, int | None]:
        """Start a child and wait for its end: (whether it said it took its configuration, its exit code; None
        when it could not be started)."""
        read_fd, write_fd = os.pipe()
        try:
            with interrupts_held():  # a Ctrl-C while its interpreter starts waits for its handler
                self._process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "splitstream.shipper", *self.args, "--ready-fd", str(write_fd),
                    pass_fds=(write_fd,), env=parent_env(),
                )  # fmt: skip
        except OSError as error:
            os.close(read_fd)
            log.error("shipper not started; retrying", error=str(error)[:300])
            return False, None
        finally:
            os.close(write_fd)  # the child's copy alone: its end (or its word) ends the read below
        log.info("shipper started", pid=self._process.pid)
        try:
            ready = bool(await asyncio.to_thread(os.read, read_fd, 64))
        finally:
            os.close(read_fd)
        if ready and self._first is not None and not self._first.done():
            self._first.set_result(None)
        return ready, await self._process.wait()

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
