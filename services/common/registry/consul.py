"""The ``consul`` registry backend: workers register in Consul, routers watch it.

Layout in Consul (ARCHITECTURE.md, Registry):

- Each worker is one instance of service ``splitstream-<model>``, with meta
  ``version``, ``engine_tag``, ``backend``, ``precision`` (the first two also as
  tags) and a gRPC health check against its grpc.health.v1 service.
- Each model's experiment is JSON in KV ``splitstream/experiments/<model>``, the
  same mapping as the file backend's ``experiment:`` block
  (:meth:`Experiment.from_mapping` / :meth:`Experiment.to_mapping`).

A router watches with blocking queries (``index`` + ``wait``): the catalog's
service list (to discover models), each model's *passing* instances, and the
experiments prefix. A change reaches the router as soon as Consul answers the
query it holds open, well within a second.

Rules a router follows (one place, so every router derives the same table):

- A model's endpoints are its passing instances, grouped by meta ``version``.
- An instance with meta ``protocol: openai`` is an OpenAI-compatible HTTP server, not a gRPC worker:
  its endpoint is the base URL ``{scheme}://{address}:{port}{base_path}`` (meta ``scheme``, default
  ``http``; ``base_path``, default ``/v1``) and meta ``openai_model``, ``api_key_file`` or
  ``api_key_env`` say what the file registry's ``openai:`` mapping says. A version with any such
  instance is an ``openai`` version (its gRPC instances, if any, are left out, with a warning); an
  instance whose meta does not make a valid base URL is left out, with a warning naming it.
- No experiment key: one version → it takes 100 %; several versions → the
  lowest version in natural order (``v2`` < ``v10``) takes 100 % and the others
  are reachable only by pin, until an experiment says otherwise. New versions
  therefore get no traffic until someone gives them some (:func:`default_experiment`).
- An experiment that is not JSON or fails validation is never applied: the
  model keeps the last good experiment this router read (or the default rule if
  it never read one), and the update carries the error.
- Consul listing no passing instance at all for a model keeps the model's last
  endpoints: an empty list is far more often a Consul restart or a check blip
  than every worker gone, and the router's own health watch takes endpoints
  that are really gone out of rotation.
- Consul unreachable: the router keeps its last state and gets an error update;
  each query retries with capped exponential backoff.
- A model leaves the routers only on purpose: its experiment key set to
  ``{"remove": true}`` (:data:`REMOVAL_VALUE`). Its workers all deregistering is
  an outage, not a removal (the last endpoints stay), and any state that would
  drop a serving model otherwise is refused (:mod:`splitstream.common.registry.removal`).
- Nothing an answer holds can end the watch: an exception while reading one is
  logged and becomes an error update, and the queries go on.

py-consul's client is synchronous (requests). Every call runs in its own daemon
thread (:func:`run_blocking`), so a blocking query held open never occupies the
event loop or the default executor, and never delays process exit.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from splitstream.common.addresses import check_base_url

# consul_errors and parse_consul_spec: imported from here by the registry's callers (the admin CLI).
from splitstream.common.consul_agent import (  # noqa: F401
    SERVICE_PREFIX,
    ConsulAddress,
    consul_errors,
    describe_error,
    parse_consul_spec,
    run_blocking,
    service_name,
)
from splitstream.common.errors import ConfigError
from splitstream.common.experiment import Experiment
from splitstream.common.names import check_model_name
from splitstream.common.registry.base import ModelEntry, OpenAIUpstream, RegistryState, RegistryUpdate
from splitstream.common.registry.removal import RemovalGuard

if TYPE_CHECKING:
    import consul

log = structlog.get_logger()

EXPERIMENT_PREFIX = "splitstream/experiments/"


def experiment_key(model: str) -> str:
    return EXPERIMENT_PREFIX + model


# -- decoding ----------------------------------------------------------------------------------------


def natural_key(version: str) -> tuple[Any, ...]:
    """Sort key putting ``v2`` before ``v10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", version))


def default_experiment(model: str, versions: Iterable[str]) -> Experiment | None:
    """The experiment of a model with no experiment key: the lowest version takes 100 %; None without versions."""
    ordered = sorted(set(versions), key=natural_key)
    if not ordered:
        return None
    control = ordered[0]
    return Experiment.build(
        model=model, salt=model, control=control, arms=[(v, 100 if v == control else 0) for v in ordered]
    )


def decode_experiment(model: str, value: bytes | None) -> Experiment:
    """Parse a KV value; raises ConfigError naming the key and what is wrong."""
    where = f"experiment at {experiment_key(model)}"
    if value is None:
        raise ConfigError(f"{where}: the key has no value")
    try:
        data = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{where} is not valid JSON: {error}") from None
    try:
        return Experiment.from_mapping(model, data)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


#: The experiment value that takes a model out of every router on purpose (docs/rollouts.md, Hot swap and rollouts).
REMOVAL_VALUE = {"remove": True}
HOW_TO_REMOVE = f"to remove a model on purpose, set its experiment key to {json.dumps(REMOVAL_VALUE)}"


def is_removal(value: bytes | None) -> bool:
    """True when a KV value is exactly :data:`REMOVAL_VALUE` (anything else is read as an experiment)."""
    try:
        return value is not None and json.loads(value) == REMOVAL_VALUE
    except ValueError:  # not JSON (or not UTF-8): an invalid experiment, reported as such elsewhere
        return False


def encode_experiment(experiment: Experiment) -> str:
    return json.dumps(experiment.to_mapping(), sort_keys=True)


@dataclass(frozen=True, kw_only=True)
class Instance:
    """One registered worker as a health query returns it."""

    service_id: str
    model: str
    version: str
    address: str  # host:port
    status: str  # passing, warning or critical: the worst of its checks
    engine_tag: str = ""
    backend: str = ""
    precision: str = ""
    #: Set for an OpenAI-compatible HTTP server (meta ``protocol: openai``); ``address`` is then its base URL.
    upstream: OpenAIUpstream | None = None


#: Meta ``protocol`` of an instance that is an OpenAI-compatible HTTP server (absent: a gRPC worker).
OPENAI_PROTOCOL = "openai"


def _openai_instance(service_id: str, address: str, meta: Mapping[str, Any]) -> tuple[str, OpenAIUpstream] | None:
    """The base URL and settings of an ``openai`` instance; None (logged) when its meta cannot make them."""
    scheme = str(meta.get("scheme") or "http")
    base_path = str(meta.get("base_path") or "/v1")
    key_file, key_env = meta.get("api_key_file") or None, meta.get("api_key_env") or None
    try:
        url = check_base_url(f"{scheme}://{address}{base_path if base_path.startswith('/') else '/' + base_path}")
        if key_file is not None and key_env is not None:
            raise ValueError("name the API key with api_key_file or api_key_env, not both")
    except ValueError as error:
        log.warning("consul instance left out: its openai meta is invalid", service_id=service_id, problem=str(error))
        return None
    model = meta.get("openai_model") or None
    return url, OpenAIUpstream(
        model=None if model is None else str(model),
        api_key_file=None if key_file is None else str(key_file),
        api_key_env=None if key_env is None else str(key_env),
    )


def decode_instance(model: str, entry: Mapping[str, Any]) -> Instance | None:
    """An entry of ``/v1/health/service/<name>``; None when it carries no version (not ours)."""
    service = entry.get("Service") or {}
    meta = service.get("Meta") or {}
    version = meta.get("version")
    port = service.get("Port")
    host = service.get("Address") or (entry.get("Node") or {}).get("Address")
    if not version or not host or not port:
        return None
    statuses = [check.get("Status", "critical") for check in entry.get("Checks") or ()]
    status = "passing"
    for worse in ("warning", "critical", "maintenance"):
        if worse in statuses:
            status = "critical" if worse == "maintenance" else worse
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    upstream = None
    if meta.get("protocol") == OPENAI_PROTOCOL:
        found = _openai_instance(str(service.get("ID", "")), address, meta)
        if found is None:
            return None
        address, upstream = found
    return Instance(
        service_id=str(service.get("ID", "")),
        model=model,
        version=str(version),
        address=address,
        upstream=upstream,
        status=status,
        engine_tag=str(meta.get("engine_tag", "")),
        backend=str(meta.get("backend", "")),
        precision=str(meta.get("precision", "")),
    )


def group_endpoints(instances: Iterable[Instance]) -> dict[str, tuple[str, ...]]:
    """version → sorted addresses."""
    grouped: dict[str, set[str]] = {}
    for instance in instances:
        grouped.setdefault(instance.version, set()).add(instance.address)
    return {version: tuple(sorted(addresses)) for version, addresses in sorted(grouped.items())}


def group_versions(instances: Iterable[Instance]) -> tuple[dict[str, tuple[str, ...]], dict[str, OpenAIUpstream]]:
    """version → sorted endpoints, and version → upstream settings for the ``openai`` versions (the settings
    of the instance with the lowest base URL; a version's gRPC instances are left out once it has one)."""
    instances = sorted(instances, key=lambda instance: instance.address)
    upstreams: dict[str, OpenAIUpstream] = {}
    for instance in instances:
        if instance.upstream is not None:
            upstreams.setdefault(instance.version, instance.upstream)
    mixed = sorted({i.service_id for i in instances if i.upstream is None and i.version in upstreams})
    if mixed:
        log.warning("consul instances left out: gRPC workers in a version of openai upstreams", service_ids=mixed)
    kept = [i for i in instances if (i.upstream is not None) == (i.version in upstreams)]
    return group_endpoints(kept), upstreams


def model_of_service(name: str) -> str | None:
    if not name.startswith(SERVICE_PREFIX):
        return None
    model = name[len(SERVICE_PREFIX) :]
    try:
        check_model_name(model)
    except ValueError:
        return None
    return model


# -- the router's watch ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WatchSettings:
    #: How long Consul may hold a blocking query open (it answers at once on a change).
    wait_s: float = 5.0
    #: First retry delay after a failed query; doubles up to ``retry_max_s`` (±20 % jitter).
    retry_min_s: float = 0.2
    retry_max_s: float = 2.0


class ConsulRegistry:
    """Registry backend for routers: :meth:`watch` yields a state whenever Consul's answer changes it."""

    def __init__(self, address: ConsulAddress, settings: WatchSettings | None = None) -> None:
        self.address = address
        self.settings = settings or WatchSettings()
        self.description = address.description
        # The registry's, not one watch's: a watch the router restarts must still refuse dropping a
        # serving model, so the last accepted state outlives the watch that accepted it.
        self._guard = RemovalGuard(how_to_remove=HOW_TO_REMOVE)

    async def watch(self) -> AsyncIterator[RegistryUpdate]:
        session = _WatchSession(self.address, self.settings, self._guard)
        try:
            async for update in session.updates():
                yield update
        finally:
            session.close()


class _WatchSession:
    """Blocking-query loops that fill in the latest answers, and one generator that turns them into updates."""

    def __init__(self, address: ConsulAddress, settings: WatchSettings, guard: RemovalGuard) -> None:
        self.address = address
        self.settings = settings
        self.changed = asyncio.Event()
        self.pending: set[str] = {"catalog", "kv"}  # sources that have not answered yet
        self.errors: dict[str, str] = {}
        self.instances: dict[str, list[Instance]] = {}
        self.experiment_values: dict[str, bytes | None] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        # Kept across answers, per model: last good experiment (and the value it came from), last endpoints.
        self.good_experiments: dict[str, tuple[bytes | None, Experiment]] = {}
        self.last_endpoints: dict[str, dict[str, tuple[str, ...]]] = {}
        self.last_upstreams: dict[str, dict[str, OpenAIUpstream]] = {}
        self.defaulted: frozenset[str] = frozenset()
        self.guard = guard

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()

    async def updates(self) -> AsyncIterator[RegistryUpdate]:
        self._start("catalog", self._fetch_catalog, self._on_catalog)
        self._start("kv", self._fetch_experiments, self._on_experiments)
        last: RegistryUpdate | None = None
        while True:
            await self.changed.wait()
            self.changed.clear()
            if self.errors:
                update = RegistryUpdate(error=f"Consul query failed: {sorted(set(self.errors.values()))[0]}")
            elif self.pending:
                continue
            else:
                update = self._update()
            if update != last:
                last = update
                yield update

    def _update(self) -> RegistryUpdate:
        """The update the latest answers make; never raises (a watch that died would freeze the router)."""
        try:
            state, problems, removed = self._state()
        except Exception as error:  # a bug or an answer no check foresaw: report it, keep watching
            log.exception("consul answers could not be turned into a state; keeping the last good one")
            return RegistryUpdate(error=f"Consul answers could not be read ({type(error).__name__}: {error})")
        refused = self.guard.check(state, removable=removed)
        if refused is not None:
            return RegistryUpdate(error=f"Consul state {refused}")
        self.guard.accept(state)
        return RegistryUpdate(state=state, error="; ".join(problems) or None)

    # -- the queries, each in its own loop ----------------------------------------------------------

    def _start(self, source: str, fetch: Callable[[consul.Consul, int], Any], apply: Callable[[Any], None]) -> None:
        self.pending.add(source)
        self.tasks[source] = asyncio.create_task(self._poll(source, fetch, apply), name=f"consul-watch-{source}")

    def _stop(self, source: str) -> None:
        task = self.tasks.pop(source, None)
        if task is not None:
            task.cancel()
        self.pending.discard(source)
        self.errors.pop(source, None)

    async def _poll(
        self, source: str, fetch: Callable[[consul.Consul, int], Any], apply: Callable[[Any], None]
    ) -> None:
        client = self.address.client()
        index = 0
        delay = self.settings.retry_min_s
        while True:
            try:
                new_index, data = await run_blocking(functools.partial(fetch, client, index))
            except Exception as error:  # consul_errors(), and anything a garbled answer makes the client raise
                reason = describe_error(error)
                if self.errors.get(source) != reason:
                    log.warning("consul query failed; retrying", source=source, error=reason)
                self.errors[source] = reason
                self.changed.set()
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self.settings.retry_max_s)
                continue
            delay = self.settings.retry_min_s
            if self.errors.pop(source, None) is not None:
                log.info("consul query answered again", source=source)
            new = int(new_index)
            # Consul's advice: an index that went backwards (a restored or rebuilt cluster) restarts
            # the watch from 0; one that is not positive is taken as 1.
            index = 0 if new < index else max(new, 1)
            self.pending.discard(source)
            try:
                apply(data)
            except Exception as error:  # an answer no check foresaw: report it; the next answer may mend it
                log.exception("consul answer could not be read", source=source)
                self.errors[source] = f"answer of {source} could not be read ({type(error).__name__}: {error})"
            self.changed.set()

    def _wait(self) -> str:
        return f"{self.settings.wait_s:g}s"

    def _fetch_catalog(self, client: consul.Consul, index: int) -> Any:
        return client.catalog.services(index=index or None, wait=self._wait())

    def _fetch_experiments(self, client: consul.Consul, index: int) -> Any:
        return client.kv.get(EXPERIMENT_PREFIX, recurse=True, index=index or None, wait=self._wait())

    def _fetch_instances(self, model: str) -> Callable[[consul.Consul, int], Any]:
        def fetch(client: consul.Consul, index: int) -> Any:
            return client.health.service(service_name(model), passing=True, index=index or None, wait=self._wait())

        return fetch

    def _on_catalog(self, services: Mapping[str, Any] | None) -> None:
        models = {m for m in map(model_of_service, services or {}) if m is not None}
        watched = {source.partition(":")[2] for source in self.tasks if source.startswith("instances:")}
        for model in sorted(models - watched):
            self._start(f"instances:{model}", self._fetch_instances(model), self._instances_setter(model))
        for model in watched - models:
            self._stop(f"instances:{model}")
            self.instances.pop(model, None)

    def _instances_setter(self, model: str) -> Callable[[Any], None]:
        def apply(entries: Sequence[Mapping[str, Any]] | None) -> None:
            decoded = (decode_instance(model, entry) for entry in entries or ())
            self.instances[model] = [i for i in decoded if i is not None]

        return apply

    def _on_experiments(self, entries: Sequence[Mapping[str, Any]] | None) -> None:
        values: dict[str, bytes | None] = {}
        for entry in entries or ():
            model = str(entry.get("Key", ""))[len(EXPERIMENT_PREFIX) :]
            try:
                check_model_name(model)
            except ValueError:
                continue
            if "/" not in model:
                values[model] = entry.get("Value")
        self.experiment_values = values

    # -- the state they make --------------------------------------------------------------------------

    def _state(self) -> tuple[RegistryState, list[str], frozenset[str]]:
        """The state, the problems kept out of it, and the models removed on purpose (``{"remove": true}``)."""
        problems: list[str] = []
        models: dict[str, ModelEntry] = {}
        defaulted: set[str] = set()
        removed = frozenset(m for m, value in self.experiment_values.items() if is_removal(value))
        for model in removed:
            self.last_endpoints.pop(model, None)
            self.last_upstreams.pop(model, None)
            self.good_experiments.pop(model, None)
        for model in sorted({*self.instances, *self.experiment_values, *self.last_endpoints} - removed):
            endpoints, upstreams = group_versions(self.instances.get(model, ()))
            if endpoints:
                self.last_endpoints[model], self.last_upstreams[model] = endpoints, upstreams
            else:
                endpoints = self.last_endpoints.get(model, {})
                upstreams = self.last_upstreams.get(model, {})
            experiment = self._experiment(model, endpoints, problems)
            if experiment is None:
                continue
            if model not in self.experiment_values and len(endpoints) > 1:
                defaulted.add(model)
            models[model] = ModelEntry(experiment=experiment, endpoints=endpoints, upstreams=upstreams)
        if defaulted != self.defaulted:
            self.defaulted = frozenset(defaulted)
            if defaulted:
                log.warning(
                    "models with several versions and no experiment: the lowest version takes all traffic",
                    models=sorted(defaulted),
                    key_prefix=EXPERIMENT_PREFIX,
                )
        return RegistryState(models=models), problems, removed

    def _experiment(self, model: str, endpoints: Mapping[str, Sequence[str]], problems: list[str]) -> Experiment | None:
        if model not in self.experiment_values:
            self.good_experiments.pop(model, None)
            return default_experiment(model, endpoints)
        value = self.experiment_values[model]
        good = self.good_experiments.get(model)
        if good is not None and good[0] == value:
            return good[1]
        try:
            experiment = decode_experiment(model, value)
        except ConfigError as error:
            kept = "keeping the last good one" if good is not None else "using the default rule"
            problems.append(f"{error} ({kept})")
            return good[1] if good is not None else default_experiment(model, endpoints)
        self.good_experiments[model] = (value, experiment)
        return experiment
