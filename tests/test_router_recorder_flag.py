"""Recording flags of the real router: bad ones refused at start, good ones taken.

Found by probing: ``--recorder nothost:abc`` or ``'a b'`` was accepted; the router served, spooled
every call for a recorder it could never reach, and said so only in its log. ``--log-flush-interval-s``
was checked as a count: 0.2 (what a user bounding a machine crash's loss tighter would give) was refused
as "not positive", while ``nan`` passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
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


def _router(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {"m": {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}, "experiment": EXPERIMENT}})
    return subprocess.run(
        [
            sys.executable, "-m", "splitstream.router", "--registry", f"file:{registry}", "--host", "127.0.0.1",
            "--port", str(free_port()), "--metrics-port", "0", "--recorder", f"127.0.0.1:{free_port()}",
            "--hmac-key", "k", "--spool-dir", str(tmp_path / "spool"), *flags,
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
        cwd=ROOT, capture_output=True, text=True, timeout=20,
    )  # fmt: skip


@pytest.mark.parametrize("interval", ["nan", "inf", "0", "-1"])
def test_a_log_flush_interval_that_is_no_positive_finite_number_is_refused_with_exit_2(
    tmp_path: Path, interval: str
) -> None:
    result = _router(tmp_path, "--log-flush-interval-s", interval)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("splitstream-router: error: --log-flush-interval-s: must be a finite number > 0")


def test_a_log_flush_interval_under_a_second_is_taken(tmp_path: Path) -> None:
    from tests.harness import Stack, health_status, wait_for

    stack = Stack(tmp_path)
    try:
        registry = tmp_path / "registry.yaml"
        write_registry(registry, {"m": {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}, "experiment": EXPERIMENT}})
        router = stack.router(
            registry,
            *("--recorder", f"127.0.0.1:{free_port()}", "--hmac-key", "k"),
            *("--spool-dir", str(tmp_path / "spool"), "--log-flush-interval-s", "0.2"),
        )
        wait_for(lambda: health_status(router.address) == 1, timeout_s=10, what="the router to serve")
        time.sleep(1.0)  # five turns of the flusher
        assert router.process is not None
        assert router.process.poll() is None, router.log()
    finally:
        stack.close()
