"""``splitstream-shipper``: read the routers' write-ahead logs and ship them to the recorder as CallRecords.

Wiring only: flags → :class:`ShipperConfig` (:mod:`splitstream.shipper.config`), and a :class:`Shipper` that
the shared runtime (:mod:`splitstream.common.runtime`) serves (health and metrics; no API of its own), drains
and stops.
A router starts one as its child by default (``--shipper child``); one per host may instead ship
several routers' log directories (``--shipper external`` on the routers, ``--log-dir`` repeated here).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import structlog
from grpc import aio
from prometheus_client import CollectorRegistry

from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.common.runtime import Runtime, Service, run_service
from splitstream.common.wal import WRITER_LOCK_FILE, segments
from splitstream.shipper.config import PROG, ShipperConfig, parse_args
from splitstream.shipper.mirror import MirrorSettings, RecordMirror
from splitstream.shipper.spool import leftover
from splitstream.shipper.tail import Tail


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging(config.server.log_level, service="shipper")
    return run_service(config.server, lambda: Shipper(config), prog=PROG)


#: How long a stopping shipper waits for its log tail's loop to end its turn (a read of a stalled disk).
TAIL_STOP_TIMEOUT_S = 5.0


class Shipper(Service):
    """The tail feeding the mirror; SIGTERM stops reading, ships what is queued within ``--flush-timeout-s``
    and leaves the rest in the logs (their cursors say where to resume)."""

    prog = PROG
    grpc_services = ()

    def __init__(self, config: ShipperConfig) -> None:
        self.config = config
        self.metrics = CollectorRegistry()
        self.log = structlog.get_logger()
        settings = MirrorSettings(
            recorder_address=config.recorder,
            queue_size=config.record_batch.queue_size,
            batch_size=config.record_batch.size,
            batch_interval_s=config.record_batch.interval_ms / 1000,
            batch_max_bytes=config.record_batch.max_bytes,
            flush_timeout_s=config.flush_timeout_s,
            recorder_tls=config.recorder_tls,
            service_token=config.service_token,
        )
        try:
            spool = leftover(config.spool_dir)
            self.mirror = RecordMirror(settings, spool, self.metrics)
            self.tail = Tail(config.log_dirs, self.mirror, self.metrics, shadow_wait_s=config.shadow_wait_s)
        except OSError as error:
            raise ConfigError(f"--log-dir/--spool-dir: {error.strerror or error}: {error.filename}") from None
        self._tailing: asyncio.Task[None] | None = None
        # An existing directory mistaken for a log: said, not refused (a router's child ships what its router named).
        for directory in () if config.exit_with_parent else config.log_dirs:
            if not (os.path.exists(os.path.join(directory, WRITER_LOCK_FILE)) or segments(Path(directory))):
                self.log.warning(
                    "no router has logged to this directory: is it a router's --log-dir?", log_dir=directory
                )

    def register(self, server: aio.Server) -> None:
        pass

    async def prepare(self, runtime: Runtime) -> None:
        self.tail.open_locks()
        self.mirror.start()
        self._tailing = asyncio.create_task(self.tail.run(), name="log-tail")

    async def run(self, runtime: Runtime) -> None:
        await runtime.set_serving(True)
        if self.config.ready_fd >= 0:
            with contextlib.suppress(OSError):  # the router gone meanwhile: --exit-with-parent sees to it
                os.write(self.config.ready_fd, b"ready\n")
            with contextlib.suppress(OSError):  # not a descriptor of ours (given by hand): nothing to tell
                os.close(self.config.ready_fd)
        self.log.info("shipper shipping", logs=list(self.config.log_dirs), recorder=self.config.recorder)
        parent = os.getppid()
        while True:
            await asyncio.sleep(1.0)
            if self._tailing is not None and self._tailing.done():
                # The tail stopped on its own (its log's lock file unusable): a shipper that ships nothing must
                # not go on saying it serves. Raises the tail's error: the runtime exits with it.
                self._tailing.result()
            # Beside Linux's parent-death signal (which the router asks for): where that is missing, a child
            # whose router died would ship on, and hold the log's lock from the restarted router's own child.
            if self.config.exit_with_parent and os.getppid() != parent:
                self.log.warning("the router that started this shipper is gone; draining")
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def _tailing_failed(self) -> bool:
        task = self._tailing
        return task is not None and task.done() and not task.cancelled() and task.exception() is not None

    async def teardown(self) -> None:
        await self.tail.close()
        loop_ended = True
        if self._tailing is not None:
            # The loop ends at its next turn (close() said so): a read of it still in a thread would move the
            # readers under the last read. Cancelled only if a read hangs (a stalled disk); then no last read.
            done, _ = await asyncio.wait({self._tailing}, timeout=TAIL_STOP_TIMEOUT_S)
            loop_ended = bool(done)
            self._tailing.cancel()
            await asyncio.gather(self._tailing, return_exceptions=True)  # its failure, if any, was raised by run()
        if loop_ended and not self._tailing_failed():
            try:
                read = await self.tail.read_rest()
            except Exception:  # a log that cannot be read now: its cursor stays, the next start reads it
                self.log.exception("last read of the logs failed; what it held stays in them")
            else:
                if read:
                    self.log.info("read the logs' last entries", entries=read)
        await self.mirror.close()
        await self.tail.commit()
        self.log.info("shipper stopped")
