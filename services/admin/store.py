"""What the admin CLI reads from and writes to a registry, for either backend.

A write replaces one model's experiment in one atomic step — a single KV put
(check-and-set on the ModifyIndex read) or a rename of a fully written file —
and only after the whole new experiment validated, so nothing is ever
half-applied. A write whose base changed since it was read fails with
:class:`Conflict` instead of overwriting someone else's change.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitstream.admin.yaml_edit import EditError, edit_experiment
from splitstream.common.errors import ConfigError
from splitstream.common.experiment import Experiment
from splitstream.common.files import atomic_write
from splitstream.common.registry import parse_registry
from splitstream.common.registry.consul import (
    ConsulAddress,
    consul_errors,
    decode_experiment,
    decode_instance,
    default_experiment,
    describe_error,
    encode_experiment,
    experiment_key,
    parse_consul_spec,
    service_name,
)
from splitstream.common.tls import PLAINTEXT, ClientTls


class AdminError(Exception):
    """The registry cannot be read or written (unreachable, corrupt, changed meanwhile): exit 1."""


class Invalid(Exception):
    """The operator asked for something the registry refuses (bad weights, unknown version): exit 2."""


class Conflict(AdminError):
    """The experiment changed between our read and our write."""


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    version: str
    address: str
    health: str  # passing / critical / warning (Consul), serving / not_serving / unreachable (file: probed)
    engine_tag: str = ""
    backend: str = ""
    precision: str = ""


@dataclass(frozen=True, kw_only=True)
class ModelView:
    model: str
    #: The experiment the registry holds; None if there is none or it is invalid (see ``problem``).
    stored: Experiment | None
    #: Why the stored experiment cannot be used ("" when it can or there is none).
    problem: str
    #: What routers follow: ``stored``, else the backend's default rule (None: nothing to route).
    effective: Experiment | None
    endpoints: tuple[Endpoint, ...]
    #: Opaque token for :meth:`Store.write`'s check-and-set.
    revision: Any

    @property
    def versions(self) -> list[str]:
        """Versions with at least one registered endpoint (healthy or not)."""
        return sorted({e.version for e in self.endpoints})


class Store(Protocol):
    description: str

    def read(self, model: str, *, probe_health: bool = False) -> ModelView: ...

    def write(self, model: str, experiment: Experiment, revision: Any) -> None: ...


def open_store(spec: str, *, tls: ClientTls = PLAINTEXT) -> Store:
    """``file:PATH`` or ``consul://HOST:PORT``; raises Invalid for anything else. ``tls``: how the
    workers' health is probed (the TLS the routers use to reach them)."""
    scheme, _, location = spec.partition(":")
    if scheme == "file" and location:
        return FileStore(Path(location), tls=tls)
    if scheme == "consul":
        try:
            return ConsulStore(parse_consul_spec(spec))
        except ValueError as error:
            raise Invalid(str(error)) from None
    raise Invalid(f"unknown registry '{spec}' (expected file:PATH or consul://HOST:PORT)")


def check_versions_exist(view: ModelView, experiment: Experiment) -> None:
    """Every version that takes traffic (weight > 0), the control and every shadow must have an endpoint."""
    known = set(view.versions)
    named = [a.version for a in experiment.arms if a.weight > 0]
    named += [experiment.control, *(s.version for s in experiment.shadows)]
    unknown = sorted({v for v in named if v not in known})
    if unknown:
        listed = ", ".join(view.versions) or "none"
        raise Invalid(
            f"model '{view.model}' has no endpoint of version(s) {', '.join(unknown)} (registered: {listed}); "
            "start and register its workers first"
        )


# -- file ----------------------------------------------------------------------------------------------


class FileStore:
    def __init__(self, path: Path, *, tls: ClientTls = PLAINTEXT) -> None:
        self.path = path
        self.tls = tls
        self.description = f"file:{path}"

    def _load(self) -> tuple[str, Any]:
        try:
            text = self.path.read_text()
        except OSError as error:
            raise AdminError(f"{self.path}: {error.strerror or error}") from None
        try:
            data = yaml.safe_load(text)
            parse_registry(data, source=str(self.path))
        except (ConfigError, yaml.YAMLError) as error:
            raise AdminError(f"registry file is invalid, fix it first: {error}") from None
        return text, data

    def read(self, model: str, *, probe_health: bool = False) -> ModelView:
        text, data = self._load()
        state = parse_registry(data, source=str(self.path))
        entry = state.models.get(model)
        if entry is None:
            raise Invalid(
                f"model '{model}' is not in {self.path} (models: {', '.join(sorted(state.models)) or 'none'})"
            )
        raw = (data.get("models") or {}).get(model) or {}
        stored = entry.experiment if raw.get("experiment") is not None else None
        pairs = [(version, address) for version, addresses in entry.endpoints.items() for address in addresses]
        health = _probe((a for _, a in pairs), tls=self.tls) if probe_health else {}
        endpoints = tuple(Endpoint(version=v, address=a, health=health.get(a, "")) for v, a in pairs)
        return ModelView(
            model=model,
            stored=stored,
            problem="",
            effective=entry.experiment,
            endpoints=endpoints,
            revision=hashlib.sha256(text.encode()).hexdigest(),
        )

    def write(self, model: str, experiment: Experiment, revision: Any) -> None:
        text, data = self._load()
        if hashlib.sha256(text.encode()).hexdigest() != revision:
            raise Conflict(f"{self.path} changed since it was read; nothing written, try again")
        data["models"][model]["experiment"] = experiment.to_mapping()
        try:  # an experiment the routers would refuse is the user's mistake: say what is wrong with it
            parse_registry(data, source=str(self.path))
        except ConfigError as error:
            raise Invalid(str(error)) from None
        # Only the experiment's changed lines change: comments, order and style stay as the operator wrote them.
        try:
            edited = edit_experiment(text, model, experiment)
        except EditError as error:
            raise AdminError(f"{self.path}: {error}; nothing written") from None
        # Readers see the old or the new file, whole, even after a crash (see atomic_write).
        try:  # through a link, to its target: a link replaced by a copy would part from what it linked to
            atomic_write(os.path.realpath(self.path), edited, mode=self.path.stat().st_mode & 0o777)
        except OSError as error:  # a full disk, a read-only directory: the old file stays, whole
            raise AdminError(f"{self.path}: cannot write: {error.strerror or error}; nothing written") from None


def _probe(addresses: Any, timeout_s: float = 1.0, *, tls: ClientTls = PLAINTEXT) -> dict[str, str]:
    """grpc.health.v1 Check on each address, concurrently."""

    def check(address: str) -> str:
        try:
            with tls.channel(address) as channel:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return "unreachable"
        return "serving" if answer.status == health_pb2.HealthCheckResponse.SERVING else "not_serving"

    unique = sorted(set(addresses))
    if not unique:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(unique))) as pool:
        return dict(zip(unique, pool.map(check, unique), strict=True))


# -- consul --------------------------------------------------------------------------------------------


class ConsulStore:
    def __init__(self, address: ConsulAddress) -> None:
        self.address = address
        self.description = address.description

    def _fail(self, error: BaseException) -> AdminError:
        return AdminError(f"{self.description}: {describe_error(error)}")

    def read(self, model: str, *, probe_health: bool = False) -> ModelView:
        client = self.address.client()
        try:
            _, entry = client.kv.get(experiment_key(model))
            _, instances = client.health.service(service_name(model))
        except consul_errors() as error:
            raise self._fail(error) from None
        decoded = [i for i in (decode_instance(model, e) for e in instances or ()) if i is not None]
        endpoints = tuple(
            Endpoint(
                version=i.version,
                address=i.address,
                health=i.status,
                engine_tag=i.engine_tag,
                backend=i.backend,
                precision=i.precision,
            )
            for i in sorted(decoded, key=lambda i: (i.version, i.address))
        )
        if entry is None and not endpoints:
            raise Invalid(
                f"model '{model}' has no instance of service {service_name(model)} and no experiment at "
                f"{experiment_key(model)} in {self.description}"
            )
        stored, problem = None, ""
        if entry is not None:
            try:
                stored = decode_experiment(model, entry.get("Value"))
            except ConfigError as error:
                problem = str(error)
        passing = [e.version for e in endpoints if e.health == "passing"]
        effective = stored if stored is not None else default_experiment(model, passing)
        revision = int(entry["ModifyIndex"]) if entry is not None else 0
        return ModelView(
            model=model, stored=stored, problem=problem, effective=effective, endpoints=endpoints, revision=revision
        )

    def write(self, model: str, experiment: Experiment, revision: Any) -> None:
        client = self.address.client()
        try:
            done = client.kv.put(experiment_key(model), encode_experiment(experiment), cas=int(revision))
        except consul_errors() as error:
            raise self._fail(error) from None
        if not done:
            raise Conflict(f"{experiment_key(model)} changed since it was read; nothing written, try again")


def weights_text(experiment: Experiment) -> str:
    """``v1 90 %, v2 10 % (control v1)``."""
    arms = ", ".join(f"{a.version} {a.weight:g} %" for a in experiment.arms)
    return f"{arms} (control {experiment.control})"
