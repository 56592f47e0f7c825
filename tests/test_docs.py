"""The configuration reference is generated from the parsers; it must match them."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.harness import ROOT


def test_the_configuration_reference_matches_every_commands_parser() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    result = subprocess.run(
        [sys.executable, "scripts/gen_config_reference.py", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
