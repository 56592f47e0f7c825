"""Exposures: every recorded call says which experiment phase it ran under and how its arm was chosen.

Real router, workers, recorder and redis-server. An A/B analysis compares arms only on randomized
assignments (``hash``, ``random``) within one phase; pins, spills and retries must be told apart in
the records themselves, because nothing read later can reconstruct them.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from splitstream.common.experiment import Experiment, phase_id
from splitstream.common.proto.splitstream.v1 import recorder_pb2
from splitstream.common.records import assignment_name
from tests.harness import (
    InferClient,
    make_request,
    metric_samples,
    router_status,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.recording_stack import MODEL, RecordingStack

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow

SALT = "exposure-salt"
HASH = recorder_pb2.ASSIGNMENT_HASH
RANDOM = recorder_pb2.ASSIGNMENT_RANDOM
PIN = recorder_pb2.ASSIGNMENT_PIN
SPILL = recorder_pb2.ASSIGNMENT_SPILL
RETRY = recorder_pb2.ASSIGNMENT_RETRY
#: v2's batcher holds a lone request for 5 s, so a call routed there is still in flight when v2 is killed.
SLOW = {"max_batch_size": 64, "dynamic_batching": {"max_queue_delay_us": 5_000_000}}


def experiment(v1: float, v2: float) -> dict:
    return {
        "salt": SALT,
        "control": "v1",
        "arms": [{"version": "v1", "weight": v1}, {"version": "v2", "weight": v2}],
    }


def key_on(version: str, v1: float, v2: float, *, avoid: frozenset[str] = frozenset()) -> str:
    """A routing key the split sends to ``version`` at these weights."""
    layout = Experiment.build(model=MODEL, salt=SALT, control="v1", arms=[("v1", v1), ("v2", v2)])
    return next(
        key for key in (f"user-{i}" for i in range(10_000)) if layout.assign(key) == version and key not in avoid
    )


def call(client: InferClient, request_id: str, *metadata: tuple[str, str]) -> str:
    """One call; returns the version that answered."""
    _, headers = client.infer(
        make_request(MODEL, np.ones((1, 4), np.float32)),
        metadata=[("x-request-id", request_id), *metadata],
        timeout_s=20,
    )
    return headers["x-splitstream-version"]


@pytest.fixture
def two_versions(tmp_path: Path) -> Iterator[RecordingStack]:
    stack = RecordingStack(
        tmp_path,
        versions={"v1": {"scale": 2.0}, "v2": {"scale": 3.0, "config": SLOW}},
        experiment=experiment(50, 50),
    )
    yield stack
    stack.close()


def test_each_way_of_choosing_an_arm_is_recorded_as_such_with_the_phase_in_force(
    two_versions: RecordingStack,
) -> None:
    stack = two_versions
    client = InferClient(stack.router.address)
    on_v1 = key_on("v1", 50, 50)
    on_v2 = key_on("v2", 50, 50)
    assert call(client, "hashed", ("x-routing-key", on_v1)) == "v1"
    call(client, "random")  # no key: either arm, by weight
    assert call(client, "pinned", ("x-splitstream-version", "v1")) == "v1"
    with pytest.raises(grpc.RpcError) as refused:
        call(client, "pinned-nowhere", ("x-splitstream-version", "v9"))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND

    # A call on its way to v2 when v2 dies (SIGKILL: UNAVAILABLE) is retried on the control.
    served: list[str] = []
    retried = threading.Thread(target=lambda: served.append(call(client, "retried", ("x-routing-key", on_v2))))
    retried.start()

    def in_flight() -> bool:
        samples = metric_samples(scrape_metrics(stack.router.metrics_port), "splitstream_router_in_flight")
        return samples[0][1] >= 1

    wait_for(in_flight, timeout_s=10, what="the call to be in flight on v2")
    stack.workers["v2"].kill()
    retried.join(timeout=30)
    assert served == ["v1"]

    # Once the router sees v2 gone, v2's keys spill to the control without trying v2.
    def v2_spilling() -> bool:
        arms = router_status(stack.router, MODEL).models[0].experiment.arms
        return {arm.version: arm.spilling for arm in arms}["v2"]

    wait_for(v2_spilling, timeout_s=10, what="v2 to be seen spilling")
    assert call(client, "spilled", ("x-routing-key", key_on("v2", 50, 50, avoid=frozenset({on_v2})))) == "v1"
    client.close()

    ids = {"hashed", "random", "pinned", "pinned-nowhere", "retried", "spilled"}
    records = {r.request_id: r for r in stack.wait_recorded(ids)}
    got = {rid: (r.assignment, r.arm, r.version) for rid, r in records.items()}
    assert got["hashed"] == (HASH, "v1", "v1")
    assert got["random"][0] == RANDOM
    assert got["pinned"] == (PIN, "v1", "v1")
    assert got["pinned-nowhere"] == (PIN, "", "")  # refused, and still counted apart from the split
    assert got["retried"] == (RETRY, "v2", "v1")
    assert got["spilled"] == (SPILL, "v2", "v1")
    assert records["retried"].retried
    assert records["retried"].fallback
    assert records["spilled"].fallback
    assert not records["spilled"].retried

    expected = phase_id(SALT, "v1", [("v1", 50), ("v2", 50)])
    for record in records.values():
        assert record.phase.id == expected
        assert dict(record.phase.weights) == {"v1": 50.0, "v2": 50.0}
        assert record.phase.control == "v1"

    # The readable stream fields say the same, for readers that never parse a record.
    redis: Any = stack.redis.client()  # binary replies; redis-py's stubs cannot say so
    entries = redis.xrange(f"splitstream:calls:{MODEL}")
    redis.close()
    readable = {fields[b"request_id"].decode(): fields for _, fields in entries}
    for request_id, record in records.items():
        fields = readable[request_id]
        assert fields[b"assignment"].decode() == assignment_name(record.assignment)
        assert fields[b"phase"].decode() == expected
        assert fields[b"arm"].decode() == record.arm
    assert readable["spilled"][b"assignment"] == b"spill"


def test_a_weight_change_starts_a_new_phase_and_a_router_restart_keeps_the_phase(tmp_path: Path) -> None:
    versions = {"v1": {"scale": 2.0}, "v2": {"scale": 3.0}}
    stack = RecordingStack(tmp_path, versions=versions, experiment=experiment(90, 10))
    try:
        endpoints = {v: [w.address] for v, w in stack.workers.items()}

        def set_weights(v1: float, v2: float) -> None:
            write_registry(stack.registry, {MODEL: {"endpoints": endpoints, "experiment": experiment(v1, v2)}})
            wait_for(
                lambda: router_status(stack.router, MODEL).models[0].experiment.arms[0].weight == v1,
                timeout_s=10,
                what=f"the router to apply {v1}/{v2}",
            )

        client = InferClient(stack.router.address)
        call(client, "at-90", ("x-routing-key", "u1"))
        set_weights(50, 50)
        call(client, "at-50", ("x-routing-key", "u1"))
        client.close()

        stack.router.signal(signal.SIGTERM)
        assert stack.router.wait(timeout_s=30) == 0
        stack.router = stack.start_router()
        client = InferClient(stack.router.address)
        call(client, "at-50-restarted", ("x-routing-key", "u1"))
        set_weights(90, 10)  # back to the first experiment: the same phase as before, not a third
        call(client, "at-90-again", ("x-routing-key", "u1"))
        client.close()

        records = {r.request_id: r for r in stack.wait_recorded({"at-90", "at-50", "at-50-restarted", "at-90-again"})}
        phases = {rid: r.phase.id for rid, r in records.items()}
        assert phases["at-90"] == phase_id(SALT, "v1", [("v1", 90), ("v2", 10)])
        assert phases["at-50"] == phase_id(SALT, "v1", [("v1", 50), ("v2", 50)])
        assert phases["at-90"] != phases["at-50"]
        assert phases["at-50-restarted"] == phases["at-50"]
        assert phases["at-90-again"] == phases["at-90"]
        assert dict(records["at-50"].phase.weights) == {"v1": 50.0, "v2": 50.0}
        assert all(r.assignment == HASH for r in records.values())
    finally:
        stack.close()
