"""Ctrl-C while a server starts: a quiet exit 0, the code a SIGINT always gets, not a traceback.

A server's own handlers (:mod:`splitstream.common.runtime`, :mod:`splitstream.common.supervisor`) are in
place only once its event loop runs, after seconds of imports and configuration. Until then Python's
default handler raised KeyboardInterrupt wherever the import had got to: Ctrl-C on a ``--processes``
router printed a screenful of traceback per process still starting (each child is a fresh Python), and
the parent died of the signal. Each command's ``__main__`` (its console script's module too) installs
:func:`quiet_interrupts` before it imports anything else; the event loop's handler replaces it, and it is
put back once the loop is closed (asyncio restores the default one), for the last moments of the exit.
"""

from __future__ import annotations

import contextlib
import signal
from types import FrameType

#: The exit code of a process Ctrl-C ended before it served (runtime.EXIT_OK; this module imports nothing).
EXIT_INTERRUPTED = 0


def quiet_interrupts() -> None:
    """SIGINT ends this process with :data:`EXIT_INTERRUPTED`, without a traceback (from the main thread; a
    call from another thread, an in-process test's, changes nothing)."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, _interrupted)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_INTERRUPTED)
