"""``--processes N``: N routers (or recorders) on one port behind one supervising parent.

Real processes throughout: a parent router with two children, workers, a recorder, redis-server.
Clients open one connection per channel (a local subchannel pool), so connections spread over the
children as the kernel's SO_REUSEPORT hashing puts them, as separate clients' would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitstream.common.experiment import Experiment
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from splitstream.common.runtime import PROCESSES_PER_CORE, parse_processes, usable_cores
from tests import launcher
from tests.harness import (
    ROOT,
    InferClient,
    ServiceProcess,
    Stack,
    SteadyLoad,
    free_port,
    health_status,
    make_request,
    metric_samples,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.recording_stack import HMAC_KEY, MODEL, RecordingStack
from tests.redis_server import RedisServer

EXPERIMENT = {
    "salt": "processes",
    "control": "v1",
    "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
}
#: Connections per test: enough that both children get some whatever the kernel's hash does.
CONNECTIONS = 12


def log_events(process: ServiceProcess) -> list[dict]:
    """The JSON log lines of ``process`` (its children write to the same file)."""
    events = []
    for line in process.log().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def child_pids(process: ServiceProcess) -> dict[int, int]:
    """The latest pid of each child index, from the parent's log."""
    return {e["index"]: e["pid"] for e in log_events(process) if e.get("event") == "child started"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_children_serving(process: ServiceProcess, count: int = 2) -> None:
    """Every child's "listening" line is in the log (the harness's health check reaches only one)."""

    def serving() -> bool:
        pids = set(child_pids(process).values())
        events = log_events(process)
        # The latest "listening" per child index must come after its latest start.
        last_start = {e["index"]: i for i, e in enumerate(events) if e.get("event") == "child started"}
        listening = {
            e["process_index"]
            for i, e in enumerate(events)
            if e.get("event") == "listening"
            and e.get("process_index") is not None
            and i > last_start.get(e["process_index"], len(events))
        }
        return len(pids) == count and len(listening) == count

    wait_for(serving, timeout_s=60, what=f"{count} children to listen")


class OwnConnection(InferClient):
    """A client on its own TCP connection (grpc would otherwise share one between same-target channels)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(self.channel)


def clients(address: str, n: int = CONNECTIONS) -> list[InferClient]:
    return [OwnConnection(address) for _ in range(n)]


def call_all(address: str, keys: list[str], prefix: str, *, pin: str = "") -> dict[str, str]:
    """One call per key, spread round-robin over fresh connections; the version that answered each
    (``pin``: sent as ``x-splitstream-version``)."""
    x = np.ones((1, 4), dtype=np.float32)
    served = {}
    connections = clients(address)
    try:
        for i, key in enumerate(keys):
            client = connections[i % len(connections)]
            metadata = [("x-routing-key", key), ("x-request-id", f"{prefix}-{key}")]
            if pin:
                metadata.append(("x-splitstream-version", pin))
            for attempt in range(3):
                try:
                    _, headers = client.infer(make_request(MODEL, x), metadata=metadata)
                    break
                except grpc.RpcError as error:  # only a connection to a child that was just killed
                    if error.code() != grpc.StatusCode.UNAVAILABLE or attempt == 2:
                        raise
            served[key] = headers["x-splitstream-version"]
    finally:
        for client in connections:
            client.close()
    return served


@pytest.fixture
def two_routers(tmp_path: Path) -> Iterator[RecordingStack]:
    stack = RecordingStack(
        tmp_path,
        versions={"v1": {"scale": 2.0}, "v2": {"scale": 3.0}},
        experiment=EXPERIMENT,
        router_args=("--processes", "2"),
    )
    try:
        wait_children_serving(stack.router)
        yield stack
    finally:
        stack.close()


@pytest.mark.slow
def test_two_router_processes_split_sticky_record_once_and_drain_on_sigterm(two_routers: RecordingStack) -> None:
    stack = two_routers
    keys = [f"user-{i}" for i in range(120)]
    first = call_all(stack.router.address, keys, "a")
    again = call_all(stack.router.address, keys, "b")
    # Stickiness across children: the split is a hash of salt and key, the same in every process.
    experiment = Experiment.from_mapping(MODEL, EXPERIMENT)
    assert first == again == {key: experiment.assign(key) for key in keys}
    assert set(first.values()) == {"v1", "v2"}

    request_ids = {f"{p}-{key}" for p in ("a", "b") for key in keys}
    records = stack.wait_recorded(request_ids)
    assert stack.raw_count() == len(request_ids)  # exactly once each
    # Both children served: each names itself (hostname-pid) in the records it logs.
    pids = set(child_pids(stack.router).values())
    assert {int(r.router_id.rsplit("-", 1)[1]) for r in records} == pids

    # One scrape of the parent shows the totals; the histogram merges over both children.
    text = scrape_metrics(stack.router.metrics_port)
    answered = sum(v for labels, v in metric_samples(text, "splitstream_router_requests_total"))
    counted = sum(v for _, v in metric_samples(text, "splitstream_router_request_seconds_count"))
    in_bucket = sum(
        v for labels, v in metric_samples(text, "splitstream_router_request_seconds_bucket") if labels["le"] == "+Inf"
    )
    assert answered == counted == in_bucket == len(request_ids)

    shippers = {e["pid"] for e in log_events(stack.router) if e.get("event") == "shipper started"}
    assert len(shippers) == 1  # one for both children's logs, run by the parent
    stack.router.signal(signal.SIGTERM)
    assert stack.router.wait() == 0
    assert not [pid for pid in pids | shippers if alive(pid)]
    assert stack.raw_count() == len(request_ids)


@pytest.mark.slow
def test_a_killed_router_child_is_restarted_and_calls_go_on(two_routers: RecordingStack) -> None:
    stack = two_routers
    before = child_pids(stack.router)
    call_all(stack.router.address, [f"warm-{i}" for i in range(24)], "warm")
    os.kill(before[0], signal.SIGKILL)
    wait_for(lambda: child_pids(stack.router)[0] != before[0], timeout_s=30, what="child 0 to be started again")
    keys = [f"after-{i}" for i in range(60)]
    call_all(stack.router.address, keys, "after")  # a connection to the dead child is retried once, elsewhere
    wait_children_serving(stack.router)
    restarts = metric_samples(scrape_metrics(stack.router.metrics_port), "splitstream_router_process_restarts_total")
    assert restarts == [({}, 1.0)]
    # The restarted child resumed its own log directory: what it had logged before is recorded too.
    stack.wait_recorded({f"warm-warm-{i}" for i in range(24)} | {f"after-{key}" for key in keys})
    assert sorted(p.name for p in stack.spool_dir.iterdir() if p.is_dir() and p.name.startswith("proc-")) == [
        "proc-0",
        "proc-1",
    ]


@pytest.mark.slow
def test_every_router_child_follows_a_registry_change_honours_pins_and_lets_a_version_drain(
    two_routers: RecordingStack,
) -> None:
    stack = two_routers
    keys = [f"pin-{i}" for i in range(24)]
    assert set(call_all(stack.router.address, keys, "pinned", pin="v2").values()) == {"v2"}
    endpoints = {v: [w.address] for v, w in stack.workers.items()}
    swapped = {**EXPERIMENT, "arms": [{"version": "v1", "weight": 0}, {"version": "v2", "weight": 100}]}
    with SteadyLoad(stack.router.address, MODEL, threads=2, key_prefix="swap") as load:
        load.wait_calls(20)
        write_registry(stack.registry, {MODEL: {"endpoints": endpoints, "experiment": swapped}})
        # Each child watches the registry itself: every connection, whichever child it reached, moves.
        wait_for(
            lambda: set(call_all(stack.router.address, keys, "probe").values()) == {"v2"},
            timeout_s=30,
            what="every child to route all traffic to v2",
        )
        load.wait_calls(20)
        # Drain v1 as production does: out of the registry, then SIGTERM. No child may still send to it.
        v2_only = {**EXPERIMENT, "control": "v2", "arms": [{"version": "v2", "weight": 100}]}
        write_registry(stack.registry, {MODEL: {"endpoints": {"v2": endpoints["v2"]}, "experiment": v2_only}})
        wait_for(lambda: every_connection_refuses_pin(stack.router.address, "v1"), timeout_s=30, what="v1 gone")
        stack.workers["v1"].signal(signal.SIGTERM)
        assert stack.workers["v1"].wait() == 0
        load.wait_calls(20)
    assert load.errors() == []


@pytest.mark.slow
def test_an_arm_spilling_in_a_child_shows_on_the_parents_scrape_until_it_recovers(two_routers: RecordingStack) -> None:
    """``splitstream_router_arm_spilling`` with ``--processes 2``: the children set it as the state changes
    (a collector run at scrape time in a child is never asked: the parent reads the children's files)."""
    stack = two_routers

    def spilling() -> list[tuple[dict[str, str], float]]:
        return sorted(
            metric_samples(scrape_metrics(stack.router.metrics_port), "splitstream_router_arm_spilling"),
            key=lambda sample: sample[0]["version"],
        )

    def arms(v1: float, v2: float) -> list[tuple[dict[str, str], float]]:
        return [({"model": MODEL, "version": "v1"}, v1), ({"model": MODEL, "version": "v2"}, v2)]

    wait_for(lambda: spilling() == arms(0.0, 0.0), timeout_s=30, what="both arms exported, neither spilling")
    stack.workers["v2"].stop()  # health: NOT_SERVING, then unreachable, in every child
    wait_for(lambda: spilling() == arms(0.0, 1.0), timeout_s=30, what="v2 spilling on the parent's scrape")
    stack.workers["v2"].start()  # the same port: each child's health watch finds it serving again
    wait_for(lambda: spilling() == arms(0.0, 0.0), timeout_s=30, what="v2 serving again in every child")
    stack.workers["v2"].stop()
    wait_for(lambda: spilling() == arms(0.0, 1.0), timeout_s=30, what="v2 spilling again")
    # An arm taken out of the experiment while spilling must not stay 1: a child cannot remove a series
    # in multiprocess mode, so it reads 0 (with one process it is removed).
    v1_only = {**EXPERIMENT, "arms": [{"version": "v1", "weight": 100}]}
    write_registry(stack.registry, {MODEL: {"endpoints": {"v1": [stack.workers["v1"].address]}, "experiment": v1_only}})
    wait_for(lambda: spilling() == arms(0.0, 0.0), timeout_s=30, what="the removed arm to read 0")


def every_connection_refuses_pin(address: str, version: str) -> bool:
    """Whether a call pinned to ``version`` is NOT_FOUND on each of a set of fresh connections (so in each child)."""
    x = np.ones((1, 4), dtype=np.float32)
    connections = clients(address)
    try:
        for client in connections:
            try:
                client.infer(make_request(MODEL, x), metadata=[("x-splitstream-version", version)])
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            else:
                return False
    finally:
        for client in connections:
            client.close()
    return True


def exported(port: int) -> dict[str, str]:
    """The metric families a scrape shows with at least one sample, and their types. Left out: a family
    with no samples (multiprocess mode does not list it; with one process a scraper sees no series of it
    either) and a counter's or histogram's ``_created`` series (a creation time, which multiprocess mode
    does not give for a sum over processes)."""
    families = {
        family.name: family.type for family in text_string_to_metric_families(scrape_metrics(port)) if family.samples
    }
    return {
        name: kind
        for name, kind in families.items()
        if not (name.endswith("_created") and name.removesuffix("_created") in families)
    }


@pytest.mark.slow
def test_one_and_two_processes_export_the_same_metrics_after_the_same_traffic(tmp_path: Path) -> None:
    """Whatever a router or recorder of one process exports, the parent of two exports too (with its own
    restart counter beside them)."""
    stack = RecordingStack(tmp_path, versions={"v1": {"scale": 2.0}, "v2": {"scale": 3.0}}, experiment=EXPERIMENT)
    try:
        recorder_port = free_port()
        recorder = stack.stack.service(
            "recorder-two",
            "splitstream.recorder",
            ["--host", "127.0.0.1", "--port", str(recorder_port), "--metrics-port", str(free_port()),
             "--redis-url", stack.redis.url, "--hmac-key", HMAC_KEY, "--processes", "2"],
            port=recorder_port,
        )  # fmt: skip
        router = stack.stack.router(
            stack.registry,
            "--recorder", f"127.0.0.1:{recorder_port}", "--hmac-key", HMAC_KEY, "--log-dir", str(tmp_path / "two"),
            "--record-batch-interval-ms", "20", "--shipper-metrics-port", str(free_port()), "--processes", "2",
        )  # fmt: skip
        wait_children_serving(router)
        wait_children_serving(recorder)
        recorded = set()
        for name, each in (("one", stack.router), ("two", router)):  # the same traffic through each
            keys = [f"{name}-{i}" for i in range(48)]
            call_all(each.address, keys, name)
            call_all(each.address, keys[:12], "pinned", pin="v2")
            recorded |= {f"{name}-{key}" for key in keys} | {f"pinned-{key}" for key in keys[:12]}
        stack.wait_recorded(recorded)
        two_router, two_recorder = exported(router.metrics_port), exported(recorder.metrics_port)
        assert two_router.pop("splitstream_router_process_restarts") == "counter"  # the parent's own
        assert two_recorder.pop("splitstream_recorder_process_restarts") == "counter"
        assert two_router == exported(stack.router.metrics_port)
        assert two_recorder == exported(stack.recorder.metrics_port)
    finally:
        stack.close()


@pytest.mark.slow
def test_two_recorder_processes_write_every_call_a_router_sends(tmp_path: Path) -> None:
    stack = RecordingStack(tmp_path, recorder_args=("--processes", "2"))
    try:
        keys = [f"k-{i}" for i in range(80)]
        call_all(stack.router.address, keys, "rec")
        stack.wait_recorded({f"rec-{key}" for key in keys})
        assert stack.raw_count() == len(keys)
        stack.recorder.signal(signal.SIGTERM)
        assert stack.recorder.wait() == 0
    finally:
        stack.close()


@pytest.mark.slow
def test_port_0_with_two_processes_is_picked_by_the_parent_and_logged(tmp_path: Path) -> None:
    registry = tmp_path / "registry.yaml"
    registry.write_text("models: {}\n")
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        process = launcher.Popen(
            [sys.executable, "-m", "splitstream.router", "--registry", f"file:{registry}", "--host", "127.0.0.1",
             "--port", "0", "--metrics-port", "0", "--processes", "2"],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    try:

        def ports() -> set[int]:
            events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
            found = {e["port"] for e in events if e.get("event") == "listening"}
            return found if sum(1 for e in events if e.get("event") == "listening") == 3 else set()

        found = wait_for(ports, timeout_s=60, what="the parent and both children to log their port")
        assert len(found) == 1
        assert 0 not in found
        assert health_status(f"127.0.0.1:{found.pop()}") == 1  # SERVING
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


#: Past the bound, the smallest count (the parent would start that many) and a typo's ten thousand and more.
TOO_MANY = [str(PROCESSES_PER_CORE * usable_cores() + 1), "100000000000000000000"]


@pytest.mark.parametrize("module", ["splitstream.router", "splitstream.recorder"])
@pytest.mark.parametrize("value", ["0", "abc", *TOO_MANY, "1_000", "\u0663"])  # ٣: an Arabic-Indic 3
def test_a_bad_processes_value_exits_2_with_one_line(tmp_path: Path, module: str, value: str) -> None:
    """Above :data:`PROCESSES_PER_CORE` per core the parent started every child asked for (ten thousand
    Pythons for a typo, until the host ran out of memory), and read ``1_000`` and other scripts' digits."""
    registry = tmp_path / "registry.yaml"
    registry.write_text("models: {}\n")
    done = launcher.run(
        [sys.executable, "-m", module, "--registry", f"file:{registry}", "--port", "0", "--processes", value]
        if module == "splitstream.router"
        else [sys.executable, "-m", module, "--port", "0", "--processes", value],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--processes" in lines[0]
    assert value in lines[0]


def test_a_child_configuration_error_is_not_restarted_the_parent_exits_2(tmp_path: Path) -> None:
    registry = tmp_path / "registry.yaml"
    registry.write_text("models: [not, a, mapping]\n")  # read by the children: each finds it unusable
    done = launcher.run(
        [sys.executable, "-m", "splitstream.router", "--registry", f"file:{registry}", "--port", "0",
         "--metrics-port", "0", "--processes", "2"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "splitstream-router: error: registry" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("splitstream-router: error: process ")
    assert "starting it again" not in done.stderr


def test_processes_auto_is_the_cores_this_process_may_run_on() -> None:
    assert parse_processes("auto") == len(os.sched_getaffinity(0))
    assert parse_processes("3") == 3


@pytest.mark.slow
def test_logs_left_by_a_router_of_another_process_count_are_shipped_when_it_comes_back(tmp_path: Path) -> None:
    """Changing ``--processes`` strands nothing: 1 → 2 ships the old top-level log, 2 → 1 the children's."""
    stack = RecordingStack(tmp_path, versions={"v1": {"scale": 2.0}}, experiment=None)
    try:
        stack.recorder.stop()  # the logs must still hold everything when the router is restarted

        def calls_then_stop(prefix: str) -> set[str]:
            keys = [f"{prefix}-{i}" for i in range(30)]
            call_all(stack.router.address, keys, prefix)
            stack.router.signal(signal.SIGTERM)
            assert stack.router.wait() == 0
            return {f"{prefix}-{key}" for key in keys}

        logged = calls_then_stop("one")
        stack.router = stack.start_router("--processes", "2")
        wait_children_serving(stack.router)
        logged |= calls_then_stop("two")
        stack.router = stack.start_router()
        stack.restart_recorder()
        stack.wait_recorded(logged)
        assert stack.raw_count() == len(logged)
    finally:
        stack.close()


@pytest.mark.slow
def test_sigterm_while_the_children_are_still_starting_is_a_clean_stop(tmp_path: Path) -> None:
    """The parent's SIGTERM may reach a child before its handler is in place (it dies of the signal, having
    served nothing): that is a clean stop, exit 0, not a failed child."""
    stack = RecordingStack(tmp_path, versions={"v1": {"scale": 2.0}}, experiment=None)
    try:
        router = stack.stack.router(stack.registry, "--processes", "2", start=False)
        router.start(wait_serving=False)
        wait_for(lambda: len(child_pids(router)) == 2, timeout_s=30, interval_s=0.005, what="both children started")
        router.signal(signal.SIGTERM)  # before they have imported grpc, let alone installed a handler
        assert router.wait() == 0
    finally:
        stack.close()


@pytest.mark.slow
@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_prometheus_multiproc_dir_in_the_users_environment_is_not_used(tmp_path: Path, processes: str) -> None:
    """Another app's ``PROMETHEUS_MULTIPROC_DIR`` left in the environment: a directory that is gone failed
    the start (a traceback, exit 1), one that exists got this recorder's metric files (and a restart with
    the same pid counted on from them). Now the recorder keeps its metrics as if the variable were unset."""
    redis = RedisServer(tmp_path / "redis").start()
    stack = Stack(tmp_path)
    other_apps = tmp_path / "other-apps-metrics"
    other_apps.mkdir()
    try:
        for directory in (tmp_path / "gone", other_apps):
            port, metrics_port = free_port(), free_port()
            recorder = stack.service(
                f"recorder-{directory.name}",
                "splitstream.recorder",
                ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
                 "--redis-url", redis.url, "--processes", processes],
                port=port,
                env={"PROMETHEUS_MULTIPROC_DIR": str(directory), "SPLITSTREAM_HMAC_KEY": HMAC_KEY},
            )  # fmt: skip
            wait_for(
                lambda port=metrics_port: (
                    metric_samples(scrape_metrics(port), "splitstream_recorder_redis_up") == [({}, 1.0)]
                ),
                timeout_s=60,
                what="the recorder's scrape to show Redis up",
            )
            recorder.signal(signal.SIGTERM)
            assert recorder.wait(timeout_s=60) == 0, recorder.log()
        assert not (tmp_path / "gone").exists()
        assert list(other_apps.iterdir()) == []
    finally:
        stack.close()
        redis.stop()


def _children_of(pid: int) -> set[int]:
    children: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        children.update(int(child) for child in (task / "children").read_text().split())
    return children


@pytest.mark.slow
def test_a_parent_whose_stderr_reader_went_away_still_restarts_children_and_stops_on_sigterm(tmp_path: Path) -> None:
    """stderr a pipe whose reader ended (``| head`` exited, a log collector restarted): every log line
    raised BrokenPipeError in the task writing it. The parent's restart task ended at its first
    "starting it again" line, and its SIGTERM handler raised before it set the stop flag, so the
    parent lived on without children and ignored SIGTERM."""
    registry = tmp_path / "registry.yaml"
    registry.write_text("models: {}\n")
    reader, writer = os.pipe()
    process = launcher.Popen(
        [sys.executable, "-m", "splitstream.router", "--registry", f"file:{registry}", "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", "--processes", "2"],
        stdout=subprocess.DEVNULL, stderr=writer, cwd=ROOT,
    )  # fmt: skip
    os.close(writer)
    try:
        with os.fdopen(reader, "rb") as log:
            listening = 0
            while listening < 3:  # the parent and both children
                line = log.readline()
                assert line, "the router ended before its children listened"
                listening += b'"event": "listening"' in line
        # The reader is gone: every line from now on meets a broken pipe.
        first = wait_for(lambda: len(_children_of(process.pid)) == 2 and _children_of(process.pid), timeout_s=30)
        killed = min(first)
        os.kill(killed, signal.SIGKILL)
        wait_for(
            lambda: killed not in _children_of(process.pid) and len(_children_of(process.pid)) == 2,
            timeout_s=60,
            what="the killed child to be started again",
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def _has_mapped(pid: int, library: str) -> bool:
    """Whether ``pid`` has loaded a shared library whose path holds ``library`` (a C extension its imports
    have reached), as /proc says."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("command", ["splitstream-router", "splitstream-recorder"])
@pytest.mark.parametrize("moment", ["the parent imports", "the children import"])
def test_ctrl_c_while_a_processes_server_starts_exits_0_without_a_traceback(
    tmp_path: Path, command: str, moment: str
) -> None:
    """Ctrl-C reaches the whole process group. Before a process's event loop handled SIGINT, Python's
    default handler raised KeyboardInterrupt wherever its imports had got to: a screenful of traceback per
    process still starting, and a parent killed by the signal (exit -2) before it had started a child."""
    registry = tmp_path / "registry.yaml"
    registry.write_text("models: {}\n")
    own = (
        ["--registry", f"file:{registry}"]
        if command == "splitstream-router"
        else ["--redis-url", "redis://127.0.0.1:1/0"]
    )
    process = launcher.Popen(
        [str(Path(sys.executable).parent / command), *own, "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--processes", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    assert process.stderr is not None
    seen = b""
    try:
        if moment == "the children import":
            while seen.count(b'"event": "child started"') < 2:
                line = process.stderr.readline()
                assert line, f"the parent ended before it started both children:\n{seen.decode()}"
                seen += line
        else:  # the console script is past its quiet_interrupts and still importing the server's modules
            wait_for(lambda: _has_mapped(process.pid, "cygrpc") or process.poll() is not None, timeout_s=30)
        os.killpg(process.pid, signal.SIGINT)
        _, rest = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    stderr = (seen + rest).decode(errors="replace")
    assert "Traceback" not in stderr, stderr
    assert "KeyboardInterrupt" not in stderr, stderr
    assert process.returncode == 0, stderr


@pytest.mark.slow
def test_a_metrics_directory_left_by_a_sigkilled_parent_is_removed_at_the_next_start(tmp_path: Path) -> None:
    """A parent killed with SIGKILL never removes its children's metrics directory: each such death left a
    ``splitstream-metrics-*`` directory of files in /tmp for good. The next parent removes those whose parent
    is dead, and nothing else: not one whose pid lives, nor a link, nor one holding files it did not write."""
    registry = tmp_path / "registry.yaml"
    registry.write_text("models: {}\n")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary)}

    def start() -> subprocess.Popen[bytes]:
        return launcher.Popen(
            [sys.executable, "-m", "splitstream.router", "--registry", f"file:{registry}", "--host", "127.0.0.1",
             "--port", "0", "--metrics-port", str(free_port()), "--processes", "2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=env,
        )  # fmt: skip

    def metrics_dirs() -> set[Path]:
        return {path for path in temporary.glob("splitstream-metrics-*") if path.is_dir() and not path.is_symlink()}

    killed = start()
    try:
        wait_for(lambda: any(p.glob("*.db") for p in metrics_dirs()), timeout_s=60, what="the children's metrics")
        children = _children_of(killed.pid)
        killed.kill()
        killed.wait()
        wait_for(lambda: not any(alive(pid) for pid in children), timeout_s=30, what="the children to end")
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    (stale,) = metrics_dirs()
    assert stale.name.startswith(f"splitstream-metrics-{killed.pid}-")

    # What the next start must leave alone.
    living = temporary / f"splitstream-metrics-{os.getpid()}-living"  # this test's own pid: alive
    living.mkdir()
    (living / "counter_1.db").write_bytes(b"")
    foreign = temporary / f"splitstream-metrics-{killed.pid}-foreign"  # a dead pid, but not only metrics files
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not prometheus-client's")
    linked = temporary / f"splitstream-metrics-{killed.pid}-link"
    linked.symlink_to(living)
    plain = temporary / f"splitstream-metrics-{killed.pid}-file"
    plain.write_text("a file")

    second = start()
    try:
        wait_for(lambda: not stale.exists(), timeout_s=60, what="the stale metrics directory to be removed")
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert sorted(path.name for path in temporary.iterdir()) == sorted(
        path.name for path in (living, foreign, linked, plain)
    )
    assert (living / "counter_1.db").exists()
    assert (foreign / "notes.txt").exists()
