"""The checks every edge of the router runs on a caller, in one order, with one set of metrics.

Both edges, the gRPC interceptor (:mod:`.interceptor`) and the HTTP front door's middleware
(:mod:`splitstream.router.http.auth`), call the same :class:`Gate`, so a credential, a grant or a rate
limit means the same on either port and is counted in the same series:

1. :meth:`Gate.admit`: the credential → a principal (:class:`Authenticator`), then the principal's rate
   limit (the token is taken before any grant is looked at, as a refused call costs the router too);
2. :meth:`Gate.require` (``status``, ``feedback``) and :meth:`Gate.check_model` (the model, and ``pin``
   when the call pins a version): each edge calls them once it knows what the call asks for (gRPC from
   the method and the request head, HTTP from the route and the parsed body);
3. :meth:`Gate.let_through`: counted by principal, and the principal's name set for the call
   (:data:`CALL_PRINCIPAL`: the servicer and the stream relay record it from there).

A refusal is a :class:`Refused` carrying a gRPC status code (the HTTP edge maps it to 401/403/429) and
a message that names what is wrong but never a key or token; :meth:`Gate.count` counts it by reason.

Credentials, read from lower-case (name, value) pairs (gRPC metadata, HTTP headers alike):

- ``x-api-key: <key>``, or ``authorization: Bearer <key>`` (how OpenAI's clients send their key): an
  API key whose SHA-256 the principals document lists;
- ``authorization: Bearer <jwt>``: a JWT verified against the JWKS (:mod:`.jwks`), whose principal claim
  names an entry of the principals document. A bearer value is an API key when its digest is listed;
  otherwise, with ``--jwt-jwks``, a value shaped as a JWT (three dot-separated parts; API keys have no
  dots) is verified as one.

A call carrying both headers is refused (which one should win is a guess the router does not make).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitstream.common.headers import VERSION_HEADER
from splitstream.router.auth.call import CALL_PRINCIPAL
from splitstream.router.auth.credentials import PrincipalsStore
from splitstream.router.auth.jwks import JwtVerifier, TokenRejected, bearer_token
from splitstream.router.auth.policy import Principal
from splitstream.router.auth.ratelimit import RateLimiter
from splitstream.router.auth.revocation import REVOKED_MESSAGE, RevocationStore

log = structlog.get_logger()

API_KEY_HEADER = "x-api-key"
AUTHORIZATION_HEADER = "authorization"
#: The headers that carry a credential (lower case): what an edge hands to :meth:`Gate.admit`.
CREDENTIAL_HEADERS = frozenset({API_KEY_HEADER, AUTHORIZATION_HEADER})

#: Grants a principal holds beside its models (:class:`~splitstream.router.auth.policy.Principal` fields).
STATUS = "status"
FEEDBACK = "feedback"
RELOAD = "reload"

FAILURE_REASONS = (
    "missing",
    "ambiguous",
    "api_key",
    "malformed",
    "algorithm",
    "unknown_key",
    "expired",
    "not_yet_valid",
    "audience",
    "issuer",
    "missing_claim",
    "signature",
    "invalid",
    "unknown_principal",
    "model",
    "pin",
    "status",
    "feedback",
    "reload",
    "bad_request",
    "route",
    "revoked",
)

Metadata = Sequence[tuple[str, str | bytes]]


class AuthMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.failures = Counter(
            "splitstream_router_auth_failures",
            "Calls refused by caller authentication (UNAUTHENTICATED) or authorization (PERMISSION_DENIED), by reason",
            ["code", "reason"],
            registry=registry,
        )
        self.allowed = Counter(
            "splitstream_router_auth_calls", "Calls let through, by principal", ["principal"], registry=registry
        )
        self.rate_limited = Counter(
            "splitstream_router_auth_rate_limited",
            "Calls refused RESOURCE_EXHAUSTED by the principal's rate limit, by principal",
            ["principal"],
            registry=registry,
        )
        self.reloads = Counter(
            "splitstream_router_auth_reloads",
            "Principals documents read: ok, or error (the last good one kept)",
            ["result"],
            registry=registry,
        )
        self.principals = Gauge(
            "splitstream_router_auth_principals",
            "Principals in the document in force",
            registry=registry,
            multiprocess_mode="livemax",  # --processes: every child reads the same document
        )


@dataclass(frozen=True, slots=True)
class Refusal:
    code: grpc.StatusCode
    message: str
    reason: str
    #: Over a rate limit: seconds until the principal's bucket holds a token again, and whose bucket it is.
    retry_after_s: float | None = None
    principal: str = ""


class Refused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


def unauthenticated(message: str, reason: str) -> Refused:
    return Refused(Refusal(grpc.StatusCode.UNAUTHENTICATED, message, reason))


def denied(message: str, reason: str) -> Refused:
    return Refused(Refusal(grpc.StatusCode.PERMISSION_DENIED, message, reason))


def _looks_like_jwt(value: str) -> bool:
    """A JWS in compact form is three base64url parts joined by dots; an API key (``token_urlsafe``) has none."""
    return value.count(".") == 2


class Authenticator:
    """Credentials → principal; knows nothing of servers (header pairs in, a principal out)."""

    def __init__(
        self, store: PrincipalsStore, *, jwt: JwtVerifier | None, api_keys: bool, limiter: RateLimiter
    ) -> None:
        self.store = store
        self.jwt = jwt
        self.api_keys = api_keys
        self.limiter = limiter
        #: ``--revoked-file``: credentials refused before they expire (None: no list).
        self.revocations: RevocationStore | None = None

    def _accepted(self) -> str:
        forms = []
        if self.api_keys:
            forms.append(f"an API key in '{API_KEY_HEADER}' or '{AUTHORIZATION_HEADER}: Bearer ...'")
        if self.jwt is not None:
            forms.append(f"a JWT in '{AUTHORIZATION_HEADER}: Bearer ...'")
        return " or ".join(forms)

    async def authenticate(self, metadata: Metadata) -> Principal:
        keys = [v for k, v in metadata if k == API_KEY_HEADER and isinstance(v, str)]
        bearer = bearer_token([v for k, v in metadata if k == AUTHORIZATION_HEADER and isinstance(v, str)])
        if keys and bearer is not None and (self.api_keys or self.jwt is not None):
            raise unauthenticated(
                f"send one credential: both '{API_KEY_HEADER}' and '{AUTHORIZATION_HEADER}' were sent", "ambiguous"
            )
        policy = self.store.policy
        assert policy is not None  # loaded before serving
        if self.api_keys and keys:
            principal = policy.by_api_key(keys[0].strip())
            if principal is None:
                raise unauthenticated(f"the API key in '{API_KEY_HEADER}' is not valid", "api_key")
            return principal
        if bearer is not None:
            principal = policy.by_api_key(bearer) if self.api_keys else None
            if principal is not None:
                return principal
            if self.jwt is not None and (_looks_like_jwt(bearer) or not self.api_keys):
                try:
                    name = await self.jwt.verify(bearer)
                except TokenRejected as error:
                    raise unauthenticated(str(error), error.reason) from None
                principal = policy.principals.get(name)
                if principal is None:
                    raise denied(
                        f"principal '{name}' is not in the router's principals document (no grants)",
                        "unknown_principal",
                    )
                return principal
            if self.api_keys:
                raise unauthenticated(f"the API key in '{AUTHORIZATION_HEADER}: Bearer' is not valid", "api_key")
        raise unauthenticated(f"no credentials: send {self._accepted()}", "missing")


class Gate:
    """Authentication, rate limits and grants for one call, whichever port it came in on."""

    def __init__(self, authenticator: Authenticator, metrics: AuthMetrics) -> None:
        self.auth = authenticator
        self.metrics = metrics

    async def admit(self, metadata: Metadata) -> Principal:
        """The caller's principal, once it is authenticated and within its rate limit; Refused otherwise
        (not counted yet: the edge counts with :meth:`count`, once, whatever refused the call)."""
        principal = await self.auth.authenticate(metadata)
        if self.auth.revocations is not None:
            entry = self.auth.revocations.check(principal, metadata)
            if entry is not None:  # the caller is told nothing of the list; the log says which entry
                log.warning("revoked credential refused", principal=principal.name, entry=entry)
                raise unauthenticated(REVOKED_MESSAGE, "revoked")
        if not self.auth.limiter.allow(principal):
            limit = principal.rate_limit
            assert limit is not None
            raise Refused(
                Refusal(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"principal '{principal.name}' is over its rate limit ({limit.per_s:g}/s, burst {limit.burst})",
                    "rate_limited",
                    retry_after_s=self.auth.limiter.retry_after_s(principal),
                    principal=principal.name,
                )
            )
        return principal

    @staticmethod
    def require(principal: Principal, grant: str) -> None:
        """PERMISSION_DENIED unless ``principal`` holds ``grant`` (:data:`STATUS`, :data:`FEEDBACK`, :data:`RELOAD`)."""
        if grant == STATUS and not principal.status:
            raise denied(f"principal '{principal.name}' may not read Status", "status")
        if grant == FEEDBACK and not principal.feedback:
            raise denied(f"principal '{principal.name}' may not report feedback", "feedback")
        if grant == RELOAD and not principal.reload:
            raise denied(f"principal '{principal.name}' may not reload the credentials", "reload")

    @staticmethod
    def check_model(principal: Principal, model: str, *, pinned: bool) -> None:
        """PERMISSION_DENIED unless ``principal`` may call ``model`` (and pin a version, when ``pinned``)."""
        if not principal.may_call(model):
            raise denied(f"principal '{principal.name}' may not call model '{model}'", "model")
        if pinned and not principal.pin:
            raise denied(
                f"principal '{principal.name}' may not pin a version ({VERSION_HEADER} or model_version)", "pin"
            )

    def count(self, refusal: Refusal) -> None:
        """Count one refused call: by reason, or under its principal's name when over its rate limit."""
        if refusal.reason == "rate_limited":
            self.metrics.rate_limited.labels(refusal.principal).inc()
        else:
            self.metrics.failures.labels(refusal.code.name, refusal.reason).inc()

    def let_through(self, principal: Principal) -> None:
        """The call goes on as ``principal``: counted, and its name set for the record (this task and those
        it starts)."""
        CALL_PRINCIPAL.set(principal.name)
        self.metrics.allowed.labels(principal.name).inc()
