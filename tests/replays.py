"""Running ``splitstream.replayer`` as its users do, for the replay tests of calls and of token streams.

A subprocess, not ``main()`` in-process: the exit code, the streams and the files written are what a
user sees, so the tests read those.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitstream.replayer.summary import Summary
from tests import launcher
from tests.harness import ROOT
from tests.recording_stack import MODEL


@dataclass
class ReplayRun:
    code: int
    stdout: str
    stderr: str
    out: Path

    @property
    def summary(self) -> dict[str, Any]:
        """summary.json as plain JSON, after checking it is exactly the typed model (no key missing or extra)."""
        text = (self.out / "summary.json").read_text()
        Summary.model_validate_json(text)
        data: dict[str, Any] = json.loads(text)
        return data

    def result_lines(self) -> list[dict[str, Any]]:
        lines = (self.out / "results.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]


def replay_command(redis_url: str, out: Path, *args: str, model: str = MODEL) -> list[str]:
    return [
        sys.executable,
        "-m",
        "splitstream.replayer",
        "--redis-url",
        redis_url,
        "--model",
        model,
        "--output-dir",
        str(out),
        *args,
    ]


def run_replay(
    redis_url: str,
    out: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 60,
    model: str = MODEL,
) -> tuple[int, str, str]:
    """The replayer's exit code, stdout and stderr, run from the repository with ``env`` over ours."""
    done = launcher.run(
        replay_command(redis_url, out, *args, model=model),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        check=False,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, done.stdout, done.stderr
