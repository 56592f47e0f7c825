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


def check_base_url(text: str) -> str:
    """``text`` without a trailing ``/`` if it is an ``http://`` or ``https://`` base URL with a host (and a
    port within 1..65535 when one is written), such as ``http://10.0.0.5:8000/v1``; else ValueError saying
    what was expected. A user and password in the URL are refused, since a registry is shown in Status and
    logs: an API key is named with ``api_key_file`` or ``api_key_env`` instead."""
    from urllib.parse import urlsplit

    expected = "expected an http(s) base URL such as http://10.0.0.5:8000/v1"
    try:
        parts = urlsplit(text)
        port = parts.port  # ValueError for a port that is not a number or is out of range
    except ValueError:
        raise ValueError(expected) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in text):
        raise ValueError(expected)
    if port == 0:
        raise ValueError(expected)
    if parts.username is not None or parts.password is not None:
        raise ValueError("no credentials in a URL: name the API key with api_key_file or api_key_env")
    if parts.query or parts.fragment:
        raise ValueError("a base URL has no query or fragment (the router appends /chat/completions)")
    return text.rstrip("/")
