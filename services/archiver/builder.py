"""The process that turns stream entries into Parquet files and writes them, beside the reading loop.

Why a process and not a thread: decoding the entries, building the tables and zstd Parquet need the
GIL for most of their time, as does the loop reading the next entries from Redis; in one process
they took turns (measured: the reads ran about twice as long while a file was built). In a child
process, reading and building overlap on two cores. The loop hands over each XREADGROUP reply
packed (marshal) as it arrives (one C-speed call while the reply is still in the CPU cache) and gets back
only counts; it acknowledges the entries once :func:`write_batches` returned, that is once every
file is written (an object store's upload complete), as before.

The child ignores SIGINT and SIGTERM (the loop decides when to stop: a drain lets the write in flight
finish) and exits once its parent is gone (a SIGKILLed archiver leaves no orphan writing on).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import marshal
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa

from splitstream.archiver.tables import Entry, Pair, call_files, decode_calls, feedback_files, id_key
from splitstream.common.archive import CALLS, Archive, write_file

T = TypeVar("T")


class UploadFailed(Exception):
    """A file could not be written to the archive (the store refused or did not answer)."""


@dataclass(frozen=True, slots=True)
class Built:
    """What one :func:`write_batches` did. ``blobs`` non-empty: nothing written yet, the records
    reference these blobs; call again with their bytes."""

    files: int = 0
    bytes: int = 0
    missing_blobs: int = 0
    corrupt: int = 0
    blobs: tuple[str, ...] = ()


def pack_entries(pairs: Sequence[Pair]) -> bytes:
    """``(stream id, [name, value, ...])`` pairs as the builder reads them (as Redis's reply holds them).

    ``marshal``, not ``pickle``: the pairs are lists and tuples of bytes, which marshal writes in half
    the time pickle takes (measured: 1.2 against 2.5 µs a demo record, in the loop, which reads Redis
    meanwhile) and reads back a little faster. Both ends are the same interpreter (the child is spawned
    from ``sys.executable``), which is all marshal's format asks."""
    return marshal.dumps(list(pairs))


# -- in the child ------------------------------------------------------------------------------

_archive: Archive | None = None


def _start(archive: Archive) -> None:
    global _archive
    _archive = archive
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A spawned pool worker blocks on its call queue even after its parent died (it holds the
    queue's write end too): poll for the parent instead."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _ready() -> int:
    return os.getpid()


def _write_in_child(*args: Any) -> Built:
    """:func:`write_batches` with the garbage collector off: the entries are lists of bytes, no cycles,
    and its passes over the tens of thousands of them just unpacked cost as much as the rest of the
    build (measured alone: 10 to 19 µs a record with it, 9.2 to 9.6 without). The child does nothing else."""
    assert _archive is not None, "the builder process was not started"
    gc.disable()
    try:
        return write_batches(_archive, *args)
    finally:
        gc.enable()


def write_batches(
    archive: Archive,
    kind: str,
    model: str,
    batches: Sequence[bytes | list[Any]],
    ordered: bool,
    blob_bytes: dict[str, bytes] | None,
) -> Built:
    """Decode the entries (each batch packed by :func:`pack_entries`, or the pairs as read; in stream id order unless
    ``ordered`` is False), build the files of their hour partitions and write them. Blocking (in the
    child, or a thread)."""
    pairs: list[Pair] = [
        pair for data in batches for pair in (marshal.loads(data) if isinstance(data, bytes) else data)
    ]
    if not ordered:
        pairs.sort(key=lambda pair: id_key(pair[0].decode()))
    missing = corrupt = 0
    if kind == CALLS:
        decoded = decode_calls(pairs)
        if decoded.blobs and blob_bytes is None:
            return Built(blobs=tuple(sorted(decoded.blobs)))
        files, missing = call_files(model, decoded, blob_bytes or {})
        corrupt = decoded.corrupt
    else:
        files = feedback_files(model, [Entry(raw_id.decode(), flat) for raw_id, flat in pairs])
    written = 0
    for planned in files:
        try:
            written += write_file(archive, planned.relative_path, planned.table)
        except (OSError, pa.ArrowException) as error:
            raise UploadFailed(f"{planned.relative_path}: {' '.join(str(error).split())[:300]}") from None
    return Built(files=len(files), bytes=written, missing_blobs=missing, corrupt=corrupt)


# -- in the archiver ---------------------------------------------------------------------------


class Builder:
    """One child process (spawned: no copy of the parent's event loop or sockets), started again if it
    dies; a file whose write was under way then fails with :class:`UploadFailed` and is retried.

    With ``in_process`` False, a thread of the archiver's own process instead (as before the child
    existed): for a host with one core, where the child only adds the hand-over, and for comparison
    (``bench/archive.py``)."""

    def __init__(self, archive: Archive, *, in_process: bool = True) -> None:
        self.archive = archive
        self.in_process = in_process
        self._pool: ProcessPoolExecutor | None = None
        #: The child's process id once :meth:`start` saw it up (None: not started, or in a thread).
        self.pid: int | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start,
                initargs=(self.archive,),
            )
        return self._pool

    async def start(self) -> None:
        """Spawn the child now (a second or two of imports) rather than at the first file."""
        if self.in_process:
            self.pid = await self._call(_ready)

    async def write(
        self,
        kind: str,
        model: str,
        batches: Sequence[bytes | list[Any]],
        ordered: bool,
        blob_bytes: dict[str, bytes] | None,
    ) -> Built:
        if not self.in_process:
            return await asyncio.to_thread(write_batches, self.archive, kind, model, batches, ordered, blob_bytes)
        return await self._call(_write_in_child, kind, model, batches, ordered, blob_bytes)

    async def _call(self, function: Callable[..., T], *args: object) -> T:
        try:
            return await asyncio.wrap_future(self._executor().submit(function, *args))
        except BrokenProcessPool as error:
            await self.close()  # the next call starts a new child
            raise UploadFailed(f"the file-building process died: {error}") from None

    def abandon(self) -> None:
        """Kill the child and its write (a shutdown that cannot wait for a store that does not answer): the
        write's entries are not acknowledged, so they are written again later, under the same names by this
        consumer. A write in a thread (``in_process`` False) cannot be killed; the process's exit waits for
        it to fail on the store's timeouts."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for child in multiprocessing.active_children():  # the pool's one worker: the archiver starts no other
            child.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop the child once its write in hand is done, waiting ``timeout_s`` at most here (a store
        that does not answer fails the write within its own timeouts)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True), timeout_s)
