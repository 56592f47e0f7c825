"""The registry interface routers depend on, and the state it delivers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from splitstream.common.experiment import Experiment


@dataclass(frozen=True, kw_only=True)
class ModelEntry:
    """One model: its experiment and the healthy endpoints of each version."""

    experiment: Experiment
    endpoints: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RegistryState:
    models: Mapping[str, ModelEntry] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RegistryUpdate:
    """A new state to apply, the error that kept one from being read, or both.

    - ``state`` only: apply it.
    - ``error`` only: nothing could be read; the router keeps serving its last good
      state and reports the error.
    - both: apply ``state``, in which the parts the error names were kept from
      before (e.g. one model's experiment in Consul is invalid); report the error.
    """

    state: RegistryState | None = None
    error: str | None = None


class Registry(Protocol):
    #: e.g. ``file:/etc/splitstream/registry.yaml``; shown in Router/Status.
    description: str

    def watch(self) -> AsyncIterator[RegistryUpdate]:
        """Yield the current state at once, then each change; never ends on its own."""
        ...
