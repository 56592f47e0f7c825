"""Outcome feedback: ``splitstream.v1.Feedback/Report`` on a real router, recorded by a real recorder in redis-server.

Events travel like call records (queue, batches, spool when the recorder is away) and land in
``splitstream:feedback:<model>``; a routing key is stored only as its HMAC, so user-level events
join the calls without a user id anywhere in Redis; bad events are refused one by one; an
idempotency key makes a resent event count once.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from splitstream.admin.main import main as admin_main
from splitstream.common.proto.splitstream.v1 import feedback_pb2, feedback_pb2_grpc
from splitstream.common.records import feedback_key, routing_key_hmac
from tests.harness import (
    InferClient,
    ServiceProcess,
    free_port,
    make_request,
    metric_samples,
    one_version_router,
    scrape_metrics,
    wait_for,
)
from tests.recording_stack import HMAC_KEY, MODEL, RecordingStack

Event = feedback_pb2.FeedbackEvent


def report(router: ServiceProcess, events: Sequence[feedback_pb2.FeedbackEvent]) -> feedback_pb2.FeedbackReply:
    with grpc.insecure_channel(router.address) as channel:
        reply: feedback_pb2.FeedbackReply = feedback_pb2_grpc.FeedbackStub(channel).Report(
            feedback_pb2.FeedbackReport(events=events), timeout=10
        )
        return reply


def entries(stack: RecordingStack) -> list[dict[str, str]]:
    """Every entry of the model's feedback stream, fields decoded."""
    redis: Any = stack.redis.client()
    try:
        raw = redis.xrange(feedback_key(MODEL))
    finally:
        redis.close()
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw]


def wait_entries(stack: RecordingStack, metric: str, count: int, timeout_s: float = 30.0) -> list[dict[str, str]]:
    """The entries of ``metric`` once there are ``count`` (fails if there are ever more)."""

    def enough() -> list[dict[str, str]] | None:
        found = [e for e in entries(stack) if e["metric"] == metric]
        assert len(found) <= count, f"{len(found)} entries of {metric}, expected {count}: {found}"
        return found if len(found) == count else None

    found: list[dict[str, str]] = wait_for(
        enough, timeout_s=timeout_s, interval_s=0.2, what=f"{count} '{metric}' events to be recorded"
    )
    return found


def metric_total(port: int, name: str, **labels: str) -> float:
    return sum(
        value
        for sample_labels, value in metric_samples(scrape_metrics(port), name)
        if all(sample_labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingStack]:
    stack = RecordingStack(tmp_path_factory.mktemp("feedback"))
    yield stack
    stack.close()


@pytest.mark.slow
def test_events_by_request_id_and_by_routing_key_join_the_calls_with_the_hmac_and_never_the_key(
    stack: RecordingStack,
) -> None:
    user = "user-alice-5ecret-key-41"
    client = InferClient(stack.router.address)
    client.infer(
        make_request(MODEL, np.ones((1, 4), np.float32)),
        metadata=[("x-request-id", "joined-call"), ("x-routing-key", user)],
    )
    client.close()
    (record,) = stack.wait_recorded({"joined-call"})
    happened = time.time_ns() - 3600 * 10**9  # an hour ago: late events are the rule, not an error
    reply = report(
        stack.router,
        [
            Event(model=MODEL, request_id="joined-call", metric="click", value=1.0),
            Event(model=MODEL, routing_key=user, metric="revenue.usd", value=12.5, event_unix_ns=happened),
            # Nobody recorded this id: the analysis counts such events; nothing on the way refuses them.
            Event(model=MODEL, request_id="never-recorded", metric="click", value=0.0),
        ],
    )
    assert (reply.accepted, list(reply.rejected)) == (3, [])

    clicks = wait_entries(stack, "click", 2)
    (revenue,) = wait_entries(stack, "revenue.usd", 1)
    by_id = {e["request_id"]: e for e in clicks}
    assert by_id["joined-call"]["unit"] == ""
    assert float(by_id["joined-call"]["value"]) == 1.0
    assert "never-recorded" in by_id
    assert revenue["unit"] == routing_key_hmac(HMAC_KEY.encode(), user) == record.routing_key_hmac
    assert revenue["request_id"] == ""
    assert float(revenue["value"]) == 12.5
    assert int(revenue["event_ns"]) == happened
    assert int(revenue["receive_ns"]) > happened
    # Without an event time, the event happened when the router received it.
    assert by_id["joined-call"]["event_ns"] == by_id["joined-call"]["receive_ns"] != "0"

    assert user.encode() not in stack.redis_bytes()
    assert user not in stack.router.log()
    assert user not in stack.recorder.log()


def test_bad_events_are_refused_one_by_one_naming_the_field_while_the_good_ones_are_recorded(
    stack: RecordingStack,
) -> None:
    now = time.time_ns()
    events = [
        Event(model=MODEL, request_id="good-1", metric="rating", value=4.0),
        Event(model=MODEL, request_id="r", metric="rating", value=math.nan),
        Event(model=MODEL, request_id="r", metric="rating", value=math.inf),
        Event(model=MODEL, request_id="r", metric="not a metric!", value=1.0),
        Event(model=MODEL, request_id="r", metric="", value=1.0),
        Event(model=MODEL, metric="rating", value=1.0),
        Event(model="no-such-model", request_id="r", metric="rating", value=1.0),
        Event(model=MODEL, request_id="r", metric="rating", value=1.0, event_unix_ns=now + 3600 * 10**9),
        Event(model=MODEL, request_id="r", metric="rating", value=1.0, event_unix_ns=-5),
        Event(model=MODEL, request_id="r", metric="rating", value=1.0, idempotency_key="k" * 257),
        Event(model=MODEL, routing_key="u" * 5000, metric="rating", value=1.0),
        Event(model=MODEL, request_id="x" * 20_000, metric="rating", value=1.0),
        Event(model=MODEL, request_id="r", metric="rating", value=1.0, idempotency_key="tab\there"),
        Event(model=MODEL, request_id="good-2", metric="rating", value=-2.5, idempotency_key="rating-good-2"),
    ]
    reply = report(stack.router, events)
    assert reply.accepted == 2
    refused = {r.index: r.reason for r in reply.rejected}
    expected_fields = {
        1: "value",
        2: "value",
        3: "metric",
        4: "metric",
        5: "request_id",
        6: "model",
        7: "event_unix_ns",
        8: "event_unix_ns",
        9: "idempotency_key",
        10: "routing_key",
        11: "request_id",
        12: "idempotency_key",
    }
    assert {i: reason.partition(":")[0] for i, reason in refused.items()} == expected_fields
    assert "no-such-model" in refused[6]
    assert "future" in refused[7]
    recorded = wait_entries(stack, "rating", 2)
    assert sorted(e["request_id"] for e in recorded) == ["good-1", "good-2"]
    port = stack.router.metrics_port
    assert metric_total(port, "splitstream_router_feedback_rejected_total", reason="value") >= 2
    assert metric_total(port, "splitstream_router_feedback_rejected_total", reason="metric") >= 2


def test_a_report_that_does_not_parse_or_is_too_large_gets_a_clear_status(stack: RecordingStack) -> None:
    with grpc.insecure_channel(stack.router.address) as channel:
        raw = channel.unary_unary("/splitstream.v1.Feedback/Report")
        event = b"\x0a\x02\xff\xfe"  # model = two bytes that are not UTF-8
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\x0a" + bytes([len(event)]) + event, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "splitstream.v1.FeedbackReport" in (caught.value.details() or "")

    many = [Event(model=MODEL, request_id=f"m{i}", metric="many", value=1.0) for i in range(1001)]
    with pytest.raises(grpc.RpcError) as caught:
        report(stack.router, many)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1001 events" in (caught.value.details() or "")

    heavy = [Event(model=MODEL, request_id="h" * 16_000, metric="heavy", value=1.0) for _ in range(300)]
    with pytest.raises(grpc.RpcError) as caught:
        report(stack.router, heavy)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bytes" in (caught.value.details() or "")
    # Nothing of a refused report was queued.
    assert not [e for e in entries(stack) if e["metric"] in ("many", "heavy")]


def test_an_event_resent_with_the_same_idempotency_key_is_written_once(stack: RecordingStack) -> None:
    once = Event(model=MODEL, request_id="dup-call", metric="purchase", value=30.0, idempotency_key="order-77")
    same_key_other_metric = Event(
        model=MODEL, request_id="dup-call", metric="purchase.items", value=2.0, idempotency_key="order-77"
    )
    keyless = Event(model=MODEL, request_id="dup-call", metric="purchase.view", value=1.0)
    assert report(stack.router, [once, once, same_key_other_metric, keyless]).accepted == 4
    assert report(stack.router, [once, keyless]).accepted == 2

    def duplicates() -> float:
        return metric_total(
            stack.shipper_metrics_port, "splitstream_shipper_feedback_recorded_total", result="duplicate"
        )

    # Once the recorder has acknowledged both duplicates, everything of both reports is in Redis.
    wait_for(lambda: duplicates() >= 2, timeout_s=20, what="the router to count the duplicates the recorder acked")
    recorded = [e for e in entries(stack) if e["request_id"] == "dup-call"]
    assert sorted(e["metric"] for e in recorded) == ["purchase", "purchase.items", "purchase.view", "purchase.view"]
    (purchase,) = [e for e in recorded if e["metric"] == "purchase"]
    assert purchase["idempotency_key"] == "order-77"
    assert duplicates() == 2
    assert metric_total(stack.recorder.metrics_port, "splitstream_recorder_feedback_duplicates_total", model=MODEL) == 2
    assert redis_ttl(stack, "splitstream:feedback-seen:{splitstream:feedback:affine}:purchase:order-77") > 0


def redis_ttl(stack: RecordingStack, key: str) -> int:
    redis: Any = stack.redis.client()
    try:
        return int(redis.ttl(key))
    finally:
        redis.close()


@pytest.mark.slow
def test_events_reported_while_the_recorder_is_down_arrive_when_it_is_back_even_across_a_router_restart(
    tmp_path: Path,
) -> None:
    stack = RecordingStack(tmp_path)
    try:
        user = "user-bob-spooled-77"
        stack.recorder.kill()
        first = [Event(model=MODEL, routing_key=user, metric="outage", value=float(i)) for i in range(20)]
        assert report(stack.router, first).accepted == 20

        def kept() -> bool:  # read by the shipper, and kept in the log while the recorder is away
            text = scrape_metrics(stack.shipper_metrics_port)
            entries = metric_samples(text, "splitstream_shipper_log_entries_total")
            return any(labels.get("kind") == "feedback" and value >= 1 for labels, value in entries) and any(
                value > 0 for _, value in metric_samples(text, "splitstream_shipper_log_pending_bytes")
            )

        wait_for(kept, timeout_s=15, what="the events to be kept in the log")
        stack.restart_recorder()
        recorded = wait_entries(stack, "outage", 20)
        assert sorted(float(e["value"]) for e in recorded) == [float(i) for i in range(20)]

        stack.recorder.kill()
        second = [
            Event(model=MODEL, routing_key=user, metric="restart", value=float(i), idempotency_key=f"r-{i}")
            for i in range(30)
        ]
        assert report(stack.router, second).accepted == 30
        stack.router.signal(signal.SIGTERM)
        assert stack.router.wait(timeout_s=30) == 0  # they wait in the log
        on_disk = list(stack.spool_dir.glob("wal-*.log"))
        assert any(p.stat().st_size for p in on_disk)
        assert user.encode() not in b"".join(p.read_bytes() for p in on_disk)
        stack.restart_recorder()
        stack.router = stack.start_router()  # a new router process finds the spool and sends it
        recorded = wait_entries(stack, "restart", 30)
        assert {e["unit"] for e in recorded} == {routing_key_hmac(HMAC_KEY.encode(), user)}
        assert user.encode() not in stack.redis_bytes()
    finally:
        stack.close()


@pytest.mark.slow
def test_a_router_without_a_recorder_refuses_feedback_with_failed_precondition(tmp_path: Path) -> None:
    with one_version_router(tmp_path, MODEL, salt="no-recorder") as router:
        with pytest.raises(grpc.RpcError) as caught:
            report(router, [Event(model=MODEL, request_id="r", metric="click", value=1.0)])
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--recorder" in (caught.value.details() or "")


# -- splitstream feedback import ---------------------------------------------------------------------

CSV_EVENTS = """model,request_id,routing_key,metric,value,event_time,idempotency_key
affine,imp-1,,conversion,1,2026-01-15T08:00:00+01:00,imp-k1
affine,,{user},conversion,0,1767225600.5,imp-k2
,imp-3,,conversion,1,1767225600000000001,imp-k3
"""


def import_file(router: ServiceProcess, path: Path, *extra: str) -> int:
    return admin_main(["feedback", "import", str(path), "--router", router.address, *extra])


def test_import_sends_csv_and_json_lines_and_a_second_import_counts_nothing_twice(
    stack: RecordingStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = "dave-imported-user-id"
    events = tmp_path / "outcomes.csv"
    events.write_text(CSV_EVENTS.format(user=user))
    assert import_file(stack.router, events, "--model", MODEL) == 0
    assert capsys.readouterr().out.strip() == f"{events}: 3 events read, 3 accepted, 0 rejected"
    recorded = {e["idempotency_key"]: e for e in wait_entries(stack, "conversion", 3)}
    assert int(recorded["imp-k1"]["event_ns"]) == 1768460400 * 10**9  # 07:00 UTC
    assert int(recorded["imp-k2"]["event_ns"]) == 1767225600_500_000_000
    assert int(recorded["imp-k3"]["event_ns"]) == 1767225600_000_000_001
    assert recorded["imp-k2"]["unit"] == routing_key_hmac(HMAC_KEY.encode(), user)
    assert recorded["imp-k3"]["request_id"] == "imp-3"

    lines = tmp_path / "more.jsonl"
    lines.write_text(
        '{"model": "affine", "request_id": "imp-4", "metric": "conversion", "value": 2.5, '
        '"idempotency_key": "imp-k4"}\n'
        "\n"
        '{"model": "elsewhere", "request_id": "imp-5", "metric": "conversion", "value": 1}\n'
    )
    assert import_file(stack.router, lines) == 1  # one event rejected
    captured = capsys.readouterr()
    assert f"{lines}:3: rejected: model: 'elsewhere' is not served by this router" in captured.err
    assert captured.out.strip() == f"{lines}: 2 events read, 1 accepted, 1 rejected"

    duplicates_before = metric_total(
        stack.shipper_metrics_port, "splitstream_shipper_feedback_recorded_total", result="duplicate"
    )
    assert import_file(stack.router, events, "--model", MODEL, "--batch-size", "2") == 0
    wait_for(
        lambda: (
            metric_total(stack.shipper_metrics_port, "splitstream_shipper_feedback_recorded_total", result="duplicate")
            >= duplicates_before + 3
        ),
        timeout_s=20,
        what="the re-imported events to be acknowledged as duplicates",
    )
    assert sorted(e["idempotency_key"] for e in entries(stack) if e["metric"] == "conversion") == [
        "imp-k1",
        "imp-k2",
        "imp-k3",
        "imp-k4",
    ]
    assert user.encode() not in stack.redis_bytes()


@pytest.mark.parametrize(
    ("name", "content", "where", "problem"),
    [
        ("bad.csv", "request_id,metric,value\nr1,click,1\nr2,click,lots\n", ":3:", "value"),
        ("bad.csv", "request_id,metric,value,colour\nr1,click,1,red\n", ":1:", "'colour'"),
        ("bad.csv", "request_id,metric,value\nr1,click,1,extra\n", ":2:", "more cells"),
        ("bad.csv", "request_id,metric,value\nr1,click,nan\n", ":2:", "value"),
        ("bad.csv", "request_id,metric,value\nr1,two words,1\n", ":2:", "metric"),
        ("bad.csv", "metric,value\nclick,1\n", ":2:", "request_id"),
        (
            "bad.jsonl",
            '{"request_id": "r1", "metric": "click", "value": 1}\n{"request_id": "r2", "metric"\n',
            ":2:",
            "JSON",
        ),
        ("bad.jsonl", '["r1", "click", 1]\n', ":1:", "JSON object"),
        ("bad.jsonl", '{"request_id": 7, "metric": "click", "value": 1}\n', ":1:", "request_id"),
        (
            "bad.jsonl",
            '{"request_id": "r", "metric": "click", "value": 1, "event_time": 1767225600000}\n',
            ":1:",
            "event_time",
        ),
        (
            "bad.jsonl",
            '{"request_id": "r", "metric": "click", "value": 1, "event_time": "yesterday"}\n',
            ":1:",
            "event_time",
        ),
        (
            "bad.jsonl",
            '{"request_id": "r", "metric": "click", "value": 1, "event_time": "2026-01-01T00:00:00"}\n',
            ":1:",
            "time zone",
        ),
        ("bad.jsonl", b'{"request_id": "r\xff", "metric": "click", "value": 1}\n', ":1:", "UTF-8"),
        ("outcomes.txt", "request_id,metric,value\n", ":", "--format"),
        # Bytes that are not UTF-8 past the first few kilobytes were blamed on the line where the decoder's
        # chunk began (638 here), not the line holding them.
        ("bad.csv", b"request_id,metric,value\n" + b"r,click,1\n" * 1000 + b"r\xff,click,1\n", ":1002:", "UTF-8"),
        (
            "bad.jsonl",
            b'{"request_id": "r", "metric": "click", "value": 1}\n' * 1000 + b'{"request_id": "r\xff"}\n',
            ":1001:",
            "UTF-8",
        ),
        # A CSV error was blamed on the header (line 1): the line of the record it stopped in is named.
        ("bad.csv", "request_id,metric,value\nr1,click,1\n" + "r" * 200_000 + ",click,1\n", ":3:", "field limit"),
        ("bad.csv", 'request_id,metric,value\nr1,click,1\nr2,"click\nr3,click,1\n', ":3:", "not CSV"),
        # These three ended in a traceback (exit 1) instead of a line naming the field.
        ("bad.jsonl", '{"request_id": "r", "metric": "click", "value": ' + "9" * 5000 + "}\n", ":1:", "JSON"),
        (
            "bad.jsonl",
            '{"request_id": "r", "metric": "click", "value": 1, "event_time": "9999-12-31T23:59:59Z"}\n',
            ":1:",
            "event_time",
        ),
        ("bad.csv", "request_id,metric,value,event_time\nr1,click,1,99999999999999999999999999\n", ":2:", "event_time"),
        # A key on two rows (same model and metric): the second was "accepted" and never written.
        (
            "bad.csv",
            "request_id,metric,value,idempotency_key\nr1,click,1,k1\nr2,buy,1,k1\nr3,click,2,k1\n",
            ":4:",
            "'k1' is on line 2 too",
        ),
        # A column named twice: the last cell won, silently.
        ("bad.csv", "request_id,metric,value,value\nr1,click,1,2\n", ":1:", "'value': named twice"),
    ],
)
def test_a_malformed_file_exits_2_with_one_line_naming_file_line_and_field_and_sends_nothing(
    stack: RecordingStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    content: str | bytes,
    where: str,
    problem: str,
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    received = metric_total(stack.router.metrics_port, "splitstream_router_feedback_received_total")
    assert import_file(stack.router, path, "--model", MODEL) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert f"{path.name}{where}" in line
    assert problem in line
    assert captured.out == ""
    assert metric_total(stack.router.metrics_port, "splitstream_router_feedback_received_total") == received


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--timeout-s", "0", "must be a finite number of seconds > 0, got 0.0"),
        ("--timeout-s", "-1", "must be a finite number of seconds > 0, got -1.0"),
        ("--timeout-s", "nan", "must be a finite number of seconds > 0, got nan"),
        ("--timeout-s", "inf", "must be a finite number of seconds > 0, got inf"),
        ("--show-rejected", "-5", "must not be negative, got -5"),
    ],
)
def test_an_import_flag_that_cannot_work_exits_2_naming_it_and_sends_nothing(
    stack: RecordingStack, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, problem: str
) -> None:
    """``--timeout-s 0`` (or negative, nan, inf) failed every report with DEADLINE_EXCEEDED, told as the router
    failing part way (exit 1, "import the file again"), which could never help."""
    path = tmp_path / "events.csv"
    path.write_text("request_id,metric,value\nr1,click,1\n")
    received = metric_total(stack.router.metrics_port, "splitstream_router_feedback_received_total")
    assert import_file(stack.router, path, "--model", MODEL, flag, value) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"splitstream feedback import: error: {flag}: {problem}"]
    assert metric_total(stack.router.metrics_port, "splitstream_router_feedback_received_total") == received


def test_a_report_the_log_has_no_room_for_is_refused_whole_and_counted(stack: RecordingStack, tmp_path: Path) -> None:
    # No shipper ships this log and its cap is below one event: the report cannot be logged.
    small = stack.start_router(
        "--spool-max-bytes", "64", "--log-dir", str(tmp_path / "spool"), "--shipper", "external"
    )  # fmt: skip
    try:
        events = [Event(model=MODEL, request_id=f"q{i}", metric="queue", value=1.0) for i in range(6)]
        with pytest.raises(grpc.RpcError) as caught:
            report(small, events)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "none of the 6 events was queued" in (caught.value.details() or "")
        assert metric_total(small.metrics_port, "splitstream_router_log_feedback_dropped_total", reason="log_full") == 6
        assert (
            metric_total(small.metrics_port, "splitstream_router_feedback_refused_reports_total", reason="queue_full")
            == 1
        )
    finally:
        small.stop()


class RecorderBeforeFeedback:
    """A stand-in for a recorder released before feedback existed (an older release cannot run here).

    It behaves as that release did on the wire: ``RecordBatch.feedback`` (field 3) was unknown to it, so
    it was skipped, and each batch was acknowledged with its records written and nothing said of feedback."""

    def __init__(self) -> None:
        from concurrent import futures

        from splitstream.common.proto.splitstream.v1 import recorder_pb2

        def record(batches: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for batch in batches:
                yield recorder_pb2.RecordAck(sequence=batch.sequence, written=len(batch.records))

        handler = grpc.method_handlers_generic_handler(
            "splitstream.v1.Recorder",
            {
                "Record": grpc.stream_stream_rpc_method_handler(
                    record,
                    request_deserializer=recorder_pb2.RecordBatch.FromString,
                    response_serializer=recorder_pb2.RecordAck.SerializeToString,
                )
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)


@pytest.mark.slow
def test_feedback_a_recorder_older_than_feedback_ignores_is_counted_and_said_not_lost_silently(tmp_path: Path) -> None:
    """Recorders must be upgraded before routers; when they are not, the loss is loud and counted."""
    old = RecorderBeforeFeedback()
    shipper_port = free_port()
    try:
        with one_version_router(
            tmp_path,
            MODEL,
            salt="old-recorder",
            extra=(
                "--recorder", f"127.0.0.1:{old.port}",
                "--hmac-key", HMAC_KEY,
                "--log-dir", str(tmp_path / "spool"),
                "--shipper-metrics-port", str(shipper_port),
                "--record-batch-interval-ms", "20",
            ),
        ) as router:  # fmt: skip
            reply = report(
                router, [Event(model=MODEL, request_id=f"r{i}", metric="click", value=1.0) for i in range(5)]
            )
            assert reply.accepted == 5
            wait_for(
                lambda: metric_total(shipper_port, "splitstream_shipper_feedback_dropped_total", reason="ignored") == 5,
                timeout_s=30,
                what="the 5 ignored events to be counted",
            )
            assert "predates feedback" in router.log()
    finally:
        old.close()
