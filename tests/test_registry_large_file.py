"""A large registry file is parsed off the router's event loop, on a real router and worker.

The YAML parse is pure Python and takes seconds for a file of megabytes. On the event loop it would
stall every call for the whole parse; off it, calls keep flowing, slowed only by sharing the GIL.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.harness import InferClient, Stack, make_request, router_status, wait_for, write_registry
from tests.models import add_version

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow

MODEL = "affine"


def test_calls_are_served_without_a_stall_while_the_router_parses_a_large_registry_file(tmp_path: Path) -> None:
    add_version(tmp_path / "models", MODEL, "v1", scale=2.0)
    stack = Stack(tmp_path)
    try:
        worker = stack.worker(tmp_path / "models", MODEL, "v1")
        registry = tmp_path / "registry.yaml"
        experiment = {"salt": "large", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
        write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}, "experiment": experiment}})
        router = stack.router(registry)

        latencies: list[float] = []
        stop = threading.Event()

        def call_steadily() -> None:
            client = InferClient(router.address)
            request = make_request(MODEL, np.ones((1, 4), dtype=np.float32))
            try:
                while not stop.is_set():
                    started = time.monotonic()
                    client.infer(request, timeout_s=30)
                    latencies.append(time.monotonic() - started)
                    time.sleep(0.01)
            finally:
                client.close()

        caller = threading.Thread(target=call_steadily)
        caller.start()
        try:
            wait_for(lambda: len(latencies) >= 20, timeout_s=10, what="calls to flow")
            staging = tmp_path / "registry.tmp"
            # One 5 MB scalar: valid YAML, no registry; seconds of parse (a stall on the loop would be one call of
            # seconds), not the tens of seconds 20 MB took on a loaded machine.
            staging.write_text("a" * 5_000_000)
            replaced = time.monotonic()
            staging.replace(registry)
            wait_for(lambda: router_status(router).registry_error, timeout_s=120, what="the file to be refused")
            parse_s = time.monotonic() - replaced
            count = len(latencies)
            wait_for(lambda: len(latencies) >= count + 20, timeout_s=10, what="calls to go on")
        finally:
            stop.set()
            caller.join(timeout=60)
        # A parse on the event loop stalls one call for all of it (the ratio is then near 1), whatever the
        # machine's load; off the loop the worst call is a small share of it. A ratio, not seconds: a loaded
        # machine slows the parse and the calls alike.
        worst = max(latencies)
        assert worst < parse_s / 4, f"worst call took {worst:.2f} s of the parse's {parse_s:.2f} s"
    finally:
        stack.close()
