"""Whether a peer is on this machine: where a credential may still travel in clear.

A token, API key or JWKS sent over plaintext can be read (or swapped) by anyone on the path; on
loopback or a Unix socket there is no path but the kernel. These helpers answer "is this hop local?"
for the checks that refuse plaintext credentials elsewhere.
"""

from __future__ import annotations

import ipaddress

#: Host names that resolve to loopback by convention (RFC 6761), without asking a resolver.
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost", "ip6-loopback"})


def is_loopback_host(host: str) -> bool:
    """``host`` (a name or address, IPv6 with or without brackets) is this machine's loopback."""
    host = host.strip().strip("[]").lower()
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_listen_host(host: str) -> bool:
    """A server bound to ``host`` (``--host``) takes connections from this machine only: loopback or a Unix
    socket. What protected mode and the service token's transport both ask of a listening server."""
    return host.startswith(("unix:", "unix-abstract:")) or is_loopback_host(host)


def is_local_target(target: str) -> bool:
    """A gRPC target (``host:port``, ``unix:PATH``, ``unix-abstract:NAME``, ``dns:///host:port``) that reaches
    only this machine."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        target = target.removeprefix(prefix)
    host, colon, _port = target.rpartition(":")
    return is_loopback_host(host if colon else target)
