"""The registry interface routers depend on, and the state it delivers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from splitstream.common.experiment import Experiment


@dataclass(frozen=True, kw_only=True)
class OpenAIUpstream:
    """How to call a version served by an OpenAI-compatible HTTP server (vLLM, trtllm-serve, NIM, ...): its
    endpoints are then base URLs (``http://10.0.0.5:8000/v1``), not gRPC addresses.

    The API key is named, never held: a registry is shown in Status and logs, and is often kept in git, so
    it says where the key is (a file, or an environment variable of the router's) and the router reads it
    when it calls."""

    #: The upstream's own name for the model (``model`` is rewritten to it); None: sent as the client wrote it.
    model: str | None = None
    #: A file holding the API key (sent as ``Authorization: Bearer``); re-read when it changes.
    api_key_file: str | None = None
    #: An environment variable of the router's holding the API key.
    api_key_env: str | None = None


@dataclass(frozen=True, kw_only=True)
class ModelEntry:
    """One model: its experiment and the healthy endpoints of each version."""

    experiment: Experiment
    endpoints: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: The versions served by OpenAI-compatible HTTP servers (their endpoints are base URLs); others are gRPC.
    upstreams: Mapping[str, OpenAIUpstream] = field(default_factory=dict)


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
