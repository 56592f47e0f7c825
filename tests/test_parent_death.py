"""A child that must not outlive its parent (a ``--processes`` server child, the router's shipper, the archiver's
builder) asks for it with one helper, :func:`splitstream.common.parent.end_with_parent`. Real processes: a parent
that starts a child using it, killed with SIGKILL, and a child whose parent was gone before it asked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness import ROOT, wait_for
from tests.test_processes import alive

#: The child: asks for ``signal`` when its parent (whose pid is argv[1]) dies, says so, then waits for ever.
CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from splitstream.common.parent import end_with_parent
    end_with_parent(int(sys.argv[1]), signal.Signals[sys.argv[2]])
    print("watching", flush=True)
    while True:
        time.sleep(60)
    """
)

#: The parent: starts the child, writes its pid to argv[2], then waits for ever (until the test kills it).
PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[3]], stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"watching\\n"
    with open(sys.argv[2], "w") as out:
        out.write(str(child.pid))
    while True:
        time.sleep(60)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_child_ends_when_its_parent_is_killed(tmp_path: Path, signum: signal.Signals) -> None:
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(pid_file), signum.name], cwd=ROOT)
    try:
        child = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), timeout_s=30, what="the child"))
        assert alive(child)
    finally:
        parent.kill()
        parent.wait()
    try:
        wait_for(lambda: not alive(child), timeout_s=10, what="the child to end with its parent")
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_child_whose_parent_is_already_gone_ends_at_once_by_the_same_signal(signum: signal.Signals) -> None:
    """The pid it was given is not its parent's (the parent died before the child asked, and the child was
    re-parented): it ends as the kernel's signal would have ended it."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    child = subprocess.run(
        [sys.executable, "-c", CHILD, gone.stdout.strip(), signum.name], cwd=ROOT, capture_output=True, timeout=30
    )
    assert child.returncode == -signum
    assert child.stdout == b""
