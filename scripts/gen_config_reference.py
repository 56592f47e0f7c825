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
    ("splitstream-router", "splitstream.router.config", "build_parser"),
    ("splitstream-worker", "splitstream.worker.main", "build_parser"),
    ("splitstream-shipper", "splitstream.shipper.config", "build_parser"),
    ("splitstream-recorder", "splitstream.recorder.config", "build_parser"),
    ("splitstream-replay", "splitstream.replayer.main", "build_parser"),
    ("splitstream-archive", "splitstream.archiver.config", "build_parser"),
    ("splitstream", "splitstream.admin.main", "build_parser"),
    ("splitstream-build-engine", "splitstream.worker.engines.build_cli", "build_parser"),
]
#: (title, module, pydantic schema): the documents people edit, rendered from their schemas.
DOCUMENTS = [
    ("Registry file (`--registry file:PATH`)", "splitstream.common.registry.file", "RegistryDocument"),
    (
        "Experiment in Consul KV (`splitstream/experiments/<model>`, JSON)",
        "splitstream.common.experiment",
        "ExperimentDocument",
    ),
    ("Model `config.yaml` (`MODEL_REPOSITORY/MODEL/VERSION/config.yaml`)", "splitstream.worker.config", "ModelConfig"),
    ("Router principals (`--auth-principals`, YAML or JSON)", "splitstream.router.auth.policy", "PrincipalsDocument"),
]
_ENV = re.compile(r"\s*\[env (\w+)(?: set)?\]")


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from each command's own parser by `python scripts/gen_config_reference.py`; the test",
        "suite fails when it is out of date. Every flag of a service can also be set by the environment",
        "variable shown (the flag on the command line wins). A repeatable flag's variable holds a",
        "comma-separated list (`SPLITSTREAM_REPLAY_MODEL=a,b` is `--model a --model b`); the flag given",
        "on the command line replaces that list.",
        "",
    ]
    for command, module, function in COMMANDS:
        parser = getattr(importlib.import_module(module), function)()
        lines += _parser_section(command, parser, level=2)
    lines += _documents_section()
    return "\n".join(lines).rstrip() + "\n"


def _parser_section(title: str, parser: argparse.ArgumentParser, *, level: int) -> list[str]:
    lines = [f"{'#' * level} `{title}`", ""]
    if parser.description:
        lines += [" ".join(parser.description.split()), ""]
    rows = []
    subcommands: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue  # hidden: set by another command for its child (the shipper's --ready-fd), not by a user
        if isinstance(action, argparse._SubParsersAction):
            subcommands += list(action.choices.items())
            continue
        # As --help shows it (less the "(default: ...)" the table has a column for): "1%%" in a help string is "1%".
        help_text = argparse.HelpFormatter(parser.prog)._expand_help(action) if action.help else ""
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


def _documents_section() -> list[str]:
    from splitstream.common.schema_reference import reference_rows

    lines = [
        "## Configuration documents",
        "",
        "Generated from each document's schema. Types are strict: YAML's `true` is not a number, `\"10\"` is",
        'not 10, `2` is not the version `"2"`, `.nan` and `.inf` are refused, and so is any key not listed.',
        "A document that breaks a rule is refused whole with one line naming the field path",
        "(`models.m.experiment.arms[1].weight: ...`); a router keeps its last good state meanwhile.",
        "",
    ]
    for title, module, name in DOCUMENTS:
        schema = getattr(importlib.import_module(module), name)
        lines += [f"### {title}", "", " ".join((schema.__doc__ or "").replace("``", "`").split()), ""]
        lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for path, kind, default, meaning in reference_rows(schema):
            escaped = meaning.replace("|", "\\|")
            lines.append(f"| `{path}` | {kind} | {default} | {escaped} |")
        lines.append("")
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
