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


__all__ = ["SIMULATOR", "cuda", "available", "device_name", "bits_to_f32", "f32_to_bits", "roundf"]
