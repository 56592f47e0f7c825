"""A fake ``cuda.bindings.runtime``: same call shapes ((error, *results)), host memory as "device" memory.

Test helpers (``ALLOCATIONS``, ``STREAMS``, ``EVENTS``, ``FAIL``, :func:`inside`) aside, every name here
exists in cuda-bindings 12.8 and 13.5 (``tests/test_tensorrt_api.py`` checks).
"""

from __future__ import annotations

import ctypes
import enum
import os
import threading
from typing import Any


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorNoDevice = 100
    cudaErrorInvalidResourceHandle = 400


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


cudaStreamNonBlocking = 1


class cudaStream_t:
    def __init__(self, handle: int = 0) -> None:
        self._handle = handle

    def __int__(self) -> int:
        return self._handle

    def __index__(self) -> int:
        return self._handle


class cudaDeviceProp:
    def __init__(self, name: bytes, major: int, minor: int) -> None:
        self.name = name
        self.major = major
        self.minor = minor


#: Every allocation: address → (kind, ctypes buffer); and a log of what happened, in order.
ALLOCATIONS: dict[int, tuple[str, Any]] = {}
STREAMS: dict[int, int] = {}
EVENTS: list[tuple[str, int]] = []
_lock = threading.Lock()
_next_stream = [1000]
#: Make the next N calls of a function fail (tests of error paths): name → error.
FAIL: dict[str, cudaError_t] = {}


def _failing(name: str) -> cudaError_t | None:
    return FAIL.pop(name, None)


def _devices() -> int:
    return int(os.environ.get("FAKE_CUDA_DEVICES", "1"))


def cudaGetDeviceCount() -> tuple[cudaError_t, int]:
    if _devices() < 1:
        return cudaError_t.cudaErrorNoDevice, 0
    return cudaError_t.cudaSuccess, _devices()


def cudaSetDevice(device: int) -> tuple[cudaError_t]:
    return (cudaError_t.cudaSuccess if device < _devices() else cudaError_t.cudaErrorInvalidValue,)


def cudaGetDeviceProperties(device: int) -> tuple[cudaError_t, cudaDeviceProp | None]:
    if device >= _devices():
        return cudaError_t.cudaErrorInvalidValue, None
    major, minor = (int(part) for part in os.environ.get("FAKE_GPU_CC", "8.9").split("."))
    name = os.environ.get("FAKE_GPU_NAME", "NVIDIA Fake L4").encode() + b"\0" * 8
    return cudaError_t.cudaSuccess, cudaDeviceProp(name, major, minor)


def cudaDeviceGetStreamPriorityRange() -> tuple[cudaError_t, int, int]:
    return cudaError_t.cudaSuccess, 0, -5


def cudaStreamCreateWithPriority(flags: int, priority: int) -> tuple[cudaError_t, cudaStream_t | None]:
    error = _failing("cudaStreamCreateWithPriority")
    if error is not None:
        return error, None
    assert flags == cudaStreamNonBlocking
    assert -5 <= priority <= 0, priority
    with _lock:
        handle = _next_stream[0] = _next_stream[0] + 1
        STREAMS[handle] = priority
        EVENTS.append(("stream", handle))
    return cudaError_t.cudaSuccess, cudaStream_t(handle)


def cudaStreamSynchronize(stream: Any) -> tuple[cudaError_t]:
    return (cudaError_t.cudaSuccess if int(stream) in STREAMS else cudaError_t.cudaErrorInvalidResourceHandle,)


def cudaStreamDestroy(stream: Any) -> tuple[cudaError_t]:
    with _lock:
        if STREAMS.pop(int(stream), None) is None:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        EVENTS.append(("stream-destroyed", int(stream)))
    return (cudaError_t.cudaSuccess,)


def cudaDeviceSynchronize() -> tuple[cudaError_t]:
    return (cudaError_t.cudaSuccess,)


#: What cudaMemGetInfo reports as the card's memory.
TOTAL_DEVICE_BYTES = 24 << 30


def cudaMemGetInfo() -> tuple[cudaError_t, int, int]:
    """(error, free, total): free is the total less the live device allocations."""
    with _lock:
        used = sum(ctypes.sizeof(buffer) for kind, buffer in ALLOCATIONS.values() if kind == "device")
    return cudaError_t.cudaSuccess, TOTAL_DEVICE_BYTES - used, TOTAL_DEVICE_BYTES


def _allocate(kind: str, nbytes: int) -> tuple[cudaError_t, int]:
    error = _failing("cudaMalloc" if kind == "device" else "cudaMallocHost")
    if error is not None:
        return error, 0
    buffer = (ctypes.c_byte * nbytes)()
    address = ctypes.addressof(buffer)
    with _lock:
        ALLOCATIONS[address] = (kind, buffer)
        EVENTS.append((kind, address))
    return cudaError_t.cudaSuccess, address


def _free(kind: str, address: int) -> tuple[cudaError_t]:
    with _lock:
        entry = ALLOCATIONS.get(address)
        if entry is None or entry[0] != kind:
            return (cudaError_t.cudaErrorInvalidValue,)
        del ALLOCATIONS[address]
        EVENTS.append((f"{kind}-freed", address))
    return (cudaError_t.cudaSuccess,)


def cudaMalloc(nbytes: int) -> tuple[cudaError_t, int]:
    return _allocate("device", nbytes)


def cudaFree(address: int) -> tuple[cudaError_t]:
    return _free("device", address)


def cudaMallocHost(nbytes: int) -> tuple[cudaError_t, int]:
    return _allocate("pinned", nbytes)


def cudaFreeHost(address: int) -> tuple[cudaError_t]:
    return _free("pinned", address)


def inside(address: int, nbytes: int, kind: str | None = None) -> bool:
    """True when ``[address, address + nbytes)`` lies in one live allocation (of ``kind``)."""
    for start, (allocated_kind, buffer) in list(ALLOCATIONS.items()):
        if start <= address and address + nbytes <= start + ctypes.sizeof(buffer):
            return kind is None or allocated_kind == kind
    return False


def cudaMemcpyAsync(dst: int, src: int, nbytes: int, kind: cudaMemcpyKind, stream: Any) -> tuple[cudaError_t]:
    error = _failing("cudaMemcpyAsync")
    if error is not None:
        return (error,)
    if int(stream) not in STREAMS:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    source_kind, target_kind = {
        cudaMemcpyKind.cudaMemcpyHostToDevice: ("pinned", "device"),
        cudaMemcpyKind.cudaMemcpyDeviceToHost: ("device", "pinned"),
    }[kind]
    if not inside(src, nbytes, source_kind) or not inside(dst, nbytes, target_kind):
        return (cudaError_t.cudaErrorInvalidValue,)
    ctypes.memmove(dst, src, nbytes)
    return (cudaError_t.cudaSuccess,)


def cudaMemcpy(dst: int, src: int, nbytes: int, kind: cudaMemcpyKind) -> tuple[cudaError_t]:
    """A synchronous copy: as in CUDA, its host side may be any host memory (pageable too), not only pinned."""
    error = _failing("cudaMemcpy")
    if error is not None:
        return (error,)
    if kind == cudaMemcpyKind.cudaMemcpyHostToDevice:
        valid = inside(dst, nbytes, "device") and not inside(src, nbytes, "device")
    elif kind == cudaMemcpyKind.cudaMemcpyDeviceToHost:
        valid = inside(src, nbytes, "device") and not inside(dst, nbytes, "device")
    else:
        valid = False
    if not valid:
        return (cudaError_t.cudaErrorInvalidValue,)
    ctypes.memmove(dst, src, nbytes)
    return (cudaError_t.cudaSuccess,)
