"""``splitstream-archive``: keep every recorded call and outcome event as Parquet on a filesystem or object store.

Wiring only: flags → :class:`ArchiverConfig` (:mod:`splitstream.archiver.config`) and an :class:`Archiver`
(see :mod:`splitstream.archiver.core` for the delivery guarantees) that the shared runtime serves (grpc health,
Prometheus), drains and stops.
Exit codes as :mod:`splitstream.common.runtime` says: 2 and one line for an archive URL that names
nothing usable, a bucket that does not exist or credentials the store refuses.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence

import structlog
from grpc import aio
from redis.exceptions import NoPermissionError, RedisError

from splitstream.archiver.config import PROG, ArchiverConfig, parse_args
from splitstream.archiver.core import Archiver
from splitstream.archiver.metrics import ArchiverMetrics
from splitstream.common.archive import Archive, ArchiveError, check_archive, open_archive, remove_abandoned_writes
from splitstream.common.errors import ConfigError
from splitstream.common.logs import configure_logging
from splitstream.common.records import archive_group_key, stream_key
from splitstream.common.redis_url import open_redis
from splitstream.common.runtime import Runtime, Service, run_service
from splitstream.common.secrets import redact_text, redact_url
from splitstream.common.supervisor import supervise


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``splitstream-archive``."""
    config = parse_args(argv)
    configure_logging(config.server.log_level, service="archiver")
    if config.server.processes > 1:
        # Each child is a whole archiver (its own consumer in the group, its own builder): see consumer_name.
        # --builder resolved here, where --processes is known (each child is told --processes 1).
        builder = "process" if config.settings.builder_process else "thread"
        archiver_argv = [*(sys.argv[1:] if argv is None else argv), "--builder", builder]
        return supervise(
            config.server, module="splitstream.archiver", argv=archiver_argv, prog=PROG, service="archiver"
        )
    return run_service(config.server, lambda: ArchiverService(config), prog=PROG)


class ArchiverService(Service):
    """No gRPC API of its own: the runtime gives it health (SERVING once Redis and the archive answer),
    metrics and the ordered SIGTERM drain (the buffered entries are written and acknowledged)."""

    prog = PROG

    def __init__(self, config: ArchiverConfig) -> None:
        self.config = config
        self.log = structlog.get_logger()
        self.archiver_metrics = ArchiverMetrics()
        self.metrics = self.archiver_metrics.registry
        try:
            self.archive: Archive = open_archive(config.archive_url, endpoint=config.s3_endpoint)
        except ArchiveError as error:
            raise ConfigError(f"--archive: {error}") from None
        try:
            self.redis = open_redis(
                config.redis_url,
                security=config.redis_security,
                socket_timeout=config.redis_timeout_s + 2.0,  # XREADGROUP blocks up to a second
                socket_connect_timeout=config.redis_timeout_s,
                client_name="splitstream-archive",
            )
        except ValueError as error:
            raise ConfigError(f"--redis-url {redact_url(config.redis_url)}: {redact_text(str(error))}") from None
        self.archiver = Archiver(self.redis, self.archive, config.settings, self.archiver_metrics)
        #: The drain ran out of time with a write still under way (its builder is then not waited for).
        self._drain_cut = False
        self._cleaning: asyncio.Task[None] | None = None

    def register(self, server: aio.Server) -> None:
        """Health and reflection only (added by the runtime)."""

    async def prepare(self, runtime: Runtime) -> None:
        """An archive that cannot be listed or written is a configuration error: exit 2, one line."""
        try:
            await asyncio.to_thread(check_archive, self.archive, create=True)
        except ArchiveError as error:
            raise ConfigError(str(error)) from None

    async def run(self, runtime: Runtime) -> None:
        self.log.info(
            "archiver started",
            archive=self.config.archive_url,
            redis=redact_url(self.config.redis_url),
            group=self.config.settings.group,
            consumer=self.config.settings.consumer,
        )
        while True:
            try:
                await self.redis.ping()
                break
            except (RedisError, OSError) as error:
                self.log.warning("redis unreachable; waiting", error=redact_text(str(error)))
                await asyncio.sleep(1.0)
        await self._claim_group()
        self._cleaning = asyncio.create_task(self._remove_abandoned_writes(), name="remove-abandoned-writes")
        await runtime.set_serving(True)
        for model in sorted(m for m in self.config.settings.models if "," in m):
            if not await self.redis.exists(stream_key(model)):  # an old command line's ``--model a,b``, perhaps
                self.log.warning(
                    "--model names one model, commas included, and Redis holds no calls of it yet: "
                    "give --model once per model to archive several",
                    model=model,
                )
        await self.archiver.run()

    async def _remove_abandoned_writes(self) -> None:
        """Temporary files and S3 multipart uploads that writes killed mid-file left (an archiver and its
        builder SIGKILLed): removed once the group is known to write to this archive (an archiver refused by
        :meth:`_claim_group` touches nothing), in the background. Only those older than ``--claim-idle-s``:
        several archivers share an archive and there is no lock between them, and a write as old as that
        is dead by the group's own rule (its entries are claimed by then: --claim-idle-s must exceed
        --flush-interval-s plus an upload), while a younger one may be another archiver's, under way."""
        try:
            removed = await asyncio.to_thread(
                remove_abandoned_writes, self.archive, older_than_s=self.config.settings.claim_idle_s
            )
        except ArchiveError as error:
            self.log.warning("could not remove what crashed writes left in the archive", error=str(error))
            return
        if removed.files or removed.uploads:
            self.log.info(
                "removed temporary files and uploads that crashed writes left",
                files=removed.files,
                uploads=removed.uploads,
            )
        for path, reason in removed.left:  # the archiver goes on: readers skip them, a person may remove them
            self.log.warning("could not remove a temporary file a crashed write left", path=path, error=reason)

    def archive_identity(self) -> str:
        """Which archive this is, as the group records it: the store and the path in it (a path resolved, so
        ``./a`` and its absolute path are one archive), never a URL's credentials or query."""
        archive = self.archive
        where = os.path.realpath(archive.base) if archive.is_local else archive.base
        endpoint = f" at {self.config.s3_endpoint}" if self.config.s3_endpoint else ""
        return f"{archive.filesystem.type_name}:{where}{endpoint}"

    async def _claim_group(self) -> None:
        """Refuse a group that another archive's archivers read: the group hands each entry to one consumer, so
        two archives sharing it each missed what the other's archiver was handed. The first archiver of a group
        names its archive in Redis; one with another archive is exit 2 and one line."""
        key = archive_group_key(self.config.settings.group)
        mine = self.archive_identity()
        try:
            await self.redis.set(key, mine, nx=True)
            recorded = await self.redis.get(key)
        except NoPermissionError:
            # An ACL written before this check (docs/security.md's set then) lacks the key: archiving as before beats
            # an archiver that stops at its upgrade while retention trims what it has not archived yet.
            self.log.warning(
                "cannot check which archive this consumer group writes to: the Redis user may not use the key; "
                "add ~splitstream:archive-group:* to its ACL",
                key=key,
            )
            return
        theirs = recorded.decode(errors="replace") if isinstance(recorded, bytes) else str(recorded)
        if recorded is not None and theirs != mine:
            raise ConfigError(
                f"--group {self.config.settings.group}: its archivers write to {theirs}, this one to {mine}: each "
                f"archive needs its own --group (or delete the key {key} in Redis to move the group to this archive)"
            )

    async def draining(self) -> None:
        """The drain gets ``--shutdown-grace-s``: a store that stopped answering would hold a SIGTERM for
        minutes (each write waits out its own timeouts and retries). Whatever is not written by then stays
        pending in Redis, for this consumer's next start or another archiver's claim."""
        grace_s = self.config.server.shutdown_grace_s
        try:
            await asyncio.wait_for(self.archiver.drain(), grace_s)
        except TimeoutError:
            self._drain_cut = True
            self.log.warning(
                "the archive did not take the buffered entries within --shutdown-grace-s; they stay pending",
                shutdown_grace_s=grace_s,
                entries=self.archiver.unwritten(),
            )

    async def teardown(self) -> None:
        if self._cleaning is not None:
            self._cleaning.cancel()
        await self.archiver.close(abandon=self._drain_cut)
        await self.redis.aclose()
