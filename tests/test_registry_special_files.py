"""A registry path that stops being a regular file, on a real router.

Found by probing a running stack: a FIFO put where the registry file was made the watch's
``open()`` wait for a writer for ever, in a thread. No later edit was applied (the file put
back included), and after SIGTERM the router logged "stopped" but never exited, waiting for
that thread.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.harness import Stack, registry_healthy, router_status, wait_for, write_registry
from tests.test_router_registry_watch import a_good_edit_applies_then_sigterm_exits_0, models

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow


def test_a_fifo_in_place_of_the_registry_file_is_refused_and_the_next_good_edit_still_applies(tmp_path: Path) -> None:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, models(v2_weight=10))
    stack = Stack(tmp_path)
    try:
        router = stack.router(registry)
        assert registry_healthy(router) == 1

        registry.unlink()
        os.mkfifo(registry)
        wait_for(
            lambda: "not a regular file" in router_status(router).registry_error,
            timeout_s=10,
            what="Status to show that the registry path is no file",
        )
        assert registry_healthy(router) == 0

        registry.unlink()
        a_good_edit_applies_then_sigterm_exits_0(router, registry)
    finally:
        stack.close()
