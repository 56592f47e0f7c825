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

import os
import signal
import sys

from splitstream.common.parent import end_with_parent  # the standard library only


def main() -> None:
    end_with_parent(int(sys.argv[1]), signal.SIGKILL)
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
