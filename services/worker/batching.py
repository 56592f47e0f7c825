"""Schedulers: how validated requests reach the backend's executor threads.

Two schedulers share one interface (:class:`Scheduler`):

* :class:`DynamicBatcher` stacks concurrent requests along the batch
  dimension and runs them as one backend call, which is where a GPU (and, less
  so, a CPU) gets its throughput.
* :class:`DirectScheduler` runs every request alone, for models without a
  batch dimension or with dynamic batching turned off.

Both run the backend in a ThreadPoolExecutor of ``instance_count`` threads, so
the event loop never blocks on an engine, and both stack/split arrays in those
threads too. A cancelled RPC only withdraws its own request; a failing backend
run fails the requests of that run and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog

from splitstream.common.errors import ModelNotReady, SplitstreamError
from splitstream.worker.metrics import WorkerMetrics

#: A backend's ``run``: arrays in, the named outputs out. Blocking; called from executor threads.
RunFn = Callable[[Mapping[str, np.ndarray], Sequence[str]], dict[str, np.ndarray]]


class BackendError(SplitstreamError):
    """The backend failed while running a batch → INTERNAL; the details go to the log, not the client."""


class Scheduler(Protocol):
    """Runs requests on the backend; :meth:`start` once inside the event loop, :meth:`stop` once at the end."""

    def start(self) -> None: ...

    async def submit(
        self, inputs: Mapping[str, np.ndarray], output_names: tuple[str, ...], rows: int
    ) -> dict[str, np.ndarray]:
        """The request's outputs; raises BackendError if its backend run failed, ModelNotReady once stopped."""
        ...

    async def stop(self) -> None:
        """Let running backend calls finish, fail requests still waiting, release the threads."""
        ...

    def depth(self) -> int:
        """Requests waiting for a backend run (read from the metrics thread)."""
        ...


class DirectScheduler:
    """One backend run per request, at most ``instance_count`` at a time."""

    def __init__(
        self, run: RunFn, *, instance_count: int, metrics: WorkerMetrics, logger: structlog.stdlib.BoundLogger
    ) -> None:
        self._run = run
        self._metrics = metrics
        self._logger = logger
        self._executor = ThreadPoolExecutor(max_workers=instance_count, thread_name_prefix="backend")
        self._slots = asyncio.Semaphore(instance_count)
        self._waiting = 0
        self._stopped = False

    def start(self) -> None:
        pass

    async def submit(
        self, inputs: Mapping[str, np.ndarray], output_names: tuple[str, ...], rows: int
    ) -> dict[str, np.ndarray]:
        if self._stopped:
            raise ModelNotReady("the worker is shutting down")
        enqueued_at = time.monotonic()
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            self._metrics.queued(time.monotonic() - enqueued_at)
            loop = asyncio.get_running_loop()
            try:
                return await loop.run_in_executor(
                    self._executor, _run_one, self._run, self._metrics, inputs, output_names, rows
                )
            except Exception as error:
                self._logger.exception("backend run failed", requests=1, rows=rows)
                raise BackendError("inference failed") from error
        finally:
            self._slots.release()

    async def stop(self) -> None:
        self._stopped = True
        await asyncio.to_thread(self._executor.shutdown, wait=True)

    def depth(self) -> int:
        return self._waiting


@dataclass(eq=False)
class _Pending:
    inputs: Mapping[str, np.ndarray]
    output_names: tuple[str, ...]
    rows: int
    #: Requests with equal keys can be stacked: same input names, dtypes and non-batch dims.
    key: tuple[Any, ...]
    future: asyncio.Future[dict[str, np.ndarray]]
    enqueued_at: float = field(default_factory=time.monotonic)


class DynamicBatcher:
    """Queue concurrent requests and run them in batches of up to ``max_batch_size`` rows.

    One task forms batches: it first waits for a free executor slot (so
    requests keep accumulating while every instance is busy), then takes the
    oldest waiting request and adds compatible requests, in arrival order,
    while they fit. The batch launches when it is full or when
    ``max_queue_delay_us`` has passed since its oldest request arrived.
    Requests that do not fit or whose shapes differ wait for a later batch.
    """

    def __init__(
        self,
        run: RunFn,
        *,
        max_batch_size: int,
        max_queue_delay_us: int,
        instance_count: int,
        metrics: WorkerMetrics,
        logger: structlog.stdlib.BoundLogger,
    ) -> None:
        self._run = run
        self._max_rows = max_batch_size
        self._max_delay_s = max_queue_delay_us / 1_000_000
        self._metrics = metrics
        self._logger = logger
        self._executor = ThreadPoolExecutor(max_workers=instance_count, thread_name_prefix="backend")
        self._slots = asyncio.Semaphore(instance_count)
        self._pending: deque[_Pending] = deque()
        self._arrived = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()
        self._former: asyncio.Task[None] | None = None
        self._stopped = False

    def start(self) -> None:
        self._former = asyncio.create_task(self._form_batches(), name="dynamic-batcher")
        self._former.add_done_callback(self._former_ended)

    def _former_ended(self, task: asyncio.Task[None]) -> None:
        """The batch former only ends by cancellation; anything else is a bug that would hang every request."""
        if task.cancelled():
            return
        self._logger.error("dynamic batcher stopped unexpectedly", exc_info=task.exception())
        self._stopped = True
        for request in self._pending:
            if not request.future.done():
                request.future.set_exception(BackendError("inference failed"))
        self._pending.clear()

    async def submit(
        self, inputs: Mapping[str, np.ndarray], output_names: tuple[str, ...], rows: int
    ) -> dict[str, np.ndarray]:
        if self._stopped:
            raise ModelNotReady("the worker is shutting down")
        key = tuple((name, array.dtype.str, array.shape[1:]) for name, array in sorted(inputs.items()))
        future: asyncio.Future[dict[str, np.ndarray]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(inputs=inputs, output_names=output_names, rows=rows, key=key, future=future))
        self._arrived.set()
        # Cancelling the caller cancels the future; the batch former then skips it.
        return await future

    async def stop(self) -> None:
        self._stopped = True
        if self._former is not None:
            self._former.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._former
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        for request in self._pending:
            if not request.future.done():
                request.future.set_exception(ModelNotReady("the worker is shutting down"))
        self._pending.clear()
        await asyncio.to_thread(self._executor.shutdown, wait=True)

    def depth(self) -> int:
        return len(self._pending)

    async def _form_batches(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                batch = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.create_task(self._run_batch(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _next_batch(self) -> list[_Pending]:
        while True:
            while not self._drop_withdrawn():
                self._arrived.clear()
                await self._arrived.wait()
            first = self._pending[0]
            deadline = first.enqueued_at + self._max_delay_s
            while True:
                batch, rows = self._select(first.key)
                remaining = deadline - time.monotonic()
                if not batch or rows >= self._max_rows or remaining <= 0:
                    break
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._arrived.wait()
            if batch:
                chosen = set(batch)
                self._pending = deque(r for r in self._pending if r not in chosen and not r.future.done())
                return batch

    def _select(self, key: tuple[Any, ...]) -> tuple[list[_Pending], int]:
        """Oldest-first requests with ``key`` that fit together in one batch."""
        batch: list[_Pending] = []
        rows = 0
        for request in self._pending:
            if request.future.done() or request.key != key or rows + request.rows > self._max_rows:
                continue
            batch.append(request)
            rows += request.rows
            if rows == self._max_rows:
                break
        return batch, rows

    def _drop_withdrawn(self) -> bool:
        """Forget requests whose caller went away; True if any request is still waiting."""
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()
        return bool(self._pending)

    async def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            loop = asyncio.get_running_loop()
            try:
                results = await loop.run_in_executor(self._executor, self._execute, batch)
            except Exception:
                rows = sum(request.rows for request in batch)
                self._logger.exception("backend run failed", requests=len(batch), rows=rows)
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(BackendError("inference failed"))
                return
            for request, outputs in zip(batch, results, strict=True):
                if not request.future.done():
                    request.future.set_result(outputs)
        finally:
            self._slots.release()

    def _execute(self, batch: list[_Pending]) -> list[dict[str, np.ndarray]]:
        """Stack, run, split; in an executor thread."""
        started = time.monotonic()
        for request in batch:
            self._metrics.queued(started - request.enqueued_at)
        if len(batch) == 1:
            inputs = batch[0].inputs
        else:
            inputs = {name: np.concatenate([r.inputs[name] for r in batch]) for name in batch[0].inputs}
        output_names = list(dict.fromkeys(name for request in batch for name in request.output_names))
        rows = sum(request.rows for request in batch)
        began = time.perf_counter()
        outputs = self._run(inputs, output_names)
        self._metrics.batch_ran(rows=rows, seconds=time.perf_counter() - began)
        for name in output_names:
            if outputs[name].ndim == 0 or outputs[name].shape[0] != rows:
                raise ValueError(f"output '{name}' has shape {list(outputs[name].shape)} for a batch of {rows} rows")
        results = []
        start = 0
        for request in batch:
            end = start + request.rows
            results.append({name: outputs[name][start:end] for name in request.output_names})
            start = end
        return results


def _run_one(
    run: RunFn,
    metrics: WorkerMetrics,
    inputs: Mapping[str, np.ndarray],
    output_names: tuple[str, ...],
    rows: int,
) -> dict[str, np.ndarray]:
    began = time.perf_counter()
    outputs = run(inputs, output_names)
    metrics.batch_ran(rows=rows, seconds=time.perf_counter() - began)
    return outputs
