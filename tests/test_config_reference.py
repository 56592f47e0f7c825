"""The configuration reference reads as ``--help`` does: argparse's escapes are not shown."""

from __future__ import annotations

from tests.harness import ROOT


def test_the_reference_shows_a_percent_sign_as_help_does_not_argparses_escape() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert "%%" not in text
    guard = next(line for line in text.splitlines() if line.startswith("| `--guard` |"))
    assert "'click:lift>=-1%'" in guard
