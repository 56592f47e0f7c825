"""The Consul backend against the Consul emulator (tests/consul_emulator.py, a test double: its docstring
lists the Consul behaviours it reproduces and those it does not).

Fake worker instances here are a grpc.health.v1 server in the test process, which the emulator checks
and the router watches like a real worker; tests that need inference start real workers.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitstream.admin.main import main as admin
from splitstream.common.proto.splitstream.v1 import router_pb2
from tests.consul_emulator import ConsulEmulator
from tests.harness import (
    DRAIN_DELAY,
    ServiceProcess,
    Stack,
    SteadyLoad,
    metric_samples,
    registry_healthy,
    router_status,
    scrape_metrics,
    wait_for,
)
from tests.models import add_version

MODEL = "affine"
TOKEN = "test-token"
KEY = f"splitstream/experiments/{MODEL}"


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[ConsulEmulator]:
    with ConsulEmulator(tmp_path / "consul", token=TOKEN) as emulator:
        yield emulator


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    yield stack
    stack.close()


class HealthServer:
    """A grpc.health.v1 server standing in for a worker where only health matters."""

    def __init__(self) -> None:
        self.servicer = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()
        self.set(health_pb2.HealthCheckResponse.SERVING)

    def set(self, status: int) -> None:
        for service in ("", MODEL):
            self.servicer.set(service, status)

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture
def health_servers() -> Iterator[list[HealthServer]]:
    servers = [HealthServer() for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def register(emulator: ConsulEmulator, server: HealthServer, version: str, **check: Any) -> str:
    service_id = f"fake-{version}-{server.port}"
    emulator.client().agent.service.register(
        f"splitstream-{MODEL}",
        service_id=service_id,
        address="127.0.0.1",
        port=server.port,
        tags=[version],
        meta={"version": version, "engine_tag": f"{MODEL}-{version}-fp32"},
        check={"GRPC": f"{server.address}/{MODEL}", "Interval": "200ms", "Timeout": "1s", **check},
    )
    return service_id


def passing(emulator: ConsulEmulator) -> list[str]:
    _, entries = emulator.client().health.service(f"splitstream-{MODEL}", passing=True)
    return [e["Service"]["ID"] for e in entries]


def experiment_json(v1: float, v2: float) -> str:
    arms = [{"version": "v1", "weight": v1}, {"version": "v2", "weight": v2}]
    return json.dumps({"salt": "consul-tests", "control": "v1", "arms": arms})


def weights(status: router_pb2.StatusResponse) -> dict[str, float]:
    return {a.version: a.weight for a in status.models[0].experiment.arms} if status.models else {}


def endpoints(status: router_pb2.StatusResponse) -> dict[str, list[str]]:
    if not status.models:
        return {}
    return {p.version: sorted(e.address for e in p.endpoints) for p in status.models[0].versions if p.endpoints}


# -- the emulator itself -------------------------------------------------------------------------------


def test_the_emulator_answers_a_blocking_kv_query_when_the_key_changes_and_refuses_a_stale_cas(
    emulator: ConsulEmulator,
) -> None:
    client = emulator.client()
    assert client.kv.put(KEY, "one")
    index, entry = client.kv.get(KEY)
    started = time.monotonic()
    with futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.kv.get, KEY, index=index, wait="5s")
        time.sleep(0.3)
        assert not waiting.done()  # held open: nothing changed yet
        assert emulator.client().kv.put(KEY, "two", cas=entry["ModifyIndex"])
        new_index, new_entry = waiting.result(timeout=5)
    assert time.monotonic() - started < 3.0  # answered at the change, well before the query's 5 s wait
    assert int(new_index) > int(index)
    assert new_entry["Value"] == b"two"
    assert not client.kv.put(KEY, "three", cas=entry["ModifyIndex"])  # the index it was read at is gone
    assert client.kv.get(KEY)[1]["Value"] == b"two"
    # A blocking query with nothing changing returns at its wait, with the same index.
    started = time.monotonic()
    assert client.kv.get(KEY, index=new_index, wait="300ms")[0] == new_index
    assert 0.25 < time.monotonic() - started < 2


def test_the_emulator_checks_grpc_health_itself_and_deregisters_a_service_critical_for_too_long(
    emulator: ConsulEmulator, health_servers: list[HealthServer]
) -> None:
    first, second = health_servers
    kept = register(emulator, first, "v1", DeregisterCriticalServiceAfter="30s")
    reaped = register(emulator, second, "v1", DeregisterCriticalServiceAfter="1s")
    wait_for(lambda: set(passing(emulator)) == {kept, reaped}, timeout_s=5, what="both instances passing")
    first.set(health_pb2.HealthCheckResponse.NOT_SERVING)
    second.stop()
    wait_for(lambda: passing(emulator) == [], timeout_s=5, what="both instances critical")
    _, entries = emulator.client().health.service(f"splitstream-{MODEL}")
    outputs = {e["Service"]["ID"]: e["Checks"][-1]["Output"] for e in entries}
    assert "NOT_SERVING" in outputs[kept]
    wait_for(
        lambda: reaped not in emulator.client().agent.services(), timeout_s=5, what="the critical one deregistered"
    )
    assert kept in emulator.client().agent.services()


def test_the_emulator_refuses_requests_without_the_acl_token(emulator: ConsulEmulator) -> None:
    import consul

    anonymous = consul.Consul(host="127.0.0.1", port=emulator.port)
    with pytest.raises(consul.ACLPermissionDenied):
        anonymous.kv.put(KEY, "x")


# -- workers -------------------------------------------------------------------------------------------


def consul_worker(stack: Stack, repository: Path, version: str, emulator: ConsulEmulator, **kw: Any) -> ServiceProcess:
    worker = stack.worker(
        repository,
        MODEL,
        version,
        "--registry",
        emulator.spec,
        "--engine-tag",
        f"{MODEL}-{version}-fp32-dyn",
        "--check-interval-s",
        "0.2",
        "--reregister-interval-s",
        "0.3",
        "--deregister-critical-after-s",
        "3",
        *DRAIN_DELAY,  # a SIGTERMed worker leaves Consul, then drains (what a worker's stop is tested for)
        start=False,
        env=emulator.env,
        **kw,
    )
    return worker


@pytest.mark.slow
def test_a_worker_registers_with_its_version_and_engine_tag_comes_back_if_forgotten_and_leaves_on_sigterm(
    emulator: ConsulEmulator, stack: Stack, tmp_path: Path
) -> None:
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v2", scale=3.0)
    worker = consul_worker(stack, repository, "v2", emulator).start()
    client = emulator.client()

    def registered() -> dict[str, Any] | None:
        _, entries = client.health.service(f"splitstream-{MODEL}", passing=True)
        return entries[0]["Service"] if entries else None

    service = wait_for(registered, timeout_s=10, what="the worker to register and pass its check")
    assert service["Port"] == worker.port
    assert service["Address"] == "127.0.0.1"
    assert service["Meta"] == {
        "model": MODEL,
        "version": "v2",
        "engine_tag": f"{MODEL}-v2-fp32-dyn",
        "backend": "onnxruntime",
        "precision": "fp32",
    }
    assert set(service["Tags"]) == {"v2", f"{MODEL}-v2-fp32-dyn"}
    # The agent forgets it (as after a restart without its state): the worker registers again.
    client.agent.service.deregister(service["ID"])
    wait_for(registered, timeout_s=5, what="the worker to register again")
    # SIGTERM: NOT_SERVING, deregister, drain, exit 0; the instance is gone before the process is.
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout_s=30) == 0
    assert service["ID"] not in client.agent.services()
    log = worker.log()
    assert log.index("deregistered from consul") < log.index('"stopped"')


# -- the router's watch ------------------------------------------------------------------------------


def consul_router(stack: Stack, emulator: ConsulEmulator, *extra: str) -> ServiceProcess:
    return stack.router(emulator.spec, *extra, env=emulator.env)


@pytest.mark.slow
def test_a_router_applies_a_kv_change_within_a_second_and_never_an_invalid_experiment(
    emulator: ConsulEmulator, stack: Stack, health_servers: list[HealthServer]
) -> None:
    for server, version in zip(health_servers, ("v1", "v2"), strict=True):
        register(emulator, server, version)
    wait_for(lambda: len(passing(emulator)) == 2, timeout_s=5, what="two passing instances")
    client = emulator.client()
    router = consul_router(stack, emulator)
    # Two versions and no experiment: the lowest version takes everything; both are routable by pin.
    status = router_status(router, MODEL)
    assert weights(status) == {"v1": 100, "v2": 0}
    assert endpoints(status) == {"v1": [health_servers[0].address], "v2": [health_servers[1].address]}
    client.kv.put(KEY, experiment_json(90, 10))
    started = time.monotonic()
    wait_for(lambda: weights(router_status(router, MODEL)) == {"v1": 90, "v2": 10}, timeout_s=3, interval_s=0.02)
    assert time.monotonic() - started < 1.0
    assert registry_healthy(router) == 1
    for bad, fragment in (("{not json", "not valid JSON"), (experiment_json(80, 10), "must sum to 100, got 90")):
        client.kv.put(KEY, bad)
        wait_for(lambda: fragment in router_status(router, MODEL).registry_error, timeout_s=3, what=fragment)  # noqa: B023
        assert weights(router_status(router, MODEL)) == {"v1": 90, "v2": 10}  # the last good one, still applied
        assert registry_healthy(router) == 0
    client.kv.put(KEY, experiment_json(50, 50))
    wait_for(lambda: weights(router_status(router, MODEL)) == {"v1": 50, "v2": 50}, timeout_s=3)
    assert router_status(router, MODEL).registry_error == ""
    assert registry_healthy(router) == 1


def test_the_admin_cli_refuses_bad_input_against_consul_and_writes_nothing(
    emulator: ConsulEmulator, health_servers: list[HealthServer], capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", TOKEN)
    register(emulator, health_servers[0], "v1")
    register(emulator, health_servers[1], "v2")
    wait_for(lambda: len(passing(emulator)) == 2, timeout_s=5, what="two passing instances")
    cli = ["--registry", emulator.spec]
    assert admin([*cli, "experiment", "set", MODEL, "--weights", "v1=90,v2=10", "--salt", "s"]) == 0
    index = emulator.client().kv.get(KEY)[1]["ModifyIndex"]
    for args, message in (
        (["--weights", "v1=80,v2=10"], "must sum to 100, got 90"),
        (["--weights", "v1=90,v3=10"], "no endpoint of version(s) v3"),
        (["--json", "{oops"], "not valid JSON"),
    ):
        capsys.readouterr()
        assert admin([*cli, "experiment", "set", MODEL, *args]) == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert err.count("\n") == 1, err
    assert emulator.client().kv.get(KEY)[1]["ModifyIndex"] == index  # nothing written
    # Malformed JSON put into KV behind the CLI's back is reported, not used.
    emulator.client().kv.put(KEY, "{oops")
    capsys.readouterr()
    assert admin([*cli, "experiment", "get", MODEL]) == 1
    assert "not valid JSON" in capsys.readouterr().err
    # `versions` shows each endpoint's Consul health and engine tag.
    assert admin([*cli, "versions", MODEL, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["versions"]
    assert [(r["version"], r["health"], r["engine_tag"]) for r in rows] == [
        ("v1", "passing", f"{MODEL}-v1-fp32"),
        ("v2", "passing", f"{MODEL}-v2-fp32"),
    ]


@pytest.mark.slow
def test_consul_stopped_for_ten_seconds_routers_keep_serving_then_converge(
    emulator: ConsulEmulator, stack: Stack, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", TOKEN)
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0)
    add_version(repository, MODEL, "v2", scale=3.0)
    v1 = [consul_worker(stack, repository, "v1", emulator) for _ in range(2)]
    for worker in v1:
        worker.start(wait_serving=False)
    for worker in v1:
        worker.wait_serving()
    wait_for(lambda: len(passing(emulator)) == 2, timeout_s=10, what="two v1 workers registered")
    routers = [consul_router(stack, emulator) for _ in range(2)]
    with SteadyLoad(routers[0].address, MODEL, threads=2, key_prefix="outage") as load:
        load.wait_calls(50)
        with emulator.stopped():
            for router in routers:
                wait_for(
                    lambda r=router: "connection refused" in router_status(r).registry_error,  # type: ignore[misc]
                    timeout_s=5,
                    what="the router to report Consul unreachable",
                )
                samples = metric_samples(scrape_metrics(router.metrics_port), "splitstream_router_registry_healthy")
                assert samples[0][1] == 0
            # A v2 worker starts while Consul is away; it registers once Consul is back.
            v2 = consul_worker(stack, repository, "v2", emulator).start()
            outage_end = time.monotonic() + 10 - 1.5
            while time.monotonic() < outage_end:
                load.wait_calls(20)
                assert weights(router_status(routers[1])) == {"v1": 100}  # the last state, still in force
        # Consul is back with its KV but without the agent's services: workers register again.
        wait_for(lambda: len(passing(emulator)) == 3, timeout_s=10, what="every worker registered again")
        assert admin(["--registry", emulator.spec, "experiment", "set", MODEL, "--weights", "v1=50,v2=50"]) == 0
        for router in routers:
            wait_for(
                lambda r=router: (  # type: ignore[misc]
                    weights(router_status(r)) == {"v1": 50, "v2": 50}
                    and endpoints(router_status(r)) == {"v1": sorted(w.address for w in v1), "v2": [v2.address]}
                    and router_status(r).registry_error == ""
                ),
                timeout_s=10,
                what="the router to converge on Consul's state",
            )
        load.wait_calls(100)
    assert load.errors() == []
    assert {o[2] for o in load.outcomes[-50:]} == {"v1", "v2"}


@pytest.mark.slow
def test_a_kv_experiment_of_the_wrong_types_is_reported_and_the_next_good_value_still_applies(
    emulator: ConsulEmulator, stack: Stack, health_servers: list[HealthServer]
) -> None:
    """Issue 11, fault 2: ``"weight": NaN`` in KV used to kill the router's watch without a word."""
    for server, version in zip(health_servers, ("v1", "v2"), strict=True):
        register(emulator, server, version)
    wait_for(lambda: len(passing(emulator)) == 2, timeout_s=5, what="two passing instances")
    client = emulator.client()
    client.kv.put(KEY, experiment_json(90, 10))
    router = consul_router(stack, emulator)
    wait_for(lambda: weights(router_status(router, MODEL)) == {"v1": 90, "v2": 10}, timeout_s=5)

    good = [(50, 50), (70, 30), (20, 80), (90, 10)]
    for (weight, fragment), (v1, v2) in zip(
        (
            ("NaN", "arms[1].weight: Input should be a finite number"),
            ("Infinity", "arms[1].weight: Input should be a finite number"),
            ("true", "arms[1].weight: Input should be a valid number, got True"),
            ('"10"', "arms[1].weight: Input should be a valid number, got '10'"),
        ),
        good,
        strict=True,
    ):
        last_good = weights(router_status(router, MODEL))
        bad = '{"control": "v1", "arms": [{"version": "v1", "weight": 90}, {"version": "v2", "weight": %s}]}'
        client.kv.put(KEY, bad % weight)
        wait_for(lambda: fragment in router_status(router, MODEL).registry_error, timeout_s=5, what=fragment)  # noqa: B023
        assert weights(router_status(router, MODEL)) == last_good
        assert registry_healthy(router) == 0
        client.kv.put(KEY, experiment_json(v1, v2))
        wait_for(lambda: weights(router_status(router, MODEL)) == {"v1": v1, "v2": v2}, timeout_s=5)  # noqa: B023
        assert router_status(router, MODEL).registry_error == ""
        assert registry_healthy(router) == 1
    router.signal(signal.SIGTERM)
    assert router.wait() == 0, router.log()
    assert "Traceback" not in router.log()


@pytest.mark.slow
def test_a_model_whose_workers_all_deregister_stays_routed_until_its_key_says_remove(
    emulator: ConsulEmulator, stack: Stack, health_servers: list[HealthServer]
) -> None:
    """Issue 11, fault 3: every worker gone is an outage, not a removal; ``{"remove": true}`` is one."""
    ids = [register(emulator, server, version) for server, version in zip(health_servers, ("v1", "v2"), strict=True)]
    wait_for(lambda: len(passing(emulator)) == 2, timeout_s=5, what="two passing instances")
    client = emulator.client()
    router = consul_router(stack, emulator)
    wait_for(lambda: endpoints(router_status(router, MODEL)).keys() == {"v1", "v2"}, timeout_s=5, what="both versions")
    for service_id in ids:
        client.agent.service.deregister(service_id)
    wait_for(lambda: not passing(emulator), timeout_s=5, what="every instance deregistered")
    client.kv.put(KEY, experiment_json(50, 50))  # a change after the deregistration, so the router has seen it
    wait_for(lambda: weights(router_status(router, MODEL)) == {"v1": 50, "v2": 50}, timeout_s=5, what="the new weights")
    # Still routed, to the last endpoints the router saw listed: v2's alone, or both when one blocking query
    # answered after both deregistrations (a loaded machine).
    kept = endpoints(router_status(router, MODEL))
    assert kept in (
        {"v2": [health_servers[1].address]},
        {"v1": [health_servers[0].address], "v2": [health_servers[1].address]},
    )
    client.kv.put(KEY, json.dumps({"remove": True}))

    def routed_models() -> list[str]:
        answer = router_status(router)
        assert answer.registry_error == ""
        return [m.model for m in answer.models]

    wait_for(lambda: routed_models() == [], timeout_s=5, what="the explicit removal")
    register(emulator, health_servers[0], "v1")
    wait_for(lambda: len(passing(emulator)) == 1, timeout_s=5, what="v1 registered again")
    client.kv.delete(KEY)
    wait_for(
        lambda: weights(router_status(router, MODEL)) == {"v1": 100}, timeout_s=5, what="the model back by default"
    )
