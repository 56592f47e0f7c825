"""A Redis URL whose query options redis-py cannot use is a bad flag, refused at start.

redis-py hands unknown query parameters (``?x=1``) and some bad values (``?ssl_cert_reqs=bogus``) to
the connection's constructor, which raises only when the first connection is made: found by probing,
the recorder and the replayer then exited 1 with a traceback (1 is the replayer's "gate failed").
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import launcher
from tests.harness import ROOT, free_port
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), password="url-options-secret").start()
    yield server
    server.stop()


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    return launcher.run(
        [sys.executable, "-m", module, *args], env=clean, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def assert_refused(result: subprocess.CompletedProcess[str], option: str, password: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--redis-url" in lines[0]
    assert repr(option) in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert password not in result.stdout + result.stderr


@pytest.mark.parametrize("query", ["x=1", "ssl_cert_reqs=bogus"])
def test_the_recorder_refuses_a_redis_url_option_it_cannot_use_with_exit_2(redis: RedisServer, query: str) -> None:
    url = f"redis://:{redis.password}@127.0.0.1:{redis.port}/0?{query}"
    result = run(
        "splitstream.recorder",
        "--redis-url", url, "--host", "127.0.0.1", "--port", str(free_port()), "--metrics-port", "0",
    )  # fmt: skip
    assert_refused(result, query.split("=")[0], redis.password or "")


@pytest.mark.parametrize("query", ["x=1", "ssl_cert_reqs=bogus"])
def test_the_replayer_refuses_a_redis_url_option_it_cannot_use_with_exit_2(
    redis: RedisServer, query: str, tmp_path: Path
) -> None:
    url = f"redis://:{redis.password}@127.0.0.1:{redis.port}/0?{query}"
    result = run(
        "splitstream.replayer",
        "--redis-url", url, "--model", "m", "--since", "-1m",
        "--target", f"127.0.0.1:{free_port()}", "--output-dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert_refused(result, query.split("=")[0], redis.password or "")
