"""common.files.atomic_write: the one crash-safe file replacement."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from splitstream.common.files import atomic_write


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
