"""Writing a replay's files: ``results.jsonl`` (one line per call, as calls finish) and ``summary.json``.

Lines are written as calls complete, so an interrupted or crashed run keeps every call it
finished. JSON has no NaN or Infinity, so non-finite numbers are written as null.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from splitstream.common.files import atomic_write
from splitstream.replayer.summary import Summary


def clean(value: Any) -> Any:
    """``value`` with NaN/Inf floats replaced by None, recursively (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


class ResultsWriter:
    """Appends one JSON object per line; flushed every ``flush_every`` lines or ``flush_interval_s``
    (so ``tail -f`` follows a slow replay), and on close."""

    def __init__(self, path: Path, *, flush_every: int = 256, flush_interval_s: float = 0.5) -> None:
        self.path = path
        self._file = path.open("w", encoding="utf-8")
        self._flush_every = flush_every
        self._flush_interval_s = flush_interval_s
        self._flushed_at = time.monotonic()
        self._pending = 0
        self.lines = 0

    def write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(clean(line), separators=(",", ":"), allow_nan=False))
        self._file.write("\n")
        self.lines += 1
        self._pending += 1
        now = time.monotonic()
        if self._pending >= self._flush_every or now - self._flushed_at >= self._flush_interval_s:
            self._file.flush()
            self._pending = 0
            self._flushed_at = now

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def write_summary(path: Path, summary: Summary) -> None:
    """Write atomically, so a reader (or a CI step after a crash) never sees half a summary."""
    atomic_write(path, summary.to_json())
