"""``--processes N``: one port served by N copies of a service, supervised by a parent that serves nothing.

A Python gRPC server uses one core. Past it, the router and the recorder scale by running more
processes on the same port: the kernel spreads new connections over them (``SO_REUSEPORT``, Linux).
The parent (:func:`supervise`) binds no gRPC port and creates no gRPC object, so grpc's rules about
fork never apply: each child is a fresh ``python -m <service>`` of the same command line with
``--processes 1``, the port to serve (picked by the parent when ``--port`` is 0), ``--metrics-port 0``
and :data:`~splitstream.common.runtime.PROCESS_INDEX_ENV` naming its index (the router keeps one
write-ahead log directory per index, so a restarted child resumes its own).

What the parent does:

- reserves the port: a ``SO_REUSEPORT`` socket bound and never listening keeps it from anyone else
  (a port already taken is exit 2 and one line, as with one process); likewise each of the service's
  other shared ports (:class:`SharedPort`: the router's HTTP port), given to every child by its flag;
- serves ``--metrics-port`` for all children at once: prometheus-client's multiprocess mode, children
  writing to a fresh ``PROMETHEUS_MULTIPROC_DIR`` that the parent reads at each scrape, so one scrape
  shows the totals and histograms merge bucket by bucket;
- restarts a child that dies, with backoff (counted in ``<service>_process_restarts``); a child that
  exits 2 (a configuration error) is not restarted: the others are drained and the parent exits 2;
- on SIGTERM or SIGINT sends every child SIGTERM (each runs its usual ordered drain), waits for all
  of them, then stops its companion (the router's one shipper) and exits 0, or the worst child's code;
- with ``forward_sighup`` (a router that authenticates callers: its children re-read their credentials on
  SIGHUP), sends SIGHUP on to every child and keeps running, so one ``kill -HUP`` of the parent reloads
  them all. The children hold the credentials; the parent has none to read. A child still starting, whose
  handler is not in place yet, dies of it and is started again, reading everything afresh. Without it, the
  parent leaves SIGHUP as it was (it ends the parent): a child without a handler would die of it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from splitstream.common.argv_secrets import give_warnings
from splitstream.common.errors import ConfigError
from splitstream.common.interrupts import interrupts_held, quiet_interrupts
from splitstream.common.runtime import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    PROCESS_INDEX_ENV,
    PROCESSES_ENV,
    ServerSettings,
    bind_metrics,
    bind_problem,
    own_metrics,
    parent_env,
)

#: prometheus-client reads it when it is first imported: set for the children only, never in the parent.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: The children's metrics directory, ``<prefix><parent pid>-<random>`` in the temporary directory: the pid
#: lets a later start remove one whose parent died without removing it (SIGKILL).
METRICS_DIR_PREFIX = "splitstream-metrics-"
_METRICS_DIR_NAME = re.compile(re.escape(METRICS_DIR_PREFIX) + r"([1-9][0-9]{0,9})-[A-Za-z0-9_]+")
_RESTART_FIRST_S = 0.2
_RESTART_MAX_S = 5.0
#: A child that served this long before dying is restarted after the first backoff again, not the last.
_STABLE_S = 30.0
#: On top of the children's own --drain-delay-s and --shutdown-grace-s, before a child that hangs is killed.
_STOP_SLACK_S = 20.0


@dataclass(frozen=True, slots=True)
class SharedPort:
    """A port beside ``--port`` that every child serves too (SO_REUSEPORT), reserved by the parent: the
    children get ``flag PORT`` (the port the parent bound, when ``port`` is 0)."""

    flag: str
    #: What is served there, for the error of a port that cannot be had ("HTTP").
    what: str
    port: int


class Companion(Protocol):
    """Something the parent runs beside the children and stops after them (the router's shipper)."""

    def start(self) -> None: ...

    async def started(self) -> None:
        """Return once it runs; ConfigError if it refused its configuration (the parent then exits 2)."""

    async def stop(self) -> None: ...


def supervise(
    settings: ServerSettings,
    *,
    module: str,
    argv: Sequence[str],
    prog: str,
    service: str,
    companion: Callable[[CollectorRegistry], Companion] | None = None,
    shared_ports: Sequence[SharedPort] = (),
    forward_sighup: bool = False,
) -> int:
    """Run ``settings.processes`` children of ``python -m module argv`` until a signal; the exit code.

    ``service`` names the parent's own metrics (``splitstream_<service>_process_restarts``);
    ``companion`` is built with the parent's metrics registry and started once the children are;
    ``shared_ports`` are served by every child beside ``--port``; ``forward_sighup``: SIGHUP is sent on
    to every child (which must handle it) rather than ending the parent."""
    own_metrics()
    parent = _Parent(
        settings, module=module, argv=argv, service=service, companion=companion, shared_ports=shared_ports
    )
    parent.forward_sighup = forward_sighup
    try:
        code = asyncio.run(parent.run())
        if parent.config_error is not None:
            # Last, as one process's would be: the child's own line saying what to fix is above.
            print(f"{prog}: error: {parent.config_error}", file=sys.stderr)
        return code
    except ConfigError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    finally:
        quiet_interrupts()  # the closed loop put Python's KeyboardInterrupt back
        parent.close()


class _Parent:
    def __init__(
        self,
        settings: ServerSettings,
        *,
        module: str,
        argv: Sequence[str],
        service: str,
        companion: Callable[[CollectorRegistry], Companion] | None,
        shared_ports: Sequence[SharedPort] = (),
    ) -> None:
        self.settings = settings
        self.shared_ports = tuple(shared_ports)
        #: The shared ports' reservations, and the flags that give each child their ports.
        self.shared_reservations: list[socket.socket] = []
        self.shared_args: list[str] = []
        #: The shared ports bound, for the "listening" line (``http_port=8000``).
        self.shared_bound: dict[str, int] = {}
        self.module = module
        self.argv = list(argv)
        self.log = structlog.get_logger().bind(supervisor=True)
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            f"splitstream_{service}_process_restarts",
            "Times a child process exited on its own and was started again (--processes)",
            registry=self.registry,
        )
        self.make_companion = companion
        self.companion: Companion | None = None
        self.reservation: socket.socket | None = None
        self.metrics_dir = ""
        self.metrics_server: Any = None
        self.children: dict[int, asyncio.subprocess.Process] = {}
        self.codes: dict[int, int] = {}
        self.stop = asyncio.Event()
        #: Why the parent stops with exit 2 because of a child, or None.
        self.config_error: str | None = None
        #: SIGHUP is sent on to the children (see :func:`supervise`).
        self.forward_sighup = False

    async def run(self) -> int:
        settings = self.settings
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        if self.forward_sighup:
            loop.add_signal_handler(signal.SIGHUP, self._forward_sighup)
        port = self._reserve_port()
        for shared in self.shared_ports:
            self.shared_args += [shared.flag, str(self._reserve_shared(shared))]
        env = {**os.environ}
        self._remove_stale_metrics_dirs()
        if settings.metrics_port:
            self.metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
            env[MULTIPROC_ENV] = self.metrics_dir
            MultiProcessCollector(self.registry, path=self.metrics_dir)
            self.metrics_server = bind_metrics(settings, self.registry)
        else:
            env.pop(MULTIPROC_ENV, None)  # children serve no metrics port: nothing would read the files
        self.log.info(
            "listening",
            host=settings.host,
            port=port,
            metrics_host=settings.metrics_host,
            metrics_port=settings.metrics_port or None,
            processes=settings.processes,
            **self.shared_bound,
        )
        # Held until now: a start that fails on its configuration stays one line on stderr.
        give_warnings(lambda line: self.log.warning("secret on the command line (deprecated)", detail=line))
        keepers = [
            asyncio.create_task(self._keep(index, port, env), name=f"child-{index}")
            for index in range(settings.processes)
        ]
        if self.make_companion is not None:
            self.companion = self.make_companion(self.registry)
            self.companion.start()
            try:
                await self.companion.started()
            except ConfigError as error:
                self.config_error = str(error)
                self.stop.set()
        await self.stop.wait()
        self.log.info("draining every child", children=sorted(p.pid for p in self.children.values()))
        for process in self.children.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        timeout_s = settings.drain_delay_s + settings.shutdown_grace_s + _STOP_SLACK_S
        _, pending = await asyncio.wait(keepers, timeout=timeout_s)
        for process in self.children.values():
            if process.returncode is None:
                self.log.error("child did not stop in time; killed", pid=process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        await asyncio.gather(*pending, return_exceptions=True)
        code = EXIT_OK
        for returncode in self.codes.values():
            if returncode in (-signal.SIGTERM, -signal.SIGINT):
                # Our SIGTERM, or a Ctrl-C sent to the whole group, reached a child still starting, before
                # even Python's handlers were in place: it served nothing.
                continue
            code = max(code, returncode if returncode >= 0 else EXIT_FAILED)
        if self.companion is not None:
            await self.companion.stop()
        if self.config_error is not None:
            code = EXIT_CONFIG
        self.log.info("stopped", exit_code=code)
        return code

    def _remove_stale_metrics_dirs(self) -> None:
        """Remove what parents that died without their cleanup (SIGKILL, the OOM killer, a power cut) left in
        the temporary directory: a metrics directory per start, files of every child, never removed.

        Only what a parent made: ``splitstream-metrics-<pid>-<random>``, a directory (not a link) of this
        user holding nothing but prometheus-client's ``*.db`` files, named with a pid that is not alive.
        A pid alive again (reused) keeps its directory: a later start gets it."""
        parent = Path(tempfile.gettempdir())
        try:
            candidates = list(parent.glob(f"{METRICS_DIR_PREFIX}*-*"))
        except OSError:
            return
        for path in candidates:
            match = _METRICS_DIR_NAME.fullmatch(path.name)
            if match is None:
                continue
            pid = int(match[1])
            try:
                info = path.lstat()
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _pid_alive(pid):
                    continue
                if not all(
                    entry.is_file(follow_symlinks=False) and entry.name.endswith(".db") for entry in os.scandir(path)
                ):
                    continue
            except OSError:
                continue
            shutil.rmtree(path, ignore_errors=True)
            self.log.info("removed the metrics directory of a parent that died", path=str(path), pid=pid)

    def _on_signal(self, signum: signal.Signals) -> None:
        if self.stop.is_set():
            self.log.warning("signal ignored, already shutting down", signal=signum.name)
            return
        self.stop.set()  # first: nothing a log line does may cost the stop
        self.log.info("signal received, shutting down", signal=signum.name)

    def _forward_sighup(self) -> None:
        if self.stop.is_set():
            return  # draining: the children are stopping, nothing to reload
        pids = []
        for process in self.children.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGHUP)
                    pids.append(process.pid)
        self.log.info("SIGHUP sent on to every child", children=sorted(pids))

    def _reserve_port(self) -> int:
        """Reserve ``--port``: the port is ours for as long as the parent lives."""
        self.reservation = _reserve(self.settings.host, self.settings.port, what="gRPC", flag="--port")
        return int(self.reservation.getsockname()[1])

    def _reserve_shared(self, shared: SharedPort) -> int:
        """Reserve a shared port as ``--port`` is; ConfigError naming its flag when it cannot be had."""
        reservation = _reserve(self.settings.host, shared.port, what=shared.what, flag=shared.flag)
        self.shared_reservations.append(reservation)
        port = int(reservation.getsockname()[1])
        self.shared_bound[shared.flag.removeprefix("--").replace("-", "_")] = port
        return port

    async def _keep(self, index: int, port: int, env: dict[str, str]) -> None:
        """Child ``index``, started again each time it dies, until the drain or a configuration error."""
        backoff_s = _RESTART_FIRST_S
        command = [
            sys.executable, "-m", self.module, *self.argv,
            "--processes", "1", "--port", str(port), "--metrics-port", "0", *self.shared_args,
        ]  # fmt: skip
        child_env = {**env, PROCESS_INDEX_ENV: str(index), PROCESSES_ENV: str(self.settings.processes)}
        while not self.stop.is_set():
            try:
                with interrupts_held():
                    process = await asyncio.create_subprocess_exec(*command, env=parent_env(child_env))
            except OSError as error:
                self.log.error("child not started; retrying", index=index, error=str(error)[:300])
                await self._pause(_RESTART_MAX_S)
                continue
            self.children[index] = process
            if self.stop.is_set():  # the drain began while it was starting: it drains too
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
            started = time.monotonic()
            self.log.info("child started", index=index, pid=process.pid)
            code = await process.wait()
            self.codes[index] = code
            if self.metrics_dir:
                mark_process_dead(process.pid, self.metrics_dir)
            if self.stop.is_set():
                self.log.info("child stopped", index=index, pid=process.pid, code=code)
                return
            if code == EXIT_CONFIG:
                self.log.error("child exited with a configuration error; stopping", index=index, pid=process.pid)
                self.config_error = f"process {index} exited with a configuration error (its line is above)"
                self.stop.set()
                return
            if time.monotonic() - started > _STABLE_S:
                backoff_s = _RESTART_FIRST_S
            self.restarts.inc()
            self.log.warning(
                "child exited; starting it again", index=index, pid=process.pid, code=code, after_s=backoff_s
            )
            await self._pause(backoff_s)
            backoff_s = min(backoff_s * 2, _RESTART_MAX_S)

    async def _pause(self, seconds: float) -> None:
        """Sleep, but not past the start of the drain."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    def close(self) -> None:
        """What outlives the event loop: the metrics endpoint, the port reservation, the metrics files."""
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None
        if self.reservation is not None:
            self.reservation.close()
            self.reservation = None
        for reservation in self.shared_reservations:
            reservation.close()
        self.shared_reservations = []
        if self.metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = ""


def _reserve(host: str, port: int, *, what: str, flag: str) -> socket.socket:
    """Bind (never listen on) a SO_REUSEPORT socket to ``host:port``; ConfigError naming ``flag`` when it
    cannot be had.

    A plain probe first: a process already listening on the port with SO_REUSEPORT set (another
    router started with --processes on the same port) would otherwise share it silently."""
    address = f"{host}:{port}"
    problem = bind_problem(host, port)
    if problem:
        raise ConfigError(f"cannot listen for {what} on {address} (--host/{flag}): {problem}")
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    reservation = socket.socket(family, kind, proto)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        reservation.bind(sockaddr)
    except OSError as error:
        reservation.close()
        raise ConfigError(f"cannot listen for {what} on {address} (--host/{flag}): {error.strerror}") from None
    return reservation


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's too: signalling it is refused, it is not absent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
