"""The precision step, on CPU: the ONNX the TensorRT builder consumes for fp32, fp16 and int8."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from splitstream.common.errors import ConfigError
from splitstream.worker.engines.precision import has_qdq, prepare_onnx, source_onnx
from tests.models import affine_model, save_graph

FEATURES = 16


def mlp_model(path: Path, *, seed: int = 7) -> Path:
    """``softmax(relu(x @ W1 + b1) @ W2 + b2)`` and ``argmax``; x is FP32 [batch, 16]."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((FEATURES, 32)).astype(np.float32) / 4
    w2 = rng.standard_normal((32, 8)).astype(np.float32) / 4
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])
    probs = helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 8])
    label = helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"])
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["a"]),
        helper.make_node("MatMul", ["a", "w2"], ["z"]),
        helper.make_node("Add", ["z", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(rng.standard_normal(32).astype(np.float32) / 4, "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) / 4, "b2"),
    ]
    graph = helper.make_graph(nodes, "mlp", [x], [probs, label], initializer=inits)
    return save_graph(graph, path)


def run(path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, {"x": x}), strict=True))


def elem_types(values: list[onnx.ValueInfoProto]) -> dict[str, int]:
    return {value.name: value.type.tensor_type.elem_type for value in values}


def wide_affine_model(path: Path) -> Path:
    return affine_model(path, scale=2.0, bias=0.5, features=FEATURES)


@pytest.mark.parametrize("build", [mlp_model, wide_affine_model])
def test_fp16_produces_a_valid_onnx_model_whose_outputs_stay_within_fp16_tolerance(
    tmp_path: Path, build: Callable[[Path], Path]
) -> None:
    source = build(tmp_path / "model.onnx")
    x = np.random.default_rng(3).standard_normal((64, FEATURES)).astype(np.float32)

    prepared = prepare_onnx(source, "fp16", tmp_path / "out" / "model.fp16.onnx")

    assert prepared == tmp_path / "out" / "model.fp16.onnx"
    model = onnx.load(str(prepared))
    onnx.checker.check_model(model, full_check=True)
    original, model_input = onnx.load(str(source)), model.graph.input
    # Inputs and outputs keep their types (FP32 stays FP32): clients and metadata do not change.
    assert elem_types(list(model_input)) == elem_types(list(original.graph.input))
    assert elem_types(list(model.graph.output)) == elem_types(list(original.graph.output))
    # The weights really are FP16 now.
    assert {init.data_type for init in model.graph.initializer} == {TensorProto.FLOAT16}
    expected, actual = run(source, x), run(prepared, x)
    for name, want in expected.items():
        if want.dtype.kind == "f":
            np.testing.assert_allclose(actual[name], want, rtol=1e-2, atol=2e-3, err_msg=name)
            assert actual[name].dtype == np.float32
    if "label" in expected:
        # Argmax may only flip where the two best logits are within FP16 rounding of each other.
        assert np.mean(actual["label"] == expected["label"]) >= 0.95


def test_fp32_and_builder_flag_modes_build_from_the_model_as_it_is(tmp_path: Path) -> None:
    source = mlp_model(tmp_path / "model.onnx")

    assert prepare_onnx(source, "fp32", tmp_path / "unused.onnx") == source
    assert prepare_onnx(source, "fp16", tmp_path / "unused.onnx", precision_mode="builder_flags") == source
    assert not (tmp_path / "unused.onnx").exists()


def test_int8_refuses_a_model_without_quantize_dequantize_nodes(tmp_path: Path) -> None:
    source = mlp_model(tmp_path / "model.onnx")

    with pytest.raises(ConfigError) as caught:
        prepare_onnx(source, "int8", tmp_path / "unused.onnx")

    assert "precision int8 needs an explicitly quantised model (QuantizeLinear/DequantizeLinear nodes)" in str(
        caught.value
    )
    assert "tensorrt.quantized_model" in str(caught.value)


def test_int8_builds_from_an_explicitly_quantised_qdq_model(tmp_path: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    source = mlp_model(tmp_path / "model.onnx")
    quantized = tmp_path / "model.qdq.onnx"
    samples = [{"x": np.random.default_rng(i).standard_normal((1, FEATURES)).astype(np.float32)} for i in range(8)]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._items = iter(samples)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._items, None)

    # TensorRT's explicit quantisation wants symmetric INT8 for weights and activations.
    quantize_static(
        str(source),
        str(quantized),
        Reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )

    assert has_qdq(onnx.load(str(quantized)))
    assert source_onnx(tmp_path, "int8", "model.qdq.onnx") == quantized
    assert prepare_onnx(quantized, "int8", tmp_path / "unused.onnx") == quantized
    with pytest.raises(ConfigError, match="no such file"):
        source_onnx(tmp_path, "int8", "missing.onnx")
