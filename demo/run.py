"""``make demo``: the whole splitstream story on one machine, with a real model, in about a minute.

1. Train a digit classifier in two versions (v2 better) and export both to ONNX.
2. Start redis-server, the recorder, one worker per version and the router (file registry, 90/10).
3. Simulated users (sticky routing keys) send held-out digits; every call is recorded.
   Every answer earns a click or not, reported through ``splitstream.v1.Feedback/Report``: users click
   more often when the served digit label is right, so v2, the more accurate model, earns more clicks.
4. Ramp v2 to 50 % with ``splitstream rollout`` while traffic flows (guards: error rate, p99).
5. Replay the last minute against v2 with ``--compare-to`` v1 and write the HTML report.
6. ``splitstream analyze``: v2's click lift over v1 with its interval and the split's SRM check, per phase;
   ``analysis.html`` beside the replay report.
7. Print per-version calls, accuracy against the true labels, latency, the replay's mismatch rate, and the
   analysis table.

Everything it starts is stopped at the end, on an error or on Ctrl-C; a second run starts afresh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from grpc import aio

from demo.processes import Supervisor, free_port, fresh_workdir, interruptible, stepper, write_registry
from demo.train import MODEL, DemoData, train
from splitstream.common import tensors
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from splitstream.common.proto.splitstream.v1 import feedback_pb2, feedback_pb2_grpc

#: The chance a user clicks on an answer: a right digit label is worth a click far more often.
CLICK_IF_RIGHT = 0.9
CLICK_IF_WRONG = 0.1
#: Click events sent per Feedback/Report call.
FEEDBACK_BATCH = 64


@dataclass
class Observed:
    """What the simulated users saw, per served version."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    correct: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    latencies_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: int = 0
    clicks: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def share(self, version: str) -> float:
        total = sum(self.calls.values())
        return self.calls[version] / total if total else 0.0


class Traffic:
    """Simulated users: each call comes from one of ``users`` sticky keys and sends a held-out digit."""

    def __init__(self, address: str, data: DemoData, *, users: int, concurrency: int, seed: int = 0) -> None:
        self.address = address
        self.data = data
        self.users = users
        self.concurrency = concurrency
        self.random = random.Random(seed)
        self.numbered = 0

    async def run(
        self, *, calls: int | None = None, stop: threading.Event | None = None, clicks: bool = True
    ) -> Observed:
        """With ``clicks``, each answer's click (or its absence) is reported by the call's request id."""
        observed = Observed()
        sent = 0
        async with aio.insecure_channel(self.address) as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            feedback = feedback_pb2_grpc.FeedbackStub(channel)

            async def report(events: list[feedback_pb2.FeedbackEvent]) -> None:
                if events:
                    await feedback.Report(feedback_pb2.FeedbackReport(events=events), timeout=10)
                    events.clear()

            async def user_loop() -> None:
                nonlocal sent
                events: list[feedback_pb2.FeedbackEvent] = []
                while (calls is None or sent < calls) and not (stop is not None and stop.is_set()):
                    sent += 1
                    self.numbered += 1
                    request_id = f"demo-{self.numbered}"
                    index = self.random.randrange(len(self.data.labels))
                    request = oip.ModelInferRequest(model_name=MODEL)
                    image = self.data.images[index : index + 1]
                    request.inputs.add(name="x", datatype=tensors.datatype_of(image), shape=list(image.shape))
                    request.raw_input_contents.append(tensors.to_raw(image))
                    key = f"user-{self.random.randrange(self.users)}"
                    started = time.perf_counter()
                    call = stub.ModelInfer(
                        request, metadata=(("x-routing-key", key), ("x-request-id", request_id)), timeout=10
                    )
                    try:
                        response = await call
                    except aio.AioRpcError:
                        observed.errors += 1
                        continue
                    latency = time.perf_counter() - started
                    version = dict(await call.trailing_metadata() or ()).get("x-splitstream-version", "?")
                    label = int(tensors.output_arrays(response)["label"][0])
                    observed.calls[version] += 1
                    observed.correct[version] += label == int(self.data.labels[index])
                    observed.latencies_s[version].append(latency)
                    if clicks:
                        right = label == int(self.data.labels[index])
                        clicked = self.random.random() < (CLICK_IF_RIGHT if right else CLICK_IF_WRONG)
                        observed.clicks[version] += clicked
                        events.append(
                            feedback_pb2.FeedbackEvent(
                                model=MODEL, request_id=request_id, metric="click", value=float(clicked)
                            )
                        )
                        if len(events) >= FEEDBACK_BATCH:
                            await report(events)
                await report(events)

            await asyncio.gather(*(user_loop() for _ in range(self.concurrency)))
        return observed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, default=Path(".demo"), help="where models, logs and reports go")
    parser.add_argument("--calls", type=int, default=3000, help="calls before and after the ramp (each)")
    parser.add_argument("--users", type=int, default=1000, help="simulated users (sticky routing keys)")
    parser.add_argument("--concurrency", type=int, default=4, help="calls in flight")
    parser.add_argument("--step-seconds", type=float, default=5.0, help="the rollout step's observation time")
    args = parser.parse_args(argv)
    summary = interruptible(lambda: run(args))
    if summary is None:
        return 130
    print_summary(summary, args.workdir)
    return 0


def run(args: argparse.Namespace) -> dict[str, object]:
    workdir = fresh_workdir(args.workdir)
    step = stepper()
    step("training the digit classifier, v1 (150 images) and v2 (all 1078)")
    data, trained_accuracy = train(workdir / "models")
    os.environ["SPLITSTREAM_HMAC_KEY"] = secrets.token_hex(16)
    with Supervisor(workdir) as supervisor:
        step("starting redis-server, recorder, workers v1 and v2, router (90/10)")
        redis_url = supervisor.start_redis("--dir", str(workdir))
        recorder = supervisor.start_recorder(redis_url, wait=False)
        workers = {
            version: supervisor.start_worker(workdir / "models", MODEL, version, wait=False) for version in ("v1", "v2")
        }
        supervisor.wait_started()  # the router's health watch finds both workers serving from its start
        experiment = {
            "salt": "demo",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 90}, {"version": "v2", "weight": 10}],
        }
        registry = write_registry(workdir, MODEL, workers, experiment)
        router_metrics = free_port()
        router = supervisor.start_router(registry, recorder, metrics_port=router_metrics)

        traffic = Traffic(router, data, users=args.users, concurrency=args.concurrency)
        warm_up = asyncio.run(traffic.run(calls=100, clicks=False))  # warm connections; not in any table
        analysis_since = time.time()
        step(f"sending {args.calls} calls from {args.users} users at 90/10, each answer clicked or not")
        before = asyncio.run(traffic.run(calls=args.calls))
        replay_since = time.time()

        step(f"ramping v2 to 50 % with `splitstream rollout` ({args.step_seconds:g} s step, traffic flowing)")
        stop = threading.Event()
        during: list[Observed] = []
        background = threading.Thread(target=lambda: during.append(asyncio.run(traffic.run(stop=stop))))
        background.start()
        try:
            supervisor.run(
                "rollout",
                [
                    "splitstream",
                    *("--registry", f"file:{registry}", "rollout", MODEL, "v2", "--steps", "50"),
                    *("--interval", f"{args.step_seconds}s", "--metrics", f"127.0.0.1:{router_metrics}"),
                    *("--max-error-rate", "0.01", "--max-p99-ratio", "5", "--min-calls", "10"),
                ],
                timeout_s=120 + args.step_seconds * 3,
                whole_output=True,
            )
        finally:
            stop.set()
            background.join()

        step(f"sending {args.calls} calls at 50/50")
        after = asyncio.run(traffic.run(calls=args.calls))
        time.sleep(1.0)  # the router's last record and feedback batches reach Redis

        step("replaying the last minute against v2, compared with v1, and writing the report")
        replay_dir = workdir / "replay"
        replay_summary = supervisor.replay(
            redis_url,
            MODEL,
            replay_dir,
            *("--since", f"{max(replay_since, time.time() - 60):.3f}", "--until", "now"),
            *("--target", workers["v2"], "--compare-to", workers["v1"], "--speed", "max", "--concurrency", "16"),
            timeout_s=600,
        )

        step("analysing clicks per phase with `splitstream analyze` (v2's lift, its interval, the SRM check)")
        analysis = supervisor.run(
            "analyze",
            [
                "splitstream",
                *("analyze", MODEL, "--redis-url", redis_url, "--since", f"{analysis_since:.3f}"),
                *("--metric", "click:rate", "--output-dir", str(replay_dir)),
            ],
            timeout_s=300,
            log="analysis",
        )
        recorded = _recorded_count(redis_url)
        step("stopping everything")

    summary = {
        "trained_accuracy": trained_accuracy,
        "phases": {"90/10": _phase(before), "50/50": _phase(after)},
        "errors": sum(o.errors for o in (warm_up, before, after, *during)),
        "calls_sent": sum(sum(o.calls.values()) + o.errors for o in (warm_up, before, after, *during)),
        "recorded": recorded,
        "replay": replay_summary,
        "report": str(replay_dir / "report.html"),
        "clicks": {"90/10": _clicks(before), "50/50": _clicks(after)},
        "analysis": _analysis(json.loads((replay_dir / "analysis.json").read_text())),
        "analysis_table": analysis.stdout,
        "analysis_report": str(replay_dir / "analysis.html"),
        "logs": str(workdir / "logs"),
        "router_metrics": f"http://127.0.0.1:{router_metrics}/metrics (while running)",
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _phase(observed: Observed) -> dict[str, dict[str, float]]:
    phase = {}
    for version in sorted(observed.calls):
        latencies = np.array(observed.latencies_s[version]) * 1000
        phase[version] = {
            "calls": observed.calls[version],
            "share": observed.share(version),
            "accuracy": observed.correct[version] / observed.calls[version],
            "p50_ms": float(np.percentile(latencies, 50)),
            "p99_ms": float(np.percentile(latencies, 99)),
        }
    return phase


def _clicks(observed: Observed) -> dict[str, float]:
    return {v: observed.clicks[v] / observed.calls[v] for v in sorted(observed.calls) if observed.calls[v]}


def _analysis(analysis: dict[str, Any]) -> dict[str, Any]:
    """Per phase (by its weights): v2's click lift over v1 with its interval, verdict, and the SRM check."""
    phases = {}
    for phase in analysis["phases"]:
        name = "/".join(f"{w:g}" for _, w in sorted(phase["weights"].items()))
        comparison = next((c for c in phase["comparisons"] if c["arm"] == "v2" and c["metric"] == "click"), None)
        srm = phase["srm"] or {}
        phases[name] = {
            "units": {arm["arm"]: arm["units"] for arm in phase["arms"]},
            "srm_p_value": srm.get("p_value"),
            "srm_flagged": srm.get("flagged"),
            "click": None
            if comparison is None
            else {
                "v1": comparison["control_value"],
                "v2": comparison["arm_value"],
                "absolute_lift": comparison["absolute_lift"],
                "absolute_ci": comparison["absolute_ci"],
                "relative_lift": comparison["relative_lift"],
                "relative_ci": comparison["relative_ci"],
                "p_value": comparison["p_value"],
                "verdict": comparison["verdict"],
            },
        }
    return phases


def _recorded_count(redis_url: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.xlen(f"splitstream:calls:{MODEL}"))
    finally:
        client.close()


def print_summary(summary: dict[str, object], workdir: Path) -> None:
    replay = summary["replay"]
    assert isinstance(replay, dict)
    print("\nsplitstream demo: digits classifier, v1 (control) vs v2\n")
    print(f"{'phase':<7} {'version':<8} {'calls':>6} {'share':>7} {'accuracy':>9} {'p50 ms':>8} {'p99 ms':>8}")
    phases = summary["phases"]
    assert isinstance(phases, dict)
    for name, phase in phases.items():
        for version, row in phase.items():
            print(
                f"{name:<7} {version:<8} {row['calls']:>6} {row['share']:>7.1%} {row['accuracy']:>9.1%} "
                f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}"
            )
    print()
    print(
        f"calls sent {summary['calls_sent']}, client errors {summary['errors']}, records in Redis {summary['recorded']}"
    )
    print(_replay_line(replay))
    clicks = summary["clicks"]
    assert isinstance(clicks, dict)
    for name, rates in clicks.items():
        shown = ", ".join(f"{version} {rate:.1%}" for version, rate in rates.items())
        print(f"clicks per answer at {name}: {shown}")
    print("\nsplitstream analyze: clicks per answer (click:rate, users as units), v2 against v1, phase by phase\n")
    print(summary["analysis_table"])
    print(f"\nreport:  {summary['report']}")
    print(f"analysis: {summary['analysis_report']}")
    print(f"logs:    {summary['logs']}")
    print(f"summary: {workdir.resolve() / 'summary.json'}")


def _replay_line(replay: dict[str, object]) -> str:
    counts = replay.get("counts", {})
    outputs = replay.get("outputs", {})
    assert isinstance(counts, dict)
    assert isinstance(outputs, dict)
    label = outputs.get("label", {})
    probabilities = outputs.get("probabilities", {})
    if label.get("mismatch_rate") is None:  # no call compared: summary.json says null, not 0 %
        return f"replay of the last minute, v2 against v1: {counts.get('completed', 0)} calls, none compared"
    return (
        f"replay of the last minute, v2 against v1: {counts.get('completed', 0)} calls; v2's label differs from "
        f"v1's on {label['mismatch_rate']:.1%} of them (argmax agreement of the probabilities "
        f"{probabilities.get('argmax_agreement') or 0:.1%})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
