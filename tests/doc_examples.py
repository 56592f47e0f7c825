"""Run the docs' worked examples as a reader would paste them into a shell.

A page marks each block a test runs with ``<!-- example: NAME -->`` on the line before its fence (GitHub
shows nothing of the comment). The block runs with bash, in a directory of the test's own, as it stands
on the page but for the addresses, paths and fixed dates the test names in a :class:`Rewrite`: the page says
``127.0.0.1:6379`` and ``localhost:8001``, the test has its servers on free ports. A server the example
leaves on its default port is moved with that flag's environment variable (``SPLITSTREAM_ROUTER_PORT``:
[configuration.md](../docs/configuration.md)), so the line on the page is the line that runs. A page's
concrete date (an incident on ``2026-11-29T14:02:00Z``) stands beside times relative to now (``--since -1d``),
so the test writes that date's calls a set number of days before its own start and moves the date there by
whole days: each line then reads the same calls on any day (tests/test_docs_examples.py, ``PastDates``).

``.venv/bin/<command>`` and a bare ``splitstream-...`` both name the commands of the virtual environment
running the tests; ``python -m demo.train`` finds this checkout's ``demo`` package.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests import launcher
from tests.harness import ROOT, clean_env, wait_for

#: The marker and the fenced block right after it (blank lines between them allowed).
MARKED_BLOCK = re.compile(r"^<!-- example: ([\w-]+) -->\n(?:\s*\n)*```(\w+)\n(.*?)^```", re.S | re.M)
#: Any marker, to find one that is not followed by a fenced block.
MARKER = re.compile(r"^<!-- example: ([\w-]+) -->", re.M)


@dataclass(frozen=True, slots=True)
class Block:
    page: str
    name: str
    language: str
    text: str


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.parent == ROOT else path.name


def marked_blocks(path: Path) -> dict[str, Block]:
    """The page's marked blocks by name; a marker without a block after it, or a name used twice, fails."""
    text = path.read_text()
    page = page_name(path)
    blocks: dict[str, Block] = {}
    for match in MARKED_BLOCK.finditer(text):
        name, language, body = match.groups()
        assert name not in blocks, f"{page}: example {name!r} is marked twice"
        blocks[name] = Block(page, name, language, body)
    loose = set(MARKER.findall(text)) - set(blocks)
    assert not loose, f"{page}: example marker(s) {sorted(loose)} not followed by a fenced block"
    return blocks


def block(page: str, name: str) -> Block:
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    blocks = marked_blocks(path)
    assert name in blocks, f"{page} has no block marked <!-- example: {name} --> (it has {sorted(blocks)})"
    return blocks[name]


@dataclass(frozen=True, slots=True)
class Rewrite:
    """What a test changes in a block before it runs it: each key (an address, path or fixed date of the page)
    becomes its value. A key the block no longer holds fails the test, so an edited page cannot leave a rewrite
    silently doing nothing (and the example talking to a port nobody listens on)."""

    replacements: Mapping[str, str] = field(default_factory=dict)

    def apply(self, block: Block) -> str:
        text = block.text
        for old, new in self.replacements.items():
            assert old in text, f"{block.page} example {block.name!r} no longer holds {old!r}: update its test"
            text = text.replace(old, new)
        return text


def shell_env(cwd: Path, extra: Mapping[str, str] = {}) -> dict[str, str]:
    """The environment a block runs in: no ``SPLITSTREAM_*`` of the developer's, this venv's commands first
    on PATH, this checkout importable (``demo``), and ``extra`` (the test's ports, as flags' variables)."""
    env = clean_env()
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def prepare(cwd: Path) -> None:
    """``.venv`` in the example's directory is the environment running the tests (the page's
    ``.venv/bin/...`` lines are written from a checkout's root)."""
    cwd.mkdir(parents=True, exist_ok=True)
    venv = cwd / ".venv"
    if not venv.exists():
        venv.symlink_to(Path(sys.prefix), target_is_directory=True)


def run_block(
    block: Block, cwd: Path, *, rewrite: Rewrite = Rewrite(), env: Mapping[str, str] = {}, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a shell block to its end (``set -e``: the first failing line ends it), output captured."""
    assert block.language in ("sh", "bash"), f"{block.page} {block.name}: not a shell block"
    prepare(cwd)
    return launcher.run(
        ["bash", "-e", "-c", rewrite.apply(block)],
        cwd=cwd,
        env=shell_env(cwd, env),
        capture_output=True,
        encoding="utf-8",
        errors="replace",  # a record's bytes, as redis-cli prints them
        timeout=timeout_s,
        check=False,
    )


class Background:
    """A block that starts servers (its last line in the foreground, as on the page), run in a process group
    of its own so that :meth:`stop` ends the servers it started in the background too."""

    def __init__(self, block: Block, cwd: Path, *, rewrite: Rewrite = Rewrite(), env: Mapping[str, str] = {}) -> None:
        assert block.language in ("sh", "bash"), f"{block.page} {block.name}: not a shell block"
        prepare(cwd)
        self.block = block
        self.log_path = cwd / f"example-{block.name}.log"
        with open(self.log_path, "wb") as log:
            self.process = launcher.Popen(
                ["bash", "-e", "-c", rewrite.apply(block)],
                cwd=cwd,
                env=shell_env(cwd, env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_running(self) -> None:
        """Fail, with the block's output, when the block ended (a server that would not start)."""
        if self.process.poll() is not None:
            raise AssertionError(
                f"{self.block.page} example {self.block.name!r} ended with {self.process.returncode}:\n{self.log()}"
            )

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the whole group at once (the servers drain together), SIGKILL what is left after
        ``timeout_s``. The group outlives the shell while a server it put in the background runs."""
        if not self._signal(signal.SIGTERM):
            self.process.wait()
            return
        try:
            wait_for(lambda: not self._signal(0), timeout_s=timeout_s, what="the example's processes to end")
        except TimeoutError:
            self._signal(signal.SIGKILL)
        self.process.wait()

    def _signal(self, signum: int) -> bool:
        """Send ``signum`` to the group; False when no process of it is left."""
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            return False
        self.process.poll()  # reap the shell, so that a dead one does not keep the group alive
        return True
