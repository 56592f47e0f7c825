"""What a service imports at start: the libraries only some deployments use are imported on first use.

py-consul with requests, PyJWT, redis-py and aiohttp were a third of a router's start-up CPU (every test
that starts one, and every restart in production), for a Consul registry, JWT callers, a Redis or an
HTTP port that most routers do without."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import ROOT, clean_env

#: Libraries a service imports only when its flags ask for them.
ON_FIRST_USE = ("consul", "requests", "jwt", "redis", "aiohttp")


@pytest.mark.parametrize(
    ("module", "needed"),
    [
        ("splitstream.router.main", ()),
        ("splitstream.worker.main", ()),
        ("splitstream.recorder.main", ("redis",)),
    ],
)
def test_a_service_imports_what_its_flags_may_not_need_only_on_first_use(module: str, needed: tuple[str, ...]) -> None:
    probe = f"import sys, {module}; print(' '.join(sorted(n for n in {ON_FIRST_USE!r} if n in sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == set(needed)
