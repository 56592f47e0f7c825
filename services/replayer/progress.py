"""The terminal progress bar (tqdm): how far through the window, calls/s, mismatches, and an ETA.

The number of calls in a window is not known until it has been read (counting first would
read the window twice), so the bar measures recorded time: ``n`` is how far into the window
the last finished call was received, and tqdm's rate and ETA follow from that. With
``--limit`` the bar counts calls instead. Off when stderr is not a terminal (CI logs).
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from splitstream.replayer.compare import CallDiff
from splitstream.replayer.selection import Selection


class Progress:
    def __init__(self, selection: Selection, *, enabled: bool) -> None:
        self._selection = selection
        self._by_calls = selection.limit is not None
        self._since_s = selection.since_ns / 1e9
        now_s = time.time()
        total = selection.limit if self._by_calls else max(min(selection.until_ns / 1e9, now_s) - self._since_s, 1e-3)
        self._bar = tqdm(
            total=total,
            unit="calls" if self._by_calls else "s of the window",
            unit_scale=False,
            dynamic_ncols=True,
            file=sys.stderr,
            disable=None if enabled else True,  # None: only on a terminal
            bar_format=(
                "{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]"
                if self._by_calls
                else "{l_bar}{bar}| {n:.1f}/{total:.1f} {unit} [{elapsed}<{remaining}{postfix}]"
            ),
        )
        self._started = time.perf_counter()
        self._calls = 0
        self._mismatches = 0
        self._status_changes = 0
        self._send_errors = 0
        self._last_postfix = 0.0

    def advance(self, receive_ns: int, diff: CallDiff | None) -> None:
        """One call done; ``diff`` None: the replayer could not send it."""
        self._calls += 1
        self._send_errors += diff is None
        self._mismatches += diff is not None and diff.outcome == "mismatch"
        self._status_changes += diff is not None and diff.outcome == "status_change"
        if self._bar.disable:
            return
        if self._by_calls:
            self._bar.update(1)
        else:
            position = min(max(receive_ns / 1e9 - self._since_s, 0.0), float(self._bar.total))
            if position > self._bar.n:
                self._bar.update(position - self._bar.n)
        now = time.perf_counter()
        if now - self._last_postfix > 0.25:
            self._last_postfix = now
            self._show_counts(now, refresh=False)

    def _show_counts(self, now: float, *, refresh: bool) -> None:
        rate = self._calls / max(now - self._started, 1e-9)
        self._bar.set_postfix_str(
            f"{self._calls} calls, {rate:.0f} calls/s, {self._mismatches} mismatched, "
            f"{self._status_changes} status changes"
            + (f", {self._send_errors} not sent (send errors)" if self._send_errors else ""),
            refresh=refresh,
        )

    def close(self) -> None:
        if not self._bar.disable:
            self._show_counts(time.perf_counter(), refresh=True)
        self._bar.close()
