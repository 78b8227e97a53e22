"""GGUF tensor data repacked at load into the layouts the kernels read, byte for byte the same size.

A quantized GGUF row interleaves each block's scale with its quants (Q8_0: 2 + 32 bytes; Q4_0: 2 + 16).
Kernels want the quants of a row contiguous and aligned (so a thread loads 4 of them with one 32-bit read)
and the scales apart, so a row is split into `data` and `scales` arrays. Nothing is added or dropped: a
packed weight has exactly the GGUF tensor's bytes, which is what the planner counted.

Layouts, in numpy order (leading dims such as `n_expert` first, then rows = outputs, then inputs):
  F32   data float32 (..., n_out, n_in)
  F16   data float16 (..., n_out, n_in)
  BF16  data uint16  (..., n_out, n_in)        the high half of a float32
  Q8_0  data int8    (..., n_out, n_in)        scales float16 (..., n_out, n_in // 32)
  Q4_0  data uint8   (..., n_out, n_in // 2)   the block's 16 bytes in GGUF order (byte j: element j in the
                                               low nibble, element j + 16 in the high), stored value + 8;
                                               scales float16 (..., n_out, n_in // 32)
"""

from dataclasses import dataclass

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from planner.errors import StratumError
from planner.model import SCALES_APART

KERNEL_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0)
_FLOAT_DTYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}
QUANT_BLOCK = 32     # elements per Q8_0 / Q4_0 block


@dataclass(frozen=True)
class PackedWeight:
    ggml_type: T
    shape: tuple                 # elements, numpy order: (..., n_out, n_in)
    data: np.ndarray
    scales: np.ndarray | None    # float16, quantized types only

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)


def check_kernel_type(ggml_type: T, shape: tuple) -> None:
    """Refuse a type no kernel reads, or a quantized row that is not whole blocks."""
    if ggml_type not in KERNEL_TYPES:
        raise StratumError(f"tensor type {ggml_type.name} has no kernel yet; the kernels read "
                           f"{', '.join(t.name for t in KERNEL_TYPES)}")
    if ggml_type in SCALES_APART and shape[-1] % QUANT_BLOCK:
        raise StratumError(f"a {ggml_type.name} row of {shape[-1]} values is not whole blocks of {QUANT_BLOCK}")


def pack(raw: np.ndarray, ggml_type: T, shape: tuple) -> PackedWeight:
    """Repack one tensor's GGUF data (any dtype; its bytes are read as stored) of numpy `shape`."""
    ggml_type, shape = T(ggml_type), tuple(int(d) for d in shape)
    check_kernel_type(ggml_type, shape)
    raw_bytes = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    expected = int(np.prod(shape)) // block_size * type_size
    if raw_bytes.size != expected:
        raise StratumError(f"{ggml_type.name} tensor of shape {shape} needs {expected} bytes, got {raw_bytes.size}")
    if ggml_type in _FLOAT_DTYPES:
        return PackedWeight(ggml_type, shape, raw_bytes.view(_FLOAT_DTYPES[ggml_type]).reshape(shape).copy(), None)
    blocks = raw_bytes.reshape(-1, type_size)
    scales = blocks[:, :2].copy().view(np.float16).reshape(*shape[:-1], shape[-1] // QUANT_BLOCK)
    quants_bytes = blocks[:, 2:].reshape(-1)
    if ggml_type == T.Q8_0:
        data = quants_bytes.view(np.int8).reshape(shape).copy()
    else:
        data = quants_bytes.reshape(*shape[:-1], shape[-1] // 2).copy()
    return PackedWeight(ggml_type, shape, data, scales)


def unpack(packed: PackedWeight) -> np.ndarray:
    """The GGUF bytes back (uint8, rows of the GGUF row size): `pack`'s inverse."""
    if packed.scales is None:
        return packed.data.reshape(-1).view(np.uint8).copy()
    n_blocks = packed.scales.size
    quants_bytes = packed.data.reshape(n_blocks, -1).view(np.uint8)
    return np.concatenate([packed.scales.reshape(n_blocks, 1).view(np.uint8), quants_bytes], axis=1).reshape(-1)


def quantize(values: np.ndarray, ggml_type: T) -> PackedWeight:
    """Float values quantized as gguf-py (bit-exact with ggml) does, then packed: how tests make weights."""
    ggml_type = T(ggml_type)
    values = np.ascontiguousarray(values, dtype=np.float32)
    check_kernel_type(ggml_type, values.shape)
    return pack(quants.quantize(values, ggml_type), ggml_type, values.shape)


def dequantize(packed: PackedWeight) -> np.ndarray:
    """float64 values, dequantized by gguf-py from the GGUF bytes: the reference for every matmul kernel."""
    raw = unpack(packed).reshape(*packed.shape[:-1], -1)
    return quants.dequantize(raw, packed.ggml_type).astype(np.float64).reshape(packed.shape)


def iter_gguf(path, header):
    """(name, PackedWeight) for every tensor of a GGUF file, one at a time (the file is memory-mapped): a
    model larger than host memory is never held twice."""
    file = np.memmap(path, dtype=np.uint8, mode="r")
    for tensor in header.tensors:
        start = header.data_offset + tensor.offset
        if start + tensor.n_bytes > file.size:
            raise StratumError(f"tensor {tensor.name} runs past the end of the file (a truncated download?)",
                               source=str(path))
        yield tensor.name, pack(file[start:start + tensor.n_bytes], tensor.ggml_type, tuple(reversed(tensor.shape)))


def read_gguf(path, header) -> dict:
    """Every tensor of a GGUF file, packed: name -> PackedWeight."""
    return dict(iter_gguf(path, header))


def packed_layout(ggml_type, shape: tuple) -> tuple:
    """((data shape, data dtype), scales shape or None) of a packed weight of numpy `shape` (module doc)."""
    ggml_type, shape = T(ggml_type), tuple(int(d) for d in shape)
    check_kernel_type(ggml_type, shape)
    if ggml_type in _FLOAT_DTYPES:
        return (shape, np.dtype(_FLOAT_DTYPES[ggml_type])), None
    scales = (*shape[:-1], shape[-1] // QUANT_BLOCK)
    if ggml_type == T.Q8_0:
        return (shape, np.dtype(np.int8)), scales
    return ((*shape[:-1], shape[-1] // 2), np.dtype(np.uint8)), scales


def placeholder_scales(data):
    """The `scales` a type without scales passes (kernels take the same arguments for every type): one
    float16 view of the data's first bytes, never read; it allocates nothing."""
    return data.reshape(-1)[:1].view(np.float16)[:1]


@dataclass(frozen=True)
class DeviceWeight:
    """A packed weight on the device; what every matmul kernel takes. `scales` is a one-element placeholder
    for float types, so every kernel has the same arguments whatever its weight type."""
    ggml_type: T
    shape: tuple
    data: object                 # device array, layout as above
    scales: object               # device float16 array
    # expert slots blob-major (planner.model.SlotLayout): shape[0] slots, slot s's data and scales start
    # s * slot_bytes after slot 0's, in flat arrays; 0: the layout above
    slot_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.ggml_type in SCALES_APART else 0)


def upload(packed: PackedWeight, stream=0) -> DeviceWeight:
    from codegen.lower.cuda import cuda
    scales = packed.scales if packed.scales is not None else np.zeros(1, np.float16)
    return DeviceWeight(packed.ggml_type, packed.shape, cuda.to_device(packed.data, stream=stream),
                        cuda.to_device(scales, stream=stream))


def mapped_upload(packed: PackedWeight) -> DeviceWeight:
    """A packed weight in mapped pinned host memory (zero-copy: kernels read it over the bus, as they read the
    runtime's host copy of the experts)."""
    from codegen.lower.cuda import mapped_filled
    scales = packed.scales if packed.scales is not None else np.zeros(1, np.float16)
    return DeviceWeight(packed.ggml_type, packed.shape, mapped_filled(packed.data.shape, packed.data.dtype, packed.data),
                        mapped_filled(scales.shape, scales.dtype, scales))
