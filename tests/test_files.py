"""common.files: atomic_write, the one crash-safe file replacement, and read_if_changed, the one poll of a
watched file."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from splitstream.common.files import atomic_write, read_if_changed


def test_atomic_write_replaces_the_file_whole_keeps_the_mode_asked_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "nested" / "registry.yaml"
    atomic_write(target, "models: {}\n")
    assert target.read_text() == "models: {}\n"
    atomic_write(target, b"models:\n  m: {}\n", mode=0o644)
    assert target.read_bytes() == b"models:\n  m: {}\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["registry.yaml"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "cursor"
    atomic_write(target, "1 0\n")
    with pytest.raises(TypeError):
        atomic_write(target, 20, mode=0o600)  # type: ignore[arg-type]  # the write itself fails
    assert target.read_text() == "1 0\n"
    assert [p.name for p in tmp_path.iterdir()] == ["cursor"]


def test_read_if_changed_reads_a_file_once_per_version_and_refuses_a_fifo_without_waiting(tmp_path: Path) -> None:
    path = tmp_path / "principals.yaml"
    path.write_text("a: 1\n")
    signature, text = read_if_changed(path, None)
    assert text == "a: 1\n"
    assert read_if_changed(path, signature) == (signature, None)  # unchanged: not read again
    atomic_write(path, "a: 2\n")  # replaced by rename: another inode
    changed, text = read_if_changed(path, signature)
    assert (changed != signature, text) == (True, "a: 2\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file") as refused:  # opened without waiting for a writer
        read_if_changed(fifo, None)
    assert refused.value.errno == errno.EINVAL
