"""Spools as a shipper from before the write-ahead log left them, for the tests of reading them.

Nothing in splitstream writes a spool any more (:mod:`splitstream.shipper.spool` only reads what an older
shipper left); this writes the same layout: numbered ``*.seg`` files of framed entries.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

from splitstream.shipper.spool import MAGIC

#: What an entry's header checksum covers: magic, payload length, records, payload crc32.
_CHECKED = struct.Struct("<4sIII")


def frame(payload: bytes, records: int = 0) -> bytes:
    """One entry as an older shipper wrote it to a segment (the header :data:`~splitstream.shipper.spool.HEADER`
    reads)."""
    checked = _CHECKED.pack(MAGIC, len(payload), records, zlib.crc32(payload))
    return checked + struct.pack("<I", zlib.crc32(checked)) + payload


def append(directory: Path, payload: bytes, records: int = 0, *, segment_bytes: int = 8 << 20) -> None:
    """Append one entry as an older shipper did: to the last segment while it is under ``segment_bytes`` (never
    to one of the layout before, ``*.spool``), else to a new one. An entry that does not fit on the disk is cut
    back off and the error raised, as it did."""
    directory.mkdir(parents=True, exist_ok=True)
    numbers = sorted(int(path.stem) for path in [*directory.glob("*.seg"), *directory.glob("*.spool")])
    last = numbers[-1] if numbers else 0
    path = directory / f"{last:08d}.seg"
    if not path.exists() or path.stat().st_size >= segment_bytes:  # none yet, full, or of the older layout
        path = directory / f"{last + 1:08d}.seg"
    view = memoryview(frame(payload, records))
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        start = os.fstat(descriptor).st_size
        try:
            while view:
                view = view[os.write(descriptor, view) :]
        except OSError:
            os.ftruncate(descriptor, start)
            raise
    finally:
        os.close(descriptor)
