"""The TensorRT backend and engine builder in-process, on the fake GPU of ``tests/fakegpu``.

The fake runs "engines" with ONNX Runtime and treats host memory as device
memory, checking every copy and every address TensorRT would touch. So these
tests prove splitstream's own logic (profiles, buffer sizes, batch splitting,
context pool, error checks, teardown order), not real TensorRT's behaviour.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import structlog
import yaml
from onnx import TensorProto, helper
from prometheus_client import CollectorRegistry

from splitstream.common.errors import ConfigError, InvalidInput
from splitstream.worker.backends.tensorrt import TensorRTBackend
from splitstream.worker.config import ModelConfig
from splitstream.worker.engines.builder import BuildError, build_and_store
from splitstream.worker.engines.cache import EngineCache, EngineMismatch
from splitstream.worker.engines.cuda import CudaError
from splitstream.worker.engines.environment import load_environment
from splitstream.worker.metrics import WorkerMetrics
from splitstream.worker.model import ServedModel
from splitstream.worker.validation import InputHeader
from tests.fake_gpu import fake_gpu, needs_fake_cuda
from tests.models import affine_model

LOG = structlog.get_logger("test")


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ModuleType, ModuleType]]:
    with fake_gpu(monkeypatch) as modules:
        yield modules


def version_dir(tmp_path: Path, *, tensorrt: dict[str, Any] | None = None, max_batch_size: int = 8) -> Path:
    directory = tmp_path / "models" / "affine" / "v1"
    affine_model(directory / "model.onnx", scale=2.0, bias=0.5)
    settings: dict[str, Any] = {"backend": "tensorrt", "max_batch_size": max_batch_size}
    if tensorrt is not None:
        settings["tensorrt"] = tensorrt
    (directory / "config.yaml").write_text(yaml.safe_dump(settings))
    return directory


def config_of(directory: Path) -> ModelConfig:
    return ModelConfig.from_file(directory / "config.yaml")


def reference(directory: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    return dict(zip(["y", "label"], session.run(["y", "label"], {"x": x}), strict=True))


def backend(directory: Path) -> TensorRTBackend:
    return TensorRTBackend(directory, config_of(directory), logger=LOG)


def rows(count: int, seed: int = 0, features: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, features)).astype(np.float32)


# --- builder -----------------------------------------------------------------------------------------------------


@needs_fake_cuda("FAKE_GPU_NAME and FAKE_GPU_CC: the engine key and record name the fake L4")
def test_the_builder_stores_the_engine_under_its_key_and_reuses_it_and_the_timing_cache(
    tmp_path: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    directory = version_dir(tmp_path, tensorrt={"precision": "fp16", "workspace_bytes": 1 << 28})
    env = load_environment()

    first = build_and_store(env, directory, config_of(directory), model="affine", version="v1", log=LOG)
    again = build_and_store(env, directory, config_of(directory), model="affine", version="v1", log=LOG)
    forced = build_and_store(env, directory, config_of(directory), model="affine", version="v1", log=LOG, force=True)

    assert (first.built, again.built, forced.built) == (True, False, True)
    assert first.path == again.path == forced.path
    assert first.path.name.startswith("fp16-dyn-sm89-trt11.4.0.106-")
    assert first.record["tag"] == "affine-v1-fp16-dyn"
    assert first.record["built_with"]["gpu_name"] == "NVIDIA Fake L4"
    timing = EngineCache(directory / "engines").timing_cache_path(env.device)
    assert timing.read_bytes() == b'{"builds": 2}'  # read, used and saved by both builds
    plan = (first.path / "engine.plan").read_bytes()
    header = plan.split(b"\n")[1]
    assert b'"profiles": [{"x": [[1, 4], [8, 4], [8, 4]]}]' in header
    assert b'"strongly_typed": 0' in header  # TensorRT 11: no network flags at all
    # The plan holds the FP16 graph the precision step made, not model.onnx.
    model = onnx.load_from_string(plan.split(b"\n", 2)[2])
    assert {init.data_type for init in model.graph.initializer} == {TensorProto.FLOAT16}


@needs_fake_cuda("FAKE_GPU_CC: the engine key names sm 8.9")
def test_on_tensorrt_10_the_graph_types_bind_through_strongly_typed_and_builder_flags_stay_possible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_gpu(monkeypatch, FAKE_TENSORRT_VERSION="10.8.0.43"):
        env = load_environment()
        graph = version_dir(tmp_path / "graph", tensorrt={"precision": "fp16"})
        flags = version_dir(tmp_path / "flags", tensorrt={"precision": "fp16", "precision_mode": "builder_flags"})
        same_cc = version_dir(tmp_path / "cc", tensorrt={"hardware_compatibility": "same_cc"})

        by_graph = build_and_store(env, graph, config_of(graph), model="affine", version="v1", log=LOG)
        by_flags = build_and_store(env, flags, config_of(flags), model="affine", version="v1", log=LOG)
        with pytest.raises(ConfigError, match=r"has no HardwareCompatibilityLevel\.SAME_COMPUTE_CAPABILITY"):
            build_and_store(env, same_cc, config_of(same_cc), model="affine", version="v1", log=LOG)

    graph_header = (by_graph.path / "engine.plan").read_bytes().split(b"\n")[1]
    flags_header = (by_flags.path / "engine.plan").read_bytes().split(b"\n")[1]
    assert b'"strongly_typed": 2' in graph_header
    assert b'"flags": []' in graph_header
    assert b'"strongly_typed": 0' in flags_header
    assert b'"flags": [0]' in flags_header
    assert by_flags.path.name.startswith("fp16-flags-dyn-sm89-trt10.8.0.43-")


def test_builder_flags_are_refused_on_tensorrt_11_where_they_are_gone(
    tmp_path: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    directory = version_dir(tmp_path, tensorrt={"precision": "fp16", "precision_mode": "builder_flags"})

    with pytest.raises(
        ConfigError, match="has no FP16/INT8 builder flags \\(removed in 11\\); use precision_mode: onnx"
    ):
        build_and_store(load_environment(), directory, config_of(directory), model="affine", version="v1", log=LOG)


def test_every_parser_error_is_reported(tmp_path: Path, gpu: tuple[ModuleType, ModuleType]) -> None:
    directory = tmp_path / "models" / "odd" / "v1"
    directory.mkdir(parents=True)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = [
        helper.make_node("FakeUnsupportedOp", ["x"], ["a"], name="first", domain="example"),
        helper.make_node("Relu", ["a"], ["b"], name="fine"),
        helper.make_node("FakeUnsupportedOp", ["b"], ["y"], name="second", domain="example"),
    ]
    graph = helper.make_graph(nodes, "odd", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example", 1)])
    model.ir_version = 8
    onnx.save(model, directory / "model.onnx")
    (directory / "config.yaml").write_text(yaml.safe_dump({"backend": "tensorrt", "max_batch_size": 8}))

    with pytest.raises(BuildError) as caught:
        build_and_store(load_environment(), directory, config_of(directory), model="odd", version="v1", log=LOG)

    message = str(caught.value)
    assert "TensorRT's ONNX parser failed with 2 error(s)" in message
    assert "UNSUPPORTED_NODE: No importer registered for op: FakeUnsupportedOp in node 0 'first'" in message
    assert "in node 2 'second' (FakeUnsupportedOp)" in message


# --- backend: load -----------------------------------------------------------------------------------------------


@needs_fake_cuda("FAKE_GPU_NAME/FAKE_GPU_CC and its allocation log")
def test_without_an_engine_for_this_gpu_the_backend_fails_naming_the_key_it_looked_for(
    tmp_path: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    directory = version_dir(tmp_path)
    loading = backend(directory)

    with pytest.raises(ConfigError) as caught:
        loading.load()

    message = str(caught.value)
    assert (
        f"no TensorRT engine for this GPU in {directory / 'engines'}: looked for fp32-dyn-sm89-trt11.4.0.106-"
        in message
    )
    assert "TensorRT 11.4.0.106, GPU NVIDIA Fake L4 sm 8.9" in message
    assert "splitstream-build-engine" in message
    assert "tensorrt.build_on_start: true" in message
    assert gpu[1].ALLOCATIONS == {}
    assert gpu[1].STREAMS == {}


def test_with_build_on_start_the_backend_builds_the_missing_engine_then_serves_it(
    tmp_path: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    directory = version_dir(tmp_path, tensorrt={"build_on_start": True})
    served = backend(directory)

    served.load()
    try:
        x = rows(3)
        outputs = served.run({"x": x}, ["y", "label"])
    finally:
        served.close()

    expected = reference(directory, x)
    np.testing.assert_array_equal(outputs["y"], expected["y"])
    np.testing.assert_array_equal(outputs["label"], expected["label"])
    assert served.engine_tag == "affine-v1-fp32-dyn"
    assert len(EngineCache(directory / "engines").entries()) == 1


def test_an_engine_that_does_not_deserialize_is_refused(tmp_path: Path, gpu: tuple[ModuleType, ModuleType]) -> None:
    directory = version_dir(tmp_path)
    built = build_and_store(load_environment(), directory, config_of(directory), model="affine", version="v1", log=LOG)
    (built.path / "engine.plan").write_bytes(b"not a plan")

    with pytest.raises(EngineMismatch, match="could not deserialize the engine \\(Serialization assertion"):
        backend(directory).load()


@pytest.fixture
def built(tmp_path: Path, gpu: tuple[ModuleType, ModuleType]) -> Path:
    """affine v1 with contexts 2, a high stream priority and a profile of at most 4 rows; its engine built."""
    directory = version_dir(
        tmp_path,
        tensorrt={
            "contexts": 2,
            "stream_priority": "high",
            "profiles": [{"min": {"x": [1, 4]}, "opt": {"x": [4, 4]}, "max": {"x": [4, 4]}}],
        },
    )
    build_and_store(load_environment(), directory, config_of(directory), model="affine", version="v1", log=LOG)
    return directory


@needs_fake_cuda("its stream table and priority range")
def test_the_loaded_engine_reports_its_tensors_tag_contexts_and_their_memory(
    built: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    served = backend(built)
    served.load()
    try:
        metadata = served.metadata()
        streams = dict(gpu[1].STREAMS)
    finally:
        served.close()

    assert [(s.name, s.datatype, s.shape) for s in metadata.inputs] == [("x", "FP32", (-1, 4))]
    assert [(s.name, s.datatype, s.shape) for s in metadata.outputs] == [
        ("y", "FP32", (-1, 4)),
        ("label", "INT64", (-1,)),
    ]
    assert served.platform == "tensorrt_plan"
    assert served.engine_tag == "affine-v1-fp32-dyn"
    # Per context: the engine's 4096 bytes of activations + x (4 rows x 4 FP32) + y (same) + label (4 INT64).
    assert served.context_device_memory_bytes == (4096 + 64 + 64 + 32, 4096 + 64 + 64 + 32)
    # One stream for sizing buffers (default priority), one per context at the device's greatest priority.
    assert sorted(streams.values()) == [-5, -5, 0]


# --- backend: run ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8])
def test_batches_within_the_profile_run_at_once_and_larger_ones_are_split(
    built: Path, gpu: tuple[ModuleType, ModuleType], count: int
) -> None:
    served = backend(built)
    served.load()
    try:
        x = rows(count, seed=count)
        outputs = served.run({"x": x}, ["label", "y"])
    finally:
        served.close()

    expected = reference(built, x)
    assert list(outputs) == ["label", "y"]
    np.testing.assert_array_equal(outputs["y"], expected["y"])
    np.testing.assert_array_equal(outputs["label"], expected["label"])


def test_concurrent_runs_each_take_their_own_context_and_get_their_own_answers(
    built: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    served = backend(built)
    served.load()
    results: dict[int, dict[str, np.ndarray]] = {}
    inputs = {i: rows(1 + i % 4, seed=100 + i) for i in range(24)}

    def work(index: int) -> None:
        results[index] = served.run({"x": inputs[index]}, ["y"])

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in inputs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        served.close()

    for index, x in inputs.items():
        np.testing.assert_array_equal(results[index]["y"], x * 2.0 + 0.5)


def relu_version(tmp_path: Path) -> Path:
    """``y = relu(x)``, x [batch, n] with a profile of n in 2..8: a shape with n = 1 is outside the engine."""
    directory = tmp_path / "models" / "relu" / "v1"
    directory.mkdir(parents=True)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    onnx.save(model, directory / "model.onnx")
    settings = {
        "backend": "tensorrt",
        "max_batch_size": 8,
        "dynamic_batching": {"max_queue_delay_us": 2000},
        "tensorrt": {
            "build_on_start": True,
            "profiles": [{"min": {"x": [1, 2]}, "opt": {"x": [8, 8]}, "max": {"x": [8, 8]}}],
        },
    }
    (directory / "config.yaml").write_text(yaml.safe_dump(settings))
    return directory


def test_a_shape_outside_every_profile_is_refused_before_it_reaches_the_engine(
    tmp_path: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    directory = relu_version(tmp_path)
    served = backend(directory)
    served.load()
    try:
        served.check_request({"x": (8, 2)})
        with pytest.raises(InvalidInput) as caught:
            served.check_request({"x": (1, 9)})
        ok = served.run({"x": -np.abs(rows(2, features=5))}, ["y"])
    finally:
        served.close()

    assert str(caught.value) == (
        "input 'x': shape [1, 9] is outside the engine's optimisation profiles (allowed: [*, 2..8])"
    )
    np.testing.assert_array_equal(ok["y"], np.zeros((2, 5), np.float32))


@needs_fake_cuda("injected failures (FAIL)")
def test_a_failing_cuda_call_is_reported_by_name_and_the_context_goes_back_to_the_pool(
    built: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    cudart = gpu[1]
    served = backend(built)
    served.load()
    try:
        cudart.FAIL["cudaMemcpyAsync"] = cudart.cudaError_t.cudaErrorInvalidValue
        with pytest.raises(CudaError) as caught:
            served.run({"x": rows(1)}, ["y"])
        after = [served.run({"x": rows(2, seed=i)}, ["y"]) for i in range(3)]  # both contexts still usable
    finally:
        served.close()

    assert str(caught.value) == "cudaMemcpyAsync(input 'x', host to device) failed: cudaErrorInvalidValue"
    assert all(result["y"].shape == (2, 4) for result in after)


# --- backend: teardown ------------------------------------------------------------------------------------------


@needs_fake_cuda("its allocation log")
def test_close_releases_buffers_before_streams_and_leaves_nothing_allocated(
    built: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    cudart = gpu[1]
    served = backend(built)
    served.load()
    served.run({"x": rows(3)}, ["y"])

    served.close()
    served.close()  # a second close does nothing

    assert cudart.ALLOCATIONS == {}
    assert cudart.STREAMS == {}
    kinds = [kind for kind, _ in cudart.EVENTS]
    last_free = max(i for i, kind in enumerate(kinds) if kind.endswith("-freed"))
    first_stream_gone = kinds.index("stream-destroyed")
    assert last_free < first_stream_gone
    # Two contexts x three tensors, each with a device and a pinned buffer.
    assert kinds.count("device-freed") == kinds.count("pinned-freed") == 6


@needs_fake_cuda("injected failures (FAIL) and its allocation log")
def test_a_load_that_fails_half_way_releases_what_it_had_allocated(
    built: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    cudart = gpu[1]
    served = backend(built)
    cudart.FAIL["cudaMallocHost"] = cudart.cudaError_t.cudaErrorMemoryAllocation

    with pytest.raises(CudaError, match="cudaMallocHost\\(64\\) failed: cudaErrorMemoryAllocation"):
        served.load()

    assert cudart.ALLOCATIONS == {}
    assert cudart.STREAMS == {}


async def test_the_served_model_warms_up_within_the_profile_and_batches_requests_on_the_engine(
    tmp_path: Path, gpu: tuple[ModuleType, ModuleType]
) -> None:
    """Warm-up with dynamic dims = 1 would be outside this profile (n >= 2): it uses the profile's min shapes."""
    directory = relu_version(tmp_path)
    registry = CollectorRegistry()
    model = ServedModel(
        name="relu",
        version="v1",
        directory=directory,
        config=config_of(directory),
        metrics=WorkerMetrics(registry, model="relu", version="v1"),
        logger=LOG,
    )
    await model.load()
    try:
        await model.warm_up()
        inputs = [rows(1 + i % 3, seed=i, features=3) for i in range(6)]
        plans = [model.plan([InputHeader("x", "FP32", x.shape)], []) for x in inputs]
        answers = await asyncio.gather(*(model.infer({"x": x}, plan) for x, plan in zip(inputs, plans, strict=True)))
        with pytest.raises(InvalidInput, match="outside the engine's optimisation profiles"):
            model.plan([InputHeader("x", "FP32", (1, 1))], [])
    finally:
        await model.stop()

    assert model.ready is False  # stopped
    assert model.engine_tag == "relu-v1-fp32-dyn"
    for x, answer in zip(inputs, answers, strict=True):
        np.testing.assert_array_equal(answer["y"], np.maximum(x, 0))
    batches = registry.get_sample_value("splitstream_worker_batch_size_count", {"model": "relu", "version": "v1"})
    assert batches is not None
    assert batches < 6  # concurrent requests met in batches
