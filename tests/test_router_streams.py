"""Token streams (ModelStreamInfer) through the router, end to end: a real router in front of real
stand-ins for Triton's decoupled models (``tests/triton_decoupled.py``: Triton cannot run here)."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from splitstream.common.headers import from_header_value, header_value
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from tests import launcher
from tests.harness import ROOT, Stack, metric_samples, scrape_metrics, wait_for, write_registry
from tests.stream_client import OpenStream, is_final, run_stream
from tests.triton_decoupled import read_events, start_standin, stream_request

MODEL = "llm"


class Deployment:
    """Stand-ins for v1 and v2 of ``llm`` split 50/50 behind one router; each stand-in logs its events."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.stack = Stack(tmp)
        self.events = {v: tmp / f"events-{v}.jsonl" for v in ("v1", "v2")}
        self.workers = {v: start_standin(self.stack, MODEL, v, events=self.events[v]) for v in ("v1", "v2")}
        self.registry = tmp / "registry.yaml"
        experiment = {
            "salt": "stream-tests",
            "control": "v1",
            "arms": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}],
        }
        endpoints = {v: [w.address] for v, w in self.workers.items()}
        write_registry(self.registry, {MODEL: {"endpoints": endpoints, "experiment": experiment}})
        self.router = self.stack.router(self.registry)

    def events_of(self, request_id: str) -> list[dict]:
        """Every stand-in event about the stream that carried request ``request_id``."""
        found = []
        for path in self.events.values():
            events = read_events(path)
            streams = {e["stream"] for e in events if e.get("id") == request_id}
            found += [e for e in events if e["stream"] in streams]
        return found


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp("streams"))
    yield deployment
    deployment.stack.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    yield stack
    stack.close()


def texts(result_responses: list[oip.ModelStreamInferResponse]) -> list[str]:
    return [r.infer_response.raw_output_contents[0][4:].decode() for r in result_responses]


# -- relaying ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_response_is_relayed_byte_for_byte_with_the_final_flag_on_the_last(deployment: Deployment) -> None:
    request = stream_request("relay-1", 5, model=MODEL)
    result = run_stream(deployment.router.address, [request], metadata=[("x-routing-key", "user-relay")])
    assert result.code == grpc.StatusCode.OK, result.details
    decoded = result.decoded()
    version = result.version
    assert texts(decoded) == [f"{version}:relay-1:{n}" for n in range(5)]
    assert [is_final(r) for r in decoded] == [False] * 4 + [True]
    events = deployment.events_of("relay-1")
    # What the worker got is what the client sent; what the client got is what the worker sent.
    assert [e["sha256"] for e in events if e["event"] == "request"] == [hashlib.sha256(request).hexdigest()]
    assert [e["sha256"] for e in events if e["event"] == "response"] == [
        hashlib.sha256(r).hexdigest() for r in result.responses
    ]


@pytest.mark.parametrize("request_id", ["ünïcode", "a\x01b", "tab\there"])
def test_a_stream_whose_id_is_not_printable_ascii_is_answered_with_the_id_percent_encoded(
    deployment: Deployment, request_id: str
) -> None:
    """The unary path's first hardening fault (a non-ASCII id hung the call) must not come back on streams."""
    result = run_stream(deployment.router.address, [stream_request(request_id, 3, model=MODEL)], timeout_s=10)
    assert result.code == grpc.StatusCode.OK, result.details
    assert [is_final(r) for r in result.decoded()] == [False, False, True]
    assert result.trailers["x-request-id"] == header_value(request_id)
    assert from_header_value(result.trailers["x-request-id"]) == request_id


def test_an_empty_final_response_and_sequence_parameters_pass_through_untouched(deployment: Deployment) -> None:
    request = oip.ModelInferRequest.FromString(
        stream_request("seq-1", 2, model=MODEL, triton_enable_empty_final_response=True)
    )
    request.parameters["sequence_id"].int64_param = 42
    request.parameters["sequence_start"].bool_param = True
    request.parameters["sequence_end"].bool_param = False
    result = run_stream(deployment.router.address, [request.SerializeToString()])
    assert result.code == grpc.StatusCode.OK, result.details
    decoded = result.decoded()
    assert [is_final(r) for r in decoded] == [False, False, True]
    assert not decoded[-1].infer_response.raw_output_contents  # the final response is empty
    (received,) = [e for e in deployment.events_of("seq-1") if e["event"] == "request"]
    assert received["parameters"] == {
        "triton_enable_empty_final_response": "bool_param: true",
        "sequence_id": "int64_param: 42",
        "sequence_start": "bool_param: true",
        "sequence_end": "bool_param: false",
    }
    assert received["sha256"] == hashlib.sha256(request.SerializeToString()).hexdigest()


def test_an_error_for_one_request_travels_in_the_stream_and_the_others_are_answered(deployment: Deployment) -> None:
    requests = [stream_request("bad-1", 0, model=MODEL), stream_request("good-1", 3, model=MODEL)]
    result = run_stream(deployment.router.address, requests)
    assert result.code == grpc.StatusCode.OK, result.details
    decoded = result.decoded()
    errors = [r for r in decoded if r.error_message]
    assert [e.infer_response.id for e in errors] == ["bad-1"]
    assert "max_tokens" in errors[0].error_message
    good = [r for r in decoded if r.infer_response.id == "good-1"]
    assert [is_final(r) for r in good] == [False, False, True]


# -- routing -----------------------------------------------------------------------------------------


def test_streams_split_by_routing_key_and_every_request_of_a_stream_stays_on_its_version(
    deployment: Deployment,
) -> None:
    served: dict[str, str] = {}
    for i in range(30):
        key = f"user-{i}"
        requests = [stream_request(f"split-{i}-{n}", 2, model=MODEL) for n in range(3)]
        result = run_stream(deployment.router.address, requests, metadata=[("x-routing-key", key)])
        assert result.code == grpc.StatusCode.OK, result.details
        versions = {r.infer_response.model_version for r in result.decoded()}
        assert versions == {result.version}, "one stream, one version"
        served[key] = result.version
    assert set(served.values()) == {"v1", "v2"}
    for key, version in list(served.items())[:10]:  # sticky: the same key, the same version
        result = run_stream(
            deployment.router.address, [stream_request("again", 1, model=MODEL)], metadata=[("x-routing-key", key)]
        )
        assert result.version == version


def test_a_stream_is_pinned_by_header_or_model_version(deployment: Deployment) -> None:
    for _ in range(3):
        by_header = run_stream(
            deployment.router.address,
            [stream_request("pin-h", 1, model=MODEL)],
            metadata=[("x-splitstream-version", "v2")],
        )
        by_field = run_stream(deployment.router.address, [stream_request("pin-f", 1, model=MODEL, version="v1")])
        assert (by_header.version, by_field.version) == ("v2", "v1")
        assert by_header.decoded()[0].infer_response.model_version == "v2"


def test_a_later_request_for_another_model_or_version_gets_an_in_stream_error_and_the_stream_goes_on(
    deployment: Deployment,
) -> None:
    requests = [
        stream_request("first", 2, model=MODEL, version="v1"),
        stream_request("other-model", 2, model="another"),
        stream_request("other-version", 2, model=MODEL, version="v2"),
        stream_request("same", 2, model=MODEL),
    ]
    result = run_stream(deployment.router.address, requests)
    assert result.code == grpc.StatusCode.OK, result.details
    by_id: dict[str, list[oip.ModelStreamInferResponse]] = {}
    for response in result.decoded():
        by_id.setdefault(response.infer_response.id, []).append(response)
    assert "needs its own stream" in by_id["other-model"][0].error_message
    assert "'another'" in by_id["other-model"][0].error_message
    assert "version 'v2'" in by_id["other-version"][0].error_message
    assert (len(by_id["first"]), len(by_id["same"])) == (2, 2)
    received = [e["id"] for e in deployment.events_of("first") if e["event"] == "request"]
    assert received == ["first", "same"]  # the misfits never reached the worker


@pytest.mark.parametrize(
    ("first", "metadata", "code", "named"),
    [
        (b"\xff\xff not a request", [], grpc.StatusCode.INVALID_ARGUMENT, "ModelInferRequest"),
        (stream_request("u", 1, model="nonexistent"), [], grpc.StatusCode.NOT_FOUND, "nonexistent"),
        (stream_request("p", 1, model=MODEL), [("x-splitstream-version", "v9")], grpc.StatusCode.NOT_FOUND, "v9"),
        (
            stream_request("c", 1, model=MODEL, version="v2"),
            [("x-splitstream-version", "v1")],
            grpc.StatusCode.INVALID_ARGUMENT,
            "conflicts",
        ),
    ],
)
def test_a_stream_refused_at_routing_ends_with_the_code_a_unary_call_gets(
    deployment: Deployment, first: bytes, metadata: list[tuple[str, str]], code: grpc.StatusCode, named: str
) -> None:
    result = run_stream(deployment.router.address, [first], metadata=metadata)
    assert (result.code, result.responses) == (code, [])
    assert named in result.details


def test_an_empty_stream_ends_ok_without_responses(deployment: Deployment) -> None:
    result = run_stream(deployment.router.address, [])
    assert (result.code, result.responses) == (grpc.StatusCode.OK, [])


# -- cancellation and deadlines ----------------------------------------------------------------------


def slow_stack(stack: Stack, tmp: Path, *, endpoints: int = 1, extra: tuple[str, ...] = ()) -> list[Path]:
    """One version of ``llm`` on ``endpoints`` slow stand-ins (50 ms a token) behind a router; their event files."""
    events = [tmp / f"events-{i}.jsonl" for i in range(endpoints)]
    workers = [start_standin(stack, MODEL, "v1", "--delay-ms", "50", *extra, events=e) for e in events]
    experiment = {"salt": "s", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
    write_registry(
        tmp / "registry.yaml",
        {MODEL: {"endpoints": {"v1": [w.address for w in workers]}, "experiment": experiment}},
    )
    return events


@pytest.mark.slow
def test_a_client_cancel_cancels_the_worker_stream(stack: Stack, tmp_path: Path) -> None:
    (events,) = slow_stack(stack, tmp_path)
    router = stack.router(tmp_path / "registry.yaml")
    stream = OpenStream(router.address)
    try:
        stream.send(stream_request("cancel-me", 1000, model=MODEL))
        stream.next()
        stream.next()
        stream.cancel()
        assert stream.finish()[0] == grpc.StatusCode.CANCELLED
    finally:
        stream.close()
    wait_for(
        lambda: any(e["event"] == "cancelled" for e in read_events(events)), timeout_s=10, what="the worker's cancel"
    )
    sent = [e for e in read_events(events) if e["event"] == "response"]
    assert len(sent) < 1000


@pytest.mark.slow
def test_the_client_deadline_ends_the_stream_and_the_worker_stream_with_it(stack: Stack, tmp_path: Path) -> None:
    (events,) = slow_stack(stack, tmp_path)
    router = stack.router(tmp_path / "registry.yaml")
    result = run_stream(router.address, [stream_request("deadline", 1000, model=MODEL)], timeout_s=1.0)
    assert result.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(result.responses) < 1000
    wait_for(
        lambda: any(e["event"] == "cancelled" for e in read_events(events)),
        timeout_s=10,
        what="the worker's stream to end with the deadline",
    )


# -- failures ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_killed_mid_stream_ends_the_client_stream_with_its_status_and_is_not_retried(
    stack: Stack, tmp_path: Path
) -> None:
    events = slow_stack(stack, tmp_path, endpoints=2)
    router = stack.router(tmp_path / "registry.yaml")
    stream = OpenStream(router.address)
    try:
        stream.send(stream_request("killed", 1000, model=MODEL))
        stream.close_sending()
        for _ in range(3):
            stream.next()
        serving = wait_for(
            lambda: [i for i, e in enumerate(events) if read_events(e)], timeout_s=5, what="the serving stand-in"
        )
        (index,) = serving
        workers = [p for p in stack.processes if p.name.startswith("triton-")]
        workers[index].kill()
        code, details = stream.finish()
    finally:
        stream.close()
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert read_events(events[1 - index]) == []  # tokens had gone out: nothing was resent elsewhere


@pytest.mark.slow
def test_a_worker_failing_mid_stream_ends_the_client_stream_with_its_status_and_details(
    stack: Stack, tmp_path: Path
) -> None:
    slow_stack(stack, tmp_path, endpoints=2, extra=("--fail-after", "3"))
    router = stack.router(tmp_path / "registry.yaml")
    result = run_stream(router.address, [stream_request("fails", 10, model=MODEL)])
    assert (result.code, result.details) == (grpc.StatusCode.INTERNAL, "stand-in: failed after 3 responses")
    assert len(result.responses) == 3


@pytest.mark.slow
def test_a_worker_failing_before_the_first_response_is_retried_on_another_endpoint(
    stack: Stack, tmp_path: Path
) -> None:
    failing, healthy = tmp_path / "failing.jsonl", tmp_path / "healthy.jsonl"
    bad = start_standin(stack, MODEL, "v1", "--abort-streams", "1000", events=failing)
    good = start_standin(stack, MODEL, "v1", events=healthy)
    experiment = {"salt": "s", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
    write_registry(
        tmp_path / "registry.yaml",
        {MODEL: {"endpoints": {"v1": [bad.address, good.address]}, "experiment": experiment}},
    )
    router = stack.router(tmp_path / "registry.yaml", "--eject-after-failures", "100")
    for i in range(4):
        result = run_stream(router.address, [stream_request(f"retry-{i}", 3, model=MODEL)])
        assert result.code == grpc.StatusCode.OK, result.details
        assert len(result.decoded()) == 3
    assert read_events(failing), "some stream went to the failing endpoint first"
    received = [e["id"] for e in read_events(healthy) if e["event"] == "request"]
    assert sorted(received) == [f"retry-{i}" for i in range(4)]
    retries = metric_samples(scrape_metrics(router.metrics_port), "splitstream_router_retries_total")
    assert sum(value for labels, value in retries if labels["model"] == MODEL) >= 1


# -- metrics -----------------------------------------------------------------------------------------


def stream_metric(port: int, name: str, **labels: str) -> float:
    samples = metric_samples(scrape_metrics(port), name)
    return sum(value for found, value in samples if all(found.get(k) == v for k, v in labels.items()))


def test_stream_metrics_count_time_to_first_token_gaps_responses_and_outcomes(deployment: Deployment) -> None:
    port = deployment.router.metrics_port
    pin = [("x-splitstream-version", "v2")]
    names = {
        "ok": ("splitstream_router_streams_total", {"status": "OK"}),
        "not_found": ("splitstream_router_streams_total", {"status": "NOT_FOUND"}),
        "ttft": ("splitstream_router_stream_ttft_seconds_count", {}),
        "gaps": ("splitstream_router_stream_gap_seconds_count", {}),
        "responses": ("splitstream_router_stream_responses_sum", {}),
        "streams": ("splitstream_router_stream_seconds_count", {}),
    }

    def read() -> dict[str, float]:
        return {k: stream_metric(port, name, model=MODEL, **labels) for k, (name, labels) in names.items()}

    before = read()
    run_stream(deployment.router.address, [stream_request("m1", 4, model=MODEL)], metadata=pin)
    run_stream(deployment.router.address, [stream_request("m2", 6, model=MODEL)], metadata=pin)
    run_stream(deployment.router.address, [stream_request("m3", 1, model=MODEL)], metadata=pin)
    refused = run_stream(
        deployment.router.address, [stream_request("m4", 1, model=MODEL)], metadata=[("x-splitstream-version", "v7")]
    )
    assert refused.code == grpc.StatusCode.NOT_FOUND
    after = read()
    delta = {k: after[k] - before[k] for k in names}
    assert delta == {"ok": 3, "not_found": 1, "ttft": 3, "gaps": 3 + 5 + 0, "responses": 11, "streams": 3}
    assert stream_metric(port, "splitstream_router_streams_active", model=MODEL) == 0


# -- NVIDIA's client ---------------------------------------------------------------------------------


def test_nvidia_tritonclient_streams_through_the_router(deployment: Deployment, tmp_path: Path) -> None:
    """tritonclient's own streaming API, unchanged, in its own interpreter (its protobuf symbols clash
    with ours)."""
    triton_python = os.environ.get("SPLITSTREAM_TRITON_PYTHON")
    assert triton_python, "run through `make test`, which provides tritonclient in its own venv"
    script = f"""
import json, queue, numpy as np, tritonclient.grpc as tc
client = tc.InferenceServerClient("{deployment.router.address}")
results = queue.Queue()
client.start_stream(callback=lambda result, error: results.put((result, error)),
                    headers={{"x-routing-key": "triton-user"}})
tokens = tc.InferInput("max_tokens", [1, 1], "INT32"); tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
client.async_stream_infer("{MODEL}", [tokens], request_id="tc-1")
client.async_stream_infer("{MODEL}", [tokens], request_id="tc-2", enable_empty_final_response=True)
seen = []
while sum(1 for s in seen if s[2]) < 2:
    result, error = results.get(timeout=20)
    assert error is None, error
    response = result.get_response()
    final = response.parameters["triton_final_response"].bool_param
    text = result.as_numpy("text_output")
    seen.append((response.id, None if text is None else text[0].decode(), final))
client.stop_stream()
print(json.dumps(seen))
"""
    done = launcher.run([triton_python, "-c", script], check=True, timeout=60, capture_output=True, text=True)
    import json

    seen = json.loads(done.stdout.strip().splitlines()[-1])
    first = [s for s in seen if s[0] == "tc-1"]
    second = [s for s in seen if s[0] == "tc-2"]
    assert [s[2] for s in first] == [False, False, False, True]
    assert [s[2] for s in second] == [False] * 4 + [True]
    assert second[-1][1] is None  # the empty final response has no text_output
    assert all(s[1].endswith(f":tc-1:{n}") for n, s in enumerate(first))


# -- shutdown ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_draining_router_finishes_streams_in_flight_and_refuses_new_ones(stack: Stack, tmp_path: Path) -> None:
    slow_stack(stack, tmp_path)
    router = stack.router(tmp_path / "registry.yaml", "--drain-delay-s", "0", "--shutdown-grace-s", "20")
    stream = OpenStream(router.address)
    try:
        stream.send(stream_request("drain", 30, model=MODEL))
        stream.close_sending()
        stream.next()
        router.signal(signal.SIGTERM)
        # A probe sent before the router has handled the signal is a stream in flight like the first; one sent
        # after is refused. Each probe has a 2 s deadline so that an early one cannot use up the wait: in a
        # full run on a loaded machine one probe waited out its whole 20 s default (not reproduced alone;
        # whether a stream accepted just as the router handles SIGTERM can hang is still open).
        wait_for(
            lambda: (
                run_stream(router.address, [stream_request("late", 1, model=MODEL)], timeout_s=2).code
                == grpc.StatusCode.UNAVAILABLE
            ),
            timeout_s=30,
            what="new streams to be refused",
        )
        code, details = stream.finish(timeout_s=30)
        assert code == grpc.StatusCode.OK, details
        assert router.wait() == 0
    finally:
        stream.close()
    assert 1 + len(stream.remaining()) == 30  # every token, though the router was told to stop after the first


# -- flags -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "named"),
    [("0", "must be positive"), ("40000000", "at most half of --record-batch-max-bytes (67108864)")],
)
def test_a_stream_record_cap_that_cannot_work_is_refused_with_exit_2_naming_the_flag(
    tmp_path: Path, value: str, named: str
) -> None:
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": ["127.0.0.1:1"]}}})
    result = launcher.run(
        [
            sys.executable, "-m", "splitstream.router", "--registry", f"file:{registry}", "--port", "0",
            "--metrics-port", "0", "--recorder", "127.0.0.1:1", "--hmac-key", "k",
            "--record-stream-max-bytes", value,
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")},
        cwd=ROOT, capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("splitstream-router: error: --record-stream-max-bytes")
    assert named in line
