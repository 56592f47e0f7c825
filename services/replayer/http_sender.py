"""Sending one recorded HTTP call to an HTTP target (a router's front door, a version, an OpenAI-compatible
server) as the request it was recorded as: method, path, body and content type.

The replayer's sender is a thread that must never block on the network, and gRPC gives it futures that
complete on gRPC's own threads. aiohttp has no such threads, so an :class:`HttpTarget` runs its own event
loop in a thread of its own: :meth:`HttpTarget.send` hands the call to that loop and returns at once, and the
call's :class:`~splitstream.replayer.sender.Outcome` is passed to ``on_done`` from the loop's thread when the
answer has been read. A streamed answer (server-sent events) is read event by event as it comes, each
event timed, so TTFT and inter-token gaps are the replay side's own.

A call the replayer could not complete because the connection failed (refused, reset, a deadline) is a
``send_error``: the target never answered it, so it is no status of the target's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import aiohttp

from splitstream.common.headers import VERSION_HEADER, from_header_value
from splitstream.common.sse import EventData
from splitstream.common.tls import ClientTls
from splitstream.replayer.http_calls import HttpReply as HttpReply
from splitstream.replayer.http_calls import HttpRequest as HttpRequest
from splitstream.replayer.http_calls import TargetRefused as TargetRefused
from splitstream.replayer.http_calls import check_http_target as check_http_target
from splitstream.replayer.http_calls import is_http_target as is_http_target
from splitstream.replayer.sender import Outcome, TargetUnreachable

#: Answers refused for the replayer's own credentials: the whole run would be refused, so it stops at start.
_REFUSED = frozenset({401, 403})


def ssl_context(tls: ClientTls) -> ssl.SSLContext:
    """The client TLS of ``--tls-ca``/``--tls-cert``/``--tls-key`` for an ``https://`` target (the system's
    roots without a CA file), as the gRPC targets use them."""
    context = ssl.create_default_context(cafile=tls.ca_file or None)
    if tls.cert_file:
        context.load_cert_chain(tls.cert_file, tls.key_file or None)
    return context


class HttpTarget:
    """One ``http(s)://host:port`` target: an aiohttp session on an event loop of its own thread."""

    def __init__(
        self, address: str, *, tls: ClientTls, concurrency: int, max_response_bytes: int = 64 * 1024 * 1024
    ) -> None:
        self.address = address
        self.base = address.rstrip("/")
        self.max_response_bytes = max_response_bytes
        self._ssl: ssl.SSLContext | bool = ssl_context(tls) if address.startswith("https://") else False
        self._server_name = tls.server_name or None
        self._concurrency = concurrency
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="replay-http", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession = self._on_loop(self._open()).result()

    async def _open(self) -> aiohttp.ClientSession:
        # One connection per call in flight at most (the sender's --concurrency slots bound them); no
        # cookies: every replayed call stands alone, as recorded.
        connector = aiohttp.TCPConnector(limit=self._concurrency, ssl=self._ssl)
        return aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=True, raise_for_status=False
        )

    def _on_loop(self, coroutine: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def wait_ready(self, timeout_s: float, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Block until the target answers HTTP: ``GET {base}/v1/models`` with the replayer's credentials.
        Any answer will do (a KServe-only server has no such route) but 401/403, which would refuse every
        call: :class:`TargetRefused`. No connection, or bytes that are no HTTP/1.1 answer (a gRPC port),
        within ``timeout_s``: :class:`TargetUnreachable`."""
        self._on_loop(self._probe(timeout_s, headers)).result()

    async def _probe(self, timeout_s: float, headers: Sequence[tuple[str, str]]) -> None:
        deadline = time.monotonic() + timeout_s
        why = ""
        while (left := deadline - time.monotonic()) > 0:
            try:
                async with self._session.get(
                    self.base + "/v1/models",
                    headers=list(headers),
                    timeout=aiohttp.ClientTimeout(total=left),
                    server_hostname=self._server_name,
                ) as response:
                    status = response.status
            except aiohttp.ClientConnectorError as error:  # refused, no route, TLS handshake
                why = str(error.os_error) if error.os_error else str(error)
                if isinstance(error, aiohttp.ClientConnectorCertificateError | aiohttp.ClientSSLError):
                    raise TargetUnreachable(f"target {self.address}: TLS failed: {why}") from None
                await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
                continue
            except (aiohttp.ClientResponseError, aiohttp.ServerDisconnectedError) as error:
                raise TargetUnreachable(
                    f"target {self.address} does not answer HTTP/1.1 (a gRPC port?): {type(error).__name__}"
                ) from None
            except (aiohttp.ClientError, TimeoutError) as error:
                why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
                break
            if status in _REFUSED:
                raise TargetRefused(
                    f"target {self.address} refused the replayer's credentials (HTTP {status} on GET /v1/models): "
                    "give it a key with --api-key-file or SPLITSTREAM_REPLAY_API_KEY"
                )
            return
        raise TargetUnreachable(
            f"target {self.address} is unreachable (no connection within {timeout_s:g}s" + (f": {why})" if why else ")")
        )

    def send(self, request: HttpRequest, *, timeout_s: float, on_done: Callable[[Outcome], None]) -> None:
        """Start the call on the target's loop and return at once; ``on_done`` runs on that loop's thread."""
        sent_at = time.perf_counter()
        self._on_loop(self._call(request, timeout_s, on_done, sent_at))

    async def _call(
        self, request: HttpRequest, timeout_s: float, on_done: Callable[[Outcome], None], sent_at: float
    ) -> None:
        try:
            outcome = await asyncio.wait_for(self._exchange(request, sent_at), timeout_s)
        except TimeoutError:
            outcome = _failed(sent_at, f"no complete answer within --timeout-s {timeout_s:g}")
        except aiohttp.ClientError as error:
            outcome = _failed(sent_at, f"{type(error).__name__}: {error}")
        except Exception as error:  # never lose a flight: the sender waits for every one
            outcome = _failed(sent_at, f"{type(error).__name__}: {error}")
        on_done(outcome)

    async def _exchange(self, request: HttpRequest, sent_at: float) -> Outcome:
        async with self._session.request(
            request.method,
            self.base + request.path,
            data=request.body,
            headers=list(request.headers),
            server_hostname=self._server_name,
            allow_redirects=False,
        ) as response:
            status = response.status
            version = from_header_value(response.headers.get(VERSION_HEADER, ""))
            content_type = response.headers.get("Content-Type", "")
            if content_type.split(";")[0].strip().lower() == "text/event-stream":
                events = await self._events(response, sent_at)
                reply = HttpReply(status, "text/event-stream", None, events)
            else:
                body = await response.content.read(self.max_response_bytes + 1)
                if len(body) > self.max_response_bytes:
                    return _failed(sent_at, f"answer over {self.max_response_bytes} bytes")
                reply = HttpReply(status, content_type, body)
        done_at = time.perf_counter()
        code = 0 if 200 <= status < 300 else status
        return Outcome(code, "", None, version, sent_at, done_at, http=reply)

    async def _events(self, response: aiohttp.ClientResponse, sent_at: float) -> tuple[tuple[float, bytes], ...]:
        """Each event's ``data`` (its lines joined by LF), timed when the bytes that ended it arrived."""
        events: list[tuple[float, bytes]] = []
        reader = EventData()
        async for chunk in response.content.iter_any():  # as the bytes arrive
            arrived = time.perf_counter() - sent_at
            events += [(arrived, data) for data in reader.feed(chunk)]
        if (last := reader.rest()) is not None:
            events.append((time.perf_counter() - sent_at, last))
        return tuple(events)

    def close(self) -> None:
        if not self._loop.is_running():
            return
        closing = self._on_loop(self._session.close())
        with contextlib.suppress(Exception):  # closing is best effort: the process is ending
            closing.result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def _failed(sent_at: float, why: str) -> Outcome:
    return Outcome(-1, "", None, "", sent_at, time.perf_counter(), send_error=why)
