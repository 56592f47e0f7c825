"""The router's registry watch survives whatever a registry update throws at it (a real router, a real file).

A value the backend does not turn into a clean error (``weight: .nan``, ``sample_rate: abc``)
must leave the router serving its last good state, say so (Status, the registry_healthy
gauge), apply the next good edit, and still stop cleanly on SIGTERM.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ServiceProcess, Stack, free_port, registry_healthy, router_status, wait_for, write_registry

MODEL = "affine"


def models(*, v2_weight: Any, sample_rate: Any = 0.5) -> dict[str, Any]:
    return {
        MODEL: {
            "endpoints": {
                "v1": [f"127.0.0.1:{free_port()}"],
                "v2": [f"127.0.0.1:{free_port()}"],
                "v3": [f"127.0.0.1:{free_port()}"],
            },
            "experiment": {
                "salt": "watch-tests",
                "control": "v1",
                "arms": [{"version": "v1", "weight": 90}, {"version": "v2", "weight": v2_weight}],
                "shadows": [{"version": "v3", "sample_rate": sample_rate}],
            },
        }
    }


def a_good_edit_applies_then_sigterm_exits_0(router: ServiceProcess, registry: Path) -> None:
    """The watch survived: the next good edit (a 50/50 split) is applied and healthy, and SIGTERM exits 0."""
    good = models(v2_weight=10)
    good[MODEL]["experiment"]["arms"] = [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}]
    write_registry(registry, good)

    def applied() -> bool:
        response = router_status(router)
        weights = {arm.version: arm.weight for arm in response.models[0].experiment.arms}
        return response.registry_error == "" and weights == {"v1": 50, "v2": 50}

    wait_for(applied, timeout_s=15, what="the good edit to be applied")
    assert registry_healthy(router) == 1

    router.signal(signal.SIGTERM)
    assert router.wait(timeout_s=30) == 0, router.log()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    yield stack
    stack.close()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"v2_weight": float("nan")}, id="weight-nan"),
        pytest.param({"v2_weight": 10, "sample_rate": "abc"}, id="sample-rate-abc"),
    ],
)
def test_a_bad_registry_value_keeps_the_last_good_state_is_reported_and_the_next_good_edit_applies(
    stack: Stack, tmp_path: Path, bad: dict[str, Any]
) -> None:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, models(v2_weight=10))
    router = stack.router(registry)
    assert router_status(router).registry_error == ""
    assert registry_healthy(router) == 1

    write_registry(registry, models(**bad))
    wait_for(lambda: router_status(router).registry_error, timeout_s=10, what="Status to show the registry error")
    assert registry_healthy(router) == 0
    arms = {arm.version: arm.weight for arm in router_status(router).models[0].experiment.arms}
    assert arms == {"v1": 90, "v2": 10}  # the last good state, still served

    a_good_edit_applies_then_sigterm_exits_0(router, registry)
    assert "Traceback" not in router.log().split('"signal received')[-1]
