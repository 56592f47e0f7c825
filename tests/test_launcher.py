"""A command forked from the test zygote ends as the same command exec'd does: the tests that start our
services through :mod:`tests.launcher` assert on exit statuses, output and signals, so the fork must not
change any of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launcher
from tests.harness import ROOT, wait_for

PROGRAM = [sys.executable, "-m", "tests.launched_program"]


def both(*args: str, **options: object) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The program run exec'd and forked, each to its end, output captured as text."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **options}
    runs = [
        launcher.run([*PROGRAM, *args], exec_=exec_, text=True, timeout=60, cwd=ROOT, **streams)  # type: ignore[arg-type]
        for exec_ in (True, False)
    ]
    return runs[0], runs[1]


@pytest.mark.parametrize(
    ("args", "returncode"),
    [
        (("exit", "0"), 0),
        (("exit", "3"), 3),
        (("exit", "258"), 2),  # the status is the code's low byte
        (("exit-text",), 1),
        (("raise",), 1),
        (("interrupt",), -signal.SIGINT),
        (("thread",), 0),
        (("atexit",), 0),
    ],
)
def test_a_forked_command_ends_with_the_status_and_output_of_an_exec(args: tuple[str, ...], returncode: int) -> None:
    executed, forked = both(*args)
    assert executed.returncode == forked.returncode == returncode
    assert forked.stdout == executed.stdout
    # A traceback names the files it passed through: the forked one starts in the zygote.
    assert _last_line(forked.stderr) == _last_line(executed.stderr)
    assert forked.stderr.startswith("err 1\n")
    if args == ("thread",):
        assert forked.stdout.endswith("thread done\n")
    if args == ("atexit",):
        assert forked.stdout.endswith("atexit ran\n")


def _last_line(text: str) -> str:
    return text.rstrip("\n").rsplit("\n", 1)[-1]


@pytest.mark.parametrize(("unbuffered", "output"), [(False, "err 1\nout 1\nout 2\n"), (True, "out 1\nerr 1\nout 2\n")])
def test_output_to_one_pipe_interleaves_as_an_execs_does(unbuffered: bool, output: str) -> None:
    """stdout block-buffered to a pipe and stderr line-buffered, as a fresh interpreter makes them (the error
    line comes first), or both written at once under ``PYTHONUNBUFFERED``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | (
        {"PYTHONUNBUFFERED": "1"} if unbuffered else {}
    )
    executed, forked = both("exit", "0", stderr=subprocess.STDOUT, env=env)
    assert forked.stdout == executed.stdout == output


def test_the_environment_working_directory_session_and_stdin_are_the_ones_asked_for(tmp_path: Path) -> None:
    env = {**os.environ, "LAUNCHED_SETTING": "on"}
    executed, forked = both("environment", env=env, start_new_session=True)
    assert forked.stdout == executed.stdout == f"out 1\nout 2\non {ROOT} True\n"
    executed, forked = both("stdin", input="typed")
    assert forked.stdout == executed.stdout == "out 1\nout 2\nTYPED\n"


def test_odd_bytes_in_arguments_and_environment_reach_the_forked_command_as_they_reach_an_execd_one() -> None:
    """Non-ASCII, control characters and bytes that are not UTF-8 cross the zygote's JSON request as
    Python's own argv decoding gives them (surrogate escapes)."""
    args = ("arguments", "caf\u00e9", "tab\there", "line\nbreak", "\x7f\x01", b"\xff\xfe")
    env = {**os.environ, "LAUNCHED_SETTING": "\u00fc\x01"}
    executed, forked = both(*args, env=env)  # type: ignore[arg-type]
    assert executed.returncode == forked.returncode == 0, forked.stderr
    assert forked.stdout == executed.stdout
    assert forked.stdout.endswith("'\\udcff\\udcfe'] '\\xfc\\x01'\n")


def test_a_forked_command_is_signalled_and_reaped_as_a_child_is() -> None:
    process = launcher.Popen([*PROGRAM, "wait-for-signal"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == b"out 1\n"  # block-buffered, flushed with "waiting"
        assert process.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
        process.send_signal(signal.SIGTERM)  # to a process that has ended: nothing, as for an exec'd child
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_a_command_that_runs_past_its_timeout_is_killed() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.run([*PROGRAM, "wait-for-signal"], capture_output=True, timeout=0.5)


@pytest.mark.skipif(launcher.ALWAYS_EXEC, reason="SPLITSTREAM_TEST_EXEC=1 execs every command")
def test_only_our_own_commands_are_forked() -> None:
    """The zygote is this process's child, and what it forks is the zygote's: a forked command's parent is not
    this process, an exec'd one's is."""
    probe = "import os; print(os.getppid())"
    exec_parent = launcher.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert int(exec_parent.stdout) == os.getpid()
    forked = launcher.Popen([*PROGRAM, "wait-for-signal"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        parent = int(Path(f"/proc/{forked.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent != os.getpid()
    finally:
        forked.kill()
        assert forked.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.skipif(launcher.ALWAYS_EXEC, reason="SPLITSTREAM_TEST_EXEC=1 execs every command")
def test_a_zygote_killed_takes_what_it_started_along_and_the_next_start_makes_a_new_one() -> None:
    """A test process that crashes leaves no service running: its zygote ends with it, and a zygote's
    children end with the zygote."""
    process = launcher.Popen([*PROGRAM, "wait-for-signal"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert process.stdout is not None
    assert process.stdout.readline() == b"out 1\n"
    zygote = int(Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(zygote, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    wait_for(lambda: not Path(f"/proc/{process.pid}").exists(), timeout_s=30, what="the child to be gone")
    process.stdout.close()
    again = launcher.run([*PROGRAM, "exit", "3"], capture_output=True, timeout=60)
    assert again.returncode == 3
