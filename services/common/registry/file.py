"""The ``file`` registry backend: one YAML file, re-read when it changes.

Format (schema: :class:`RegistryDocument`)::

    models:
      <model>:
        endpoints:                 # version → worker addresses (host:port)
          v1: [127.0.0.1:9001, 127.0.0.1:9002]
          v2: [127.0.0.1:9003]
          v3:                      # or an OpenAI-compatible HTTP server (vLLM, NIM, ...)
            openai: [http://10.0.0.5:8000/v1]
            model: served-name     # optional: the upstream's own model name
            api_key_file: /etc/splitstream/v3.key   # optional (or api_key_env: VAR)
        experiment:                # optional when the model has one version
          salt: <string>           # default: the model name
          control: v1
          arms: [{version: v1, weight: 90}, {version: v2, weight: 10}]
          shadows: [{version: v3, sample_rate: 0.1}]
          routing_key_header: x-routing-key
    remove_models: [<model>, ...]  # optional: models taken out on purpose (see below)

The file is polled (stat every ``poll_interval_s``) rather than watched with
inotify, because editors and config managers replace files by rename and
inotify watches follow the old inode. A file that fails to parse or validate
is reported and the previous state is kept; so is a file that drops a serving
model (or every model) without naming it under ``remove_models``
(:mod:`splitstream.common.registry.removal`): an editor saving in place
truncates the file first, and a poll landing then must not unroute everything.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import structlog
import yaml
from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, model_validator

from splitstream.common.addresses import check_address, check_base_url
from splitstream.common.errors import ConfigError
from splitstream.common.experiment import Experiment, ExperimentDocument, VersionName
from splitstream.common.files import FileSignature, read_if_changed
from splitstream.common.names import check_model_name
from splitstream.common.registry.base import ModelEntry, OpenAIUpstream, RegistryState, RegistryUpdate
from splitstream.common.registry.removal import RemovalGuard
from splitstream.common.schema import Document, validate

log = structlog.get_logger()

#: How an operator takes models out of a file registry on purpose; shown with every refused removal.
HOW_TO_REMOVE = "to remove models on purpose, name them under the top-level 'remove_models:' list"


def _model_name(name: str) -> str:
    check_model_name(name)  # ValueError → a validation error at this key
    return name


ModelName = Annotated[str, AfterValidator(_model_name)]
Address = Annotated[str, AfterValidator(check_address)]
#: One address may be written without the list around it (``v1: 127.0.0.1:9001``).
Addresses = Annotated[list[Address], BeforeValidator(lambda value: [value] if isinstance(value, str) else value)]
BaseUrl = Annotated[str, AfterValidator(check_base_url)]
#: One base URL may be written without the list around it (``openai: http://10.0.0.5:8000/v1``).
BaseUrls = Annotated[list[BaseUrl], BeforeValidator(lambda value: [value] if isinstance(value, str) else value)]
NonEmpty = Annotated[str, Field(min_length=1)]


class OpenAIVersionDocument(Document):
    """A version served by OpenAI-compatible HTTP servers: the router passes requests through to them."""

    openai: BaseUrls = Field(
        description="base URLs (`http(s)://host:port/v1`; one may go without the list); the router calls "
        "`{base}/chat/completions`, `{base}/completions` and checks health with `GET {base}/models`"
    )
    model: NonEmpty | None = Field(
        None, description="the upstream's own model name, written into each request's `model`; null: unchanged"
    )
    api_key_file: NonEmpty | None = Field(
        None, description="a file holding the API key, sent as `Authorization: Bearer` (never inline here)"
    )
    api_key_env: NonEmpty | None = Field(
        None, description="an environment variable of the router's holding the API key (instead of a file)"
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> OpenAIVersionDocument:
        if self.api_key_file is not None and self.api_key_env is not None:
            raise ValueError("name the API key with api_key_file or api_key_env, not both")
        return self

    def upstream(self) -> OpenAIUpstream:
        return OpenAIUpstream(model=self.model, api_key_file=self.api_key_file, api_key_env=self.api_key_env)


#: The union's branch names: pydantic puts them in an error's path, where :func:`_without_branches` takes them
#: out again (``<`` is in no version name, so no path of the user's is touched).
_GRPC, _OPENAI = "<grpc>", "<openai>"


def _without_branches(path: str) -> str:
    return path.replace(f".{_GRPC}", "").replace(f".{_OPENAI}", "")


#: A version's endpoints: gRPC addresses (a list, or one string), or a mapping with ``openai:`` base URLs.
VersionEndpoints = Annotated[
    Annotated[Addresses, Tag(_GRPC)] | Annotated[OpenAIVersionDocument, Tag(_OPENAI)],
    Discriminator(lambda value: _OPENAI if isinstance(value, dict | OpenAIVersionDocument) else _GRPC),
]


class ModelDocument(Document):
    """One model: where its versions run and how traffic splits between them."""

    endpoints: dict[VersionName, VersionEndpoints] | None = Field(
        None,
        description="version → list of `host:port` (one address may go without the list), or `{openai: "
        "[base URL, ...], model, api_key_file | api_key_env}` for OpenAI-compatible HTTP servers; null: none",
    )
    experiment: ExperimentDocument | None = Field(
        None, description="the split; may be left out when the model has exactly one version (it takes 100 %)"
    )


class RegistryDocument(Document):
    """The whole file. An empty or comment-only file is refused (it is what a poll sees mid-save)."""

    models: dict[ModelName, ModelDocument] = Field(
        description="model name → model; `{}` serves nothing (refused while models are routed, see remove_models)"
    )
    remove_models: list[ModelName] | None = Field(
        None,
        description="models taken out on purpose: a state that drops a serving model, or every model, is "
        "refused unless each is named here; null: none",
    )

    @model_validator(mode="after")
    def _removed_models_are_absent(self) -> RegistryDocument:
        both = sorted(set(self.remove_models or ()) & set(self.models))
        if both:
            raise ValueError(f"remove_models names {both}, which are also under models; keep them in one place")
        return self


class FileRegistry:
    def __init__(self, path: str | os.PathLike[str], *, poll_interval_s: float = 0.25) -> None:
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.description = f"file:{self.path}"
        # The registry's, not one watch's: a watch the router restarts must still refuse dropping a
        # serving model, so the last accepted state outlives the watch that accepted it.
        self._guard = RemovalGuard(how_to_remove=HOW_TO_REMOVE)

    async def watch(self) -> AsyncIterator[RegistryUpdate]:
        """Yield an update per change of the file; survives anything a file or its reading can do.

        Any exception while reading or parsing (not only the ConfigError a bad value
        should become) is logged and yielded as an error update, and polling goes on:
        a watch that died would leave the router healthy on a state nobody can change.
        """
        last_signature: FileSignature | None = None
        last_error: str | None = None
        guard = self._guard
        while True:
            update: RegistryUpdate | None = None
            try:
                signature, text = await asyncio.to_thread(read_if_changed, self.path, last_signature)
                last_signature = signature
                if text is not None:
                    # In a thread: YAML parsing is pure Python, and on the event loop a 10 MB file would hold
                    # every call for 2.3 s (measured on a running router).
                    state, removed = await asyncio.to_thread(_parse_text, text, str(self.path))
                    refused = guard.check(state, removable=removed)
                    if refused is not None:
                        raise ConfigError(f"{self.path}: {refused}")
                    guard.accept(state)
                    update = RegistryUpdate(state=state)
            except OSError as error:
                last_signature = None  # read again once the file is back, even if it looks unchanged
                update = RegistryUpdate(error=f"{self.path}: {error.strerror or error}")
            except UnicodeDecodeError as error:
                update = RegistryUpdate(error=f"{self.path}: not UTF-8 text (byte {error.start}: {error.reason})")
            except (ConfigError, yaml.YAMLError) as error:
                update = RegistryUpdate(error=" ".join(str(error).split()))
            except Exception as error:  # a bug or a value no check foresaw: report it, keep watching
                log.exception("registry file could not be read; keeping the last good state", path=str(self.path))
                update = RegistryUpdate(error=f"{self.path}: cannot be read ({type(error).__name__}: {error})")
            if update is not None and (update.error is None or update.error != last_error):
                last_error = update.error
                yield update
            await asyncio.sleep(self.poll_interval_s)


def _parse_text(text: str, source: str) -> tuple[RegistryState, frozenset[str]]:
    return parse_registry_file(yaml.safe_load(text), source=source)


def parse_registry(data: Any, *, source: str = "registry") -> RegistryState:
    """Validate the registry mapping; raises ConfigError naming the model and field at fault."""
    state, _ = parse_registry_file(data, source=source)
    return state


def parse_registry_file(data: Any, *, source: str = "registry") -> tuple[RegistryState, frozenset[str]]:
    """The state a registry document describes and the models it removes on purpose (``remove_models``).

    Raises ConfigError ``"<source>: <field path>: <problem>"`` for anything the schema or the
    experiment rules refuse. An empty document (an empty or comment-only file) is refused:
    it is what a poll sees in the middle of a non-atomic save, never a registry someone meant.
    """
    if data is None:
        raise ConfigError(f"{source}: the file is empty (a save in progress, or truncated); a registry needs 'models:'")
    document = validate(RegistryDocument, data, where=source, rename=_without_branches)
    models: dict[str, ModelEntry] = {}
    for model, entry in document.models.items():
        endpoints: dict[str, tuple[str, ...]] = {}
        upstreams: dict[str, OpenAIUpstream] = {}
        for version, value in (entry.endpoints or {}).items():
            if isinstance(value, OpenAIVersionDocument):
                endpoints[version] = tuple(dict.fromkeys(value.openai))
                upstreams[version] = value.upstream()
            else:
                endpoints[version] = tuple(dict.fromkeys(value))
        try:
            experiment = _experiment(model, entry, endpoints)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None
        models[model] = ModelEntry(experiment=experiment, endpoints=endpoints, upstreams=upstreams)
    return RegistryState(models=models), frozenset(document.remove_models or ())


def _experiment(model: str, entry: ModelDocument, endpoints: dict[str, tuple[str, ...]]) -> Experiment:
    if entry.experiment is not None:
        return Experiment.from_document(model, entry.experiment)
    if len(endpoints) != 1:
        raise ConfigError(
            f"model '{model}' has {len(endpoints)} versions but no experiment; add one saying how to split"
        )
    (only,) = endpoints
    return Experiment.build(model=model, salt=model, control=only, arms=[(only, 100)])
