"""The routing table: for each model, its experiment and one pool per version.

A table is immutable once built; a registry change builds a new one and swaps
it in with one assignment, so a request sees either the old or the new state,
never a mix. Endpoints (channels, health, load counters) carry over between
tables by address, so a reload drops no connection and no call in flight.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from splitstream.common.errors import ModelNotFound, ModelNotReady
from splitstream.common.experiment import Experiment
from splitstream.router.pools import PoolMember, VersionPool


class Assignment(enum.Enum):
    """How a call's arm was chosen (``CallRecord.assignment``). Only HASH and RANDOM are randomized:
    an A/B analysis compares arms on those alone, and counts pins, spills and retries apart."""

    HASH = "hash"  # the split, on the call's routing key
    RANDOM = "random"  # the split, for a call without a routing key
    PIN = "pin"  # the client pinned the version
    SPILL = "spill"  # the arm had no eligible endpoint: the control served
    RETRY = "retry"  # the arm answered UNAVAILABLE: retried on the control


@dataclass(frozen=True, slots=True)
class Route:
    """Where one call goes, and why."""

    version: str
    arm: str  # the version the split (or the pin) asked for
    pool: VersionPool
    pinned: bool
    fallback: bool  # served by the control because the arm had no eligible endpoint
    assignment: Assignment


@dataclass(frozen=True, slots=True)
class ModelRoutes:
    experiment: Experiment
    pools: Mapping[str, VersionPool]

    def route(self, *, routing_key: str | None, pinned_version: str | None) -> Route:
        """Pick the version for one call. Raises ModelNotFound / ModelNotReady."""
        model = self.experiment.model
        if pinned_version:
            pool = self.pools.get(pinned_version)
            if pool is None:
                known = sorted(self.pools)
                raise ModelNotFound(f"model '{model}' has no version '{pinned_version}' (known: {known})")
            return Route(
                version=pinned_version,
                arm=pinned_version,
                pool=pool,
                pinned=True,
                fallback=False,
                assignment=Assignment.PIN,
            )
        arm = self.experiment.assign(routing_key)
        split = Assignment.RANDOM if routing_key is None else Assignment.HASH
        pool = self.pools.get(arm)
        if pool is not None and pool.has_eligible():
            return Route(version=arm, arm=arm, pool=pool, pinned=False, fallback=False, assignment=split)
        control = self.experiment.control
        control_pool = self.pools.get(control)
        if control_pool is None or not control_pool.has_eligible():
            raise ModelNotReady(f"model '{model}': no healthy endpoint for version '{arm}' or control '{control}'")
        spilled = arm != control
        return Route(
            version=control,
            arm=arm,
            pool=control_pool,
            pinned=False,
            fallback=spilled,
            assignment=Assignment.SPILL if spilled else split,
        )

    def fallback_after_failure(self, route: Route) -> Route | None:
        """Where to retry when the routed version has no other endpoint: the control, unless pinned."""
        control = self.experiment.control
        if route.pinned or route.version == control:
            return None
        pool = self.pools.get(control)
        if pool is None or not pool.has_eligible():
            return None
        return Route(
            version=control, arm=route.arm, pool=pool, pinned=False, fallback=True, assignment=Assignment.RETRY
        )


@dataclass(frozen=True, slots=True)
class RoutingTable:
    models: Mapping[str, ModelRoutes]
    endpoints: Mapping[tuple[str, str, str], PoolMember]  # (model, version, address) → endpoint

    def model(self, name: str) -> ModelRoutes:
        routes = self.models.get(name)
        if routes is None:
            if not name:
                raise ModelNotFound("request has no model_name")
            raise ModelNotFound(f"unknown model '{name}' (served: {sorted(self.models)})")
        return routes


EMPTY_TABLE = RoutingTable(models={}, endpoints={})
