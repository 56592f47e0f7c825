"""A model's config.yaml is a pydantic schema: any value anywhere is a ModelConfig or a one-line ConfigError.

Before, a config.yaml that was not UTF-8 escaped the hand-written checks as UnicodeDecodeError: a
traceback and exit 1 from the worker instead of exit 2 and one line.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitstream.common.errors import ConfigError
from splitstream.worker.config import ModelConfig
from tests import launcher
from tests.fuzzing import all_paths
from tests.harness import ROOT
from tests.models import add_version

FULL: dict[str, Any] = {
    "backend": "tensorrt",
    "max_batch_size": 8,
    "dynamic_batching": {"enabled": True, "max_queue_delay_us": 500},
    "instance_count": 1,
    "intra_op_threads": 1,
    "execution_providers": ["tensorrt", "cpu"],
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
    "tensorrt": {
        "precision": "int8",
        "precision_mode": "onnx",
        "quantized_model": "model.qdq.onnx",
        "profiles": [{"min": {"x": [1, 4]}, "opt": {"x": [8, 4]}, "max": {"x": [8, 4]}}],
        "workspace_bytes": 1 << 30,
        "contexts": 2,
        "stream_priority": "high",
        "build_on_start": False,
        "hardware_compatibility": "none",
        "version_compatible": False,
        "timing_cache": True,
    },
}
ONNXRUNTIME: dict[str, Any] = {
    "backend": "onnxruntime",
    "onnxruntime": {
        "tensorrt": {
            "engine_cache_path": "cache",
            "timing_cache_path": "cache",
            "fp16": True,
            "workspace_bytes": 1024,
            "profile": {"min": {"x": [1, 4]}, "opt": {"x": [8, 4]}, "max": {"x": [8, 4]}},
        }
    },
}


def replaced(document: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    result = copy.deepcopy(document)
    target: Any = result
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return result


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
GENERATION: dict[str, Any] = {
    "backend": "onnxruntime",
    "max_batch_size": 64,
    "generation": {"max_tokens_limit": 512, "pad_id": 32},
}
PATHS = [(document, path) for document in (FULL, ONNXRUNTIME, GENERATION) for path in all_paths(document)]


def test_both_full_configs_are_valid() -> None:
    assert ModelConfig.from_mapping(FULL).trt.contexts == 2
    assert ModelConfig.from_mapping(ONNXRUNTIME).ort.tensorrt.profile is not None
    generation = ModelConfig.from_mapping(GENERATION).generation
    assert generation is not None
    assert generation.max_tokens_limit == 512


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dynamic_batching": {}}, "generation: replaces dynamic_batching"),
        ({"max_batch_size": 0}, "generation: needs max_batch_size > 0"),
        ({"instance_count": 2}, "generation: steps every sequence in one backend run at a time; instance_count must"),
        ({"generation": {"max_tokens_limit": 0}}, "generation.max_tokens_limit: must be an integer within 1..1000000"),
        ({"generation": {"pad_id": 256}}, "generation.pad_id: must be an integer within 0..255"),
    ],
)
def test_a_generation_config_that_cannot_work_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_mapping({**GENERATION, **change})


def test_a_worker_told_to_generate_with_a_graph_that_is_no_next_token_model_exits_2_naming_the_interface(
    tmp_path: Path,
) -> None:
    directory = add_version(tmp_path, "m", "v1", scale=1.0)
    (directory / "config.yaml").write_text("backend: onnxruntime\nmax_batch_size: 8\ngeneration: {}\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    flags = ["--model-repository", str(tmp_path), "--model", "m", "--version", "v1", "--port", "0"]
    result = launcher.run(
        [sys.executable, "-m", "splitstream.worker", *flags, "--metrics-port", "0"],
        env=clean,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()  # the model loads after logging started: the error is the last line
    assert lines[-1].startswith("splitstream-worker: error: "), result.stderr
    assert "generation: needs a graph with one input (INT64 [batch, n]" in lines[-1]


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(where=st.sampled_from(PATHS), value=yaml_values)
def test_any_value_anywhere_in_a_model_config_is_a_config_or_a_one_line_config_error(
    where: tuple[dict[str, Any], tuple[Any, ...]], value: Any
) -> None:
    base, path = where
    try:
        ModelConfig.from_mapping(replaced(base, path, value))
    except ConfigError as error:
        message = str(error)
    else:
        message = ""
    assert "\n" not in message


def test_a_worker_given_a_config_yaml_that_is_not_utf8_exits_2_with_one_line(tmp_path: Path) -> None:
    directory = add_version(tmp_path, "m", "v1", scale=1.0)
    (directory / "config.yaml").write_bytes(b"backend: onnxruntime\nmax_batch_size: \xff\xfe\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSTREAM_")}
    flags = [
        "--model-repository",
        str(tmp_path),
        "--model",
        "m",
        "--version",
        "v1",
        "--port",
        "0",
        "--metrics-port",
        "0",
    ]
    result = launcher.run(
        [sys.executable, "-m", "splitstream.worker", *flags],
        env=clean,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("splitstream-worker: error: ")
    assert "config.yaml: cannot read it" in lines[0]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("max_batch_size",), 10**20, "max_batch_size: must be an integer within 0..65536"),
        (
            ("dynamic_batching", "max_queue_delay_us"),
            99_999_999_999_999,
            "dynamic_batching.max_queue_delay_us: must be an integer within 0..10000000",
        ),
    ],
)
def test_huge_batch_sizes_and_queue_delays_are_refused_naming_the_field_and_its_bounds(
    path: tuple[str, ...], value: int, message: str
) -> None:
    """Found by probing: ``max_queue_delay_us: 99999999999999`` and a batch size of 10**20 were accepted."""
    document = copy.deepcopy(FULL)
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_mapping(document)


def test_the_largest_batch_size_and_queue_delay_are_accepted() -> None:
    document = copy.deepcopy(FULL)
    document["max_batch_size"] = 65_536
    document["dynamic_batching"]["max_queue_delay_us"] = 10_000_000
    config = ModelConfig.from_mapping(document)
    assert (config.max_batch_size, config.dynamic_batching.max_queue_delay_us) == (65_536, 10_000_000)
