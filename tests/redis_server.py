"""A real, throwaway ``redis-server`` for tests and benchmarks.

Each instance listens on its own free port on 127.0.0.1 (never 6379, which a
developer's Redis may hold), keeps nothing on disk (``--save ""``, no AOF) and
works in its own directory. It can be stopped and started again on the same port,
which is how tests take Redis away from a service and give it back.

    with RedisServer(tmp_path) as server:
        client = redis.Redis.from_url(server.url)

With ``tls=RedisTls(...)`` it listens only on a TLS port (``rediss://`` URLs; Debian's redis-server
is built with TLS), and ``users`` are ``ACL SETUSER`` lines applied once it answers, so tests can
give each component its own least-privilege user (:meth:`RedisServer.url_for`).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.harness import free_port


@dataclass(frozen=True)
class RedisTls:
    """The server's certificate and key, and the CA clients verify it with (and, when
    ``auth_clients``, the CA client certificates must chain to: ``--tls-auth-clients yes``)."""

    cert: Path
    key: Path
    ca: Path
    auth_clients: bool = False
    #: A client certificate the harness itself connects with when ``auth_clients``.
    client_cert: Path | None = None
    client_key: Path | None = None


class RedisServer:
    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        password: str = "",
        config: Sequence[str] = (),
        tls: RedisTls | None = None,
        users: Sequence[str] = (),
    ) -> None:
        """``password``: require it (``--requirepass``; :attr:`url` carries it). ``config``: extra
        ``redis-server`` arguments, e.g. ``("--stream-node-max-entries", "10")``."""
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError("redis-server is not on PATH")
        self.executable = executable
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.tls = tls
        self.users = list(users)
        tls_config: list[str] = []
        if tls is not None:
            tls_config = [
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(tls.cert),
                "--tls-key-file",
                str(tls.key),
                "--tls-ca-cert-file",
                str(tls.ca),
                "--tls-auth-clients",
                "yes" if tls.auth_clients else "no",
            ]
        self.config = [*(("--requirepass", password) if password else ()), *tls_config, *config]
        self.log_path = directory / f"redis-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password else ""
        return f"{self.scheme}://{credentials}127.0.0.1:{self.port}/0"

    @property
    def scheme(self) -> str:
        return "rediss" if self.tls is not None else "redis"

    def url_for(self, user: str = "", password: str = "") -> str:
        """A URL without credentials when both are empty (they then come from flags or files)."""
        credentials = f"{user}:{password}@" if user or password else ""
        return f"{self.scheme}://{credentials}127.0.0.1:{self.port}/0"

    def _client_options(self) -> dict[str, object]:
        if self.tls is None:
            return {}
        options: dict[str, object] = {"ssl_ca_certs": str(self.tls.ca)}
        if self.tls.client_cert is not None:
            options |= {"ssl_certfile": str(self.tls.client_cert), "ssl_keyfile": str(self.tls.client_key)}
        return options

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start redis-server and return once it answers PING (raises with its log otherwise)."""
        if self.running:
            return self
        args = [
            self.executable,
            "--port",
            "0" if self.tls is not None else str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--logfile",
            str(self.log_path),
            *self.config,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password or None,
            socket_timeout=1,
            socket_connect_timeout=1,
            ssl=self.tls is not None,
            **self._client_options(),  # type: ignore[arg-type]
        )
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{self.log()}")
                try:
                    if client.ping():
                        for rules in self.users:
                            client.execute_command("ACL", "SETUSER", *rules.split())
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer PING within {timeout_s}s:\n{self.log()}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Terminate redis-server and wait for it; its data is gone (nothing is persisted)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self) -> redis.Redis:
        """A blocking client (binary replies) for assertions; the caller closes it."""
        return redis.Redis.from_url(self.url, **self._client_options())  # type: ignore[arg-type]

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
