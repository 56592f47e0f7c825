"""Where the principals document comes from, and how it is kept current without a restart.

``--auth-principals`` names it: ``file:PATH`` (YAML or JSON, polled like the file registry: a stat
every ``poll_interval_s``, re-read when its inode, size or mtime changes, so both in-place saves
and rename-over replacements are seen), or ``consul://HOST:PORT/KEY`` (a Consul KV key watched with
blocking queries, ACL token from ``CONSUL_HTTP_TOKEN``, the registry's Consul client).

A document that cannot be read, parsed or validated is logged (once per distinct problem), counted,
and the last good policy stays: a half-written file must not lock every caller out, or let every
caller in. At startup there is no last good policy, so the router refuses to start (exit 2).
A key removed from the document is refused from the next poll on (within ``poll_interval_s``, or
as soon as Consul answers the blocking query).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import structlog
import yaml

from splitstream.common.consul_agent import ConsulAddress, describe_error, parse_consul_spec, run_blocking
from splitstream.common.errors import ConfigError
from splitstream.common.files import FileSignature, read_if_changed
from splitstream.common.secrets import redact_text
from splitstream.router.auth.policy import Policy, parse_policy

if TYPE_CHECKING:
    import consul

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class PolicyUpdate:
    """A new policy, or why the source could not give one (the last good policy stays)."""

    policy: Policy | None = None
    error: str = ""


class FilePrincipals:
    def __init__(self, path: str, *, poll_interval_s: float = 0.25) -> None:
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.description = f"file:{path}"

    async def watch(self) -> AsyncIterator[PolicyUpdate]:
        """An update at start and per change; never raises (a failure is an error update)."""
        last: FileSignature | None = None
        while True:
            update: PolicyUpdate | None = None
            try:
                signature, text = await asyncio.to_thread(read_if_changed, self.path, last)
                last = signature
                if text is not None:
                    policy = await asyncio.to_thread(_parse, text, str(self.path))
                    update = PolicyUpdate(policy=policy)
            except OSError as error:
                last = None  # read again once the file is back
                update = PolicyUpdate(error=f"{self.path}: {error.strerror or error}")
            except UnicodeDecodeError as error:
                update = PolicyUpdate(error=f"{self.path}: not UTF-8 text (byte {error.start})")
            except (ConfigError, yaml.YAMLError) as error:
                update = PolicyUpdate(error=" ".join(str(error).split()))
            except Exception as error:  # a value no check foresaw: report it, keep polling
                log.exception("principals file could not be read", path=str(self.path))
                update = PolicyUpdate(error=f"{self.path}: cannot be read ({type(error).__name__})")
            if update is not None:
                yield update
            await asyncio.sleep(self.poll_interval_s)


class ConsulPrincipals:
    def __init__(self, address: ConsulAddress, key: str, *, wait_s: float = 30.0, retry_s: float = 1.0) -> None:
        self.address = address
        self.key = key
        self.wait_s = wait_s
        self.retry_s = retry_s
        self.description = f"{address.description}/{key}"

    async def watch(self) -> AsyncIterator[PolicyUpdate]:
        """An update at start and per change of the key (blocking queries); never raises."""
        client = self.address.client(timeout_s=self.wait_s + 10)
        index = 0
        while True:
            try:
                new_index, entry = await run_blocking(functools.partial(self._fetch, client, index))
            except Exception as error:
                yield PolicyUpdate(error=f"{self.description}: {describe_error(error)}")
                await asyncio.sleep(self.retry_s)
                continue
            new = int(new_index or 0)
            changed = new != index
            index = 0 if new < index else max(new, 1)
            if not changed:
                continue
            if entry is None:
                yield PolicyUpdate(error=f"{self.description}: the key does not exist")
                continue
            try:
                text = (entry.get("Value") or b"").decode("utf-8")
                yield PolicyUpdate(policy=_parse(text, self.description))
            except (ConfigError, yaml.YAMLError, UnicodeDecodeError) as error:
                yield PolicyUpdate(error=" ".join(str(error).split()))

    def _fetch(self, client: consul.Consul, index: int) -> Any:
        return client.kv.get(self.key, index=index or None, wait=f"{self.wait_s:g}s")


PrincipalsSource = FilePrincipals | ConsulPrincipals


def open_principals(spec: str) -> PrincipalsSource:
    """The source ``spec`` names (``file:PATH`` or ``consul://HOST:PORT/KEY``); ConfigError otherwise."""
    scheme, _, location = spec.partition(":")
    if scheme == "file" and location:
        if not os.path.isfile(location):
            raise ConfigError(f"--auth-principals: file '{location}' does not exist")
        return FilePrincipals(location)
    if scheme == "consul":
        parts = urlsplit(spec)
        key = parts.path.strip("/")
        if not key:
            raise ConfigError("--auth-principals: expected consul://HOST:PORT/KEY (the KV key is missing)")
        try:
            address = parse_consul_spec(f"consul://{parts.netloc}")
        except ValueError as error:
            raise ConfigError(f"--auth-principals: {redact_text(str(error))}") from None
        return ConsulPrincipals(address, key)
    raise ConfigError("--auth-principals: expected file:PATH or consul://HOST:PORT/KEY")


class PrincipalsStore:
    """The current policy, kept by a background watch of its source."""

    def __init__(self, source: PrincipalsSource, *, on_update: Callable[[Policy | None, str], None]) -> None:
        self.source = source
        self.policy: Policy | None = None
        #: ``--api-key-secret-file``: the key of the document's ``api_keys_hmac_sha256`` digests.
        self.api_key_secret = b""
        self._on_update = on_update
        self._updates: AsyncIterator[PolicyUpdate] | None = None
        self._task: asyncio.Task[None] | None = None

    async def load(self) -> None:
        """The first policy, before any call is served; ConfigError when there is none."""
        self._updates = self.source.watch()
        first = await anext(self._updates)
        if first.policy is None:
            raise ConfigError(f"--auth-principals: {first.error}")
        self._apply(first)

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="principals-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._updates is not None and hasattr(self._updates, "aclose"):
            await self._updates.aclose()

    async def _follow(self) -> None:
        last_error = ""
        while True:
            try:
                if self._updates is None:
                    self._updates = self.source.watch()
                async for update in self._updates:
                    if update.error and update.error == last_error:
                        continue
                    last_error = update.error
                    self._apply(update)
            except Exception:  # a watch must outlive any bug: log, report, start again
                log.exception("principals watch failed; keeping the last policy")
                self._on_update(None, "the principals watch failed")
            self._updates = None
            await asyncio.sleep(1.0)

    async def reread(self) -> None:
        """Read a ``file:`` document now (SIGHUP), not at the next poll; a Consul key is watched already."""
        if not isinstance(self.source, FilePrincipals):
            return
        path = self.source.path
        try:
            text = await asyncio.to_thread(path.read_text, encoding="utf-8")
            self._apply(PolicyUpdate(policy=await asyncio.to_thread(_parse, text, str(path))))
        except (OSError, UnicodeDecodeError, ConfigError, yaml.YAMLError) as error:
            self._apply(PolicyUpdate(error=f"{path}: {' '.join(str(error).split())}"))

    def _apply(self, update: PolicyUpdate) -> None:
        if update.policy is None:
            log.error("principals document refused; keeping the last good one", error=update.error)
            self._on_update(None, update.error)
            return
        policy = update.policy
        if self.api_key_secret:
            policy = dataclasses.replace(policy, hmac_secret=self.api_key_secret)
        self.policy = policy
        log.info("principals loaded", source=self.source.description, principals=sorted(policy.principals))
        self._on_update(policy, "")


def _parse(text: str, source: str) -> Policy:
    return parse_policy(yaml.safe_load(text), source=source)
