"""Open-loop send times, and waiting for them precisely.

Call ``i`` leaves at ``start + (t_i - t_0) / speed`` whatever earlier calls are doing, so a
slow target shows up as latency, not as a slower replay. Waiting is done by the sender
thread, not the event loop: asyncio's ``loop.call_at`` fires up to ~1.1 ms late at p99 here
(epoll waits in whole milliseconds), while ``time.sleep`` wakes within ~0.1-0.2 ms. So
:func:`sleep_until` sleeps until ``spin_s`` before the deadline and spins the rest on
``time.perf_counter``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: Spin this long before a deadline instead of sleeping (time.sleep overshoots by ~0.1-0.2 ms).
SPIN_S = 0.0003
#: Longest single sleep, so a stop request is noticed quickly during long gaps.
_MAX_NAP_S = 0.05


class OpenLoopClock:
    """Planned send times (``time.perf_counter`` seconds) from receive times in unix ns.

    ``speed=None`` means "as fast as possible": no planned time. The first call fixes the
    origin: it is planned ``lead_s`` after it reaches the clock."""

    def __init__(
        self, speed: float | None, *, lead_s: float = 0.02, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if speed is not None and speed <= 0:
            raise ValueError("speed must be positive")
        self.speed = speed
        self.lead_s = lead_s
        self._clock = clock
        self.start: float | None = None
        self._t0_ns = 0

    def planned(self, receive_ns: int) -> float | None:
        if self.speed is None:
            return None
        if self.start is None:
            self.start = self._clock() + self.lead_s
            self._t0_ns = receive_ns
        return self.start + (receive_ns - self._t0_ns) / 1e9 / self.speed


def sleep_until(deadline: float, *, stop: threading.Event | None = None, spin_s: float = SPIN_S) -> bool:
    """Return at ``deadline`` (perf_counter seconds), never before; False if ``stop`` was set first."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return True
        if stop is not None and stop.is_set():
            return False
        if remaining > spin_s:
            time.sleep(min(remaining - spin_s, _MAX_NAP_S))
        # else: spin; the loop re-reads the clock
