"""The one module that imports numba.cuda: every kernel and every device buffer goes through these names.

numba-cuda is in maintenance; moving to its successor should change this file only. Under
`NUMBA_ENABLE_CUDASIM=1` the same kernels run on the CPU in numba's simulator, which lacks warp shuffles and
runs libdevice bit casts wrongly: kernels reduce through shared memory, and bit casts come from here; the
warp-level reductions kernels use (`warp_max`, `warp_sum` in a fixed butterfly order) are emulated for it
here.
"""

import functools
import gc
import math
import weakref

import numpy as np
from numba import config, cuda, float32
from numba.core import types as _numba_types

from codegen.lower import kernel_cache

SIMULATOR = bool(config.ENABLE_CUDASIM)
SHARED_BYTES = 48 * 1024                    # static shared memory a block may use
SHARED_ALIGN = None if SIMULATOR else 16    # shared tiles read as float4 (the simulator takes no alignment)
U = np.uint64           # array indices known >= 0, cast to unsigned: numba emits no negative-index wraparound
IDX = 1023              # thread ids masked with this are provably >= 0: no wraparound code either
BIDX = 0x7FFFFFFF       # the same for block ids
WARP_MAX_VALUES = 64     # values one warp_max or warp_sum call reduces at most

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


if SIMULATOR:
    def load4(array, index):
        """Elements index..index + 3 of `array`'s last axis (index: an integer, or a tuple for a 2-D array); of a
        uint16 array, its 16 bytes from element index as 4 int32 words."""
        if array.dtype == np.uint16:
            return tuple(np.array([array[index + k] for k in range(8)], np.uint16).view(np.int32))
        if isinstance(index, tuple):
            row, first = index
            return array[row, first], array[row, first + 1], array[row, first + 2], array[row, first + 3]
        return array[index], array[index + 1], array[index + 2], array[index + 3]
else:
    from llvmlite import ir as _ir
    from numba.cuda import cgutils as _cgutils
    from numba.cuda.api_util import normalize_indices as _normalize_indices
    from numba.cuda.extending import intrinsic as _intrinsic

    @_intrinsic
    def load4(typingctx, array, index):
        """Elements index..index + 3 of `array`'s last axis (an int32 or float32 array; index: an integer, or a
        tuple for a 2-D array) as a 4-tuple, in one 16-byte load through the read-only cache
        (`ld.global.nc.v4`): numba's indexing emits 4-byte loads only, so a lane would need four loads in
        flight for the same bytes. Of a uint16 array (K-quant headers), the 16 bytes from element index as 4
        int32 words (elements 2k and 2k + 1 the low and high half of word k): one load, not 8 two-byte loads
        whose 64-bit addresses the compiler would keep in registers. The first element's address must be a
        multiple of 16 bytes (a misaligned address stops the kernel with a CUDA error; it never reads a wrong
        value)."""
        element = _numba_types.int32 if array.dtype == _numba_types.uint16 else array.dtype
        signature = _numba_types.UniTuple(element, 4)(array, index)

        def codegen(context, builder, sig, args):
            array_type, index_type = sig.args
            array_value, indices = args
            index_type, indices = _normalize_indices(context, builder, index_type, indices, array_type,
                                                     array_type.dtype)
            struct = context.make_array(array_type)(context, builder, value=array_value)
            pointer = _cgutils.get_item_pointer(context, builder, array_type, struct, indices, wraparound=False)
            value_type = context.get_value_type(element)
            kind, constraint = ("f32", "f") if element == _numba_types.float32 else ("b32", "r")
            load = _ir.InlineAsm(_ir.FunctionType(_ir.LiteralStructType([value_type] * 4), [pointer.type]),
                                 f"ld.global.nc.v4.{kind} {{$0, $1, $2, $3}}, [$4];",
                                 ",".join([f"={constraint}"] * 4) + ",l")
            loaded = builder.call(load, [pointer])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(loaded, k) for k in range(4)])

        if element not in (_numba_types.int32, _numba_types.float32):
            return None
        return signature, codegen


@cuda.jit(device=True, inline=True)
def better(value, index, best, best_index):
    """Whether (value, index) beats (best, best_index): larger, or equal at a lower index (no branch: the
    router counts these in its inner loop)."""
    return (value > best) | ((value == best) & (index < best_index))


@functools.cache
def kernels_overlap() -> bool:
    """Whether a kernel may start while the kernel before it on its stream drains (programmatic dependent
    launch: compute capability 9.0 and later; never in the simulator): kernels marked `overlapping` then do. A
    decode step's kernels are short, and each one's launch, ramp and drain leave the memory partly idle
    (BENCHMARKS.md run 49)."""
    return not SIMULATOR and cuda.get_current_device().compute_capability >= (9, 0)


def overlapping(kernel):
    """Mark a kernel (a `cuda.jit` dispatcher) as one whose every thread calls `wait_for_prior_grids` before it
    reads or writes anything another kernel writes or reads, and `let_dependents_launch` after: `launch_kernel`
    then lets it start while the kernel before it on its stream drains, where `kernels_overlap`. Its blocks
    are resident and waiting when that kernel ends, so its launch costs no gap (a graph captured from the
    stream keeps the same overlap)."""
    kernel.overlaps_previous = True
    return kernel


if SIMULATOR:
    def wait_for_prior_grids():
        """0: the simulator runs one kernel at a time."""
        return 0

    def let_dependents_launch():
        """Nothing: the simulator runs one kernel at a time."""
else:
    @_intrinsic
    def wait_for_prior_grids(typingctx):
        """Wait until the kernel before this one on its stream has finished and its writes are visible (at
        once unless this kernel was launched to overlap it), and return int32 0: a kernel adds it to the
        indices of what that kernel wrote, so that no load of those can be moved above the wait. Where kernels
        cannot overlap (`kernels_overlap`), only the constant 0."""
        def codegen(context, builder, sig, args):
            if not kernels_overlap():
                return _ir.Constant(_ir.IntType(32), 0)
            wait = _ir.InlineAsm(_ir.FunctionType(_ir.IntType(32), []),
                                 "griddepcontrol.wait;\n\tmov.u32 $0, 0;", "=r", side_effect=True)
            return builder.call(wait, [])
        return _numba_types.int32(), codegen

    @_intrinsic
    def let_dependents_launch(typingctx):
        """Let the next kernel on the stream start (if launched to overlap this one) once every block of this
        one has passed here. Kernels call it after `wait_for_prior_grids`: at most two kernels then share the
        GPU, one draining and one ramping up (run 49's kernels that let the next in at their start slowed the
        smallest shape 2x). Nothing where kernels cannot overlap."""
        def codegen(context, builder, sig, args):
            if kernels_overlap():
                trigger = _ir.InlineAsm(_ir.FunctionType(_ir.VoidType(), []), "griddepcontrol.launch_dependents;",
                                        "", side_effect=True)
                builder.call(trigger, [])
            return context.get_dummy_value()
        return _numba_types.void(), codegen


@cuda.jit(device=True, inline=True)
def begin_after_prior_grids():
    """The first statement of an `overlapping` kernel with nothing to do before the previous kernel's end:
    `wait_for_prior_grids`, then `let_dependents_launch`."""
    wait_for_prior_grids()
    let_dependents_launch()


if SIMULATOR:
    def f16x2_to_f32(word):
        """The two float16 values packed in int32 `word` (element 0 in the low half) as float32, exactly."""
        halves = np.array([word], dtype=np.int32).view(np.float16)
        return np.float32(halves[0]), np.float32(halves[1])

    @cuda.jit(device=True)
    def syncwarp():
        """A barrier for the lanes of a warp; the simulator, which has none, waits for the whole block (so a
        kernel must reach it the same number of times in every warp)."""
        cuda.syncthreads()

    def _butterfly(values, count, combine):
        """values[i] = the GPU's xor butterfly of combine over the warp's lanes, for i < count, through shared
        memory: each step combines a lane's value with the lane `step` away, own value first. The simulator
        waits for the whole block twice: every warp must call it the same number of times."""
        exchange = cuda.shared.array((1024, WARP_MAX_VALUES), np.float32)
        tid = cuda.threadIdx.x
        first = tid - tid % 32
        cuda.syncthreads()
        for i in range(count):
            exchange[tid, i] = values[i]
        cuda.syncthreads()
        for i in range(count):
            lanes = [exchange[first + lane, i] for lane in range(32)]
            for step in (16, 8, 4, 2, 1):
                lanes = [np.float32(combine(lanes[lane], lanes[lane ^ step])) for lane in range(32)]
            values[i] = lanes[tid % 32]

    @cuda.jit(device=True)
    def warp_max(values, count):
        """values[i] = its largest value across the warp's lanes, for i < count."""
        _butterfly(values, count, max)

    @cuda.jit(device=True)
    def warp_sum(values, count):
        """values[i] = the sum of its values across the warp's lanes, for i < count, in the GPU's order."""
        _butterfly(values, count, lambda a, b: a + b)
else:
    @_intrinsic
    def f16x2_to_f32(typingctx, word):
        """The two float16 values packed in int32 `word` (element 0 in the low half) as float32: two hardware
        conversions (exact for every half, subnormals and infinities too), where unpacking the bits in software
        takes about eight instructions a value."""
        signature = _numba_types.UniTuple(_numba_types.float32, 2)(word)

        def codegen(context, builder, sig, args):
            f32 = _ir.FloatType()
            convert = _ir.InlineAsm(_ir.FunctionType(_ir.LiteralStructType([f32, f32]), [_ir.IntType(32)]),
                                    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; "
                                    "cvt.f32.f16 $1, hi; }", "=f,=f,r")
            converted = builder.call(convert, args)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(converted, k) for k in range(2)])

        if word != _numba_types.int32:
            return None
        return signature, codegen

    @cuda.jit(device=True, inline=True)
    def syncwarp():
        """A barrier for the lanes of a warp (the simulator waits for the whole block instead)."""
        cuda.syncwarp(0xFFFFFFFF)

    @cuda.jit(device=True, inline=True)
    def warp_max(values, count):
        """values[i] = its largest value across the warp's lanes, for i < count: a butterfly of shuffles
        (every lane must take part)."""
        for i in range(count):
            top = values[i]
            for step in (16, 8, 4, 2, 1):
                top = max(top, cuda.shfl_xor_sync(0xFFFFFFFF, top, step))
            values[i] = top

    @cuda.jit(device=True, inline=True)
    def warp_sum(values, count):
        """values[i] = the sum of its values across the warp's lanes, for i < count: a butterfly of shuffles,
        which gives every lane the same bits (each step adds the same two numbers on both lanes), in a fixed
        order (every lane must take part)."""
        for i in range(count):
            total = values[i]
            for step in (16, 8, 4, 2, 1):
                total = total + cuda.shfl_xor_sync(0xFFFFFFFF, total, step)
            values[i] = total


def free_device_bytes() -> int:
    """The device's free memory once every dropped device array is returned: numba frees them later, in
    batches, so a buffer dropped just before (the ceilings' 4 GiB read) could still count as taken, and be
    returned during what is measured next (run 32 read an engine's start as 4 GiB less than its plan)."""
    gc.collect()
    cuda.current_context().deallocations.clear()
    return cuda.current_context().get_memory_info()[0]


def aligned16(array) -> bool:
    """Whether `load4` may read this device array at every index that is a multiple of 4 along its last axis:
    its start and its row strides are multiples of 16 bytes (the simulator's arrays always may)."""
    if SIMULATOR or array.size == 0:
        return True
    return array.device_ctypes_pointer.value % 16 == 0 and all(stride % 16 == 0 for stride in array.strides[:-1])


def check_aligned(what: str, array) -> None:
    """Refuse an array that `load4` cannot read at its rows' starts (`aligned16`), before a launch faults."""
    if not aligned16(array):
        raise ValueError(f"{what}: 16-byte loads read its rows, and this array starts or steps at an address "
                         "that is not a multiple of 16 bytes")


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
    argument types' identities; the parameters go to the driver's cuLaunchKernel as one reused buffer of
    8-byte slots (cuda.core's launch wrapped them and the stream anew each call: about 30 us a launch of a
    MoE kernel's 115 parameters, BENCHMARKS.md). A kernel's first launch for its argument types loads it from
    the disk cache (`kernel_cache`) or compiles it and stores it there. A kernel marked `overlapping` may
    start while the previous kernel on the stream drains."""
    if SIMULATOR:
        kernel[griddim, blockdim, stream](*args)
        return
    types, params = [], []
    for value in args:
        entry = _marshalled_arrays.get(id(value))
        if entry is None or entry[0]() is not value:
            if not isinstance(value, _DeviceNDArray):
                ty = _scalar_type(kernel, value)
                types.append(ty)
                params.append(_scalar_bits(ty, value))
                continue
            entry = _marshal_array(kernel, value)
        types.append(entry[1])
        params.extend(entry[2])
    key = (id(kernel), *map(id, types))
    found = _functions.get(key)
    if found is None:       # the types and dispatcher are kept alive, so their ids stay theirs
        function = _kernel_function(kernel, tuple(types))
        overlaps = getattr(kernel, "overlaps_previous", False) and kernels_overlap()
        found = _functions[key] = function.handle, function, tuple(types), kernel, overlaps
    slots = _param_slots.get(len(params))
    if slots is None:       # values, and the pointer to each that the driver reads
        values = np.zeros(len(params), np.uint64)
        addresses = values.ctypes.data + 8 * np.arange(len(params), dtype=np.uint64)
        slots = _param_slots[len(params)] = values, addresses
    values, pointers = slots
    values[:] = params      # the driver copies them at the call, so the buffer is free again on return
    shape = (griddim, blockdim)
    dims = _dims_of.get(shape)
    if dims is None:
        dims = _dims_of[shape] = (*_dims(griddim), *_dims(blockdim))
    if found[4]:
        err, = _driver.cuLaunchKernelEx(_overlapping_config(dims, stream), found[0], pointers.ctypes.data, 0)
    else:
        err, = _driver.cuLaunchKernel(found[0], *dims, 0, _stream_handle(stream), pointers.ctypes.data, 0)
    if err != _driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"launching {getattr(kernel, '__name__', kernel)} on grid {griddim} x {blockdim} "
                           f"failed: {err}")


def _overlapping_config(dims: tuple, stream):
    """The launch configuration of a kernel of these dimensions on this stream that may overlap the previous
    kernel (programmatic stream serialization), made once per (dimensions, stream)."""
    key = (dims, int(stream.handle) if stream else 0)      # `_stream_handle`'s number, without its object
    config = _overlapping_configs.get(key)
    if config is None:
        attribute = _driver.CUlaunchAttribute()
        attribute.id = _driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = _overlapping_configs[key] = _driver.CUlaunchConfig()
        (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.blockDimY,
         config.blockDimZ) = dims
        config.sharedMemBytes = 0
        config.hStream = _stream_handle(stream)
        config.attrs = [attribute]
        config.numAttrs = 1
    return config


def kernel_counts() -> dict:
    """How this process got its kernels: loaded from the disk cache, compiled (and stored), or compiled with
    no cache entry (a kernel whose code `kernel_cache` cannot read, or the cache turned off)."""
    return dict(_kernel_counts)


def _kernel_function(kernel, types: tuple):
    """The driver's function for `kernel` at these argument types: from the disk cache, else compiled by numba
    and stored there."""
    capability = cuda.get_current_device().compute_capability
    entry_key = kernel_cache.key(kernel.py_func, types, capability, kernel.targetoptions)
    stored = kernel_cache.load(entry_key)
    if stored is not None:
        name, cubin = stored
        try:
            module = cuda.current_context().create_module_image(_ObjectCode.from_cubin(cubin))
            function = module.get_function(name).kernel
        except Exception:       # a damaged or foreign entry: compile instead, and overwrite it
            function = None
        if function is not None:
            _kernel_counts["loaded"] += 1
            return function
    library = kernel.compile(types)._codelibrary
    if entry_key is None or kernel_cache.folder() is None:
        _kernel_counts["compiled, not cached"] += 1
    else:
        kernel_cache.store(entry_key, library._entry_name, library.get_cubin().code)
        _kernel_counts["compiled"] += 1
    return library.get_cufunc().kernel


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
    _check_rows(dst, dst_row, src, src_row, rows)
    if SIMULATOR:
        if to_host:
            dst[dst_row:dst_row + rows] = src[src_row:src_row + rows].copy_to_host(stream=stream)
        else:
            dst[dst_row:dst_row + rows].copy_to_device(src[src_row:src_row + rows], stream=stream)
        return
    host_at = host.ctypes.data + (dst_row if to_host else src_row) * row_bytes
    device_at = device.device_ctypes_pointer.value + (src_row if to_host else dst_row) * row_bytes
    if to_host:
        err, = _driver.cuMemcpyDtoHAsync(host_at, device_at, rows * row_bytes, _stream_handle(stream))
    else:
        err, = _driver.cuMemcpyHtoDAsync(device_at, host_at, rows * row_bytes, _stream_handle(stream))
    if err != _driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"an asynchronous copy of {rows * row_bytes} bytes failed: {err}")


def _check_rows(dst, dst_row: int, src, src_row: int, rows: int) -> None:
    if not (0 <= src_row <= src_row + rows <= src.shape[0] and 0 <= dst_row <= dst_row + rows <= dst.shape[0]):
        raise ValueError(f"rows {src_row}..{src_row + rows} into {dst_row}..{dst_row + rows}: outside "
                         f"{src.shape[0]} and {dst.shape[0]} rows")


def copy_into_rows(dst, dst_row: int, offset_bytes: int, src, src_row: int, rows: int, stream) -> None:
    """Rows src_row.. of a page-locked host array into rows dst_row.. of a 2-D uint8 device array, each at
    byte offset_bytes of its row (rows of different lengths: a source row is a part of a longer destination
    row, as an expert matrix is of a blob-major slot), asynchronous on `stream`: one pitched driver copy."""
    row_bytes = src.strides[0]
    if not src.flags.c_contiguous or offset_bytes + row_bytes > dst.shape[1] or dst.dtype != np.uint8:
        raise ValueError(f"copy_into_rows: rows of {row_bytes} bytes at offset {offset_bytes} do not fit "
                         f"uint8 rows of {dst.shape[1]} bytes")
    _check_rows(dst, dst_row, src, src_row, rows)
    if SIMULATOR:
        flat = src.reshape(src.shape[0], -1).view(np.uint8)
        for i in range(rows):
            dst[dst_row + i, offset_bytes:offset_bytes + row_bytes].copy_to_device(flat[src_row + i], stream=stream)
        return
    copy = _driver.CUDA_MEMCPY2D()
    copy.srcMemoryType = _driver.CUmemorytype.CU_MEMORYTYPE_HOST
    copy.srcHost = src.ctypes.data + src_row * row_bytes
    copy.srcPitch = row_bytes
    copy.dstMemoryType = _driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    copy.dstDevice = dst.device_ctypes_pointer.value + dst_row * dst.strides[0] + offset_bytes
    copy.dstPitch = dst.strides[0]
    copy.WidthInBytes = row_bytes
    copy.Height = rows
    err, = _driver.cuMemcpy2DAsync(copy, _stream_handle(stream))
    if err != _driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"an asynchronous copy of {rows} rows of {row_bytes} bytes failed: {err}")


if not SIMULATOR:
    from cuda.bindings import driver as _driver
    from cuda.core import ObjectCode as _ObjectCode
    from numba.cuda.cudadrv.devicearray import DeviceNDArray as _DeviceNDArray

_marshalled_arrays = {}     # id(device array) -> (weak reference, numba type, kernel parameters)
_functions = {}             # (id(dispatcher), id(each argument's type)...) -> (driver handle, its kernel, types,
#                             dispatcher, whether it overlaps the kernel before it)
_dims_of = {}               # (grid, block) -> the six dimensions cuLaunchKernel takes
_param_slots = {}           # parameter count -> (uint64 values, their addresses): launch_kernel's buffer
_overlapping_configs = {}   # (dimensions, stream handle) -> the CUlaunchConfig of an overlapping launch
_scalar_types = {}          # Python or numpy scalar type -> numba type
_kernel_counts = {"loaded": 0, "compiled": 0, "compiled, not cached": 0}


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


def _scalar_bits(ty, value) -> int:
    """A scalar as numba's kernels take it, as the unsigned integer whose low bytes (little-endian) hold its C
    value: the driver reads the parameter's own size from its 8-byte slot."""
    if isinstance(ty, _numba_types.Boolean):
        return int(bool(value))
    if isinstance(ty, _numba_types.Integer):
        low = -(1 << (ty.bitwidth - 1)) if ty.signed else 0
        if not low <= value < low + (1 << ty.bitwidth):
            raise OverflowError(f"{value} does not fit a kernel argument of type {ty}")
        return int(value) & ((1 << ty.bitwidth) - 1)
    if ty == _numba_types.float32:
        return int(np.float32(value).view(np.uint32))
    if ty == _numba_types.float64:
        return int(np.float64(value).view(np.uint64))
    raise TypeError(f"a kernel argument of type {ty}: launch_kernel takes device arrays, integers, floats and bools")


def _marshal_array(kernel, array) -> tuple:
    """A device array as numba's kernels take it: meminfo and parent (null), size, item size, data pointer,
    shape, strides in bytes."""
    params = (0, 0, array.size, array.dtype.itemsize, array.device_ctypes_pointer.value, *array.shape,
              *array.strides)
    key = id(array)
    entry = _marshalled_arrays[key] = (weakref.ref(array), kernel.typeof_pyval(array), params)
    weakref.finalize(array, _marshalled_arrays.pop, key, None)
    return entry


def _stream_handle(stream):
    """The driver's handle of a numba stream; 0 or None: the default (legacy) stream."""
    return _driver.CUstream(int(stream.handle) if stream else 0)


def _dims(dims) -> tuple:
    """(x, y, z) of a grid or block given as an int or a tuple of 1-3 ints."""
    dims = tuple(int(d) for d in dims) if isinstance(dims, tuple) else (int(dims),)
    return dims + (1,) * (3 - len(dims))


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
        handle = _stream_handle(stream)
        mode = _driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        self._checked(_driver.cuStreamBeginCapture(handle, mode))
        try:
            enqueue(stream)
        finally:
            self.graph = self._checked(_driver.cuStreamEndCapture(handle))
        self.executable = self._checked(_driver.cuGraphInstantiate(self.graph, 0))

    def _checked(self, result):
        err, *rest = result
        if err != _driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def replay(self, stream) -> None:
        if SIMULATOR:
            self.enqueue(stream)
            return
        self._checked(_driver.cuGraphLaunch(self.executable, _stream_handle(stream)))

    def close(self) -> None:
        if self.executable is not None:
            self._checked(_driver.cuGraphExecDestroy(self.executable))
            self._checked(_driver.cuGraphDestroy(self.graph))
            self.executable = self.graph = None


__all__ = ["SIMULATOR", "cuda", "available", "device_name", "bits_to_f32", "f32_to_bits", "roundf", "CapturedGraph",
           "mapped_device_view", "mapped_filled", "mapped_host_view", "event_done", "launch_kernel", "kernel_counts",
           "copy_rows", "load4", "aligned16", "check_aligned", "f16x2_to_f32", "syncwarp", "warp_max", "warp_sum", "WARP_MAX_VALUES",
           "better", "free_device_bytes", "kernels_overlap", "overlapping", "begin_after_prior_grids", "wait_for_prior_grids",
           "let_dependents_launch", "SHARED_BYTES", "SHARED_ALIGN", "U", "IDX",
           "BIDX"]
