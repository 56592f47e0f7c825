"""Where routers learn endpoints and experiments: one interface, several backends."""

from splitstream.common.registry.base import ModelEntry, Registry, RegistryState, RegistryUpdate
from splitstream.common.registry.file import FileRegistry, parse_registry

__all__ = ["FileRegistry", "ModelEntry", "Registry", "RegistryState", "RegistryUpdate", "parse_registry"]
