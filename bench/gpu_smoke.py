"""GPU smoke test of the TensorRT backend: build, load, run, compare with ONNX Runtime, time it.

Needs a machine with an NVIDIA GPU, TensorRT 10.8+ and cuda-python
(``pip install -e '.[tensorrt]'``; ``onnxruntime-gpu`` adds the ONNX Runtime
CUDA column). It is a script, not a test: ``make test`` runs without a GPU.

For each precision (``--precisions fp32,fp16``) it

1. writes a model repository with an MLP (``--layers`` MatMul+Relu of
   ``--width``, FP32 in and out) and ``backend: tensorrt`` with a profile of
   1..``--max-batch`` rows;
2. builds the engine with :func:`~splitstream.worker.engines.builder.build_and_store`
   (precision step, timing cache, engine cache) and builds it again, which
   must find it cached;
3. loads it with the worker's TensorRT backend (2 contexts, high stream
   priority), runs batches of ``--batches`` rows plus one larger than the
   profile (split into several engine calls), and compares every output with
   ONNX Runtime on CPU (fp32: rtol 1e-2 because TensorRT may use TF32;
   fp16: rtol 5e-2);
4. times each batch size on TensorRT, ONNX Runtime CUDA (when
   onnxruntime-gpu is installed) and ONNX Runtime CPU, and prints p50/p99
   latency and rows/s side by side.

Exit code 0 when every comparison passed, 1 otherwise, 2 when TensorRT,
cuda-python or a GPU is missing (one line says which).

    .venv/bin/python bench/gpu_smoke.py [--precisions fp32,fp16] [--batches 1,8,32,64] [--iterations 200]

``--fake`` runs it on ``tests/fakegpu`` instead (ONNX Runtime pretending to be
TensorRT): a dry run of this script's own code on a machine without a GPU;
its numbers mean nothing.

``--fake-tensorrt`` fakes TensorRT alone: a GPU machine with cuda-python but no
TensorRT runs everything else for real (device probe, stream priorities,
non-blocking streams, device and pinned buffers, the copies, teardown) while
``tests/fakegpu``'s engine runs the model with ONNX Runtime on CPU between a
device-to-host and a host-to-device copy. Its "tensorrt" numbers are ONNX
Runtime's (plus those copies); the outputs are still compared with ONNX Runtime
on CPU, and the device's free memory before load and after close must match
(after a first load/run/close, since CUDA keeps some memory it allocates on
first use).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import structlog
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.mlp import mlp_model  # noqa: E402

MODEL, VERSION = "smoke-mlp", "v1"
TOLERANCES = {"fp32": (1e-2, 1e-3), "fp16": (5e-2, 5e-3)}


def timed(run: Callable[[], object], iterations: int) -> tuple[float, float]:
    """p50 and p99 milliseconds of ``run()`` after a few warm-up calls."""
    for _ in range(min(10, iterations)):
        run()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1000)
    return float(np.percentile(samples, 50)), float(np.percentile(samples, 99))


def _runner(backend: Any) -> Callable[[dict[str, np.ndarray]], object]:
    return lambda feeds: backend.run(feeds, ["y"])


def _session_runner(session: ort.InferenceSession) -> Callable[[dict[str, np.ndarray]], object]:
    return lambda feeds: session.run(["y"], feeds)


def _bound(run: Callable[[dict[str, np.ndarray]], object], feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    return lambda: run(feeds)


class _FakeTensorRTFinder:
    """Resolves ``import tensorrt`` to ``tests/fakegpu/tensorrt`` only; ``cuda`` stays the installed cuda-python."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "tensorrt":
            return None
        return importlib.machinery.PathFinder.find_spec(name, [str(ROOT / "tests" / "fakegpu")])


def _free_device_bytes(cudart: Any) -> int | None:
    """Free device memory (cudaMemGetInfo), or None where it cannot be read."""
    from splitstream.worker.engines.cuda import CudaError, checked

    try:
        free, _total = checked(cudart.cudaMemGetInfo(), "cudaMemGetInfo")
    except (CudaError, AttributeError):
        return None
    return int(free)


def _cuda_bindings_version() -> str:
    try:
        import cuda.bindings
    except ImportError:
        return "none"
    return str(getattr(cuda.bindings, "__version__", "unknown (fake)"))


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--precisions", default="fp32,fp16")
    cli.add_argument("--batches", default="1,8,32,64")
    cli.add_argument("--max-batch", type=int, default=64)
    cli.add_argument("--layers", type=int, default=4)
    cli.add_argument("--width", type=int, default=1024)
    cli.add_argument("--iterations", type=int, default=200)
    cli.add_argument("--keep", type=Path, default=None, help="build the repository here and keep it")
    fakes = cli.add_mutually_exclusive_group()
    fakes.add_argument("--fake", action="store_true", help="dry run on tests/fakegpu (no GPU; numbers mean nothing)")
    fakes.add_argument(
        "--fake-tensorrt",
        action="store_true",
        help="tests/fakegpu's TensorRT (ONNX Runtime on CPU) on real cuda-python and a real GPU",
    )
    args = cli.parse_args()
    if args.fake:
        sys.path.insert(0, str(ROOT / "tests" / "fakegpu"))
    elif args.fake_tensorrt:
        sys.meta_path.insert(0, _FakeTensorRTFinder())

    from splitstream.common.errors import ConfigError
    from splitstream.worker.backends.tensorrt import TensorRTBackend
    from splitstream.worker.config import ModelConfig
    from splitstream.worker.engines.builder import build_and_store
    from splitstream.worker.engines.cuda import stream_priority
    from splitstream.worker.engines.environment import load_environment

    log = structlog.get_logger("gpu_smoke")
    try:
        env = load_environment("the GPU smoke test")
    except ConfigError as error:
        print(f"gpu_smoke: {error}", file=sys.stderr)
        return 2
    device = env.device
    cudart = env.cudart
    if args.fake:
        print("FAKE GPU (tests/fakegpu): neither TensorRT nor CUDA; every number below means nothing")
    elif args.fake_tensorrt:
        print(
            "FAKE TENSORRT (tests/fakegpu) on real cuda-python and a real GPU: the 'tensorrt' rows below are ONNX "
            "Runtime on CPU plus real host/device copies, not TensorRT"
        )
    print(
        f"TensorRT {device.tensorrt_version} on {device.gpu_name} (compute capability "
        f"{device.compute_capability[0]}.{device.compute_capability[1]}, sm {device.sm}); cuda-bindings "
        f"{_cuda_bindings_version()}; onnxruntime {ort.__version__} providers {ort.get_available_providers()}"
    )
    high, (least, greatest) = stream_priority(cudart, "high")
    print(f"stream priorities: least {least}, greatest {greatest}; 'high' is {high}")
    engine_name = "fake tensorrt (onnxruntime cpu)" if args.fake or args.fake_tensorrt else "tensorrt"
    batches = [int(b) for b in args.batches.split(",")]
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    failures = 0
    rows = []
    try:
        for precision in args.precisions.split(","):
            directory = workdir / precision / MODEL / VERSION
            mlp_model(directory / "model.onnx", layers=args.layers, width=args.width)
            settings = {
                "backend": "tensorrt",
                "max_batch_size": args.max_batch,
                "instance_count": 2,
                "tensorrt": {
                    "precision": precision,
                    "contexts": 2,
                    "stream_priority": "high",
                    "workspace_bytes": 1 << 30,
                    "profiles": [
                        {
                            "min": {"x": [1, args.width]},
                            "opt": {"x": [max(batches), args.width]},
                            "max": {"x": [args.max_batch, args.width]},
                        }
                    ],
                },
            }
            (directory / "config.yaml").write_text(yaml.safe_dump(settings))
            config = ModelConfig.from_file(directory / "config.yaml")
            start = time.perf_counter()
            outcome = build_and_store(env, directory, config, model=MODEL, version=VERSION, log=log)
            build_s = time.perf_counter() - start
            again = build_and_store(env, directory, config, model=MODEL, version=VERSION, log=log)
            print(f"[{precision}] built {outcome.path.name} in {build_s:.1f} s; second build cached: {not again.built}")
            if again.built:
                failures += 1
            cpu = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
            gpu = None
            if "CUDAExecutionProvider" in ort.get_available_providers() and not args.fake:
                gpu = ort.InferenceSession(str(directory / "model.onnx"), providers=["CUDAExecutionProvider"])
            # A first load, run and close: CUDA keeps some device memory it allocates on first use (2 MiB on an
            # H200 with cuda-bindings 13.3), which is no leak of the backend's; the check starts after it.
            free_first = _free_device_bytes(cudart)
            backend = TensorRTBackend(directory, config, logger=log)
            backend.load()
            try:
                backend.run({"x": np.zeros((1, args.width), dtype=np.float32)}, ["y"])
            finally:
                backend.close()
            free_before = _free_device_bytes(cudart)
            if free_first is not None and free_before is not None:
                print(f"[{precision}] a first load/run/close kept {free_first - free_before:,} bytes of device memory")
            backend = TensorRTBackend(directory, config, logger=log)
            backend.load()
            free_loaded = _free_device_bytes(cudart)
            try:
                memory = backend.context_device_memory_bytes
                print(f"[{precision}] tag {backend.engine_tag}; device bytes per context {memory}")
                rtol, atol = TOLERANCES.get(precision, (5e-2, 5e-3))
                for count in [*batches, args.max_batch + args.max_batch // 2 + 1]:
                    x = np.random.default_rng(count).standard_normal((count, args.width)).astype(np.float32)
                    expected = cpu.run(["y"], {"x": x})[0]
                    actual = backend.run({"x": x}, ["y"])["y"]
                    worst = float(np.max(np.abs(actual - expected)))
                    ok = actual.shape == expected.shape and np.allclose(actual, expected, rtol=rtol, atol=atol)
                    failures += not ok
                    note = " (split: beyond the profile)" if count > args.max_batch else ""
                    verdict = "ok" if ok else "MISMATCH"
                    print(f"[{precision}] batch {count}{note}: max |trt - ort cpu| = {worst:.2e} {verdict}")
                for count in batches:
                    x = np.random.default_rng(count).standard_normal((count, args.width)).astype(np.float32)
                    engines: list[tuple[str, Callable[[dict[str, np.ndarray]], object]]] = [
                        (f"{engine_name} {precision}", _runner(backend)),
                        ("onnxruntime cpu", _session_runner(cpu)),
                    ]
                    if gpu is not None:
                        engines.insert(1, ("onnxruntime cuda", _session_runner(gpu)))
                    for name, run in engines:
                        p50, p99 = timed(_bound(run, {"x": x}), args.iterations)
                        rows.append((name, count, p50, p99, count / (p50 / 1000)))
            finally:
                backend.close()
            free_after = _free_device_bytes(cudart)
            if free_before is not None and free_loaded is not None and free_after is not None:
                leaked = free_before - free_after
                print(
                    f"[{precision}] device memory free: {free_before:,} before load, {free_loaded:,} loaded "
                    f"({free_before - free_loaded:,} in use), {free_after:,} after close: "
                    f"{'ok' if leaked <= 0 else f'LEAK? {leaked:,} bytes did not come back'}"
                )
                failures += leaked > 0
            else:
                print(f"[{precision}] device memory: cudaMemGetInfo unavailable, no leak check")
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print("| engine | batch | p50 ms | p99 ms | rows/s at p50 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, count, p50, p99, throughput in rows:
        print(f"| {name} | {count} | {p50:.3f} | {p99:.3f} | {throughput:,.0f} |")
    print(f"\n{'FAILED' if failures else 'OK'}: {failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
