"""What a gRPC address given to splitstream may be, checked alike wherever one enters.

Router flags (``--recorder``), replay targets and registry endpoints all name a
peer to dial. gRPC accepts nearly any string as a target and only fails when it
dials, so a typo (``recorder:80o3``, ``a b:8003``, ``host:99999``) would be
accepted and then retried for ever. It is refused where it is written instead.
"""

from __future__ import annotations


def check_address(text: str) -> str:
    """``text`` if it is ``host:port`` (port 1..65535, host without whitespace; ``[::1]:9001`` too) or
    ``unix:PATH``; else ValueError saying what was expected."""
    if text.startswith("unix:") and len(text) > len("unix:"):
        return text
    host, colon, port = text.rpartition(":")
    if colon and host and not any(c.isspace() for c in host) and port.isdigit() and 0 < int(port) < 65536:
        return text
    raise ValueError(f"expected host:port with a port within 1..65535 (or unix:PATH), got {text!r}")
