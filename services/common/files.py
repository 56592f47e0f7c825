"""Crash-safe file replacement, one implementation for every service that rewrites a file in place."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` so that readers, and the file system after a crash, see either
    the old file or the new one, whole.

    A sibling temporary file is written and fsync'd, renamed over ``path``, then the directory is
    fsync'd: without the first fsync a crash can leave the new name pointing at an empty file (ext4,
    XFS delayed allocation); without the last, the rename itself may not survive a power cut.
    ``mode`` sets the new file's permission bits (default: what ``mkstemp`` gives, 0o600)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    descriptor, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(staging, mode)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename, creation or deletion in ``directory`` durable (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
