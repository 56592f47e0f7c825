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

import grpc
import pytest

from splitstream.common.proto.splitstream.v1 import router_pb2, router_pb2_grpc
from tests.harness import Stack, free_port, metric_samples, scrape_metrics, wait_for, write_registry

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


def status(address: str) -> router_pb2.StatusResponse:
    with grpc.insecure_channel(address) as channel:
        response: router_pb2.StatusResponse = router_pb2_grpc.RouterStub(channel).Status(
            router_pb2.StatusRequest(), timeout=5
        )
        return response


def registry_healthy(metrics_port: int) -> float:
    return metric_samples(scrape_metrics(metrics_port), "splitstream_router_registry_healthy")[0][1]


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
    assert status(router.address).registry_error == ""
    assert registry_healthy(router.metrics_port) == 1

    write_registry(registry, models(**bad))
    wait_for(lambda: status(router.address).registry_error, timeout_s=10, what="Status to show the registry error")
    assert registry_healthy(router.metrics_port) == 0
    arms = {arm.version: arm.weight for arm in status(router.address).models[0].experiment.arms}
    assert arms == {"v1": 90, "v2": 10}  # the last good state, still served

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
    assert "Traceback" not in router.log().split('"signal received')[-1]
