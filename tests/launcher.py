"""``subprocess``'s ``Popen`` and ``run`` for the commands tests start, forked from :mod:`tests.zygote`.

A command ``[sys.executable, "-m", "splitstream.<service>", ...]`` is forked from a process that has imported
splitstream already (the CPU the suite spent starting interpreters: see :mod:`tests.zygote`); anything else,
and any option the fork cannot honour, is exec'd by ``subprocess`` as before. The returned object is a real
``subprocess.Popen``: pipes, ``communicate``, text mode, timeouts and signals work as they do for an exec'd
child; only the child's creation, its wait status (reported by the zygote, which is its parent) and its
signals (through a pidfd) differ.

``SPLITSTREAM_TEST_EXEC=1`` in the test run's environment execs every command (a fresh interpreter each, as
before this module); a test that inspects the process itself (its ``/proc/PID/cmdline``, the libraries it
maps while starting) passes ``exec_=True``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Only our own services and CLIs (what the zygote has imported, and what tests start hundreds of times), and
#: the program that checks the fork ends as an exec does.
FORKED_MODULES = ("splitstream.", "tests.launched_program")

ALWAYS_EXEC = os.environ.get("SPLITSTREAM_TEST_EXEC", "") not in ("", "0")


class _Zygote:
    """This test process's zygote, started on first use and ended (with what it started) at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._path = ""
        atexit.register(self._stop)

    def path(self) -> str:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            return self._path

    def _start(self) -> None:
        if self._path:  # the zygote before this one ended (killed): its socket goes with it
            shutil.rmtree(os.path.dirname(self._path), ignore_errors=True)
        directory = tempfile.mkdtemp(prefix="splitstream-zygote-")
        self._path = os.path.join(directory, "socket")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # each child sets its own
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self._path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if line != b"ready\n":
            raise RuntimeError(f"the test zygote did not start (exit {self._process.wait()})")

    def _stop(self) -> None:
        if self._process is not None and self._process.stdin is not None:
            self._process.stdin.close()  # the zygote kills what it started and exits
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
        if self._path:
            shutil.rmtree(os.path.dirname(self._path), ignore_errors=True)


_ZYGOTE = _Zygote()


def _forkable(args: Any, kwargs: dict[str, Any], *, exec_: bool) -> bool:
    if ALWAYS_EXEC or exec_:
        return False
    if not isinstance(args, (list, tuple)) or len(args) < 3:
        return False
    if str(args[0]) != sys.executable or args[1] != "-m" or not str(args[2]).startswith(FORKED_MODULES):
        return False
    simple = {
        "shell": False,
        "executable": None,
        "preexec_fn": None,
        "pass_fds": (),
        "user": None,
        "group": None,
        "extra_groups": None,
        "umask": -1,
        "process_group": None,
    }
    if any(kwargs.get(name, default) != default for name, default in simple.items()):
        return False
    if not kwargs.get("restore_signals", True) or not kwargs.get("close_fds", True):
        return False
    # Settings the interpreter reads once at start (PYTHONHASHSEED, PYTHONPATH, the locale...) are the
    # zygote's, which are this process's (less PYTHONUNBUFFERED, which the child's streams follow).
    env = kwargs.get("env")
    asked = os.environ if env is None else env
    return all(
        asked.get(name) == os.environ.get(name)
        for name in {*asked, *os.environ}
        if name.startswith(("PYTHON", "LC_", "LANG")) and name != "PYTHONUNBUFFERED"
    )


class Popen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen``, forked from the zygote when the command is one of ours."""

    def __init__(self, args: Any, *positional: Any, exec_: bool = False, **kwargs: Any) -> None:
        if positional:
            raise TypeError("tests.launcher.Popen takes its options by keyword")
        self._forked = _forkable(args, kwargs, exec_=exec_)
        self._pidfd = -1
        self._zygote_connection: socket.socket | None = None
        self._status_buffer = b""
        super().__init__(args, **kwargs)

    def _execute_child(  # type: ignore[override]
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: Any,
        pass_fds: Any,
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: Any,
        shell: Any,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        restore_signals: Any,
        gid: Any,
        gids: Any,
        uid: Any,
        umask: Any,
        start_new_session: bool,
        process_group: Any,
    ) -> None:
        if not self._forked:
            return super()._execute_child(  # type: ignore[misc]
                args,
                executable,
                preexec_fn,
                close_fds,
                pass_fds,
                cwd,
                env,
                startupinfo,
                creationflags,
                shell,
                p2cread,
                p2cwrite,
                c2pread,
                c2pwrite,
                errread,
                errwrite,
                restore_signals,
                gid,
                gids,
                uid,
                umask,
                start_new_session,
                process_group,
            )
        request = {
            "module": str(args[2]),
            "args": [os.fsdecode(arg) for arg in args[3:]],
            "env": {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()},
            "cwd": os.fsdecode(os.path.abspath(cwd if cwd is not None else os.getcwd())),
            "new_session": bool(start_new_session),
        }
        # -1: the child inherits this process's stream, as an exec'd child would.
        streams = [
            p2cread if p2cread != -1 else 0,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
        ]
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(_ZYGOTE.path())
            socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], streams)
            answer, self._pidfd = self._read_start(connection)
        except BaseException:
            connection.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]
        self.pid = answer["pid"]
        self._zygote_connection = connection
        self._child_created = True

    def _read_start(self, connection: socket.socket) -> tuple[dict[str, Any], int]:
        """The zygote's answer (the pid, with a pidfd); a child that ended at once may have its status
        behind it in the same read, kept for :meth:`_try_wait`."""
        message, fds, _, _ = socket.recv_fds(connection, 4096, 1)
        while message and b"\n" not in message:
            more = connection.recv(4096)
            if not more:
                break
            message += more
        answer, newline, self._status_buffer = message.partition(b"\n")
        if not newline or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"the test zygote did not start the command: {message!r}")
        return json.loads(answer), fds[0]

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if not self._forked:
            return super()._try_wait(wait_flags)  # type: ignore[misc]
        assert self._zygote_connection is not None
        self._zygote_connection.setblocking(not wait_flags & os.WNOHANG)
        while not self._status_buffer.endswith(b"\n"):
            try:
                chunk = self._zygote_connection.recv(4096)
            except BlockingIOError:
                return (0, 0)
            if not chunk:  # the zygote is gone: so is the child (it kills its children when it ends)
                return (self.pid, signal.SIGKILL)
            self._status_buffer += chunk
        return (self.pid, json.loads(self._status_buffer)["status"])

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if not self._forked:
            return super()._internal_poll(_deadstate=_deadstate)  # type: ignore[misc]
        if self.returncode is None and self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)  # type: ignore[attr-defined]
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode

    def _handle_exitstatus(self, sts: int, *args: Any, **kwargs: Any) -> None:
        super()._handle_exitstatus(sts, *args, **kwargs)  # type: ignore[misc]
        self._release()

    def send_signal(self, sig: int) -> None:
        if not self._forked:
            return super().send_signal(sig)
        self.poll()
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def _release(self) -> None:
        if self._pidfd != -1:
            os.close(self._pidfd)
            self._pidfd = -1
        if self._zygote_connection is not None:
            self._zygote_connection.close()
            self._zygote_connection = None


def run(
    args: Sequence[Any],
    *,
    input: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` with :class:`Popen` (the same options, outcome and exceptions)."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        if kwargs.get("stdout") is not None or kwargs.get("stderr") is not None:
            raise ValueError("stdout and stderr arguments may not be used with capture_output.")
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            process.kill()
            expired.stdout, expired.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        returncode = process.poll()
        assert returncode is not None
    if check and returncode:
        raise subprocess.CalledProcessError(returncode, args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(args, returncode, stdout, stderr)
