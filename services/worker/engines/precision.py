"""The precision step: the ONNX the TensorRT builder consumes, made before and apart from the build.

TensorRT 11 removed the FP16/INT8 builder flags: every network is strongly
typed, so reduced precision must be in the graph itself. This step puts it
there, and the builder treats the graph's types as the truth on 10.x and 11.x
alike:

- ``fp32``: ``model.onnx`` as it is.
- ``fp16``: ``model.onnx`` converted with ONNX Runtime's float16 converter
  (``onnxruntime.transformers.float16``, a maintained fork of
  onnxconverter-common's, shipped inside the onnxruntime package the worker
  already depends on). Inputs and outputs stay FP32 (``keep_io_types``), so
  the served metadata, clients and recorded traffic do not change with the
  precision; the converter inserts the casts. Ops it knows to be unsafe in
  FP16 stay FP32.
- ``int8``: an explicitly quantised model (QuantizeLinear/DequantizeLinear
  nodes), made offline from a representative data set by NVIDIA ModelOpt or
  ``onnxruntime.quantization.quantize_static(..., quant_format=QDQ)``.
  Implicit calibration (``IInt8EntropyCalibrator2``) is gone from TensorRT;
  a model without Q/DQ nodes is refused here, not silently built as FP32.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx

from splitstream.common.errors import ConfigError
from splitstream.worker.engines.profiles import InputShape
from splitstream.worker.metadata import DYNAMIC

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_onnx(directory: Path, precision: str, quantized_model: str | None) -> Path:
    """The ONNX file the precision step starts from (and whose SHA-256 keys the engine)."""
    name = quantized_model if precision == "int8" and quantized_model else "model.onnx"
    path = directory / name
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    return path


def onnx_inputs(path: Path) -> tuple[InputShape, ...]:
    """The graph's real inputs (initializers excluded), symbolic or unknown dimensions as ``-1``."""
    model = onnx.load(str(path), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        shape = tuple(dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else DYNAMIC for dim in dims)
        inputs.append(InputShape(value.name, shape))
    return tuple(inputs)


def has_qdq(model: onnx.ModelProto) -> bool:
    """True when the main graph or a subgraph holds Q/DQ nodes (an explicitly quantised model)."""
    return any(node.op_type in QDQ_OPS for node in _all_nodes(model.graph))


def _all_nodes(graph: onnx.GraphProto):  # type: ignore[no-untyped-def]
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from _all_nodes(subgraph)


def convert_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with FP32 weights and computation in FP16, inputs and outputs kept FP32."""
    # Imported here: the module is only needed for this step (it ships in the onnxruntime wheel).
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(model, keep_io_types=True)
    # The converter appends the casts it inserts after the nodes that read them; ONNX requires
    # (and onnx.checker enforces) topological order.
    sort_topologically(converted.graph)
    onnx.checker.check_model(converted)
    return converted


def sort_topologically(graph: onnx.GraphProto) -> None:
    """Reorder ``graph``'s nodes so each comes after the producers of its inputs, otherwise keeping their order.

    Inputs a node's subgraphs read from the enclosing graph count as its
    inputs. Raises ConfigError for a cycle or an input nothing produces.
    """
    available = {value.name for value in graph.input} | {init.name for init in graph.initializer} | {""}
    available |= {init.values.name for init in graph.sparse_initializer}
    pending = list(graph.node)
    needs = [set(node.input) | _outer_names(node) for node in pending]
    ordered: list[onnx.NodeProto] = []
    while pending:
        ready = [i for i, node in enumerate(pending) if needs[i] <= available]
        if not ready:
            missing = sorted(needs[0] - available)
            raise ConfigError(f"the converted graph is not a DAG: node '{pending[0].name}' waits for {missing}")
        for i in ready:
            ordered.append(pending[i])
            available.update(pending[i].output)
        keep = set(range(len(pending))) - set(ready)
        pending = [pending[i] for i in sorted(keep)]
        needs = [needs[i] for i in sorted(keep)]
    del graph.node[:]
    graph.node.extend(ordered)


def _outer_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs use but do not define themselves (they come from the enclosing graph)."""
    names: set[str] = set()
    for attribute in node.attribute:
        subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for subgraph in subgraphs:
            defined = {v.name for v in subgraph.input} | {i.name for i in subgraph.initializer}
            for inner in subgraph.node:
                defined.update(inner.output)
            for inner in subgraph.node:
                names.update(name for name in inner.input if name and name not in defined)
                names.update(_outer_names(inner) - defined)
    return names


def prepare_onnx(source: Path, precision: str, destination: Path, *, precision_mode: str = "onnx") -> Path:
    """The ONNX file the builder consumes for ``precision``: ``source`` itself, or a converted copy at ``destination``.

    Only fp16 in ``onnx`` mode writes a new file; fp32 and int8 build from
    ``source`` as it is (so external weight files next to it keep working).
    With ``precision_mode: builder_flags`` (TensorRT 10.x) the graph stays as
    it is and the builder's flags choose the precision; int8 still needs Q/DQ
    nodes. Raises ConfigError saying what to do when the input cannot serve.
    """
    if precision == "int8":
        if not has_qdq(onnx.load(str(source), load_external_data=False)):
            raise ConfigError(
                f"{source}: precision int8 needs an explicitly quantised model (QuantizeLinear/DequantizeLinear "
                "nodes); make one from calibration data with NVIDIA ModelOpt or onnxruntime.quantization."
                "quantize_static(quant_format=QDQ) and name it in tensorrt.quantized_model"
            )
        return source
    if precision == "fp16" and precision_mode == "onnx":
        destination.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(convert_fp16(onnx.load(str(source))), str(destination))
        return destination
    if precision not in ("fp32", "fp16"):
        raise ConfigError(f"precision {precision!r}: unknown")
    return source
