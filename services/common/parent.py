"""A child process that must not outlive the process that started it: one helper for every such child.

Two kinds of child use it: the servers a ``--processes`` parent (and the router's shipper) start, through
:func:`splitstream.common.runtime.die_with_parent`, and the archiver's builder (``builder_main``). Standard
library only: the builder calls it before its imports, which take a second or more and during which an
archiver killed meanwhile would otherwise leave it running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

#: prctl's option number (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def end_with_parent(parent: int, signum: signal.Signals) -> None:
    """Ask the kernel for ``signum`` when the parent dies, however it dies (``PR_SET_PDEATHSIG``, Linux only),
    then check that the parent is still ``parent`` (the pid the parent gave its child): one that died before
    the request took effect sends no signal, and the child would live on under pid 1. Then the child sends
    itself ``signum``, as the kernel would have.

    Asked by the child itself, not by a ``preexec_fn`` between fork and exec: that ran Python (a ``dlopen``)
    in a fork of a parent whose gRPC and executor threads held locks, and a child shipper restarted in a crash
    loop was seen to die there (SIGSEGV, or to hang) before it ever ran."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)
