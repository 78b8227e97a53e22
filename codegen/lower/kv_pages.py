"""K/V pages: their layout, the element formats of their words, and the K/V store (a pass stores its K/V in
its RoPE launch, `codegen.lower.pointwise.make_rope`, through `block_store`; `make_kv_store` fills pages from
given K/V for tests and benchmarks).


K/V pages. A layer's K/V lives in `n_slots` slots of `page_tokens` positions; logical page
p = position // page_tokens is held in slot page_table[p] (an int32 device array: the runtime keeps a ring,
the kernels just follow the table). K and V have their own GGML types (`planner.kv`: f32 for tests, f16,
q8_0, q4_0 and mixes such as k8v4). Each of the four arrays is slot-major, a slot one contiguous row of each
(what the runtime streams to and from the host); within a slot, kv head, then position, then the head's row:

  data    int32 words (n_slots, n_kv * page_tokens * words): a head's row of `head_dim` values, packed:
            F32 one value a word; F16 two (element 2w in the low half); Q8_0 four int8 quants (element 4w
            in the low byte); Q4_0 eight nibbles, each 32-value block's 16 bytes in GGUF order (byte j holds
            element j in its low nibble and element j + 16 in its high one, stored value + 8)
  scales  float16 (n_slots, n_kv * page_tokens * head_dim // 32): Q8_0 / Q4_0 block scales; a (1, 1)
            placeholder for float types, so every kernel takes the same arguments

Nothing is added or dropped: the bytes are the planner's n_slots * page_tokens * (row_bytes(n_kv*dk, k_type)
+ row_bytes(n_kv*dv, v_type)). Stores quantize bit-exactly as gguf-py (ggml) does.
"""

import functools
from dataclasses import dataclass, replace

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.lower.cuda import (aligned16, begin_after_prior_grids, bits_to_f32, cuda, f32_to_bits, launch_kernel,
                                mapped_device_view, mapped_filled, overlapping, roundf)
from codegen.lower.weights import placeholder_scales
from planner.errors import StratumError
from planner.kv import KVType, parse_kv_type, row_bytes

QUANT_BLOCK = 32          # values per Q8_0 / Q4_0 block
KV_KINDS = (T.F32, T.F16, T.Q8_0, T.Q4_0)
ELEMENTS_PER_WORD = {T.F32: 1, T.F16: 2, T.Q8_0: 4, T.Q4_0: 8}
QUANTIZED = (T.Q8_0, T.Q4_0)

STORE_THREADS = 128


_F16_SCALE = np.float32(2.0 ** 112)      # a half's exponent bias moved to a float's
_F16_SUBNORMAL = np.float32(2.0 ** 24)   # a float below 2**-14 in units of the half's smallest subnormal
_ROUND_TO_INT = np.float32(2.0 ** 23)    # x + 2**23 - 2**23 rounds x (0 <= x < 2**23) to the nearest even int
_MAGIC = 0x4B000000                      # the float 2**23: its low mantissa bits hold a small integer exactly
_MAGIC_Q8 = np.float32(2.0 ** 23 + 128)  # quant byte ^ 0x80 in the mantissa -> int8 value
_MAGIC_Q4 = np.float32(2.0 ** 23 + 8)    # nibble in the mantissa -> nibble - 8
_Q8_MAX = np.float32(127)
_Q4_DIVISOR = np.float32(-8)
_Q4_OFFSET = np.float32(8.5)
_NOT_FUSED = np.float32(3.0e38)          # min(x, this) is x, but keeps x * y + c from becoming one FMA
_ONE = np.float32(1)
_ZERO = np.float32(0)


def kv_types(kv_type_name) -> KVType:
    kv = kv_type_name if isinstance(kv_type_name, KVType) else parse_kv_type(kv_type_name)
    for which, ggml_type in (("K", kv.k_type), ("V", kv.v_type)):
        if ggml_type not in KV_KINDS:
            raise StratumError(f"K/V type {kv.name}: {which} in {ggml_type.name} has no kernel; the attention "
                               f"kernels read {', '.join(t.name for t in KV_KINDS)}", field="kv")
    return kv


def check_head_dims(**dims) -> None:
    for name, value in dims.items():
        if value <= 0 or value % QUANT_BLOCK:
            raise StratumError(f"{name} = {value}: the K/V kernels need a positive multiple of {QUANT_BLOCK}")


# ---------------------------------------------------------------------------------------------------------
# pages


@dataclass(frozen=True)
class ArraySpec:
    """The shape and dtype of one K/V array, before it is allocated."""
    shape: tuple
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def _zeroed_device_array(shape, dtype):
    return cuda.to_device(np.zeros(shape, dtype))


@dataclass(frozen=True)
class KVPages:
    """A layer's K/V pages: ArraySpecs from `kv_arrays`, device arrays once allocated (layout: module doc)."""
    k_data: object
    k_scales: object
    v_data: object
    v_scales: object
    kv: KVType
    page_tokens: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int

    def arrays(self) -> tuple:
        return self.k_data, self.k_scales, self.v_data, self.v_scales

    def stored_arrays(self) -> tuple:
        """The arrays that hold bytes of their own: data, and scales where the type has them (a float type's
        scales are a placeholder view of its data)."""
        return tuple(array for array, quantized in ((self.k_data, True), (self.k_scales, self.kv.k_type in QUANTIZED),
                                                    (self.v_data, True), (self.v_scales, self.kv.v_type in QUANTIZED))
                     if quantized)

    @property
    def n_slots(self) -> int:
        return self.k_data.shape[0]

    @property
    def nbytes(self) -> int:
        """The planner's count: data, and scales where the type has them (placeholders are not counted)."""
        return (self.k_data.nbytes + self.v_data.nbytes + (self.k_scales.nbytes if self.kv.k_type in QUANTIZED
                else 0) + (self.v_scales.nbytes if self.kv.v_type in QUANTIZED else 0))

    def allocate(self, device_array=None) -> "KVPages":
        """The same pages as device arrays, each from `device_array(shape, dtype)` (the runtime carves them
        from its arena); by default fresh zeroed device arrays."""
        make = device_array or _zeroed_device_array
        return replace(self, **{name: make(a.shape, a.dtype) for name, a in zip(_ARRAYS, self.arrays())})


    def carve(self, array_at) -> "KVPages":
        """The same pages as views `array_at(shape, dtype)` hands out one after another (the runtime's K/V
        region), bytes as the planner counts them: scales a type lacks are a view of its data, not carved."""
        k_data = array_at(self.k_data.shape, self.k_data.dtype)
        k_scales = array_at(self.k_scales.shape, self.k_scales.dtype) if self.kv.k_type in QUANTIZED else \
            placeholder_scales(k_data).reshape(1, 1)
        v_data = array_at(self.v_data.shape, self.v_data.dtype)
        v_scales = array_at(self.v_scales.shape, self.v_scales.dtype) if self.kv.v_type in QUANTIZED else \
            placeholder_scales(v_data).reshape(1, 1)
        return replace(self, k_data=k_data, k_scales=k_scales, v_data=v_data, v_scales=v_scales)


_ARRAYS = ("k_data", "k_scales", "v_data", "v_scales")


@functools.cache
def page_locator(page_tokens: int):
    """locate(page_table, position) -> (its slot, or its page in the host copy; whether it is the host copy;
    its offset within the page): a device function the attention kernels read every position through."""
    @cuda.jit(device=True, inline=True)
    def locate(page_table, key):
        page = key // page_tokens
        slot = page_table[page]
        if slot >= 0:
            return slot, False, key - page * page_tokens
        return page, True, key - page * page_tokens
    return locate


def aligned_kernel_arrays(pages: KVPages, host_pages: KVPages | None, reader: str) -> tuple:
    """The pages' arrays, then their host copy's (`host_arrays`), as an attention kernel takes them; refused
    unless every data array starts and steps at a multiple of 16 bytes (the kernels read rows 16 bytes a load)."""
    arrays = (*pages.arrays(), *host_arrays(pages, host_pages))
    if not all(aligned16(a) for a in arrays[0::2]):
        raise ValueError(f"{reader} reads K/V rows 16 bytes a load: a K/V data array starts or steps at an address "
                         "that is not a multiple of 16 bytes")
    return arrays


def mapped_host_copy(pages: KVPages) -> KVPages:
    """`pages` (specs) as a host copy: zeroed mapped pinned memory, each array viewed once as the device array
    kernels take. Views made at each launch (4 arrays for each K/V store and attention node, each then marshalled
    anew: `launch_kernel` marshals an array object once) cost the demo about 1 ms a chunk (BENCHMARKS.md, runs
    21-22)."""
    return pages.allocate(lambda shape, dtype: mapped_device_view(mapped_filled(shape, dtype)))


def host_arrays(pages: KVPages, host_pages: KVPages | None) -> tuple:
    """The host copy's arrays (`mapped_host_copy`), or, with no host copy, the pages' own arrays in their place (then
    never read: every page has a slot)."""
    return pages.arrays() if host_pages is None else host_pages.arrays()


def _tensor_arrays(ggml_type: T, n_slots: int, page_tokens: int, n_head_kv: int, head_dim: int):
    words = n_head_kv * page_tokens * head_dim // ELEMENTS_PER_WORD[ggml_type]
    scales = (n_slots, n_head_kv * page_tokens * head_dim // QUANT_BLOCK) if ggml_type in QUANTIZED else (1, 1)
    return ArraySpec((n_slots, words), np.dtype(np.int32)), ArraySpec(scales, np.dtype(np.float16))


def kv_arrays(kv_type_name, n_slots: int, page_tokens: int, n_head_kv: int, head_dim_k: int,
              head_dim_v: int) -> KVPages:
    """The K/V pages of one layer as ArraySpecs; `.allocate()` makes them device arrays."""
    kv = kv_types(kv_type_name)
    check_head_dims(head_dim_k=head_dim_k, head_dim_v=head_dim_v)
    if n_slots <= 0 or page_tokens <= 0 or n_head_kv <= 0:
        raise StratumError(f"K/V pages need slots, page tokens and kv heads > 0 (got {n_slots}, {page_tokens}, "
                           f"{n_head_kv})")
    pages = KVPages(*_tensor_arrays(kv.k_type, n_slots, page_tokens, n_head_kv, head_dim_k),
                    *_tensor_arrays(kv.v_type, n_slots, page_tokens, n_head_kv, head_dim_v), kv=kv,
                    page_tokens=page_tokens, n_head_kv=n_head_kv, head_dim_k=head_dim_k, head_dim_v=head_dim_v)
    planned = n_slots * page_tokens * (row_bytes(n_head_kv * head_dim_k, kv.k_type)
                                       + row_bytes(n_head_kv * head_dim_v, kv.v_type))
    assert pages.nbytes == planned, (pages.nbytes, planned)
    return pages


# ---------------------------------------------------------------------------------------------------------
# element formats


@cuda.jit(device=True, inline=True)
def _half_to_f32(h):
    """The float32 value of half bits h (0..0xffff), exactly: subnormals, infinities and NaN too."""
    magnitude = h & 0x7FFF
    if magnitude >= 0x7C00:
        value = bits_to_f32(np.int32(0x7F800000 | ((magnitude & 0x3FF) << 13)))
    else:
        value = bits_to_f32(np.int32(magnitude << 13)) * _F16_SCALE
    return -value if h & 0x8000 else value


@cuda.jit(device=True, inline=True)
def _f32_to_half(x):
    """Half bits (0..0xffff) of float32 x, rounded to nearest even as numpy's astype(float16) does."""
    bits = f32_to_bits(x)
    sign = (bits >> 16) & 0x8000
    a = bits & 0x7FFFFFFF
    if a > 0x7F800000:
        h = 0x7E00
    elif a >= 0x477FF000:              # 65520 and above round to infinity
        h = 0x7C00
    elif a >= 0x38800000:              # a normal half: rebias the exponent, round the 13 dropped bits
        m = a - 0x38000000
        h = (m + 0xFFF + ((m >> 13) & 1)) >> 13
    else:                              # a subnormal half (or zero): round x * 2**24 to an integer
        scaled = abs(x) * _F16_SUBNORMAL
        h = np.int32((scaled + _ROUND_TO_INT) - _ROUND_TO_INT)
    return sign | h


def element_format(ggml_type: T):
    """(dim, value): element e of packed word w holds dim(w, e) of the row; value(word, e, scale) is it."""
    if ggml_type == T.F32:
        def dim(w, e):
            return w

        def value(word, e, scale):
            return bits_to_f32(word)
    elif ggml_type == T.F16:
        def dim(w, e):
            return 2 * w + e

        def value(word, e, scale):
            return _half_to_f32((word >> (16 * e)) & 0xFFFF)
    elif ggml_type == T.Q8_0:
        def dim(w, e):
            return 4 * w + e

        def value(word, e, scale):
            return (bits_to_f32(np.int32(_MAGIC | (((word >> (8 * e)) & 0xFF) ^ 0x80))) - _MAGIC_Q8) * scale
    else:
        def dim(w, e):
            return (w // 4) * QUANT_BLOCK + (w % 4) * 4 + e % 4 + 16 * (e // 4)

        def value(word, e, scale):
            nibble = (word >> (8 * (e % 4) + 4 * (e // 4))) & 0xF
            return (bits_to_f32(np.int32(_MAGIC | nibble)) - _MAGIC_Q4) * scale
    return cuda.jit(device=True, inline=True)(dim), cuda.jit(device=True, inline=True)(value)


def converted_element_format(ggml_type: T):
    """element_format for a typed view (one element a word): the hardware converts it, times the block scale."""
    quantized = ggml_type in QUANTIZED

    def dim(w, e):
        return w

    def value(element, e, scale):
        converted = np.float32(element)
        return converted * scale if quantized else converted
    return cuda.jit(device=True, inline=True)(dim), cuda.jit(device=True, inline=True)(value)


# ---------------------------------------------------------------------------------------------------------
# K/V store


# block writers: the 32 values x[row, col:col + 32] into a slot's words from `word` on (and scale `block`);
# float types write one word a thread (`part`: which one), quantized ones need the whole block's maximum


def _quantize_q8_0(x, row, col, data, scales, slot, word, block, part):
    amax = _ZERO
    for e in range(QUANT_BLOCK):
        amax = max(amax, abs(x[row, col + e]))
    d = amax / _Q8_MAX
    inverse = _ONE / d if d != _ZERO else _ZERO
    for w in range(QUANT_BLOCK // 4):
        packed = 0
        for e in range(4):
            packed |= (np.int32(roundf(x[row, col + 4 * w + e] * inverse)) & 0xFF) << (8 * e)
        data[slot, word + w] = packed
    scales[slot, block] = d


def _quantize_q4_0(x, row, col, data, scales, slot, word, block, part):
    amax = _ZERO
    signed_max = _ZERO
    for e in range(QUANT_BLOCK):
        if abs(x[row, col + e]) > amax:
            amax = abs(x[row, col + e])
            signed_max = x[row, col + e]
    d = signed_max / _Q4_DIVISOR
    inverse = _ONE / d if d != _ZERO else _ZERO
    for w in range(QUANT_BLOCK // 8):
        packed = 0
        for b in range(4):
            for high in range(2):
                scaled = min(x[row, col + 4 * w + b + 16 * high] * inverse, _NOT_FUSED)
                packed |= np.int32(min(15, np.int32(scaled + _Q4_OFFSET))) << (8 * b + 4 * high)
        data[slot, word + w] = packed
    scales[slot, block] = d


def _store_f32(x, row, col, data, scales, slot, word, block, part):
    data[slot, word + part] = f32_to_bits(x[row, col + part])


def _store_f16(x, row, col, data, scales, slot, word, block, part):
    data[slot, word + part] = _f32_to_half(x[row, col + 2 * part]) | (_f32_to_half(x[row, col + 2 * part + 1]) << 16)


_BLOCK_WRITERS = {T.F32: _store_f32, T.F16: _store_f16, T.Q8_0: _quantize_q8_0, T.Q4_0: _quantize_q4_0}
_WRITER_PARTS = {T.F32: QUANT_BLOCK, T.F16: QUANT_BLOCK // 2, T.Q8_0: 1, T.Q4_0: 1}   # threads per block


@functools.cache
def block_store(ggml_type: T, n_head_kv: int, head_dim: int, page_tokens: int):
    """(store, units a head): store(i, x, positions, page_table, data, scales, host_data, host_scales, through)
    writes unit i of x's rows (row, kv head, 32-value block, then the block's part: a thread per quantized block,
    per word of a float one) into its position's page, quantized: in the slot the page table gives (none when
    -1), and when `through`, into the host copy's page too (the same bits). A head's units are consecutive, so
    unit (row * n_head_kv + head) * units + u is its u-th."""
    ggml_type = T(ggml_type)
    blocks = head_dim // QUANT_BLOCK
    parts = _WRITER_PARTS[ggml_type]
    block_words = QUANT_BLOCK // ELEMENTS_PER_WORD[ggml_type]
    write = cuda.jit(device=True, inline=True)(_BLOCK_WRITERS[ggml_type])

    @cuda.jit(device=True, inline=True)
    def store(unit, x, positions, page_table, data, scales, host_data, host_scales, through):
        i = unit // parts
        part = unit % parts
        row = i // (n_head_kv * blocks)
        head = (i // blocks) % n_head_kv
        block = i % blocks
        pos = positions[row]
        at = ((head * page_tokens + pos % page_tokens) * blocks + block)     # the block's index in its slot
        page = pos // page_tokens
        slot = page_table[page]
        if slot >= 0:
            write(x, row, head * head_dim + block * QUANT_BLOCK, data, scales, slot, at * block_words, at, part)
        if through:
            write(x, row, head * head_dim + block * QUANT_BLOCK, host_data, host_scales, page, at * block_words, at,
                  part)
    return store, blocks * parts


@functools.cache
def make_kv_store(kv_type_name, n_head_kv: int, head_dim_k: int, head_dim_v: int, page_tokens: int):
    """launch(stream, k, v, positions, page_table, pages, host_pages=None): k f32 (rows, n_kv*dk) and v f32
    (rows, n_kv*dv) at int32 `positions` into their pages (quantized bit-exactly as gguf-py does): each page
    into the slot page_table gives, and with `host_pages` (the whole context's pages, page p at index p, in
    mapped host memory) into the host copy too; a thread per 32 values quantized, per word of f16 or f32 (the
    same bits as a pass's store in its RoPE launch)."""
    kv = kv_types(kv_type_name)
    check_head_dims(head_dim_k=head_dim_k, head_dim_v=head_dim_v)
    store_k, k_units = block_store(kv.k_type, n_head_kv, head_dim_k, page_tokens)
    store_v, v_units = block_store(kv.v_type, n_head_kv, head_dim_v, page_tokens)
    k_blocks, v_blocks = n_head_kv * k_units, n_head_kv * v_units      # threads per row

    @overlapping
    @cuda.jit
    def kernel(k, v, positions, page_table, k_data, k_scales, v_data, v_scales, hk_data, hk_scales, hv_data,
               hv_scales, through):
        begin_after_prior_grids()
        i = cuda.grid(1)
        n_k = k.shape[0] * k_blocks
        if i < n_k:
            store_k(i, k, positions, page_table, k_data, k_scales, hk_data, hk_scales, through)
        elif i < n_k + v.shape[0] * v_blocks:
            store_v(i - n_k, v, positions, page_table, v_data, v_scales, hv_data, hv_scales, through)

    def launch(stream, k, v, positions, page_table, pages, host_pages=None):
        threads = k.shape[0] * (k_blocks + v_blocks)
        if threads:
            launch_kernel(kernel, -(-threads // STORE_THREADS), STORE_THREADS, stream, k, v, positions, page_table,
                          *pages.arrays(), *host_arrays(pages, host_pages), int(host_pages is not None))
    return launch
