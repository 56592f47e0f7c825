"""Recording flags of the real router: bad ones refused at start, good ones taken.

Found by probing: ``--recorder nothost:abc`` or ``'a b'`` was accepted; the router served, spooled
every call for a recorder it could never reach, and said so only in its log. ``--log-flush-interval-s``
was checked as a count: 0.2 (what a user bounding a machine crash's loss tighter would give) was refused
as "not positive", while ``nan`` passed.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import Stack, free_port, run_module, wait_for, write_registry

EXPERIMENT = {"salt": "flag", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}


def _registry(tmp_path: Path) -> Path:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {"m": {"endpoints": {"v1": [f"127.0.0.1:{free_port()}"]}, "experiment": EXPERIMENT}})
    return registry


def _router(tmp_path: Path, *flags: str, recorder: str = "") -> subprocess.CompletedProcess[str]:
    """The real router with recording on, given ``flags``, to its end (or 20 s)."""
    return run_module(
        "splitstream.router", "--registry", f"file:{_registry(tmp_path)}", "--host", "127.0.0.1",
        "--port", str(free_port()), "--metrics-port", "0", "--recorder", recorder or f"127.0.0.1:{free_port()}",
        "--hmac-key", "k", "--log-dir", str(tmp_path / "spool"), *flags, timeout_s=20,
    )  # fmt: skip


@pytest.mark.parametrize("recorder", ["recorder:80o3", "a b:8003", "recorder:70000", "recorder"])
def test_a_recorder_address_that_is_no_host_and_port_is_refused_with_exit_2(tmp_path: Path, recorder: str) -> None:
    result = _router(tmp_path, recorder=recorder)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("splitstream-router: error: --recorder:")
    assert repr(recorder) in lines[0]


@pytest.mark.parametrize("interval", ["nan", "inf", "0", "-1"])
def test_a_log_flush_interval_that_is_no_positive_finite_number_is_refused_with_exit_2(
    tmp_path: Path, interval: str
) -> None:
    result = _router(tmp_path, "--log-flush-interval-s", interval)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("splitstream-router: error: --log-flush-interval-s: must be a finite number > 0")


@pytest.mark.slow
def test_a_log_flush_interval_under_a_second_is_taken(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    try:
        router = stack.router(  # waits for it to serve
            _registry(tmp_path),
            *("--recorder", f"127.0.0.1:{free_port()}", "--hmac-key", "k"),
            *("--log-dir", str(tmp_path / "spool"), "--log-flush-interval-s", "0.2"),
        )
        time.sleep(1.0)  # five turns of the flusher: nothing to wait for but that it lives through them
        assert router.process is not None
        assert router.process.poll() is None, router.log()
    finally:
        stack.close()


@pytest.mark.parametrize(
    ("flag", "variable", "deprecated"),
    [
        ("--log-dir", "", False),
        ("--spool-dir", "", True),
        ("", "SPLITSTREAM_ROUTER_SPOOL_DIR", True),
    ],
)
def test_the_log_directory_is_log_dir_and_the_old_spool_dir_is_taken_with_a_deprecation_line(
    tmp_path: Path, flag: str, variable: str, deprecated: bool
) -> None:
    """``--log-dir`` is the shipper's name for the same directory; the router's old ``--spool-dir`` (and its
    variable) still names it for a release, and the router says once that it is deprecated."""
    log_dir = tmp_path / "log"
    stack = Stack(tmp_path)
    try:
        router = stack.router(  # waits for it to serve
            _registry(tmp_path),
            *("--recorder", f"127.0.0.1:{free_port()}", "--hmac-key", "k"),
            *((flag, str(log_dir)) if flag else ()),
            env={variable: str(log_dir)} if variable else None,
        )
        assert (log_dir / "router.lock").exists(), router.log()  # the router logs there
        # ... and its child shipper was given the same directory: it holds the directory's shipper lock.
        wait_for(lambda: (log_dir / "shipper.lock").exists(), timeout_s=20, what="the child shipper's lock")
        entries = [json.loads(line) for line in router.log().splitlines() if line.startswith("{")]
        warnings = [e for e in entries if "is deprecated" in e.get("event", "")]
        if deprecated:
            (warning,) = warnings
            assert warning["level"] == "warning"
            assert (
                warning["event"] == "--spool-dir is deprecated and will be removed in the next release: use --log-dir"
            )
            assert warning["use"] == "--log-dir (SPLITSTREAM_ROUTER_LOG_DIR)"
        else:
            assert warnings == []
    finally:
        stack.close()


def test_the_old_spool_dir_naming_another_directory_than_log_dir_is_refused_with_exit_2(tmp_path: Path) -> None:
    result = _router(tmp_path, "--spool-dir", str(tmp_path / "other"))  # beside --log-dir tmp/spool
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "splitstream-router: error: --spool-dir is the old name of --log-dir: give --log-dir only"
    ], result.stderr
