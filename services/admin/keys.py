"""``splitstream keys add PRINCIPAL``: a new random API key, shown once, its HMAC written to the document.

The key is made here (``secrets.token_urlsafe(32)``: 256 bits), so no human picks it; it is printed
once on stdout and never stored: the principals document receives only its HMAC-SHA256 keyed with
the routers' ``--api-key-secret-file`` (:mod:`splitstream.router.auth.keys`). The document is edited
in round-trip mode (comments, order and style stay), checked as the router checks it, and replaced
atomically, so a router polling it never reads half a file. A principal not in the document is added
with no grant (``models: []``) unless ``--model`` names some.

Exit codes: 0 the key was added; 2 a usage error (one line naming the flag or the document's problem).
"""

from __future__ import annotations

import argparse
import io
import secrets
import sys
from pathlib import Path
from typing import Any, TextIO

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError as RoundTripError

from splitstream.common.errors import ConfigError
from splitstream.common.files import atomic_write
from splitstream.router.auth.keys import api_key_digest, read_api_key_secret
from splitstream.router.auth.policy import check_principal_name, parse_policy

USAGE = 2


def add_parser(commands: Any, *, env_prefix: str) -> None:
    """Register ``keys add`` on the admin CLI's subcommands."""
    keys = commands.add_parser("keys", env_prefix=env_prefix, help="manage the API keys of the principals document")
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser(
        "add",
        env_prefix=env_prefix,
        help="make a random API key for PRINCIPAL, print it once, and write its HMAC into the principals document",
    )
    add.add_argument("principal", help="the principal's name (added with no grant when the document lacks it)")
    add.add_argument("--principals", required=True, help="the principals document to edit (a YAML or JSON file)")
    add.add_argument("--api-key-secret-file", required=True, help="the routers' --api-key-secret-file (keys the HMAC)")
    add.add_argument(
        "--model", action="append", default=[], help="a model a new principal may call (repeatable; * for every one)"
    )


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        key = add_key(Path(args.principals), args.principal, read_api_key_secret(args.api_key_secret_file), args.model)
    except ConfigError as error:
        print(f"splitstream keys add: error: {error}", file=err)
        return USAGE
    print(key, file=out)
    print(
        f"added an API key for '{args.principal}' to {args.principals}: the key above is shown only now",
        file=err,
    )
    return 0


def add_key(path: Path, principal: str, secret: bytes, models: list[str]) -> str:
    """A new key for ``principal``, its digest written into the document at ``path``; ConfigError if the
    document cannot be read, edited or would not validate."""
    try:
        check_principal_name(principal)
    except ValueError as error:
        raise ConfigError(f"PRINCIPAL {principal!r}: {error}") from None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"--principals {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--principals {path}: not UTF-8 text") from None
    editor = YAML()
    editor.preserve_quotes = True
    try:
        document = editor.load(text)
    except RoundTripError as error:
        raise ConfigError(f"--principals {path}: not YAML ({' '.join(str(error).split())[:200]})") from None
    if document is None:
        document = CommentedMap()
    if not isinstance(document, dict):
        raise ConfigError(f"--principals {path}: the document is not a mapping (principals: ...)")
    principals = document.setdefault("principals", CommentedMap())
    if not isinstance(principals, dict):
        raise ConfigError(f"--principals {path}: 'principals' is not a mapping")
    entry = principals.get(principal)
    if entry is None:
        entry = principals[principal] = CommentedMap(models=CommentedSeq(models))
    elif not isinstance(entry, dict):
        raise ConfigError(f"--principals {path}: principal '{principal}' is not a mapping")
    elif models:
        raise ConfigError(f"--model: principal '{principal}' exists; edit its grants in {path}")
    key = secrets.token_urlsafe(32)
    digests = entry.setdefault("api_keys_hmac_sha256", CommentedSeq())
    if not isinstance(digests, list):
        raise ConfigError(f"--principals {path}: api_keys_hmac_sha256 of '{principal}' is not a list")
    digests.append(api_key_digest(secret, key))
    written = io.StringIO()
    editor.dump(document, written)
    parse_policy(yaml.safe_load(written.getvalue()), source=f"--principals {path}")  # as a router reads it
    atomic_write(path, written.getvalue())
    return key
