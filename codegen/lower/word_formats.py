"""How the packed words of a weight (`codegen.lower.weights`) become float32 values, for every type the matmul
kernels read. A quant's bit field is or-ed into the mantissa of a float whose exponent makes its lowest bit weigh
1, and one float subtraction leaves the quant (no int-to-float conversion, and for most fields no shift); f16
moves its bits into a float32 scaled by 2^112 (exact for every finite value). Scales are not applied here:
`scale` reads the (scale, min) of a value, and a value is scale * quant - min (min 0 but for Q4_K and Q5_K).

Each type is read two ways, by a `Format`:
- the decode family reads a row in chunks (4 words, one 16-byte load; Q6_K 12 words, three; Q5_K 20, five) and
  decodes a chunk in steps, each step's values whole float4s of x: `step` and `step_elem`;
- the prefill family (and the embedding) reads a 16-value slice of a row as 4 threads, each loading the few
  words that hold its 4 values: `slice_word` and `slice_quants`.
Word types (a word holds 1, 2, 4 or 8 whole values: F32, F16, BF16, Q8_0, Q4_0, Q4_K) also give their word
decoder (`decode`, `elem`), which attention's K/V reads too. Q6_K's 6-bit quants straddle words: a chunk of 64
values holds their low nibbles in 8 words and their high 2 bits in 4 (`weights.pack`'s layout); Q5_K's chunk
of 128 values its nibbles in 16 words as Q4_K holds them and their fifth bits in 4.
"""

from typing import NamedTuple

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.lower.cuda import bits_to_f32, cuda, f32_to_bits, load4

_F16_SCALE = np.float32(2.0 ** 112)     # f16 bits << 13 read as float32, times this, is the f16 value
_HIGH_HALF = np.int32(-65536)           # 0xFFFF0000


def _magic(p: int) -> int:
    """float32 bits of 2^(23 - p): a bit field starting at bit p of the mantissa then weighs exactly 1."""
    return (150 - p) << 23


def _field(p: int, width: int, offset: int):
    """(mask, magic bits, bias) reading the `width`-bit field at bit p as the integer value - offset:
    float(bits((word & mask) | magic)) - bias, exact (the field sits in the mantissa, bit p weighs 1)."""
    return np.int32(((1 << width) - 1) << p), np.int32(_magic(p)), np.float32(2.0 ** (23 - p) + offset)


# Q8_0: bytes 0 and 1 in place, 2 and 3 after one shift; the xor flips their sign bit (quant + 128)
_B0, _, _B0_BIAS = _field(0, 8, 128)
_B1, _, _B1_BIAS = _field(8, 8, 128)
_B0_FLIP, _B1_FLIP = np.int32(0x80 | _magic(0)), np.int32(0x8000 | _magic(8))   # (w & mask) ^ flip: both at once


@cuda.jit(device=True, inline=True)
def _f32(word, vals, i, base):
    vals[i, base] = bits_to_f32(word)


@cuda.jit(device=True, inline=True)
def f16_bits_to_f32(h):
    """The float16 whose bits are the low 16 of int32 h (the rest zero), as float32."""
    mag = bits_to_f32((h & np.int32(0x7FFF)) << np.int32(13)) * _F16_SCALE
    return bits_to_f32(f32_to_bits(mag) | ((h & np.int32(0x8000)) << np.int32(16)))


@cuda.jit(device=True, inline=True)
def _f16(word, vals, i, base):
    for v in range(2):
        vals[i, base + v] = f16_bits_to_f32((word >> np.int32(16 * v)) & np.int32(0xFFFF))


@cuda.jit(device=True, inline=True)
def _bf16(word, vals, i, base):
    vals[i, base] = bits_to_f32(word << np.int32(16))
    vals[i, base + 1] = bits_to_f32(word & _HIGH_HALF)


@cuda.jit(device=True, inline=True)
def _q8_0(word, vals, i, base):
    high = word >> np.int32(16)
    vals[i, base] = bits_to_f32((word & _B0) ^ _B0_FLIP) - _B0_BIAS
    vals[i, base + 1] = bits_to_f32((word & _B1) ^ _B1_FLIP) - _B1_BIAS
    vals[i, base + 2] = bits_to_f32((high & _B0) ^ _B0_FLIP) - _B0_BIAS
    vals[i, base + 3] = bits_to_f32((high & _B1) ^ _B1_FLIP) - _B1_BIAS


def _nibbles(offset: int):
    """The decoder of a word of a Q4_0-ordered block (byte j: value j in the low nibble, j + 16 in the high),
    stored as quant + offset: vals = its 4 low nibbles, then its 4 high. Nibbles at bits 0, 4, 8, 12, 16 are
    read in place, those at 20, 24, 28 after one shift by 12."""
    n0, n4, n8, n12, n16 = (_field(p, 4, offset) for p in (0, 4, 8, 12, 16))

    @cuda.jit(device=True, inline=True)
    def decode(word, vals, i, base):
        high = word >> np.int32(12)
        vals[i, base] = bits_to_f32((word & n0[0]) | n0[1]) - n0[2]
        vals[i, base + 4] = bits_to_f32((word & n4[0]) | n4[1]) - n4[2]
        vals[i, base + 1] = bits_to_f32((word & n8[0]) | n8[1]) - n8[2]
        vals[i, base + 5] = bits_to_f32((word & n12[0]) | n12[1]) - n12[2]
        vals[i, base + 2] = bits_to_f32((word & n16[0]) | n16[1]) - n16[2]
        vals[i, base + 6] = bits_to_f32((high & n8[0]) | n8[1]) - n8[2]
        vals[i, base + 3] = bits_to_f32((high & n12[0]) | n12[1]) - n12[2]
        vals[i, base + 7] = bits_to_f32((high & n16[0]) | n16[1]) - n16[2]
    return decode



def _byte_fields(width: int, offset: int):
    """The decoder of a word's 4 byte-aligned fields of `width` <= 7 bits (bits 0, 8, 16 in place, 24 after one
    shift), each stored as quant + offset: vals = those 4. Q4_0 and Q4_K slices read their low nibbles so,
    Q6_K its assembled 6-bit quants."""
    f0, f8, f16 = (_field(p, width, offset) for p in (0, 8, 16))

    @cuda.jit(device=True, inline=True)
    def decode(word, vals, i, base):
        vals[i, base] = bits_to_f32((word & f0[0]) | f0[1]) - f0[2]
        vals[i, base + 1] = bits_to_f32((word & f8[0]) | f8[1]) - f8[2]
        vals[i, base + 2] = bits_to_f32((word & f16[0]) | f16[1]) - f16[2]
        vals[i, base + 3] = bits_to_f32(((word >> np.int32(16)) & f8[0]) | f8[1]) - f8[2]
    return decode


_six_bits = _byte_fields(6, 32)     # Q6_K: each byte a 6-bit quant + 32
_five_bits = _byte_fields(5, 0)     # Q5_K: each byte a 5-bit quant
_LOW_NIBBLES = np.int32(0x0F0F0F0F)
_TWO_BITS = np.int32(0x03030303)
_LOW_BITS = np.int32(0x01010101)


@cuda.jit(device=True, inline=True)
def _elem_plain(word_index, v, vpw):
    return word_index * vpw + v


@cuda.jit(device=True, inline=True)
def _elem_q4_0(word_index, v, vpw):
    # shifts and masks, not // and %: indices are >= 0, and the compiler then adds no sign fix-ups
    return ((word_index >> 2) << 5) + ((word_index & 3) << 2) + (v & 3) + ((v >> 2) << 4)


# ---------------------------------------------------------------------------------------------------------
# scales: (scale, min) of the value at index `value` of a row whose scales start at element `start`


@cuda.jit(device=True, inline=True)
def _block_scale(scales, start, value):
    """One float16 scale a 32-value block (Q8_0, Q4_0), min 0."""
    return np.float32(scales[start + (value >> 5)]), np.float32(0)


@cuda.jit(device=True, inline=True)
def _header_byte(header, base, k):
    """Byte k of a block header read as uint16 elements from element `base`."""
    return (np.int32(header[base + k // 2]) >> np.int32(8 * (k % 2))) & np.int32(0xFF)


@cuda.jit(device=True, inline=True)
def _q4_k_scale(header, start, value):
    """(d * sc, dmin * m) of the value's 32-value sub-block j from its 256-value block's 16-byte header (d,
    dmin, 12 bytes of 6-bit scales and mins; 8 uint16 elements, read as 4 words in one load), gguf-py's
    Q4_K.get_scale_min: sub-block j < 4 has the low 6 bits of bytes j and j + 4; j >= 4 the nibbles of byte
    j + 4 and the top 2 bits of bytes j - 4 and j (bytes counted after d and dmin)."""
    j = (value >> 5) & 7
    d_dmin, bytes_0_3, bytes_4_7, bytes_8_11 = load4(header, start + (value >> 8) * 8)
    shift = np.int32(8 * (j & 3))
    if j < 4:
        sc = (bytes_0_3 >> shift) & 63
        m = (bytes_4_7 >> shift) & 63
    else:
        packed = (bytes_8_11 >> shift) & 0xFF
        sc = (packed & 15) | ((((bytes_0_3 >> shift) & 0xFF) >> 6) << 4)
        m = (packed >> 4) | ((((bytes_4_7 >> shift) & 0xFF) >> 6) << 4)
    d = f16_bits_to_f32(d_dmin & np.int32(0xFFFF))
    dmin = f16_bits_to_f32((d_dmin >> np.int32(16)) & np.int32(0xFFFF))
    return d * np.float32(sc), dmin * np.float32(m)


@cuda.jit(device=True, inline=True)
def _q6_k_scale(header, start, value):
    """d * sc of the value's 16-value run from its 256-value block's 18 bytes (16 int8 scales, then d; 9
    uint16 elements): exact in float32, gguf-py's Q6_K scale. Min 0."""
    base = start + (value >> 8) * 9
    byte = _header_byte(header, base, (value >> 4) & 15)
    d = f16_bits_to_f32(np.int32(header[base + 8]))
    return d * np.float32(byte - ((byte & 0x80) << 1)), np.float32(0)


# ---------------------------------------------------------------------------------------------------------
# formats


class Format(NamedTuple):
    block_values: int   # values a block holds: a row is whole blocks, each block_words words of quants
    block_words: int
    block_scales: int   # 16-bit elements of scales a block holds (0: none)
    chunk_words: int    # a decode lane's chunk of a row (module doc)
    steps: int          # steps a chunk is decoded in
    step_values: int    # values a step decodes (whole float4s of x)
    runs: int           # scales a chunk's values take, one per equal run of its values' float4s
    step: object        # device fn (held, u, i, t, vals): vals[0, :step_values] = step t's quants of chunk held[u, i]
    step_elem: object   # device fn (t, e) -> the chunk's value index of step t's value e
    slice_words: int    # words a prefill thread loads of a row for its 4 values of a 16-value slice
    slice_word: object  # device fn (k0, part, q) -> the row's word index of thread part's q-th word of slice k0
    slice_quants: object    # device fn (wv, base, k0, vals): vals[0, :4] = the quants of values k0 + 4 part ..
    #                         + 3 from the thread's words wv[base:base + slice_words]
    scale: object = None    # device fn (scales, the row's first scale element, value index in row) -> (scale, min)
    has_min: bool = False   # a value is scale * quant - min (Q4_K's sub-block offsets)
    header_bits: bool = False   # kernels read the scales as uint16 bits (K-quant headers), not float16
    vpw: int = 0        # word types: values a word; `decode(word, vals, i, base)` and `elem(word, v, vpw)`
    decode: object = None
    elem: object = None

    def row_words(self, n_in: int) -> int:
        return n_in // self.block_values * self.block_words

    def row_scales(self, n_in: int) -> int:
        return n_in // self.block_values * self.block_scales


def _word_format(vpw: int, decode, elem, block_values: int, block_words: int, block_scales: int = 0,
                 scale=None, has_min: bool = False, header_bits: bool = False, nibble_offset: int = 0) -> Format:
    """A type whose word holds `vpw` whole values: a decode step is the words of one float4 of x (one word of
    4 or 8 values), a prefill thread's 4 values of a slice are 4 // vpw words, or the low or high nibbles of
    one word of a 32-value (sub-)block held in Q4_0's order."""
    step_words = max(1, 4 // vpw)

    @cuda.jit(device=True, inline=True)
    def step(held, u, i, t, vals):
        for q in range(step_words):
            decode(held[u, i, t * step_words + q], vals, 0, q * vpw)

    @cuda.jit(device=True, inline=True)
    def step_elem(t, e):
        return elem(t * step_words, e, vpw)

    if vpw <= 4:
        vpw_shift = vpw.bit_length() - 1

        @cuda.jit(device=True, inline=True)
        def slice_word(k0, part, q):
            return (k0 >> vpw_shift) + part * step_words + q

        @cuda.jit(device=True, inline=True)
        def slice_quants(wv, base, k0, vals):
            for q in range(step_words):
                decode(wv[base + q], vals, 0, q * vpw)
    else:
        low = _byte_fields(4, nibble_offset)

        @cuda.jit(device=True, inline=True)
        def slice_word(k0, part, q):
            return ((k0 >> 5) << 2) + part

        @cuda.jit(device=True, inline=True)
        def slice_quants(wv, base, k0, vals):
            low(wv[base] >> np.int32(4 * ((k0 >> 4) & 1)), vals, 0, 0)

    return Format(block_values, block_words, block_scales, 4, 4 // step_words, step_words * vpw, 1, step,
                  step_elem, step_words, slice_word, slice_quants, scale, has_min, header_bits, vpw, decode, elem)


@cuda.jit(device=True, inline=True)
def _q6_k_step(held, u, i, t, vals):
    """Step t of a Q6_K chunk: values 4t.., 16 + 4t.., 32 + 4t.., 48 + 4t.. (4 each) from the low nibbles of
    word t, its high nibbles, word 4 + t's low and high nibbles, with word 8 + t's bit pairs 0-1, 2-3, 4-5, 6-7
    of each byte above them."""
    a, b, h = held[u, i, t], held[u, i, 4 + t], held[u, i, 8 + t]
    _six_bits((a & _LOW_NIBBLES) | ((h & _TWO_BITS) << np.int32(4)), vals, 0, 0)
    _six_bits(((a >> np.int32(4)) & _LOW_NIBBLES) | ((h & np.int32(0x0C0C0C0C)) << np.int32(2)), vals, 0, 4)
    _six_bits((b & _LOW_NIBBLES) | (h & np.int32(0x30303030)), vals, 0, 8)
    _six_bits(((b >> np.int32(4)) & _LOW_NIBBLES) | ((h >> np.int32(2)) & np.int32(0x30303030)), vals, 0, 12)


@cuda.jit(device=True, inline=True)
def _q6_k_step_elem(t, e):
    return ((e >> 2) << 4) + (t << 2) + (e & 3)


@cuda.jit(device=True, inline=True)
def _q6_k_slice_word(k0, part, q):
    """The 16-value run g of chunk k0 >> 6: its nibbles in word (g >> 1) * 4 + part, its bit pairs in 8 + part."""
    return (k0 >> 6) * 12 + (((k0 >> 5) & 1) * 4 if q == 0 else 8) + part


@cuda.jit(device=True, inline=True)
def _q6_k_slice_quants(wv, base, k0, vals):
    g = (k0 >> 4) & 3
    nibbles = (wv[base] >> np.int32(4 * (g & 1))) & _LOW_NIBBLES
    _six_bits(nibbles | (((wv[base + 1] >> np.int32(2 * g)) & _TWO_BITS) << np.int32(4)), vals, 0, 0)


@cuda.jit(device=True, inline=True)
def _q5_k_fifth_bits(nibbles, high, at):
    """The bytes of 4 nibbles (bits 0-3 of each byte) with bit `at` of each byte of `high` above them."""
    return nibbles | (((high >> at) & _LOW_BITS) << np.int32(4))


@cuda.jit(device=True, inline=True)
def _q5_k_step(held, u, i, t, vals):
    """Step t of a Q5_K chunk (128 values, sub-blocks s = 0..3, `weights`' layout): the low (t even) or high
    nibbles of word t // 2 of each sub-block (word 4s + t // 2: values 4 (t // 2).. low, 16 + 4 (t // 2)..
    high), their fifth bits from word 16 + t // 2; sub-block s's 4 values at vals 4s.. (a step of 4 values of
    each sub-block, not 8: x's values a lane holds a window row, halved; run s is then vals 4s..)."""
    half = t & 1
    high = held[u, i, 16 + (t >> 1)]
    for s in range(4):
        nibbles = (held[u, i, 4 * s + (t >> 1)] >> np.int32(4 * half)) & _LOW_NIBBLES
        _five_bits(_q5_k_fifth_bits(nibbles, high, np.int32(4 * half + s)), vals, 0, 4 * s)


@cuda.jit(device=True, inline=True)
def _q5_k_step_elem(t, e):
    return ((e >> 2) << 5) + ((t >> 1) << 2) + ((t & 1) << 4) + (e & 3)


@cuda.jit(device=True, inline=True)
def _q5_k_slice_word(k0, part, q):
    """The 16 values of half h of sub-block s of chunk k0 >> 7: their nibbles in word 4s + part, their fifth bits
    in word 16 + part."""
    return (k0 >> 7) * 20 + (((k0 >> 5) & 3) * 4 if q == 0 else 16) + part


@cuda.jit(device=True, inline=True)
def _q5_k_slice_quants(wv, base, k0, vals):
    half = (k0 >> 4) & 1
    nibbles = (wv[base] >> np.int32(4 * half)) & _LOW_NIBBLES
    _five_bits(_q5_k_fifth_bits(nibbles, wv[base + 1], np.int32(4 * half + ((k0 >> 5) & 3))), vals, 0, 0)


FORMATS = {
    T.F32: _word_format(1, _f32, _elem_plain, 1, 1),
    T.F16: _word_format(2, _f16, _elem_plain, 2, 1),
    T.BF16: _word_format(2, _bf16, _elem_plain, 2, 1),
    T.Q8_0: _word_format(4, _q8_0, _elem_plain, 32, 8, 1, _block_scale),
    T.Q4_0: _word_format(8, _nibbles(8), _elem_q4_0, 32, 4, 1, _block_scale, nibble_offset=8),
    # each 32-value sub-block's quants as Q4_0 holds a block's; the 256-value block's 16 header bytes apart
    T.Q4_K: _word_format(8, _nibbles(0), _elem_q4_0, 256, 32, 8, _q4_k_scale, True, True),
    # a chunk of 20 words is 128 values, 4 sub-blocks (module doc); the header Q4_K's
    T.Q5_K: Format(256, 40, 8, 20, 8, 16, 4, _q5_k_step, _q5_k_step_elem, 2, _q5_k_slice_word,
                   _q5_k_slice_quants, _q4_k_scale, True, True),
    # a chunk of 12 words is 64 values (module doc), a run of 16 values one int8 scale
    T.Q6_K: Format(256, 48, 9, 12, 4, 16, 4, _q6_k_step, _q6_k_step_elem, 2, _q6_k_slice_word,
                   _q6_k_slice_quants, _q6_k_scale, False, True),
}
