"""OpenAI-compatible HTTP servers as a version's endpoints (``openai`` upstreams in the registry).

A version declared ``openai`` (vLLM, trtllm-serve, Triton's OpenAI frontend, NIM, llama.cpp) is served
by HTTP base URLs instead of gRPC workers. Its endpoints sit in the same :class:`VersionPool` as a gRPC
version's, with the same health gate, least-loaded pick and circuit breaker, so the split's spill to the
control and ejection work alike; only the HTTP front door calls them (passing requests through).

- Health: ``GET {base}/models`` every second (2 s timeout), as a gRPC worker without a health Watch is
  polled: 200 is SERVING, another status NOT_SERVING, no connection UNREACHABLE.
- One :class:`aiohttp.ClientSession` per router for every upstream (:class:`UpstreamHttp`): connections
  are reused across calls and health checks; it is made on the event loop and closed with the core.
- The API key is read where the registry says (a file, re-read when it changes, or an environment
  variable) and sent as ``Authorization: Bearer``; it is never logged nor shown in Status.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import aiohttp
import structlog

from splitstream.common.files import FileSignature, read_if_changed
from splitstream.common.registry import OpenAIUpstream
from splitstream.router.pools import Health, PoolMember

log = structlog.get_logger()

#: How often an upstream's health is checked, and how long a check may take: those of a gRPC worker
#: whose health is polled (``Endpoint._watch_health``).
HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 2.0
#: How long opening a connection to an upstream may take before the call is retried elsewhere.
CONNECT_TIMEOUT_S = 5.0


class UpstreamHttp:
    """The router's one HTTP client session for every ``openai`` upstream; made on first use, on the loop."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                # No cap of our own on connections: each upstream limits its own concurrency, as a worker does.
                connector=aiohttp.TCPConnector(limit=0),
                # No total timeout: a stream lasts as long as the generation. Connecting is bounded, so a
                # black-holed upstream is retried elsewhere before the client's first byte.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
                raise_for_status=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class ApiKeyUnavailable(Exception):
    """The upstream's API key could not be read; the message names where it was looked for, never a key."""


class ApiKey:
    """An upstream's API key, read where the registry names it: a file (re-read only when it changed, so
    a rotated key is used from the next call on) or an environment variable of the router's."""

    def __init__(self, upstream: OpenAIUpstream) -> None:
        self.file = upstream.api_key_file
        self.env = upstream.api_key_env
        self._signature: FileSignature | None = None
        self._value: str | None = None

    async def value(self) -> str | None:
        """The key (None when the upstream takes none). Raises ApiKeyUnavailable."""
        if self.env is not None:
            key = os.environ.get(self.env, "").strip()
            if not key:
                raise ApiKeyUnavailable(f"environment variable {self.env} (api_key_env) is not set or empty")
            return key
        if self.file is None:
            return None
        try:
            self._signature, text = await asyncio.to_thread(read_if_changed, self.file, self._signature)
        except (OSError, UnicodeDecodeError) as error:
            self._signature = self._value = None
            reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
            raise ApiKeyUnavailable(f"API key file {self.file} (api_key_file) cannot be read: {reason}") from None
        if text is not None:
            self._value = text.strip() or None
        if self._value is None:
            raise ApiKeyUnavailable(f"API key file {self.file} (api_key_file) is empty")
        return self._value


class OpenAIEndpoint(PoolMember):
    """One base URL of an ``openai`` version: health by ``GET {base}/models``, calls by the front door."""

    def __init__(
        self,
        base_url: str,
        upstream: OpenAIUpstream,
        http: UpstreamHttp,
        *,
        eject_after_failures: int,
        eject_duration_s: float,
        on_eject: Callable[[], None] | None = None,
        on_eligibility: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            base_url,
            eject_after_failures=eject_after_failures,
            eject_duration_s=eject_duration_s,
            on_eject=on_eject,
            on_eligibility=on_eligibility,
        )
        self.base_url = base_url.rstrip("/")
        self.upstream: OpenAIUpstream = upstream
        self.http = http
        self.api_key = ApiKey(upstream)
        self._key_problem = ""

    async def headers(self) -> dict[str, str]:
        """``Authorization`` for a call (none without a key). Raises ApiKeyUnavailable."""
        key = await self.api_key.value()
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    async def _watch_health(self) -> None:
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        while True:
            try:
                headers = await self.headers()
                self._key_problem = ""
                async with self.http.session.get(f"{self.base_url}/models", headers=headers, timeout=timeout) as answer:
                    await answer.read()
                    self._health_is(Health.SERVING if answer.status == 200 else Health.NOT_SERVING)
                    if answer.status != 200:
                        log.debug("upstream health check refused", endpoint=self.address, status=answer.status)
            except ApiKeyUnavailable as error:
                if str(error) != self._key_problem:
                    self._key_problem = str(error)
                    log.warning("upstream API key unavailable", endpoint=self.address, problem=str(error))
                self._health_is(Health.NOT_SERVING)
            except (aiohttp.ClientError, TimeoutError):
                self._set_unreachable()
            await asyncio.sleep(HEALTH_INTERVAL_S)
