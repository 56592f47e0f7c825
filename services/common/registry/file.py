"""The ``file`` registry backend: one YAML file, re-read when it changes.

Format::

    models:
      <model>:
        endpoints:                 # version → worker addresses (host:port)
          v1: [127.0.0.1:9001, 127.0.0.1:9002]
          v2: [127.0.0.1:9003]
        experiment:                # optional when the model has one version
          salt: <string>           # default: the model name
          control: v1
          arms: [{version: v1, weight: 90}, {version: v2, weight: 10}]
          shadows: [{version: v3, sample_rate: 0.1}]
          routing_key_header: x-routing-key

The file is polled (stat every ``poll_interval_s``) rather than watched with
inotify, because editors and config managers replace files by rename and
inotify watches follow the old inode. A file that fails to parse or validate
is reported and the previous state is kept.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from splitstream.common.errors import ConfigError
from splitstream.common.experiment import Experiment
from splitstream.common.names import check_model_name
from splitstream.common.registry.base import ModelEntry, RegistryState, RegistryUpdate


class FileRegistry:
    def __init__(self, path: str | os.PathLike[str], *, poll_interval_s: float = 0.25) -> None:
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.description = f"file:{self.path}"

    async def watch(self) -> AsyncIterator[RegistryUpdate]:
        last_signature: tuple[int, int, int] | None = None
        last_error: str | None = None
        while True:
            try:
                signature, text = await asyncio.to_thread(self._read_if_changed, last_signature)
            except OSError as error:
                signature, text = None, None
                message = f"{self.path}: {error.strerror or error}"
                if message != last_error:
                    last_error = message
                    last_signature = None
                    yield RegistryUpdate(error=message)
            if text is not None:
                last_signature = signature
                try:
                    state = parse_registry(yaml.safe_load(text), source=str(self.path))
                except (ConfigError, yaml.YAMLError) as error:
                    last_error = str(error)
                    yield RegistryUpdate(error=last_error)
                else:
                    last_error = None
                    yield RegistryUpdate(state=state)
            await asyncio.sleep(self.poll_interval_s)

    def _read_if_changed(self, last: tuple[int, int, int] | None) -> tuple[tuple[int, int, int], str | None]:
        stat = self.path.stat()
        signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if signature == last:
            return signature, None
        return signature, self.path.read_text()


def parse_registry(data: Any, *, source: str = "registry") -> RegistryState:
    """Validate the registry mapping; raises ConfigError naming the model and field at fault."""
    if data is None:
        return RegistryState()
    if not isinstance(data, Mapping) or not isinstance(data.get("models", {}), Mapping):
        raise ConfigError(f"{source}: expected a mapping with a 'models' mapping at the top")
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise ConfigError(f"{source}: unknown top-level field(s) {unknown}")
    models: dict[str, ModelEntry] = {}
    for model, entry in (data.get("models") or {}).items():
        models[str(model)] = _parse_model(str(model), entry or {}, source)
    return RegistryState(models=models)


def _parse_model(model: str, entry: Any, source: str) -> ModelEntry:
    where = f"{source}: model '{model}'"
    try:
        check_model_name(model)
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: must be a mapping with 'endpoints' and 'experiment'")
    unknown = sorted(set(entry) - {"endpoints", "experiment"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}")
    raw_endpoints = entry.get("endpoints") or {}
    if not isinstance(raw_endpoints, Mapping):
        raise ConfigError(f"{where}: 'endpoints' must map version → list of host:port")
    endpoints: dict[str, tuple[str, ...]] = {}
    for version, addresses in raw_endpoints.items():
        if isinstance(addresses, str):
            addresses = [addresses]
        if not isinstance(addresses, list) or not all(isinstance(a, str) and ":" in a for a in addresses):
            raise ConfigError(f"{where}: endpoints of version '{version}' must be a list of host:port")
        endpoints[str(version)] = tuple(dict.fromkeys(addresses))
    raw_experiment = entry.get("experiment")
    if raw_experiment is None:
        if len(endpoints) != 1:
            raise ConfigError(f"{where}: has {len(endpoints)} versions but no experiment; add one saying how to split")
        (only,) = endpoints
        experiment = Experiment.build(model=model, salt=model, control=only, arms=[(only, 100)])
    else:
        try:
            experiment = Experiment.from_mapping(model, raw_experiment)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None
    return ModelEntry(experiment=experiment, endpoints=endpoints)
