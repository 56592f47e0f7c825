"""The one rule both registry backends apply before a state may drop models.

A registry that suddenly lists fewer models is far more often a mistake than a
decision: an editor that truncates the file before writing it (a poll can land
in between), a config manager that rendered an empty template, ``models: {}``
pasted by accident. Applying it would answer every call NOT_FOUND. So a new
state is refused (reported like any invalid state; the router keeps its last
good one) when, compared with the last state accepted, it drops a model that is
serving (has at least one endpoint) — every model, or only some — unless each
such model is named as removed on purpose (the file's ``remove_models:``,
Consul's ``{"remove": true}`` experiment value). Dropping a model with no
endpoint at all is allowed: nothing routed to it worked anyway, and refusing it
would leave a router unhealthy for a model nobody can call (in Consul, an
experiment key deleted before any worker registered). The first state a router
reads has nothing to compare with and is not checked.
"""

from __future__ import annotations

from collections.abc import Collection

from splitstream.common.registry.base import RegistryState


def refused_removal(
    previous: RegistryState | None, new: RegistryState, *, removable: Collection[str] = (), how_to_remove: str = ""
) -> str | None:
    """Why ``new`` may not replace ``previous`` (None: it may)."""
    if previous is None:
        return None
    dropped = sorted(set(previous.models) - set(new.models) - set(removable))
    if not dropped:
        return None
    serving = [model for model in dropped if any(previous.models[model].endpoints.values())]
    if not serving:
        return None
    hint = f"; {how_to_remove}" if how_to_remove else ""
    if not new.models:
        return f"refused: it would drop every model ({', '.join(serving)}) and leave nothing to route{hint}"
    return f"refused: it would drop model(s) {', '.join(serving)}, which are serving{hint}"


class RemovalGuard:
    """Remembers the last accepted state so each new one is judged against it."""

    def __init__(self, *, how_to_remove: str) -> None:
        self.how_to_remove = how_to_remove
        self.accepted: RegistryState | None = None

    def check(self, new: RegistryState, *, removable: Collection[str] = ()) -> str | None:
        return refused_removal(self.accepted, new, removable=removable, how_to_remove=self.how_to_remove)

    def accept(self, state: RegistryState) -> None:
        self.accepted = state
