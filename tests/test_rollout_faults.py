"""``splitstream rollout`` and ``experiment set`` against faults from outside, on real processes: a
``--metrics`` naming the wrong thing, signals at bad moments, the registry file edited, full or linked
under it, Consul failing mid-rollout.

The lab is two real workers (v1, v2) of one model behind a real router that follows a file registry,
under steady load; the CLI runs as a subprocess, as an operator runs it. What a rollout leaves in the
registry is read back with ``experiment get``, as the operator would.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests import launcher
from tests.consul_emulator import ConsulEmulator
from tests.harness import (
    ROOT,
    InferClient,
    ServiceProcess,
    Stack,
    SteadyLoad,
    clean_env,
    free_port,
    make_request,
    run_module,
    wait_for,
    write_registry,
)
from tests.models import add_version
from tests.tmpfs import small_tmpfs

#: Every test here starts several processes or waits out real time (make test-fast skips them).
pytestmark = pytest.mark.slow

MODEL = "m"
#: Loose latency and few calls per step: two cores run the router, both workers and the load here.
JUDGED = ("--interval", "3s", "--check-every", "0.3s", "--min-calls", "5", "--max-p99-ratio", "50")


def arms(text: str, model: str = MODEL) -> dict[str, float]:
    """The weights of ``model``'s experiment in a registry file's text."""
    experiment = yaml.safe_load(text)["models"][model]["experiment"]
    return {a["version"]: a["weight"] for a in experiment["arms"]}


class Lab:
    """v1 and v2 of ``m`` (and a model ``other`` on v1) behind a router on ``registry``, under load."""

    def __init__(self, tmp: Path, registry: Path | None = None) -> None:
        self.tmp = tmp
        add_version(tmp / "models", MODEL, "v1", scale=2.0)
        add_version(tmp / "models", MODEL, "v2", scale=3.0)
        self.stack = Stack(tmp)
        self.workers = {v: self.stack.worker(tmp / "models", MODEL, v, start=False) for v in ("v1", "v2")}
        for worker in self.workers.values():
            worker.start(wait_serving=False)
        for worker in self.workers.values():
            worker.wait_serving()
        self.registry = registry or tmp / "registry.yaml"
        self.write()
        self.router: ServiceProcess = self.stack.router(self.registry)
        self.metrics = f"127.0.0.1:{self.router.metrics_port}"
        self.load = SteadyLoad(self.router.address, MODEL, threads=2, key_prefix="lab", pause_s=0.005).__enter__()
        self.load.wait_calls(20)

    def write(self, v2: float = 0) -> None:
        """The registry as its operator keeps it: v1 the control, v2 at ``v2`` %."""
        one = {"v1": [self.workers["v1"].address]}
        experiment = {
            "salt": "lab",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 100 - v2}, {"version": "v2", "weight": v2}],
        }
        other = {"salt": "other", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
        endpoints = {v: [w.address] for v, w in self.workers.items()}
        models = {MODEL: {"endpoints": endpoints, "experiment": experiment}}
        write_registry(self.registry, {**models, "other": {"endpoints": one, "experiment": other}})

    def close(self) -> None:
        self.load.stop()
        self.stack.close()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path)
    yield lab
    lab.close()


class Cli:
    """``splitstream ARGS`` in a subprocess, its output (stdout and stderr) read line by line as it comes."""

    def __init__(self, *args: str) -> None:
        self.process = launcher.Popen(
            [sys.executable, "-m", "splitstream.admin", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=clean_env(),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, text: str, timeout_s: float = 60) -> str:
        def seen() -> str | None:
            if self.process.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"exited {self.process.returncode} before {text!r}:\n{self.output()}")
            return next((line for line in self.lines if text in line), None)

        try:
            line: str = wait_for(seen, timeout_s=timeout_s, what=repr(text))
        except TimeoutError as error:
            raise AssertionError(f"{error}\n{self.output()}") from None
        return line

    def wait(self, timeout_s: float = 90) -> int:
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        return code

    def output(self) -> str:
        return "\n".join(self.lines)


def rollout(registry: Path | str, *flags: str) -> Cli:
    spec = registry if isinstance(registry, str) else f"file:{registry}"
    return Cli("--registry", spec, "rollout", MODEL, "v2", *flags)


def assert_one_line_no_traceback(output: str) -> None:
    assert "Traceback" not in output, output
    assert len(output.strip().splitlines()) == 1, output


class MetricsProxy:
    """An HTTP server standing where a router's /metrics is expected: it passes the router's answer on
    until told to answer ``body`` instead (a web page, as a proxy or load balancer in the way does)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = f"http://{upstream}/metrics"
        self.body: bytes | None = None
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = proxy.body
                if body is None:
                    with urllib.request.urlopen(proxy.upstream, timeout=5) as response:
                        body = response.read()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- --metrics naming the wrong thing --------------------------------------------------------------------


@pytest.fixture
def idle_registry(tmp_path: Path) -> Path:
    """A registry of ``m`` with v1 and v2 registered (nobody listens: a refusal must come before any call)."""
    path = tmp_path / "registry.yaml"
    experiment = {"salt": "s", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
    endpoints = {"v1": ["127.0.0.1:1"], "v2": ["127.0.0.1:2"]}
    write_registry(path, {MODEL: {"endpoints": endpoints, "experiment": experiment}})
    return path


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("http://[::1", "Invalid IPv6 URL"),
        ("127.0.0.1:notaport", "notaport"),
        ("127.0.0.1:99999", "out of range"),
        ("ftp://127.0.0.1:21/metrics", "http:// or https://"),
        ("", "HOST:PORT"),
    ],
)
def test_a_metrics_url_that_cannot_be_read_is_refused_with_exit_2_and_one_line(
    idle_registry: Path, flag: str, named: str
) -> None:
    before = idle_registry.read_text()
    done = run_module("splitstream.admin", "--registry", f"file:{idle_registry}", "rollout", MODEL, "v2",
                      "--metrics", flag)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert_one_line_no_traceback(done.stderr)
    assert named in done.stderr
    assert "--metrics" in done.stderr
    assert idle_registry.read_text() == before


def test_metrics_that_are_not_a_router_s_are_refused_before_anything_changes(lab: Lab) -> None:
    before = lab.registry.read_text()
    page = MetricsProxy(lab.metrics)
    page.body = b"<html><body>Sign in to continue</body></html>\n"
    try:
        # A web page where the router's metrics were expected; a worker's metrics (Prometheus, not a router).
        for wrong in (page.address, f"127.0.0.1:{lab.workers['v1'].metrics_port}"):
            done = run_module("splitstream.admin", "--registry", f"file:{lab.registry}", "rollout", MODEL, "v2",
                              "--metrics", lab.metrics, "--metrics", wrong, *JUDGED)  # fmt: skip
            assert done.returncode == 2, done.stdout + done.stderr
            assert_one_line_no_traceback(done.stderr)
            assert wrong in done.stderr
            assert "nothing changed" in done.stderr
            assert done.stdout == ""
    finally:
        page.close()
    assert lab.registry.read_text() == before


def test_metrics_that_stop_being_prometheus_text_mid_step_roll_the_new_version_back(lab: Lab) -> None:
    proxy = MetricsProxy(lab.metrics)
    try:
        run = rollout(lab.registry, "--steps", "10,50,100", "--metrics", proxy.address, *JUDGED)
        run.wait_line("step 1/3")
        proxy.body = b"<html><body>502 Bad Gateway</body></html>\n"
        code = run.wait()
    finally:
        proxy.close()
    assert code == 3, run.output()
    assert "Traceback" not in run.output()
    assert "ROLLED BACK" in run.output(), run.output()
    assert f"{proxy.address}/metrics answered not Prometheus text" in run.output()
    assert arms(lab.registry.read_text()) == {"v1": 100, "v2": 0}


# -- signals at bad moments --------------------------------------------------------------------------


class SilentListener:
    """A port that takes connections and never answers (a router hung, a firewall holding the line)."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.socket.accept()[0])

    def close(self) -> None:
        for connection in self.accepted:
            connection.close()
        self.socket.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_first_scrape_leaves_the_registry_as_it_was_with_one_line(
    idle_registry: Path, signum: signal.Signals
) -> None:
    before = idle_registry.read_text()
    hung = SilentListener()
    try:
        run = rollout(idle_registry, "--metrics", hung.address, *JUDGED)
        wait_for(lambda: hung.accepted, timeout_s=60, what="the first scrape")
        run.process.send_signal(signum)
        code = run.wait()
    finally:
        hung.close()
    assert code == 3, run.output()
    assert_one_line_no_traceback(run.output())
    assert "interrupted before the first step" in run.output()
    assert idle_registry.read_text() == before


def on_consul(lab: Lab, emulator: ConsulEmulator) -> None:
    """The lab's workers registered in Consul, and v1 the whole experiment there."""
    client = emulator.client()
    for version, worker in lab.workers.items():
        client.agent.service.register(
            f"splitstream-{MODEL}",
            service_id=f"{MODEL}-{version}",
            address="127.0.0.1",
            port=worker.port,
            tags=[version],
            meta={"model": MODEL, "version": version},
        )
    experiment = {"salt": "lab", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
    client.kv.put(f"splitstream/experiments/{MODEL}", json.dumps(experiment))


def consul_arms(emulator: ConsulEmulator) -> dict[str, float]:
    _, entry = emulator.client().kv.get(f"splitstream/experiments/{MODEL}")
    return {a["version"]: a["weight"] for a in json.loads(entry["Value"])["arms"]}


def test_more_signals_during_a_rollback_do_not_stop_it(lab: Lab, tmp_path: Path) -> None:
    """The rollback's registry read waits on a Consul that does not answer (SIGSTOPped) while Ctrl-C
    comes again, and SIGTERM: the rollback still ends with v2 at 0 %."""
    with ConsulEmulator(tmp_path / "consul") as emulator:
        on_consul(lab, emulator)
        run = rollout(emulator.spec, "--steps", "10,50,100", "--metrics", lab.metrics, *JUDGED)
        run.wait_line("step 1/3")
        assert emulator.process is not None
        emulator.process.send_signal(signal.SIGSTOP)
        try:
            run.process.send_signal(signal.SIGINT)
            run.wait_line(f"rolling back {MODEL} v2 to 0 %")
            for again in (signal.SIGINT, signal.SIGTERM):
                run.process.send_signal(again)
        finally:
            emulator.process.send_signal(signal.SIGCONT)
        code = run.wait()
        assert code == 3, run.output()
        assert "Traceback" not in run.output()
        assert "interrupt noted" in run.output()
        assert "ROLLED BACK: interrupted" in run.output()
        assert consul_arms(emulator) == {"v1": 100, "v2": 0}


# -- the registry file edited, full or linked under a rollout --------------------------------------------


def edit_by_hand(path: Path, old: str, new: str) -> str:
    """What an operator's editor does: the whole file written anew and renamed over it."""
    text = path.read_text()
    assert old in text
    edited = text.replace(old, new)
    staging = path.with_name(path.name + ".swp")
    staging.write_text(edited)
    staging.replace(path)
    return edited


def test_an_edit_elsewhere_in_the_file_during_a_step_is_kept_and_the_rollout_goes_on(lab: Lab) -> None:
    run = rollout(lab.registry, "--steps", "10,50,100", "--metrics", lab.metrics, *JUDGED)
    run.wait_line("step 1/3")
    edit_by_hand(lab.registry, "salt: other", "salt: other-reshuffled  # changed by hand in step 1")
    code = run.wait()
    assert code == 0, run.output()
    assert "promoted" in run.output()
    text = lab.registry.read_text()
    assert "salt: other-reshuffled  # changed by hand in step 1" in text
    assert arms(text) == {"v2": 100}


def fill(directory: Path) -> None:
    """Write a file in ``directory`` until its file system is full."""
    with open(directory / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(b"\0" * 4096)


def test_experiment_set_on_a_full_disk_exits_1_with_one_line_and_the_file_as_it_was(idle_registry: Path) -> None:
    with small_tmpfs(idle_registry.parent / "small", "64k") as small:
        registry = small / "registry.yaml"
        registry.write_text(idle_registry.read_text())
        fill(small)
        done = run_module("splitstream.admin", "--registry", f"file:{registry}", "experiment", "set", MODEL,
                          "--weights", "v1=90,v2=10")  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert_one_line_no_traceback(done.stderr)
        assert "No space left on device; nothing written" in done.stderr
        assert registry.read_text() == idle_registry.read_text()
        assert sorted(p.name for p in small.iterdir()) == ["filler", "registry.yaml"]


def test_a_rollout_whose_first_step_cannot_be_written_changes_nothing(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "64k") as small:
        lab = Lab(tmp_path, registry=small / "registry.yaml")
        try:
            before = lab.registry.read_text()
            fill(small)
            run = rollout(lab.registry, "--metrics", lab.metrics, *JUDGED)
            code = run.wait()
            assert code == 1, run.output()
            assert_one_line_no_traceback(run.output())
            assert "step 1 could not be written" in run.output()
            assert "No space left on device" in run.output()
            assert lab.registry.read_text() == before
        finally:
            lab.close()


def test_a_disk_that_fills_during_a_rollout_rolls_back_once_it_has_room_again(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "64k") as small:
        lab = Lab(tmp_path, registry=small / "registry.yaml")
        try:
            run = rollout(lab.registry, "--steps", "10,50,100", "--metrics", lab.metrics, *JUDGED)
            run.wait_line("step 1/3")
            fill(small)  # step 2 cannot be written, nor at first the rollback
            run.wait_line("No space left on device; nothing written; trying again")
            assert arms(lab.registry.read_text()) == {"v1": 90, "v2": 10}
            (small / "filler").unlink()
            code = run.wait()
            assert code == 3, run.output()
            assert "Traceback" not in run.output()
            assert "ROLLED BACK: step 2 could not be written" in run.output()
            assert arms(lab.registry.read_text()) == {"v1": 100, "v2": 0}
        finally:
            lab.close()


def test_consul_failing_mid_rollout_is_waited_out_and_the_rollout_rolls_back(lab: Lab, tmp_path: Path) -> None:
    with ConsulEmulator(tmp_path / "consul") as emulator:
        on_consul(lab, emulator)
        router = lab.stack.router(emulator.spec)  # v2 takes calls as Consul's experiment says
        with SteadyLoad(router.address, MODEL, threads=2, key_prefix="consul", pause_s=0.005):
            run = rollout(emulator.spec, "--steps", "10,50,100", "--metrics", f"127.0.0.1:{router.metrics_port}",
                          *JUDGED)  # fmt: skip
            run.wait_line("step 1/3")
            with emulator.stopped():  # (KV comes back with it; the instances do not, as after an agent restart)
                run.wait_line("connection refused; trying again")
            code = run.wait()
        assert code == 3, run.output()
        assert "Traceback" not in run.output()
        assert "ROLLED BACK: step 2 could not be written" in run.output()
        assert consul_arms(emulator) == {"v1": 100, "v2": 0}


def test_experiment_set_through_a_symlink_writes_its_target_and_keeps_the_link(idle_registry: Path) -> None:
    """Registries kept in a checkout are often linked into place (``/etc/splitstream/registry.yaml`` → the
    checkout's file): the write must land in the checkout, and the link stay a link."""
    target = idle_registry.parent / "checkout" / "registry.yaml"
    target.parent.mkdir()
    idle_registry.replace(target)
    idle_registry.symlink_to(Path("checkout") / "registry.yaml")
    done = run_module("splitstream.admin", "--registry", f"file:{idle_registry}", "experiment", "set", MODEL,
                      "--weights", "v1=90,v2=10")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert idle_registry.is_symlink()
    assert arms(target.read_text()) == {"v1": 90, "v2": 10}
    assert sorted(p.name for p in target.parent.iterdir()) == ["registry.yaml"]


@pytest.mark.parametrize(
    ("guard", "named"),
    [
        ("click:lift>=1e400", "the bound 1e400 is past any number"),
        ("click:lift<=-1e999%", "the bound -1e999 is past any number"),
        ("click:propotion:lift>=-1%", "'propotion' is neither a kind"),
        ("wait_s:mean:lowr:lift<=5%", "'lowr' is neither a kind"),
        # The cap is read by analyze --metric's parser: its refusals are the guard's.
        ("click:cap=P99:lift>=-1%", "a cap applies to a number per unit (kinds mean and sum), not to rate"),
        ("revenue:sum:cap=P101:lift>=-1%", "bad cap='P101'"),
        ("revenue:sum:cap=P99:lower:lift<=1%", "the cap goes last"),
    ],
)
def test_a_guard_that_could_never_be_judged_is_refused_with_exit_2_and_one_line(
    idle_registry: Path, guard: str, named: str
) -> None:
    """A bound of infinity never trips; a metric named by a typo never has events: each waved v2 through
    or rolled back at the end of a step, for no reason the operator could see."""
    before = idle_registry.read_text()
    done = run_module("splitstream.admin", "--registry", f"file:{idle_registry}", "rollout", MODEL, "v2",
                      "--metrics", "127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1/0", "--guard", guard)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert_one_line_no_traceback(done.stderr)
    assert named in done.stderr
    assert idle_registry.read_text() == before


@pytest.mark.parametrize("steps", ["0.001", "10,33.333,100"])
def test_a_step_finer_than_the_weights_go_is_refused_with_exit_2(idle_registry: Path, steps: str) -> None:
    """Weights go by 0.01 % (``experiment set`` refuses finer ones); a step of 0.001 was written as 0 %,
    judged for a whole interval on no calls, and rolled back."""
    before = idle_registry.read_text()
    done = run_module("splitstream.admin", "--registry", f"file:{idle_registry}", "rollout", MODEL, "v2",
                      "--metrics", "127.0.0.1:1", "--steps", steps)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert_one_line_no_traceback(done.stderr)
    assert "--steps: weights go by 0.01 %" in done.stderr
    assert idle_registry.read_text() == before


@pytest.mark.parametrize("header", ["x user id", "x-user-id-bin", "grpc-timeout", "x-üser"])
def test_a_routing_key_header_no_call_can_carry_is_refused_with_exit_2(idle_registry: Path, header: str) -> None:
    """Without its key a call is split at random: such a header made every call unkeyed, silently."""
    before = idle_registry.read_text()
    done = run_module("splitstream.admin", "--registry", f"file:{idle_registry}", "experiment", "set", MODEL,
                      "--routing-key-header", header)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert_one_line_no_traceback(done.stderr)
    assert "is not a header a call can carry" in done.stderr
    assert idle_registry.read_text() == before


def test_a_rollout_whose_terminal_goes_away_rolls_back(lab: Lab) -> None:
    """An ssh session dropped mid-rollout: SIGHUP, and nothing reads the output any more. SIGHUP ended
    the process at once, v2 left at its step's weight with nothing watching it."""
    read_end, write_end = os.pipe()
    process = launcher.Popen(
        [sys.executable, "-m", "splitstream.admin", "--registry", f"file:{lab.registry}", "rollout", MODEL, "v2",
         "--steps", "10,50,100", "--metrics", lab.metrics, *JUDGED],
        stdout=write_end, stderr=write_end, cwd=ROOT, env=clean_env(),
    )  # fmt: skip
    os.close(write_end)
    with os.fdopen(read_end) as terminal:
        for line in terminal:
            if line.startswith("step 1/3"):
                break
        else:
            raise AssertionError(f"the rollout ended with {process.wait()} before its first step")
    process.send_signal(signal.SIGHUP)  # and the terminal is closed: what the rollout prints now fails
    assert process.wait(timeout=90) == 3
    assert arms(lab.registry.read_text()) == {"v1": 100, "v2": 0}


# -- names that cannot be a model's or a version's ------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "version", "named"),
    [
        ("", "v2", "the model name is empty ('')"),
        ("   ", "v2", "model '   ' contains ' '"),
        ("m\u200b", "v2", "model 'm\\u200b' contains '\\u200b'"),
        (MODEL, "", "the version name is empty ('')"),
        (MODEL, " \t", "the version name is only whitespace (' \\t')"),
        (MODEL, "v2\u200b", "version 'v2\\u200b' contains '\\u200b' (U+200B), a character that does not show"),
        (MODEL, "v2 ", "version 'v2 ' starts or ends with whitespace"),
    ],
    ids=["empty-model", "blank-model", "zero-width-model", "empty-version", "blank-version", "zero-width-version",
         "trailing-space-version"],
)  # fmt: skip
def test_a_model_or_version_name_that_cannot_be_one_is_refused_with_exit_2_and_one_line_naming_it(
    idle_registry: Path, model: str, version: str, named: str
) -> None:
    """``rollout m ''`` (a variable left empty in a script), a zero-width space pasted with the name: the name
    was looked up all the same, and the answer (``model '' is not in ...``, ``no endpoint of version(s)  ...``,
    the invisible character printed as itself) did not say what was wrong with it."""
    before = idle_registry.read_text()
    done = run_module("splitstream.admin", "--registry", f"file:{idle_registry}", "rollout", model, version,
                      "--metrics", "127.0.0.1:1")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert_one_line_no_traceback(done.stderr)
    assert named in done.stderr
    assert idle_registry.read_text() == before


def test_an_empty_model_name_is_refused_before_consul_is_asked(tmp_path: Path) -> None:
    """On Consul, model '' named the experiments prefix itself (``splitstream/experiments/``)."""
    with ConsulEmulator(tmp_path / "consul") as emulator:
        done = run_module("splitstream.admin", "--registry", emulator.spec, "rollout", "", "v2",
                          "--metrics", "127.0.0.1:1")  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert_one_line_no_traceback(done.stderr)
        assert "the model name is empty ('')" in done.stderr


# -- one router named twice -----------------------------------------------------------------------------


def test_a_router_named_twice_in_metrics_is_read_once_and_its_calls_counted_once(lab: Lab) -> None:
    """``--metrics`` repeated for one router (the same flag twice in a script, or spelt otherwise: a trailing
    slash, the scheme in capitals): its calls and errors were summed once per flag, so a step showed (and
    --min-calls counted) twice or four times the calls v2 answered. Exactly 7 calls pinned to v2 in the step."""
    lab.load.stop()
    port = lab.router.metrics_port
    spellings = (lab.metrics, lab.metrics, f"HTTP://127.0.0.1:{port}/", f"127.0.0.1:{port}/metrics/")
    flags = [part for url in spellings for part in ("--metrics", url)]
    run = rollout(lab.registry, "--steps", "50", "--interval", "4s", "--check-every", "0.5s", "--min-calls", "1",
                  *flags)  # fmt: skip
    run.wait_line("step 1/1")
    time.sleep(1.0)  # past the step's first scrape
    client = InferClient(lab.router.address)
    try:
        for number in range(7):
            client.infer(make_request(MODEL, np.ones((1, 4), dtype=np.float32), version="v2",
                                      request_id=f"pinned-{number}"))  # fmt: skip
    finally:
        client.close()
    code = run.wait()
    assert code == 0, run.output()
    assert "Traceback" not in run.output()
    assert "  v2: 7 calls, 0.00 % errors" in run.output(), run.output()
    notes = [line for line in run.output().splitlines() if "it is read once" in line]
    assert len(notes) == 3, run.output()
    assert arms(lab.registry.read_text()) == {"v1": 50, "v2": 50}


# -- two rollouts of one model -----------------------------------------------------------------------------


def refused_as_held(spec: str, holder: Cli) -> str:
    """A second rollout of ``m`` while ``holder`` runs one: exit 2 at once, one line naming who holds it."""
    started = time.monotonic()
    done = run_module("splitstream.admin", "--registry", spec, "rollout", MODEL, "v2", "--metrics", "127.0.0.1:1",
                      *JUDGED)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert_one_line_no_traceback(done.stderr)
    assert time.monotonic() - started < 20  # (an interpreter's start on two busy cores; no step is waited for)
    assert f"model '{MODEL}' already has a rollout running" in done.stderr
    assert f"rollout of v2 by pid {holder.process.pid} on {socket.gethostname()}, since " in done.stderr
    assert done.stdout == ""
    return done.stderr


def test_a_second_rollout_of_a_model_is_refused_while_one_runs_and_a_killed_one_leaves_no_lock(lab: Lab) -> None:
    """Two rollouts of one model fought over its weights (one's rollback undid the other's step). The file
    registry's lock is an flock beside the file: SIGKILL frees it, no stale lock to clear by hand."""
    first = rollout(lab.registry, "--steps", "10,50,100", "--metrics", lab.metrics, *JUDGED, "--interval", "60s")
    first.wait_line("step 1/3")
    written = lab.registry.read_text()
    refused_as_held(f"file:{lab.registry}", first)
    assert lab.registry.read_text() == written  # the second changed nothing
    first.process.send_signal(signal.SIGKILL)
    first.wait()
    assert arms(lab.registry.read_text()) == {"v1": 90, "v2": 10}  # where the killed one left v2
    again = rollout(lab.registry, "--steps", "50,100", "--metrics", lab.metrics, *JUDGED)
    code = again.wait()
    assert code == 0, again.output()
    assert "promoted" in again.output()
    assert arms(lab.registry.read_text()) == {"v2": 100}
    assert sorted(p.name for p in lab.registry.parent.iterdir() if p.name.startswith(".")) == []


def test_a_second_rollout_on_consul_is_refused_and_the_lock_goes_with_its_holder(lab: Lab, tmp_path: Path) -> None:
    """On Consul the lock is a session's acquire of ``splitstream/rollouts/m``: released when the rollout
    ends (here by SIGTERM, rolling back), and by the session's TTL when the rollout is killed."""
    from splitstream.admin.lock import CONSUL_TTL_S

    key = f"splitstream/rollouts/{MODEL}"
    with ConsulEmulator(tmp_path / "consul") as emulator:
        on_consul(lab, emulator)
        router = lab.stack.router(emulator.spec)
        metrics_flag = ("--metrics", f"127.0.0.1:{router.metrics_port}")
        with SteadyLoad(router.address, MODEL, threads=2, key_prefix="consul", pause_s=0.005):
            first = rollout(emulator.spec, "--steps", "10,50,100", *metrics_flag, *JUDGED, "--interval", "60s")
            first.wait_line("step 1/3")
            refused_as_held(emulator.spec, first)
            assert consul_arms(emulator) == {"v1": 90, "v2": 10}
            first.process.send_signal(signal.SIGTERM)
            assert first.wait() == 3, first.output()
            assert consul_arms(emulator) == {"v1": 100, "v2": 0}
            assert emulator.client().kv.get(key)[1] is None  # released at its end

            killed = rollout(emulator.spec, "--steps", "10,50,100", *metrics_flag, *JUDGED, "--interval", "60s")
            killed.wait_line("step 1/3")
            killed.process.send_signal(signal.SIGKILL)
            killed.wait()
            refused_as_held(emulator.spec, killed)  # its session lives on until its TTL runs out
            wait_for(lambda: emulator.client().kv.get(key)[1] is None, timeout_s=2 * CONSUL_TTL_S + 5,
                     what="the killed rollout's session to expire")  # fmt: skip
            again = rollout(emulator.spec, "--steps", "50,100", *metrics_flag, *JUDGED)
            code = again.wait()
        assert code == 0, again.output()
        assert "promoted" in again.output()
        assert consul_arms(emulator) == {"v2": 100}
        assert emulator.client().kv.get(key)[1] is None


def test_a_rollout_whose_consul_session_expired_while_another_took_the_lock_stops_and_leaves_it_to_that_one(
    lab: Lab, tmp_path: Path
) -> None:
    """A rollout stopped (SIGSTOP, a laptop asleep) for longer than its session's TTL loses its lock; another
    rollout may take it. When the first wakes it must not go on writing steps, or roll back the other's."""
    from splitstream.admin.lock import CONSUL_TTL_S

    key = f"splitstream/rollouts/{MODEL}"
    with ConsulEmulator(tmp_path / "consul") as emulator:
        on_consul(lab, emulator)
        router = lab.stack.router(emulator.spec)
        metrics_flag = ("--metrics", f"127.0.0.1:{router.metrics_port}")
        with SteadyLoad(router.address, MODEL, threads=2, key_prefix="consul", pause_s=0.005):
            first = rollout(emulator.spec, "--steps", "10,50,100", *metrics_flag, *JUDGED, "--interval", "60s")
            first.wait_line("step 1/3")
            first.process.send_signal(signal.SIGSTOP)
            try:
                wait_for(lambda: emulator.client().kv.get(key)[1] is None, timeout_s=2 * CONSUL_TTL_S + 5,
                         what="the stopped rollout's session to expire")  # fmt: skip
                second = rollout(emulator.spec, "--steps", "50,100", *metrics_flag, *JUDGED, "--interval", "60s")
                second.wait_line("step 1/2")
            finally:
                first.process.send_signal(signal.SIGCONT)
            assert first.wait() == 1, first.output()
            assert "was lost (its session expired) and another rollout holds it" in first.output()
            assert "rollout stopped, the experiment left to it" in first.output()
            assert consul_arms(emulator) == {"v1": 50, "v2": 50}  # the second's step, not rolled back
            second.process.send_signal(signal.SIGTERM)
            assert second.wait() == 3, second.output()
        assert consul_arms(emulator) == {"v1": 100, "v2": 0}
        assert emulator.client().kv.get(key)[1] is None


# -- a single step to 100 % ---------------------------------------------------------------------------------


def test_a_single_step_to_100_percent_judges_the_p99_guard_against_a_baseline_and_rolls_back_on_it(lab: Lab) -> None:
    """With ``--steps 100`` the control takes no traffic in the only step, and no earlier step had measured
    its p99: the guard was shown "not judged: no control reference yet" and v2 promoted on its error rate
    alone. The control's p99 is now read first over one interval at the weights as they stand (nothing
    written); a --max-p99-ratio no version can meet (0.001) rolls v2 back. (Under a load fast enough, the
    control's calls in the moment the router takes to apply the step made a reference by chance: a slow
    load here, about 20 calls a second, so those are fewer than --min-calls.)"""
    lab.load.stop()
    with SteadyLoad(lab.router.address, MODEL, threads=1, key_prefix="slow", pause_s=0.05) as slow:
        slow.wait_calls(5)
        run = rollout(lab.registry, "--steps", "100", "--metrics", lab.metrics, *JUDGED, "--min-calls", "15",
                      "--max-p99-ratio", "0.001")  # fmt: skip
        code = run.wait()
    assert code == 3, run.output()
    assert "Traceback" not in run.output()
    assert "baseline: m v1 100 %, v2 0 % (control v1) as it stands" in run.output()
    assert "ROLLED BACK: v2 p99" in run.output()
    assert "over --max-p99-ratio 0.001" in run.output()
    assert arms(lab.registry.read_text()) == {"v1": 100, "v2": 0}


def test_a_single_step_to_100_percent_that_holds_shows_its_p99_ratio_and_promotes(lab: Lab) -> None:
    run = rollout(lab.registry, "--steps", "100", "--metrics", lab.metrics, *JUDGED)
    code = run.wait()
    assert code == 0, run.output()
    step = next(line for line in run.output().splitlines() if line.startswith("  v2: "))
    assert "not judged" not in step
    assert ", ratio " in step
    assert step.endswith(": guards hold")
    assert arms(lab.registry.read_text()) == {"v2": 100}
