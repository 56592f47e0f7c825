"""Ctrl-C while a server starts: a quiet exit 0, the code a SIGINT always gets, not a traceback.

A server's own handlers (:mod:`splitstream.common.runtime`, :mod:`splitstream.common.supervisor`) are in
place only once its event loop runs, after seconds of imports and configuration. Until then Python's
default handler raised KeyboardInterrupt wherever the import had got to: Ctrl-C on a ``--processes``
router printed a screenful of traceback per process still starting (each child is a fresh Python), and
the parent died of the signal. Each command's ``__main__`` (its console script's module too) installs
:func:`quiet_interrupts` before it imports anything else; the event loop's handler replaces it, and it is
put back once the loop is closed (asyncio restores the default one), for the last moments of the exit.

A child a server starts (a ``--processes`` child, the router's shipper) is started with SIGINT blocked
(:func:`interrupts_held`): a Ctrl-C that reached it while its interpreter was still starting, before any
code of ours ran, printed "Fatal Python error: init_import_site" and a traceback. It stays pending until
:func:`quiet_interrupts` unblocks it, and then ends the child quietly.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

#: The exit code of a process Ctrl-C ended before it served (runtime.EXIT_OK; this module imports nothing).
EXIT_INTERRUPTED = 0
#: How many :func:`interrupts_held` are open (in the event loop's thread, the only one that starts children).
_holds = 0


def quiet_interrupts() -> None:
    """SIGINT ends this process with :data:`EXIT_INTERRUPTED`, without a traceback (from the main thread; a
    call from another thread, an in-process test's, changes nothing)."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, _interrupted)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held by a parent: see interrupts_held


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT blocked in this thread meanwhile: a child forked here inherits the mask (not the parent's
    handler) and gets a Ctrl-C only once its :func:`quiet_interrupts` runs. The parent loses none: it is
    delivered when the block ends.

    Nested or overlapping holds (tasks of one event loop starting children at once) share one block, lifted
    when the last ends: each restoring the mask it found had the one that started second block SIGINT for
    good once the first had ended, and the parent never saw Ctrl-C again."""
    global _holds
    if _holds == 0:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    _holds += 1
    try:
        yield
    finally:
        _holds -= 1
        if _holds == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_INTERRUPTED)
