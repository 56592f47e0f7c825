"""Who may do what: the principals document, its schema, and the grants each principal holds.

One document lists every principal the router knows (``--auth-principals``), whichever way it
authenticates: an API key (its SHA-256 is listed here) or a JWT (its principal claim names an
entry here). A caller whose name is not listed holds no grant at all, so the principals, and
with them every metric label that names one, are a bounded, configured set::

    principals:
      web-frontend:
        api_keys_sha256: [9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08]
        models: [digits]           # model names, or "*" for every model
        pin: false                 # may pin a version (x-splitstream-version or model_version)
        status: false              # may call splitstream.v1.Router/Status
        feedback: true             # may call splitstream.v1.Feedback/Report
        reload: false              # may call splitstream.v1.Router/ReloadCredentials
        rate_limit: {per_s: 50, burst: 100}   # optional token bucket
      ci-replayer:                 # a JWT principal (sub claim): no API key
        models: ["*"]
        pin: true

Keys are stored as HMAC-SHA256 keyed with a server secret (``--api-key-secret-file``;
``api_keys_hmac_sha256``, written by ``splitstream keys add``), not a slow password hash: a slow hash
would cost every call milliseconds or more (docs/security.md has the figures), and with the secret kept
apart from the document a leaked document no longer lets anyone test guesses of a human-chosen key.
Unsalted SHA-256 entries (``api_keys_sha256``) are still read for one release, with a warning. The
presented key's digest is looked up (:meth:`Policy.by_api_key` says why that is safe).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator

from splitstream.common.errors import ConfigError
from splitstream.common.names import check_model_name
from splitstream.common.schema import Document, Flag, validate

#: Every model, in a principal's ``models``.
ANY_MODEL = "*"
#: A principal's name: it goes into records, logs and metric labels, so it is short and plain.
_PRINCIPAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:/+-]{0,127}\Z")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def check_principal_name(name: str) -> str:
    """Raise ValueError unless ``name`` may name a principal (letters, digits, ``._@:/+-``, at most 128)."""
    if not _PRINCIPAL_NAME.match(name):
        raise ValueError(
            "a principal's name is 1 to 128 letters, digits or ._@:/+- characters, starting with a letter or digit"
        )
    return name


def _digest(value: str) -> str:
    if not _SHA256_HEX.fullmatch(value):
        raise ValueError("must be the SHA-256 of an API key as 64 lower-case hex digits (sha256sum prints it)")
    return value


def _model(value: str) -> str:
    if value != ANY_MODEL:
        check_model_name(value)
    return value


class RateLimitDocument(Document):
    """A token bucket: ``burst`` calls at once, then ``per_s`` a second."""

    per_s: Annotated[float, Field(gt=0, description="calls a second, on average (refill rate)")]
    burst: Annotated[int, Field(ge=1, description="calls allowed at once (bucket size)")]


class PrincipalDocument(Document):
    """One caller: how it authenticates (API keys; a JWT names it by its principal claim) and what it may do."""

    api_keys_sha256: list[Annotated[str, AfterValidator(_digest)]] = Field(
        [],
        description="deprecated (read for one more release): unsalted SHA-256 (64 lower-case hex digits) of each "
        "API key it may send; use `api_keys_hmac_sha256` (`splitstream keys add`)",
    )
    api_keys_hmac_sha256: list[Annotated[str, AfterValidator(_digest)]] = Field(
        [],
        description="HMAC-SHA256 (64 lower-case hex digits), keyed with the router's `--api-key-secret-file`, of "
        "each API key it may send; written by `splitstream keys add`",
    )
    models: list[Annotated[str, AfterValidator(_model)]] = Field(
        [], description="models it may call (ModelInfer, ModelMetadata, ModelReady): names, or `*` for every one"
    )
    pin: Flag = Field(False, description="may pin a version (`x-splitstream-version` or `model_version`)")
    status: Flag = Field(False, description="may call `splitstream.v1.Router/Status` (salts, worker addresses)")
    feedback: Flag = Field(False, description="may call `splitstream.v1.Feedback/Report`")
    reload: Flag = Field(
        False,
        description="may call `splitstream.v1.Router/ReloadCredentials` (`splitstream credentials reload`): the "
        "JWKS, revocation list and principals read again now",
    )
    rate_limit: RateLimitDocument | None = Field(
        None, description="calls refused RESOURCE_EXHAUSTED past it (per router); null: no limit"
    )


class PrincipalsDocument(Document):
    """Every principal the router knows, by name (its name is what records, logs and metrics show)."""

    principals: dict[Annotated[str, AfterValidator(check_principal_name)], PrincipalDocument] = Field(
        description="principal name (1-128 of letters, digits, `._@:/+-`) → its credentials and grants"
    )

    @model_validator(mode="after")
    def _keys_are_unique(self) -> PrincipalsDocument:
        owner: dict[str, str] = {}
        for name, principal in self.principals.items():
            for digest in [*principal.api_keys_sha256, *principal.api_keys_hmac_sha256]:
                if owner.setdefault(digest, name) != name:
                    raise ValueError(f"one API key is listed for both '{owner[digest]}' and '{name}'")
        return self


@dataclass(frozen=True, slots=True)
class RateLimit:
    per_s: float
    burst: int


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller and what it may do."""

    name: str
    models: frozenset[str]
    pin: bool = False
    status: bool = False
    feedback: bool = False
    reload: bool = False
    rate_limit: RateLimit | None = None

    def may_call(self, model: str) -> bool:
        return ANY_MODEL in self.models or model in self.models


@dataclass(frozen=True, slots=True)
class Policy:
    """One version of the principals document, ready for lookups."""

    principals: Mapping[str, Principal]
    #: SHA-256 hex of an API key → the principal's name (deprecated unsalted entries).
    key_owners: Mapping[str, str]
    #: HMAC-SHA256 hex of an API key (keyed with :attr:`hmac_secret`) → the principal's name.
    hmac_owners: Mapping[str, str] = field(default_factory=dict)
    #: ``--api-key-secret-file``'s secret, set by the store that loads the document (b"": none).
    hmac_secret: bytes = field(default=b"", repr=False)

    def by_api_key(self, key: str) -> Principal | None:
        """The principal ``key`` belongs to, or None.

        A lookup by digest rather than a constant-time comparison with each stored digest: what a
        lookup's timing can reveal is how much of the *SHA-256 of the caller's own guess* matches a
        stored digest, which brings no preimage closer (the reason constant-time comparison matters
        for raw secrets does not hold for their digests), and it costs the same for 10 keys or 10,000."""
        raw = key.encode("utf-8", "surrogatepass")
        owner = None
        if self.hmac_owners and self.hmac_secret:
            owner = self.hmac_owners.get(hmac.new(self.hmac_secret, raw, hashlib.sha256).hexdigest())
        if owner is None and self.key_owners:
            owner = self.key_owners.get(hashlib.sha256(raw).hexdigest())
        return None if owner is None else self.principals[owner]


EMPTY_POLICY = Policy(principals={}, key_owners={})


def parse_policy(data: Any, *, source: str) -> Policy:
    """The policy in a parsed document; ConfigError naming ``source`` and the field at fault."""
    if data is None:
        raise ConfigError(f"{source}: the document is empty (expected 'principals:')")
    document = validate(PrincipalsDocument, data, where=source)
    principals: dict[str, Principal] = {}
    owners: dict[str, str] = {}
    hmac_owners: dict[str, str] = {}
    for name, entry in document.principals.items():
        limit = entry.rate_limit
        principals[name] = Principal(
            name=name,
            models=frozenset(entry.models),
            pin=entry.pin,
            status=entry.status,
            feedback=entry.feedback,
            reload=entry.reload,
            rate_limit=None if limit is None else RateLimit(limit.per_s, limit.burst),
        )
        for digest in entry.api_keys_sha256:
            owners[digest] = name
        for digest in entry.api_keys_hmac_sha256:
            hmac_owners[digest] = name
    return Policy(principals=principals, key_owners=owners, hmac_owners=hmac_owners)
