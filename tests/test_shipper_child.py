"""The router's child shipper (``--shipper child``) refusing its configuration, on real router, worker, shipper,
recorder and redis-server processes: an exit 2 cannot be mended by starting the shipper again."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from splitstream.common import wal
from tests.harness import metric_samples, run_module, scrape_metrics, wait_for, write_registry
from tests.recording_stack import MODEL, RecordingStack
from tests.test_wal_directory import call
from tests.test_wal_recording import shipper_pid


def test_a_router_whose_child_shipper_refuses_its_configuration_at_start_exits_2(tmp_path: Path) -> None:
    """The shipper refused the log (its lock file cannot be opened: a directory in its place) with exit 2, and the
    router served on, restarting it for ever, with backoff, while nothing was shipped. The router refuses to start
    with exit 2: the shipper's line says what is wrong, the router's last line that its shipper refused."""
    spool = tmp_path / "spool"
    (spool / "shipper.lock").mkdir(parents=True)
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": ["127.0.0.1:1"]}}})
    result = run_module(
        "splitstream.router", "--registry", f"file:{registry}", "--host", "127.0.0.1", "--port", "0",
        "--metrics-port", "0", "--recorder", "127.0.0.1:1", "--hmac-key", "k", "--log-dir", str(spool),
        timeout_s=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        "splitstream-router: error: --shipper child: splitstream-shipper refused its configuration (its line is above)"
    ), result.stderr
    assert f"splitstream-shipper: error: --log-dir: Is a directory: {spool / 'shipper.lock'}" in lines, result.stderr


@pytest.mark.slow
def test_a_child_shipper_refusing_its_configuration_later_is_not_restarted_and_shows_in_the_metrics(
    tmp_path: Path,
) -> None:
    """A child that exited 2 after the router had started (its lock file replaced by a directory) was restarted
    for ever. It is left stopped, said loudly in the router's log and in ``splitstream_router_shipper_refused``;
    the router answers on and its calls are kept in the log."""
    stack = RecordingStack(tmp_path)
    try:
        stack.wait_recorded(call(stack, "before", 5))
        child = shipper_pid(stack)
        os.unlink(stack.spool_dir / "shipper.lock")
        (stack.spool_dir / "shipper.lock").mkdir()
        os.kill(child, signal.SIGKILL)

        def router_metric(name: str) -> float:
            samples = metric_samples(scrape_metrics(stack.router.metrics_port), f"splitstream_router_shipper_{name}")
            return samples[0][1] if samples else 0.0

        wait_for(lambda: router_metric("refused") == 1, timeout_s=30, what="the refusal to show in the metrics")
        assert "the child shipper refused its configuration" in stack.router.log()
        restarts = router_metric("restarts_total")
        call(stack, "after", 5)  # answered, logged for a shipper once the router is restarted
        assert wal.log_bytes(stack.spool_dir) > 0
        assert router_metric("restarts_total") == restarts
    finally:
        stack.close()


@pytest.mark.slow
def test_a_child_shipper_ends_when_its_router_is_killed(tmp_path: Path) -> None:
    """The child asks for the parent-death signal itself now (it was asked between fork and exec, running Python
    in a fork of the router's threads): a router killed with SIGKILL still leaves no shipper holding its log."""
    stack = RecordingStack(tmp_path)
    try:
        stack.wait_recorded(call(stack, "before", 5))
        child = shipper_pid(stack)
        stack.router.kill()

        def gone() -> bool:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return True
            return Path(f"/proc/{child}/status").read_text().find("State:\tZ") >= 0

        wait_for(gone, timeout_s=30, what="the child shipper to end with its router")
        stack.router = stack.start_router()  # its own child takes the log
        stack.wait_recorded(call(stack, "after", 5))
    finally:
        stack.close()
