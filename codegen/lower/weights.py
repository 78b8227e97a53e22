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
  Q4_K  data uint8   (..., n_out, n_in // 2)   each 32-value sub-block's quants as a Q4_0 block holds them
                                               (GGUF puts sub-blocks 2i and 2i + 1 in the low and high nibbles
                                               of the same 32 bytes), unsigned; scales (..., n_out, n_in // 32)
                                               float16-sized: each 256-value block's 16 header bytes as stored
                                               (d, dmin, the 12 bytes of 6-bit sub-block scales and mins)
  Q5_K  data uint8   (..., n_out, 5 * n_in // 8)   each 128 values of a 256-value block (4 sub-blocks s of 32)
                                               in 80 bytes: 64 of low nibbles, each sub-block's 16 as Q4_0
                                               holds a block's (byte j: value j low, j + 16 high), then 4 words
                                               p of high bits, bit 8k + 4h + s of word p the fifth bit of value
                                               16h + 4p + k of sub-block s; quants unsigned; scales as Q4_K's
  Q6_K  data uint8   (..., n_out, 3 * n_in // 4)   each 64 values v = 0..63 of a 256-value block in 48 bytes:
                                               byte b < 16 holds v = b and 16 + b (low 4 bits; low, high
                                               nibble), byte 16 + b v = 32 + b and 48 + b, byte 32 + b the
                                               high 2 bits of v = b, 16 + b, 32 + b, 48 + b (bits 0-1 .. 6-7),
                                               quants unsigned (value + 32); scales (..., n_out, 9 * n_in // 256)
                                               float16-sized: each block's 16 int8 run scales, then d, as stored
"""

from dataclasses import dataclass

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from planner.architecture import tensor_role
from planner.errors import StratumError
from planner.model import SCALE_BYTES, SCALES_APART, split_bytes

KERNEL_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K)
_FLOAT_DTYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}
QUANT_BLOCK = 32     # elements per Q8_0 / Q4_0 block, and per Q4_K / Q5_K sub-block: what a scale covers
Q4_K_HEADER_BYTES = 16  # a Q4_K (and Q5_K) block's d, dmin (float16) and 12 bytes of 6-bit sub-block scales and mins
HEADER_AT_END = (T.Q6_K,)   # GGUF stores these types' scales after their quants, the others' before


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
    block = max(QUANT_BLOCK, GGML_QUANT_SIZES[ggml_type][0]) if ggml_type in SCALES_APART else 1
    if shape[-1] % block:
        raise StratumError(f"a {ggml_type.name} row of {shape[-1]} values is not whole blocks of {block}")


SWIGLU_PAIRS = (("ffn_gate", "ffn_up"), ("ffn_gate_shexp", "ffn_up_shexp"), ("ffn_gate_exps", "ffn_up_exps"))


def check_swiglu_types(model) -> None:
    """A SwiGLU kernel reads its gate and up matrices as one type: a model that stores them in two is refused."""
    types = {t.name: t.ggml_type for t in model.tensors}
    for name, gate in types.items():
        for gate_role, up_role in SWIGLU_PAIRS:
            if tensor_role(name) == gate_role:
                up_name = name.replace(f".{gate_role}.", f".{up_role}.", 1)
                if types.get(up_name, gate) != gate:
                    raise StratumError(f"{name} is {gate.name} but {up_name} is {types[up_name].name}: the SwiGLU "
                                       "kernel reads a gate and its up in one type", source=str(model.source))


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
    (data_shape, data_dtype), scales_shape = packed_layout(ggml_type, shape)
    header = SCALE_BYTES[ggml_type]
    at = type_size - header if ggml_type in HEADER_AT_END else 0
    scales = blocks[:, at:at + header].copy().view(np.float16).reshape(scales_shape)
    quants_bytes = np.delete(blocks, np.s_[at:at + header], axis=1)     # a new array: the one copy
    if ggml_type == T.Q4_K:
        quants_bytes = _q4_k_sub_blocks(quants_bytes)
    elif ggml_type == T.Q5_K:
        quants_bytes = _q5_k_chunks(_q5_k_quants(quants_bytes))
    elif ggml_type == T.Q6_K:
        quants_bytes = _q6_k_chunks(_q6_k_quants(quants_bytes))
    return PackedWeight(ggml_type, shape, quants_bytes.reshape(-1).view(data_dtype).reshape(data_shape), scales)


def _q4_k_sub_block_values(quants_bytes: np.ndarray) -> np.ndarray:
    """(blocks, 128) Q4_K quant bytes as GGUF stores them (32-byte groups g: sub-block 2g in the low nibbles,
    2g + 1 in the high) -> (blocks, 256) nibbles in value order."""
    groups = quants_bytes.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (groups & 0xF).reshape(-1, 256)


def _q4_k_quant_bytes(values: np.ndarray) -> np.ndarray:
    """`_q4_k_sub_block_values`' inverse: (blocks, 128) bytes in GGUF's order."""
    halves = values.reshape(-1, 4, 2, 32)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k_sub_blocks(quants_bytes: np.ndarray) -> np.ndarray:
    """(blocks, 128) Q4_K quant bytes as GGUF stores them -> each sub-block's 16 bytes in Q4_0's order (byte j:
    value j low, j + 16 high)."""
    values = _q4_k_sub_block_values(quants_bytes).reshape(-1, 8, 2, 16)     # [block, sub-block, half, j]
    return (values[:, :, 0] | (values[:, :, 1] << 4)).reshape(-1)


def _q4_k_groups(data: np.ndarray) -> np.ndarray:
    """`_q4_k_sub_blocks`' inverse: (blocks, 128) bytes in GGUF's order."""
    sub_blocks = data.reshape(-1, 8, 16)
    return _q4_k_quant_bytes(np.concatenate([sub_blocks & 0xF, sub_blocks >> 4], axis=2))


def _q5_k_quants(quants_bytes: np.ndarray) -> np.ndarray:
    """(blocks, 256) unsigned 5-bit quants of Q5_K blocks' qh and qs bytes as GGUF stores them (gguf-py's
    Q5_K.dequantize_blocks: sub-block s's value l has bit s of qh byte l above the nibbles of qs that Q4_K
    would hold there)."""
    qh, qs = quants_bytes[:, :32], quants_bytes[:, 32:]
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1     # [block, s, l]
    return _q4_k_sub_block_values(qs) | (high.reshape(-1, 256) << 4)


def _q5_k_gguf(quants: np.ndarray) -> np.ndarray:
    """`_q5_k_quants`' inverse: (blocks, 160) qh and qs bytes."""
    values = quants.reshape(-1, 8, 32)
    qh = ((values >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8)
    return np.concatenate([qh, _q4_k_quant_bytes(values & 0xF)], axis=1)


def _q5_k_chunks(quants: np.ndarray) -> np.ndarray:
    """(blocks, 256) 5-bit quants -> (blocks, 160) bytes in the kernels' layout (module doc)."""
    values = quants.reshape(-1, 2, 4, 2, 16)                  # [block, chunk, s, h, j]
    low = values & 0xF
    nibbles = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(-1, 2, 64)
    high = (values >> 4).reshape(-1, 2, 4, 2, 4, 4)           # [block, chunk, s, h, p, k]
    shifts = (4 * np.arange(2).reshape(2, 1) + np.arange(4).reshape(1, 4)).astype(np.uint8)      # [h, s] -> 4h + s
    bits = (high << shifts.T.reshape(1, 1, 4, 2, 1, 1)).sum(axis=(2, 3), dtype=np.uint8)     # [block, chunk, p, k]
    return np.concatenate([nibbles, bits.reshape(-1, 2, 16)], axis=2).reshape(-1, 160)


def _q5_k_from_chunks(data: np.ndarray) -> np.ndarray:
    """`_q5_k_chunks`' inverse."""
    chunks = data.reshape(-1, 2, 80)
    nibbles = chunks[:, :, :64].reshape(-1, 2, 4, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    bits = chunks[:, :, 64:].reshape(-1, 2, 1, 1, 4, 4)       # [block, chunk, -, -, p, k]
    shifts = (4 * np.arange(2).reshape(1, 2) + np.arange(4).reshape(4, 1)).astype(np.uint8)      # [s, h] -> 4h + s
    high = (bits >> shifts.reshape(1, 1, 4, 2, 1, 1)) & 1     # [block, chunk, s, h, p, k]
    return ((nibbles & 0xF) | (high.reshape(-1, 2, 4, 2, 16) << 4)).reshape(-1, 256)


def _q6_k_quants(quants_bytes: np.ndarray) -> np.ndarray:
    """(blocks, 256) unsigned 6-bit quants of Q6_K blocks' ql and qh bytes as GGUF stores them (gguf-py's
    Q6_K.dequantize_blocks: value 128h + 64s + b has the nibble s of ql byte 64h + b; value 128h + 32s + j
    the bits 2s, 2s + 1 of qh byte 32h + j)."""
    ql, qh = quants_bytes[:, :128], quants_bytes[:, 128:]
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0xF
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return low.reshape(-1, 256) | (high.reshape(-1, 256) << 4)


def _q6_k_gguf(quants: np.ndarray) -> np.ndarray:
    """`_q6_k_quants`' inverse: (blocks, 192) ql and qh bytes."""
    low = (quants & 0xF).reshape(-1, 2, 2, 64)
    ql = low[:, :, 0] | (low[:, :, 1] << 4)
    high = (quants >> 4).reshape(-1, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64)], axis=1)


def _q6_k_chunks(quants: np.ndarray) -> np.ndarray:
    """(blocks, 256) 6-bit quants -> (blocks, 192) bytes in the kernels' layout (module doc)."""
    runs = quants.reshape(-1, 4, 4, 16)                    # [block, chunk, run of 16 values, b]
    low, high = runs & 0xF, runs >> 4
    nibbles = np.concatenate([low[:, :, 0] | (low[:, :, 1] << 4), low[:, :, 2] | (low[:, :, 3] << 4)], axis=2)
    bits = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([nibbles, bits], axis=2).reshape(-1, 192)


def _q6_k_from_chunks(data: np.ndarray) -> np.ndarray:
    """`_q6_k_chunks`' inverse."""
    chunks = data.reshape(-1, 4, 48)
    a, b, bits = chunks[:, :, :16], chunks[:, :, 16:32], chunks[:, :, 32:]
    low = np.stack([a & 0xF, a >> 4, b & 0xF, b >> 4], axis=2)
    high = np.stack([(bits >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    return (low | (high << 4)).reshape(-1, 256)


def unpack(packed: PackedWeight) -> np.ndarray:
    """The GGUF bytes back (uint8, rows of the GGUF row size): `pack`'s inverse."""
    if packed.scales is None:
        return packed.data.reshape(-1).view(np.uint8).copy()
    header = SCALE_BYTES[packed.ggml_type]
    n_blocks = packed.scales.size * 2 // header
    quants_bytes = packed.data.reshape(n_blocks, -1).view(np.uint8)
    if packed.ggml_type == T.Q4_K:
        quants_bytes = _q4_k_groups(quants_bytes)
    elif packed.ggml_type == T.Q5_K:
        quants_bytes = _q5_k_gguf(_q5_k_from_chunks(quants_bytes))
    elif packed.ggml_type == T.Q6_K:
        quants_bytes = _q6_k_gguf(_q6_k_from_chunks(quants_bytes))
    headers = packed.scales.reshape(n_blocks, -1).view(np.uint8)
    parts = [quants_bytes, headers] if packed.ggml_type in HEADER_AT_END else [headers, quants_bytes]
    return np.concatenate(parts, axis=1).reshape(-1)


def quantize(values: np.ndarray, ggml_type: T) -> PackedWeight:
    """Float values quantized as gguf-py (bit-exact with ggml) does, then packed: how tests make weights.
    gguf-py cannot quantize the K-quants: `quantize_q4_k`, `quantize_q5_k` and `quantize_q6_k` do."""
    ggml_type = T(ggml_type)
    values = np.ascontiguousarray(values, dtype=np.float32)
    check_kernel_type(ggml_type, values.shape)
    quantizer = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}.get(ggml_type)
    raw = quantizer(values) if quantizer else quants.quantize(values, ggml_type)
    return pack(raw, ggml_type, values.shape)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """GGUF Q6_K bytes of float values (rows of whole 256-value blocks): each 16-value run's step max|x| / 31
    as an int8 multiple of the block's d, each quant rounded into [-32, 31]. A plain rounding, not llama.cpp's
    search: any valid Q6_K bytes serve the kernels' tests."""
    runs = values.reshape(-1, 16, 16).astype(np.float64)
    step = np.abs(runs).max(axis=2) / 31
    d = (step.max(axis=1) / 127).astype(np.float16)
    sc = np.clip(np.round(step / np.maximum(d.astype(np.float64), 1e-30)[:, None]), 0, 127).astype(np.int8)
    step_q = d.astype(np.float64)[:, None] * sc
    q = np.clip(np.round(runs / np.maximum(step_q, 1e-30)[:, :, None]), -32, 31) + 32
    raw = np.concatenate([_q6_k_gguf(q.astype(np.uint8).reshape(-1, 256)), sc.view(np.uint8),
                          d.reshape(-1, 1).view(np.uint8)], axis=1)
    return raw.reshape(*values.shape[:-1], -1)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """GGUF Q4_K bytes of float values (rows of whole 256-value blocks): `_quantize_sub_blocks` at 15 steps."""
    header, q = _quantize_sub_blocks(values, 15)
    return np.concatenate([header, _q4_k_quant_bytes(q)], axis=1).reshape(*values.shape[:-1], -1)


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    """GGUF Q5_K bytes of float values (rows of whole 256-value blocks): `_quantize_sub_blocks` at 31 steps."""
    header, q = _quantize_sub_blocks(values, 31)
    return np.concatenate([header, _q5_k_gguf(q)], axis=1).reshape(*values.shape[:-1], -1)


def _quantize_sub_blocks(values: np.ndarray, steps: int) -> tuple:
    """(16-byte headers, (blocks, 256) unsigned quants) of a K-quant with sub-block mins (Q4_K, Q5_K): each
    32-value sub-block's range [min, max] split into `steps` steps, its step and -min as 6-bit multiples of the
    block's d and dmin. A plain rounding, not llama.cpp's search for the best scales: any valid bytes serve the
    kernels' tests."""
    sub = values.reshape(-1, 8, QUANT_BLOCK).astype(np.float64)
    low = np.maximum(-sub.min(axis=2), 0.0)                  # the sub-block's offset: value = step * q - low
    step = (sub.max(axis=2) + low) / steps
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = (low.max(axis=1) / 63).astype(np.float16)
    sc = np.clip(np.round(step / np.maximum(d.astype(np.float64), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(low / np.maximum(dmin.astype(np.float64), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    step_q = d.astype(np.float64)[:, None] * sc
    low_q = dmin.astype(np.float64)[:, None] * m
    q = np.clip(np.round((sub + low_q[:, :, None]) / np.maximum(step_q, 1e-30)[:, :, None]), 0, steps)
    packed_scales = np.empty((len(sub), 12), np.uint8)       # gguf-py's Q4_K.get_scale_min, inverted
    packed_scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed_scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    packed_scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    header = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed_scales],
                            axis=1)
    return header, q.astype(np.uint8).reshape(-1, 256)


def dequantize(packed: PackedWeight) -> np.ndarray:
    """float64 values, dequantized by gguf-py from the GGUF bytes: the reference for every matmul kernel."""
    raw = unpack(packed).reshape(*packed.shape[:-1], -1)
    return quants.dequantize(raw, packed.ggml_type).astype(np.float64).reshape(packed.shape)


def iter_gguf(path, header):
    """(name, PackedWeight) for every tensor of a GGUF file, one at a time (the file is memory-mapped): a
    model larger than host memory is never held twice. A file holding a type no kernel reads is refused here,
    before any tensor is read (an engine's start, before it allocates)."""
    unread = [t for t in header.tensors if t.ggml_type not in KERNEL_TYPES]
    if unread:
        types = sorted({t.ggml_type.name for t in unread})
        raise StratumError(f"{len(unread)} of its {len(header.tensors)} tensors are {', '.join(types)}, which no "
                           f"kernel reads yet (the first: {unread[0].name}); the kernels read "
                           f"{', '.join(t.name for t in KERNEL_TYPES)}", source=str(path))
    return _packed_tensors(path, header)


def _packed_tensors(path, header):
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
    quant_bytes, scale_bytes = split_bytes(ggml_type, shape[-1])
    scales = (*shape[:-1], scale_bytes // 2)
    if ggml_type == T.Q8_0:
        return (shape, np.dtype(np.int8)), scales
    return ((*shape[:-1], quant_bytes), np.dtype(np.uint8)), scales


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
