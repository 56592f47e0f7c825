"""Tiny ONNX models the tests build themselves with onnx.helper."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper


def save_graph(graph: onnx.GraphProto, path: Path, *, check: bool = True) -> Path:
    """Wrap ``graph`` in an opset-17 model (checked with onnx.checker unless told not to) and save it."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if check:
        onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def affine_model(path: Path, *, scale: float, bias: float, features: int = 4, score: bool = False) -> Path:
    """``y = x * scale + bias`` and ``label = argmax(y, axis=1)``; x is FP32 [batch, features].
    With ``score``, a third output ``score = sum(y, axis=1)`` (FP32 [batch]), for tests that
    need an output to treat apart from the other two (e.g. redact two, compare one).

    Two versions that differ only in ``scale``/``bias`` give outputs that differ in a
    known way, which routing and replay tests rely on.
    """
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", features])
    label = helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"])
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "bias"], ["y"]),
        helper.make_node("ArgMax", ["y"], ["label"], axis=1, keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(np.array(scale, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.array(bias, dtype=np.float32), "bias"),
    ]
    outputs = [y, label]
    if score:
        nodes.append(helper.make_node("ReduceSum", ["y", "score_axes"], ["score"], keepdims=0))
        inits.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "score_axes"))
        outputs.append(helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch"]))
    graph = helper.make_graph(nodes, "affine", [x], outputs, initializer=inits)
    return save_graph(graph, path)


def add_version(
    repository: Path,
    model: str,
    version: str,
    *,
    scale: float,
    bias: float = 0.0,
    config: dict[str, Any] | None = None,
    score: bool = False,
) -> Path:
    """Lay out ``<repository>/<model>/<version>/{model.onnx,config.yaml}``."""
    directory = repository / model / version
    affine_model(directory / "model.onnx", scale=scale, bias=bias, score=score)
    settings = {"backend": "onnxruntime", "max_batch_size": 8, "dynamic_batching": {"max_queue_delay_us": 500}}
    settings.update(config or {})
    (directory / "config.yaml").write_text(yaml.safe_dump(settings))
    return directory


def faulty_affine_model(path: Path, *, scale: float, features: int = 4) -> Path:
    """Like :func:`affine_model` (``bias`` 0), but the run fails for inputs whose largest value is >= 1.

    The failure is a real onnxruntime error (Gather index out of bounds), so the worker
    answers INTERNAL exactly as for a model that breaks on some inputs. Warm-up (zeros) passes.
    """
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", features])
    label = helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"])
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["largest"], keepdims=0),
        helper.make_node("Cast", ["largest"], ["index"], to=TensorProto.INT64),
        helper.make_node("Gather", ["zero", "index"], ["nothing"], axis=0),  # only index 0 (or -1) exists
        helper.make_node("Mul", ["x", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "nothing"], ["y"]),
        helper.make_node("ArgMax", ["y"], ["label"], axis=1, keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(np.array(scale, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.zeros(1, dtype=np.float32), "zero"),
    ]
    graph = helper.make_graph(nodes, "faulty_affine", [x], [y, label], initializer=inits)
    return save_graph(graph, path)


def add_faulty_version(repository: Path, model: str, version: str, *, scale: float) -> Path:
    """A version laid out like :func:`add_version` whose model fails on inputs with a value >= 1."""
    directory = repository / model / version
    faulty_affine_model(directory / "model.onnx", scale=scale)
    settings = {"backend": "onnxruntime", "max_batch_size": 8, "dynamic_batching": {"max_queue_delay_us": 500}}
    (directory / "config.yaml").write_text(yaml.safe_dump(settings))
    return directory
