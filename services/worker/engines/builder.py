"""Build a serialized TensorRT engine from a model version's ONNX and config (TensorRT 10.8+ and 11.x).

The steps, in TensorRT's current API (no ``EXPLICIT_BATCH``, no
``max_workspace_size``, no ``build_engine``, no calibrators):

1. Precision step (:mod:`.precision`): the ONNX the builder consumes.
2. ``builder.create_network(flags)``: on 10.x with ``precision_mode: onnx``
   the STRONGLY_TYPED flag, so the graph's types decide the precision exactly
   as TensorRT 11 always does (there the flag is deprecated and ignored, so
   none is passed); with ``builder_flags`` (10.x only) a weakly typed network
   and the FP16/INT8 builder flags, looked up by name behind a version check.
3. ``OnnxParser.parse_from_file``; on failure every parser error is reported.
4. Workspace via ``set_memory_pool_limit(MemoryPoolType.WORKSPACE, n)``.
5. One optimisation profile per configured profile (``set_shape`` for each
   input with a dynamic dimension).
6. Optional hardware compatibility (``AMPERE_PLUS``, ``SAME_COMPUTE_CAPABILITY``
   where this TensorRT has it) and the VERSION_COMPATIBLE flag.
7. Timing cache: read from ``engines/timing-...cache`` if present, used for
   the build and written back (it makes rebuilds of similar engines fast).
8. ``build_serialized_network``; a falsy result is a failure, reported with
   the errors TensorRT logged.

:func:`build_and_store` wraps it with the engine cache: it computes the same
key a worker looks for, skips the build when that entry exists, and stores
the plan with its ``engine.json``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from splitstream.common.errors import ConfigError
from splitstream.common.files import atomic_write
from splitstream.worker.config import ModelConfig
from splitstream.worker.engines.cache import EngineCache, build_record, engine_key
from splitstream.worker.engines.environment import TensorRTEnvironment
from splitstream.worker.engines.precision import prepare_onnx
from splitstream.worker.engines.profiles import Profile
from splitstream.worker.engines.spec import ENGINES_DIR, resolve_spec

#: TensorRT 10.x builder flags for precision_mode: builder_flags (gone in 11; looked up by name).
LEGACY_PRECISION_FLAGS = {"fp16": "FP16", "int8": "INT8"}
HARDWARE_LEVELS = {"ampere_plus": "AMPERE_PLUS", "same_cc": "SAME_COMPUTE_CAPABILITY"}
#: Errors TensorRT logged during a build, kept for the failure message.
KEPT_MESSAGES = 50


class BuildError(Exception):
    """TensorRT could not parse the model or build the engine; the message holds every error it gave."""


@dataclass(frozen=True)
class BuildOutcome:
    path: Path
    record: dict[str, Any]
    built: bool


def make_logger(trt: Any, log: structlog.stdlib.BoundLogger, *, verbose: bool = False) -> Any:
    """A ``trt.ILogger`` that forwards to ``log`` and keeps the errors for failure messages."""
    severity = trt.ILogger.Severity
    threshold = int(severity.INFO if verbose else severity.WARNING)
    errors_at = int(severity.ERROR)

    class CollectingLogger(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, level: Any, msg: str) -> None:
            if int(level) <= errors_at:
                self.errors.append(msg)
                del self.errors[:-KEPT_MESSAGES]
            if int(level) <= threshold:
                log.log(_LEVELS.get(int(level), 20), "tensorrt", message=msg)

    return CollectingLogger()


#: TensorRT severity (INTERNAL_ERROR=0 .. VERBOSE=4) → logging level.
_LEVELS = {0: 50, 1: 40, 2: 30, 3: 20, 4: 10}


def build_serialized(
    env: TensorRTEnvironment,
    onnx_path: Path,
    *,
    profiles: Sequence[Profile],
    precision: str,
    precision_mode: str,
    workspace_bytes: int | None,
    hardware_compatibility: str,
    version_compatible: bool,
    timing_cache_path: Path | None,
    log: structlog.stdlib.BoundLogger,
    verbose: bool = False,
) -> bytes:
    """The serialized engine for ``onnx_path`` (already through the precision step); raises BuildError."""
    trt = env.trt
    logger = make_logger(trt, log, verbose=verbose)
    builder = trt.Builder(logger)
    flags = 0
    if precision_mode == "builder_flags":
        if env.major >= 11:
            raise ConfigError(
                f"tensorrt.precision_mode builder_flags: TensorRT {env.device.tensorrt_version} has no FP16/INT8 "
                "builder flags (removed in 11); use precision_mode: onnx"
            )
    elif env.major < 11:
        # 10.x: make the graph's types binding, as 11 always does (where the flag is deprecated and ignored).
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(
            f"{onnx_path}: TensorRT's ONNX parser failed with {len(errors)} error(s):\n"
            + "\n".join(f"  {line}" for line in errors or logger.errors or ["(no error reported)"])
        )
    builder_config = builder.create_builder_config()
    if workspace_bytes is not None:
        builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    for index, profile in enumerate(profiles):
        if not profile.shapes:
            continue
        optimization_profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile.shapes:
            optimization_profile.set_shape(name, low, opt, high)
        if builder_config.add_optimization_profile(optimization_profile) < 0:
            raise BuildError(f"TensorRT refused optimisation profile {index}: {'; '.join(logger.errors)}")
    if precision_mode == "builder_flags" and precision in LEGACY_PRECISION_FLAGS:
        flag = getattr(trt.BuilderFlag, LEGACY_PRECISION_FLAGS[precision], None)
        if flag is None:
            raise ConfigError(
                f"tensorrt.precision_mode builder_flags: this TensorRT has no BuilderFlag."
                f"{LEGACY_PRECISION_FLAGS[precision]}; use precision_mode: onnx"
            )
        builder_config.set_flag(flag)
    if hardware_compatibility != "none":
        level = getattr(trt.HardwareCompatibilityLevel, HARDWARE_LEVELS[hardware_compatibility], None)
        if level is None:
            raise ConfigError(
                f"tensorrt.hardware_compatibility {hardware_compatibility}: TensorRT {env.device.tensorrt_version} "
                f"has no HardwareCompatibilityLevel.{HARDWARE_LEVELS[hardware_compatibility]}"
            )
        builder_config.hardware_compatibility_level = level
    if version_compatible:
        builder_config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if timing_cache_path is not None:
        previous = timing_cache_path.read_bytes() if timing_cache_path.is_file() else b""
        timing_cache = builder_config.create_timing_cache(previous)
        if timing_cache is None or not builder_config.set_timing_cache(timing_cache, False):
            log.warning("timing cache unusable, starting a new one", path=str(timing_cache_path))
            timing_cache = builder_config.create_timing_cache(b"")
            builder_config.set_timing_cache(timing_cache, True)
    plan = builder.build_serialized_network(network, builder_config)
    if not plan:
        raise BuildError(
            "TensorRT could not build the engine:\n"
            + "\n".join(f"  {line}" for line in logger.errors or ["(no error logged; run with --verbose)"])
        )
    if timing_cache_path is not None:
        atomic_write(timing_cache_path, bytes(memoryview(builder_config.get_timing_cache().serialize())))
    return bytes(memoryview(plan))


def _parser_error(parser_error: Any) -> str:
    """One parser error with where it happened (node index, name and operator when TensorRT names them)."""
    text = " ".join(str(parser_error).split())
    if text and not text.startswith("<"):
        return text
    parts = [f"{parser_error.code()}: {parser_error.desc()}"]
    if parser_error.node() >= 0:
        parts.append(f"node {parser_error.node()} '{parser_error.node_name()}' ({parser_error.node_operator()})")
    return " in ".join(parts)


def build_and_store(
    env: TensorRTEnvironment,
    directory: Path,
    config: ModelConfig,
    *,
    model: str,
    version: str,
    log: structlog.stdlib.BoundLogger,
    force: bool = False,
    verbose: bool = False,
) -> BuildOutcome:
    """Make sure the engine cache of ``directory`` holds this GPU's engine; build it unless it is there."""
    resolved = resolve_spec(directory, config, model=model, version=version)
    spec = resolved.spec
    key = engine_key(spec, env.device)
    cache = EngineCache(directory / ENGINES_DIR)
    if not force:
        found = cache.load(key, env.device)
        if found is not None:
            return BuildOutcome(path=cache.path_of(key), record=found[1], built=False)
    trt_config = config.trt
    log.info("building TensorRT engine", tag=spec.tag, key=key.directory_name, gpu=env.device.gpu_name)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="splitstream-build-") as scratch:
        prepared = prepare_onnx(
            resolved.source,
            spec.precision,
            Path(scratch) / f"model.{spec.precision}.onnx",
            precision_mode=spec.precision_mode,
        )
        plan = build_serialized(
            env,
            prepared,
            profiles=spec.profiles,
            precision=spec.precision,
            precision_mode=spec.precision_mode,
            workspace_bytes=trt_config.workspace_bytes,
            hardware_compatibility=spec.hardware_compatibility,
            version_compatible=spec.version_compatible,
            timing_cache_path=cache.timing_cache_path(env.device) if trt_config.timing_cache else None,
            log=log,
            verbose=verbose,
        )
    seconds = time.monotonic() - started
    record = build_record(spec, key, env.device, build_seconds=seconds)
    path = cache.store(key, plan, record)
    log.info("TensorRT engine built", tag=spec.tag, path=str(path), seconds=round(seconds, 1), plan_bytes=len(plan))
    return BuildOutcome(path=path, record=record, built=True)
