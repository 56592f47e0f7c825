"""Secrets given on the command line: read from a file instead, and a deprecation warning meanwhile.

Every local user can read every process's command line (``ps``, ``/proc/PID/cmdline``), so an HMAC key
passed as ``--hmac-key KEY`` or a password inside ``--redis-url redis://:PW@host`` (or the router's
``--jwt-jwks https://user:PW@host/...``) is no secret on a shared machine. Secrets come from files
(``--hmac-key-file``, ``--redis-password-file``) or the environment; a secret on the command line
still works for one release, with a warning on stderr that names the flag and what to use instead
and never the value.

:class:`~splitstream.common.cli.EnvArgumentParser` applies both rules to every command: a flag added
with ``file_flag=`` gets that sibling flag (its file's content, surrounding whitespace removed,
becomes the flag's value), and :func:`note_secrets_on_command_line` runs after each parse. The warning
is held until the configuration is known to be valid (a usage error stays one line on stderr) and
given by :func:`give_warnings`: a service gives it once it listens (a JSON line in its log), and
the replayer on stderr once it has replayed successfully (a failed run's one error line stays the only
one).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from splitstream.common.secrets import redact_url

#: The variable a ``--processes`` child finds set: its parent has already warned.
_CHILD_ENV = "SPLITSTREAM_PROCESS_INDEX"


def _has_password(url: str) -> bool:
    return redact_url(url) != url


#: flag → (whether its value holds a secret, what to use instead; {prefix} is the command's variable prefix).
ARGV_SECRETS: dict[str, tuple[Callable[[str], bool], str]] = {
    "--hmac-key": (bool, "--hmac-key-file FILE or the SPLITSTREAM_HMAC_KEY variable"),
    "--redis-url": (
        _has_password,
        "a URL without the password and --redis-password-file FILE (or the {prefix}REDIS_PASSWORD variable), "
        "or the whole URL in {prefix}REDIS_URL",
    ),
    # The router sends a JWKS URL's userinfo as Basic auth: the same password in argv as a Redis URL's.
    "--jwt-jwks": (_has_password, "the whole URL in {prefix}JWT_JWKS, or file:PATH"),
}


def on_command_line(args: Sequence[str], flag: str) -> bool:
    """Whether ``flag`` (``--flag VALUE`` or ``--flag=VALUE``) is among ``args``, before any ``--``."""
    for arg in args:
        if arg == "--":
            return False
        if arg == flag or arg.startswith(flag + "="):
            return True
    return False


#: Warnings noted by the last parse and not given yet.
_pending: list[str] = []


def note_secrets_on_command_line(
    parser: argparse.ArgumentParser, args: Sequence[str], namespace: argparse.Namespace, prefix: str
) -> None:
    """Hold one warning for each secret ``parser``'s own flags took from ``args``: never its value."""
    if os.environ.get(_CHILD_ENV, "").isdigit():
        return
    for action in parser._actions:
        for flag in action.option_strings:
            rule = ARGV_SECRETS.get(flag)
            if rule is None or not on_command_line(args, flag):
                continue
            holds_secret, instead = rule
            value = getattr(namespace, action.dest, None)
            if isinstance(value, str) and holds_secret(value):
                _pending.append(
                    f"{parser.prog}: warning: a secret in {flag} on the command line is visible to every local "
                    f"user (ps, /proc/PID/cmdline); use {instead.format(prefix=prefix)} instead (deprecated: "
                    "refused in a later release)"
                )


def drop_warnings() -> None:
    """Forget the held warnings: the command exits on a usage error, whose one line is all it prints."""
    _pending.clear()


def give_warnings(log: Callable[[str], object] | None = None) -> None:
    """Give the held warnings: to ``log`` (a service's logger) or to stderr."""
    while _pending:
        line = _pending.pop(0)
        if log is None:
            print(line, file=sys.stderr)
        else:
            log(line)


def read_secret_file(flag: str, path: str) -> str:
    """The secret in ``path`` (surrounding whitespace removed), or ValueError naming ``flag`` (never the content)."""
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else "cannot be read as text"
        raise ValueError(f"{flag} {path}: {reason}") from None
    if not value:
        raise ValueError(f"{flag} {path}: the file is empty")
    return value
