"""A --recorder that is no host:port is a bad flag of the real router, refused at start.

Found by probing: ``--recorder nothost:abc`` or ``'a b'`` was accepted; the router served, spooled
every call for a recorder it could never reach, and said so only in its log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT, free_port, write_registry

EXPERIMENT = {"salt": "flag", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}


@pytest.mark.parametrize("recorder", ["recorder:80o3", "a b:8003", "recorder:70000", "recorder"])
def test_a_recorder_address_that_is_no_host_and_port_is_refused_with_exit_2(tmp_path: Path, recorder: str) -> None:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {"m": {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}, "experiment": EXPERIMENT}})
    result = subprocess.run(
        [
            sys.executable, "-m", "splitstream.router", "--registry", f"file:{registry}", "--host", "127.0.0.1",
            "--port", str(free_port()), "--metrics-port", "0", "--recorder", recorder, "--hmac-key", "k",
            "--spool-dir", str(tmp_path / "spool"),
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
        cwd=ROOT, capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("splitstream-router: error: --recorder:")
    assert repr(recorder) in lines[0]
