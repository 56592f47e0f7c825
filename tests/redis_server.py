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

from tests import launcher
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
        self.process = launcher.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
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


class RedisClusterServers:
    """A real Redis Cluster: ``masters`` ``redis-server --cluster-enabled yes`` processes (each with
    ``replicas`` replicas) on free ports, joined by ``redis-cli --cluster create``. A small
    ``cluster-node-timeout`` makes a failover (a master killed, its replica promoted) take about a second.

        with RedisClusterServers(tmp_path, replicas=1) as cluster:
            client = cluster.client()  # a blocking redis.RedisCluster
    """

    def __init__(
        self,
        directory: Path,
        *,
        masters: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = 1000,
        tls: RedisTls | None = None,
        password: str = "",
        users: Sequence[str] = (),
    ) -> None:
        """``tls``: every node listens on TLS only, the cluster bus and replication too (``--tls-cluster``,
        ``--tls-replication``; ``rediss+cluster://`` URLs). ``password`` (the default user's) and ``users``
        (``ACL SETUSER`` lines) as for :class:`RedisServer`, applied on every node: ACLs are per node."""
        self.directory = directory
        self.replicas = replicas
        self.tls = tls
        self.password = password
        secure: tuple[str, ...] = ()
        if tls is not None:
            secure += ("--tls-cluster", "yes", "--tls-replication", "yes")
        if password:
            secure += ("--masterauth", password)  # replicas sync as the default user
        self.servers = [
            RedisServer(
                directory / f"node-{index}",
                password=password,
                tls=tls,
                users=users,
                config=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                    # The bus port is the port + 10000 unless set: a free port above 55535 would not do.
                    "--cluster-port",
                    str(free_port()),
                    # A replica that never finished its first sync cannot be promoted: sync at once.
                    "--repl-diskless-sync-delay",
                    "0",
                    *secure,
                ),
            )
            for index in range(masters * (1 + replicas))
        ]

    @property
    def scheme(self) -> str:
        return "rediss+cluster" if self.tls is not None else "redis+cluster"

    @property
    def url(self) -> str:
        """Every node as a startup node, so a client can start with any one of them down (with the default
        user's password when there is one)."""
        return self.url_for(password=self.password)

    def url_for(self, user: str = "", password: str = "") -> str:
        """The cluster's URL as ``user`` (no credentials when both are empty: flags or files give them)."""
        credentials = f"{user}:{password}@" if user or password else ""
        return f"{self.scheme}://{credentials}" + ",".join(f"127.0.0.1:{server.port}" for server in self.servers)

    def start(self, timeout_s: float = 30.0) -> RedisClusterServers:
        """Start the nodes, create the cluster, return once every slot is served (``cluster_state:ok``)."""
        for server in self.servers:
            server.start()
        redis_cli = shutil.which("redis-cli")
        if redis_cli is None:
            raise RuntimeError("redis-cli is not on PATH")
        nodes = [f"127.0.0.1:{server.port}" for server in self.servers]
        create = ["--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        launcher.run(
            [redis_cli, *self._cli_options(), *create],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        self.wait_ok(timeout_s)
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node says ``cluster_state:ok`` and every slot has a running master."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._ok():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not ok after {timeout_s}s")
            time.sleep(0.1)

    def _ok(self) -> bool:
        running = {server.port for server in self.servers if server.running}
        for server in self.servers:
            if not server.running:
                continue
            with server.client() as client:
                try:
                    info = client.execute_command("CLUSTER", "INFO")
                    slots = client.execute_command("CLUSTER", "SLOTS")
                    replication = client.info("replication")
                except redis.RedisError:
                    return False
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False  # a replica that has not synced could not take over
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
            covered = sum(int(end) - int(start) + 1 for start, end, master, *_ in slots if int(master[1]) in running)
            if covered != 16384:
                return False
        return True

    def master_of(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot now."""
        with self.client() as client:
            node = client.get_node_from_key(key)
            port = int(node.port)
        return next(server for server in self.servers if server.port == port)

    def move_slot(self, key: str, to: RedisServer, timeout_s: float = 30.0) -> None:
        """Give ``key``'s slot to the master ``to``, while the slot holds no key (nothing to migrate): how
        a test puts two keys that hash to one master's range on different masters."""
        with self.client() as client:
            slot = client.keyslot(key)
            if client.cluster_countkeysinslot(slot):
                raise RuntimeError(f"slot {slot} of {key!r} holds keys: move it before anything is written")
        with to.client() as client:
            node_id = client.execute_command("CLUSTER", "MYID")
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id)
            client.execute_command("CLUSTER", "BUMPEPOCH")  # its claim wins over any stale one in gossip
        for server in self.servers:
            if server is not to and server.running:
                with server.client() as client:
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id)
        deadline = time.monotonic() + timeout_s
        while self.master_of(key).port != to.port or not self._ok():
            if time.monotonic() > deadline:
                raise RuntimeError(f"slot {slot} did not move to {to.port} within {timeout_s}s")
            time.sleep(0.1)

    @property
    def masters(self) -> list[RedisServer]:
        """The running nodes that serve slots now."""
        with self.client() as client:
            ports = {int(node.port) for node in client.get_primaries()}
        return [server for server in self.servers if server.port in ports]

    def kill(self, server: RedisServer) -> None:
        """SIGKILL one node: no goodbye to the cluster, as a crashed host."""
        if server.process is not None:
            server.process.kill()
            server.process.wait()
            server.process = None

    def _cli_options(self) -> list[str]:
        """``redis-cli`` flags to reach a node: TLS files and the default user's password."""
        options = ["-a", self.password, "--no-auth-warning"] if self.password else []
        if self.tls is not None:
            options += ["--tls", "--cacert", str(self.tls.ca)]
            if self.tls.client_cert is not None:
                options += ["--cert", str(self.tls.client_cert), "--key", str(self.tls.client_key)]
        return options

    def client(self) -> redis.RedisCluster:
        """A blocking cluster client (binary replies) for assertions, as the default user; the caller closes it."""
        running = next(server for server in self.servers if server.running)
        return redis.RedisCluster(
            host="127.0.0.1",
            port=running.port,
            password=self.password or None,
            ssl=self.tls is not None,
            **running._client_options(),  # type: ignore[arg-type]
        )

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> RedisClusterServers:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
