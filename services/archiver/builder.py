"""The process that turns stream entries into Parquet files and writes them, beside the reading loop.

Why a process and not a thread: decoding the entries, building the tables and zstd Parquet need the
GIL for most of their time, as does the loop reading the next entries from Redis; in one process
they took turns (measured: the reads ran about twice as long while a file was built). In a child
process, reading and building overlap on two cores. The loop hands over each XREADGROUP reply
packed (marshal) as it arrives (one C-speed call while the reply is still in the CPU cache) and gets back
only counts; it acknowledges the entries once :func:`write_batches` returned, that is once every
file is written (an object store's upload complete), as before.

The child is a plain ``python -m splitstream.archiver.builder_main`` process with two pipes (calls on its
stdin, their pickled answers on a pipe of their own: its stdout and stderr are the archiver's, for log
lines; one call at a time), not a :mod:`multiprocessing` pool: a pool's spawn machinery
starts a resource tracker beside the child and registers the pool's semaphores with it, and a
SIGKILLed archiver leaves both behind (the tracker lives as long as the child) and then a
"leaked semaphore objects" warning. The child ignores SIGINT and SIGTERM (the loop decides when to
stop: a drain lets the write in flight finish) and is killed by the kernel when the archiver dies,
however it dies (see :mod:`splitstream.archiver.builder_main`): a SIGKILLed archiver leaves no
process writing on, even one killed while its builder was still starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import marshal
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import pyarrow as pa

from splitstream.archiver.tables import Entry, Pair, call_files, decode_calls, feedback_files, id_key
from splitstream.common.archive import CALLS, Archive, write_file


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
    meanwhile) and reads back a little faster. Both ends are the same interpreter (the child is started
    from ``sys.executable``), which is all marshal's format asks."""
    return marshal.dumps(list(pairs))


# -- in the child ------------------------------------------------------------------------------

#: A message on a pipe: its length, then the pickle.
_LENGTH = struct.Struct("<Q")


class BuilderGone(Exception):
    """The other end of the builder's pipes closed (the process died, or its parent did)."""


def _send(sink: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sink.write(_LENGTH.pack(len(data)))
    sink.write(data)
    sink.flush()


def _receive(source: IO[bytes]) -> Any:
    head = source.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise BuilderGone("its pipe closed")
    (size,) = _LENGTH.unpack(head)
    data = source.read(size)
    if len(data) < size:
        raise BuilderGone("its pipe closed mid-message")
    return pickle.loads(data)


def serve(source: IO[bytes], sink: IO[bytes]) -> None:
    """The child's loop: the archive first, then ``(name, args)`` calls, each answered ``(True, result)`` or
    ``(False, exception)``, until the archiver closes the pipe."""
    archive: Archive = _receive(source)
    while True:
        try:
            name, args = _receive(source)
        except BuilderGone:
            return
        try:
            answer: tuple[bool, object] = (True, os.getpid() if name == "ready" else _write_in_child(archive, *args))
        except Exception as error:
            answer = (False, error)
        try:
            _send(sink, answer)
        except pickle.PicklingError:
            _send(sink, (False, RuntimeError(repr(answer[1])[:1000])))


def _write_in_child(archive: Archive, *args: Any) -> Built:
    """:func:`write_batches` with the garbage collector off: the entries are lists of bytes, no cycles,
    and its passes over the tens of thousands of them just unpacked cost as much as the rest of the
    build (measured alone: 10 to 19 µs a record with it, 9.2 to 9.6 without). The child does nothing else."""
    gc.disable()
    try:
        return write_batches(archive, *args)
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


class _Child:
    """One builder process and its two pipes (its stdin; :attr:`answers`). :meth:`call` blocks: run it in a thread."""

    def __init__(self, archive: Archive) -> None:
        # Started from the loop's thread: the kernel's parent-death signal follows the thread that started the
        # child, and this one lives as long as the process (a pool thread may end before it).
        # The answers come on a pipe of their own (its fd number given on the command line), not on stdout:
        # whatever else writes to the child's stdout (a start-up hook, a library's print) goes to the log as
        # the archiver's own output does, and cannot be read as an answer.
        answers, sink = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "splitstream.archiver.builder_main", str(os.getpid()), str(sink)],
                stdin=subprocess.PIPE,
                pass_fds=(sink,),
            )
        except BaseException:
            os.close(answers)
            raise
        finally:
            os.close(sink)  # the child's copy is the only writer: its death is the end of the pipe here
        self.answers = os.fdopen(answers, "rb")
        self.archive = archive
        self._configured = False

    def call(self, name: str, args: tuple[object, ...]) -> Any:
        assert self.process.stdin is not None
        try:
            if not self._configured:
                _send(self.process.stdin, self.archive)
                self._configured = True
            _send(self.process.stdin, (name, args))
            ok, value = _receive(self.answers)
        except (BuilderGone, OSError, ValueError) as error:  # BrokenPipeError: it died before reading
            self.kill()
            code = self.process.poll()
            raise UploadFailed(f"the file-building process died (exit {code}): {error}") from None
        if not ok:
            raise value
        return value

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def stop(self, timeout_s: float) -> None:
        """Close its pipe (it exits when it reads the end) and reap it; killed after ``timeout_s``."""
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self.answers.close()


class Builder:
    """One child process, started again if it dies; a file whose write was under way then fails with
    :class:`UploadFailed` and is retried.

    With ``in_process`` False, a thread of the archiver's own process instead (as before the child
    existed): for a host with one core, where the child only adds the hand-over, and for comparison
    (``bench/archive.py``)."""

    def __init__(self, archive: Archive, *, in_process: bool = True) -> None:
        self.archive = archive
        self.in_process = in_process
        self._child: _Child | None = None
        #: One call on the pipes at a time (a write, and another started meanwhile, take turns).
        self._turn = threading.Lock()
        #: The child's process id once :meth:`start` saw it up (None: not started, or in a thread).
        self.pid: int | None = None

    async def start(self) -> None:
        """Start the child now (a second or two of imports) rather than at the first file."""
        if self.in_process:
            self.pid = await self._call("ready")

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
        built: Built = await self._call("write", kind, model, batches, ordered, blob_bytes)
        return built

    async def _call(self, name: str, *args: object) -> Any:
        """Pickled, sent and answered in a thread (a file's entries are megabytes: never on the loop). A
        cancelled caller stops waiting; the call itself runs on, as a pool's did."""
        if self._child is None:  # a dead one fails the call in hand first: counted as an upload error, retried
            self._child = _Child(self.archive)
        return await asyncio.to_thread(self._exchange, self._child, name, args)

    def _exchange(self, child: _Child, name: str, args: tuple[object, ...]) -> Any:
        with self._turn:
            try:
                return child.call(name, args)
            except UploadFailed:
                if self._child is child:
                    self._child = None  # the next call starts a new child
                raise

    def abandon(self) -> None:
        """Kill the child and its write (a shutdown that cannot wait for a store that does not answer): the
        write's entries are not acknowledged, so they are written again later, under the same names by this
        consumer. A write in a thread (``in_process`` False) cannot be killed; the process's exit waits for
        it to fail on the store's timeouts."""
        child, self._child = self._child, None
        if child is not None:
            with contextlib.suppress(OSError):
                child.process.kill()

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop the child once its write in hand is done, waiting ``timeout_s`` at most for that (a store
        that does not answer fails the write within its own timeouts); killed past it."""
        child, self._child = self._child, None
        if child is not None:
            await asyncio.to_thread(self._stop, child, timeout_s)

    def _stop(self, child: _Child, timeout_s: float) -> None:
        if not self._turn.acquire(timeout=timeout_s):
            child.kill()  # its write still under way: its pipes are left to the thread that waits on them
            return
        try:
            child.stop(timeout_s=5.0)
        finally:
            self._turn.release()
