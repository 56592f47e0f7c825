"""Reading a spool an older shipper or router left: shipped before the log, once, then removed.

Before the write-ahead log (:mod:`splitstream.common.wal`) was the spool, a shipper (and before it a
router) spooled record batches here while the recorder was unreachable or slow. Nothing writes a spool
any more, but a host upgraded from such a version may still hold one, full of calls not yet recorded: a
shipper that finds it (:func:`leftover`, in ``--spool-dir``, by default its first ``--log-dir``) sends it,
oldest first, before the log, then removes it (:meth:`Spool.remove`). So this module stays, for reading
only, as long as an upgrade from a spooling version is supported. Layout: a directory of segment files
(``00000001.seg`` …) and a cursor saying how far entries were acknowledged, written at most every 0.1 s
and at :meth:`Spool.flush`, so that a shipper restarted mid-way resends only what was not acknowledged.

Entry framing, chosen so that damage costs only the entries it touches::

    magic b"\\xf0SPL" | u32 payload length | u32 records | u32 payload crc32 | u32 header crc32 | payload

The header checksum makes a header trustworthy on its own; the magic lets the
reader find the next entry after damage. When an entry does not check (a flipped
bit in its header or payload, a truncation, a torn last write), the reader scans
forward from the entry's first byte + 1 for the next magic whose header and
payload both check, and resumes there. So a torn tail needs no repair, and a bad
byte in the middle of a segment costs that one entry, never the entries after it.
Each damaged range is reported (segment, offset, bytes, and the record count when
its header survived) through ``on_damage`` and logged.

Segments of the layout before that (``*.spool``: ``<u32 length><u32 crc32>``
entries, no magic) are read too, oldest first. Damage in them cannot be resynced
past: the rest of that segment is reported damaged.

The cursor must stay writable on a disk that the spool's segments filled, or every
restart would resend all that was acknowledged: it lives in ``cursor.slots``, a
64-byte file allocated when the spool opens and from then on only overwritten in
place (no new blocks, so no ENOSPC, on any file system that does not copy on
write). It holds two slots of ``magic | u64 sequence | u64 segment | u64 offset |
u32 crc32``, written alternately with fsync; a torn slot write fails its checksum
and the reader takes the other slot, the newer of the two that check, so a crash
mid-write costs at most the previous 0.1 s of acknowledgements. A text ``cursor``
file left by an older router is read when no slot checks, and removed once a slot
is written. All methods block on file I/O: call them off the event loop
(``asyncio.to_thread``).
"""

from __future__ import annotations

import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from splitstream.common.files import fsync_directory

log = structlog.get_logger()

MAGIC = b"\xf0SPL"
#: magic, payload length, records in the payload, payload crc32, header crc32 (of the 16 bytes before it).
HEADER = struct.Struct("<4sIIII")
_CHECKED = struct.Struct("<4sIII")
_SUFFIX = ".seg"
#: The previous layout's segments: read (so an old spool is delivered), never written.
_LEGACY_SUFFIX = ".spool"
_LEGACY_HEADER = struct.Struct("<II")
#: Longest the cursor file lags the acknowledged position (see ``_set_cursor``).
CURSOR_WRITE_S = 0.1
#: magic, sequence (the newer valid slot wins), segment, offset, crc32 of the 28 bytes before it.
CURSOR_SLOT = struct.Struct("<4sQQQI")
_CURSOR_MAGIC = b"\xf0CUR"
_CURSOR_CHECKED = struct.Struct("<4sQQQ")
CURSOR_FILE = "cursor.slots"
#: The previous layout's cursor (text ``segment offset``, replaced by rename): read, never written.
_LEGACY_CURSOR_FILE = "cursor"


@dataclass(frozen=True, slots=True)
class Damage:
    """A byte range of a segment that held no entry that checks; its entries are lost."""

    segment: int
    offset: int
    length: int
    #: Records the damaged entry held, when its header survived (None: unknown).
    records: int | None


class Spool:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        on_damage: Callable[[Damage], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        #: Called (under the spool's lock, in the reading thread) for each damaged range skipped.
        self.on_damage = on_damage
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._legacy = _numbered(self.directory, _LEGACY_SUFFIX)
        current = _numbered(self.directory, _SUFFIX)
        self._segments = sorted(self._legacy | current)
        self._sizes = {s: self._path(s).stat().st_size for s in self._segments}
        self._cursor_sequence = 0
        self._cursor_allocated = False
        self._cursor = self._read_cursor()
        self._cursor_written = time.monotonic()
        try:
            self._allocate_cursor()
        except OSError as error:  # a disk already full: retried at each cursor write
            log.error("spool: cursor file not allocated", error=str(error)[:300])
        self._drop_consumed_segments()

    # -- reading ---------------------------------------------------------------------------

    def peek(self) -> tuple[bytes, tuple[int, int]] | None:
        """The oldest entry not yet acknowledged and the position just past it (for :meth:`commit`).

        Damaged ranges met on the way are reported, logged and skipped: the cursor moves past them,
        so they are never read again and do not count as pending."""
        with self._lock:
            while True:
                found = self._next_at(*self._cursor)
                if found is None:
                    return None
                if isinstance(found, Damage):
                    self._report(found)
                    self._set_cursor((found.segment, found.offset + found.length))
                    continue
                return found

    def commit(self, position: tuple[int, int]) -> None:
        """Mark everything before ``position`` as delivered; delete segments left behind."""
        with self._lock:
            self._set_cursor(position)

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes()

    def empty(self) -> bool:
        return self.pending_bytes == 0

    # -- internals -------------------------------------------------------------------------

    def _next_at(self, segment: int, offset: int) -> tuple[bytes, tuple[int, int]] | Damage | None:
        """The entry at or after the position, or the damaged range that starts there; None at the end."""
        for candidate in self._segments:
            if candidate < segment:
                continue
            if candidate > segment:
                offset = 0
            size = self._sizes[candidate]
            if offset >= size:
                continue
            with open(self._path(candidate), "rb") as file:
                file.seek(offset)
                if candidate in self._legacy:
                    return _read_legacy(file, candidate, offset, size)
                return _read(file, candidate, offset, size)
        return None

    def _report(self, damage: Damage) -> None:
        log.error(
            "spool: damaged entry skipped; its records are lost",
            segment=damage.segment,
            offset=damage.offset,
            length=damage.length,
            records=damage.records,
        )
        if self.on_damage is not None:
            self.on_damage(damage)

    def remove(self) -> None:
        """Delete every segment and cursor file: the spool is shipped (called once it is empty)."""
        with self._lock:
            for name in os.listdir(self.directory):
                if name.endswith((_SUFFIX, _LEGACY_SUFFIX)) or name in (CURSOR_FILE, _LEGACY_CURSOR_FILE):
                    (self.directory / name).unlink(missing_ok=True)
            self._segments.clear()
            self._sizes.clear()
            self._legacy.clear()
            fsync_directory(self.directory)

    def flush(self) -> None:
        """Write the cursor now (at shutdown), so a restart resends nothing already acknowledged."""
        with self._lock:
            self._write_cursor()

    def _set_cursor(self, position: tuple[int, int]) -> None:
        self._cursor = position
        # A durable cursor costs an fsync (0.35 ms on ext4 here; ~3 ms as a write and rename) and a drain
        # commits once per batch; one lagging at most CURSOR_WRITE_S behind only makes a crash resend a
        # few batches (readers drop duplicates), so it is written at most that often, and before
        # segments are deleted.
        if time.monotonic() - self._cursor_written >= CURSOR_WRITE_S or self._consumed_segments():
            try:
                self._write_cursor()
            except OSError as error:
                # Only when the cursor file could never be allocated. Segments are deleted all the same:
                # a restart then resumes at the start of the first one left, which resends less, and
                # their space is what the cursor file needs.
                log.error("spool: cursor not written", error=str(error)[:300])
        self._drop_consumed_segments()

    def _allocate_cursor(self) -> None:
        """Create ``cursor.slots`` at its full size, so that writing it never needs a free block."""
        if self._cursor_allocated:
            return
        path = self.directory / CURSOR_FILE
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(descriptor).st_size >= 2 * CURSOR_SLOT.size:
                self._cursor_allocated = True
                return
            # Zeros check as no slot: the cursor read before stays in memory until the first write.
            _write_all(descriptor, bytes(2 * CURSOR_SLOT.size), 0)
            os.fsync(descriptor)
        except OSError:
            path.unlink(missing_ok=True)  # a short file would need new blocks later: try again then
            raise
        finally:
            os.close(descriptor)
        fsync_directory(self.directory)
        self._cursor_allocated = True

    def _write_cursor(self) -> None:
        self._allocate_cursor()
        sequence = self._cursor_sequence + 1
        checked = _CURSOR_CHECKED.pack(_CURSOR_MAGIC, sequence, *self._cursor)
        slot = checked + struct.pack("<I", zlib.crc32(checked))
        try:
            descriptor = os.open(self.directory / CURSOR_FILE, os.O_WRONLY)
        except FileNotFoundError:
            self._cursor_allocated = False  # removed by hand: allocated again at the next write
            raise
        try:
            _write_all(descriptor, slot, (sequence % 2) * CURSOR_SLOT.size)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        self._cursor_sequence = sequence
        self._cursor_written = time.monotonic()
        legacy = self.directory / _LEGACY_CURSOR_FILE
        if legacy.exists():
            legacy.unlink()
            fsync_directory(self.directory)

    def _pending_bytes(self) -> int:
        segment, offset = self._cursor
        return sum(size - (offset if s == segment else 0) for s, size in self._sizes.items() if s >= segment)

    def _path(self, segment: int) -> Path:
        return self.directory / f"{segment:08d}{_LEGACY_SUFFIX if segment in self._legacy else _SUFFIX}"

    def _read_cursor(self) -> tuple[int, int]:
        start = (self._segments[0] if self._segments else 1), 0
        slots = _read_cursor_slots(self.directory / CURSOR_FILE)
        if slots is not None:
            self._cursor_sequence, segment, offset = slots
        else:
            try:
                segment, offset = (int(p) for p in (self.directory / _LEGACY_CURSOR_FILE).read_text().split())
            except (OSError, ValueError):  # none yet, or unreadable: resend from the start (at least once)
                return start
        if not self._segments or segment > self._segments[-1]:
            # Past every segment there is (files removed by hand): new segments start again at 1,
            # and a cursor beyond them would hide them.
            return start
        return segment, offset

    def _consumed_segments(self) -> list[int]:
        """Segments wholly before the cursor, and the cursor's segment once fully read and not last."""
        segment, offset = self._cursor
        return [
            candidate
            for candidate in self._segments
            if candidate < segment
            or (candidate == segment and offset >= self._sizes[candidate] and candidate != self._segments[-1])
        ]

    def _drop_consumed_segments(self) -> None:
        for candidate in self._consumed_segments():
            self._path(candidate).unlink(missing_ok=True)
            self._segments.remove(candidate)
            self._sizes.pop(candidate)
            self._legacy.discard(candidate)


def leftover(directory: str | os.PathLike[str], **kwargs: Any) -> Spool | None:
    """The spool an older router or shipper left in ``directory``, if it left any segment (else None, and
    nothing is created there)."""
    try:
        if not (_numbered(Path(directory), _SUFFIX) or _numbered(Path(directory), _LEGACY_SUFFIX)):
            return None
    except FileNotFoundError:
        return None
    return Spool(directory, **kwargs)


def _numbered(directory: Path, suffix: str) -> set[int]:
    """Numbers of the segments in ``directory`` ending in ``suffix``: regular files named exactly as a spool
    names them (``00000001.seg``). A foreign ``1.seg``, or a directory so named, is not a segment: taken for
    one, it would fail the shipper's start, for ever (a router restarts its child shipper)."""
    numbers = set()
    for entry in os.scandir(directory):
        stem = entry.name[: -len(suffix)]
        named = entry.name.endswith(suffix) and stem.isascii() and stem.isdigit()
        if named and entry.name == f"{int(stem):08d}{suffix}" and entry.is_file():
            numbers.add(int(stem))
    return numbers


def _write_all(descriptor: int, data: bytes, offset: int) -> None:
    """``pwrite`` all of ``data``: a short write is retried, so its error (ENOSPC, EFBIG) is raised."""
    view = memoryview(data)
    while view:
        written = os.pwrite(descriptor, view, offset)
        view = view[written:]
        offset += written


def _read_cursor_slots(path: Path) -> tuple[int, int, int] | None:
    """(sequence, segment, offset) of the newer slot that checks; None if none does or there is no file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    best: tuple[int, int, int] | None = None
    for start in (0, CURSOR_SLOT.size):
        slot = data[start : start + CURSOR_SLOT.size]
        if len(slot) < CURSOR_SLOT.size:
            continue
        magic, sequence, segment, offset, checksum = CURSOR_SLOT.unpack(slot)
        if magic != _CURSOR_MAGIC or zlib.crc32(slot[: _CURSOR_CHECKED.size]) != checksum:
            continue  # never written, or torn by a crash mid-write: the other slot holds the cursor
        if best is None or sequence > best[0]:
            best = sequence, segment, offset
    return best


def _read(file: BinaryIO, segment: int, offset: int, size: int) -> tuple[bytes, tuple[int, int]] | Damage:
    """The entry at ``offset`` of a segment, or the damaged range from there to the next entry that checks."""
    data = file.read(HEADER.size)
    records: int | None = None
    if len(data) == HEADER.size:
        magic, length, count, payload_crc, header_crc = HEADER.unpack(data)
        if magic == MAGIC and zlib.crc32(data[: _CHECKED.size]) == header_crc:
            records = count
            payload = file.read(length)
            if len(payload) == length and zlib.crc32(payload) == payload_crc:
                return payload, (segment, offset + HEADER.size + length)
    # Damaged: find the next entry that checks, from the next byte on (a torn header can hide a magic).
    file.seek(offset)
    rest = file.read(size - offset)
    resume = _next_valid(rest, 1)
    return Damage(segment, offset, resume, records)


def _next_valid(data: bytes, start: int) -> int:
    """Index of the first whole, checking entry in ``data`` at or after ``start``; ``len(data)`` if none."""
    position = data.find(MAGIC, start)
    while position != -1:
        header = data[position : position + HEADER.size]
        if len(header) == HEADER.size:
            _, length, _, payload_crc, header_crc = HEADER.unpack(header)
            end = position + HEADER.size + length
            if (
                zlib.crc32(header[: _CHECKED.size]) == header_crc
                and end <= len(data)
                and zlib.crc32(data[position + HEADER.size : end]) == payload_crc
            ):
                return position
        position = data.find(MAGIC, position + 1)
    return len(data)


def _read_legacy(file: BinaryIO, segment: int, offset: int, size: int) -> tuple[bytes, tuple[int, int]] | Damage:
    """An entry of the previous layout; it has no marker to resync on, so damage costs the rest of the segment."""
    header = file.read(_LEGACY_HEADER.size)
    if len(header) == _LEGACY_HEADER.size:
        length, checksum = _LEGACY_HEADER.unpack(header)
        payload = file.read(length)
        if len(payload) == length and zlib.crc32(payload) == checksum:
            return payload, (segment, offset + _LEGACY_HEADER.size + length)
    return Damage(segment, offset, size - offset, None)
