"""Times the replayer cannot place in a stream, refused before anything is sent (real replayer, Redis, worker).

Found by probing: ``--since -999999d`` (year -711) was accepted, the window replayed, and then
writing the report raised OverflowError: a traceback and exit 1, the "gate failed" code.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests import launcher
from tests.harness import ROOT, Stack
from tests.models import add_version
from tests.redis_server import RedisServer

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow

MODEL = "affine"


@pytest.mark.parametrize(
    "window",
    [["--since", "-999999d"], ["--since", "-1h", "--until", "+9999999d"], ["--since", "99999999999999"]],
    ids=["before-1970", "after-9999", "epoch-after-9999"],
)
def test_a_time_outside_1970_to_9999_is_a_usage_error_not_a_failed_gate(tmp_path: Path, window: list[str]) -> None:
    add_version(tmp_path / "models", MODEL, "v1", scale=2.0)
    stack = Stack(tmp_path)
    try:
        with RedisServer(tmp_path / "redis") as redis:
            client = redis.client()
            client.xadd(f"splitstream:calls:{MODEL}", {"record": b"not a record"})  # the model has a stream
            client.close()
            worker = stack.worker(tmp_path / "models", MODEL, "v1")
            result = launcher.run(
                [
                    sys.executable, "-m", "splitstream.replayer", "--redis-url", redis.url, "--model", MODEL,
                    "--target", worker.address, "--output-dir", str(tmp_path / "out"), *window,
                ],
                env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
                cwd=ROOT, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
    finally:
        stack.close()
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("splitstream-replay: error: bad time")
    assert "1970" in lines[0]
