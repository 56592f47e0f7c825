"""A small tmpfs mounted for a test, so that a disk really fills (mounting needs root)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import launcher


@contextmanager
def small_tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """``directory`` as a tmpfs of ``size`` (``mount -o size=``); the test is skipped where it cannot mount."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = launcher.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()[:200]}")
    try:
        yield directory
    finally:
        launcher.run(["umount", "-l", str(directory)], check=False)
