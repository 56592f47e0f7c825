"""Is TensorRT usable here? One place that imports TensorRT and cuda-python and finds the GPU.

:func:`load_environment` either returns the modules and this machine's
:class:`~splitstream.worker.engines.cache.DeviceFacts`, or raises one
ConfigError line naming everything that is missing, which the worker and the
engine builder print as their last word (exit code 2), not a traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType

from splitstream.common.errors import ConfigError
from splitstream.worker.engines.cache import DeviceFacts
from splitstream.worker.engines.cuda import CudaError, import_cudart, probe_device

#: Supported TensorRT releases: 10.8 up to (not including) 12.
MIN_TENSORRT = (10, 8)
MAX_TENSORRT_MAJOR = 11
INSTALL_HINT = "pip install 'splitstream[tensorrt]'"


@dataclass(frozen=True)
class TensorRTEnvironment:
    """The imported ``tensorrt`` and ``cuda.bindings.runtime`` modules and the GPU they run on."""

    trt: ModuleType
    cudart: ModuleType
    device: DeviceFacts

    @property
    def major(self) -> int:
        return self.device.tensorrt_major


def import_tensorrt() -> ModuleType:
    import tensorrt

    return tensorrt


def load_environment(what: str = "backend tensorrt") -> TensorRTEnvironment:
    """TensorRT, cuda-python and a GPU, or ConfigError (one line) saying which are missing."""
    missing = []
    trt: ModuleType | None = None
    cudart: ModuleType | None = None
    try:
        trt = import_tensorrt()
    except ImportError as error:
        if getattr(error, "name", None) in ("tensorrt", None):
            missing.append("TensorRT is not installed (no module tensorrt)")
        else:
            missing.append(f"TensorRT cannot be imported ({_one_line(error)})")
    except Exception as error:  # a tensorrt wheel without its libraries fails with OSError and others
        missing.append(f"TensorRT cannot be imported ({_one_line(error)})")
    try:
        cudart = import_cudart()
    except ImportError:
        missing.append("cuda-python is not installed (no module cuda.bindings.runtime)")
    except Exception as error:
        missing.append(f"cuda-python cannot be imported ({_one_line(error)})")
    if missing:
        raise ConfigError(f"{what} needs TensorRT, cuda-python and an NVIDIA GPU: {'; '.join(missing)}; {INSTALL_HINT}")
    assert trt is not None
    assert cudart is not None
    version = str(getattr(trt, "__version__", "0"))
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers < MIN_TENSORRT or numbers[0] > MAX_TENSORRT_MAJOR:
        raise ConfigError(
            f"{what} supports TensorRT {MIN_TENSORRT[0]}.{MIN_TENSORRT[1]} to {MAX_TENSORRT_MAJOR}.x, "
            f"this is TensorRT {version}"
        )
    try:
        device = probe_device(cudart, version)
    except CudaError as error:
        raise ConfigError(f"{what} needs an NVIDIA GPU: {error}") from None
    return TensorRTEnvironment(trt=trt, cudart=cudart, device=device)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
