"""``python -m splitstream.archiver.builder_main <archiver pid> <answers fd>``: the archiver's builder process
(:mod:`splitstream.archiver.builder`), which must not outlive the archiver.

Before anything else (its imports take a second or more), the child asks the kernel for SIGKILL when its
parent dies (``PR_SET_PDEATHSIG``), then checks that the parent is still the archiver whose pid it was
given: an archiver SIGKILLed before the request took effect sends no signal, and its child would
otherwise wait for calls under pid 1 for ever. SIGKILL rather than SIGTERM: a write under way has its
entries unacknowledged, so they are written again (its temporary file is removed by the next
archiver). Only the standard library is imported before that check.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

#: prctl's option number (linux/prctl.h), as in :mod:`splitstream.common.runtime` (not imported: it loads grpc).
_PR_SET_PDEATHSIG = 1


def main() -> None:
    parent = int(sys.argv[1])
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)  # the archiver died before the request took effect
    # The loop decides when to stop (a drain lets the write in flight finish); a Ctrl-C reaches the whole group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The answers go on their own pipe (the archiver's stdout and stderr stay this process's, for log lines): a
    # line printed on stdout, even by a start-up hook before this ran, cannot be read as an answer.
    answers = os.fdopen(int(sys.argv[2]), "wb")
    from splitstream.archiver.builder import serve

    serve(os.fdopen(0, "rb"), answers)


if __name__ == "__main__":
    main()
