"""A Consul HTTP API emulator for the tests: a test double, NOT Consul.

Consul itself cannot be installed where the tests run, so this stands in for one
Consul agent (and its servers) as seen through py-consul, for exactly the calls
splitstream makes. It runs as a real separate process (``python -m
tests.consul_emulator --port P``) speaking HTTP on 127.0.0.1, so routers, workers
and the admin CLI talk to it over the network as they would to Consul.

Consul behaviours it reproduces (where splitstream depends on them):

- Agent services: ``PUT /v1/agent/service/register`` (ID, Name, Address, Port,
  Tags, Meta, ``Check``/``Checks``; JSON keys case-insensitive as Consul decodes
  them; registering an existing ID replaces it), ``PUT
  /v1/agent/service/deregister/<id>`` (404 for an unknown ID), ``GET
  /v1/agent/services``.
- ``GET /v1/health/service/<name>[?passing]``: ``[{Node, Service, Checks}]`` with
  the node's ``serfHealth`` check; ``passing`` keeps instances whose every check
  passes; an instance without ``Address`` takes the node's address.
- ``GET /v1/catalog/services``: ``{name: [tags]}``, ``consul`` included.
- KV: ``GET /v1/kv/<key>[?recurse]`` (base64 ``Value``, ``CreateIndex``,
  ``ModifyIndex``; 404 when nothing matches), ``PUT /v1/kv/<key>[?cas=N]`` (cas 0:
  only if absent; else only if ModifyIndex equals N; answers ``true``/``false``),
  ``DELETE /v1/kv/<key>[?recurse]``.
- Sessions and KV locks, as Consul's session API documents them: ``PUT /v1/session/create``
  (``Name``, ``Behavior`` release|delete, ``TTL`` between 10s and 24h else 400, ``LockDelay``,
  default 15s; answers ``{"ID": ...}``), ``PUT /v1/session/renew/<id>`` (``[session]``; 404
  "Session id '<id>' not found" once it is gone), ``PUT /v1/session/destroy/<id>`` (``true``),
  ``GET /v1/session/info/<id>``. ``PUT /v1/kv/<key>?acquire=<session>`` takes the key's lock
  when no session holds it (or the same one does) and answers ``true``, else ``false``; an
  unknown session is a 500 "invalid session". ``?release=<session>`` lets go of it (``false``
  when that session does not hold it). A plain PUT or DELETE ignores locks, as in Consul (they
  are advisory). Entries show ``Session`` while held and ``LockIndex`` counts acquisitions. A
  session destroyed, or not renewed within its TTL, is invalidated: its locks are released
  (``Behavior`` release) or their keys deleted (delete), and for ``LockDelay`` after that the
  key cannot be acquired (``false``). Consul invalidates a TTL session between TTL and twice the TTL
  after its last renewal; the emulator at TTL exactly (checked every 0.1 s). Sessions persist
  with KV in ``--state-file`` and their TTL timers start again at a restart, as Consul's do
  at a leader election.
- Blocking queries on every GET above: ``?index=N&wait=D`` holds the answer until
  the result's index exceeds N or D passes (default 5m, at most 10m); every
  answer carries ``X-Consul-Index``. One raft-like index counts every write.
- gRPC health checks the emulator runs itself: ``grpc.health.v1.Health/Check`` on
  the check's ``GRPC`` target (``host:port[/service]``) every ``Interval`` with
  ``Timeout``; SERVING → passing, any other answer or no answer → critical, with
  ``Output`` saying why. ``Status`` sets the initial state (critical by default).
  So a worker that turns NOT_SERVING goes critical and drops out of ``?passing``.
- ``DeregisterCriticalServiceAfter``: a service whose check has been critical that
  long is deregistered.
- ACL tokens, only if started with ``--token T``: a request without
  ``X-Consul-Token: T`` gets 403 "Permission denied".
- HTTPS, only if started with ``--tls-cert/--tls-key``: the API is served over TLS only (a
  plaintext request gets no answer, as with Consul's ``ports.http = -1``); with ``--tls-ca`` a
  client without a certificate from that CA is refused in the handshake (``verify_incoming``).
  A token sent as a ``?token=`` query parameter is logged ("token in query string"), so tests can
  prove clients send it only as the header.
- gRPC checks with ``GRPCUseTLS``: dialled over TLS with the agent's own ``--tls-ca`` and
  ``--tls-cert/--tls-key`` (Consul's checks use the agent's outgoing TLS settings).
- Restart: KV and the index persist in ``--state-file`` (they live in the servers'
  raft log); services and checks do not, like an agent that lost its local state,
  so workers must register again.

Not reproduced (splitstream does not depend on it, or the tests must not):
multiple nodes, datacenters and servers, gossip and leader election;
consistency modes (``stale``/``consistent``) and ``X-Consul-KnownLeader``/
``LastContact``; the blocking-query jitter (wait/16) and Consul's 1-minute
minimum and 30-second reaper granularity for DeregisterCriticalServiceAfter
(honoured to the check here); the initial random stagger of checks (the first
check runs at once); HTTP/TCP/TTL/script checks, check ``SuccessBeforePassing``/
``FailuresBeforeCritical``, maintenance mode, ``warning`` status; ACL policies
(one token allows everything); sessions' health checks (a session's node is always
healthy here), ``/v1/session/list`` and ``/node``; KV flags beyond storing them,
transactions; tag/filter/near/node-meta query parameters; per-prefix index
tracking (a recursive or missing-key KV query reports the whole KV index, so
it may wake without a change, which Consul also allows); Connect, prepared
queries, events, snapshots; ``TLSSkipVerify``/``TLSServerName`` on checks; HTTP/2 on the API.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests import launcher

NODE = "emulator"
NODE_ADDRESS = "127.0.0.1"
DEFAULT_WAIT_S = 300.0
MAX_WAIT_S = 600.0
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | int | float | None, default: float = 0.0) -> float:
    """Go duration (``1m30s``, ``500ms``) or a number of seconds → seconds."""
    if text is None or text == "":
        return default
    if isinstance(text, int | float):
        return float(text)
    parts = re.findall(r"([\d.]+)(ns|us|µs|ms|s|m|h)", text)
    if not parts:
        return float(text)
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _lower_keys(data: Any) -> Any:
    if isinstance(data, dict):
        return {str(k).lower(): v for k, v in data.items()}
    return data


@dataclass
class Check:
    check_id: str
    service_id: str
    service_name: str
    target: str  # host:port
    grpc_service: str
    interval_s: float
    timeout_s: float
    deregister_after_s: float | None
    status: str
    output: str = ""
    critical_since: float | None = None
    use_tls: bool = False
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass
class Service:
    service_id: str
    name: str
    address: str
    port: int
    tags: list[str]
    meta: dict[str, str]
    create_index: int
    modify_index: int
    checks: list[Check]


class State:
    """Everything the emulator knows, behind one lock; ``changed`` wakes blocking queries."""

    def __init__(self, state_file: Path | None) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.state_file = state_file
        self.index = 1
        self.kv: dict[str, dict[str, Any]] = {}  # key → {Value (bytes|None), CreateIndex, ModifyIndex, Flags}
        self.kv_index = 1
        self.services: dict[str, Service] = {}
        self.service_index: dict[str, int] = {}  # service name → index of its last change
        self.catalog_index = 1
        #: session ID → {ID, Name, Behavior, TTL, LockDelay (ns), CreateIndex}; and when each TTL runs out.
        self.sessions: dict[str, dict[str, Any]] = {}
        self.session_deadlines: dict[str, float] = {}
        self.lock_delays: dict[str, float] = {}  # key → monotonic time before which it cannot be acquired
        if state_file is not None and state_file.exists():
            saved = json.loads(state_file.read_text())
            self.index = self.kv_index = self.catalog_index = int(saved["index"])
            for key, entry in saved["kv"].items():
                value = entry["Value"]
                self.kv[key] = {**entry, "Value": None if value is None else base64.b64decode(value)}
            for session in saved.get("sessions", ()):
                self.sessions[session["ID"]] = session
                self._renew_timer(session["ID"])

    # -- writes (caller holds the lock) ------------------------------------------------------------

    def bump(self) -> int:
        self.index += 1
        return self.index

    def save(self) -> None:
        if self.state_file is None:
            return
        kv = {
            key: {**entry, "Value": None if entry["Value"] is None else base64.b64encode(entry["Value"]).decode()}
            for key, entry in self.kv.items()
        }
        staging = self.state_file.with_suffix(".tmp")
        sessions = list(self.sessions.values())
        staging.write_text(json.dumps({"index": self.index, "kv": kv, "sessions": sessions}))
        staging.replace(self.state_file)

    def touch_service(self, name: str) -> None:
        self.service_index[name] = self.bump()

    def register(self, body: dict[str, Any]) -> Service:
        data = _lower_keys(body)
        name = data.get("name")
        if not name:
            raise ValueError("Missing service name")
        service_id = data.get("id") or name
        old = self.services.get(service_id)
        if old is not None:
            self._drop(old)
        index = self.bump()
        raw_checks = list(data.get("checks") or [])
        if data.get("check"):
            raw_checks.append(data["check"])
        service = Service(
            service_id=service_id,
            name=name,
            address=data.get("address") or "",
            port=int(data.get("port") or 0),
            tags=list(data.get("tags") or []),
            meta=dict(data.get("meta") or {}),
            create_index=old.create_index if old is not None else index,
            modify_index=index,
            checks=[],
        )
        for number, raw in enumerate(raw_checks, start=1):
            check = _lower_keys(raw)
            target = check.get("grpc")
            if not target:
                raise ValueError("only gRPC checks are emulated")
            host_port, _, grpc_service = target.partition("/")
            service.checks.append(
                Check(
                    check_id=check.get("checkid") or check.get("id") or f"service:{service_id}:{number}",
                    service_id=service_id,
                    service_name=name,
                    target=host_port,
                    grpc_service=grpc_service,
                    interval_s=parse_duration(check.get("interval"), 10.0),
                    timeout_s=parse_duration(check.get("timeout"), 10.0),
                    deregister_after_s=parse_duration(check.get("deregistercriticalserviceafter")) or None,
                    status=(check.get("status") or "critical").lower(),
                    output="initial status",
                    use_tls=bool(check.get("grpcusetls")),
                )
            )
            if service.checks[-1].status != "passing":
                service.checks[-1].critical_since = time.monotonic()
        self.services[service_id] = service
        self.touch_service(name)
        self.catalog_index = self.index
        self.changed.notify_all()
        return service

    def deregister(self, service_id: str) -> bool:
        service = self.services.pop(service_id, None)
        if service is None:
            return False
        self._drop(service)
        self.touch_service(service.name)
        self.catalog_index = self.index
        self.changed.notify_all()
        return True

    def _drop(self, service: Service) -> None:
        for check in service.checks:
            check.stop.set()

    def set_check(self, check: Check, status: str, output: str) -> None:
        service = self.services.get(check.service_id)
        if service is None or check not in service.checks:
            return
        check.output = output
        if status == check.status:
            return
        check.status = status
        check.critical_since = time.monotonic() if status == "critical" else None
        self.touch_service(check.service_name)
        self.changed.notify_all()

    def kv_put(
        self, key: str, value: bytes, cas: int | None, *, acquire: str | None = None, release: str | None = None
    ) -> bool:
        """Raises KeyError for an ``acquire``/``release`` session that does not exist (Consul: 500)."""
        existing = self.kv.get(key)
        if cas is not None:
            if cas == 0 and existing is not None:
                return False
            if cas != 0 and (existing is None or existing["ModifyIndex"] != cas):
                return False
        holder = existing.get("Session") if existing else None
        lock_index = existing.get("LockIndex", 0) if existing else 0
        for session in (acquire, release):
            if session is not None and session not in self.sessions:
                raise KeyError(session)
        if acquire is not None:
            if holder is not None and holder != acquire:
                return False
            if holder is None and time.monotonic() < self.lock_delays.get(key, 0.0):
                return False
            if holder is None:
                lock_index += 1
            holder = acquire
        elif release is not None:
            if holder != release:
                return False
            holder = None
        index = self.bump()
        self.kv[key] = {
            "Value": value,
            "CreateIndex": existing["CreateIndex"] if existing else index,
            "ModifyIndex": index,
            "LockIndex": lock_index,
            "Flags": 0,
        }
        if holder is not None:
            self.kv[key]["Session"] = holder
        self.kv_index = index
        self.save()
        self.changed.notify_all()
        return True

    # -- sessions (caller holds the lock) -------------------------------------------------------------

    def session_create(self, body: dict[str, Any]) -> str:
        """Raises ValueError with Consul's message for a bad TTL or behavior."""
        data = _lower_keys(body)
        behavior = (data.get("behavior") or "release").lower()
        if behavior not in {"release", "delete"}:
            raise ValueError(f"Invalid Behavior setting '{behavior}'")
        ttl = data.get("ttl") or ""
        if ttl and not 10 <= parse_duration(ttl) <= 86400:
            raise ValueError(f"Invalid Session TTL '{ttl}', must be between [10s=24h0m0s]")
        delay = data.get("lockdelay")
        delay_s = 15.0 if delay is None else parse_duration(delay) if isinstance(delay, str) else float(delay) / 1e9
        session_id = str(uuid.uuid4())
        self.sessions[session_id] = {
            "ID": session_id,
            "Name": data.get("name") or "",
            "Node": NODE,
            "Behavior": behavior,
            "TTL": ttl,
            "LockDelay": int(delay_s * 1e9),
            "CreateIndex": self.bump(),
        }
        self._renew_timer(session_id)
        self.save()
        return session_id

    def _renew_timer(self, session_id: str) -> None:
        ttl = self.sessions[session_id]["TTL"]
        if ttl:
            self.session_deadlines[session_id] = time.monotonic() + parse_duration(ttl)

    def session_renew(self, session_id: str) -> dict[str, Any] | None:
        if session_id not in self.sessions:
            return None
        self._renew_timer(session_id)
        return self.sessions[session_id]

    def session_destroy(self, session_id: str) -> None:
        """Invalidate: release (or delete) what it holds, and start each key's lock delay."""
        session = self.sessions.pop(session_id, None)
        self.session_deadlines.pop(session_id, None)
        if session is None:
            return
        held = [key for key, entry in self.kv.items() if entry.get("Session") == session_id]
        for key in held:
            if session["Behavior"] == "delete":
                del self.kv[key]
            else:
                del self.kv[key]["Session"]
                self.kv[key]["ModifyIndex"] = self.bump()
            if session["LockDelay"]:
                self.lock_delays[key] = time.monotonic() + session["LockDelay"] / 1e9
        self.kv_index = self.bump()
        self.save()
        self.changed.notify_all()

    def expire_sessions(self) -> list[str]:
        now = time.monotonic()
        expired = [sid for sid, deadline in self.session_deadlines.items() if deadline <= now]
        for session_id in expired:
            self.session_destroy(session_id)
        return expired

    def kv_delete(self, key: str, recurse: bool) -> None:
        keys = [k for k in self.kv if k.startswith(key)] if recurse else [key] if key in self.kv else []
        for k in keys:
            del self.kv[k]
        self.kv_index = self.bump()
        self.save()
        self.changed.notify_all()

    # -- reads (caller holds the lock): (index, status, body) --------------------------------------------

    def read_health(self, name: str, passing: bool) -> tuple[int, int, Any]:
        entries: list[dict[str, Any]] = []
        for service in self.services.values():
            if service.name != name:
                continue
            checks = [
                {
                    "Node": NODE,
                    "CheckID": "serfHealth",
                    "Name": "Serf Health Status",
                    "Status": "passing",
                    "Output": "Agent alive and reachable",
                    "ServiceID": "",
                    "ServiceName": "",
                    "Type": "",
                }
            ] + [
                {
                    "Node": NODE,
                    "CheckID": check.check_id,
                    "Name": f"Service '{name}' check",
                    "Status": check.status,
                    "Output": check.output,
                    "ServiceID": service.service_id,
                    "ServiceName": name,
                    "Type": "grpc",
                }
                for check in service.checks
            ]
            if passing and any(c["Status"] != "passing" for c in checks):
                continue
            entries.append(
                {
                    "Node": {"ID": "", "Node": NODE, "Address": NODE_ADDRESS, "Datacenter": "dc1", "Meta": {}},
                    "Service": {
                        "ID": service.service_id,
                        "Service": name,
                        "Tags": service.tags,
                        "Address": service.address,
                        "Meta": service.meta,
                        "Port": service.port,
                        "CreateIndex": service.create_index,
                        "ModifyIndex": service.modify_index,
                    },
                    "Checks": checks,
                }
            )
        entries.sort(key=lambda e: e["Service"]["ID"])
        return self.service_index.get(name, self.catalog_index), 200, entries

    def read_catalog(self) -> tuple[int, int, Any]:
        services: dict[str, list[str]] = {"consul": []}
        for service in self.services.values():
            tags = services.setdefault(service.name, [])
            tags.extend(t for t in service.tags if t not in tags)
        return self.catalog_index, 200, services

    def read_kv(self, key: str, recurse: bool) -> tuple[int, int, Any]:
        keys = sorted(k for k in self.kv if k.startswith(key)) if recurse else [key] if key in self.kv else []
        if not keys:
            return self.kv_index, 404, None
        entries = []
        for k in keys:
            entry = self.kv[k]
            value = entry["Value"]
            entries.append(
                {
                    "Key": k,
                    "Value": None if value is None else base64.b64encode(value).decode(),
                    "CreateIndex": entry["CreateIndex"],
                    "ModifyIndex": entry["ModifyIndex"],
                    "LockIndex": entry.get("LockIndex", 0),
                    "Flags": entry["Flags"],
                }
            )
            if entry.get("Session"):
                entries[-1]["Session"] = entry["Session"]
        index = self.kv_index if recurse else max(e["ModifyIndex"] for e in entries)
        return index, 200, entries

    def agent_services(self) -> dict[str, Any]:
        return {
            s.service_id: {
                "ID": s.service_id,
                "Service": s.name,
                "Tags": s.tags,
                "Meta": s.meta,
                "Port": s.port,
                "Address": s.address,
                "Datacenter": "dc1",
            }
            for s in self.services.values()
        }


class Checker:
    """Runs each registered gRPC check in its own thread, as the agent does."""

    def __init__(self, state: State, tls: tuple[str, str, str] | None = None) -> None:
        self.state = state
        self.tls = tls  # (ca, cert, key): the agent's outgoing TLS, for GRPCUseTLS checks

    def start(self, check: Check) -> None:
        threading.Thread(target=self._run, args=(check,), name=f"check-{check.check_id}", daemon=True).start()

    def _run(self, check: Check) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
        if check.use_tls:
            ca, cert, key = self.tls or ("", "", "")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=Path(ca).read_bytes() if ca else None,
                private_key=Path(key).read_bytes() if key else None,
                certificate_chain=Path(cert).read_bytes() if cert else None,
            )
            channel = grpc.secure_channel(check.target, credentials, options=options)
        else:
            channel = grpc.insecure_channel(check.target, options=options)
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not check.stop.is_set():
                try:
                    answer = stub.Check(
                        health_pb2.HealthCheckRequest(service=check.grpc_service), timeout=check.timeout_s
                    )
                    serving = answer.status == health_pb2.HealthCheckResponse.SERVING
                    status = "passing" if serving else "critical"
                    name = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
                    output = f"gRPC check {check.target}/{check.grpc_service}: {name}"
                except grpc.RpcError as error:
                    status, output = "critical", f"gRPC check {check.target}: {error.code().name} {error.details()}"
                with self.state.lock:
                    self.state.set_check(check, status, output)
                    expired = (
                        check.deregister_after_s is not None
                        and check.critical_since is not None
                        and time.monotonic() - check.critical_since >= check.deregister_after_s
                    )
                    if expired and check.service_id in self.state.services:
                        self.state.deregister(check.service_id)
                        print(f"deregistered {check.service_id}: critical for {check.deregister_after_s}s", flush=True)
                        return
                check.stop.wait(check.interval_s)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: EmulatorServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any, index: int | None = None, *, raw: bool = False) -> None:
        payload = body if raw else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if raw else "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if index is not None:
            self.send_header("X-Consul-Index", str(index))
            self.send_header("X-Consul-KnownLeader", "true")
        self.end_headers()
        self.wfile.write(payload)

    def _parse(self) -> tuple[str, dict[str, str], bytes]:
        url = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        return urllib.parse.unquote(url.path), query, body

    def _authorized(self) -> bool:
        if "token" in urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query):
            print(f"token in query string: {self.command} {urllib.parse.urlsplit(self.path).path}", flush=True)
        token = self.server.token
        if token and self.headers.get("X-Consul-Token") != token:
            self._send(403, b"Permission denied", raw=True)
            return False
        return True

    def do_GET(self) -> None:
        path, query, _ = self._parse()
        if path == "/v1/status/leader":  # needs no token in Consul either
            self._send(200, "127.0.0.1:8300")
            return
        if not self._authorized():
            return
        state = self.server.state
        if path == "/v1/agent/services":
            with state.lock:
                self._send(200, state.agent_services())
            return
        if path.startswith("/v1/health/service/"):
            name = path[len("/v1/health/service/") :]
            passing = "passing" in query and query["passing"].lower() not in {"0", "false"}
            self._blocking(query, lambda: state.read_health(name, passing))
            return
        if path == "/v1/catalog/services":
            self._blocking(query, state.read_catalog)
            return
        if path.startswith("/v1/kv/"):
            key = path[len("/v1/kv/") :]
            self._blocking(query, lambda: state.read_kv(key, "recurse" in query))
            return
        if path.startswith("/v1/session/info/"):
            with state.lock:
                session = state.sessions.get(path[len("/v1/session/info/") :])
                self._send(200, [session] if session else None, state.index)
            return
        self._send(404, b"unsupported by the emulator", raw=True)

    def _blocking(self, query: dict[str, str], read: Any) -> None:
        state = self.server.state
        wanted = int(query.get("index") or 0)
        wait_s = min(parse_duration(query.get("wait"), DEFAULT_WAIT_S), MAX_WAIT_S)
        deadline = time.monotonic() + wait_s
        with state.lock:
            index, status, body = read()
            while wanted and index <= wanted:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                state.changed.wait(remaining)
                index, status, body = read()
        if status == 404:
            self._send(404, b"", index, raw=True)
        else:
            self._send(status, body, index)

    def do_PUT(self) -> None:
        path, query, body = self._parse()
        if not self._authorized():
            return
        state = self.server.state
        if path == "/v1/agent/service/register":
            try:
                payload = json.loads(body or b"{}")
                with state.lock:
                    service = state.register(payload)
            except (ValueError, TypeError) as error:
                self._send(400, str(error).encode(), raw=True)
                return
            for check in service.checks:
                self.server.checker.start(check)
            self._send(200, b"", raw=True)
            return
        if path.startswith("/v1/agent/service/deregister/"):
            service_id = path[len("/v1/agent/service/deregister/") :]
            with state.lock:
                found = state.deregister(service_id)
            if found:
                self._send(200, b"", raw=True)
            else:
                self._send(404, f'Unknown service ID "{service_id}"'.encode(), raw=True)
            return
        if path.startswith("/v1/kv/"):
            key = path[len("/v1/kv/") :]
            cas = int(query["cas"]) if "cas" in query else None
            try:
                with state.lock:
                    done = state.kv_put(key, body, cas, acquire=query.get("acquire"), release=query.get("release"))
            except KeyError:
                self._send(500, b"invalid session", raw=True)
                return
            self._send(200, done)
            return
        if path == "/v1/session/create":
            try:
                with state.lock:
                    session_id = state.session_create(json.loads(body or b"{}"))
            except (ValueError, TypeError) as error:
                self._send(400, str(error).encode(), raw=True)
                return
            self._send(200, {"ID": session_id})
            return
        if path.startswith("/v1/session/renew/"):
            session_id = path[len("/v1/session/renew/") :]
            with state.lock:
                session = state.session_renew(session_id)
            if session is None:
                self._send(404, f"Session id '{session_id}' not found".encode(), raw=True)
            else:
                self._send(200, [session])
            return
        if path.startswith("/v1/session/destroy/"):
            with state.lock:
                state.session_destroy(path[len("/v1/session/destroy/") :])
            self._send(200, True)
            return
        self._send(404, b"unsupported by the emulator", raw=True)

    def do_DELETE(self) -> None:
        path, query, _ = self._parse()
        if not self._authorized():
            return
        if path.startswith("/v1/kv/"):
            with self.server.state.lock:
                self.server.state.kv_delete(path[len("/v1/kv/") :], "recurse" in query)
            self._send(200, True)
            return
        self._send(404, b"unsupported by the emulator", raw=True)


class EmulatorServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, state: State, token: str, tls: tuple[str, str, str] | None = None) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.state = state
        self.checker = Checker(state, tls)
        self.token = token
        if tls is not None:
            import ssl

            ca, cert, key = tls
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            if ca:
                context.load_verify_locations(cafile=ca)
                context.verify_mode = ssl.CERT_REQUIRED
            # The handshake happens in the request's thread, so a silent client never stalls accept().
            self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A refused TLS handshake is a line, not a traceback (Consul logs one line too)."""
        print(f"connection from {client_address} failed: {sys.exc_info()[1]}", flush=True)


def _reap_sessions(state: State) -> None:
    """Invalidate the sessions whose TTL ran out without a renewal."""
    while True:
        time.sleep(0.1)
        with state.lock:
            for session_id in state.expire_sessions():
                print(f"session {session_id} invalidated: its TTL ran out", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Consul HTTP API emulator (a test double)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state-file", type=Path, default=None, help="where KV and the index survive a restart")
    parser.add_argument("--token", default="", help="require this ACL token on every request")
    parser.add_argument("--tls-cert", default="", help="serve HTTPS only, with this certificate")
    parser.add_argument("--tls-key", default="", help="private key of --tls-cert")
    parser.add_argument("--tls-ca", default="", help="require client certificates from this CA (verify_incoming)")
    args = parser.parse_args(argv)
    tls = (args.tls_ca, args.tls_cert, args.tls_key) if args.tls_cert else None
    server = EmulatorServer(args.port, State(args.state_file), args.token, tls)
    threading.Thread(target=_reap_sessions, args=(server.state,), name="session-reaper", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # an agent killed mid-query: connections just drop
    print(f"consul emulator listening on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()
    return 0


# -- the test-side handle -------------------------------------------------------------------------------


class ConsulEmulator:
    """Starts the emulator as a separate process on a free port; stop and start again on the same port.

    ``spec`` is the registry spec (``consul://127.0.0.1:PORT``) for routers, workers and the CLI.
    """

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        token: str = "",
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        """``tls``: (CA, certificate, key): HTTPS only, client certificates from the CA required."""
        from tests.harness import free_port

        self.tls = tls
        directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.token = token
        self.state_file = directory / f"consul-{self.port}.json"
        self.log_path = directory / f"consul-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def spec(self) -> str:
        return f"consul://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for processes using it (the standard token variable). With TLS, the standard
        HTTPS variables too; the client certificate is the emulator's own (issued for client use too)."""
        env = {"CONSUL_HTTP_TOKEN": self.token} if self.token else {}
        if self.tls is not None:
            ca, cert, key = self.tls
            env |= {
                "CONSUL_HTTP_SSL": "true",
                "CONSUL_CACERT": str(ca),
                "CONSUL_CLIENT_CERT": str(cert),
                "CONSUL_CLIENT_KEY": str(key),
            }
        return env

    def start(self, timeout_s: float = 15.0) -> ConsulEmulator:
        from tests.harness import ROOT

        args = [sys.executable, "-m", "tests.consul_emulator", "--port", str(self.port)]
        args += ["--state-file", str(self.state_file)]
        if self.token:
            args += ["--token", self.token]
        if self.tls is not None:
            args += ["--tls-ca", str(self.tls[0]), "--tls-cert", str(self.tls[1]), "--tls-key", str(self.tls[2])]
        with open(self.log_path, "ab") as log:
            self.process = launcher.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"consul emulator exited with {self.process.returncode}:\n{self.log()}")
            try:
                self.client(timeout_s=1).status.leader()
                return self
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"consul emulator did not answer within {timeout_s}s:\n{self.log()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill it; KV (and the index) come back on the next start, registered services do not."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)
        self.process = None

    @contextmanager
    def stopped(self) -> Iterator[None]:
        self.stop()
        try:
            yield
        finally:
            self.start()

    def client(self, timeout_s: float = 10.0) -> Any:
        import consul

        if self.tls is None:
            return consul.Consul(
                host="127.0.0.1", port=self.port, token=self.token or None, connections_timeout=timeout_s
            )
        ca, cert, key = self.tls
        return consul.Consul(
            host="127.0.0.1",
            port=self.port,
            scheme="https",
            verify=str(ca),
            cert=(str(cert), str(key)),
            token=self.token or None,
            connections_timeout=timeout_s,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> ConsulEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    raise SystemExit(main())
