"""A registry path that stops being a regular file, on a real router.

Found by probing a running stack: a FIFO put where the registry file was made the watch's
``open()`` wait for a writer for ever, in a thread. No later edit was applied (the file put
back included), and after SIGTERM the router logged "stopped" but never exited, waiting for
that thread.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.harness import Stack, wait_for, write_registry
from tests.test_router_registry_watch import MODEL, models, registry_healthy, status


def test_a_fifo_in_place_of_the_registry_file_is_refused_and_the_next_good_edit_still_applies(tmp_path: Path) -> None:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, models(v2_weight=10))
    stack = Stack(tmp_path)
    try:
        router = stack.router(registry)
        assert registry_healthy(router.metrics_port) == 1

        registry.unlink()
        os.mkfifo(registry)
        wait_for(
            lambda: "not a regular file" in status(router.address).registry_error,
            timeout_s=10,
            what="Status to show that the registry path is no file",
        )
        assert registry_healthy(router.metrics_port) == 0

        registry.unlink()
        good = models(v2_weight=10)
        good[MODEL]["experiment"]["arms"] = [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}]
        write_registry(registry, good)

        def applied() -> bool:
            response = status(router.address)
            weights = {arm.version: arm.weight for arm in response.models[0].experiment.arms}
            return response.registry_error == "" and weights == {"v1": 50, "v2": 50}

        wait_for(applied, timeout_s=15, what="the good edit to be applied")
        assert registry_healthy(router.metrics_port) == 1

        router.signal(signal.SIGTERM)
        assert router.wait(timeout_s=30) == 0, router.log()
    finally:
        stack.close()
