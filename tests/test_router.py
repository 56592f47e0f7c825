"""The router end to end: real worker and router processes, real gRPC, a real registry file."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnxruntime
import pytest

from splitstream.common import tensors
from splitstream.common.headers import header_value
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from splitstream.common.proto.splitstream.v1 import router_pb2
from tests import launcher
from tests.harness import (
    DRAIN_DELAY,
    InferClient,
    Stack,
    SteadyLoad,
    free_port,
    make_request,
    metric_samples,
    router_status,
    scrape_metrics,
    wait_for,
    write_registry,
)
from tests.models import add_version

MODEL = "affine"
SCALES = {"v1": 2.0, "v2": 3.0}


def experiment(v1: float, v2: float) -> dict[str, object]:
    return {
        "salt": "router-tests",
        "control": "v1",
        "arms": [{"version": "v1", "weight": v1}, {"version": "v2", "weight": v2}],
    }


def expected(x: np.ndarray, version: str) -> np.ndarray:
    return x * np.float32(SCALES[version])


class Deployment:
    """Workers v1 (two endpoints) and v2 (one) behind one router, shared by the read-only tests."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.repository = tmp / "models"
        for version, scale in SCALES.items():
            add_version(self.repository, MODEL, version, scale=scale)
        self.stack = Stack(tmp)
        self.v1 = [self.stack.worker(self.repository, MODEL, "v1") for _ in range(2)]
        self.v2 = [self.stack.worker(self.repository, MODEL, "v2")]
        self.registry = tmp / "registry.yaml"
        self.write(v1=90, v2=10)
        self.router = self.stack.router(self.registry)
        self.client = InferClient(self.router.address)

    def write(self, *, v1: float, v2: float) -> None:
        write_registry(
            self.registry,
            {
                MODEL: {
                    "endpoints": {"v1": [w.address for w in self.v1], "v2": [w.address for w in self.v2]},
                    "experiment": experiment(v1, v2),
                }
            },
        )

    def close(self) -> None:
        self.client.close()
        self.stack.close()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp("router"))
    yield deployment
    deployment.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    yield stack
    stack.close()


def served_version(client: InferClient, key: str | None = None, version: str = "") -> str:
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    metadata = [("x-routing-key", key)] if key is not None else []
    response, headers = client.infer(make_request(MODEL, x, version=version), metadata=metadata)
    version = headers["x-splitstream-version"]
    assert response.model_version == version
    np.testing.assert_array_equal(tensors.output_arrays(response)["y"], expected(x, version))
    return version


# -- outputs ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_outputs_through_the_router_equal_onnxruntime_with_raw_and_typed_contents(deployment: Deployment) -> None:
    session = onnxruntime.InferenceSession(str(deployment.repository / MODEL / "v1" / "model.onnx"))
    rng = np.random.default_rng(7)
    for typed in (False, True):
        x = rng.standard_normal((3, 4)).astype(np.float32)
        request = make_request(MODEL, x, version="v1", typed=typed, request_id="abc")
        response, _ = deployment.client.infer(request)
        outputs = tensors.output_arrays(response)
        y, label = session.run(["y", "label"], {"x": x})
        np.testing.assert_array_equal(outputs["y"], y)
        np.testing.assert_array_equal(outputs["label"], label)
        assert response.id == "abc"


def test_nvidia_tritonclient_gets_the_same_outputs_as_onnxruntime(deployment: Deployment, tmp_path: Path) -> None:
    """tritonclient runs in its own interpreter: it registers the same protobuf symbols as our stubs."""
    triton_python = os.environ.get("SPLITSTREAM_TRITON_PYTHON")
    assert triton_python, "run through `make test`, which provides tritonclient in its own venv"
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = f"""
import numpy as np, tritonclient.grpc as tc
client = tc.InferenceServerClient("{deployment.router.address}")
assert client.is_server_live() and client.is_server_ready()
assert client.is_model_ready("{MODEL}")
meta = client.get_model_metadata("{MODEL}")
assert [i.name for i in meta.inputs] == ["x"], meta
x = np.load("{tmp_path / "x.npy"}")
inp = tc.InferInput("x", list(x.shape), "FP32"); inp.set_data_from_numpy(x)
result = client.infer("{MODEL}", [inp], model_version="v1", request_id="triton-1",
                      outputs=[tc.InferRequestedOutput("y"), tc.InferRequestedOutput("label")])
assert result.get_response().id == "triton-1"
np.save("{tmp_path / "y.npy"}", result.as_numpy("y")); np.save("{tmp_path / "label.npy"}", result.as_numpy("label"))
"""
    launcher.run([triton_python, "-c", script], check=True, timeout=60)
    session = onnxruntime.InferenceSession(str(deployment.repository / MODEL / "v1" / "model.onnx"))
    y, label = session.run(["y", "label"], {"x": x})
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), y)
    np.testing.assert_array_equal(np.load(tmp_path / "label.npy"), label)


# -- routing ----------------------------------------------------------------------------------


def test_the_served_version_is_reported_and_matches_the_outputs(deployment: Deployment) -> None:
    versions = {served_version(deployment.client, key=f"k{i}") for i in range(60)}
    assert versions <= {"v1", "v2"}


def test_pinning_by_header_or_model_version_bypasses_the_split(deployment: Deployment) -> None:
    x = np.ones((1, 4), dtype=np.float32)
    for _ in range(5):
        _, headers = deployment.client.infer(make_request(MODEL, x), metadata=[("x-splitstream-version", "v2")])
        assert headers["x-splitstream-version"] == "v2"
        assert served_version(deployment.client, version="v2") == "v2"


def test_pinning_an_unknown_version_is_not_found_and_names_it(deployment: Deployment) -> None:
    x = np.ones((1, 4), dtype=np.float32)
    with pytest.raises(grpc.RpcError) as caught:
        deployment.client.infer(make_request(MODEL, x), metadata=[("x-splitstream-version", "v9")])
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "v9" in caught.value.details()


@pytest.mark.slow
def test_one_key_gets_the_same_version_from_two_separate_routers(deployment: Deployment) -> None:
    second = deployment.stack.router(deployment.registry, name="second-router")
    other = InferClient(second.address)
    try:
        keys = [f"user-{i}" for i in range(150)]
        first_answers = [served_version(deployment.client, key=k) for k in keys]
        assert [served_version(other, key=k) for k in keys] == first_answers
        assert [served_version(deployment.client, key=k) for k in keys] == first_answers
        assert set(first_answers) == {"v1", "v2"}
    finally:
        other.close()
        second.stop()


@pytest.mark.slow
def test_calls_without_a_key_split_by_weight(stack: Stack, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    for version, scale in SCALES.items():
        add_version(repository, MODEL, version, scale=scale)
    workers = {v: stack.worker(repository, MODEL, v) for v in SCALES}
    registry = tmp_path / "registry.yaml"
    write_registry(
        registry, {MODEL: {"endpoints": {v: [w.address] for v, w in workers.items()}, "experiment": experiment(70, 30)}}
    )
    router = stack.router(registry)
    client = InferClient(router.address)
    versions = [served_version(client) for _ in range(1000)]
    client.close()
    # 1000 draws at p=0.3: the standard deviation is 0.0145, so ±0.06 is about 4 sigma.
    assert abs(versions.count("v2") / len(versions) - 0.30) < 0.06


def test_editing_the_registry_changes_the_split_within_two_seconds_without_a_failed_call(
    deployment: Deployment,
) -> None:
    try:
        with SteadyLoad(deployment.router.address, MODEL, threads=3, key_prefix="edit") as load:
            load.wait_calls(30)
            deployment.write(v1=0, v2=100)
            edited = time.monotonic()

            def only_v2_after(t: float) -> bool:
                recent = [o for o in load.outcomes if o[0] > t]
                return len(recent) >= 20 and all(o[2] == "v2" for o in recent[-20:])

            wait_for(lambda: only_v2_after(edited), timeout_s=5, what="the split to follow the edit")
            switched = min(o[0] for o in load.outcomes if o[0] > edited and o[2] == "v2")
            # Every call sent later than 2 s after the edit went to v2.
            late = [o for o in load.outcomes if o[0] > edited + 2.0]
            load.wait_calls(10)
        assert switched - edited < 2.0
        assert all(o[2] == "v2" for o in late)
        assert load.errors() == []
    finally:
        deployment.write(v1=90, v2=10)
        wait_for(
            lambda: router_status(deployment.router).models[0].experiment.arms[0].weight == 90,
            timeout_s=5,
            what="the registry to be restored",
        )


@pytest.mark.slow
def test_a_version_without_a_healthy_endpoint_spills_to_the_control(stack: Stack, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=SCALES["v1"])
    v1 = stack.worker(repository, MODEL, "v1")
    registry = tmp_path / "registry.yaml"
    dead = f"127.0.0.1:{free_port()}"
    write_registry(
        registry, {MODEL: {"endpoints": {"v1": [v1.address], "v2": [dead]}, "experiment": experiment(0, 100)}}
    )
    router = stack.router(registry)
    client = InferClient(router.address)
    assert [served_version(client, key=f"k{i}") for i in range(30)] == ["v1"] * 30
    client.close()
    fallbacks = metric_samples(scrape_metrics(router.metrics_port), "splitstream_router_fallbacks_total")
    assert any(labels == {"model": MODEL, "arm": "v2", "version": "v1"} and value > 0 for labels, value in fallbacks)


@pytest.mark.slow
def test_an_arm_without_endpoints_is_shown_spilling_in_status_and_metrics_until_it_gets_one(
    stack: Stack, tmp_path: Path
) -> None:
    repository = tmp_path / "models"
    for version, scale in SCALES.items():
        add_version(repository, MODEL, version, scale=scale)
    v1 = stack.worker(repository, MODEL, "v1")
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [v1.address]}, "experiment": experiment(50, 50)}})
    router = stack.router(registry)

    def spilling() -> tuple[dict[str, bool], dict[str, float]]:
        arms = {arm.version: arm.spilling for arm in router_status(router, MODEL).models[0].experiment.arms}
        samples = metric_samples(scrape_metrics(router.metrics_port), "splitstream_router_arm_spilling")
        return arms, {labels["version"]: value for labels, value in samples if labels["model"] == MODEL}

    wait_for(lambda: spilling() == ({"v1": False, "v2": True}, {"v1": 0.0, "v2": 1.0}), timeout_s=5, what="v2 spilling")
    v2 = stack.worker(repository, MODEL, "v2")
    write_registry(
        registry,
        {MODEL: {"endpoints": {"v1": [v1.address], "v2": [v2.address]}, "experiment": experiment(50, 50)}},
    )
    wait_for(lambda: spilling() == ({"v1": False, "v2": False}, {"v1": 0.0, "v2": 0.0}), timeout_s=5, what="v2 serving")
    # An arm taken out of the experiment leaves the metric (with --processes it reads 0: test_processes).
    v1_only = {"salt": "router-tests", "control": "v1", "arms": [{"version": "v1", "weight": 100}]}
    write_registry(registry, {MODEL: {"endpoints": {"v1": [v1.address]}, "experiment": v1_only}})
    wait_for(lambda: spilling() == ({"v1": False}, {"v1": 0.0}), timeout_s=5, what="v2 gone from the metric")


# -- failures ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_killed_under_load_fails_only_calls_in_flight_then_none(stack: Stack, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=SCALES["v1"])
    workers = [stack.worker(repository, MODEL, "v1") for _ in range(2)]
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [w.address for w in workers]}}})
    router = stack.router(registry)
    threads = 4
    with SteadyLoad(router.address, MODEL, threads=threads) as load:
        load.wait_calls(100)
        workers[0].kill()
        killed = time.monotonic()
        load.wait_calls(300)
    errors = load.errors()
    # At most the calls in flight on the killed worker (one per load thread) may fail...
    assert len(errors) <= threads
    # ...and only at the moment of the kill; afterwards every call succeeds.
    assert all(sent <= killed + 0.5 for sent, _, _, _ in errors)
    assert load.count() > 400


@pytest.mark.slow
def test_a_worker_given_sigterm_under_load_drains_with_zero_failed_calls(stack: Stack, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=SCALES["v1"])
    workers = [stack.worker(repository, MODEL, "v1", *DRAIN_DELAY) for _ in range(2)]
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [w.address for w in workers]}}})
    router = stack.router(registry)
    with SteadyLoad(router.address, MODEL, threads=4) as load:
        load.wait_calls(100)
        workers[0].signal(signal.SIGTERM)
        assert workers[0].wait(timeout_s=30) == 0
        load.wait_calls(200)
    assert load.errors() == []


@pytest.mark.slow
def test_the_router_drains_calls_in_flight_on_sigterm_and_exits_zero(stack: Stack, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    # A long batching delay keeps each call in flight for ~300 ms.
    add_version(repository, MODEL, "v1", scale=2.0, config={"dynamic_batching": {"max_queue_delay_us": 300_000}})
    worker = stack.worker(repository, MODEL, "v1")
    registry = tmp_path / "registry.yaml"
    write_registry(registry, {MODEL: {"endpoints": {"v1": [worker.address]}}})
    router = stack.router(registry)
    channel = grpc.insecure_channel(router.address)
    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
    futures = [stub.ModelInfer.future(make_request(MODEL, np.ones((1, 4), np.float32)), timeout=10) for _ in range(4)]
    port = router.metrics_port
    in_flight = lambda: metric_samples(scrape_metrics(port), "splitstream_router_in_flight")[0][1]  # noqa: E731
    wait_for(lambda: in_flight() == 4, timeout_s=5, what="the four calls to be in flight at the router")
    router.signal(signal.SIGTERM)
    assert all(f.result().model_version == "v1" for f in futures)
    assert router.wait(timeout_s=30) == 0
    channel.close()


async def test_the_time_left_on_a_call_travels_to_the_worker(stack: Stack, tmp_path: Path) -> None:
    """The router core is driven in-process, so no client-side deadline can end the call: only the
    deadline the router forwards can (without it the worker answers after its 5 s batching delay).
    Through a real client the client's own deadline would fire at the same moment and hide a router
    that dropped it."""
    from splitstream.common.registry import parse_registry
    from splitstream.router.core import EndpointSettings, RouterCore
    from splitstream.router.metrics import RouterMetrics

    repository = tmp_path / "models"
    add_version(repository, MODEL, "v1", scale=2.0, config={"dynamic_batching": {"max_queue_delay_us": 5_000_000}})
    worker = stack.worker(repository, MODEL, "v1")
    settings = EndpointSettings(channel_options=(), eject_after_failures=3, eject_duration_s=5, drain_timeout_s=1)
    core = RouterCore(settings=settings, metrics=RouterMetrics())
    core.apply(parse_registry({"models": {MODEL: {"endpoints": {"v1": [worker.address]}}}}))
    request = make_request(MODEL, np.ones((1, 4), np.float32)).SerializeToString()
    try:
        started = time.monotonic()
        outcome = await core.infer(request, {}, timeout_s=0.2)
        elapsed = time.monotonic() - started
    finally:
        await core.close()
    assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < 2.5  # half the worker's hold: the deadline ended the call, not the worker's answer


# -- bad input --------------------------------------------------------------------------------


def bad_requests() -> dict[str, tuple[oip.ModelInferRequest, grpc.StatusCode, str]]:
    x = np.ones((1, 4), dtype=np.float32)
    wrong_dtype = make_request(MODEL, x.astype(np.float64))
    wrong_shape = make_request(MODEL, np.ones((1, 5), dtype=np.float32))
    short_raw = make_request(MODEL, x)
    short_raw.raw_input_contents[0] = short_raw.raw_input_contents[0][:-4]
    unknown_input = make_request(MODEL, x)
    unknown_input.inputs[0].name = "nope"
    missing_input = oip.ModelInferRequest(model_name=MODEL)
    too_big = make_request(MODEL, np.ones((9, 4), dtype=np.float32))
    unknown_model = make_request("no-such-model", x)
    return {
        "wrong datatype": (wrong_dtype, grpc.StatusCode.INVALID_ARGUMENT, "FP64"),
        "wrong shape": (wrong_shape, grpc.StatusCode.INVALID_ARGUMENT, "'x'"),
        "raw length": (short_raw, grpc.StatusCode.INVALID_ARGUMENT, "12 bytes"),
        "unknown input": (unknown_input, grpc.StatusCode.INVALID_ARGUMENT, "'nope'"),
        "missing input": (missing_input, grpc.StatusCode.INVALID_ARGUMENT, "'x'"),
        "batch too large": (too_big, grpc.StatusCode.INVALID_ARGUMENT, "max_batch_size"),
        "unknown model": (unknown_model, grpc.StatusCode.NOT_FOUND, "no-such-model"),
    }


@pytest.mark.parametrize("case", list(bad_requests()))
def test_bad_input_gets_the_right_status_and_a_message_naming_the_problem(deployment: Deployment, case: str) -> None:
    request, code, fragment = bad_requests()[case]
    with pytest.raises(grpc.RpcError) as caught:
        deployment.client.infer(
            request, metadata=[("x-splitstream-version", "v1")] if code != grpc.StatusCode.NOT_FOUND else []
        )
    assert caught.value.code() == code, caught.value.details()
    assert fragment in caught.value.details()
    assert served_version(deployment.client, key="still-serving") in {"v1", "v2"}


CORRUPT_TAG = b"\xff\xff\xff"
#: Field 1 (a string in each message below but ServerLiveRequest) holding bytes that are not UTF-8.
BAD_UTF8 = b"\x0a\x02\xc3\x28"


@pytest.mark.parametrize(
    ("method", "message", "garbage"),
    [
        ("/inference.GRPCInferenceService/ModelMetadata", "inference.ModelMetadataRequest", CORRUPT_TAG),
        ("/inference.GRPCInferenceService/ModelMetadata", "inference.ModelMetadataRequest", BAD_UTF8),
        ("/inference.GRPCInferenceService/ModelReady", "inference.ModelReadyRequest", BAD_UTF8),
        ("/inference.GRPCInferenceService/ServerLive", "inference.ServerLiveRequest", CORRUPT_TAG),
        ("/splitstream.v1.Router/Status", "splitstream.v1.StatusRequest", BAD_UTF8),
    ],
)
def test_bytes_that_do_not_parse_get_invalid_argument_naming_the_message_from_every_method(
    deployment: Deployment, method: str, message: str, garbage: bytes
) -> None:
    """grpc's own deserializer answered UNKNOWN with "Unexpected <class DecodeError>" (found by the fuzz test)."""
    with grpc.insecure_channel(deployment.router.address) as channel, pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary(method)(garbage, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert message in caught.value.details()


ODD_REQUEST_IDS = ["ünïcode", "a\x01b", "tab\there", "50%"]


@pytest.mark.parametrize("request_id", ODD_REQUEST_IDS)
def test_a_request_id_that_is_not_printable_ascii_is_answered_promptly_with_it_percent_encoded(
    deployment: Deployment, request_id: str
) -> None:
    """Before the fix the router's forward to the worker carried the raw id, gRPC refused it, and the
    call hung until the client's deadline: the short deadline turns that into DEADLINE_EXCEEDED."""
    x = np.ones((1, 4), dtype=np.float32)
    response, headers = deployment.client.infer(make_request(MODEL, x, request_id=request_id), timeout_s=3)
    assert response.id == request_id
    assert headers["x-request-id"] == header_value(request_id)
    assert headers["x-splitstream-version"] in {"v1", "v2"}


@pytest.mark.parametrize("request_id", ODD_REQUEST_IDS)
def test_a_call_refused_at_routing_answers_its_status_with_the_request_id_percent_encoded(
    deployment: Deployment, request_id: str
) -> None:
    x = np.ones((1, 4), dtype=np.float32)
    with grpc.insecure_channel(deployment.router.address) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(
                make_request(MODEL, x, request_id=request_id),
                metadata=[("x-splitstream-version", "v9")],
                timeout=3,
            )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
    assert dict(caught.value.trailing_metadata())["x-request-id"] == header_value(request_id)


def test_a_percent_encoded_request_id_header_comes_back_unchanged(deployment: Deployment) -> None:
    x = np.ones((1, 4), dtype=np.float32)
    encoded = header_value("ünïcode")
    _, headers = deployment.client.infer(make_request(MODEL, x), metadata=[("x-request-id", encoded)], timeout_s=3)
    assert headers["x-request-id"] == encoded


@pytest.mark.parametrize("sent", ["a%41", "100%", "req%2F1", "50%ok"])
def test_an_ascii_request_id_header_holding_a_percent_sign_is_kept_as_sent(deployment: Deployment, sent: str) -> None:
    """Only what header_value() makes is decoded: a client's own ``%`` (a URL-encoded id, say) means itself."""
    x = np.ones((1, 4), dtype=np.float32)
    _, headers = deployment.client.infer(make_request(MODEL, x), metadata=[("x-request-id", sent)], timeout_s=3)
    assert headers["x-request-id"] == sent


def test_random_bytes_sent_to_model_infer_are_rejected_and_the_router_keeps_serving(deployment: Deployment) -> None:
    rng = np.random.default_rng(11)
    with grpc.insecure_channel(deployment.router.address) as channel:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for _ in range(5):
            with pytest.raises(grpc.RpcError) as caught:
                raw(rng.bytes(64), timeout=5)
            assert caught.value.code() in {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
    assert served_version(deployment.client, key="after-garbage") in {"v1", "v2"}


def test_calls_grpc_refuses_before_the_router_sees_them_are_counted_as_received_only(
    deployment: Deployment,
) -> None:
    """A message over the size limit is refused by gRPC itself (RESOURCE_EXHAUSTED): the router's
    handler never runs, so only the calls-received counter can show it."""
    router = deployment.stack.router(deployment.registry, "--max-message-bytes", "4096", name="small-messages")
    client = InferClient(router.address)

    def counts() -> tuple[float, float]:
        text = scrape_metrics(router.metrics_port)
        received = sum(value for _, value in metric_samples(text, "splitstream_router_calls_received_total"))
        answered = sum(value for _, value in metric_samples(text, "splitstream_router_requests_total"))
        return received, answered

    try:
        served_version(client, key="small")
        with pytest.raises(grpc.RpcError) as caught:
            client.infer(make_request(MODEL, np.ones((4, 400), dtype=np.float32)), timeout_s=5)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_for(lambda: counts() == (2.0, 1.0), timeout_s=5, what="one call received and answered, one refused")
    finally:
        client.close()
        router.stop()


# -- introspection ----------------------------------------------------------------------------


def test_status_reports_the_experiment_and_endpoints_in_use(deployment: Deployment) -> None:
    status = router_status(deployment.router, MODEL)
    assert status.registry == f"file:{deployment.registry}"
    (model,) = status.models
    arms = {(a.version, a.weight, a.bucket_start, a.bucket_end) for a in model.experiment.arms}
    assert arms == {("v1", 90, 0, 9000), ("v2", 10, 9000, 10000)}
    endpoints = {p.version: sorted(e.address for e in p.endpoints) for p in model.versions}
    assert endpoints == {"v1": sorted(w.address for w in deployment.v1), "v2": [deployment.v2[0].address]}
    wait_for(
        lambda: all(
            e.health == router_pb2.EndpointStatus.SERVING
            for p in router_status(deployment.router, MODEL).models[0].versions
            for e in p.endpoints
        ),
        timeout_s=5,
        what="every endpoint to be reported SERVING",
    )


def test_metrics_count_calls_per_model_version_and_status(deployment: Deployment) -> None:
    for i in range(20):
        served_version(deployment.client, key=f"metrics-{i}")
    samples = metric_samples(scrape_metrics(deployment.router.metrics_port), "splitstream_router_requests_total")
    ok = {
        labels["version"]: value for labels, value in samples if labels["model"] == MODEL and labels["status"] == "OK"
    }
    assert ok.get("v1", 0) + ok.get("v2", 0) >= 20


def test_model_metadata_and_readiness_answer_for_the_model(deployment: Deployment) -> None:
    with grpc.insecure_channel(deployment.router.address) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = stub.ModelMetadata(oip.ModelMetadataRequest(name=MODEL), timeout=5)
        assert list(metadata.versions) == ["v1", "v2"]
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("x", "FP32", [-1, 4])]
        assert stub.ModelReady(oip.ModelReadyRequest(name=MODEL), timeout=5).ready
        assert not stub.ModelReady(oip.ModelReadyRequest(name="nope"), timeout=5).ready
        assert stub.ServerReady(oip.ServerReadyRequest(), timeout=5).ready


def test_a_missing_registry_file_exits_2_with_one_line(tmp_path: Path) -> None:
    result = launcher.run(
        [
            sys.executable,
            "-m",
            "splitstream.router",
            "--registry",
            f"file:{tmp_path / 'absent.yaml'}",
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "absent.yaml" in result.stderr


@pytest.mark.slow
def test_the_healthcheck_command_exits_0_for_a_serving_router_and_1_for_a_closed_port(
    deployment: Deployment,
) -> None:
    def check(address: str) -> int:
        command = [sys.executable, "-m", "splitstream.common.healthcheck", address]
        return launcher.run(command, capture_output=True, timeout=30).returncode

    assert check(deployment.router.address) == 0
    assert check(f"127.0.0.1:{free_port()}") == 1
