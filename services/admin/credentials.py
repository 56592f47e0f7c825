"""``splitstream credentials reload``: routers read their credentials again now, from wherever the operator is.

SIGHUP does it on the router's host (``kill -HUP``); a signal reaches no other host, and a router in a
container or behind a scheduler has no pid an operator can name. So the same reload is an RPC,
``splitstream.v1.Router/ReloadCredentials``, on the port callers already use, under the same
authentication and TLS: the caller's principal needs the ``reload`` grant. One call per ``--router``
reloads all of that router's processes (``--processes N``: the child that takes it has the supervisor
signal every child). The answer shows the JWKS key ids now in force, so an operator who withdrew a
signing key sees it gone.

Exit codes: 0 every router reloaded; 1 a router refused or could not be reached (each named on stderr,
the others still asked); 2 a usage error (one line).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import grpc

from splitstream.common.addresses import check_address
from splitstream.common.errors import ConfigError
from splitstream.common.proto.splitstream.v1 import router_pb2, router_pb2_grpc
from splitstream.common.tls import client_tls_from_args

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
PROG = "splitstream credentials reload"
#: The credential's variable when no --api-key-file is given.
API_KEY_ENV = "SPLITSTREAM_ADMIN_API_KEY"


def add_parser(commands: Any, *, env_prefix: str) -> None:
    """Register ``credentials reload`` on the admin CLI's subcommands."""
    credentials = commands.add_parser(
        "credentials", env_prefix=env_prefix, help="routers' credentials: read the JWKS and revocations again now"
    )
    actions = credentials.add_subparsers(dest="action", required=True, metavar="ACTION")
    reload = actions.add_parser(
        "reload",
        env_prefix=env_prefix,
        help="make routers read their JWKS, revocation list and principals now (SIGHUP's reload, over gRPC)",
        description=(
            "Call splitstream.v1.Router/ReloadCredentials on every --router: each reads its JWKS, revocation "
            "list and file: principals document again, in all its processes, and answers with the JWKS key ids "
            "now in force. The caller's principal needs the reload grant. Exit 0: every router reloaded; 1: one "
            "refused or was unreachable; 2: usage error."
        ),
    )
    reload.add_argument(
        "--router",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="a router's gRPC address (repeat for every router)",
    )
    reload.add_argument(
        "--api-key-file",
        default="",
        help=f"file holding the API key (or JWT) of a principal with the reload grant (else {API_KEY_ENV})",
    )
    reload.add_argument("--timeout-s", type=float, default=40.0, help="deadline of each router's reload")


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The exit code (see the module docstring)."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        routers = [_address(router) for router in args.router]
        if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
            raise ValueError(f"--timeout-s: must be a finite number of seconds > 0, got {args.timeout_s}")
        credential = read_credential(args.api_key_file)
        tls = client_tls_from_args(args, flag="--tls")  # the admin CLI's shared --tls* flags
    except (ValueError, ConfigError) as error:
        print(f"{PROG}: error: {error}", file=err)
        return EXIT_USAGE
    metadata = credential_metadata(credential)
    code = EXIT_OK
    for router in routers:
        try:
            with tls.channel(router) as channel:
                reply = router_pb2_grpc.RouterStub(channel).ReloadCredentials(
                    router_pb2.ReloadCredentialsRequest(), metadata=metadata, timeout=args.timeout_s
                )
        except grpc.RpcError as error:
            status: Any = error  # a grpc.Call too: code() and details()
            print(f"{PROG}: error: router {router}: {status.code().name}: {status.details()}", file=err)
            code = EXIT_FAILED
            continue
        print(_summary(router, reply), file=out)
    return code


def _address(text: str) -> str:
    try:
        return check_address(text)
    except ValueError as error:
        raise ValueError(f"--router: {error}") from None


def read_credential(path: str) -> str:
    """The API key or JWT the admin CLI sends to routers (``--api-key-file``, else ``SPLITSTREAM_ADMIN_API_KEY``);
    ValueError naming the flag, never the content. Empty: none (a router that authenticates refuses the call)."""
    if not path:
        return os.environ.get(API_KEY_ENV, "").strip()
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-key-file {path}: {getattr(error, 'strerror', None) or error}") from None
    if not value:
        raise ValueError(f"--api-key-file {path}: the file is empty")
    return value


def credential_metadata(credential: str) -> list[tuple[str, str]]:
    """``authorization: Bearer`` (an API key or a JWT, as the router reads both), or nothing."""
    return [("authorization", f"Bearer {credential}")] if credential else []


def _summary(router: str, reply: router_pb2.ReloadCredentialsResponse) -> str:
    processes = f"{reply.processes} processes" if reply.processes != 1 else "1 process"
    keys = ", ".join(reply.jwks_key_ids) if reply.jwks_key_ids else "none"
    return (
        f"{router}: reloaded ({reply.router_id}, {processes}); JWKS key ids: {keys}; "
        f"revocation entries: {reply.revoked_entries}"
    )
