"""The MLP the batching bench and the GPU smoke test serve: one graph, so their numbers are of the same model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp_model(path: Path, *, width: int, layers: int, seed: int = 0) -> None:
    """``x [batch, width]`` through ``layers`` MatMul+Relu to ``y``, FP32; weights from ``seed``."""
    rng = np.random.default_rng(seed)
    nodes = []
    inits = []
    current = "x"
    for i in range(layers):
        weights = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(weights, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"m{i}"]))
        out = "y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("Relu", [f"m{i}"], [out]))
        current = out
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
    model = helper.make_model(
        helper.make_graph(nodes, "mlp", [x], [y], initializer=inits), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
