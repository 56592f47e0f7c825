"""What exposures and feedback cost the router's event loop, measured side by side in one run.

Two rows for the router's log append (on the event loop, as each call is answered): a call
encoded and appended to the write-ahead log without the exposure fields (as before they
existed) and with them (phase, assignment); their ratio is the cost of exposures. Then what
one event of a Feedback/Report costs (check, routing-key HMAC, serialize: run in a thread,
not on the loop) and logging it (``offer_feedback``, on the loop), per event, for reports
of 1,000.

    .venv/bin/python bench/exposures_feedback.py [--calls 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from splitstream.common.experiment import Experiment
from splitstream.common.proto.splitstream.v1 import feedback_pb2
from splitstream.router.core import CallOutcome
from splitstream.router.feedback import FeedbackService
from splitstream.router.recording import CallLog
from splitstream.router.routing import Assignment


def outcome(with_exposure: bool, experiment: Experiment) -> CallOutcome:
    call = CallOutcome("req-1", "bench", grpc.StatusCode.OK, "", b"r" * 64, version="v1", arm="v1")
    call.receive_unix_ns, call.latency_s, call.routing_key = time.time_ns(), 0.0012, "user-42"
    call.routing_key_header = "x-routing-key"
    if with_exposure:
        call.phase, call.assignment = experiment.phase, Assignment.HASH
    return call


def per_call_us(mirror: CallLog, call: CallOutcome, calls: int) -> float:
    request = b"q" * 128
    metadata = (("x-request-id", "req-1"), ("x-routing-key", "user-42"))
    started = time.perf_counter()
    for _ in range(calls):
        mirror.offer(call, request, metadata)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000, help="records built per path and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args()
    experiment = Experiment.build(model="bench", salt="s", control="v1", arms=[("v1", 90), ("v2", 10)])
    with tempfile.TemporaryDirectory() as spool_dir:
        mirror = CallLog(
            spool_dir,
            CollectorRegistry(),
            router_id="bench",
            hmac_key=b"k",
            max_bytes=1 << 40,
            segment_bytes=64 << 20,
            flush_interval_s=1.0,
        )
        plain, exposed = outcome(False, experiment), outcome(True, experiment)
        rows: dict[str, list[float]] = {"log append, no exposure fields": [], "log append, phase + assignment": []}
        for _ in range(args.rounds):
            rows["log append, no exposure fields"].append(per_call_us(mirror, plain, args.calls))
            rows["log append, phase + assignment"].append(per_call_us(mirror, exposed, args.calls))

        service = FeedbackService(mirror=mirror, hmac_key=b"k", serves=lambda m: True, registry=CollectorRegistry())
        check_us, offer_us = [], []
        for _ in range(args.rounds):
            report = feedback_pb2.FeedbackReport(
                events=[
                    feedback_pb2.FeedbackEvent(
                        model="bench", routing_key=f"user-{i}", metric="click", value=1.0, idempotency_key=f"k{i}"
                    )
                    for i in range(1000)
                ]
            )
            started = time.perf_counter()
            checked = service.check(report, time.time_ns())
            check_us.append((time.perf_counter() - started) / 1000 * 1e6)
            started = time.perf_counter()
            mirror.offer_feedback(checked.events)
            offer_us.append((time.perf_counter() - started) / 1000 * 1e6)
        mirror.writer.close()
    base = statistics.median(rows["log append, no exposure fields"])
    print(f"{'path':40} {'median µs/item':>15} {'ratio':>7}")
    for name, values in rows.items():
        median = statistics.median(values)
        print(f"{name:40} {median:15.2f} {median / base:7.2f}")
    print(f"{'feedback event: check+HMAC+serialize':40} {statistics.median(check_us):15.2f} {'(thread)':>7}")
    print(f"{'feedback event: log (offer_feedback)':40} {statistics.median(offer_us):15.3f} {'(loop)':>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
