"""Experiments: which version of a model serves which share of traffic.

Assignment contract (ARCHITECTURE.md): ``bucket = xxh3_64(salt, key) mod 10000``;
arms own contiguous bucket ranges. The control arm is laid first (from bucket 0)
and the other arms follow in version order, so the layout depends only on the
weights, never on the order arms were written in a file. In a two-arm
experiment the control grows from the bottom and the candidate from the top:
raising either arm's weight only adds buckets to it, so no key ever moves away
from the arm that grew. Same key → same arm on every router, across restarts.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import xxhash
from pydantic import Field, StringConstraints

from splitstream.common.errors import ConfigError
from splitstream.common.headers import DEFAULT_ROUTING_KEY_HEADER
from splitstream.common.schema import Document, validate

BUCKETS = 10_000
_METADATA_KEY = re.compile(r"[0-9a-z_.-]+")

#: A version name as written in a document: a non-empty string. ``version: 2`` is refused rather than
#: coerced, because YAML reads ``1.10`` as the float 1.1 and coercion would silently name another version.
VersionName = Annotated[str, StringConstraints(min_length=1)]


class ArmDocument(Document):
    """One arm: a version and its share of the traffic."""

    version: VersionName = Field(description='a version of the model, e.g. `v2` (a string: quote `"2"`)')
    weight: Annotated[float, Field(ge=0)] = Field(
        description="percent of the traffic, >= 0, at most 2 decimals; the arms sum to 100 "
        '(a number: `true`, `"10"`, `.nan` and `.inf` are refused)'
    )


class ShadowDocument(Document):
    """A version that gets a sampled copy of the calls after the client has its answer."""

    version: VersionName = Field(description="the shadow version; it may not take live traffic (weight > 0)")
    sample_rate: Annotated[float, Field(ge=0, le=1)] = Field(1.0, description="fraction of the calls copied, 0..1")


class ExperimentDocument(Document):
    """An experiment as the file's ``experiment:`` block and Consul's KV JSON write it.

    ``null`` means "the default" for the optional fields, as leaving the key out does. In Consul, the
    value ``{"remove": true}`` instead of an experiment takes the model out of every router.
    """

    model: str | None = Field(None, description="the model's name (Consul's JSON may repeat it); not used")
    salt: str | None = Field(None, description="hash salt; changing it reshuffles every key; null: the model name")
    control: VersionName = Field(description="the arm that takes the traffic of versions without a healthy endpoint")
    arms: Annotated[list[ArmDocument], Field(min_length=1)] = Field(description="the split, at least one arm")
    shadows: list[ShadowDocument] | None = Field(None, description="shadow copies; null: none")
    routing_key_header: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] | None = Field(
        None, description="header carrying the sticky key; null: `x-routing-key`"
    )


def _number(value: float) -> float:
    """90.0 → 90, so a weight read as an integer is written back as one (admin output, YAML edits)."""
    return int(value) if value.is_integer() else value


@dataclass(frozen=True, kw_only=True)
class Arm:
    version: str
    weight: float  # percent
    bucket_start: int = 0
    bucket_end: int = 0  # exclusive


@dataclass(frozen=True, kw_only=True)
class Shadow:
    version: str
    sample_rate: float  # 0..1


@dataclass(frozen=True, kw_only=True)
class Phase:
    """The experiment as an A/B analysis sees it: units are compared only within one phase.

    ``id`` is :func:`phase_id` of the salt, control and weights, so every router (and every restart)
    names the same experiment alike, and any change of salt, control, arms or weights starts a new one."""

    id: str
    weights: tuple[tuple[str, float], ...]  # (version, percent) in version order, weight-0 arms included
    control: str


def phase_id(salt: str, control: str, weights: Sequence[tuple[str, float]]) -> str:
    """First 16 hex digits of SHA-256 over a fixed encoding of the experiment's randomization.

    The encoding (documented, so other tools can recompute it) is the UTF-8 of the compact JSON array
    ``["splitstream-phase/1", salt, control, [[version, basis_points], ...]]``: arms sorted by version
    (code point order), each weight as an integer number of basis points (``round(percent * 100)``,
    so 50, 50.0 and 50.00 are one weight), arms at weight 0 included (adding one at 0 % changes
    nothing a unit sees, but it is a different experiment to the people running it)."""
    arms = sorted((version, round(weight * 100)) for version, weight in weights)
    encoded = json.dumps(["splitstream-phase/1", salt, control, [list(arm) for arm in arms]], separators=(",", ":"))
    return hashlib.sha256(encoded.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """A validated experiment with its bucket layout computed once."""

    model: str
    salt: str
    control: str
    arms: tuple[Arm, ...]
    shadows: tuple[Shadow, ...] = ()
    routing_key_header: str = DEFAULT_ROUTING_KEY_HEADER
    _bucket_ends: tuple[int, ...] = field(default=(), repr=False, compare=False)
    #: Computed once by :meth:`build` (every record a router writes carries it).
    phase: Phase = field(default=Phase(id="", weights=(), control=""), compare=False)

    @classmethod
    def build(
        cls,
        *,
        model: str,
        salt: str,
        control: str,
        arms: Sequence[tuple[str, float]],
        shadows: Sequence[tuple[str, float]] = (),
        routing_key_header: str = DEFAULT_ROUTING_KEY_HEADER,
    ) -> Experiment:
        """Validate and lay out an experiment; raises ConfigError naming what is wrong."""
        where = f"experiment for model '{model}'"
        if not arms:
            raise ConfigError(f"{where}: arms: needs at least one arm")
        versions = [version for version, _ in arms]
        duplicates = sorted({v for v in versions if versions.count(v) > 1})
        if duplicates:
            raise ConfigError(f"{where}: arms: version(s) {duplicates} appear in more than one arm")
        if control not in versions:
            raise ConfigError(f"{where}: control '{control}' is not one of the arms {versions}")
        buckets: dict[str, int] = {}
        for index, (version, weight) in enumerate(arms):
            if (
                isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not math.isfinite(weight)
                or weight < 0
            ):
                raise ConfigError(f"{where}: arms[{index}].weight: arm '{version}' needs a number >= 0, got {weight!r}")
            share = round(weight * BUCKETS / 100)
            if abs(share - weight * BUCKETS / 100) > 1e-6:
                raise ConfigError(
                    f"{where}: arms[{index}].weight: arm '{version}' weight {weight} is finer than 0.01 %"
                )
            buckets[version] = share
        if sum(buckets.values()) != BUCKETS:
            total = sum(weight for _, weight in arms)
            raise ConfigError(f"{where}: arms: arm weights must sum to 100, got {total:g}")
        for index, (version, rate) in enumerate(shadows):
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
                raise ConfigError(
                    f"{where}: shadows[{index}].sample_rate: shadow '{version}' needs a rate within 0..1, got {rate!r}"
                )
            if version in versions and dict(arms)[version] > 0:
                raise ConfigError(f"{where}: shadows[{index}].version: '{version}' also takes live traffic as an arm")
        header = routing_key_header.strip().lower()
        if not header:
            raise ConfigError(f"{where}: routing_key_header: must not be empty")
        # No call can carry a header gRPC refuses as a key (a space, say), and a -bin header's value is bytes:
        # every call would go unkeyed, split at random, and stickiness be lost without a word.
        if not _METADATA_KEY.fullmatch(header) or header.startswith("grpc-") or header.endswith("-bin"):
            raise ConfigError(
                f"{where}: routing_key_header: {routing_key_header!r} is not a header a call can carry as its key "
                "(gRPC metadata keys are 0-9 a-z - _ . ; not grpc-*, not *-bin)"
            )
        ordered = [control, *sorted(v for v in versions if v != control)]
        laid: list[Arm] = []
        start = 0
        weights = dict(arms)
        for version in ordered:
            end = start + buckets[version]
            laid.append(Arm(version=version, weight=weights[version], bucket_start=start, bucket_end=end))
            start = end
        return cls(
            model=model,
            salt=salt,
            control=control,
            arms=tuple(laid),
            shadows=tuple(Shadow(version=v, sample_rate=r) for v, r in shadows),
            routing_key_header=header,
            _bucket_ends=tuple(arm.bucket_end for arm in laid),
            phase=Phase(
                id=phase_id(salt, control, list(weights.items())),
                weights=tuple(sorted(weights.items())),
                control=control,
            ),
        )

    @classmethod
    def from_mapping(cls, model: str, data: Any) -> Experiment:
        """Build from the registry's mapping form (YAML file or Consul KV JSON); raises ConfigError
        naming the field (``arms[1].weight: ...``) for any value of any type that does not fit."""
        document = validate(ExperimentDocument, data, where=f"experiment for model '{model}'")
        return cls.from_document(model, document)

    @classmethod
    def from_document(cls, model: str, document: ExperimentDocument) -> Experiment:
        """Lay out a schema-valid experiment; the checks across fields (sum, control) raise ConfigError."""
        return cls.build(
            model=model,
            salt=document.salt if document.salt is not None else model,
            control=document.control,
            arms=[(arm.version, _number(arm.weight)) for arm in document.arms],
            shadows=[(shadow.version, shadow.sample_rate) for shadow in document.shadows or ()],
            routing_key_header=document.routing_key_header or DEFAULT_ROUTING_KEY_HEADER,
        )

    def to_mapping(self) -> dict[str, Any]:
        return {
            "salt": self.salt,
            "control": self.control,
            "arms": [{"version": a.version, "weight": a.weight} for a in self.arms],
            "shadows": [{"version": s.version, "sample_rate": s.sample_rate} for s in self.shadows],
            "routing_key_header": self.routing_key_header,
        }

    @property
    def versions(self) -> tuple[str, ...]:
        return tuple(arm.version for arm in self.arms)

    def bucket(self, key: str | bytes) -> int:
        """The key's bucket in 0..9999 (stable across processes and restarts)."""
        data = key.encode() if isinstance(key, str) else key
        return xxhash.xxh3_64_intdigest(self.salt.encode() + b"\x00" + data) % BUCKETS

    def assign(self, key: str | bytes | None) -> str:
        """The version serving ``key``; without a key, a random draw by weight."""
        bucket = random.randrange(BUCKETS) if key is None else self.bucket(key)
        for arm, end in zip(self.arms, self._bucket_ends, strict=True):
            if bucket < end:
                return arm.version
        return self.control  # unreachable: the ends cover 0..9999
