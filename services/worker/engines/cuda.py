"""CUDA through cuda-python (``cuda.bindings.runtime``), every call's error checked.

cuda-python's runtime functions return ``(error, *results)``; :func:`checked`
turns a non-success error into :class:`CudaError` naming the call and the
error, so no failure passes silently. Some releases raise instead of
returning an error when the driver library is missing (cuda-bindings 12.8
raises ``RuntimeError: Failed to dlopen libcuda.so.1``); :func:`probe_device`
turns both into one line.

Nothing here imports cuda-python at module level: callers pass the ``cudart``
module that :func:`import_cudart` returned.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from splitstream.worker.engines.cache import DeviceFacts


class CudaError(RuntimeError):
    """A CUDA runtime call failed; the message names the call and CUDA's error name."""


def import_cudart() -> ModuleType:
    """``cuda.bindings.runtime``; raises ImportError when cuda-python is not installed."""
    from cuda.bindings import runtime as cudart

    return cudart


def checked(result: Any, what: str) -> Any:
    """The results of a cuda-python call, after checking its error: ``None``, one value or a tuple."""
    if not isinstance(result, tuple):
        result = (result,)
    error, *values = result
    if int(error) != 0:
        name = getattr(error, "name", None) or f"error {int(error)}"
        raise CudaError(f"{what} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def probe_device(cudart: ModuleType, tensorrt_version: str, device: int = 0) -> DeviceFacts:
    """This machine's GPU as the engine cache keys it; raises CudaError when there is no usable GPU."""
    try:
        count = checked(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
        if count < 1:
            raise CudaError("no CUDA device is visible (cudaGetDeviceCount returned 0)")
        checked(cudart.cudaSetDevice(device), f"cudaSetDevice({device})")
        props = checked(cudart.cudaGetDeviceProperties(device), f"cudaGetDeviceProperties({device})")
    except CudaError:
        raise
    except RuntimeError as error:  # e.g. the driver library cannot be loaded
        raise CudaError(f"CUDA is unusable here ({error})") from None
    name = props.name
    if isinstance(name, bytes):
        name = name.split(b"\0", 1)[0].decode(errors="replace")
    return DeviceFacts(
        tensorrt_version=tensorrt_version,
        gpu_name=str(name).strip(),
        compute_capability=(int(props.major), int(props.minor)),
    )


def stream_priority(cudart: ModuleType, wanted: str | int) -> tuple[int, tuple[int, int]]:
    """The CUDA priority for ``wanted`` and the device's range ``(least, greatest)``.

    CUDA priorities count down: ``least`` (usually 0) is the default,
    ``greatest`` (e.g. -5) the most urgent. An integer outside the range is
    clamped into it, as CUDA itself would.
    """
    least, greatest = checked(cudart.cudaDeviceGetStreamPriorityRange(), "cudaDeviceGetStreamPriorityRange")
    if wanted == "normal":
        priority = least
    elif wanted == "high":
        priority = greatest
    else:
        priority = min(max(int(wanted), greatest), least)
    return priority, (least, greatest)


def create_stream(cudart: ModuleType, priority: int) -> Any:
    """A non-blocking stream (it does not synchronise with the legacy default stream) with ``priority``."""
    return checked(
        cudart.cudaStreamCreateWithPriority(cudart.cudaStreamNonBlocking, priority),
        f"cudaStreamCreateWithPriority(priority={priority})",
    )


@dataclass
class DeviceBuffer:
    """``nbytes`` of device memory (at least 1 byte, so every tensor has an address)."""

    ptr: int
    nbytes: int

    @classmethod
    def allocate(cls, cudart: ModuleType, nbytes: int) -> DeviceBuffer:
        ptr = checked(cudart.cudaMalloc(max(nbytes, 1)), f"cudaMalloc({nbytes})")
        return cls(int(ptr), nbytes)

    def free(self, cudart: ModuleType) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            checked(cudart.cudaFree(ptr), "cudaFree")


@dataclass
class PinnedBuffer:
    """``nbytes`` of page-locked host memory, so copies to and from the GPU run asynchronously at full speed."""

    ptr: int
    nbytes: int

    @classmethod
    def allocate(cls, cudart: ModuleType, nbytes: int) -> PinnedBuffer:
        ptr = checked(cudart.cudaMallocHost(max(nbytes, 1)), f"cudaMallocHost({nbytes})")
        return cls(int(ptr), nbytes)

    def view(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        """The first bytes of the buffer as an array of ``shape`` (no copy; valid until :meth:`free`)."""
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        if nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes do not fit a pinned buffer of {self.nbytes}")
        raw = memoryview((ctypes.c_byte * max(nbytes, 1)).from_address(self.ptr)).cast("B")
        return np.frombuffer(raw, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)

    def free(self, cudart: ModuleType) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            checked(cudart.cudaFreeHost(ptr), "cudaFreeHost")
