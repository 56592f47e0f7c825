"""Write docs/configuration.md from the services' own argument parsers, so the reference cannot drift.

python scripts/gen_config_reference.py          # rewrite docs/configuration.md
python scripts/gen_config_reference.py --check  # exit 1 if it is out of date (the test suite runs this)
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

from splitstream.common.cli import hides_default

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "configuration.md"

#: (command, module, function returning its ArgumentParser)
COMMANDS = [
    ("splitstream-router", "splitstream.router.main", "build_parser"),
    ("splitstream-worker", "splitstream.worker.main", "build_parser"),
    ("splitstream-recorder", "splitstream.recorder.config", "build_parser"),
    ("splitstream-replay", "splitstream.replayer.main", "build_parser"),
    ("splitstream", "splitstream.admin.main", "build_parser"),
    ("splitstream-build-engine", "splitstream.worker.engines.build_cli", "build_parser"),
]
_ENV = re.compile(r"\s*\[env (\w+)(?: set)?\]")


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from each command's own parser by `python scripts/gen_config_reference.py`; the test",
        "suite fails when it is out of date. Every flag of a service can also be set by the environment",
        "variable shown (the flag on the command line wins).",
        "",
    ]
    for command, module, function in COMMANDS:
        parser = getattr(importlib.import_module(module), function)()
        lines += _parser_section(command, parser, level=2)
    return "\n".join(lines).rstrip() + "\n"


def _parser_section(title: str, parser: argparse.ArgumentParser, *, level: int) -> list[str]:
    lines = [f"{'#' * level} `{title}`", ""]
    if parser.description:
        lines += [" ".join(parser.description.split()), ""]
    rows = []
    subcommands: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            subcommands += list(action.choices.items())
            continue
        help_text = action.help or ""
        env = _ENV.search(help_text)
        help_text = " ".join(_ENV.sub("", help_text).split()).replace("|", "\\|")
        names = ", ".join(f"`{n}`" for n in action.option_strings) or f"`{action.dest}` (positional)"
        hidden = action.default in (None, argparse.SUPPRESS, [], "") or action.required or hides_default(action)
        default = "" if hidden else f"`{action.default}`"
        rows.append(f"| {names} | {f'`{env.group(1)}`' if env else ''} | {default} | {help_text} |")
    if rows:
        lines += ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    for name, sub in subcommands:
        lines += _parser_section(f"{title} {name}", sub, level=level + 1)
    return lines


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET.relative_to(ROOT)} is out of date: run python scripts/gen_config_reference.py")
            return 1
        return 0
    TARGET.parent.mkdir(exist_ok=True)
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
