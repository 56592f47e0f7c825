"""Secrets stay out of the errors a bad configuration gets, found by probing a running stack.

A Redis URL carries its password; two ways of getting the configuration wrong quoted it:
a rule across several settings (the recorder's "masking needs an HMAC key") quoted the whole
settings document, URL included, and a URL typed without its scheme (``:PW@host:6379``) was
quoted as it was, since no URL parser finds a userinfo there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import launcher
from tests.harness import ROOT, free_port

PASSWORD = "probe-redis-secret-7"


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    return launcher.run(
        [sys.executable, "-m", module, *args], env=clean, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_recorder_refused_for_a_rule_across_settings_does_not_quote_its_redis_password() -> None:
    result = run(
        "splitstream.recorder",
        "--redis-url", f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0", "--redact-metadata", "x-user:mask",
        "--host", "127.0.0.1", "--port", str(free_port()), "--metrics-port", "0",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "needs an HMAC key" in lines[0]
    assert PASSWORD not in result.stdout + result.stderr


@pytest.mark.slow
def test_a_redis_url_without_its_scheme_is_refused_without_quoting_the_password() -> None:
    url = f":{PASSWORD}@127.0.0.1:{free_port()}/0"
    replay = run(
        "splitstream.replayer",
        "--redis-url", url, "--model", "m", "--target", f"127.0.0.1:{free_port()}", "--since", "-1m",
    )  # fmt: skip
    assert replay.returncode == 2, replay.stderr
    assert len(replay.stderr.strip().splitlines()) == 1, replay.stderr
    assert "--redis-url" in replay.stderr
    assert PASSWORD not in replay.stdout + replay.stderr
    recorder = run(
        "splitstream.recorder",
        "--redis-url", url, "--host", "127.0.0.1", "--port", str(free_port()), "--metrics-port", "0",
    )  # fmt: skip
    assert recorder.returncode == 2, recorder.stderr
    assert len(recorder.stderr.strip().splitlines()) == 1, recorder.stderr
    assert PASSWORD not in recorder.stdout + recorder.stderr
