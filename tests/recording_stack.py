"""A real recording stack for end-to-end tests: redis-server, a recorder, workers and a router.

Shared by the recording tests and the replay tests (which record traffic through it first).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import (
    CorruptEntry,
    StoredRecord,
    UnsupportedSchema,
    decode_entry,
    read_entries,
    stream_key,
)
from splitstream.common.redis_url import RedisClient, open_redis
from tests.harness import ServiceProcess, Stack, free_port, wait_for, write_registry
from tests.models import add_version
from tests.records import unique_by_request_id
from tests.redis_server import RedisClusterServers, RedisServer

MODEL = "affine"
HMAC_KEY = "recording-tests-key"


class RecordingStack:
    """redis-server, a recorder, workers and a router with recording on.

    ``versions`` maps each version of model ``affine`` to its ``scale`` (and optional ``bias``,
    worker ``config`` and ``score``: see :func:`tests.models.affine_model`); ``experiment`` goes
    into the registry as is. ``worker(stack, version)`` starts something else in a version's place (a
    stand-in for Triton, say) instead of a worker serving the affine model."""

    def __init__(
        self,
        tmp: Path,
        *,
        recorder_args: tuple[str, ...] = (),
        versions: dict[str, dict] | None = None,
        experiment: dict | None = None,
        router_args: tuple[str, ...] = (),
        worker: Callable[[Stack, str], ServiceProcess] | None = None,
        redis: RedisClusterServers | None = None,
        model: str = MODEL,
        more_models: dict[str, Any] | None = None,
    ) -> None:
        """``redis``: record into this (started) Redis Cluster instead of a Redis of the stack's own; ``model``:
        the registry's model name (with ``worker``, the model the stand-ins serve); ``more_models``: other
        models' registry entries, as they are."""
        self.tmp = tmp
        self.model = model
        tmp.mkdir(parents=True, exist_ok=True)
        # The key from a file, as docs/security.md says: on the command line every local user could read it.
        self.hmac_key_file = tmp / "hmac-key"
        self.hmac_key_file.write_text(HMAC_KEY + "\n")
        # Persistent, as production Redis is: a stop and restart keeps what was written.
        self.redis: RedisServer | RedisClusterServers = (
            redis or RedisServer(tmp / "redis", config=("--appendonly", "yes", "--appendfsync", "always")).start()
        )
        self.stack = Stack(tmp)
        try:
            self.recorder_port = free_port()
            self.recorder_args = recorder_args
            self.recorder = self._recorder()
            repository = tmp / "models"
            versions = versions or {"v1": {"scale": 2.0}}
            self.workers = {}
            for version, spec in versions.items():
                if worker is not None:
                    self.workers[version] = worker(self.stack, version)
                    continue
                add_version(
                    repository,
                    MODEL,
                    version,
                    scale=spec["scale"],
                    bias=spec.get("bias", 0.0),
                    config=spec.get("config"),
                    score=spec.get("score", False),
                )
                self.workers[version] = self.stack.worker(repository, MODEL, version)
            registry = tmp / "registry.yaml"
            entry: dict = {"endpoints": {v: [w.address] for v, w in self.workers.items()}}
            if experiment:
                entry["experiment"] = experiment
            write_registry(registry, {self.model: entry, **(more_models or {})})
            self.registry = registry
            self.spool_dir = tmp / "spool"
            #: The Prometheus port of the child shipper of the router started last (the recording counters).
            self.shipper_metrics_port = 0
            self.router = self.start_router(*router_args)
        except BaseException:
            self.close()  # a part that failed to start leaves none of the others running
            raise

    def start_router(self, *extra: str) -> ServiceProcess:
        """A router recording to this stack's recorder, logging to this stack's spool directory (its child
        shipper's metrics on :attr:`shipper_metrics_port`)."""
        if "external" not in extra:  # a new port each time: the child of a router stopped before may still drain
            self.shipper_metrics_port = free_port()
            extra = ("--shipper-metrics-port", str(self.shipper_metrics_port), *extra)
        return self.stack.router(
            self.registry,
            "--recorder",
            f"127.0.0.1:{self.recorder_port}",
            "--hmac-key-file",
            str(self.hmac_key_file),
            "--log-dir",
            str(self.spool_dir),
            "--record-batch-interval-ms",
            "20",
            *extra,
        )

    def _recorder(self) -> ServiceProcess:
        args = [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.recorder_port),
            "--metrics-port",
            str(free_port()),
            "--redis-url",
            self.redis.url,
            "--hmac-key-file",
            str(self.hmac_key_file),
            "--redis-timeout-s",
            "1",
            *self.recorder_args,
        ]
        process = ServiceProcess(
            f"recorder-{len(self.stack.processes)}",
            "splitstream.recorder",
            args,
            log_dir=self.tmp,
            port=self.recorder_port,
        )
        self.stack.processes.append(process)
        return process.start()

    def restart_recorder(self) -> None:
        self.recorder = self._recorder()

    def records(self, model: str = "") -> list[recorder_pb2.CallRecord]:
        """Every readable record of ``model`` (the stack's own by default), once per request id (entries a test
        wrote as garbage are left out)."""

        async def readable(client: RedisClient) -> AsyncIterator[StoredRecord]:
            async for entry in read_entries(client, model or self.model):
                with contextlib.suppress(CorruptEntry, UnsupportedSchema):
                    yield decode_entry(entry)

        async def read() -> list[recorder_pb2.CallRecord]:
            client = open_redis(self.redis.url)
            try:
                return [s.record async for s in unique_by_request_id(readable(client))]
            finally:
                await client.aclose()

        return asyncio.run(read())

    def raw_count(self) -> int:
        client = self.redis.client()
        try:
            return int(client.xlen(stream_key(self.model)))
        finally:
            client.close()

    def wait_recorded(
        self, request_ids: set[str], timeout_s: float = 30.0, *, model: str = ""
    ) -> list[recorder_pb2.CallRecord]:
        stream = stream_key(model or self.model)

        def done() -> list[recorder_pb2.CallRecord] | None:
            # Every record read and decoded is the test's CPU: while the stream holds fewer entries than the
            # calls waited for (each is at least one), they cannot all be there, and one XLEN says so.
            with contextlib.closing(self.redis.client()) as client:
                if int(client.xlen(stream)) < len(request_ids):
                    return None
            records = self.records(model)
            return records if request_ids <= {r.request_id for r in records} else None

        try:
            return wait_for(done, timeout_s=timeout_s, interval_s=0.05, what="every call to be recorded")
        except TimeoutError:
            missing = request_ids - {r.request_id for r in self.records(model)}
            raise AssertionError(
                f"{len(missing)} of {len(request_ids)} calls never recorded, e.g. "
                f"{sorted(missing)[:5]}\n{self.router.log()[-3000:]}"
            ) from None

    def redis_bytes(self) -> bytes:
        """Every key, stream field and value, and string in this stack's Redis, concatenated: where a leak would be."""
        redis: Any = self.redis.client()  # binary replies; redis-py's stubs cannot say so
        everything = b""
        for key in redis.scan_iter(count=1000):
            everything += key
            kind = redis.type(key)
            if kind == b"stream":
                for _, fields in redis.xrange(key):
                    for field, value in fields.items():
                        everything += field + value
            elif kind == b"string":
                everything += redis.get(key) or b""
        redis.close()
        return everything

    def close(self) -> None:
        self.stack.close()
        self.redis.stop()


def shipper_metric(stack: RecordingStack, name: str, **labels: str) -> float:
    """A counter of the stack's shipper (``splitstream_shipper_<name>``), summed over ``labels``' matches; 0
    while the shipper is not up yet."""
    from tests.harness import metric_samples, scrape_metrics

    try:
        text = scrape_metrics(stack.shipper_metrics_port)
    except OSError:
        return 0.0
    samples = metric_samples(text, f"splitstream_shipper_{name}")
    return sum(value for sample_labels, value in samples if labels.items() <= sample_labels.items())


def wait_recorder_tries(stack: RecordingStack, more: int) -> None:
    """Wait until the stack's shipper has failed ``more`` more streams to the recorder (it is away), each
    after its backoff: an outage held for what happens in it rather than for a time."""
    from tests.harness import wait_for

    failed = shipper_metric(stack, "recorder_stream_failures_total")
    wait_for(
        lambda: shipper_metric(stack, "recorder_stream_failures_total") >= failed + more,
        timeout_s=30,
        what=f"{more} more failed tries of the recorder",
    )
