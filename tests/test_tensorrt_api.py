"""Every TensorRT and cuda-python name our code uses exists in the releases we support; none that were removed.

No GPU or TensorRT library needed: ``tests/data/api_names/`` holds the Python
API names of TensorRT 10.8.0.43 and 11.4.0.106 (read from their bindings
wheels' ``tensorrt.so`` string tables) and of ``cuda.bindings.runtime`` in
cuda-bindings 12.8.0 and 13.5.0 (from ``dir()``), made by
``scripts/gen_api_names.py``. The code's uses are collected from its syntax
tree: attribute accesses on ``trt`` and on the variables that hold TensorRT
objects (named by the convention in ``TRT_RECEIVERS``), and on ``cudart``.

A name TensorRT's linker merged into a longer string (``num_errors`` lives
inside ``get_num_errors``) is found as that string's end.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from splitstream.worker.engines import builder

ROOT = Path(__file__).resolve().parent.parent
NAMES = Path(__file__).resolve().parent / "data" / "api_names"
TENSORRT_RELEASES = ("10.8.0.43", "11.4.0.106")
CUDA_RELEASES = ("12.8.0", "13.5.0")
SOURCES = (
    "services/worker/backends/tensorrt.py",
    "services/worker/engines/builder.py",
    "services/worker/engines/cuda.py",
    "services/worker/engines/environment.py",
    "bench/gpu_smoke.py",
)
#: Variables (or ``self._<name>`` attributes) that hold TensorRT objects in the sources above.
TRT_RECEIVERS = frozenset(
    {
        "trt",
        "builder",
        "network",
        "parser",
        "parser_error",
        "builder_config",
        "optimization_profile",
        "timing_cache",
        "severity",
        "runtime",
        "engine",
        "context",
    }
)
#: Variables that hold cuda-python's runtime module or its results, and the class their attributes belong to.
CUDA_RECEIVERS = {"cudart": None, "props": "cudaDeviceProp"}
#: Gone from current TensorRT (or from cuda-python); the code must not touch them.
REMOVED = (
    "EXPLICIT_BATCH",
    "execute_async_v2",
    "get_binding_index",
    "num_bindings",
    "binding_is_input",
    "set_binding_shape",
    "max_workspace_size",
    "IInt8EntropyCalibrator2",
    "int8_calibrator",
    "build_engine",
    "build_cuda_engine",
    "device_memory_size",
)


@cache
def names(kind: str, release: str) -> frozenset[str]:
    lines = (NAMES / f"{kind}-{release}.txt").read_text().splitlines()
    return frozenset(line for line in lines if line and not line.startswith("#"))


def in_tensorrt(name: str, release: str) -> bool:
    table = names("tensorrt", release)
    return name in table or any(entry.endswith(name) for entry in table)


def in_cuda(name: str, release: str) -> bool:
    return name in names("cuda-bindings", release)


def receiver(node: ast.expr) -> str | None:
    """``trt``/``engine`` for ``trt.X``/``self._engine.X``; the receiver of a chain for ``trt.A.B``; else None."""
    while isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr.lstrip("_")
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return receiver(node.func)  # builder_config.get_timing_cache().serialize(): a TensorRT object too
    return node.id if isinstance(node, ast.Name) else None


def chain(node: ast.Attribute) -> list[str]:
    """``cudart.cudaMemcpyKind.cudaMemcpyHostToDevice`` → ``["cudaMemcpyKind", "cudaMemcpyHostToDevice"]``."""
    parts = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute) and not (isinstance(value.value, ast.Name) and value.value.id == "self"):
        parts.append(value.attr)
        value = value.value
    return parts[::-1]


@cache
def uses() -> tuple[frozenset[tuple[str, str]], frozenset[str], frozenset[str]]:
    """(TensorRT uses as (file, name)), cuda-python uses (``name`` or ``Class.member``), every identifier."""
    trt_uses: set[tuple[str, str]] = set()
    cuda_uses: set[str] = set()
    identifiers: set[str] = set()
    for source in SOURCES:
        tree = ast.parse((ROOT / source).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                identifiers.add(node.id)
            if not isinstance(node, ast.Attribute):
                continue
            identifiers.add(node.attr)
            owner = receiver(node)
            if node.attr.startswith("__") or owner is None:
                continue
            if owner in TRT_RECEIVERS:
                trt_uses.add((source, node.attr))
            elif owner in CUDA_RECEIVERS:
                parts = chain(node)
                if owner == "cudart":
                    cuda_uses.add(".".join(parts[-2:]) if len(parts) > 1 else parts[0])
                elif len(parts) == 1:
                    cuda_uses.add(f"{CUDA_RECEIVERS[owner]}.{node.attr}")
    return frozenset(trt_uses), frozenset(cuda_uses), frozenset(identifiers)


def test_the_collector_sees_the_calls_that_matter() -> None:
    """Guards the test itself: a renamed variable must not silently empty the lists below."""
    trt_uses, cuda_uses, _ = uses()
    used = {name for _, name in trt_uses}

    assert {
        "Builder", "create_network", "OnnxParser", "parse_from_file", "num_errors", "get_error",
        "create_builder_config", "set_memory_pool_limit", "create_optimization_profile", "set_shape",
        "add_optimization_profile", "create_timing_cache", "set_timing_cache", "get_timing_cache", "serialize",
        "build_serialized_network", "Runtime", "deserialize_cuda_engine", "num_io_tensors", "get_tensor_name",
        "get_tensor_mode", "get_tensor_dtype", "get_tensor_shape", "get_tensor_profile_shape",
        "create_execution_context", "set_optimization_profile_async", "set_input_shape", "infer_shapes",
        "set_tensor_address", "execute_async_v3", "nptype", "WORKSPACE", "STRONGLY_TYPED", "VERSION_COMPATIBLE",
    } <= used  # fmt: skip
    assert {
        "cudaGetDeviceCount", "cudaGetDeviceProperties", "cudaDeviceGetStreamPriorityRange",
        "cudaStreamCreateWithPriority", "cudaStreamNonBlocking", "cudaStreamSynchronize", "cudaStreamDestroy",
        "cudaMalloc", "cudaFree", "cudaMallocHost", "cudaFreeHost", "cudaMemcpyAsync",
        "cudaMemcpyKind.cudaMemcpyHostToDevice", "cudaMemcpyKind.cudaMemcpyDeviceToHost", "cudaDeviceProp.major",
    } <= cuda_uses  # fmt: skip


@pytest.mark.parametrize("release", TENSORRT_RELEASES)
def test_every_tensorrt_name_the_code_uses_exists_in_the_release(release: str) -> None:
    trt_uses, _, _ = uses()

    missing = sorted(f"{source}: {name}" for source, name in trt_uses if not in_tensorrt(name, release))

    assert missing == [], f"not in TensorRT {release}"


@pytest.mark.parametrize("release", CUDA_RELEASES)
def test_every_cuda_python_name_the_code_uses_exists_in_the_release(release: str) -> None:
    _, cuda_uses, _ = uses()

    assert sorted(name for name in cuda_uses if not in_cuda(name, release)) == []


def test_no_removed_api_is_used_and_the_removed_list_is_really_gone_from_tensorrt_11() -> None:
    _, _, identifiers = uses()
    text = "\n".join((ROOT / source).read_text() for source in SOURCES)

    assert sorted(identifiers & set(REMOVED)) == []
    assert [name for name in REMOVED if in_tensorrt(name, "11.4.0.106")] == []
    assert "pycuda" not in text
    assert "from cuda import cudart" not in text  # removed in cuda-bindings 13


def test_names_looked_up_by_version_are_where_the_version_check_expects_them() -> None:
    """FP16/INT8 builder flags: TensorRT 10.x only. Hardware levels: at least one release has each."""
    for flag in builder.LEGACY_PRECISION_FLAGS.values():
        assert in_tensorrt(flag, "10.8.0.43"), flag
    assert not in_tensorrt("FP16", "11.4.0.106")  # INT8 cannot be told apart from UINT8 in the string table
    for level in builder.HARDWARE_LEVELS.values():
        assert any(in_tensorrt(level, release) for release in TENSORRT_RELEASES), level
    assert not in_tensorrt("SAME_COMPUTE_CAPABILITY", "10.8.0.43")  # hence looked up with getattr
    assert all(in_tensorrt("device_memory_size_v2", release) for release in TENSORRT_RELEASES)


def test_the_name_lists_were_generated_from_the_named_wheels() -> None:
    for release in TENSORRT_RELEASES:
        header = (NAMES / f"tensorrt-{release}.txt").read_text().splitlines()[0]
        assert f"TensorRT {release}" in header
        assert "bindings" in header
        assert len(names("tensorrt", release)) > 1500
    for release in CUDA_RELEASES:
        assert len(names("cuda-bindings", release)) > 2000


def test_the_fake_cuda_runtime_defines_only_names_both_releases_have() -> None:
    """``tests/fakegpu`` stands in for cuda-python: a name the real one lacks would pass here and fail on a GPU."""
    tree = ast.parse((ROOT / "tests" / "fakegpu" / "cuda" / "bindings" / "runtime.py").read_text())
    defined: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.ClassDef):
            defined.add(node.name)
            for member in node.body:
                if isinstance(member, ast.Assign):
                    defined.update(f"{node.name}.{t.id}" for t in member.targets if isinstance(t, ast.Name))
    # Test helpers: private names, UPPER_CASE tables and knobs, inside().
    public = {name for name in defined if not name.startswith("_") and not name.isupper() and name != "inside"}

    assert {"cudaMemcpy", "cudaMemcpyAsync", "cudaMemcpyKind.cudaMemcpyDeviceToHost"} <= public
    for release in CUDA_RELEASES:
        assert sorted(name for name in public if not in_cuda(name, release)) == [], release
