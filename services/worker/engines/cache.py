"""The engine cache in the model repository: where a built engine lives and when it may be loaded.

Layout, beside the version's ``model.onnx``::

    <repo>/<model>/<version>/engines/
        fp16-dyn-sm89-trt11.4.0.106-3f9c0a1b2c3d4e5f/
            engine.plan        the serialized engine
            engine.json        its key, its tag and the facts of the build
        timing-trt11.4.0.106-nvidia-l4-sm89.cache    the builder's timing cache (per TensorRT version and GPU)

An engine is keyed by everything that makes it unusable elsewhere or stale:
TensorRT version, GPU name and compute capability, hardware-compatibility
level, version-compatible flag, precision, the profiles' shapes and the
SHA-256 of the ONNX file the precision step consumed. Portability options
widen the key on purpose: a hardware-compatible engine is keyed by its level
instead of one GPU, a version-compatible one by TensorRT's major version.

Loading checks twice: the directory is the one the key names, and
:func:`check_loadable` compares ``engine.json``'s build facts with this
machine's, so a plan copied to the wrong place is still refused. There is no
other way to know: TensorRT has no preflight check for a plan.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitstream.common.errors import ConfigError
from splitstream.worker.engines.profiles import Profile

#: engine.json's format; a different one is treated as a missing engine.
RECORD_FORMAT = 1
PLAN_FILE = "engine.plan"
RECORD_FILE = "engine.json"
#: Ampere is compute capability 8.0; AMPERE_PLUS engines run on it and everything after.
AMPERE = (8, 0)


class EngineMismatch(ConfigError):
    """An engine exists but was built for another GPU, TensorRT version or model; it is never loaded."""


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What this machine offers an engine: TensorRT's version and the GPU's name and compute capability."""

    tensorrt_version: str
    gpu_name: str
    compute_capability: tuple[int, int]

    @property
    def sm(self) -> str:
        return f"{self.compute_capability[0]}{self.compute_capability[1]}"

    @property
    def tensorrt_major(self) -> int:
        return int(self.tensorrt_version.split(".")[0])


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What to build, from config.yaml and the model files: everything in the key except the machine."""

    model: str
    version: str
    precision: str
    precision_mode: str
    profiles: tuple[Profile, ...]
    onnx_sha256: str
    hardware_compatibility: str = "none"
    version_compatible: bool = False

    @property
    def variant(self) -> str:
        """The precision as keyed: ``fp16``, or ``fp16-flags`` for TensorRT 10.x builder flags."""
        return self.precision if self.precision_mode == "onnx" else f"{self.precision}-flags"

    @property
    def tag(self) -> str:
        """The engine's human tag, e.g. ``resnet-v2-fp16-dyn``: model, version, precision, dynamic or static."""
        shape = "dyn" if any(profile.dynamic for profile in self.profiles) else "static"
        return f"{self.model}-{self.version}-{self.precision}-{shape}"


@dataclass(frozen=True, kw_only=True)
class EngineKey:
    """The cache key of one engine: an :class:`EngineSpec` on one kind of machine."""

    fields: dict[str, Any]
    key_id: str
    directory_name: str


def engine_key(spec: EngineSpec, device: DeviceFacts) -> EngineKey:
    """The key under which ``spec``'s engine for ``device`` is stored (and looked up)."""
    tensorrt = f"{device.tensorrt_major}.x-vc" if spec.version_compatible else device.tensorrt_version
    if spec.hardware_compatibility == "ampere_plus":
        gpu, capability = "any", f"{AMPERE[0]}.{AMPERE[1]}+"
    elif spec.hardware_compatibility == "same_cc":
        gpu, capability = "any", "{}.{}".format(*device.compute_capability)
    else:
        gpu, capability = device.gpu_name, "{}.{}".format(*device.compute_capability)
    fields = {
        "tensorrt": tensorrt,
        "gpu": gpu,
        "compute_capability": capability,
        "hardware_compatibility": spec.hardware_compatibility,
        "version_compatible": spec.version_compatible,
        "precision": spec.variant,
        "profiles": [profile.to_json() for profile in spec.profiles],
        "onnx_sha256": spec.onnx_sha256,
    }
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    key_id = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    sm = "sm80plus" if spec.hardware_compatibility == "ampere_plus" else f"sm{device.sm}"
    trt = f"trt{device.tensorrt_major}vc" if spec.version_compatible else f"trt{device.tensorrt_version}"
    shape = spec.tag.rsplit("-", 1)[1]
    return EngineKey(fields=fields, key_id=key_id, directory_name=f"{spec.variant}-{shape}-{sm}-{trt}-{key_id}")


def describe_key(key: EngineKey) -> str:
    """One line naming a key's fields, for "no engine" and mismatch messages."""
    fields = key.fields
    profiles = "; ".join(
        ", ".join(f"{name} {r[0]}..{r[2]} opt {r[1]}" for name, r in profile.items()) or "static"
        for profile in fields["profiles"]
    )
    return (
        f"key {key.key_id} (TensorRT {fields['tensorrt']}, GPU {fields['gpu']} sm {fields['compute_capability']}, "
        f"hardware compatibility {fields['hardware_compatibility']}, version compatible "
        f"{str(fields['version_compatible']).lower()}, precision {fields['precision']}, profiles [{profiles}], "
        f"onnx sha256 {fields['onnx_sha256'][:12]}...)"
    )


def build_record(spec: EngineSpec, key: EngineKey, device: DeviceFacts, *, build_seconds: float) -> dict[str, Any]:
    """engine.json: the key, the tag and the facts of the machine that built it."""
    return {
        "format": RECORD_FORMAT,
        "key_id": key.key_id,
        "key": key.fields,
        "tag": spec.tag,
        "built_with": {
            "tensorrt_version": device.tensorrt_version,
            "gpu_name": device.gpu_name,
            "compute_capability": list(device.compute_capability),
        },
        "build_seconds": round(build_seconds, 3),
    }


def check_loadable(record: dict[str, Any], key: EngineKey, device: DeviceFacts) -> None:
    """Raise EngineMismatch unless the engine ``record`` describes may run on ``device`` for ``key``."""
    if record.get("format") != RECORD_FORMAT:
        raise EngineMismatch(f"engine.json has format {record.get('format')!r}, this worker reads {RECORD_FORMAT}")
    if record.get("key_id") != key.key_id or record.get("key") != key.fields:
        differing = sorted(name for name in key.fields if (record.get("key") or {}).get(name) != key.fields[name]) or [
            "key_id"
        ]
        raise EngineMismatch(f"engine.json was written for another key (differs in {', '.join(differing)})")
    built = record.get("built_with") or {}
    built_version = str(built.get("tensorrt_version", ""))
    built_cc = tuple(built.get("compute_capability") or ())
    if key.fields["version_compatible"]:
        if _version(built_version)[:1] != _version(device.tensorrt_version)[:1] or _version(built_version) > _version(
            device.tensorrt_version
        ):
            raise EngineMismatch(
                f"engine built with TensorRT {built_version} (version compatible) cannot run on TensorRT "
                f"{device.tensorrt_version}: needs the same major version, not older"
            )
    elif built_version != device.tensorrt_version:
        raise EngineMismatch(
            f"engine built with TensorRT {built_version}, this worker has TensorRT {device.tensorrt_version}"
        )
    level = key.fields["hardware_compatibility"]
    if level == "ampere_plus":
        if device.compute_capability < AMPERE:
            raise EngineMismatch(
                "engine is hardware compatible from Ampere (sm 8.0) on; this GPU is sm {}.{}".format(
                    *device.compute_capability
                )
            )
    elif built_cc != device.compute_capability:
        raise EngineMismatch(
            "engine built for compute capability {}, this GPU ({}) is {}.{}".format(
                ".".join(str(part) for part in built_cc) or "?", device.gpu_name, *device.compute_capability
            )
        )
    elif level == "none" and built.get("gpu_name") != device.gpu_name:
        raise EngineMismatch(f"engine built on a {built.get('gpu_name')}, this GPU is a {device.gpu_name}")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


class EngineCache:
    """The ``engines/`` directory of one model version."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path_of(self, key: EngineKey) -> Path:
        return self.directory / key.directory_name

    def load(self, key: EngineKey, device: DeviceFacts) -> tuple[bytes, dict[str, Any]] | None:
        """The plan and record stored under ``key``; None when there is none. Raises EngineMismatch."""
        entry = self.path_of(key)
        plan_path, record_path = entry / PLAN_FILE, entry / RECORD_FILE
        if not plan_path.is_file():
            return None
        try:
            record = json.loads(record_path.read_text())
        except FileNotFoundError:
            raise EngineMismatch(
                f"{entry}: has {PLAN_FILE} but no {RECORD_FILE}; refusing an engine of unknown origin"
            ) from None
        except (OSError, ValueError) as error:
            raise EngineMismatch(f"{record_path}: unreadable ({error})") from None
        if not isinstance(record, dict):
            raise EngineMismatch(f"{record_path}: not a JSON object")
        try:
            check_loadable(record, key, device)
        except EngineMismatch as error:
            raise EngineMismatch(f"{entry}: {error}") from None
        return plan_path.read_bytes(), record

    def store(self, key: EngineKey, plan: bytes, record: dict[str, Any]) -> Path:
        """Write the entry atomically: a concurrent builder's identical entry wins, readers never see half of one."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path_of(key)
        staging = Path(tempfile.mkdtemp(prefix=f".{key.directory_name}.", dir=self.directory))
        try:
            (staging / PLAN_FILE).write_bytes(plan)
            (staging / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            if target.exists():
                shutil.rmtree(target)  # a stale or partial entry (its plan was missing) is replaced
            try:
                os.rename(staging, target)
            except OSError:
                if not (target / PLAN_FILE).is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def timing_cache_path(self, device: DeviceFacts) -> Path:
        """The builder's timing cache for this TensorRT version and GPU (shared by the version's engines)."""
        gpu = re.sub(r"[^a-z0-9]+", "-", device.gpu_name.lower()).strip("-") or "gpu"
        return self.directory / f"timing-trt{device.tensorrt_version}-{gpu}-sm{device.sm}.cache"

    def entries(self) -> Sequence[Path]:
        return sorted(path for path in self.directory.glob("*") if (path / PLAN_FILE).is_file())
