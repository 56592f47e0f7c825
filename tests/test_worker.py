"""The worker end to end: real processes, real gRPC, the generated stubs as the client.

Most tests share one worker (module scope) serving ``affine`` v1
(``y = 2x + 0.5``, ``label = argmax(y)``) with dynamic batching; tests that
need their own life cycle (warm-up failure, SIGTERM) start their own.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper, numpy_helper

import splitstream
from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from splitstream.common.tensors import output_arrays
from tests import launcher
from tests.harness import (
    ROOT,
    ServiceProcess,
    free_port,
    metric_samples,
    running_stack,
    scrape_metrics,
    wait_for,
)
from tests.models import add_version, save_graph
from tests.tensors import add_raw_input, add_typed_input

MODEL = "affine"
VERSION = "v1"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

Reference = Callable[[np.ndarray], dict[str, np.ndarray]]


# --- fixtures -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("models")
    # A 5 ms queue delay lets the concurrent requests of the batching test meet in one batch.
    add_version(repo, MODEL, VERSION, scale=2.0, bias=0.5, config={"dynamic_batching": {"max_queue_delay_us": 5000}})
    return repo


@pytest.fixture(scope="module")
def worker(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with running_stack(tmp_path_factory.mktemp("logs")) as stack:
        metrics_port = free_port()
        process = stack.worker(repository, MODEL, VERSION, "--metrics-port", str(metrics_port))
        yield process


@pytest.fixture(scope="module")
def reference(repository: Path) -> Reference:
    """The same model.onnx run by ONNX Runtime directly: what every answer must equal."""
    session = ort.InferenceSession(str(repository / MODEL / VERSION / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]

    def run(x: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, {"x": x}), strict=True))

    return run


@pytest.fixture
async def stub(worker: ServiceProcess) -> AsyncIterator[grpc_service_pb2_grpc.GRPCInferenceServiceStub]:
    async with grpc.aio.insecure_channel(worker.address) as channel:
        yield grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)


# --- helpers ------------------------------------------------------------------------------------------------------


def features(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 4)).astype(np.float32)


def infer_request(x: np.ndarray, *, outputs: tuple[str, ...] = (), **fields: Any) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=MODEL, **fields)
    add_raw_input(request, "x", x)
    for name in outputs:
        request.outputs.add(name=name)
    return request


def assert_matches(response: oip.ModelInferResponse, expected: dict[str, np.ndarray]) -> None:
    actual = output_arrays(response)
    assert list(actual) == list(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(actual[name], array, err_msg=f"output '{name}'")


def metric(port: int, name: str, **labels: str) -> float:
    """Sum of one metric's samples whose labels include ``labels`` (0 when there are none yet)."""
    samples = metric_samples(scrape_metrics(port), name)
    return sum(value for sample_labels, value in samples if labels.items() <= sample_labels.items())


async def assert_still_serves(stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, reference: Reference) -> None:
    x = features(2, seed=99)
    assert_matches(await stub.ModelInfer(infer_request(x), timeout=10), reference(x))


# --- inference ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_input", [add_raw_input, add_typed_input], ids=["raw", "typed"])
async def test_outputs_equal_onnxruntime_run_directly(
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, reference: Reference, add_input: Any
) -> None:
    x = features(3, seed=1)
    request = oip.ModelInferRequest(model_name=MODEL)
    add_input(request, "x", x)

    response = await stub.ModelInfer(request, timeout=10)

    assert_matches(response, reference(x))
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("y", "FP32", [3, 4]),
        ("label", "INT64", [3]),
    ]
    assert len(response.raw_output_contents) == 2, "outputs always travel as raw contents"
    assert not any(o.HasField("contents") for o in response.outputs)


async def test_only_the_requested_outputs_come_back_in_the_requested_order(
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, reference: Reference
) -> None:
    x = features(2, seed=2)
    expected = reference(x)

    only_label = await stub.ModelInfer(infer_request(x, outputs=("label",)), timeout=10)
    both_reversed = await stub.ModelInfer(infer_request(x, outputs=("label", "y")), timeout=10)

    assert_matches(only_label, {"label": expected["label"]})
    assert_matches(both_reversed, {"label": expected["label"], "y": expected["y"]})


async def test_response_echoes_the_request_id_and_names_the_served_version(
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    x = features(1, seed=3)

    unpinned = await stub.ModelInfer(infer_request(x, id="req-42"), timeout=10)
    pinned = await stub.ModelInfer(infer_request(x, model_version=VERSION), timeout=10)

    assert (unpinned.model_name, unpinned.model_version, unpinned.id) == (MODEL, VERSION, "req-42")
    assert (pinned.model_version, pinned.id) == (VERSION, "")


async def test_dynamic_batching_runs_concurrent_requests_together_and_answers_each_its_own(
    worker: ServiceProcess, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, reference: Reference
) -> None:
    port = worker.metrics_port
    runs_before = metric(port, "splitstream_worker_batch_size_count")
    rows_before = metric(port, "splitstream_worker_batch_size_sum")
    single_row_runs_before = metric(port, "splitstream_worker_batch_size_bucket", le="1.0")
    rng = random.Random(4)
    inputs = [features(rng.randint(1, 3), seed=100 + i) for i in range(32)]

    responses = await asyncio.gather(
        *(stub.ModelInfer(infer_request(x, id=str(i)), timeout=10) for i, x in enumerate(inputs))
    )

    for i, (x, response) in enumerate(zip(inputs, responses, strict=True)):
        assert response.id == str(i)
        assert_matches(response, reference(x))
    runs = metric(port, "splitstream_worker_batch_size_count") - runs_before
    rows = metric(port, "splitstream_worker_batch_size_sum") - rows_before
    multi_row_runs = runs - (metric(port, "splitstream_worker_batch_size_bucket", le="1.0") - single_row_runs_before)
    assert rows == sum(len(x) for x in inputs)
    assert runs < len(inputs), f"{len(inputs)} concurrent requests took {runs} backend runs: nothing was batched"
    assert multi_row_runs > 0
    assert metric(port, "splitstream_worker_queue_seconds_count") >= len(inputs)
    assert metric(port, "splitstream_worker_inference_seconds_count") >= runs


# --- metadata, liveness, readiness, health ------------------------------------------------------------------------


async def test_server_is_live_ready_and_names_itself(stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    live = await stub.ServerLive(oip.ServerLiveRequest(), timeout=5)
    ready = await stub.ServerReady(oip.ServerReadyRequest(), timeout=5)
    metadata = await stub.ServerMetadata(oip.ServerMetadataRequest(), timeout=5)

    assert live.live
    assert ready.ready
    assert (metadata.name, metadata.version, list(metadata.extensions)) == (
        "splitstream-worker",
        splitstream.__version__,
        [],
    )


async def test_model_metadata_describes_the_served_version_with_dynamic_dims_as_minus_one(
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    for version in ("", VERSION):
        metadata = await stub.ModelMetadata(oip.ModelMetadataRequest(name=MODEL, version=version), timeout=5)

        assert (metadata.name, list(metadata.versions), metadata.platform) == (MODEL, [VERSION], "onnxruntime_onnx")
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("x", "FP32", [-1, 4])]
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
            ("y", "FP32", [-1, 4]),
            ("label", "INT64", [-1]),
        ]


@pytest.mark.parametrize(
    ("name", "version", "ready"),
    [(MODEL, "", True), (MODEL, VERSION, True), (MODEL, "v2", False), ("other", "", False)],
)
async def test_model_is_ready_only_for_its_own_name_and_version(
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, name: str, version: str, ready: bool
) -> None:
    response = await stub.ModelReady(oip.ModelReadyRequest(name=name, version=version), timeout=5)

    assert response.ready is ready


@pytest.mark.parametrize(("name", "version", "named"), [("other", "", "'other'"), (MODEL, "v2", "'v2'")])
async def test_unknown_model_or_version_is_not_found_for_metadata_and_inference(
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, name: str, version: str, named: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as metadata_error:
        await stub.ModelMetadata(oip.ModelMetadataRequest(name=name, version=version), timeout=5)
    request = infer_request(features(1, seed=5), model_version=version)
    request.model_name = name
    with pytest.raises(grpc.aio.AioRpcError) as infer_error:
        await stub.ModelInfer(request, timeout=5)

    for error in (metadata_error.value, infer_error.value):
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert named in (error.details() or "")


async def test_health_is_serving_for_the_server_and_for_the_model(worker: ServiceProcess) -> None:
    async with grpc.aio.insecure_channel(worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", MODEL):
            response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="other"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


# --- bad requests -------------------------------------------------------------------------------------------------


def _wrong_datatype() -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=MODEL)
    add_raw_input(request, "x", np.zeros((2, 4), dtype=np.int32))
    return request


def _raw_length_mismatch() -> oip.ModelInferRequest:
    request = infer_request(features(2, seed=6))
    request.raw_input_contents[0] = request.raw_input_contents[0][:-4]
    return request


def _unknown_input() -> oip.ModelInferRequest:
    request = infer_request(features(1, seed=7))
    add_raw_input(request, "z", features(1, seed=8))
    return request


def _duplicate_input() -> oip.ModelInferRequest:
    request = infer_request(features(1, seed=9))
    add_raw_input(request, "x", features(1, seed=10))
    return request


def _extra_raw_contents() -> oip.ModelInferRequest:
    request = infer_request(features(1, seed=11))
    request.raw_input_contents.append(b"\0" * 16)
    return request


def _typed_count_mismatch() -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1.0, 2.0, 3.0])
    return request


def _typed_wrong_field() -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.int_contents.extend([1, 2, 3, 4])
    return request


BAD_REQUESTS: dict[str, tuple[Callable[[], oip.ModelInferRequest], tuple[str, ...]]] = {
    "wrong datatype": (_wrong_datatype, ("input 'x'", "expected FP32, got INT32")),
    "wrong shape": (lambda: infer_request(np.zeros((2, 5), np.float32)), ("input 'x'", "[-1, 4]", "[2, 5]")),
    "wrong rank": (lambda: infer_request(np.zeros(8, np.float32)), ("input 'x'", "[-1, 4]", "[8]")),
    "raw byte length mismatch": (_raw_length_mismatch, ("input 'x'", "28 bytes", "needs 32 bytes")),
    "unknown input": (_unknown_input, ("unknown input 'z'",)),
    "missing input": (lambda: oip.ModelInferRequest(model_name=MODEL), ("missing input 'x'",)),
    "duplicate input": (_duplicate_input, ("input 'x'", "more than once")),
    "batch too large": (
        lambda: infer_request(features(9, seed=12)),
        ("input 'x'", "batch of 9 exceeds max_batch_size 8"),
    ),
    "unknown requested output": (
        lambda: infer_request(features(1, seed=13), outputs=("probabilities",)),
        ("unknown requested output 'probabilities'",),
    ),
    "raw contents count mismatch": (_extra_raw_contents, ("2 raw_input_contents for 1 inputs",)),
    "typed contents count mismatch": (_typed_count_mismatch, ("input 'x'", "3 values", "needs 4")),
    "typed contents in the wrong field": (_typed_wrong_field, ("input 'x'", "fp32_contents", "int_contents")),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_bad_input_is_invalid_argument_naming_the_tensor_and_the_worker_keeps_serving(
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, reference: Reference, case: str
) -> None:
    build, fragments = BAD_REQUESTS[case]

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(build(), timeout=5)

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for fragment in fragments:
        assert fragment in (caught.value.details() or "")
    await assert_still_serves(stub, reference)


async def test_random_bytes_sent_to_model_infer_fail_and_the_worker_keeps_serving(
    worker: ServiceProcess, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, reference: Reference
) -> None:
    garbage = random.Random(14).randbytes(512)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        model_infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await model_infer(garbage, timeout=5)

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid inference.ModelInferRequest" in (caught.value.details() or "")
    await assert_still_serves(stub, reference)


CORRUPT_TAG = b"\xff\xff\xff"
#: Field 1 (a string in each message below but ServerLiveRequest) holding bytes that are not UTF-8.
BAD_UTF8 = b"\x0a\x02\xc3\x28"
#: Every method of the worker with its request message and bytes that do not parse as it.
GARBAGE_BY_METHOD = [
    ("ServerLive", "inference.ServerLiveRequest", CORRUPT_TAG),
    ("ServerReady", "inference.ServerReadyRequest", CORRUPT_TAG),
    ("ModelReady", "inference.ModelReadyRequest", BAD_UTF8),
    ("ServerMetadata", "inference.ServerMetadataRequest", CORRUPT_TAG),
    ("ModelMetadata", "inference.ModelMetadataRequest", BAD_UTF8),
    ("ModelMetadata", "inference.ModelMetadataRequest", CORRUPT_TAG),
    ("ModelInfer", "inference.ModelInferRequest", BAD_UTF8),
    ("ModelInfer", "inference.ModelInferRequest", CORRUPT_TAG),
]


@pytest.mark.parametrize(("method", "message", "garbage"), GARBAGE_BY_METHOD)
async def test_bytes_that_do_not_parse_get_invalid_argument_naming_the_message_from_every_method(
    worker: ServiceProcess, method: str, message: str, garbage: bytes
) -> None:
    """grpc's own deserializer answered UNKNOWN with "Unexpected <class DecodeError>"."""
    async with grpc.aio.insecure_channel(worker.address) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(garbage, timeout=5)

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert f"not a valid {message}" in (caught.value.details() or "")
    assert "Traceback" not in worker.log()


#: Percent-escapes that no id encoded by header_value can contain: bytes that are not UTF-8.
NOT_UTF8_ESCAPES = ["%80", "%c3", "%ff%zz"]


@pytest.mark.parametrize("header", NOT_UTF8_ESCAPES)
async def test_a_request_id_header_whose_escapes_are_not_utf8_is_served(
    worker: ServiceProcess, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, reference: Reference, header: str
) -> None:
    """Decoding the header for the log line raised UnicodeDecodeError outside the handler's error
    handling, and grpc answered UNKNOWN with the exception's name (found by the fuzz test)."""
    x = features(1, seed=17)
    response = await stub.ModelInfer(infer_request(x), metadata=[("x-request-id", header)], timeout=5)

    assert_matches(response, reference(x))
    assert "Traceback" not in worker.log()


async def test_requests_are_counted_by_status_code(
    worker: ServiceProcess, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    port = worker.metrics_port
    labels = {"model": MODEL, "version": VERSION}
    ok_before = metric(port, "splitstream_worker_requests_total", status="OK", **labels)
    invalid_before = metric(port, "splitstream_worker_requests_total", status="INVALID_ARGUMENT", **labels)

    await stub.ModelInfer(infer_request(features(1, seed=15)), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.ModelInfer(oip.ModelInferRequest(model_name=MODEL), timeout=5)

    assert metric(port, "splitstream_worker_requests_total", status="OK", **labels) == ok_before + 1
    assert metric(port, "splitstream_worker_requests_total", status="INVALID_ARGUMENT", **labels) == invalid_before + 1


# --- life cycle ---------------------------------------------------------------------------------------------------


def matmul_model(path: Path) -> None:
    """``y = x @ W`` with W 4x4, but x declared [batch, n]: any n other than 4 fails at run time."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    weights = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul", [x], [y], [weights])
    save_graph(graph, path, check=False)


def test_health_stays_not_serving_when_the_warm_up_inference_fails(tmp_path: Path) -> None:
    directory = tmp_path / "models" / "matmul" / "v1"
    matmul_model(directory / "model.onnx")
    config = {
        "backend": "onnxruntime",
        "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
    }
    (directory / "config.yaml").write_text(yaml.safe_dump(config))

    with running_stack(tmp_path) as stack:
        worker = stack.worker(tmp_path / "models", "matmul", "v1", start=False).start(wait_serving=False)
        wait_for(lambda: "warm-up inference failed" in worker.log(), timeout_s=30, what="the warm-up to fail")
        with grpc.insecure_channel(worker.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            inference = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            statuses = [
                health.Check(health_pb2.HealthCheckRequest(service=s), timeout=5).status for s in ("", "matmul")
            ]
            live = inference.ServerLive(oip.ServerLiveRequest(), timeout=5).live
            ready = inference.ServerReady(oip.ServerReadyRequest(), timeout=5).ready
            model_ready = inference.ModelReady(oip.ModelReadyRequest(name="matmul"), timeout=5).ready
            request = oip.ModelInferRequest(model_name="matmul")
            add_raw_input(request, "x", np.zeros((1, 3), np.float32))
            with pytest.raises(grpc.RpcError) as infer_error:
                inference.ModelInfer(request, timeout=5)

    assert statuses == [NOT_SERVING, NOT_SERVING]
    assert (live, ready, model_ready) == (True, False, False)
    assert infer_error.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
async def test_sigterm_under_load_drains_finishes_in_flight_calls_and_exits_0(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    # Requests wait 1.5 s for a batch, so they are still in flight when the drain delay ends and server.stop begins.
    add_version(
        repo, MODEL, VERSION, scale=2.0, bias=0.5, config={"dynamic_batching": {"max_queue_delay_us": 1_500_000}}
    )
    metrics_port = free_port()
    with running_stack(tmp_path) as stack:
        worker = stack.worker(repo, MODEL, VERSION, "--metrics-port", str(metrics_port), "--drain-delay-s", "1.0")
        async with grpc.aio.insecure_channel(worker.address) as channel:
            inference = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == SERVING
            inputs = [features(1, seed=200 + i) for i in range(5)]
            calls = [asyncio.ensure_future(inference.ModelInfer(infer_request(x), timeout=20)) for x in inputs]
            await _wait_async(
                lambda: metric(metrics_port, "splitstream_worker_queue_depth") == len(inputs), "queued calls"
            )

            worker.signal(signal.SIGTERM)
            assert (await watch.read()).status == NOT_SERVING
            ready = await inference.ServerReady(oip.ServerReadyRequest(), timeout=5)
            worker.signal(signal.SIGINT)  # a second signal must not cut the shutdown short
            assert await watch.read() is grpc.aio.EOF
            responses = await asyncio.gather(*calls)
            exit_code = await asyncio.to_thread(worker.wait, 20)

    assert not ready.ready
    assert exit_code == 0
    for x, response in zip(inputs, responses, strict=True):
        np.testing.assert_array_equal(output_arrays(response)["y"], x * 2.0 + 0.5)
    assert "signal ignored, already shutting down" in worker.log()


async def _wait_async(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll a blocking ``condition`` off the event loop (in-flight calls keep moving) until true."""
    await asyncio.to_thread(wait_for, condition, timeout_s=timeout_s, what=what)


# --- command line and config --------------------------------------------------------------------------------------


def run_worker_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return launcher.run(
        [sys.executable, "-m", "splitstream.worker", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"max_batch_size": -1}, "max_batch_size"),
        ({"max_batch": 8}, "max_batch: unknown field"),
        ({"dynamic_batching": {"max_queue_delay_us": "soon"}}, "dynamic_batching.max_queue_delay_us"),
        ({"execution_providers": ["gpu"]}, "execution_providers"),
        ({"inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 4]}]}, "inputs must name exactly"),
    ],
    ids=["negative max_batch_size", "unknown key", "delay not a number", "unknown provider", "input not in model"],
)
def test_bad_config_exits_2_with_a_line_naming_the_field(tmp_path: Path, config: dict[str, Any], named: str) -> None:
    add_version(tmp_path, MODEL, VERSION, scale=1.0, config=config)

    result = run_worker_cli(
        "--model-repository", str(tmp_path), "--model", MODEL, "--version", VERSION,
        "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
    )  # fmt: skip

    assert result.returncode == 2, result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("splitstream-worker: error: ")
    assert named in last_line


def test_bad_config_yaml_leaves_exactly_one_line_on_stderr(tmp_path: Path) -> None:
    add_version(tmp_path, MODEL, VERSION, scale=1.0, config={"instance_count": 0})

    result = run_worker_cli("--model-repository", str(tmp_path), "--model", MODEL, "--version", VERSION)

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"splitstream-worker: error: {tmp_path / MODEL / VERSION / 'config.yaml'}: "
        "instance_count: must be an integer >= 1, got 0"
    ]


def test_flags_can_come_from_the_environment(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SPLITSTREAM_WORKER_MODEL_REPOSITORY": str(tmp_path),
        "SPLITSTREAM_WORKER_MODEL": MODEL,
        "SPLITSTREAM_WORKER_VERSION": "v9",
    }

    result = run_worker_cli(env=env)

    assert result.returncode == 2
    assert f"--model-repository: no directory {tmp_path / MODEL / 'v9'}" in result.stderr


def test_a_bad_value_in_the_environment_exits_2_naming_the_variable() -> None:
    result = run_worker_cli(env={**os.environ, "SPLITSTREAM_WORKER_PORT": "nine"})

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "splitstream-worker: error: SPLITSTREAM_WORKER_PORT: invalid value 'nine' for --port"
    ]


def test_help_explains_every_flag_and_its_default() -> None:
    result = run_worker_cli("--help")

    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for flag in (
        "--model-repository", "--model", "--version", "--host", "--port", "--metrics-port", "--log-level",
        "--drain-delay-s", "--shutdown-grace-s", "SPLITSTREAM_WORKER_PORT", "SPLITSTREAM_WORKER_MODEL_REPOSITORY",
    ):  # fmt: skip
        assert flag in text
    for default in ("(default: 127.0.0.1)", "(default: 9000)", "(default: 0.5)", "(default: 30.0)"):
        assert default in text
