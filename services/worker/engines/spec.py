"""What engine a model version wants: config.yaml + its ONNX file → :class:`EngineSpec` (no TensorRT needed).

The worker and ``splitstream-build-engine`` both call :func:`resolve_spec`,
so the key the builder stores an engine under is exactly the key a worker
looks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitstream.worker.config import ModelConfig
from splitstream.worker.engines.cache import EngineSpec
from splitstream.worker.engines.precision import onnx_inputs, sha256_of, source_onnx
from splitstream.worker.engines.profiles import InputShape, resolve_profiles

ENGINES_DIR = "engines"


@dataclass(frozen=True)
class ResolvedSpec:
    spec: EngineSpec
    #: The ONNX file the precision step starts from (model.onnx, or the Q/DQ model for int8).
    source: Path
    inputs: tuple[InputShape, ...]


def resolve_spec(directory: Path, config: ModelConfig, *, model: str, version: str) -> ResolvedSpec:
    """The engine ``<repo>/<model>/<version>/`` (``directory``) needs; raises ConfigError naming the problem."""
    trt = config.trt
    source = source_onnx(directory, trt.precision, trt.quantized_model)
    inputs = onnx_inputs(source)
    profiles = resolve_profiles(trt.profiles, inputs, max_batch_size=config.max_batch_size)
    spec = EngineSpec(
        model=model,
        version=version,
        precision=trt.precision,
        precision_mode=trt.precision_mode,
        profiles=profiles,
        onnx_sha256=sha256_of(source),
        hardware_compatibility=trt.hardware_compatibility,
        version_compatible=trt.version_compatible,
    )
    return ResolvedSpec(spec=spec, source=source, inputs=inputs)
