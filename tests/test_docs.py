"""The docs: the configuration reference is generated from the parsers and must match them; every relative
link in README.md and docs/*.md must lead to a file that exists, and to a heading of it when it names one."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests import launcher
from tests.harness import ROOT

#: A Markdown inline link or image: [text](target) or [text](target "title").
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, links and markup reduced to their text,
    every character but letters, digits, spaces, hyphens and underscores dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # https:, mailto: ...: not a file of this repository
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{os.path.relpath(path, ROOT)}: {target}"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{where}: no heading #{anchor} in {os.path.relpath(linked, ROOT)}")
    return broken


@pytest.mark.slow
def test_the_configuration_reference_matches_every_commands_parser() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    result = launcher.run(
        [sys.executable, "scripts/gen_config_reference.py", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", documents(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_leads_to_an_existing_file_and_heading(path: Path) -> None:
    assert broken_links(path) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    page = ROOT / "docs" / "rollouts.md"
    doc = tmp_path / "page.md"
    doc.write_text(
        "# Page\n\n## A heading: with `code` (and more)\n\n"
        f"[fine]({page}#a-worked-example) [self](#a-heading-with-code-and-more)\n"
        f"[gone](missing.md) [no anchor]({page}#no-such-heading) `[in code](missing.md)`\n\n"
        "```\n[in a block](missing.md)\n```\n"
    )
    broken = broken_links(doc)
    assert len(broken) == 2, broken
    assert broken[0].endswith("missing.md: no such file")
    assert broken[1].endswith("#no-such-heading: no heading #no-such-heading in docs/rollouts.md")


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        (
            "Processes: one router or recorder per core (`--processes`)",
            "processes-one-router-or-recorder-per-core---processes",
        ),
        ("The demo's language models", "the-demos-language-models"),
        ("A/B analysis", "ab-analysis"),
        (
            "Storage: Redis over TLS with least-privilege ACL users",
            "storage-redis-over-tls-with-least-privilege-acl-users",
        ),
        ("Router `config.yaml` [link](x.md)", "router-configyaml-link"),
    ],
)
def test_headings_get_githubs_anchors(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


#: A shell code block in the docs (```sh and its kin); plain blocks hold pictures and output.
_SHELL_BLOCK = re.compile(r"^```(?:sh|bash|shell|console)\n(.*?)^```", re.S | re.M)


def documented_command_lines() -> list[tuple[str, str, list[str]]]:
    """(page, line, argv) of every splitstream command in the docs' shell blocks, as a shell would split it:
    continuations joined, comments and a trailing ``&`` dropped, ``...`` (the usual flags, elided) left out,
    and ``--since -1d`` joined as the commands themselves join a relative time to its flag."""
    commands = {name for name, _, _ in _config_commands()}
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _SHELL_BLOCK.findall(page.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                for part in re.split(r"\s(?:\||&&|;)\s", line.strip().removeprefix("$ ")):
                    if "[--" in part:  # a usage synopsis, optional parts in brackets
                        continue
                    tokens = shlex.split(part, comments=True)
                    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):  # VARIABLE=value before the command
                        tokens.pop(0)
                    if not tokens or tokens[0].removeprefix(".venv/bin/") not in commands:
                        continue
                    argv: list[str] = []
                    for token in tokens[1:]:
                        if argv and argv[-1].startswith("--") and "=" not in argv[-1] and re.match(r"^-\d", token):
                            argv[-1] += "=" + token
                        elif token != "&":
                            argv.append(token)
                    found.append((page.name, part.strip(), [tokens[0].removeprefix(".venv/bin/"), *argv]))
    return found


def _config_commands() -> list[tuple[str, str, str]]:
    """The commands and their parsers, as the configuration reference lists them."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gen_config_reference import COMMANDS
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return list(COMMANDS)


def test_every_command_the_docs_show_is_taken_by_todays_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag renamed or removed leaves no example behind that a reader would copy and see refused. Lines with
    ``...`` stand for a command with its usual flags, so only a flag they name must exist there."""
    for name in [k for k in os.environ if k.startswith("SPLITSTREAM_")]:
        monkeypatch.delenv(name)
    parsers = {name: (module, function) for name, module, function in _config_commands()}
    lines = documented_command_lines()
    assert len(lines) >= 30, lines  # the docs' examples are found at all
    refused = []
    for page, line, (command, *argv) in lines:
        module, function = parsers[command]
        parser = getattr(importlib.import_module(module), function)()
        elided = "..." in argv
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args([a for a in argv if a != "..."])
        except SystemExit as error:
            message = errors.getvalue().strip().splitlines()[-1] if errors.getvalue().strip() else str(error)
            if error.code and not (elided and "arguments are required" in message):
                refused.append(f"{page}: {line[:120]} -> {message}")
    assert refused == []
