"""A service token never crosses a network in clear.

Whoever sees a router's Record stream to a plaintext recorder reads its ``authorization: Bearer``
token and can then write forged records; a recorder that takes the token over plaintext invites just
that. So a token is only sent to, or accepted on, a hop that is TLS, or that never leaves the machine
(loopback, a Unix socket: the demo and the tests, with no certificate to make). Otherwise the process
refuses to start (exit 2, one line), unless ``--allow-insecure-token`` says the operator knows why
(a network encrypted below gRPC, such as WireGuard or a mesh's sidecar on the same host).
"""

from __future__ import annotations

from splitstream.common.errors import ConfigError
from splitstream.common.loopback import is_local_listen_host, is_local_target

INSECURE_TOKEN_FLAG = "--allow-insecure-token"
INSECURE_TOKEN_HELP = (
    "send or accept a service token, API key or JWT over plaintext beyond loopback (refused by default: anyone "
    "who sees the traffic can reuse it); for a network already encrypted below gRPC, or TLS ended by a proxy"
)


def check_token_sent(*, token: str, target: str, tls: bool, allow_insecure: bool, flag: str = "--recorder") -> None:
    """ConfigError unless a token sent to ``target`` travels over TLS or stays on this machine."""
    if token and not tls and not allow_insecure and not is_local_target(target):
        raise ConfigError(
            f"{flag} {target}: the service token would be sent in clear to another host; turn on --recorder-tls "
            f"(the recorder with --grpc-use-ssl), or pass {INSECURE_TOKEN_FLAG}"
        )


def check_token_accepted(*, taken: bool, host: str, tls: bool, allow_insecure: bool, what: str = "") -> None:
    """ConfigError unless a server that takes a credential (``taken``) listens with TLS or on loopback only.
    ``what``: the flag that makes it take callers' credentials (the router's --auth-principals); empty: the
    service token."""
    if taken and not tls and not allow_insecure and not is_local_listen_host(host):
        credential = f"{what}: callers' API keys and JWTs" if what else f"--host {host}: the service token"
        where = f" (--host {host})" if what else ""
        raise ConfigError(
            f"{credential} would be accepted in clear from other hosts{where}; serve TLS (--grpc-use-ssl), listen "
            f"on loopback, or pass {INSECURE_TOKEN_FLAG}"
        )
