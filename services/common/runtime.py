"""One runtime for every splitstream server: shared flags, listeners, health, signals and an ordered drain.

Router, recorder and worker differ in what they serve, not in how they start or stop.
Each ``main`` parses its flags (the shared ones added by :func:`add_server_arguments`),
builds a :class:`Service` and hands it to :func:`run_service`, which:

1. binds the gRPC port on ``--host`` (TLS with ``--grpc-use-ssl``, mutual with
   ``--grpc-use-ssl-mutual``; :mod:`splitstream.common.tls`) and the Prometheus port on ``--metrics-host``
   (default 127.0.0.1); a taken port or a bad address is a configuration error;
2. registers the service's handlers, grpc.health.v1 (every name NOT_SERVING until the
   service says otherwise) and server reflection, runs :meth:`Service.prepare`, starts
   serving and runs :meth:`Service.run` in the background;
3. on SIGTERM or SIGINT drains in this order (a second signal is logged and ignored):
   health NOT_SERVING for every name (for good) and :meth:`Service.run` cancelled (again every
   second while it runs on: a cancel can be lost) →
   :meth:`Service.draining` → ``--drain-delay-s`` of serving on, so balancers and routers
   move away (skipped if the service never reported SERVING: nobody sends to it) →
   health Watch streams end → :meth:`Service.before_stop` → the server stops accepting
   and calls in flight get ``--shutdown-grace-s`` → :meth:`Service.teardown` → the
   metrics endpoint closes.

With ``--processes N`` (router and recorder) none of this runs in the parent:
:mod:`splitstream.common.supervisor` starts N children that each run it on the same port.

Exit codes, the same for every service: 0 after a clean SIGTERM/SIGINT; 2 and one line on
stderr for a configuration error (bad flag value, taken port, unusable address,
:class:`ConfigError` from the service's construction, ``prepare`` or ``run``); 1 when the
service failed otherwise (logged with its traceback) or a teardown step failed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import gc
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import structlog
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client import values as prometheus_values
from prometheus_client.exposition import ThreadingWSGIServer

from splitstream.common.argv_secrets import give_warnings
from splitstream.common.errors import ConfigError
from splitstream.common.handlers import ParseRequests
from splitstream.common.health import NOT_SERVING, SERVING, HealthServicer
from splitstream.common.interrupts import quiet_interrupts
from splitstream.common.parent import end_with_parent
from splitstream.common.protected_mode import DEFAULT_METRICS_HOST, INSECURE_FLAG, INSECURE_HELP
from splitstream.common.tls import ServerTls

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: How often the drain repeats a cancel that :meth:`Service.run` (or a task of it) did not act on.
CANCEL_REPEAT_S = 1.0
#: Set by the ``--processes`` parent (:mod:`splitstream.common.supervisor`) in each child: its index, 0..N-1.
#: A child serves its port with SO_REUSEPORT, beside its siblings.
PROCESS_INDEX_ENV = "SPLITSTREAM_PROCESS_INDEX"
#: Set beside it: how many children the parent runs (N), for what a child reports of all of them.
PROCESSES_ENV = "SPLITSTREAM_PROCESS_COUNT"
#: ``--processes`` above this many per usable core is refused: past one per core they only share the cores.
PROCESSES_PER_CORE = 4
#: gRPC takes message limits as a C int.
_MAX_GRPC_INT = 2**31 - 1
#: The longest --drain-delay-s and --shutdown-grace-s: an hour is past any orchestrator's stop timeout, and a
#: typo (1e300) made a SIGTERMed server wait for ever, never exiting short of SIGKILL.
MAX_STOP_WAIT_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class ServerDefaults:
    """A service's defaults for the shared flags (ports differ per service; the rest rarely does)."""

    port: int
    metrics_port: int
    max_message_bytes: int = 64 * 1024 * 1024
    drain_delay_s: float = 0.5
    shutdown_grace_s: float = 30.0


def process_index() -> int | None:
    """This process's index among its ``--processes`` siblings, or None when it was not started by a parent."""
    value = os.environ.get(PROCESS_INDEX_ENV, "")
    return int(value) if value.isdigit() else None


#: prometheus-client's switch to multiprocess mode (both spellings it reads); see :func:`own_metrics`.
MULTIPROC_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def own_metrics() -> None:
    """Keep this process's metrics in its own memory unless it is a ``--processes`` child.

    The variable switches prometheus-client to files in that directory for every metric made after it
    is imported. Left there by a user's environment (another app's, a stale one), a directory that does
    not exist made a ``--processes`` parent fail its start with a traceback and one process fail on its
    first metric; one that exists filled with files, and a process restarted with the same pid (pid 1
    in a container) counted on from its previous life. Only the parent's fresh directory is the
    children's business (:mod:`splitstream.common.supervisor`)."""
    if process_index() is not None:
        return
    for name in MULTIPROC_VARIABLES:
        os.environ.pop(name, None)
    prometheus_values.ValueClass = prometheus_values.MutexValue


class _ProcessesError(argparse.ArgumentTypeError, ValueError):
    """argparse shows an ArgumentTypeError's message; EnvArgumentParser reports a ValueError for the variable."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's cpuset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parse_processes(value: str) -> int:
    """``--processes``: a whole number from 1 to :data:`PROCESSES_PER_CORE` per usable core, or ``auto``
    (one per usable core).

    The bound is what keeps a typo (``--processes 10000`` for 10) from starting ten thousand Pythons,
    each a router's or recorder's memory, until the host runs out; only ASCII digits are read, so
    ``1_000`` or another script's digits are refused rather than taken as a count nobody meant."""
    text = value.strip()
    if text.lower() == "auto":
        return usable_cores()
    if not (text.isascii() and text.isdigit()):
        raise _ProcessesError(f"expected a whole number >= 1 or auto, got {value!r}")
    count = int(text)
    if count < 1:
        raise _ProcessesError(f"must be at least 1 (or auto), got {count}")
    cores = usable_cores()
    if count > PROCESSES_PER_CORE * cores:
        raise _ProcessesError(
            f"at most {PROCESSES_PER_CORE} per usable core ({PROCESSES_PER_CORE * cores} here, "
            f"where auto is {cores}), got {count}"
        )
    return count


def add_server_arguments(parser: argparse.ArgumentParser, defaults: ServerDefaults, *, processes: bool = False) -> None:
    """The flags every splitstream server has, in one group, with the same names, help and checks everywhere.

    Each reads its ``SPLITSTREAM_<SERVICE>_<FLAG>`` variable when ``parser`` is an EnvArgumentParser.
    ``processes``: the service can run as N processes on one port (``--processes``, see
    :mod:`splitstream.common.supervisor`)."""
    group = parser.add_argument_group("server (the same for every splitstream server)")
    if processes:
        group.add_argument(
            "--processes",
            type=parse_processes,
            default=1,
            help="processes serving --port together (SO_REUSEPORT, Linux only), each on its own core; auto: "
            f"one per usable core; at most {PROCESSES_PER_CORE} per usable core. A parent supervises them: restarts "
            "one that dies, drains all on SIGTERM, serves --metrics-port with their totals",
        )
    group.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the gRPC server listens on (this machine only by default; 0.0.0.0: every interface, which "
        f"needs TLS or caller authentication, or {INSECURE_FLAG})",
    )
    group.add_argument(
        "--port", type=int, default=defaults.port, help="gRPC port (0 picks a free one; the log says which)"
    )
    group.add_argument(
        "--metrics-host",
        default="",
        help="address the Prometheus /metrics endpoint listens on (empty: 127.0.0.1, this machine only; "
        "0.0.0.0 for a Prometheus elsewhere)",
    )
    group.add_argument(
        "--metrics-port", type=int, default=defaults.metrics_port, help="Prometheus /metrics port (0: off)"
    )
    group.add_argument(INSECURE_FLAG, action="store_true", help=INSECURE_HELP)
    group.add_argument(
        "--log-level", type=str.upper, default="INFO", help=f"level of the JSON log on stderr: {', '.join(LOG_LEVELS)}"
    )
    group.add_argument(
        "--drain-delay-s",
        type=float,
        default=defaults.drain_delay_s,
        help="on SIGTERM: seconds to keep serving after reporting NOT_SERVING, so balancers and routers move "
        f"away (at most {MAX_STOP_WAIT_S:g})",
    )
    group.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=defaults.shutdown_grace_s,
        help="on SIGTERM: seconds the work in flight (calls; the archiver's drain) gets before it is cancelled "
        f"(at most {MAX_STOP_WAIT_S:g})",
    )
    group.add_argument(
        "--max-message-bytes",
        type=int,
        default=defaults.max_message_bytes,
        help="largest gRPC message received or sent",
    )
    # Triton's names where they mean the same; the files are re-read when they change (no restart).
    tls = parser.add_argument_group("server TLS (plaintext unless --grpc-use-ssl; Triton's flag names)")
    tls.add_argument(
        "--grpc-use-ssl",
        action="store_true",
        help="serve gRPC over TLS with --grpc-server-cert/--grpc-server-key (re-read when they change)",
    )
    tls.add_argument(
        "--grpc-use-ssl-mutual",
        action="store_true",
        help="mutual TLS (implies --grpc-use-ssl): refuse clients without a certificate from --grpc-root-cert",
    )
    tls.add_argument("--grpc-server-cert", default="", help="PEM certificate (chain) this server presents")
    tls.add_argument("--grpc-server-key", default="", help="PEM private key of --grpc-server-cert")
    tls.add_argument(
        "--grpc-root-cert", default="", help="PEM CA bundle client certificates must chain to (mutual TLS)"
    )


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """The shared server flags, validated; a bad value raises ConfigError naming the flag.

    A frozen dataclass rather than a pydantic model: the values arrive typed from argparse,
    the checks are ranges whose messages must name the *flag* (``--port``), not a field, and
    the services' own settings are dataclasses of the same shape."""

    host: str = "127.0.0.1"
    port: int
    metrics_host: str = ""  # empty: loopback (DEFAULT_METRICS_HOST)
    metrics_port: int
    log_level: str = "INFO"
    drain_delay_s: float = 0.5
    shutdown_grace_s: float = 30.0
    max_message_bytes: int = 64 * 1024 * 1024
    grpc_use_ssl: bool = False
    grpc_use_ssl_mutual: bool = False
    grpc_server_cert: str = ""
    grpc_server_key: str = ""
    grpc_root_cert: str = ""
    processes: int = 1
    insecure: bool = False

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise ConfigError("--host: must not be empty")
        if self.processes < 1:
            raise ConfigError(f"--processes: must be at least 1, got {self.processes}")
        if self.processes > 1 and (sys.platform != "linux" or not hasattr(socket, "SO_REUSEPORT")):
            raise ConfigError(
                f"--processes {self.processes}: sharing a port needs SO_REUSEPORT as Linux has it; use 1 here"
            )
        if not self.metrics_host:
            object.__setattr__(self, "metrics_host", DEFAULT_METRICS_HOST)
        for flag, port in (("--port", self.port), ("--metrics-port", self.metrics_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{flag}: must be within 0..65535, got {port}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level: must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for flag, seconds in (("--drain-delay-s", self.drain_delay_s), ("--shutdown-grace-s", self.shutdown_grace_s)):
            if not (math.isfinite(seconds) and 0 <= seconds <= MAX_STOP_WAIT_S):  # NaN passes a plain `< 0` check
                raise ConfigError(f"{flag}: must be a number of seconds within 0..{MAX_STOP_WAIT_S:g}, got {seconds}")
        if not 0 < self.max_message_bytes <= _MAX_GRPC_INT:
            raise ConfigError(f"--max-message-bytes: must be within 1..{_MAX_GRPC_INT}, got {self.max_message_bytes}")
        self._check_tls()

    def _check_tls(self) -> None:
        """Files are checked here, at start, so a typo is exit 2 and one line, never a server that
        listens and then fails every handshake."""
        use_ssl = self.grpc_use_ssl or self.grpc_use_ssl_mutual
        if not use_ssl:
            for flag, value in (
                ("--grpc-server-cert", self.grpc_server_cert),
                ("--grpc-server-key", self.grpc_server_key),
                ("--grpc-root-cert", self.grpc_root_cert),
            ):
                if value:
                    raise ConfigError(f"{flag} needs --grpc-use-ssl (or --grpc-use-ssl-mutual); plaintext otherwise")
            return
        if not (self.grpc_server_cert and self.grpc_server_key):
            raise ConfigError("--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key")
        if self.grpc_use_ssl_mutual and not self.grpc_root_cert:
            raise ConfigError("--grpc-use-ssl-mutual needs --grpc-root-cert (the CA client certificates chain to)")
        if self.grpc_root_cert and not self.grpc_use_ssl_mutual:
            raise ConfigError("--grpc-root-cert is for mutual TLS: add --grpc-use-ssl-mutual")
        tls = self.tls
        assert tls is not None
        tls.check()

    @property
    def tls(self) -> ServerTls | None:
        """The server's TLS, or None for plaintext."""
        if not (self.grpc_use_ssl or self.grpc_use_ssl_mutual):
            return None
        return ServerTls(
            cert_file=self.grpc_server_cert,
            key_file=self.grpc_server_key,
            client_ca_file=self.grpc_root_cert,
            mutual=self.grpc_use_ssl_mutual,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        """The settings from flags added by :func:`add_server_arguments` (``--processes`` only where offered)."""
        return cls(**{name: getattr(args, name) for name in SERVER_ARGUMENTS if hasattr(args, name)})

    @property
    def grpc_address(self) -> str:
        return _host_port(self.host, self.port)

    def server_options(self) -> list[tuple[str, int]]:
        """SO_REUSEPORT off: two processes must never silently share a port (the second must fail to start);
        on only in a ``--processes`` child, whose parent holds the port for its children alone."""
        return [
            ("grpc.so_reuseport", 1 if process_index() is not None else 0),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]


#: The argparse destinations :func:`add_server_arguments` adds: one per :class:`ServerSettings` field.
SERVER_ARGUMENTS = frozenset(field.name for field in dataclasses.fields(ServerSettings))


class Runtime:
    """What a running service may ask of the runtime: its settings, and its health status."""

    def __init__(self, settings: ServerSettings, health: HealthServicer, health_names: Sequence[str]) -> None:
        self.settings = settings
        self.port = 0  # the gRPC port bound (differs from settings.port when that is 0)
        self.served = False  # whether health ever said SERVING
        self._health = health
        self._health_names = tuple(dict.fromkeys(["", *health_names]))

    async def set_serving(self, serving: bool) -> None:
        """Health for every name the service offers; ignored once the drain has begun (it stays NOT_SERVING)."""
        for name in self._health_names:
            await self._health.set(name, SERVING if serving else NOT_SERVING)
        self.served = self.served or serving


class Service:
    """What a service plugs into :func:`run_service`; every hook but :meth:`register` may be left as it is.

    ``prog`` names the command in error lines; ``grpc_services`` are the full names of the
    gRPC services it serves (reflection, and health names beside ``""``); ``metrics`` is the
    registry its Prometheus endpoint exposes."""

    prog: str = "splitstream"
    grpc_services: Sequence[str] = ()
    metrics: CollectorRegistry | None = None

    def health_names(self) -> Sequence[str]:
        """Names health reports on besides ``""`` (default: the gRPC services)."""
        return self.grpc_services

    def interceptors(self) -> Sequence[aio.ServerInterceptor]:
        """Server interceptors, outermost first (none by default)."""
        return ()

    def register(self, server: aio.Server) -> None:
        """Add the service's handlers to ``server`` (not started yet)."""
        raise NotImplementedError

    async def prepare(self, runtime: Runtime) -> None:
        """Ports are bound, nothing is served yet: load what calls need (ConfigError: exit 2)."""

    async def run(self, runtime: Runtime) -> None:
        """Serving: the service's own long-lived work (it reports SERVING through ``runtime``).

        Cancelled when the drain begins. Returning is fine; ConfigError ends the process with
        exit 2, any other exception with 1 (after the drain, in both cases)."""

    async def draining(self) -> None:
        """Health is NOT_SERVING: stop taking new work where the protocol cannot say so (ready flags, Consul)."""

    async def before_stop(self) -> None:
        """The drain delay is over; the server is about to stop accepting (end long streams politely)."""

    async def teardown(self) -> None:
        """The server has stopped: flush and release what the service holds."""


#: Set in the environment of a child a service starts (see supervisor): the pid of the parent it must not outlive.
PARENT_PID_ENV = "SPLITSTREAM_PARENT_PID"


def parent_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (else this process's environment) naming this process as the parent (see :func:`die_with_parent`)."""
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """Runs in a child at its start: SIGTERM when the parent exits, however it exits (Linux only), so a
    parent killed with SIGKILL leaves no process behind serving or holding a log (see
    :func:`splitstream.common.parent.end_with_parent`). SIGTERM, so the child drains as on any stop."""
    parent = os.environ.pop(PARENT_PID_ENV, "")  # popped: the child's own children have another parent
    if parent.isdigit():
        end_with_parent(int(parent), signal.SIGTERM)


def run_service(settings: ServerSettings, build: Callable[[], Service], *, prog: str) -> int:
    """Run the service ``build()`` makes (called inside the event loop) until a signal; the exit code.

    ``prog`` names the command in the one-line error of a configuration problem found before
    the service exists (a taken gRPC port)."""
    die_with_parent()
    own_metrics()
    runner = _Runner(settings, build, prog=prog)
    try:
        return asyncio.run(runner.serve())
    except ConfigError as error:
        print(f"{runner.prog}: error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception:
        runner.log.exception("could not start")
        return EXIT_FAILED
    finally:
        quiet_interrupts()  # the closed loop put Python's KeyboardInterrupt back


class _Runner:
    def __init__(self, settings: ServerSettings, build: Callable[[], Service], *, prog: str) -> None:
        self.settings = settings
        self.build = build
        self.prog = prog
        self.log = structlog.get_logger()
        self.health = HealthServicer()
        self.metrics_server: Any = None

    async def serve(self) -> int:
        settings = self.settings
        # Signals are caught from the start, so one during startup ends in the same ordered drain.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: signal.Signals) -> None:
            if stop.is_set():
                self.log.warning("signal ignored, already shutting down", signal=signum.name)
                return
            self.log.info("signal received, shutting down", signal=signum.name)
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        service = self.build()
        self.prog = service.prog
        # The server is made after the service, which may intercept calls (interceptors are fixed at creation).
        # ParseRequests last (innermost): every handler, health's and reflection's too, answers bytes that
        # do not parse INVALID_ARGUMENT naming the message, where grpc itself answers UNKNOWN.
        server = aio.server(interceptors=[*service.interceptors(), ParseRequests()], options=settings.server_options())
        port = _bind_grpc(server, settings)
        try:
            runtime = Runtime(settings, self.health, service.health_names())
            runtime.port = port
            if settings.metrics_port and service.metrics is not None:
                self.metrics_server = bind_metrics(settings, service.metrics)
            service.register(server)
            add_health_and_reflection(server, self.health, service.grpc_services)
            await runtime.set_serving(False)
            await service.prepare(runtime)
        except BaseException:
            await server.stop(None)
            self._close_metrics()
            raise
        await server.start()
        self.log.info(
            "listening",
            host=settings.host,
            port=port,
            **({"process_index": index} if (index := process_index()) is not None else {}),
            metrics_host=settings.metrics_host,
            metrics_port=settings.metrics_port or None,
            tls="mutual" if settings.grpc_use_ssl_mutual else ("on" if settings.grpc_use_ssl else "off"),
        )
        # Everything the service is made of (modules, routing tables, servers) exists now and lives as long as the
        # process: frozen, the cyclic collector no longer walks it at each full collection (some 70,000 objects
        # in a router, tens of milliseconds each time, paid by the calls answered meanwhile).
        gc.collect()
        gc.freeze()
        # Held until now: a start that fails on its configuration stays one line on stderr.
        give_warnings(lambda line: self.log.warning("secret on the command line (deprecated)", detail=line))
        running = asyncio.create_task(service.run(runtime), name="service-run")
        stopping = asyncio.create_task(stop.wait(), name="wait-for-signal")
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if running.done() and not running.cancelled() and running.exception() is None:
            await stopping  # the service's own work is done; it serves on until told to stop
        code = EXIT_OK
        failure = running.exception() if running.done() and not running.cancelled() else None
        if isinstance(failure, ConfigError):
            code = EXIT_CONFIG
        elif failure is not None:
            self.log.error("service failed; shutting down", exc_info=failure)
            code = EXIT_FAILED
        code = max(code, await self._drain(server, service, runtime, running, stopping))
        self.log.info("stopped", exit_code=code)
        if isinstance(failure, ConfigError):
            # Last, so the line that says what to fix is the one a person reads first.
            print(f"{self.prog}: error: {failure}", file=sys.stderr)
        return code

    async def _drain(self, server: aio.Server, service: Service, runtime: Runtime, *tasks: asyncio.Task[Any]) -> int:
        settings = self.settings
        self.log.info("draining", drain_delay_s=settings.drain_delay_s, shutdown_grace_s=settings.shutdown_grace_s)
        await self.health.enter_graceful_shutdown()
        await self._cancel(*tasks)
        code = await self._step("draining", service.draining())
        if runtime.served and settings.drain_delay_s > 0:
            await asyncio.sleep(settings.drain_delay_s)
        self.health.end_watches()
        code = max(code, await self._step("before_stop", service.before_stop()))
        await server.stop(settings.shutdown_grace_s)
        code = max(code, await self._step("teardown", service.teardown()))
        await asyncio.to_thread(self._close_metrics)
        return code

    async def _cancel(self, *tasks: asyncio.Task[Any]) -> None:
        """Cancel until the tasks end: on Python 3.11 ``asyncio.wait_for`` (which redis-py runs each command
        under) returns its result instead of raising when the cancel lands just as the awaited call
        completes, and the loop it runs in goes on as if never told to stop. A cancel the task lost is
        repeated every :data:`CANCEL_REPEAT_S` (level-triggered, as in trio and anyio)."""
        for task in tasks:
            task.cancel()
        pending = {task for task in tasks if not task.done()}
        while pending:
            _, pending = await asyncio.wait(pending, timeout=CANCEL_REPEAT_S)
            for task in pending:
                self.log.warning("a cancelled task runs on; cancelling it again", task=task.get_name())
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _step(self, name: str, step: Any) -> int:
        """One service hook; a failure is logged and the drain goes on (the rest must still be released)."""
        try:
            await step
        except Exception:
            self.log.exception("shutdown step failed", step=name)
            return EXIT_FAILED
        return EXIT_OK

    def _close_metrics(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _bind_grpc(server: aio.Server, settings: ServerSettings) -> int:
    """Bind the gRPC port (not serving yet); ConfigError when the port is taken or the address unusable.

    The port is tried with a plain socket first: gRPC's own failure is a vague RuntimeError
    plus a line of its C core on stderr, and the contract is one line saying what is wrong."""
    address = settings.grpc_address
    problem = bind_problem(settings.host, settings.port, reuse_port=process_index() is not None)
    if problem:
        raise ConfigError(f"cannot listen for gRPC on {address} (--host/--port): {problem}")
    tls = settings.tls
    try:
        if tls is not None:
            return int(server.add_secure_port(address, tls.credentials()))
        return int(server.add_insecure_port(address))
    except RuntimeError as error:
        raise ConfigError(f"cannot listen for gRPC on {address} (--host/--port): {error}") from None


#: How often the /metrics server's loop looks for a stop: its shutdown() waits up to this long, and
#: prometheus-client's start_http_server polls every 0.5 s, which every SIGTERMed server waited out.
METRICS_POLL_S = 0.05


class _QuietHandler(WSGIRequestHandler):
    """A request handler that logs nothing: scrapes are not news."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def bind_metrics(settings: ServerSettings, registry: CollectorRegistry) -> Any:
    """Serve ``registry`` at /metrics from a thread (prometheus-client's WSGI app and threading server),
    stopped at once by ``shutdown()``."""
    address = _host_port(settings.metrics_host, settings.metrics_port)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            settings.metrics_host, settings.metrics_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family, "daemon_threads": True})
        server: ThreadingWSGIServer = make_server(
            str(sockaddr[0]), settings.metrics_port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
        )
    except (OSError, UnicodeError) as error:  # UnicodeError: a host name IDNA cannot encode
        reason = "not a valid host name" if isinstance(error, UnicodeError) else error.strerror or str(error)
        raise ConfigError(f"cannot serve metrics on {address} (--metrics-host/--metrics-port): {reason}") from None
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": METRICS_POLL_S}, name="metrics", daemon=True
    ).start()
    return server


def bind_problem(host: str, port: int, *, reuse_port: bool = False) -> str:
    """Why ``host:port`` cannot be listened on, or "" (port 0 always can). SO_REUSEADDR as gRPC sets it,
    so a port left in TIME_WAIT by a previous run is not refused; SO_REUSEPORT too in a ``--processes``
    child (``reuse_port``), whose parent and siblings hold the port with it."""
    if port == 0:
        return ""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        return f"cannot resolve {host!r}: {error.strerror}"
    except UnicodeError:  # a name IDNA cannot encode (a label over 63 characters, an empty label)
        return f"cannot resolve {host!r}: not a valid host name"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind(sockaddr)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return f"port {port} is already in use"
            return error.strerror or str(error)
    return ""


def add_health_and_reflection(server: aio.Server, health: HealthServicer, service_names: Sequence[str]) -> None:
    """grpc.health.v1 for routers, Consul and container checks; reflection so grpcurl needs no .proto files."""
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
