"""Where routers learn endpoints and experiments: one interface, several backends."""

from splitstream.common.registry.base import ModelEntry, OpenAIUpstream, Registry, RegistryState, RegistryUpdate
from splitstream.common.registry.consul import ConsulRegistry, parse_consul_spec
from splitstream.common.registry.file import FileRegistry, parse_registry

__all__ = [
    "ConsulRegistry",
    "FileRegistry",
    "ModelEntry",
    "OpenAIUpstream",
    "Registry",
    "RegistryState",
    "RegistryUpdate",
    "parse_consul_spec",
    "parse_registry",
]
