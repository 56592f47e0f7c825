"""A worker configured for TensorRT, and ``splitstream-build-engine``, as real processes.

Without TensorRT or a GPU both fail at start with one clear line (exit 2).
With the fake GPU of ``tests/fakegpu`` on PYTHONPATH the whole path runs:
build the engines in "CI", then a worker loads them and serves over gRPC.
Under ``SPLITSTREAM_TEST_REAL_CUDA=1`` the workers get the fake ``tensorrt``
alone and run on cuda-python and a real GPU (see ``tests/fake_gpu.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import yaml

from splitstream.common.proto.inference import grpc_service_pb2 as oip
from splitstream.common.proto.inference import grpc_service_pb2_grpc
from splitstream.common.tensors import output_arrays
from tests import launcher
from tests.fake_gpu import fake_gpu_pythonpath, needs_fake_cuda
from tests.harness import ROOT, ServiceProcess, free_port, make_request, metric_samples, scrape_metrics
from tests.models import add_version, affine_model
from tests.tensors import add_raw_input

MODEL, VERSION = "affine", "v1"
NO_TENSORRT_LINE = (
    "splitstream-worker: error: backend tensorrt needs TensorRT, cuda-python and an NVIDIA GPU: "
    "TensorRT is not installed (no module tensorrt); cuda-python is not installed (no module cuda.bindings.runtime); "
    "pip install 'splitstream[tensorrt]'"
)


@pytest.fixture
def no_tensorrt(tmp_path: Path) -> dict[str, str]:
    """An environment where ``import tensorrt`` and ``import cuda`` fail, whatever this machine has installed."""
    shadow = tmp_path / "shadow"
    (shadow / "cuda").mkdir(parents=True)
    (shadow / "tensorrt.py").write_text("raise ImportError(\"No module named 'tensorrt'\", name='tensorrt')\n")
    (shadow / "cuda" / "__init__.py").write_text("raise ImportError(\"No module named 'cuda'\", name='cuda')\n")
    inherited = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), *([inherited] if inherited else [])])}


def fake_gpu_env(**settings: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": fake_gpu_pythonpath(), **settings}


def repository(tmp_path: Path, **tensorrt: Any) -> Path:
    repo = tmp_path / "models"
    add_version(repo, MODEL, VERSION, scale=2.0, bias=0.5, config={"backend": "tensorrt", "tensorrt": tensorrt or None})
    return repo


def run_module(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return launcher.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )


def worker_args(repo: Path, port: int = 0) -> list[str]:
    return [
        "--model-repository", str(repo), "--model", MODEL, "--version", VERSION,
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
    ]  # fmt: skip


# --- no TensorRT, no GPU: one line, exit 2 -----------------------------------------------------------------------


def test_a_tensorrt_worker_without_tensorrt_or_a_gpu_exits_2_with_one_line(
    tmp_path: Path, no_tensorrt: dict[str, str]
) -> None:
    result = run_module("splitstream.worker", *worker_args(repository(tmp_path)), env=no_tensorrt)

    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == NO_TENSORRT_LINE


@needs_fake_cuda("FAKE_CUDA_DEVICES=0")
def test_a_tensorrt_worker_with_tensorrt_but_no_gpu_exits_2_naming_the_cuda_error(tmp_path: Path) -> None:
    result = run_module(
        "splitstream.worker", *worker_args(repository(tmp_path)), env=fake_gpu_env(FAKE_CUDA_DEVICES="0")
    )

    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "splitstream-worker: error: backend tensorrt needs an NVIDIA GPU: cudaGetDeviceCount failed: cudaErrorNoDevice"
    )


@needs_fake_cuda("FAKE_GPU_CC: the key names sm 8.9")
def test_a_gpu_worker_without_a_cached_engine_exits_2_naming_the_key_it_looked_for(tmp_path: Path) -> None:
    repo = repository(tmp_path, precision="fp16")

    result = run_module("splitstream.worker", *worker_args(repo), env=fake_gpu_env())

    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"splitstream-worker: error: no TensorRT engine for this GPU in {repo / MODEL / VERSION / 'engines'}: "
        "looked for fp16-dyn-sm89-trt11.4.0.106-"
    )
    assert "precision fp16" in last


def test_the_engine_builder_without_tensorrt_exits_2_with_one_line_but_can_still_run_the_precision_step(
    tmp_path: Path, no_tensorrt: dict[str, str]
) -> None:
    repo = repository(tmp_path, precision="fp16")
    prepared = tmp_path / "out" / "model.fp16.onnx"

    build = run_module("splitstream.worker.engines.build_cli", "--model-repository", str(repo), env=no_tensorrt)
    prepare = run_module(
        "splitstream.worker.engines.build_cli",
        "--model-repository", str(repo), "--model", MODEL, "--version", VERSION, "--prepare-only", str(prepared),
        env=no_tensorrt,
    )  # fmt: skip

    assert build.returncode == 2
    assert (
        build.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "splitstream-build-engine: error: splitstream-build-engine needs TensorRT, cuda-python and an NVIDIA GPU: "
            "TensorRT is not installed"
        )
    )
    assert "Traceback" not in build.stderr
    assert prepare.returncode == 0, prepare.stderr
    assert prepare.stdout.split() == ["prepared", f"{MODEL}/{VERSION}", "affine-v1-fp16-dyn", str(prepared)]
    assert prepared.is_file()


def test_the_engine_builder_reports_a_config_error_in_one_line(tmp_path: Path) -> None:
    repo = repository(tmp_path)
    config = repo / MODEL / VERSION / "config.yaml"
    config.write_text(yaml.safe_dump({"backend": "tensorrt", "tensorrt": {"precision": "fp64"}}))

    result = run_module("splitstream.worker.engines.build_cli", "--model-repository", str(repo), env=fake_gpu_env())

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"splitstream-build-engine: error: {config}: tensorrt.precision: must be one of ['fp32', 'fp16', 'int8'], "
        "got 'fp64'"
    ]


# --- the whole path on the fake GPU ------------------------------------------------------------------------------


@pytest.mark.slow
def test_engines_built_in_ci_are_served_by_a_worker_on_the_same_gpu(tmp_path: Path) -> None:
    repo = repository(tmp_path, precision="fp16", contexts=2)
    add_version(repo, "other", "v1", scale=1.0, config={"backend": "onnxruntime"})  # not TensorRT: skipped
    env = fake_gpu_env()

    built = run_module("splitstream.worker.engines.build_cli", "--model-repository", str(repo), env=env)
    cached = run_module("splitstream.worker.engines.build_cli", "--model-repository", str(repo), env=env)

    assert built.returncode == 0, built.stderr
    assert built.stdout.split()[:3] == ["built", f"{MODEL}/{VERSION}", "affine-v1-fp16-dyn"]
    assert cached.stdout.split()[:3] == ["cached", f"{MODEL}/{VERSION}", "affine-v1-fp16-dyn"]

    port, metrics_port = free_port(), free_port()
    args = worker_args(repo, port)
    args[args.index("--metrics-port") + 1] = str(metrics_port)
    worker = ServiceProcess("worker-trt", "splitstream.worker", args, log_dir=tmp_path, port=port, env=env)
    worker.start(timeout_s=60)
    try:
        x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
        with grpc.insecure_channel(worker.address) as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            metadata = stub.ModelMetadata(oip.ModelMetadataRequest(name=MODEL), timeout=10)
            request = oip.ModelInferRequest(model_name=MODEL)
            add_raw_input(request, "x", x)
            outputs = output_arrays(stub.ModelInfer(request, timeout=10))
        metrics = scrape_metrics(metrics_port)
    finally:
        worker.stop()

    assert metadata.platform == "tensorrt_plan"
    np.testing.assert_allclose(outputs["y"], x * 2.0 + 0.5, rtol=1e-3, atol=1e-3)  # FP16 inside, FP32 outside
    assert outputs["y"].dtype == np.float32
    info = metric_samples(metrics, "splitstream_worker_engine_info")
    assert info == [
        ({"model": MODEL, "version": VERSION, "backend": "tensorrt", "engine_tag": "affine-v1-fp16-dyn"}, 1.0)
    ]
    memory = metric_samples(metrics, "splitstream_worker_context_device_memory_bytes")
    assert sorted(labels["context"] for labels, _ in memory) == ["0", "1"]
    assert all(value > 0 for _, value in memory)
    assert '"tensorrt engine loaded"' in worker.log()


# --- concurrent load: every answer is its own request's ----------------------------------------------------------

HAMMER_CLIENTS = 32
HAMMER_SECONDS = 3.0
FEATURES = 512  # 2 KiB a row: copies large enough to take time on a real GPU


def hammered_repository(tmp_path: Path) -> Path:
    """affine [batch, 512] on TensorRT: 3 contexts for 4 executor threads, dynamic batching up to 16 rows and
    two profiles (1..4 and 5..8 rows), so runs wait for contexts, switch profiles and split batches over 8 rows."""
    directory = tmp_path / "models" / MODEL / VERSION
    affine_model(directory / "model.onnx", scale=2.0, bias=0.5, features=FEATURES)
    settings = {
        "backend": "tensorrt",
        "max_batch_size": 16,
        "dynamic_batching": {"max_queue_delay_us": 1000},
        "instance_count": 4,
        "tensorrt": {
            "build_on_start": True,
            "contexts": 3,
            "profiles": [
                {"min": {"x": [1, FEATURES]}, "opt": {"x": [4, FEATURES]}, "max": {"x": [4, FEATURES]}},
                {"min": {"x": [5, FEATURES]}, "opt": {"x": [8, FEATURES]}, "max": {"x": [8, FEATURES]}},
            ],
        },
    }
    (directory / "config.yaml").write_text(yaml.safe_dump(settings))
    return tmp_path / "models"


@pytest.mark.slow
def test_concurrent_clients_each_get_the_answer_to_their_own_input(tmp_path: Path) -> None:
    """32 clients send distinct random inputs of 1..4 rows for a few seconds; the worker batches them, splits the
    batches over its profiles and runs them on 3 contexts at once. Each answer must be ONNX Runtime's (on CPU) for
    that request's own input: a row from another request, or one read before its copy finished, is a wrong answer.
    On the fake cudart this checks the batching and context logic; with SPLITSTREAM_TEST_REAL_CUDA=1 the copies
    are really asynchronous."""
    repo = hammered_repository(tmp_path)
    reference = ort.InferenceSession(str(repo / MODEL / VERSION / "model.onnx"), providers=["CPUExecutionProvider"])
    port, metrics_port = free_port(), free_port()
    args = worker_args(repo, port)
    args[args.index("--metrics-port") + 1] = str(metrics_port)
    worker = ServiceProcess("worker-trt", "splitstream.worker", args, log_dir=tmp_path, port=port, env=fake_gpu_env())
    worker.start(timeout_s=60)
    stop = threading.Event()
    answered = [0] * HAMMER_CLIENTS
    wrong: list[str] = []
    failed: list[str] = []

    def client(index: int) -> None:
        rng = np.random.default_rng(1000 + index)
        with grpc.insecure_channel(worker.address) as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            while not stop.is_set():
                x = rng.standard_normal((int(rng.integers(1, 5)), FEATURES)).astype(np.float32)
                x[:, int(rng.integers(FEATURES))] += 10.0  # a label that differs between rows and requests
                try:
                    outputs = output_arrays(stub.ModelInfer(make_request(MODEL, x), timeout=30))
                except grpc.RpcError as error:
                    failed.append(f"client {index}: {error.code().name} {error.details()}")
                    return
                y, label = reference.run(["y", "label"], {"x": x})
                if not (np.array_equal(outputs["y"], y) and np.array_equal(outputs["label"], label)):
                    wrong.append(f"client {index}, request {answered[index]}: {x.shape[0]} rows")
                answered[index] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(HAMMER_CLIENTS)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(HAMMER_SECONDS)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        metrics = scrape_metrics(metrics_port)
    finally:
        stop.set()
        worker.stop()

    assert not failed, failed[:5]
    assert not wrong, f"{len(wrong)} of {sum(answered)} answers were not their own request's: {wrong[:5]}"
    assert all(count > 0 for count in answered), answered
    runs = {labels["le"]: value for labels, value in metric_samples(metrics, "splitstream_worker_batch_size_bucket")}
    assert runs["+Inf"] < sum(answered)  # requests met in batches
    assert runs["+Inf"] > runs["8.0"]  # some batches were over 8 rows: split across the profiles
    assert "Traceback" not in worker.log()
