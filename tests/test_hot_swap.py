"""Hot swap end to end, on both registry backends: real workers, two routers, the `splitstream rollout` CLI.

With ``consul`` (the Consul emulator, a test double: see tests/consul_emulator.py) workers register
themselves and deregister on SIGTERM; with ``file`` the test edits the YAML file as an operator would.
Routing keys are unique per call, so the observed split of a step is a binomial draw around its weight.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from splitstream.common.experiment import Experiment
from splitstream.common.proto.splitstream.v1 import router_pb2, router_pb2_grpc
from tests import launcher
from tests.consul_emulator import ConsulEmulator
from tests.harness import DRAIN_DELAY, ROOT, ServiceProcess, Stack, SteadyLoad, router_status, wait_for, write_registry
from tests.models import add_faulty_version, add_version

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow

MODEL = "affine"
SALT = "hot-swap"
Outcome = tuple[float, str, str, str]


class Deployment:
    """Workers and routers of one model on one backend, and the operator's moves on it."""

    def __init__(self, backend: str, tmp: Path) -> None:
        self.backend = backend
        self.tmp = tmp
        self.repository = tmp / "models"
        self.stack = Stack(tmp)
        self.emulator: ConsulEmulator | None = None
        self.registry_file = tmp / "registry.yaml"
        self.workers: dict[str, list[ServiceProcess]] = {}
        if backend == "consul":
            self.emulator = ConsulEmulator(tmp / "consul").start()
            self.spec = self.emulator.spec
        else:
            self.spec = f"file:{self.registry_file}"
        self.routers: list[ServiceProcess] = []

    def start_workers(self, version: str, count: int, *, faulty: bool = False) -> list[ServiceProcess]:
        """Start ``count`` workers of ``version`` and make them known to the routers (register / list them)."""
        if faulty:
            add_faulty_version(self.repository, MODEL, version, scale=3.0)
        elif not (self.repository / MODEL / version).exists():
            add_version(self.repository, MODEL, version, scale={"v1": 2.0}.get(version, 3.0))
        # drain() stops them while the routers still send to them: their drain delay is what it tests.
        extra: list[str] = [*DRAIN_DELAY]
        if self.emulator is not None:
            extra += [
                "--registry",
                self.emulator.spec,
                "--check-interval-s",
                "0.2",
                "--engine-tag",
                f"{MODEL}-{version}",
            ]
        workers = [self.stack.worker(self.repository, MODEL, version, *extra, start=False) for _ in range(count)]
        for worker in workers:
            worker.start(wait_serving=False)
        for worker in workers:
            worker.wait_serving()
        self.workers.setdefault(version, []).extend(workers)
        if self.emulator is None:
            self._write_file()
        return workers

    def drain(self, version: str) -> None:
        """Take every worker of ``version`` away as production does: out of the registry, SIGTERM, exit 0."""
        workers = self.workers.pop(version)
        if self.emulator is None:
            self._write_file()  # an operator removes them from the file first
        for worker in workers:
            worker.signal(signal.SIGTERM)
        for worker in workers:
            assert worker.wait(timeout_s=30) == 0, worker.log()

    def _write_file(self) -> None:
        experiment: Any = {"salt": SALT, "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
        if self.registry_file.exists():
            experiment = yaml.safe_load(self.registry_file.read_text())["models"][MODEL]["experiment"]
        endpoints = {v: [w.address for w in ws] for v, ws in self.workers.items()}
        write_registry(self.registry_file, {MODEL: {"endpoints": endpoints, "experiment": experiment}})

    def start_routers(self, count: int) -> list[ServiceProcess]:
        self.routers = [self.stack.router(self.spec, start=False) for _ in range(count)]
        for router in self.routers:
            router.start(wait_serving=False)
        for router in self.routers:
            router.wait_serving()
        return self.routers

    def set_salt(self) -> None:
        """Pin the salt, so the test can compute each key's bucket."""
        if self.emulator is not None:
            cli(self.spec, "experiment", "set", MODEL, "--salt", SALT)

    def versions_seen_by_routers(self) -> list[set[str]]:
        seen = []
        for router in self.routers:
            with grpc.insecure_channel(router.address) as channel:
                status = router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(model=MODEL), timeout=5)
            seen.append({p.version for p in status.models[0].versions if p.endpoints})
        return seen

    def close(self) -> None:
        self.stack.close()
        if self.emulator is not None:
            self.emulator.stop()


@pytest.fixture(params=["file", "consul"])
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(request.param, tmp_path)
    yield deployment
    deployment.close()


def cli(spec: str, *args: str) -> subprocess.CompletedProcess[str]:
    result = launcher.run(
        [sys.executable, "-m", "splitstream.admin", "--registry", spec, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result


class RolloutRun:
    """``splitstream rollout`` in a subprocess; remembers when each line of its output arrived."""

    def __init__(self, deployment: Deployment, version: str, *flags: str) -> None:
        metrics = [f"--metrics=127.0.0.1:{r.metrics_port}" for r in deployment.routers]
        args = [sys.executable, "-m", "splitstream.admin", "--registry", deployment.spec, "rollout", MODEL, version]
        self.process = launcher.Popen(
            [*args, *metrics, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait(self, timeout_s: float = 90) -> int:
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        return code

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def time_of(self, prefix: str) -> float:
        return next(t for t, line in self.lines if line.startswith(prefix))


def key_of(outcome: Outcome, prefix: str) -> str:
    """SteadyLoad's request id ``load-<run>-<thread>-<n>`` goes with routing key ``<prefix>-<thread>-<n>``."""
    _, _, thread, number = outcome[3].rsplit("-", 3)
    return f"{prefix}-{thread}-{number}"


def share_of_v2(outcomes: list[Outcome], start: float, end: float) -> tuple[float, int]:
    window = [o for o in outcomes if start <= o[0] < end and o[1] == "OK"]
    return sum(o[2] == "v2" for o in window) / max(len(window), 1), len(window)


def test_a_rollout_under_load_ramps_10_50_100_and_v1_drains_with_zero_failed_calls(deployment: Deployment) -> None:
    deployment.start_workers("v1", 2)
    deployment.start_routers(2)
    deployment.set_salt()
    loads = [SteadyLoad(r.address, MODEL, threads=2, key_prefix=f"swap{i}") for i, r in enumerate(deployment.routers)]
    for load in loads:
        load.__enter__()
    try:
        for load in loads:
            load.wait_calls(50)
        deployment.start_workers("v2", 1)  # registers (consul) or is added to the file
        wait_for(
            lambda: all("v2" in seen for seen in deployment.versions_seen_by_routers()),
            timeout_s=5,
            what="both routers to see v2's endpoint",
        )
        rollout = RolloutRun(
            deployment, "v2", "--steps", "10,50,100", "--interval", "2s", "--max-error-rate", "0.01",
            # Judged, but loosely: two cores run both routers, three workers and the load here.
            "--max-p99-ratio", "20", "--min-calls", "10", "--check-every", "0.5s",
        )  # fmt: skip
        assert rollout.wait() == 0, rollout.output()
        assert "promoted" in rollout.output()
        deployment.drain("v1")  # deregister / leave the file, SIGTERM, drain, exit 0
        drained = time.monotonic()
        for load in loads:
            load.wait_calls(100)
    finally:
        for load in loads:
            load.stop()
    outcomes = sorted(o for load in loads for o in load.outcomes)
    assert [o for o in outcomes if o[1] != "OK"] == []
    starts = [rollout.time_of(f"step {n}/3") for n in (1, 2, 3)]
    ends = [*starts[1:], rollout.time_of("promoted")]
    for weight, start, end in zip((10, 50, 100), starts, ends, strict=True):
        share, calls = share_of_v2(outcomes, start + 0.5, end)  # routers apply a change well within 0.5 s
        assert calls >= 100, f"too few calls in the {weight} % step to judge the split"
        p = weight / 100
        tolerance = max(4 * math.sqrt(p * (1 - p) / calls), 0.01)  # 4 sigma of a binomial draw
        assert abs(share - p) <= tolerance, f"{weight} % step: v2 served {share:.3f} of {calls} calls"
    after_drain = [o for o in outcomes if o[0] > drained]
    assert after_drain
    assert all(o[2] == "v2" for o in after_drain)
    experiment = yaml.safe_load(cli(deployment.spec, "experiment", "get", MODEL).stdout)
    assert experiment["control"] == "v2"
    assert experiment["arms"] == [{"version": "v2", "weight": 100}]


def test_a_rollout_of_a_failing_version_rolls_back_by_itself_and_v1_clients_see_no_error(
    deployment: Deployment,
) -> None:
    deployment.start_workers("v1", 1)
    deployment.start_routers(1)
    deployment.set_salt()
    deployment.start_workers("v2", 1, faulty=True)  # fails on the inputs this load sends
    wait_for(lambda: "v2" in deployment.versions_seen_by_routers()[0], timeout_s=5, what="the router to see v2")
    with SteadyLoad(deployment.routers[0].address, MODEL, threads=3, key_prefix="rollback") as load:
        load.wait_calls(50)
        rollout = RolloutRun(
            deployment, "v2", "--steps", "10,50,100", "--interval", "5s", "--max-error-rate", "5%",
            "--max-p99-ratio", "20", "--min-calls", "10", "--check-every", "0.5s",
        )  # fmt: skip
        code = rollout.wait()
        rolled_back = time.monotonic()
        load.wait_calls(200)
    assert code == 3, rollout.output()
    output = rollout.output()
    assert "ROLLED BACK" in output
    assert "v2 error rate" in output
    assert "step 2/3" not in output
    experiment = yaml.safe_load(cli(deployment.spec, "experiment", "get", MODEL).stdout)
    assert {a["version"]: a["weight"] for a in experiment["arms"]} == {"v1": 100, "v2": 0}
    # Only calls whose key fell in v2's 10 % (buckets 9000..9999) failed, and none once the rollback applied.
    layout = Experiment.build(model=MODEL, salt=SALT, control="v1", arms=[("v1", 90), ("v2", 10)])
    errors = load.errors()
    assert errors, "the faulty version never received a call"
    assert all(layout.bucket(key_of(o, "rollback")) >= 9000 for o in errors)
    assert all(o[0] < rolled_back + 0.5 for o in errors)
    v1_share = [o for o in load.outcomes if layout.bucket(key_of(o, "rollback")) < 9000]
    assert v1_share
    assert all(o[1] == "OK" and o[2] == "v1" for o in v1_share)


def test_a_router_never_applies_an_invalid_experiment_from_the_registry_file(tmp_path: Path) -> None:
    """The Consul counterpart is in test_consul.py (malformed JSON and bad weights in KV)."""
    registry = tmp_path / "registry.yaml"
    endpoints = {"v1": ["127.0.0.1:1"], "v2": ["127.0.0.1:2"]}  # nobody listens: only the experiment matters

    def write(v1: float, v2: float) -> None:
        arms = [{"version": "v1", "weight": v1}, {"version": "v2", "weight": v2}]
        write_registry(registry, {MODEL: {"endpoints": endpoints, "experiment": {"control": "v1", "arms": arms}}})

    write(90, 10)
    stack = Stack(tmp_path)
    try:
        router = stack.router(registry)

        write(80, 10)
        wait_for(
            lambda: "must sum to 100, got 90" in router_status(router, MODEL).registry_error,
            timeout_s=5,
            what="the rejection",
        )
        assert [(a.version, a.weight) for a in router_status(router, MODEL).models[0].experiment.arms] == [
            ("v1", 90),
            ("v2", 10),
        ]
        write(50, 50)
        wait_for(lambda: router_status(router, MODEL).registry_error == "", timeout_s=5, what="the valid file to apply")
        assert [(a.version, a.weight) for a in router_status(router, MODEL).models[0].experiment.arms] == [
            ("v1", 50),
            ("v2", 50),
        ]
    finally:
        stack.close()
