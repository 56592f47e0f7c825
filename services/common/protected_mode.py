"""Protected mode: a server others can reach must either encrypt or know who calls it.

Redis's model: a server bound beyond loopback with neither TLS nor caller authentication is one
anybody on the network can use (send inferences past the router's permissions, forge records) or
read. So such a server refuses to start (exit 2, one line naming what to add) unless ``--insecure``
says the operator knows why (a private network, a mesh sidecar doing mTLS on the same host, a
container network). The default ``--host 0.0.0.0`` counts as beyond loopback: the refusal is loud
at start rather than a server that silently stops being reachable after an upgrade. The demo and the
tests listen on ``127.0.0.1`` and need nothing.
"""

from __future__ import annotations

from splitstream.common.errors import ConfigError
from splitstream.common.loopback import is_local_listen_host

INSECURE_FLAG = "--insecure"
INSECURE_HELP = (
    "listen beyond loopback in plaintext with no caller authentication (refused by default: anyone who reaches "
    "the port can call it); for a network that is private or encrypted below gRPC. Router, recorder and worker; "
    "the archiver and shipper serve only health and start either way"
)
#: Where a server that must be reachable only by this machine's Prometheus exposes /metrics unless told.
DEFAULT_METRICS_HOST = "127.0.0.1"


def check_protected_mode(*, host: str, tls: bool, authenticated: bool, insecure: bool, auth_flag: str) -> None:
    """ConfigError unless a server on ``host`` serves TLS, authenticates its callers, listens on loopback,
    or was told ``--insecure``. ``auth_flag``: the flag that makes this server authenticate callers."""
    if not is_local_listen_host(host) and not (tls or authenticated or insecure):
        raise ConfigError(
            f"--host {host}: plaintext beyond loopback with no caller authentication, anyone who reaches the port "
            f"can call it; serve TLS (--grpc-use-ssl), add {auth_flag}, listen on --host 127.0.0.1, "
            f"or pass {INSECURE_FLAG}"
        )
