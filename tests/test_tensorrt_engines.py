"""TensorRT's pure logic, no GPU needed: config → profiles, batch planning, the engine cache key and tag,
and the refusal of an engine built for another GPU, TensorRT version or model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from splitstream.common.errors import ConfigError, InvalidInput
from splitstream.worker.config import ModelConfig
from splitstream.worker.engines.cache import (
    DeviceFacts,
    EngineCache,
    EngineMismatch,
    EngineSpec,
    build_record,
    describe_key,
    engine_key,
)
from splitstream.worker.engines.profiles import (
    InputShape,
    Profile,
    batch_split_warning,
    check_shapes,
    plan_chunks,
    profile_from_json,
    resolve_profiles,
)
from splitstream.worker.engines.spec import resolve_spec
from tests.models import affine_model

L4 = DeviceFacts(tensorrt_version="11.4.0.106", gpu_name="NVIDIA L4", compute_capability=(8, 9))
X = InputShape("x", (-1, 4))


def config(**tensorrt: Any) -> ModelConfig:
    return ModelConfig.from_mapping({"backend": "tensorrt", "max_batch_size": 8, "tensorrt": tensorrt or None})


def spec(**overrides: Any) -> EngineSpec:
    values: dict[str, Any] = {
        "model": "resnet",
        "version": "v2",
        "precision": "fp16",
        "precision_mode": "onnx",
        "profiles": resolve_profiles((), (X,), max_batch_size=8),
        "onnx_sha256": "ab" * 32,
    }
    values.update(overrides)
    return EngineSpec(**values)


# --- config ------------------------------------------------------------------------------------------------------


def test_a_tensorrt_section_is_read_with_its_profiles_and_defaults_fill_the_rest() -> None:
    loaded = config(
        precision="fp16",
        profiles=[{"min": {"x": [1, 4]}, "opt": {"x": [4, 4]}, "max": {"x": [16, 4]}}],
        contexts=2,
        stream_priority="high",
        workspace_bytes=1 << 30,
    )

    trt = loaded.trt
    assert (trt.precision, trt.contexts, trt.stream_priority, trt.workspace_bytes) == ("fp16", 2, "high", 1 << 30)
    assert trt.profiles[0].max == {"x": (16, 4)}
    assert (trt.build_on_start, trt.hardware_compatibility, trt.version_compatible, trt.timing_cache) == (
        False,
        "none",
        False,
        True,
    )
    assert ModelConfig.from_mapping({"backend": "tensorrt"}).trt.precision == "fp32"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensorrt": {"precision": "fp8"}}, "tensorrt.precision: must be one of ['fp32', 'fp16', 'int8']"),
        ({"tensorrt": {"workspace": 1}}, "tensorrt.workspace: unknown field"),
        ({"tensorrt": {"contexts": 0}}, "tensorrt.contexts: must be an integer >= 1"),
        ({"tensorrt": {"stream_priority": "urgent"}}, "tensorrt.stream_priority: must be one of ['normal', 'high']"),
        ({"tensorrt": {"hardware_compatibility": "turing"}}, "tensorrt.hardware_compatibility: must be one of"),
        ({"tensorrt": {"build_on_start": "yes"}}, "tensorrt.build_on_start: must be true or false"),
        ({"tensorrt": {"quantized_model": "q.onnx"}}, "tensorrt.quantized_model: only used with precision: int8"),
        (
            {"tensorrt": {"precision": "int8", "quantized_model": "../other/q.onnx"}},
            "must name a file inside the version directory",
        ),
        ({"tensorrt": {"profiles": []}}, "tensorrt.profiles: must be a non-empty list"),
        (
            {"tensorrt": {"profiles": [{"min": {"x": [1, 4]}, "max": {"x": [8, 4]}}]}},
            "tensorrt.profiles[0]: lacks opt",
        ),
        (
            {"tensorrt": {"profiles": [{"min": {"x": [4, 4]}, "opt": {"x": [2, 4]}, "max": {"x": [8, 4]}}]}},
            "tensorrt.profiles[0]: input 'x': needs min <= opt <= max in every dimension",
        ),
        (
            {"tensorrt": {"profiles": [{"min": {"x": [1, 4]}, "opt": {"y": [2, 4]}, "max": {"x": [8, 4]}}]}},
            "tensorrt.profiles[0]: opt: names ['y'], but min names ['x']",
        ),
        (
            {"tensorrt": {"profiles": [{"min": {"x": [1]}, "opt": {"x": [2, 4]}, "max": {"x": [8, 4]}}]}},
            "must have the same rank",
        ),
        ({"tensorrt": {"profiles": [{"min": {"x": ["1"]}}]}}, "tensorrt.profiles[0].min.x: must be a list of integers"),
        (
            {"tensorrt": {}, "backend": "onnxruntime"},
            "tensorrt: configures backend tensorrt, but backend is onnxruntime",
        ),
        (
            {"onnxruntime": {"tensorrt": {"fp16": True}}, "backend": "tensorrt"},
            "onnxruntime: configures backend onnxruntime, but backend is tensorrt",
        ),
        ({"onnxruntime": {"tensorrt": {"engine_cache": "x"}}}, "onnxruntime.tensorrt.engine_cache: unknown field"),
    ],
)
def test_a_bad_tensorrt_setting_names_the_field_and_the_problem(settings: dict[str, Any], message: str) -> None:
    data = {"backend": "tensorrt", "max_batch_size": 8, **settings}
    if "onnxruntime" in settings and "backend" not in settings:
        data["backend"] = "onnxruntime"

    with pytest.raises(ConfigError) as caught:
        ModelConfig.from_mapping(data)

    assert message in str(caught.value)


# --- profiles ----------------------------------------------------------------------------------------------------


def test_without_configured_profiles_the_batch_dimension_spans_one_to_max_batch_size_tuned_for_the_max() -> None:
    (profile,) = resolve_profiles((), (X, InputShape("mask", (-1, 4, 4))), max_batch_size=8)

    assert profile.to_json() == {"mask": [[1, 4, 4], [8, 4, 4], [8, 4, 4]], "x": [[1, 4], [8, 4], [8, 4]]}
    assert (profile.min_batch, profile.max_batch, profile.dynamic) == (1, 8, True)


def test_configured_profiles_become_min_opt_max_per_dynamic_input() -> None:
    image = InputShape("image", (-1, 3, -1, -1))
    loaded = config(
        profiles=[
            {
                "min": {"image": [1, 3, 224, 224]},
                "opt": {"image": [4, 3, 224, 224]},
                "max": {"image": [8, 3, 512, 512]},
            },
            {
                "min": {"image": [1, 3, 1024, 1024]},
                "opt": {"image": [1, 3, 1024, 1024]},
                "max": {"image": [2, 3, 1024, 1024]},
            },
        ]
    )

    profiles = resolve_profiles(loaded.trt.profiles, (image, InputShape("scale", (1,))), max_batch_size=8)

    assert [p.range_of("image") for p in profiles] == [
        ((1, 3, 224, 224), (4, 3, 224, 224), (8, 3, 512, 512)),
        ((1, 3, 1024, 1024), (1, 3, 1024, 1024), (2, 3, 1024, 1024)),
    ]
    assert profiles[0].range_of("scale") is None  # static inputs need no profile shapes
    assert profile_from_json(profiles[1].to_json()) == profiles[1]


@pytest.mark.parametrize(
    ("inputs", "profiles", "message"),
    [
        ((InputShape("image", (-1, 3, -1, -1)),), [], "input 'image' has dynamic dimension 2"),
        (
            (X,),
            [{"min": {"y": [1, 4]}, "opt": {"y": [1, 4]}, "max": {"y": [1, 4]}}],
            "'y' is not an input of the model (inputs: ['x'])",
        ),
        (
            (X, InputShape("mask", (-1, 4))),
            [{"min": {"x": [1, 4]}, "opt": {"x": [1, 4]}, "max": {"x": [8, 4]}}],
            "lacks shapes for input 'mask'",
        ),
        ((X,), [{"min": {"x": [1, 2]}, "opt": {"x": [1, 2]}, "max": {"x": [8, 2]}}], "dimension 1 is fixed at 4"),
        ((X,), [{"min": {"x": [1]}, "opt": {"x": [1]}, "max": {"x": [8]}}], "has rank 2"),
        ((X,), [{"min": {"x": [2, 4]}, "opt": {"x": [4, 4]}, "max": {"x": [8, 4]}}], "accepts a batch of 1"),
        ((X,), [{"min": {"x": [0, 4]}, "opt": {"x": [4, 4]}, "max": {"x": [8, 4]}}], "min must be >= 1"),
    ],
)
def test_profiles_that_do_not_fit_the_model_are_refused(
    inputs: tuple[InputShape, ...], profiles: list[dict[str, Any]], message: str
) -> None:
    configured = config(profiles=profiles).trt.profiles if profiles else ()

    with pytest.raises(ConfigError) as caught:
        resolve_profiles(configured, inputs, max_batch_size=8)

    assert message in str(caught.value)


def test_a_model_without_a_batch_dimension_needs_configured_profiles_for_dynamic_inputs() -> None:
    with pytest.raises(ConfigError, match="list its min/opt/max shapes"):
        resolve_profiles((), (InputShape("tokens", (-1,)),), max_batch_size=0)
    assert resolve_profiles((), (InputShape("x", (2, 4)),), max_batch_size=0) == (Profile(()),)


def two_profiles() -> tuple[Profile, ...]:
    small = {"min": {"x": [1, 4]}, "opt": {"x": [2, 4]}, "max": {"x": [4, 4]}}
    large = {"min": {"x": [1, 8]}, "opt": {"x": [2, 8]}, "max": {"x": [2, 8]}}
    configured = config(profiles=[small, large]).trt.profiles
    return resolve_profiles(configured, (InputShape("x", (-1, -1)),), max_batch_size=8)


def test_a_batch_runs_on_the_first_profile_that_takes_it_and_larger_batches_are_split() -> None:
    profiles = two_profiles()

    assert plan_chunks(profiles, {"x": (3, 4)}, batched=True) == [(0, 0, 3)]
    assert plan_chunks(profiles, {"x": (2, 8)}, batched=True) == [(1, 0, 2)]
    assert plan_chunks(profiles, {"x": (7, 8)}, batched=True) == [(1, 0, 2), (1, 2, 4), (1, 4, 6), (1, 6, 7)]
    assert plan_chunks(profiles, {"x": (8, 4)}, batched=True) == [(0, 0, 4), (0, 4, 8)]
    assert batch_split_warning(profiles, max_batch_size=8) is not None
    assert batch_split_warning(profiles, max_batch_size=4) is None


def test_a_request_whose_shape_no_profile_takes_is_refused_naming_the_tensor_and_the_ranges() -> None:
    profiles = two_profiles()

    check_shapes(profiles, {"x": (8, 4)}, batched=True)  # the batch dimension is split, never refused
    with pytest.raises(InvalidInput) as caught:
        check_shapes(profiles, {"x": (1, 6)}, batched=True)
    with pytest.raises(InvalidInput):
        plan_chunks(profiles, {"x": (1, 6)}, batched=True)

    assert str(caught.value) == (
        "input 'x': shape [1, 6] is outside the engine's optimisation profiles (allowed: [*, 4] or [*, 8])"
    )


def test_profiles_render_as_onnxruntime_tensorrt_provider_options() -> None:
    (profile,) = resolve_profiles((), (X, InputShape("mask", (-1, 2))), max_batch_size=8)

    assert profile.ort_options() == {
        "trt_profile_min_shapes": "mask:1x2,x:1x4",
        "trt_profile_opt_shapes": "mask:8x2,x:8x4",
        "trt_profile_max_shapes": "mask:8x2,x:8x4",
    }


# --- cache key and tag -------------------------------------------------------------------------------------------


def test_the_tag_names_model_version_precision_and_whether_shapes_are_dynamic() -> None:
    static = resolve_profiles((), (InputShape("x", (2, 4)),), max_batch_size=0)

    assert spec().tag == "resnet-v2-fp16-dyn"
    assert spec(precision="int8", profiles=static).tag == "resnet-v2-int8-static"


def test_the_key_is_stable_and_readable() -> None:
    key = engine_key(spec(), L4)

    assert key == engine_key(spec(), L4)
    assert key.directory_name == f"fp16-dyn-sm89-trt11.4.0.106-{key.key_id}"
    assert key.fields == {
        "tensorrt": "11.4.0.106",
        "gpu": "NVIDIA L4",
        "compute_capability": "8.9",
        "hardware_compatibility": "none",
        "version_compatible": False,
        "precision": "fp16",
        "profiles": [{"x": [[1, 4], [8, 4], [8, 4]]}],
        "onnx_sha256": "ab" * 32,
    }
    assert "TensorRT 11.4.0.106, GPU NVIDIA L4 sm 8.9" in describe_key(key)


@pytest.mark.parametrize(
    ("change", "device"),
    [
        ({}, DeviceFacts(tensorrt_version="11.3.0.99", gpu_name="NVIDIA L4", compute_capability=(8, 9))),
        ({}, DeviceFacts(tensorrt_version="11.4.0.106", gpu_name="NVIDIA A10", compute_capability=(8, 6))),
        ({}, DeviceFacts(tensorrt_version="11.4.0.106", gpu_name="NVIDIA L40S", compute_capability=(8, 9))),
        ({"precision": "fp32"}, L4),
        ({"precision_mode": "builder_flags"}, L4),
        ({"onnx_sha256": "cd" * 32}, L4),
        ({"profiles": resolve_profiles((), (X,), max_batch_size=16)}, L4),
        ({"hardware_compatibility": "same_cc"}, L4),
        ({"version_compatible": True}, L4),
    ],
    ids=["tensorrt", "gpu+cc", "gpu", "precision", "precision mode", "onnx", "profile", "hw compat", "version compat"],
)
def test_everything_that_makes_an_engine_unusable_changes_the_key(change: dict[str, Any], device: DeviceFacts) -> None:
    assert engine_key(spec(**change), device).key_id != engine_key(spec(), L4).key_id


def test_portable_engines_are_keyed_by_their_compatibility_not_by_one_gpu_or_release() -> None:
    hopper = DeviceFacts(tensorrt_version="11.4.0.106", gpu_name="NVIDIA H100", compute_capability=(9, 0))
    later = DeviceFacts(tensorrt_version="11.5.0.1", gpu_name="NVIDIA L4", compute_capability=(8, 9))
    l40s = DeviceFacts(tensorrt_version="11.4.0.106", gpu_name="NVIDIA L40S", compute_capability=(8, 9))
    ampere_plus = spec(hardware_compatibility="ampere_plus")
    same_cc = spec(hardware_compatibility="same_cc")
    portable = spec(version_compatible=True)

    assert engine_key(ampere_plus, hopper) == engine_key(ampere_plus, L4)
    assert engine_key(ampere_plus, L4).directory_name.startswith("fp16-dyn-sm80plus-trt11.4.0.106-")
    assert engine_key(same_cc, l40s) == engine_key(same_cc, L4)
    assert engine_key(same_cc, hopper) != engine_key(same_cc, L4)
    assert engine_key(portable, later) == engine_key(portable, L4)
    assert engine_key(portable, L4).directory_name.startswith("fp16-dyn-sm89-trt11vc-")


# --- the cache: store, load, refuse -----------------------------------------------------------------------------


def stored(tmp_path: Path, engine_spec: EngineSpec, built_on: DeviceFacts) -> EngineCache:
    cache = EngineCache(tmp_path / "engines")
    key = engine_key(engine_spec, built_on)
    cache.store(key, b"PLAN", build_record(engine_spec, key, built_on, build_seconds=1.5))
    return cache


def test_a_stored_engine_loads_on_the_same_gpu_and_tensorrt(tmp_path: Path) -> None:
    cache = stored(tmp_path, spec(), L4)

    found = cache.load(engine_key(spec(), L4), L4)

    assert found is not None
    plan, record = found
    assert plan == b"PLAN"
    assert record["tag"] == "resnet-v2-fp16-dyn"
    assert record["built_with"] == {
        "tensorrt_version": "11.4.0.106",
        "gpu_name": "NVIDIA L4",
        "compute_capability": [8, 9],
    }
    assert cache.entries() == [cache.path_of(engine_key(spec(), L4))]


def test_no_engine_for_another_gpu_is_found_under_this_gpus_key(tmp_path: Path) -> None:
    a100 = DeviceFacts(tensorrt_version="11.4.0.106", gpu_name="NVIDIA A100", compute_capability=(8, 0))
    cache = stored(tmp_path, spec(), a100)

    assert cache.load(engine_key(spec(), L4), L4) is None


@pytest.mark.parametrize(
    ("built_on", "message"),
    [
        (
            DeviceFacts(tensorrt_version="10.8.0.43", gpu_name="NVIDIA L4", compute_capability=(8, 9)),
            "engine built with TensorRT 10.8.0.43, this worker has TensorRT 11.4.0.106",
        ),
        (
            DeviceFacts(tensorrt_version="11.4.0.106", gpu_name="NVIDIA A100", compute_capability=(8, 0)),
            "engine built for compute capability 8.0, this GPU (NVIDIA L4) is 8.9",
        ),
        (
            DeviceFacts(tensorrt_version="11.4.0.106", gpu_name="NVIDIA L40S", compute_capability=(8, 9)),
            "engine built on a NVIDIA L40S, this GPU is a NVIDIA L4",
        ),
    ],
)
def test_an_engine_built_elsewhere_and_copied_under_this_key_is_refused(
    tmp_path: Path, built_on: DeviceFacts, message: str
) -> None:
    """A plan moved by hand into this GPU's directory: engine.json still says where it was built."""
    key = engine_key(spec(), L4)
    cache = EngineCache(tmp_path / "engines")
    record = build_record(spec(), key, built_on, build_seconds=1.0)
    cache.store(key, b"PLAN", record)

    with pytest.raises(EngineMismatch) as caught:
        cache.load(key, L4)

    assert message in str(caught.value)
    assert str(cache.path_of(key)) in str(caught.value)


def test_an_engine_record_for_another_key_or_without_a_record_is_refused(tmp_path: Path) -> None:
    key = engine_key(spec(), L4)
    other = spec(onnx_sha256="cd" * 32)
    cache = EngineCache(tmp_path / "engines")
    cache.store(key, b"PLAN", build_record(other, engine_key(other, L4), L4, build_seconds=1.0))

    with pytest.raises(EngineMismatch, match="written for another key \\(differs in onnx_sha256\\)"):
        cache.load(key, L4)
    (cache.path_of(key) / "engine.json").unlink()
    with pytest.raises(EngineMismatch, match="no engine.json; refusing an engine of unknown origin"):
        cache.load(key, L4)


def test_compatible_engines_load_where_their_compatibility_reaches_and_nowhere_else(tmp_path: Path) -> None:
    turing = DeviceFacts(tensorrt_version="11.4.0.106", gpu_name="Tesla T4", compute_capability=(7, 5))
    older = DeviceFacts(tensorrt_version="11.3.0.99", gpu_name="NVIDIA L4", compute_capability=(8, 9))
    newer = DeviceFacts(tensorrt_version="11.5.0.1", gpu_name="NVIDIA L4", compute_capability=(8, 9))
    ampere_plus = spec(hardware_compatibility="ampere_plus")
    portable = spec(version_compatible=True)
    cache = stored(tmp_path / "hw", ampere_plus, L4)
    vc_cache = stored(tmp_path / "vc", portable, L4)

    assert cache.load(engine_key(ampere_plus, L4), L4) is not None
    with pytest.raises(EngineMismatch, match="hardware compatible from Ampere"):
        cache.load(engine_key(ampere_plus, turing), turing)
    assert vc_cache.load(engine_key(portable, newer), newer) is not None
    with pytest.raises(EngineMismatch, match="needs the same major version, not older"):
        vc_cache.load(engine_key(portable, older), older)


def test_the_timing_cache_is_named_for_the_tensorrt_version_and_gpu(tmp_path: Path) -> None:
    path = EngineCache(tmp_path).timing_cache_path(L4)

    assert path.name == "timing-trt11.4.0.106-nvidia-l4-sm89.cache"


def test_the_spec_comes_from_config_yaml_and_the_onnx_files_sha256(tmp_path: Path) -> None:
    directory = tmp_path / "affine" / "v1"
    affine_model(directory / "model.onnx", scale=2.0, bias=0.5)
    loaded = config(precision="fp16")

    resolved = resolve_spec(directory, loaded, model="affine", version="v1")

    assert resolved.spec.tag == "affine-v1-fp16-dyn"
    assert resolved.inputs == (InputShape("x", (-1, 4)),)
    assert resolved.spec.profiles[0].to_json() == {"x": [[1, 4], [8, 4], [8, 4]]}
    affine_model(directory / "model.onnx", scale=3.0, bias=0.5)
    changed = resolve_spec(directory, loaded, model="affine", version="v1")
    assert changed.spec.onnx_sha256 != resolved.spec.onnx_sha256
    json.dumps(engine_key(resolved.spec, L4).fields)  # the key is plain JSON


# --- onnxruntime's TensorRT execution provider ------------------------------------------------------------------


def test_the_onnxruntime_tensorrt_section_becomes_execution_provider_options(tmp_path: Path) -> None:
    from splitstream.worker.backends.onnxruntime import tensorrt_provider_options

    loaded = ModelConfig.from_mapping(
        {
            "backend": "onnxruntime",
            "max_batch_size": 8,
            "execution_providers": ["tensorrt", "cuda", "cpu"],
            "onnxruntime": {
                "tensorrt": {
                    "engine_cache_path": "trt-ep-cache",
                    "timing_cache_path": "trt-ep-timing",
                    "fp16": True,
                    "workspace_bytes": 1 << 30,
                    "profile": {"min": {"x": [1, 4]}, "opt": {"x": [4, 4]}, "max": {"x": [8, 4]}},
                }
            },
        }
    )

    options = tensorrt_provider_options(loaded.ort.tensorrt, tmp_path)

    assert options == {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(tmp_path / "trt-ep-cache"),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(tmp_path / "trt-ep-timing"),
        "trt_fp16_enable": "True",
        "trt_max_workspace_size": str(1 << 30),
        "trt_profile_min_shapes": "x:1x4",
        "trt_profile_opt_shapes": "x:4x4",
        "trt_profile_max_shapes": "x:8x4",
    }
    assert tensorrt_provider_options(ModelConfig.from_mapping({"backend": "onnxruntime"}).ort.tensorrt, tmp_path) == {}
