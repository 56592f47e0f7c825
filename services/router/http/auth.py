"""Callers on the HTTP port: authenticated, rate-limited and authorized by the gRPC edge's own checks.

With ``--auth-principals`` the front door runs :class:`HttpGuard`'s middleware on every request, inside
the edge middleware (which answers errors and counts). It calls the same
:class:`~splitstream.router.auth.gate.Gate` as the gRPC interceptor: the same credentials (``Authorization:
Bearer <API key or JWT>``, as OpenAI's clients send their key, or ``x-api-key``), the same principals
document, the same token buckets and the same metrics.

Deny by default. What a request needs is decided from its route, in this order:

1. a route in :data:`OPEN_ROUTES` (health: what balancers and Kubernetes probe, as grpc.health is open
   on the gRPC port): nothing;
2. every other request, a route or none (a 404, a 405): an authenticated caller within its rate limit,
   so an unknown path says nothing to a caller without a credential;
3. a route with a ``{model}`` in its path (``/v1/models/{model}``, KServe's ``/v2/models/{model}/...``):
   the model's grant, checked here; a ``POST`` there that names a ``{version}`` or sends
   ``x-splitstream-version`` pins, and needs ``pin``;
4. a route in :data:`GRANT_ROUTES`: that grant (``/v1/feedback``: ``feedback``);
5. a route in :data:`BODY_MODEL_ROUTES`: the model is known only once the body is parsed, so the handler
   calls :func:`authorize_model` then (before anything is routed or streamed);
6. a route in :data:`PRINCIPAL_ROUTES`: any authenticated caller (``/v1/models`` lists only the models
   the principal may call: :func:`may_see`);
7. any other route: refused (500, logged as a bug). A route added later is never served unchecked; it
   is either shaped as rule 3 or listed here.

Refusals are OpenAI's error object: 401 (``invalid_api_key``, with ``WWW-Authenticate: Bearer``) for a
missing or bad credential, 403 for a grant the principal lacks, 429 with ``Retry-After`` over a rate
limit. Their messages are generic, so a caller learns nothing of the configuration (principal names,
JWT settings); the gRPC edge's detailed reason is logged with the request id, which every refusal
carries in ``x-request-id`` and a 401 or 403 in its message too, as the gRPC port answers.

The principal's name is set for the call as the interceptor sets it (:data:`CALL_PRINCIPAL`, read by
the stream relay's record) and kept on the call (:class:`~.call.Call`: its ``principal`` and ``admitted``).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
from aiohttp import web

from splitstream.common.headers import REQUEST_ID_HEADER, VERSION_HEADER, from_header_value
from splitstream.common.runtime import process_index
from splitstream.router.auth.answers import LOG_HAS_THE_REASON
from splitstream.router.auth.gate import CREDENTIAL_HEADERS, FEEDBACK, Gate, Refusal, Refused
from splitstream.router.auth.policy import Principal
from splitstream.router.http.call import CALL
from splitstream.router.http.errors import ApiError, internal

log = structlog.get_logger()

#: Routes open to anyone (health), as grpc.health is on the gRPC port.
OPEN_ROUTES = frozenset({"/v2/health/live", "/v2/health/ready"})
#: Routes whose model is in the body: their handlers call :func:`authorize_model` once it is parsed.
BODY_MODEL_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
#: Routes any authenticated caller may use.
PRINCIPAL_ROUTES = frozenset({"/v1/models", "/v2"})
#: Routes that need one grant beside the models.
GRANT_ROUTES = {"/v1/feedback": FEEDBACK}

#: Longest request id quoted in a refusal's message, as on the gRPC port (x-request-id still echoes a longer one).
_MAX_ID_IN_MESSAGE = 128


class HttpGuard:
    """The middleware that admits HTTP requests through ``gate``."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._index = process_index()

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> Any:
        route = _route(request)
        if route in OPEN_ROUTES:
            return await handler(request)
        call = request[CALL]
        if call.request_id is None:  # the refusal's log line and x-request-id tell the operator which
            sent = request.headers.get(REQUEST_ID_HEADER, "")
            call.request_id = from_header_value(sent) if sent else uuid.uuid4().hex
        credentials = tuple(
            (name, value)
            for name, value in ((k.lower(), v) for k, v in request.headers.items())
            if name in CREDENTIAL_HEADERS
        )
        gate = self.gate
        try:
            principal = await gate.admit(credentials)
            if request.match_info.http_exception is None:  # a route: what it needs (else a 404/405 follows)
                self._authorize_route(request, principal, route)
        except Refused as refused:
            raise self.refuse(request, refused.refusal) from None
        call.principal = principal.name
        call.admitted = (principal, self)
        gate.let_through(principal)
        return await handler(request)

    def _authorize_route(self, request: web.Request, principal: Principal, route: str) -> None:
        model = request.match_info.get("model")
        if model is not None:
            pinned = request.method == "POST" and bool(
                request.match_info.get("version") or request.headers.get(VERSION_HEADER)
            )
            Gate.check_model(principal, model, pinned=pinned)
        elif route in GRANT_ROUTES:
            Gate.require(principal, GRANT_ROUTES[route])
        elif route not in BODY_MODEL_ROUTES and route not in PRINCIPAL_ROUTES:
            log.error("HTTP route has no declared authorization; refused", route=route)
            raise Refused(Refusal(grpc.StatusCode.INTERNAL, f"route {route} has no declared authorization", "route"))

    def refuse(self, request: web.Request, refusal: Refusal) -> ApiError:
        """Count and log ``refusal``; the caller's answer, which says nothing of the configuration."""
        self.gate.count(refusal)
        call = request.get(CALL)
        rid = (call.request_id if call is not None else None) or ""
        error = _answer(refusal)
        if error.status in (401, 403) and 0 < len(rid) <= _MAX_ID_IN_MESSAGE:
            # As the gRPC port's text says it (x-request-id carries it too, as gRPC's trailers do).
            error.message = f"{error.message} (request id {rid}; {LOG_HAS_THE_REASON})"
        log.info(
            "HTTP call refused",
            request_id=rid,
            status=error.status,
            reason=refusal.reason,
            detail=refusal.message,
            route=_route(request),
            **({"process_index": self._index} if self._index is not None else {}),
        )
        return error


def authorize_model(request: web.Request, model: str) -> None:
    """Raise the 403 unless the request's principal may call ``model`` (and pin, when it sends the pin
    header); nothing when callers are not authenticated. For :data:`BODY_MODEL_ROUTES`, once the body
    names the model."""
    admitted = request[CALL].admitted
    if admitted is None:
        return
    principal, guard = admitted
    try:
        Gate.check_model(principal, model, pinned=bool(request.headers.get(VERSION_HEADER)))
    except Refused as refused:
        raise guard.refuse(request, refused.refusal) from None


def may_see(request: web.Request, model: str) -> bool:
    """Whether the request's principal may call ``model`` (all models when callers are not authenticated)."""
    admitted = request[CALL].admitted
    return admitted is None or admitted[0].may_call(model)


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else ""


def _answer(refusal: Refusal) -> ApiError:
    """OpenAI's error for a refusal: the status and a generic message (the detail is logged)."""
    if refusal.code == grpc.StatusCode.UNAUTHENTICATED:
        message = (
            "You didn't provide an API key: send it as 'Authorization: Bearer <key>'"
            if refusal.reason == "missing"
            else "Incorrect API key or token provided"
        )
        return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if refusal.code == grpc.StatusCode.PERMISSION_DENIED:
        if refusal.reason == "model":
            return ApiError(403, "You may not call this model", param="model", code="permission_denied")
        if refusal.reason == "pin":
            return ApiError(403, f"You may not pin a version ({VERSION_HEADER})", code="permission_denied")
        return ApiError(403, "You may not do this", code="permission_denied")
    if refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        wait_s = max(refusal.retry_after_s or 0.0, 0.001)
        return ApiError(
            429,
            f"Rate limit reached: retry after {math.ceil(wait_s)} s",
            type="requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(math.ceil(wait_s)), "retry-after-ms": str(math.ceil(wait_s * 1000))},
        )
    return internal()
