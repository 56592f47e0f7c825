"""A process that has imported splitstream once and forks each service a test starts from that state.

Most of the test suite's CPU went to starting services: about 1,500 starts in a run, each a fresh
interpreter importing gRPC, protobuf, NumPy, Redis and our own modules again (0.3-0.8 s of CPU each, on 2
cores shared by two or four test processes). A process forked from here has all of that imported already;
it then runs the service's ``__main__`` exactly as ``python -m`` does, with the test's arguments, environment,
working directory and standard streams. It is still a process of its own, serving real sockets, stopped by
real signals, with its own exit status: what the tests assert on is unchanged. What differs from an exec
(and why a test that depends on it asks :mod:`tests.launcher` for an exec): ``/proc/PID/cmdline`` shows this
module's command line, every library below is mapped from the start, and the forked processes share the
interpreter's hash seed.

Protocol, one Unix-socket connection per process started: the client sends a JSON request (module, argv,
environment, working directory, new session or not) with the child's stdin, stdout and stderr as
``SCM_RIGHTS``; this process forks, answers ``{"pid": N}`` with a pidfd of the child (so the client signals
exactly that process, never a reused pid), and later sends the raw wait status when it reaps the child.
The process exits, killing what it started, when its stdin closes (the test process that started it ended).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
from typing import Any, NoReturn

from splitstream.common.parent import end_with_parent

#: What the services import at start with the flags tests give them (and the admin CLI's commands): the
#: import is the cost a fork saves. A module imported here but not by a service changes nothing it does.
PRELOAD = (
    "grpc",
    "grpc.aio",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "google.protobuf",
    "numpy",
    "yaml",
    "structlog",
    "prometheus_client",
    "redis",
    "redis.asyncio",
    "aiohttp",
    "aiohttp.web",
    "pydantic",
    "onnxruntime",
    "pyarrow",
    "pyarrow.parquet",
    "pyarrow.dataset",
    "scipy.stats",
    "cryptography.x509",
    "jwt",
    "consul",
    "splitstream.router.main",
    "splitstream.worker.main",
    "splitstream.recorder.main",
    "splitstream.shipper.main",
    "splitstream.replayer.main",
    "splitstream.archiver.main",
    "splitstream.admin.main",
)

#: Exit status of a child that could not be set up (its working directory is missing, say), as a
#: shell reports a command it could not run.
SETUP_FAILED = 127


def preload() -> None:
    for module in PRELOAD:
        with contextlib.suppress(ImportError):  # an extra not installed: the service that needs it fails itself
            __import__(module)
    gc.collect()
    gc.freeze()  # what every child shares is never walked by a child's collector, so never copied


class Zygote:
    """Accepts start requests, forks, and reports each child's exit to the connection that started it."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.wakeup_read, self.wakeup_write = os.pipe()
        os.set_blocking(self.wakeup_write, False)
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}
        self.pid = os.getpid()

    def serve(self) -> dict[str, Any] | None:
        """Serve until stdin closes (returns None) or, in a forked child, return what the child runs."""
        signal.set_wakeup_fd(self.wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, "reap")
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
        print("ready", flush=True)
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    connection, _ = self.listener.accept()
                    request = self._start(connection)
                    if request is not None:
                        return request
                elif key.data == "reap":
                    os.read(self.wakeup_read, 4096)
                    self._reap()
                elif not os.read(sys.stdin.fileno(), 4096):
                    self._kill_all()
                    return None

    def _start(self, connection: socket.socket) -> dict[str, Any] | None:
        fds: list[int] = []
        try:
            message, fds = _receive(connection)
            request = json.loads(message)
        except (OSError, ValueError):
            for fd in fds:
                os.close(fd)
            connection.close()
            return None
        pid = os.fork()
        if pid == 0:
            self._become_child(connection, fds, request)
            return request
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        try:
            socket.send_fds(connection, [json.dumps({"pid": pid}).encode() + b"\n"], [pidfd])
        except OSError:
            pass  # the client went away; the child runs on and is reaped like any other
        finally:
            os.close(pidfd)
        self.children[pid] = connection
        return None

    def _become_child(self, connection: socket.socket, fds: list[int], request: dict[str, Any]) -> None:
        # A zygote that dies (its test process crashed, say) takes what it started along: nothing is left
        # running, and a client that sees the zygote gone may report its child killed.
        end_with_parent(self.pid, signal.SIGKILL)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        self.listener.close()
        connection.close()
        for other in self.children.values():
            other.close()
        os.close(self.wakeup_read)
        os.close(self.wakeup_write)
        stdin, stdout, stderr = fds
        for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        gc.unfreeze()
        try:
            if request["new_session"]:
                os.setsid()
            os.chdir(request["cwd"])
            sys.path[0] = request["cwd"]  # as ``python -m`` puts its working directory first
        except OSError as error:
            print(f"cannot start {request['module']}: {error}", file=sys.stderr, flush=True)
            os._exit(SETUP_FAILED)
        os.environ.clear()
        os.environ.update(request["env"])
        _open_standard_streams(unbuffered=bool(request["env"].get("PYTHONUNBUFFERED")))

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.sendall(json.dumps({"status": status}).encode() + b"\n")
                connection.close()

    def _kill_all(self) -> None:
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


#: The zygote's own stdout and stderr objects, kept so that their collection never closes fds 1 and 2.
_REPLACED_STREAMS: list[Any] = []


def _open_standard_streams(*, unbuffered: bool) -> None:
    """stdout and stderr as a fresh interpreter makes them for this child's fds and ``PYTHONUNBUFFERED``
    (CPython's ``create_stdio``): block-buffered to a file or pipe, line-buffered to a terminal and on
    stderr, written through unbuffered; a test reading a command's output sees it when that command would
    show it."""
    _REPLACED_STREAMS.extend((sys.stdout, sys.stderr))
    for fd, name, errors in ((1, "stdout", sys.stdout.errors), (2, "stderr", "backslashreplace")):
        binary = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        stream = io.TextIOWrapper(
            binary,
            encoding=sys.stdout.encoding,
            errors=errors,
            newline="\n",
            line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _receive(connection: socket.socket) -> tuple[bytes, list[int]]:
    """One request: a JSON line, and three file descriptors sent with its first bytes."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while data and not data.endswith(b"\n"):
        chunk = connection.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    if not data.endswith(b"\n") or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise OSError(f"expected a request line and 3 file descriptors, got {len(fds)}")
    return data, fds


def run_as_main(module: str) -> NoReturn:
    """Run ``module`` as ``python -m`` does and end this process as such a process ends: same exit status,
    same output, the same non-daemon threads waited for and ``atexit`` functions run; only the teardown of
    every module this process imported is left out (``os._exit``). That teardown, of everything
    :data:`PRELOAD` imported, was nearly all of a forked child's CPU (0.5 s of a 0.51 s ``--help``)."""
    code = 0
    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:
        interrupted = True
        sys.excepthook(*sys.exc_info())
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if interrupted:  # an uncaught KeyboardInterrupt ends the interpreter by SIGINT (exit status -2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status for ``SystemExit(code)``, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    preload()
    request = Zygote(sys.argv[1]).serve()
    if request is None:
        return
    # The forked child: from here on it is ``python -m MODULE ARGS`` (runpy sets argv[0] to the module's
    # file as -m does).
    sys.argv = [request["module"], *request["args"]]
    run_as_main(request["module"])


if __name__ == "__main__":
    main()
