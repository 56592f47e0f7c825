"""A size-capped, append-only, crash-safe on-disk queue of record batches.

The router spools record batches here while the recorder is unreachable or slow,
and sends them, oldest first, when it is back. Layout: a directory of segment
files (``00000001.spool`` …); each entry is ``<u32 length><u32 crc32><payload>``.
A ``cursor`` file (replaced atomically) says how far entries were acknowledged.

Crash safety: each append is flushed and fsync'd before it counts. On open, the
last segment is scanned and a torn tail (a short header, a short payload or a
bad checksum: a write cut by a crash) is cut off, so it is skipped, never read
as a record. The cap is on bytes not yet acknowledged; a full spool refuses
the append (the caller drops and counts), it never blocks.

All methods block on file I/O: call them off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from pathlib import Path

import structlog

log = structlog.get_logger()

_HEADER = struct.Struct("<II")
_SUFFIX = ".spool"


class Spool:
    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int, segment_bytes: int = 8 << 20) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._segments = sorted(int(p.stem) for p in self.directory.glob(f"*{_SUFFIX}") if p.stem.isdigit())
        self._cursor = self._read_cursor()
        self._drop_consumed_segments()
        if self._segments:
            self._repair(self._segments[-1])
        self._sizes = {s: self._path(s).stat().st_size for s in self._segments}

    # -- writing ---------------------------------------------------------------------------

    def append(self, payload: bytes) -> bool:
        """Durably append one entry; False (nothing written) when it would pass the cap."""
        entry = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        with self._lock:
            if self._pending_bytes() + len(entry) > self.max_bytes:
                return False
            if not self._segments or self._sizes[self._segments[-1]] >= self.segment_bytes:
                segment = (self._segments[-1] + 1) if self._segments else 1
                self._segments.append(segment)
                self._sizes[segment] = 0
            segment = self._segments[-1]
            with open(self._path(segment), "ab") as file:
                file.write(entry)
                file.flush()
                os.fsync(file.fileno())
            self._sizes[segment] += len(entry)
            return True

    # -- reading ---------------------------------------------------------------------------

    def peek(self, after: tuple[int, int] | None = None) -> tuple[bytes, tuple[int, int]] | None:
        """The next entry after ``after`` (default: the cursor) and the position just past it."""
        with self._lock:
            segment, offset = after or self._cursor
            for candidate in self._segments:
                if candidate < segment:
                    continue
                if candidate > segment:
                    segment, offset = candidate, 0
                if offset >= self._sizes[candidate]:
                    continue
                with open(self._path(candidate), "rb") as file:
                    file.seek(offset)
                    header = file.read(_HEADER.size)
                    length, checksum = _HEADER.unpack(header)
                    payload = file.read(length)
                if zlib.crc32(payload) != checksum:  # only possible if the disk changed under us
                    log.error("spool entry corrupt; skipping the rest of its segment", segment=candidate)
                    offset = self._sizes[candidate]
                    continue
                return payload, (candidate, offset + _HEADER.size + length)
            return None

    def commit(self, position: tuple[int, int]) -> None:
        """Mark everything before ``position`` as delivered; delete segments left behind."""
        with self._lock:
            self._cursor = position
            staging = self.directory / "cursor.tmp"
            staging.write_text(f"{position[0]} {position[1]}\n")
            os.replace(staging, self.directory / "cursor")
            self._drop_consumed_segments()

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes()

    def empty(self) -> bool:
        return self.pending_bytes == 0

    # -- internals -------------------------------------------------------------------------

    def _pending_bytes(self) -> int:
        segment, offset = self._cursor
        return sum(size - (offset if s == segment else 0) for s, size in self._sizes.items() if s >= segment)

    def _path(self, segment: int) -> Path:
        return self.directory / f"{segment:08d}{_SUFFIX}"

    def _read_cursor(self) -> tuple[int, int]:
        try:
            segment, offset = (self.directory / "cursor").read_text().split()
            return int(segment), int(offset)
        except (OSError, ValueError):
            return (self._segments[0] if self._segments else 1), 0

    def _drop_consumed_segments(self) -> None:
        """Delete segments wholly before the cursor, and the cursor's segment once fully read and not last."""
        segment, offset = self._cursor
        sizes = getattr(self, "_sizes", None)
        for candidate in list(self._segments):
            finished = candidate == segment and sizes is not None and offset >= sizes.get(candidate, 0)
            if candidate < segment or (finished and candidate != self._segments[-1]):
                self._path(candidate).unlink(missing_ok=True)
                self._segments.remove(candidate)
                if sizes is not None:
                    sizes.pop(candidate, None)

    def _repair(self, segment: int) -> None:
        """Cut a torn tail off the last segment (a crash during append)."""
        path = self._path(segment)
        data = path.read_bytes()
        good = 0
        while good + _HEADER.size <= len(data):
            length, checksum = _HEADER.unpack_from(data, good)
            end = good + _HEADER.size + length
            if end > len(data) or zlib.crc32(data[good + _HEADER.size : end]) != checksum:
                break
            good = end
        if good != len(data):
            log.warning("spool: cut a torn last write", segment=segment, kept_bytes=good, cut_bytes=len(data) - good)
            with open(path, "r+b") as file:
                file.truncate(good)
                file.flush()
                os.fsync(file.fileno())
