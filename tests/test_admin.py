"""The admin CLI in-process: metrics arithmetic, rollout decisions on scripted metrics, input the file
registry refuses, and what its writes keep of the file (everything but the lines of the weights moved).
End-to-end rollouts on real processes are in test_hot_swap.py."""

from __future__ import annotations

import difflib
import math
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitstream.admin import metrics
from splitstream.admin.main import main
from splitstream.admin.outcomes import OutcomeGuard
from splitstream.admin.rollout import FAILED, PROMOTED, ROLLED_BACK, Rollout, RolloutPlan
from splitstream.admin.store import Conflict, Endpoint, FileStore, Invalid, ModelView, Store
from splitstream.analysis import statistics as st
from splitstream.analysis.model import (
    Analysis,
    ArmSummary,
    CallCounts,
    FeedbackCounts,
    Interval,
    MetricComparison,
    MetricSpec,
    PhaseResult,
    SampleRatioMismatch,
)
from splitstream.common.experiment import Experiment
from splitstream.common.registry import parse_registry
from tests.harness import free_port, write_registry

# -- metrics -----------------------------------------------------------------------------------------

EXPOSITION = """
# TYPE splitstream_router_requests_total counter
splitstream_router_requests_total{model="m",version="v1",status="OK"} 90
splitstream_router_requests_total{model="m",version="v2",status="OK"} 8
splitstream_router_requests_total{model="m",version="v2",status="INTERNAL"} 2
splitstream_router_requests_total{model="m",version="v2",status="INVALID_ARGUMENT"} 5
splitstream_router_requests_total{model="other",version="v2",status="INTERNAL"} 50
# TYPE splitstream_router_request_seconds histogram
splitstream_router_request_seconds_bucket{model="m",version="v2",le="0.001"} 0
splitstream_router_request_seconds_bucket{model="m",version="v2",le="0.002"} 10
splitstream_router_request_seconds_bucket{model="m",version="v2",le="0.005"} 15
splitstream_router_request_seconds_bucket{model="m",version="v2",le="+Inf"} 15
splitstream_router_request_seconds_count{model="m",version="v2"} 15
splitstream_router_request_seconds_sum{model="m",version="v2"} 0.03
"""


def test_client_errors_do_not_count_against_a_version_and_other_models_are_ignored() -> None:
    counts = metrics.parse(EXPOSITION, "m")
    assert counts["v2"].calls == 15
    assert counts["v2"].errors == 2
    assert counts["v1"].errors == 0


def test_p99_interpolates_inside_the_histogram_bucket_like_promql() -> None:
    counts = metrics.parse(EXPOSITION, "m")["v2"]
    # rank 0.99 * 15 = 14.85 lies in (0.002, 0.005] holding counts 10..15.
    assert counts.quantile(0.99) == pytest.approx(0.002 + 0.003 * (14.85 - 10) / 5)
    assert metrics.VersionCounts().quantile(0.99) is None


def test_a_step_counts_only_the_calls_between_two_scrapes_and_survives_a_router_restart() -> None:
    before = {"a": {"v2": metrics.VersionCounts(100, 1, {0.01: 100, math.inf: 100})}}
    after = {
        "a": {"v2": metrics.VersionCounts(150, 6, {0.01: 140, math.inf: 150})},
        "b": {"v2": metrics.VersionCounts(10, 0, {0.01: 10, math.inf: 10})},  # a router first seen now
    }
    step = metrics.interval(before, after)["v2"]
    assert (step.calls, step.errors, step.buckets) == (60, 5, {0.01: 50, math.inf: 60})
    restarted = metrics.interval(after, {"a": {"v2": metrics.VersionCounts(7, 0, {math.inf: 7})}})
    assert restarted["v2"].calls == 7


STREAM_EXPOSITION = """
# TYPE splitstream_router_streams_total counter
splitstream_router_streams_total{model="m",version="v2",status="OK"} 7
splitstream_router_streams_total{model="m",version="v2",status="UNAVAILABLE"} 1
splitstream_router_streams_total{model="m",version="v2",status="CANCELLED"} 2
# TYPE splitstream_router_stream_ttft_seconds histogram
splitstream_router_stream_ttft_seconds_bucket{model="m",version="v2",le="0.05"} 4
splitstream_router_stream_ttft_seconds_bucket{model="m",version="v2",le="0.1"} 8
splitstream_router_stream_ttft_seconds_bucket{model="m",version="v2",le="+Inf"} 8
splitstream_router_stream_ttft_seconds_count{model="m",version="v2"} 8
splitstream_router_stream_ttft_seconds_sum{model="m",version="v2"} 0.5
# TYPE splitstream_router_stream_gap_seconds histogram
splitstream_router_stream_gap_seconds_bucket{model="m",version="v2",le="0.01"} 90
splitstream_router_stream_gap_seconds_bucket{model="m",version="v2",le="+Inf"} 100
splitstream_router_stream_gap_seconds_count{model="m",version="v2"} 100
splitstream_router_stream_gap_seconds_sum{model="m",version="v2"} 1.2
"""


def test_streams_count_as_calls_and_their_token_histograms_are_read() -> None:
    counts = metrics.parse(EXPOSITION + STREAM_EXPOSITION, "m")["v2"]
    assert (counts.calls, counts.errors) == (15 + 10, 2 + 1)  # a cancelled stream is the client's doing
    assert counts.ttft == {0.05: 4, 0.1: 8, math.inf: 8}
    assert metrics.quantile(counts.ttft, 0.5) == pytest.approx(0.05)
    assert metrics.observations(counts.gaps) == 100
    assert counts.quantile(0.99) == pytest.approx(0.002 + 0.003 * (14.85 - 10) / 5)  # unary p99 unchanged


def test_router_addresses_become_metrics_urls() -> None:
    assert metrics.metrics_url("127.0.0.1:8002") == "http://127.0.0.1:8002/metrics"
    assert metrics.metrics_url("http://r:8002/custom") == "http://r:8002/custom"


# -- rollout decisions on scripted metrics -------------------------------------------------------------


class MemoryStore:
    """A registry in memory with check-and-set revisions."""

    description = "memory"

    def __init__(self, experiment: Experiment, versions: list[str]) -> None:
        self.experiment = experiment
        self.revision = 1
        self.versions = versions
        self.history: list[dict[str, float]] = []

    def read(self, model: str, *, probe_health: bool = False) -> ModelView:
        endpoints = tuple(Endpoint(version=v, address=f"{v}:1", health="passing") for v in self.versions)
        return ModelView(
            model=model,
            stored=self.experiment,
            problem="",
            effective=self.experiment,
            endpoints=endpoints,
            revision=self.revision,
        )

    def write(self, model: str, experiment: Experiment, revision: Any) -> None:
        if revision != self.revision:
            raise Conflict("changed")
        self.experiment = experiment
        self.revision += 1
        self.history.append({a.version: a.weight for a in experiment.arms})


class ScriptedRouters:
    """Each scrape adds calls by the current weights: ``per_scrape`` calls, v2 failing at ``v2_error_rate``,
    latencies v1 ≤ 2 ms and v2 ≤ ``v2_latency_s``."""

    def __init__(
        self,
        store: Store,
        *,
        v2_error_rate: float = 0.0,
        v2_latency_s: float = 0.002,
        v2_ttft_s: float | None = None,
        v2_gap_s: float | None = None,
    ) -> None:
        """With ``v2_ttft_s`` or ``v2_gap_s`` the routers also serve token streams, each stream 10 tokens:
        v1's first token within 50 ms and gaps within 10 ms, v2's as given (the other as fast as v1)."""
        self.store = store
        self.v2_error_rate = v2_error_rate
        self.v2_latency_s = v2_latency_s
        self.streams = v2_ttft_s is not None or v2_gap_s is not None
        self.v2_ttft_s = 0.05 if v2_ttft_s is None else v2_ttft_s
        self.v2_gap_s = 0.01 if v2_gap_s is None else v2_gap_s
        self.totals = {v: metrics.VersionCounts() for v in ("v1", "v2")}

    def __call__(self, urls: Any, model: str) -> metrics.Snapshot:
        experiment = self.store.read(model).effective
        assert experiment is not None
        weights = {a.version: a.weight for a in experiment.arms}
        for version, counts in self.totals.items():
            calls = 200 * weights.get(version, 0) / 100
            latency = self.v2_latency_s if version == "v2" else 0.002
            counts.calls += calls
            counts.errors += calls * (self.v2_error_rate if version == "v2" else 0)
            for le in (0.002, 0.005, 0.01, math.inf):
                counts.buckets[le] = counts.buckets.get(le, 0) + (calls if latency <= le else 0)
            if self.streams:
                streams = 50 * weights.get(version, 0) / 100
                counts.calls += streams
                ttft = self.v2_ttft_s if version == "v2" else 0.05
                gap = self.v2_gap_s if version == "v2" else 0.01
                for le in (0.01, 0.02, 0.05, 0.1, 0.2, math.inf):
                    counts.ttft[le] = counts.ttft.get(le, 0) + (streams if ttft <= le else 0)
                    counts.gaps[le] = counts.gaps.get(le, 0) + (9 * streams if gap <= le else 0)
        return {
            "router": {
                v: metrics.VersionCounts(c.calls, c.errors, dict(c.buckets), dict(c.ttft), dict(c.gaps))
                for v, c in self.totals.items()
            }
        }


def rollout(store: Store, routers: Any, **plan: Any) -> tuple[Any, list[str]]:
    lines: list[str] = []
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    settings = {
        "model": "m",
        "version": "v2",
        "steps": (10.0, 50.0, 100.0),
        "interval_s": 3.0,
        "max_error_rate": 0.01,
        "max_p99_ratio": 1.5,
        "metrics_urls": ("router",),
        "min_calls": 10,
        **plan,
    }
    verdict = Rollout(
        store, RolloutPlan(**settings), out=lines.append, scrape=routers, sleep=sleep, clock=lambda: now[0]
    ).run()
    return verdict, lines


def two_arms(v1: float = 100, v2: float = 0) -> Experiment:
    return Experiment.build(model="m", salt="s", control="v1", arms=[("v1", v1), ("v2", v2)])


def test_a_healthy_rollout_ramps_every_step_then_makes_the_new_version_the_control() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, lines = rollout(store, ScriptedRouters(store))
    assert verdict.code == PROMOTED, verdict.message
    assert store.history == [{"v1": 90, "v2": 10}, {"v1": 50, "v2": 50}, {"v1": 0, "v2": 100}, {"v2": 100}]
    assert store.experiment.control == "v2"
    assert store.experiment.salt == "s"
    assert sum("guards hold" in line for line in lines) == 3


def test_a_failing_version_is_set_back_to_zero_in_its_first_step() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, _ = rollout(store, ScriptedRouters(store, v2_error_rate=0.5))
    assert verdict.code == ROLLED_BACK
    assert "error rate 50.00 %" in verdict.message
    assert store.history == [{"v1": 90, "v2": 10}, {"v1": 100, "v2": 0}]
    assert store.experiment.control == "v1"


def test_a_slow_version_trips_the_p99_guard_and_is_rolled_back() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, _ = rollout(store, ScriptedRouters(store, v2_latency_s=0.009))
    assert verdict.code == ROLLED_BACK
    assert "--max-p99-ratio" in verdict.message
    assert store.history[-1] == {"v1": 100, "v2": 0}


def test_stream_guards_hold_for_a_version_as_fast_as_the_control_and_show_their_ratios() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, lines = rollout(
        store, ScriptedRouters(store, v2_ttft_s=0.05, v2_gap_s=0.01), max_ttft_p99_ratio=1.5, max_itl_p99_ratio=1.5
    )
    assert verdict.code == PROMOTED, verdict.message
    judged = [line for line in lines if "guards hold" in line]
    assert len(judged) == 3
    assert all("TTFT p99" in line and "ITL p99" in line for line in judged)
    assert "ratio 1.00" in judged[0]


def test_a_version_slow_to_its_first_token_trips_the_ttft_guard_and_is_rolled_back() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, _ = rollout(store, ScriptedRouters(store, v2_ttft_s=0.2), max_ttft_p99_ratio=1.5)
    assert verdict.code == ROLLED_BACK
    assert "TTFT p99" in verdict.message
    assert "--max-ttft-p99-ratio 1.5" in verdict.message
    assert store.history[-1] == {"v1": 100, "v2": 0}


def test_a_version_with_slow_tokens_trips_the_itl_guard_and_is_rolled_back() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, _ = rollout(store, ScriptedRouters(store, v2_gap_s=0.1), max_ttft_p99_ratio=1.5, max_itl_p99_ratio=2)
    assert verdict.code == ROLLED_BACK
    assert "ITL p99" in verdict.message
    assert "--max-itl-p99-ratio 2" in verdict.message


def test_stream_guards_are_not_judged_unless_asked() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, lines = rollout(store, ScriptedRouters(store, v2_ttft_s=0.2, v2_gap_s=0.1))
    assert verdict.code == PROMOTED, verdict.message
    assert not any("TTFT" in line for line in lines)


def test_a_step_without_enough_calls_cannot_be_judged_and_rolls_back() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, _ = rollout(store, ScriptedRouters(store), min_calls=10_000)
    assert verdict.code == ROLLED_BACK
    assert "nothing to judge" in verdict.message


def test_an_interrupted_rollout_sets_the_new_version_back_to_zero() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    routers = ScriptedRouters(store)
    scrapes = [0]

    def scrape(urls: Any, model: str) -> metrics.Snapshot:
        scrapes[0] += 1
        if scrapes[0] == 4:  # in the first step
            raise KeyboardInterrupt
        return routers(urls, model)

    verdict, _ = rollout(store, scrape)
    assert verdict.code == ROLLED_BACK
    assert "interrupted" in verdict.message
    assert store.history[-1] == {"v1": 100, "v2": 0}


def test_a_rollout_stops_without_touching_an_experiment_someone_else_changed() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    routers = ScriptedRouters(store)
    scrapes = [0]

    def scrape(urls: Any, model: str) -> metrics.Snapshot:
        scrapes[0] += 1
        if scrapes[0] == 5:  # an operator sets weights by hand during the first step
            store.write("m", two_arms(70, 30), store.revision)
        return routers(urls, model)

    verdict, _ = rollout(store, scrape)
    assert verdict.code == FAILED
    assert "changed" in verdict.message
    assert store.history[-1] == {"v1": 70, "v2": 30}


def test_a_rollout_of_an_unregistered_version_changes_nothing() -> None:
    store = MemoryStore(two_arms(), ["v1"])
    with pytest.raises(Invalid, match="no endpoint of version"):
        rollout(store, ScriptedRouters(store))
    assert store.history == []


# -- the CLI on the file registry --------------------------------------------------------------------


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    path = tmp_path / "registry.yaml"
    write_registry(
        path,
        {
            "m": {
                "endpoints": {"v1": ["127.0.0.1:1"], "v2": ["127.0.0.1:2"]},
                "experiment": {"salt": "s", "control": "v1", "arms": [{"version": "v1", "weight": 100}]},
            },
            "other": {"endpoints": {"v1": ["127.0.0.1:3"]}},
        },
    )
    return path


def _arms_json(v1: str, v2: str) -> str:
    """An experiment as JSON text with the two weights written verbatim (NaN, true, "100", ...)."""
    arms = f'[{{"version": "v1", "weight": {v1}}}, {{"version": "v2", "weight": {v2}}}]'
    return f'{{"salt": "s", "control": "v1", "arms": {arms}}}'


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--weights", "v1=80,v2=10"], "must sum to 100, got 90"),
        (["--weights", "v1=90,v9=10"], "no endpoint of version(s) v9"),
        (["--weights", "v1=110,v2=-10"], "arms[1].weight: must not be negative, got -10"),
        (["--weights", "v1=90,v2=10", "--control", "v3"], "control 'v3' is not one of the arms"),
        (["--json", '{"control": "v1", "arms": [{"version": "v1", "weight": 100}'], "not valid JSON"),
        (["--json", '{"control": ["v1", "v2"], "arms": []}'], "'control' must be one version name"),
        # Issue 11, fault 2: NaN and infinity used to end in a traceback (exit 1), true was taken as 1 %.
        (["--weights", "v1=nan,v2=100"], "weight of 'v1' must be a finite number, got 'nan'"),
        (["--weights", "v1=100,v2=inf"], "weight of 'v2' must be a finite number, got 'inf'"),
        (["--weights", "v1=1e400,v2=0"], "weight of 'v1' must be a finite number"),
        (["--weights", "v1=90", "--shadow", "v2=nan"], "shadows[0].sample_rate: Input should be a finite number"),
        (["--json", _arms_json("NaN", "100")], "arms[0].weight: Input should be a finite number, got nan"),
        (["--json", _arms_json("Infinity", "0")], "arms[0].weight: Input should be a finite number, got inf"),
        (["--json", _arms_json("99", "true")], "arms[1].weight: Input should be a valid number, got True"),
        (["--json", _arms_json('"100"', "0")], "arms[0].weight: Input should be a valid number, got '100'"),
        (["--json", _arms_json("100", "null")], "arms[1].weight: Input should be a valid number, got None"),
        (["--json", _arms_json("100", "[0]")], "arms[1].weight: Input should be a valid number, got [0]"),
    ],
)
def test_bad_experiment_input_exits_2_with_one_line_and_leaves_the_file_untouched(
    registry: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    before = registry.read_bytes()
    try:
        code = main(["--registry", f"file:{registry}", "experiment", "set", "m", *args])
    except SystemExit as usage_error:  # argparse's own usage errors exit instead of returning
        code = usage_error.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1
    assert registry.read_bytes() == before


def test_experiment_set_rewrites_only_the_experiment_and_get_reads_it_back(
    registry: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = yaml.safe_load(registry.read_text())
    assert main(["--registry", f"file:{registry}", "experiment", "set", "m", "--weights", "v1=90,v2=10"]) == 0
    after = yaml.safe_load(registry.read_text())
    assert after["models"]["m"]["endpoints"] == before["models"]["m"]["endpoints"]
    assert after["models"]["other"] == before["models"]["other"]
    assert after["models"]["m"]["experiment"]["salt"] == "s"  # kept: fields not given keep their value
    assert not list(registry.parent.glob(".registry.yaml.*"))  # no staging file left behind
    capsys.readouterr()
    assert main(["--registry", f"file:{registry}", "experiment", "get", "m"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["arms"] == [{"version": "v1", "weight": 90}, {"version": "v2", "weight": 10}]


def test_versions_lists_every_endpoint_with_its_probed_health_and_weight(
    registry: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--registry", f"file:{registry}", "versions", "m", "--json"]) == 0
    rows = yaml.safe_load(capsys.readouterr().out)["versions"]
    assert [(r["version"], r["endpoint"], r["health"], r["weight"]) for r in rows] == [
        ("v1", "127.0.0.1:1", "unreachable", 100),
        ("v2", "127.0.0.1:2", "unreachable", 0),
    ]


def test_an_unknown_model_or_registry_scheme_is_a_usage_error(
    registry: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--registry", f"file:{registry}", "experiment", "get", "nope"]) == 2
    assert "model 'nope' is not in" in capsys.readouterr().err
    assert main(["--registry", "etcd://x", "versions", "m"]) == 2
    assert "unknown registry" in capsys.readouterr().err


# -- the file registry keeps the operator's layout ----------------------------------------------------

COMMENTED_REGISTRY = """\
# Experiments of the digits service. Reviewed in git: keep the diffs small.

models:
  m:   # the model under test
    endpoints:
      v1: [127.0.0.1:1]
      v2: ['127.0.0.1:2']
    experiment:
      salt: "s"
      control: v1
      arms:
        - version: v1
          weight: 100  # incumbent
        - version: v2
          weight: 0    # candidate
      routing_key_header: x-user-id

  other:   # one version, so no experiment
    endpoints: {v1: [127.0.0.1:3]}
"""


def changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    """The lines difflib finds only in ``before`` and only in ``after``."""
    old, new = before.splitlines(), after.splitlines()
    removed: list[str] = []
    added: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag != "equal":
            removed += old[i1:i2]
            added += new[j1:j2]
    return removed, added


class RecordingFileStore(FileStore):
    """The file store, keeping the file's text after each write."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.texts: list[str] = []

    def write(self, model: str, experiment: Experiment, revision: Any) -> None:
        super().write(model, experiment, revision)
        self.texts.append(self.path.read_text())


@pytest.fixture
def commented_registry(tmp_path: Path) -> Path:
    path = tmp_path / "registry.yaml"
    path.write_text(COMMENTED_REGISTRY)
    path.chmod(0o640)
    return path


def test_experiment_set_and_a_rollout_change_only_the_lines_of_the_weights_they_change(
    commented_registry: Path,
) -> None:
    path = commented_registry
    assert main(["--registry", f"file:{path}", "experiment", "set", "m", "--weights", "v1=90,v2=10"]) == 0
    after_set = path.read_text()
    assert changed_lines(COMMENTED_REGISTRY, after_set) == (
        ["          weight: 100  # incumbent", "          weight: 0    # candidate"],
        ["          weight: 90   # incumbent", "          weight: 10   # candidate"],
    )

    store = RecordingFileStore(path)
    verdict, _ = rollout(store, ScriptedRouters(store), steps=(10.0, 50.0, 100.0))
    assert verdict.code == PROMOTED, verdict.message
    at_10, at_50, at_100, promoted = store.texts
    assert at_10 == after_set  # the weights it already had: not a byte changed
    assert changed_lines(at_10, at_50) == (
        ["          weight: 90   # incumbent", "          weight: 10   # candidate"],
        ["          weight: 50   # incumbent", "          weight: 50   # candidate"],
    )
    assert changed_lines(at_50, at_100) == (
        ["          weight: 50   # incumbent", "          weight: 50   # candidate"],
        ["          weight: 0    # incumbent", "          weight: 100  # candidate"],
    )
    # Promotion: v2 becomes the control and v1's arm (its comment with it) goes.
    assert changed_lines(at_100, promoted) == (
        ["      control: v1", "        - version: v1", "          weight: 0    # incumbent"],
        ["      control: v2"],
    )

    # Routers read it as the promoted experiment, the other model as it was.
    before, after = (parse_registry(yaml.safe_load(text)) for text in (COMMENTED_REGISTRY, promoted))
    assert after.models["m"].experiment == Experiment.build(
        model="m", salt="s", control="v2", arms=[("v2", 100)], routing_key_header="x-user-id"
    )
    assert after.models["m"].endpoints == before.models["m"].endpoints
    assert after.models["other"] == before.models["other"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert not list(path.parent.glob(".registry.yaml.*"))


def test_a_rolled_back_rollout_leaves_the_file_as_it_was_byte_for_byte(commented_registry: Path) -> None:
    path = commented_registry
    assert main(["--registry", f"file:{path}", "experiment", "set", "m", "--weights", "v1=90,v2=10"]) == 0
    store = FileStore(path)
    verdict, _ = rollout(store, ScriptedRouters(store, v2_error_rate=0.5))
    assert verdict.code == ROLLED_BACK, verdict.message
    # Rolled back to v1 100 %, v2 0 %: the weights the file started with, in the file it started as.
    assert path.read_text() == COMMENTED_REGISTRY


def test_a_change_made_to_the_file_after_it_was_read_is_a_conflict_and_is_kept(commented_registry: Path) -> None:
    store = FileStore(commented_registry)
    view = store.read("m")
    edited_meanwhile = COMMENTED_REGISTRY.replace("# the model under test", "# the model under test (v2 soon)")
    commented_registry.write_text(edited_meanwhile)  # even a comment: the file is not what was read
    with pytest.raises(Conflict, match="changed since it was read"):
        store.write("m", two_arms(90, 10), view.revision)
    assert commented_registry.read_text() == edited_meanwhile


@pytest.mark.parametrize(
    ("text", "removed", "added"),
    [
        pytest.param(
            "models:\n"
            "  m:\n"
            "    endpoints: {v1: [127.0.0.1:1], v2: [127.0.0.1:2]}\n"
            "    experiment: {salt: s, control: v1, arms: [{version: v1, weight: 100}, {version: v2, weight: 0}]}\n",
            ["    experiment: {salt: s, control: v1, arms: [{version: v1, weight: 100}, {version: v2, weight: 0}]}"],
            ["    experiment: {salt: s, control: v1, arms: [{version: v1, weight: 90}, {version: v2, weight: 10}]}"],
            id="flow style",
        ),
        pytest.param(
            "# header\n"
            "---\n"
            "models:\n"
            "    m:\n"
            "        endpoints:\n"
            "            v1:\n"
            "                - 127.0.0.1:1\n"
            "            v2:\n"
            "                - 127.0.0.1:2\n"
            "        experiment:\n"
            "            salt: s\n"
            "            control: v1\n"
            "            arms:\n"
            "                - version: v1\n"
            "                  weight: 100\n"
            "...\n"
            "# trailer\n",
            ["                  weight: 100"],
            ["                  weight: 90", "                - version: v2", "                  weight: 10"],
            id="four spaces, document markers",
        ),
    ],
)
def test_other_layouts_are_kept_too(tmp_path: Path, text: str, removed: list[str], added: list[str]) -> None:
    path = tmp_path / "registry.yaml"
    path.write_text(text)
    assert main(["--registry", f"file:{path}", "experiment", "set", "m", "--weights", "v1=90,v2=10"]) == 0
    assert changed_lines(text, path.read_text()) == (removed, added)


def test_an_experiment_shared_through_an_anchor_changes_for_its_model_alone(tmp_path: Path) -> None:
    path = tmp_path / "registry.yaml"
    path.write_text(
        "models:\n"
        "  m:\n"
        "    endpoints: {v1: [127.0.0.1:1], v2: [127.0.0.1:2]}\n"
        "    experiment: &shared {salt: s, control: v1, arms: [{version: v1, weight: 100}, {version: v2, weight: 0}]}\n"
        "  n:\n"
        "    endpoints: {v1: [127.0.0.1:3], v2: [127.0.0.1:4]}\n"
        "    experiment: *shared\n"
    )
    before = parse_registry(yaml.safe_load(path.read_text()))
    assert main(["--registry", f"file:{path}", "experiment", "set", "n", "--weights", "v1=90,v2=10"]) == 0
    after = parse_registry(yaml.safe_load(path.read_text()))
    assert after.models["m"] == before.models["m"]
    assert {a.version: a.weight for a in after.models["n"].experiment.arms} == {"v1": 90, "v2": 10}


def test_a_stream_guard_ratio_that_is_not_positive_is_a_usage_error_naming_the_flag(
    registry: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--max-ttft-p99-ratio", "--max-itl-p99-ratio"):
        argv = ["--registry", f"file:{registry}", "rollout", "m", "v2", "--metrics", "127.0.0.1:1", flag, "0"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{flag}: must be positive" in err
        assert len(err.strip().splitlines()) == 1


# -- outcome guards: syntax and refused input ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name", "kind", "op", "bound", "relative"),
    [
        ("click:lift>=-1%", "click", "rate", ">=", -0.01, True),
        ("revenue.usd:sum:lift>=-0.5", "revenue.usd", "sum", ">=", -0.5, False),
        ("wait_s:mean:lift<=5%", "wait_s", "mean", "<=", 0.05, True),
        # proportion is the old name of rate: read as rate.
        ("click:proportion:lift >= 0", "click", "rate", ">=", 0.0, False),
        ("click:rate:lift >= 0", "click", "rate", ">=", 0.0, False),
        ("buy:conversion:lift>=-2%", "buy", "conversion", ">=", -0.02, True),
        # The metrics of the calls are per call (mean) unless a kind says otherwise.
        ("ttft_ms:lift<=10%", "ttft_ms", "mean", "<=", 0.1, True),
        ("cost:sum:lift<=0.01", "cost", "sum", "<=", 0.01, False),
    ],
)
def test_a_guard_names_its_metric_kind_direction_and_bound(
    text: str, name: str, kind: str, op: str, bound: float, relative: bool
) -> None:
    guard = OutcomeGuard.parse(text)
    assert (guard.metric.name, guard.metric.kind.value, guard.op, guard.relative) == (name, kind, op, relative)
    assert guard.bound == pytest.approx(bound)


@pytest.mark.parametrize(
    ("text", "metric", "shown"),
    [
        ("revenue:mean:cap=P99:lift>=-1%", "revenue:mean:cap=P99", "revenue:mean:cap=P99:lift>=-1%"),
        ("revenue.usd:sum:cap=250:lift>=-0.5", "revenue.usd:sum:cap=250", "revenue.usd:sum:cap=250:lift>=-0.5"),
        ("wait_s:mean:lower:cap=P99.9:lift<=5%", "wait_s:mean:lower:cap=P99.9", "wait_s:mean:cap=P99.9:lift<=5%"),
    ],
)
def test_a_guard_caps_its_metric_as_analyze_metric_does(text: str, metric: str, shown: str) -> None:
    guard = OutcomeGuard.parse(text)
    assert guard.metric == MetricSpec.parse(metric)  # the one parser: the analysis the guard reads caps the same
    assert guard.text == shown


def test_a_guard_bounds_a_lower_is_better_metric_from_above_and_says_so_to_the_analysis() -> None:
    implied = OutcomeGuard.parse("wait_s:mean:lift<=5%")
    written = OutcomeGuard.parse("wait_s:mean:lower:lift<=5%")
    assert implied.metric == written.metric
    assert str(written.metric) == "wait_s:mean:lower"  # the analysis it reads calls a rising wait "worse"
    assert OutcomeGuard.parse("click:lift>=-1%").metric.direction == "higher"
    with pytest.raises(ValueError, match="where lower is better is bounded with lift<=BOUND"):
        OutcomeGuard.parse("wait_s:mean:lower:lift>=-5%")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--guard", "wait_s:mean:lower:lift>=-5%"], "a metric where lower is better is bounded with lift<="),
        (["--guard", "click>=-1%"], "--guard 'click>=-1%': expected NAME[:KIND][:cap=CAP]:lift>=BOUND"),
        (["--guard", "click:lift>-1%"], "expected NAME[:KIND][:cap=CAP]:lift>=BOUND"),
        (["--guard", "click:lift>=-1%"], "--guard needs --redis-url"),
        (["--promote-on-win"], "--promote-on-win needs at least one --guard"),
        (
            ["--guard", "click:lift>=-1%", "--guard", "click:sum:lift>=0", "--redis-url", "redis://127.0.0.1:1"],
            "metric 'click' is given two kinds",
        ),
        (["--guard", "click:lift>=-1%", "--redis-url", "redis://127.0.0.1:1/0?bogus=1"], "bad --redis-url"),
        (["--guard", "ttft_ms:proportion:lift<=10%"], "ttft_ms is measured on the calls: its kind is mean"),
        (
            ["--guard", "cost:lift<=10%", "--redis-url", "redis://127.0.0.1:1", "--price", "v1=1/1M-in"],
            "bad --price 'v1=1/1M-in': v1 has no 'out' price",
        ),
        (
            ["--guard", "cost:lift<=10%", "--redis-url", "redis://127.0.0.1:1", "--price", "v1=1/1M-in,2/1M-out"],
            "--guard on cost needs --price for v2",
        ),
    ],
)
def test_bad_outcome_guard_flags_exit_2_with_one_line_and_change_nothing(
    registry: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    before = registry.read_bytes()
    argv = ["--registry", f"file:{registry}", "rollout", "m", "v2", "--metrics", "127.0.0.1:1", *flags]
    try:
        code = main(argv)
    except SystemExit as usage_error:
        code = usage_error.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1
    assert registry.read_bytes() == before


def test_a_guard_whose_redis_is_unreachable_exits_1_before_changing_anything(
    registry: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = registry.read_bytes()
    argv = ["--registry", f"file:{registry}", "rollout", "m", "v2", "--metrics", "127.0.0.1:1"]
    argv += ["--guard", "click:lift>=-1%", "--redis-url", f"redis://:guard-pw-secret@127.0.0.1:{free_port()}/0"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "is unreachable" in err
    assert "guard-pw-secret" not in err
    assert "nothing changed" in err
    assert registry.read_bytes() == before


# -- outcome guards on scripted analyses -----------------------------------------------------------------


class ScriptedOutcomes:
    """The analysis a rollout's guard reads: the store's current phase with ``units`` per arm (split by the
    weights unless ``split`` says otherwise), v2's click lift ``lift`` with the always-valid interval
    ``interval`` over a control at ``control_value``."""

    def __init__(
        self,
        store: MemoryStore,
        *,
        lift: float,
        interval: tuple[float, float],
        units: int = 400,
        split: dict[str, int] | None = None,
        control_value: float = 0.5,
        metric: str = "click",
    ) -> None:
        self.store = store
        self.metric = metric
        self.lift = lift
        self.interval = interval
        self.units = units
        self.split = split
        self.control_value = control_value
        self.reads: list[int] = []

    def __call__(self, since_ns: int) -> Analysis:
        self.reads.append(since_ns)
        experiment = self.store.experiment
        weights = {a.version: float(a.weight) for a in experiment.arms}
        units = self.split or {v: round(self.units * w / 100) for v, w in weights.items() if w > 0}
        srm = st.sample_ratio_mismatch(units, weights)
        assert srm is not None
        no_interval = Interval(low=None, high=None)
        base = self.control_value
        comparison = MetricComparison(
            metric=self.metric, kind=st.MetricKind.RATE, arm="v2", control="v1", test="z",
            control_value=base, arm_value=base + self.lift, absolute_lift=self.lift,
            absolute_ci=no_interval, relative_lift=self.lift / base if base else None, relative_ci=no_interval,
            p_value=None, sequential_ci=Interval(low=self.interval[0], high=self.interval[1]),
            sequential_relative_ci=Interval(low=self.interval[0] / base, high=self.interval[1] / base)
            if base else None,
            verdict="inconclusive", verdict_line="",
        )  # fmt: skip
        arms = [
            ArmSummary(arm=v, weight=weights[v], units=n, calls=n, errors=0, error_rate=0.0, latency_p50_ms=None,
                       latency_p99_ms=None, metrics={})
            for v, n in units.items()
        ]  # fmt: skip
        phase = PhaseResult(
            id=experiment.phase.id, control="v1", weights=weights, first_ns=0, units=sum(units.values()),
            crossover_units=0, srm=SampleRatioMismatch(
                observed=srm.observed, expected=srm.expected, chi2=srm.chi2, p_value=srm.p_value, flagged=srm.flagged
            ), arms=arms, comparisons=[comparison],
        )  # fmt: skip
        zero_calls = CallCounts(entries_read=0, calls=0, randomized=0, not_randomized=0, duplicates=0, corrupt=0)
        zero_feedback = FeedbackCounts(
            entries_read=0, used=0, duplicates=0, unknown=0, not_randomized=0, crossover=0, outside_window=0,
            other_metrics=0, corrupt=0,
        )  # fmt: skip
        return Analysis(
            model="m", since_ns=since_ns, until_ns=since_ns + 1, unit="user", alpha=0.05, sequential=True,
            metrics=["click:rate"], calls=zero_calls, feedback=zero_feedback, phases=[phase],
            non_randomized=[], verdicts=[],
        )  # fmt: skip


def guarded_rollout(store: MemoryStore, outcomes: ScriptedOutcomes, *guards: str, **plan: Any) -> tuple[Any, list[str]]:
    lines: list[str] = []
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    settings = {
        "model": "m", "version": "v2", "steps": (10.0, 50.0, 100.0), "interval_s": 3.0, "max_error_rate": 0.01,
        "max_p99_ratio": 1.5, "metrics_urls": ("router",), "min_calls": 10,
        "guards": tuple(OutcomeGuard.parse(g) for g in guards), **plan,
    }  # fmt: skip
    verdict = Rollout(
        store,
        RolloutPlan(**settings),
        out=lines.append,
        scrape=ScriptedRouters(store),
        sleep=sleep,
        clock=lambda: now[0],
        outcomes=outcomes,
    ).run()
    return verdict, lines


def test_significant_harm_rolls_back_at_the_first_check_that_shows_it() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    outcomes = ScriptedOutcomes(store, lift=-0.1, interval=(-0.15, -0.05))
    verdict, lines = guarded_rollout(store, outcomes, "click:lift>=-1%")
    assert verdict.code == ROLLED_BACK
    assert "v2 harms click lift -20.0 % (always-valid CI -30.0 % .. -10.0 %), bound >= -1.0 %" in verdict.message
    assert store.history == [{"v1": 90, "v2": 10}, {"v1": 100, "v2": 0}]
    assert len(outcomes.reads) == 1
    assert sum(line.strip().startswith("check ") for line in lines) == 1


def test_an_interval_that_still_reaches_the_bound_keeps_the_rollout_going_and_shows_every_check() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    outcomes = ScriptedOutcomes(store, lift=-0.02, interval=(-0.06, 0.02))
    verdict, lines = guarded_rollout(store, outcomes, "click:lift>=-1%")
    assert verdict.code == PROMOTED, verdict.message
    checks = [line for line in lines if line.strip().startswith("check ")]
    assert len(checks) == 6  # 3 s steps checked every second, at 10 % and 50 %
    assert "click lift -4.0 % (always-valid CI -12.0 % .. +4.0 %), bound >= -1.0 %: open" in checks[0]
    assert any("outcome guards not judged in this step: v1 takes no traffic" in line for line in lines)


def test_a_sequence_whose_lower_edge_clears_the_bound_reads_non_inferior_and_keeps_going() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    outcomes = ScriptedOutcomes(store, lift=0.0, interval=(-0.004, 0.004))
    verdict, lines = guarded_rollout(store, outcomes, "click:lift>=-1%")
    assert verdict.code == PROMOTED, verdict.message
    checks = [line for line in lines if line.strip().startswith("check ")]
    assert "click lift +0.0 % (always-valid CI -0.8 % .. +0.8 %), bound >= -1.0 %: non-inferior" in checks[0]


def test_an_absolute_bound_and_a_lower_is_better_guard_are_judged_on_their_own_scale() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    outcomes = ScriptedOutcomes(store, lift=0.1, interval=(0.05, 0.15), metric="wait_s")
    verdict, _ = guarded_rollout(store, outcomes, "wait_s:mean:lift<=0.02")
    assert verdict.code == ROLLED_BACK
    assert "v2 harms wait_s lift +0.1 (always-valid CI +0.05 .. +0.15), bound <= +0.02" in verdict.message


def test_promote_on_win_ends_each_step_at_its_first_significant_win() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    outcomes = ScriptedOutcomes(store, lift=0.1, interval=(0.05, 0.15))
    verdict, lines = guarded_rollout(store, outcomes, "click:lift>=-1%", promote_on_win=True)
    assert verdict.code == PROMOTED, verdict.message
    assert sum("advancing early" in line for line in lines) == 2  # the 100 % step has no control to beat
    assert len(outcomes.reads) == 2
    assert store.experiment.control == "v2"


def test_without_promote_on_win_a_win_waits_for_the_end_of_the_step() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    outcomes = ScriptedOutcomes(store, lift=0.1, interval=(0.05, 0.15))
    verdict, lines = guarded_rollout(store, outcomes, "click:lift>=-1%")
    assert verdict.code == PROMOTED, verdict.message
    assert not any("advancing early" in line for line in lines)
    assert len(outcomes.reads) == 6


def test_a_sample_ratio_mismatch_stops_the_rollout_whatever_the_lift_says() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    outcomes = ScriptedOutcomes(store, lift=0.1, interval=(0.05, 0.15), split={"v1": 300, "v2": 100})
    verdict, _ = guarded_rollout(store, outcomes, "click:lift>=-1%", promote_on_win=True)
    assert verdict.code == ROLLED_BACK
    assert "sample ratio mismatch in this step" in verdict.message
    assert "units per arm v1 300, v2 100, expected v1 360, v2 40" in verdict.message
    assert store.history[-1] == {"v1": 100, "v2": 0}


def test_guards_wait_for_enough_units_and_a_step_that_ends_without_them_rolls_back() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    # 20 and 10 units at 90/10: chi-square says p = 2e-5, but v2 expects 3 units, too few to test.
    outcomes = ScriptedOutcomes(store, lift=-0.3, interval=(-0.5, -0.1), split={"v1": 20, "v2": 10})
    verdict, lines = guarded_rollout(store, outcomes, "click:lift>=-1%")
    assert "click not judged (10 units in an arm, fewer than 30)" in lines[1]
    assert "SRM not tested yet" in lines[1]
    assert verdict.code == ROLLED_BACK
    assert "before every outcome guard could be judged: click:rate:lift>=-1%: 10 units in an arm" in (verdict.message)


def test_a_guard_on_a_metric_without_events_is_never_judged_and_the_step_rolls_back() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    outcomes = ScriptedOutcomes(store, lift=0.1, interval=(0.05, 0.15))
    verdict, _ = guarded_rollout(store, outcomes, "clik:lift>=-1%")
    assert verdict.code == ROLLED_BACK
    assert "clik:rate:lift>=-1%: no comparison with the control" in verdict.message


def test_rollout_help_shows_the_guard_syntax(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["rollout", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "NAME[:KIND][:cap=CAP]:lift>=BOUND" in out
    assert "relative (-1%)" in out


def test_a_guard_from_the_environment_is_used_and_flags_replace_it(
    registry: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPLITSTREAM_ADMIN_GUARD", "click:lift>=-1%")
    argv = ["--registry", f"file:{registry}", "rollout", "m", "v2", "--metrics", "127.0.0.1:1"]
    assert main(argv) == 2
    assert "--guard needs --redis-url" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--guard", "nonsense"])
    assert exit_info.value.code == 2
    assert "--guard 'nonsense': expected" in capsys.readouterr().err
    assert main([*argv, "--guard", "click:lift>=-1%", "--guard", "click:sum:lift>=0", "--redis-url", "x"]) == 2
    assert "given two kinds" in capsys.readouterr().err


def test_a_single_step_to_100_percent_reads_the_control_s_p99_first_and_judges_the_step_on_it() -> None:
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, lines = rollout(store, ScriptedRouters(store, v2_latency_s=0.009), steps=(100.0,))
    assert verdict.code == ROLLED_BACK, verdict.message
    assert "--max-p99-ratio" in verdict.message
    assert lines[0].startswith("baseline: m v1 100 %, v2 0 % (control v1) as it stands")
    assert store.history == [{"v1": 0, "v2": 100}, {"v1": 100, "v2": 0}]  # the baseline wrote nothing


def test_a_last_step_whose_latency_guard_no_step_could_judge_rolls_back_instead_of_promoting() -> None:
    """At 99.9 % the control answers too few calls to measure its p99, and at 100 % none: promoting would
    rest on a guard never judged."""
    store = MemoryStore(two_arms(), ["v1", "v2"])
    verdict, _lines = rollout(store, ScriptedRouters(store), steps=(99.9, 100.0))
    assert verdict.code == ROLLED_BACK, verdict.message
    assert "p99" in verdict.message
    assert "could not be judged: no step measured the control's p99" in verdict.message
    assert store.history[-1] == {"v1": 100, "v2": 0}
