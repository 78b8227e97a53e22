"""The one module that imports numba.cuda: every kernel and every device buffer goes through these names.

numba-cuda is in maintenance; moving to its successor should change this file only. Under
`NUMBA_ENABLE_CUDASIM=1` the same kernels run on the CPU in numba's simulator, which lacks warp shuffles and
runs libdevice bit casts wrongly: kernels reduce through shared memory, and bit casts come from here.
"""

import math

import numpy as np
from numba import config, cuda, float32

SIMULATOR = bool(config.ENABLE_CUDASIM)

# Kernels use this module object (`from codegen.lower.cuda import cuda`; `cuda.jit`, `cuda.grid(1)`,
# `cuda.shared.array`, `cuda.syncthreads()`, `cuda.to_device`, ...): the simulator swaps a global that *is*
# numba.cuda for its CPU version while a kernel runs, so aliases of its attributes would not work there.


def available() -> bool:
    """Whether kernels can run here: a real GPU, or the simulator."""
    return SIMULATOR or cuda.is_available()


def device_name() -> str:
    if SIMULATOR:
        return "numba CUDA simulator (CPU)"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else name


if SIMULATOR:
    import sys
    import threading

    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    def _shared_array_once(self, shape, dtype, alignment=None, _lock=threading.Lock(),
                           _original=FakeCUDAShared.array):
        """The simulator makes a block's shared array on the first call from each source line but checks and
        stores without a lock, so two threads of a block could each make one and no longer share it (rare
        wrong sums under load). The same, under a lock."""
        if shape == 0 or alignment is not None:       # dynamic shared memory, or the simulator's refusal
            return _original(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with _lock:
            if key not in self._allocations:
                self._allocations[key] = np.empty(shape, np.dtype(dtype))
            return self._allocations[key]

    FakeCUDAShared.array = _shared_array_once

    def bits_to_f32(bits):
        """The float32 whose bit pattern is the int32 `bits` (bf16 -> f32 is `bits_to_f32(b << 16)`)."""
        return np.array(bits, dtype=np.int32).view(np.float32)[()]

    def f32_to_bits(value):
        return np.array(value, dtype=np.float32).view(np.int32)[()]
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def bits_to_f32(bits):
        return libdevice.int_as_float(bits)

    @cuda.jit(device=True, inline=True)
    def f32_to_bits(value):
        return libdevice.float_as_int(value)


@cuda.jit(device=True, inline=True)
def roundf(x):
    """C's roundf (half away from zero), as ggml quantizes; written out so the simulator agrees bitwise."""
    a = abs(x)
    floored = math.floor(a)
    b = floored + math.floor(float32(2.0) * (a - floored))
    return -b if x < 0 else b


def mapped_device_view(array):
    """A mapped host array (`cuda.mapped_array`, a numpy array too) as the device array kernels and copies
    take; device arrays (and all of the simulator's arrays) as they are. numba's mapped arrays lose their
    device pointer in numpy views (reshape, slices): view the whole array first, then slice the view. A view
    without a pointer is refused, never read as address 0."""
    if not isinstance(array, np.ndarray):
        return array
    view = cuda.as_cuda_array(array)
    if not view.device_ctypes_pointer.value:
        raise ValueError("a host array with no device pointer: a numpy view (slice, reshape) of a "
                         "cuda.mapped_array loses it; view the mapped array with mapped_device_view first")
    return view


def mapped_host_view(array):
    """A mapped host array as plain numpy memory, the source of a host-to-device copy (page-locked: an
    asynchronous DMA at the link's rate). numba would copy from a mapped array itself device to device,
    and fails on its slices; the simulator's arrays are returned as they are."""
    return np.ndarray.view(array, np.ndarray) if isinstance(array, np.ndarray) else array


def event_done(event) -> bool:
    """Whether the work before a recorded event has finished (the simulator runs everything at once)."""
    return True if SIMULATOR else event.query()


class CapturedGraph:
    """Work enqueued on a stream by `enqueue(stream)`, captured once as a CUDA graph and replayed with one
    launch (about 1 us a node against tens of us a Python launch). Kernels must already be compiled (run
    `enqueue` once first) and must neither allocate nor synchronise. The simulator has no graphs: replay
    calls `enqueue` again, which computes the same thing."""

    def __init__(self, enqueue, stream):
        self.enqueue, self.executable, self.graph = enqueue, None, None
        if SIMULATOR:
            return
        from cuda.bindings import driver
        self._driver = driver
        handle = driver.CUstream(int(stream.handle))
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        self._checked(driver.cuStreamBeginCapture(handle, mode))
        try:
            enqueue(stream)
        finally:
            self.graph = self._checked(driver.cuStreamEndCapture(handle))
        self.executable = self._checked(driver.cuGraphInstantiate(self.graph, 0))

    def _checked(self, result):
        err, *rest = result
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def replay(self, stream) -> None:
        if SIMULATOR:
            self.enqueue(stream)
            return
        self._checked(self._driver.cuGraphLaunch(self.executable, self._driver.CUstream(int(stream.handle))))

    def close(self) -> None:
        if self.executable is not None:
            self._checked(self._driver.cuGraphExecDestroy(self.executable))
            self._checked(self._driver.cuGraphDestroy(self.graph))
            self.executable = self.graph = None


__all__ = ["SIMULATOR", "cuda", "available", "device_name", "bits_to_f32", "f32_to_bits", "roundf", "CapturedGraph",
           "mapped_device_view", "mapped_host_view", "event_done"]
