"""One rollout per model at a time: a lock that dies with the rollout holding it.

Two rollouts of one model fought over its weights: each wrote its steps, and one's rollback
undid the other's step. A rollout holds its model's lock from before its first read to its
end; a second one is refused at once (exit 2), naming who holds it: version, pid, host and since
when.

- File registry: ``flock`` on a lock file beside the registry file (beside the file a link points
  to, which is what is written): ``.<registry file>.rollout.<model>.lock``. The kernel lets go of
  the lock when its holder dies, however it dies (SIGKILL included). The holder writes who it is
  in the file and removes the file at its end (a lock file left by a killed rollout is taken over).
- Consul: a session (TTL :data:`CONSUL_TTL_S`, behaviour ``delete``, no lock delay) holding KV
  ``splitstream/rollouts/<model>`` by ``?acquire=``, the value saying who holds it. A thread
  renews the session every third of its TTL; the rollout's end destroys it, which deletes the key.
  A rollout killed with SIGKILL leaves the key until Consul invalidates the session, within one to
  two TTLs of its last renewal.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitstream.admin.store import AdminError, ConsulStore, FileStore, Invalid, Store
from splitstream.common.registry.consul import consul_errors, describe_error

if TYPE_CHECKING:
    import consul  # py-consul pulls requests: imported by a Consul registry's client, not by a file registry's

#: KV prefix of the Consul rollout locks (a key per model).
LOCK_PREFIX = "splitstream/rollouts/"
#: TTL of a rollout's Consul session, in seconds (Consul takes 10 s to 24 h).
CONSUL_TTL_S = 15


def holder(version: str) -> dict[str, Any]:
    """Who this rollout is, as the lock records it."""
    return {
        "version": version,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


def _held_text(model: str, where: str, text: str | bytes | None) -> str:
    try:
        who = json.loads(text or b"")
        held = f"rollout of {who['version']} by pid {who['pid']} on {who['host']}, since {who['since']}"
    except (ValueError, TypeError, KeyError):
        held = "rollout that has not said who it is yet"
    return f"model '{model}' already has a rollout running ({held}; lock {where}); wait for it to end or stop it"


class RolloutLock:
    """Held by ``with``; Invalid (exit 2) when another rollout holds it, AdminError (exit 1) when it cannot
    be taken at all."""

    def __enter__(self) -> RolloutLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None: ...

    def lost(self) -> str | None:
        """Why the lock is no longer held (another rollout took it), or None."""
        return None


class FileLock(RolloutLock):
    def __init__(self, registry: Path, model: str, who: dict[str, Any]) -> None:
        real = Path(os.path.realpath(registry))
        name = f".{real.name}.rollout.{urllib.parse.quote(model, safe='')}.lock"
        self.path = real.with_name(name)
        self.fd: int | None = None
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as error:
                raise AdminError(f"cannot lock {self.path}: {error.strerror or error}; nothing changed") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                text = self._holder_text(fd)
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise AdminError(f"cannot lock {self.path}: {error.strerror or error}; nothing changed") from None
                raise Invalid(_held_text(model, str(self.path), text)) from None
            try:  # the file its last holder removed at its end (after we opened it) is no lock
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            try:  # who holds it, for the rollout refused: a disk too full to say it still leaves the lock held
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps(who).encode() + b"\n")
            except OSError:
                pass
            self.fd = fd
            return
        raise AdminError(f"cannot lock {self.path}: it keeps being removed; nothing changed")

    @staticmethod
    def _holder_text(fd: int) -> bytes:
        """The holder writes who it is just after it takes the lock: a moment to let it."""
        for _ in range(10):
            text = os.pread(fd, 4096, 0)
            if text.endswith(b"\n"):
                return text
            time.sleep(0.05)
        return text

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # removed while held, so no one takes a lock on a file gone
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


class ConsulLock(RolloutLock):
    def __init__(self, store: ConsulStore, model: str, who: dict[str, Any]) -> None:
        self.description = store.description
        self.address = store.address
        self.key = LOCK_PREFIX + model
        self.model = model
        self.value = json.dumps(who)
        self.ttl_s = CONSUL_TTL_S
        self._lost: str | None = None
        self._stop = threading.Event()
        client = self.address.client()
        try:
            self.session = self._acquire(client)
        except consul_errors() as error:
            raise AdminError(
                f"{self.description}: cannot lock {self.key}: {describe_error(error)}; nothing changed"
            ) from None
        if self.session is None:
            try:
                _, entry = client.kv.get(self.key)
            except consul_errors():
                entry = None
            raise Invalid(_held_text(model, f"{self.key} in {self.description}", (entry or {}).get("Value")))
        self._renewer = threading.Thread(target=self._renew, name="rollout-lock", daemon=True)
        self._renewer.start()

    def _acquire(self, client: consul.Consul) -> str | None:
        """A new session holding the key, or None (the session destroyed) when another one holds it."""
        session = client.session.create(
            name=f"splitstream rollout of {self.model}", behavior="delete", ttl=self.ttl_s, lock_delay=0
        )
        try:
            if client.kv.put(self.key, self.value, acquire=session):
                return str(session)
        except BaseException:
            with contextlib.suppress(*consul_errors()):
                client.session.destroy(session)
            raise
        with contextlib.suppress(*consul_errors()):
            client.session.destroy(session)
        return None

    def _renew(self) -> None:
        """Renew every third of the TTL; Consul failing is tried again. A session Consul no longer knows (it
        expired: this process stopped, or Consul could not be reached for a TTL) is replaced and the key
        taken again; if another rollout took it meanwhile, :meth:`lost` says so."""
        import consul  # loaded already, by the client

        client = self.address.client()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                client.session.renew(self.session)
                continue
            except consul.NotFound:
                pass
            except consul_errors():
                continue
            try:
                session = self._acquire(client)
            except consul_errors():
                continue
            if session is None:
                self._lost = f"the rollout lock {self.key} was lost (its session expired) and another rollout holds it"
                return
            self.session = session

    def lost(self) -> str | None:
        return self._lost

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._renewer.join(timeout=5)
        with contextlib.suppress(*consul_errors()):  # (left to expire within two TTLs when Consul is down)
            self.address.client(timeout_s=5).session.destroy(self.session)


def rollout_lock(store: Store, model: str, version: str) -> RolloutLock:
    """Take ``model``'s rollout lock in ``store``'s registry; a store of neither kind (tests') needs none."""
    who = holder(version)
    if isinstance(store, FileStore):
        return FileLock(store.path, model, who)
    if isinstance(store, ConsulStore):
        return ConsulLock(store, model, who)
    return RolloutLock()


@contextlib.contextmanager
def held(store: Store, model: str, version: str) -> Iterator[RolloutLock]:
    lock = rollout_lock(store, model, version)
    try:
        yield lock
    finally:
        lock.release()
