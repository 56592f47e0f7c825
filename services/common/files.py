"""Files every service handles alike: crash-safe replacement of a file rewritten in place, and reading a
watched file again only once it changed."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from stat import S_ISREG

#: What tells a watched file's versions apart without reading it: inode (a file replaced by rename), mtime, size.
FileSignature = tuple[int, int, int]


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


def read_if_changed(path: str | os.PathLike[str], last: FileSignature | None) -> tuple[FileSignature, str | None]:
    """``path``'s signature, and its text (UTF-8) unless the signature is ``last`` (then None). Blocks: call it
    in a thread. OSError when it cannot be read, or is not a regular file.

    Opened with O_NONBLOCK: a FIFO put in the file's place would otherwise wait for a writer for ever, in a
    thread that no later poll replaces and that keeps the process from exiting after SIGTERM. For a regular
    file the flag changes nothing."""
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
        stat = os.fstat(file.fileno())
        if not S_ISREG(stat.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if signature == last:
            return signature, None
        return signature, file.read().decode("utf-8")
