"""The one module that imports numba.cuda: every kernel and every device buffer goes through these names.

numba-cuda is in maintenance; moving to its successor should change this file only. Under
`NUMBA_ENABLE_CUDASIM=1` the same kernels run on the CPU in numba's simulator, which lacks warp shuffles and
runs libdevice bit casts wrongly: kernels reduce through shared memory, and bit casts come from here.
"""

import math
import weakref

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


def mapped_filled(shape, dtype, values=0):
    """Mapped pinned host memory (page-locked, readable and writable by kernels in place) holding `values`."""
    mapped = cuda.mapped_array(shape, dtype)
    mapped[...] = values
    return mapped


def mapped_host_view(array):
    """A mapped host array as plain numpy memory, the source of a host-to-device copy (page-locked: an
    asynchronous DMA at the link's rate). numba would copy from a mapped array itself device to device,
    and fails on its slices; the simulator's arrays are returned as they are."""
    return np.ndarray.view(array, np.ndarray) if isinstance(array, np.ndarray) else array


def launch_kernel(kernel, griddim, blockdim, stream, *args) -> None:
    """kernel[griddim, blockdim, stream](*args), with what numba redoes on every call done once: numba types
    and marshals each argument and finds the compiled kernel at each launch (about 12 us an array, 250 us for
    a MoE kernel's 17), which dominated prefill's expert batches launched from Python. Here each device array
    is marshalled once, scalar types are known by their Python type, and the compiled kernel is found by its
    argument types' identities. A kernel's first launch for its argument types (which compiles it) takes
    numba's path."""
    if SIMULATOR:
        kernel[griddim, blockdim, stream](*args)
        return
    types, marshalled = [], []
    for value in args:
        entry = _marshalled_arrays.get(id(value))
        if entry is None or entry[0]() is not value:
            if not isinstance(value, _DeviceNDArray):
                types.append(_scalar_type(kernel, value))
                marshalled.append(None)
                continue
            entry = _marshal_array(kernel, value)
        types.append(entry[1])
        marshalled.append(entry[2])
    key = (id(kernel), *map(id, types))
    found = _compiled.get(key)
    if found is None:
        compiled = kernel.overloads.get(tuple(types))
        if compiled is None:
            kernel[griddim, blockdim, stream](*args)       # compiles for these types
            return
        _compiled[key] = compiled, tuple(types), kernel     # kept alive: their ids stay theirs
    else:
        compiled = found[0]
    params = []
    for ty, value, done in zip(types, args, marshalled):
        if done is None:
            compiled._prepare_args(ty, value, stream, [], params)
        else:
            params.extend(done)
    function = _functions.get(compiled)
    if function is None:
        function = _functions[compiled] = compiled._codelibrary.get_cufunc().kernel
    shape = (griddim, blockdim)
    config = _configs.get(shape)
    if config is None:
        config = _configs[shape] = _LaunchConfig(grid=_dims(griddim), block=_dims(blockdim), shmem_size=0)
    _core_launch(stream or cuda.default_stream(), config, function, *params)


def copy_rows(dst, dst_row: int, src, src_row: int, rows: int, stream) -> None:
    """Rows src_row.. of `src` into rows dst_row.. of `dst`, asynchronous on `stream`: a page-locked host array
    (numpy) into a device array, or a device array into a page-locked host array (both C-contiguous, rows of
    the same bytes). One driver call, not numba's copy, which costs ~200 us of Python a call (slicing both
    arrays, checking, marshalling)."""
    to_host = isinstance(dst, np.ndarray)
    host, device = (dst, src) if to_host else (src, dst)
    row_bytes = host.strides[0]
    if device.strides[0] != row_bytes or not (host.flags.c_contiguous and device.is_c_contiguous()):
        raise ValueError(f"copy_rows needs C-contiguous arrays of equal rows ({row_bytes} and {device.strides[0]} "
                         "bytes)")
    if not (0 <= src_row <= src_row + rows <= src.shape[0] and 0 <= dst_row <= dst_row + rows <= dst.shape[0]):
        raise ValueError(f"rows {src_row}..{src_row + rows} into {dst_row}..{dst_row + rows}: outside "
                         f"{src.shape[0]} and {dst.shape[0]} rows")
    if SIMULATOR:
        if to_host:
            dst[dst_row:dst_row + rows] = src[src_row:src_row + rows].copy_to_host(stream=stream)
        else:
            dst[dst_row:dst_row + rows].copy_to_device(src[src_row:src_row + rows], stream=stream)
        return
    from cuda.bindings import driver
    host_at = host.ctypes.data + (dst_row if to_host else src_row) * row_bytes
    device_at = device.device_ctypes_pointer.value + (src_row if to_host else dst_row) * row_bytes
    handle = driver.CUstream(int(stream.handle))
    if to_host:
        err, = driver.cuMemcpyDtoHAsync(host_at, device_at, rows * row_bytes, handle)
    else:
        err, = driver.cuMemcpyHtoDAsync(device_at, host_at, rows * row_bytes, handle)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"an asynchronous copy of {rows * row_bytes} bytes failed: {err}")


if not SIMULATOR:
    from cuda.core import LaunchConfig as _LaunchConfig
    from cuda.core import launch as _core_launch
    from numba.cuda.cudadrv.devicearray import DeviceNDArray as _DeviceNDArray

_marshalled_arrays = {}     # id(device array) -> (weak reference, numba type, kernel parameters)
_compiled = {}              # (id(dispatcher), id(each argument's type)...) -> (compiled kernel, types, dispatcher)
_functions = {}             # numba's compiled kernel -> the driver's function
_configs = {}               # (grid, block) -> launch configuration
_scalar_types = {}          # Python or numpy scalar type -> numba type


def _scalar_type(kernel, value):
    """numba's type of an argument that is not a device array: scalars' by their Python type, once (a Python
    int is int64 below 2**63); anything else asked of numba each time."""
    kind = type(value)
    cacheable = (kind is float or isinstance(value, np.generic)
                 or (kind is int and -(1 << 63) <= value < (1 << 63)))
    ty = _scalar_types.get(kind) if cacheable else None
    if ty is None:
        ty = kernel.typeof_pyval(value)
        if cacheable:
            _scalar_types[kind] = ty
    return ty


def _marshal_array(kernel, array) -> tuple:
    ty = kernel.typeof_pyval(array)
    params = []
    any_compiled = next(iter(kernel.overloads.values()), None)
    if any_compiled is None:        # nothing compiled yet: numba's path compiles and marshals this time
        return lambda: None, ty, None
    any_compiled._prepare_args(ty, array, 0, [], params)
    key = id(array)
    entry = _marshalled_arrays[key] = (weakref.ref(array), ty, tuple(params))
    weakref.finalize(array, _marshalled_arrays.pop, key, None)
    return entry


def _dims(dims):
    return tuple(int(d) for d in dims) if isinstance(dims, tuple) else int(dims)


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
           "mapped_device_view", "mapped_filled", "mapped_host_view", "event_done", "launch_kernel", "copy_rows"]
