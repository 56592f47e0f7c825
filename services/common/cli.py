"""Command-line helpers shared by every command's entry point.

Each flag can also come from an environment variable ``SPLITSTREAM_<SERVICE>_<FLAG>``
(``--metrics-port`` of the router → ``SPLITSTREAM_ROUTER_METRICS_PORT``), which is
how containers are configured. A flag given on the command line wins.

Flags that carry secrets (HMAC keys, URLs that may hold a password) are marked once,
``add_argument(..., secret=True)``: their help says whether the variable is set but
never shows its value, and no error message quotes it. ``file_flag="--x-file"`` adds a
flag naming a file that holds the secret; one given on the command line draws a
deprecation warning (:mod:`splitstream.common.argv_secrets`).

A repeatable flag (``action="append"``) reads its variable as a comma-separated list
(``SPLITSTREAM_REPLAY_MODEL=a,b`` is ``--model a --model b``); given on the command line,
the flag's values replace that list rather than add to it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from splitstream.common.argv_secrets import (
    drop_warnings,
    note_secrets_on_command_line,
    on_command_line,
    read_secret_file,
)
from splitstream.common.secrets import REDACTED

#: Attributes set on a secret flag's argparse Action: it is secret; its default came from the environment.
_SECRET = "splitstream_secret"
_FROM_ENVIRONMENT = "splitstream_from_environment"


def is_secret(action: argparse.Action) -> bool:
    """Whether ``action`` was added with ``secret=True`` (its value must never be shown)."""
    return bool(getattr(action, _SECRET, False))


def hides_default(action: argparse.Action) -> bool:
    """Whether ``action``'s default must not be shown: a secret flag's default that came from the
    environment (the code's own defaults are no secret, and showing them helps)."""
    return is_secret(action) and bool(getattr(action, _FROM_ENVIRONMENT, False))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown for every flag but :func:`hides_default` ones."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if hides_default(action):
            return action.help
        return super()._get_help_string(action)


class _AppendOverEnvironment(argparse._AppendAction):
    """``append`` whose first value on the command line starts a new list: the default (the environment's
    list) is replaced, as any other flag's would be, never appended to (nor mutated: it is shared)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option)


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to ``SPLITSTREAM_<SERVICE>_<FLAG>`` when set."""

    def __init__(self, *args: Any, env_prefix: str, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        self.env_prefix = env_prefix
        #: (flag, its dest, its file flag, the file flag's dest) for each flag added with ``file_flag=``.
        self._secret_files: list[tuple[str, str, str, str]] = []
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: Any, secret: bool = False, file_flag: str = "", **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*names, **self._from_environment(names, kwargs, secret=secret))
        self._add_file_flag(super().add_argument, action, file_flag)
        return self._marked(action, names, secret)

    def _add_file_flag(self, add: Any, action: argparse.Action, file_flag: str) -> None:
        """``file_flag``: a sibling that names a file holding the secret (kept out of ``ps``; see
        :mod:`splitstream.common.argv_secrets`); its content becomes ``action``'s value after parsing."""
        if not file_flag:
            return
        flag = action.option_strings[-1]
        names = (file_flag,)
        file_action = add(
            *names,
            **self._from_environment(
                names, {"default": "", "help": f"file holding the value of {flag} (kept out of ps)"}, secret=False
            ),
        )
        self._marked(file_action, names, False)
        self._secret_files.append((flag, action.dest, file_flag, file_action.dest))

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse, then put each ``file_flag``'s file in its flag and warn of secrets on the command line."""
        given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(given, namespace)
        for flag, dest, file_flag, file_dest in self._secret_files:
            path = getattr(parsed, file_dest, "")
            if not path:
                continue
            if on_command_line(given, flag):
                self.error(f"{file_flag}: give {flag} or {file_flag}, not both")
            try:
                setattr(parsed, dest, read_secret_file(file_flag, path))
            except ValueError as error:
                self.error(str(error))
        note_secrets_on_command_line(self, given, parsed, self.env_prefix)
        return parsed, extras

    def add_argument_group(self, *args: Any, **kwargs: Any) -> argparse._ArgumentGroup:
        """Groups read the environment too (argparse's groups have their own ``add_argument``)."""
        group = super().add_argument_group(*args, **kwargs)
        add = group.add_argument

        def add_argument(*names: Any, secret: bool = False, file_flag: str = "", **options: Any) -> argparse.Action:
            action = add(*names, **self._from_environment(names, options, secret=secret))
            self._add_file_flag(add, action, file_flag)
            return self._marked(action, names, secret)

        group.add_argument = add_argument  # type: ignore[method-assign]
        return group

    def _variable(self, names: tuple[Any, ...]) -> str | None:
        long_names = [n for n in names if isinstance(n, str) and n.startswith("--")]
        return self.env_prefix + long_names[0][2:].upper().replace("-", "_") if long_names else None

    def _marked(self, action: argparse.Action, names: tuple[Any, ...], secret: bool) -> argparse.Action:
        variable = self._variable(names)
        setattr(action, _SECRET, secret)
        setattr(action, _FROM_ENVIRONMENT, variable is not None and variable in os.environ)
        return action

    def _from_environment(self, names: tuple[Any, ...], kwargs: dict[str, Any], *, secret: bool) -> dict[str, Any]:
        variable = self._variable(names)
        if variable is None or "help" not in kwargs or kwargs.get("action") == "help":
            return kwargs
        flag = "--" + variable.removeprefix(self.env_prefix).lower().replace("_", "-")
        repeatable = kwargs.get("action") == "append"
        if repeatable:
            kwargs["action"] = _AppendOverEnvironment
        if variable in os.environ:
            raw = os.environ[variable]
            if repeatable:
                try:
                    convert = kwargs.get("type", str)
                    kwargs["default"] = [convert(item.strip()) for item in raw.split(",") if item.strip()]
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    shown = REDACTED if secret else repr(raw)
                    self.error(f"{variable}: invalid value {shown} for {flag}")
            elif kwargs.get("action") == "store_true":
                kwargs["default"] = raw.strip().lower() in {"1", "true", "yes", "on"}
            else:
                try:
                    kwargs["default"] = kwargs["type"](raw) if "type" in kwargs else raw
                except (TypeError, ValueError):
                    shown = REDACTED if secret else repr(raw)
                    self.error(f"{variable}: invalid value {shown} for {flag}")
            kwargs["required"] = False
        if secret:
            # Whether it is set, never what it is: --help output ends up in tickets and CI logs.
            kwargs["help"] = f"{kwargs['help']} [env {variable}{' set' if variable in os.environ else ''}]"
        else:
            kwargs["help"] = f"{kwargs['help']} [env {variable}]"
        return kwargs

    def error(self, message: str) -> NoReturn:
        """Usage errors: one line on stderr and exit code 2."""
        drop_warnings()
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str) -> NoReturn:
    """Exit 2 with one clear line (configuration errors found after parsing)."""
    drop_warnings()
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
