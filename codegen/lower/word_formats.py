"""How a 32-bit word of a packed weight (`codegen.lower.weights`) becomes float32 values, for every type the
matmul kernels read: a word holds 1 (F32), 2 (F16, BF16), 4 (Q8_0) or 8 (Q4_0, Q4_K) values, decoded exactly
and cheaply. A quant's bit field is or-ed into the mantissa of a float whose exponent makes its lowest bit weigh
1, and one float subtraction leaves the quant (no int-to-float conversion, and for most fields no shift); f16
moves its bits into a float32 scaled by 2^112 (exact for every finite value). Scales are not applied here:
`scale` reads a word's (scale, min), and a value is scale * quant - min (min 0 but for Q4_K).
"""

from typing import NamedTuple

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.lower.cuda import bits_to_f32, cuda, f32_to_bits

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


@cuda.jit(device=True, inline=True)
def _elem_plain(word_index, v, vpw):
    return word_index * vpw + v


@cuda.jit(device=True, inline=True)
def _elem_q4_0(word_index, v, vpw):
    # shifts and masks, not // and %: indices are >= 0, and the compiler then adds no sign fix-ups
    return ((word_index >> 2) << 5) + ((word_index & 3) << 2) + (v & 3) + ((v >> 2) << 4)


def _block_scale(wps: int):
    """The scale of a word of a type with one float16 scale a block of `wps` words, and min 0."""
    @cuda.jit(device=True, inline=True)
    def scale(scales, start, word):
        return np.float32(scales[start + word // wps]), np.float32(0)
    return scale


@cuda.jit(device=True, inline=True)
def _q4_k_byte(header, base, k):
    """Byte k of the 12 bytes of 6-bit scales and mins after a Q4_K header's d and dmin (uint16 elements)."""
    return (np.int32(header[base + 2 + k // 2]) >> np.int32(8 * (k % 2))) & np.int32(0xFF)


@cuda.jit(device=True, inline=True)
def _q4_k_scale(header, start, word):
    """(d * sc, dmin * m) of word `word`'s sub-block (4 words, 32 values; 8 a block of 32 words) from its
    block's 16-byte header (8 uint16 elements from start + 8 * block), gguf-py's Q4_K.get_scale_min: sub-block
    j < 4 has the low 6 bits of bytes j and j + 4; j >= 4 the nibbles of byte j + 4 and the top 2 bits of
    bytes j - 4 and j."""
    base = start + (word >> 5) * 8
    j = (word >> 2) & 7
    if j < 4:
        sc = _q4_k_byte(header, base, j) & 63
        m = _q4_k_byte(header, base, j + 4) & 63
    else:
        packed = _q4_k_byte(header, base, j + 4)
        sc = (packed & 15) | ((_q4_k_byte(header, base, j - 4) >> 6) << 4)
        m = (packed >> 4) | ((_q4_k_byte(header, base, j) >> 6) << 4)
    d = f16_bits_to_f32(np.int32(header[base]))
    dmin = f16_bits_to_f32(np.int32(header[base + 1]))
    return d * np.float32(sc), dmin * np.float32(m)


class Format(NamedTuple):
    vpw: int            # values per 32-bit word
    wps: int            # words per float16 element of the scales (0: no scales)
    decode: object      # device fn (word, vals, i, base): vals[i, base:base + vpw] = the word's values
    elem: object        # device fn (word index in row, v, vpw) -> the value's index in the row
    slice_words: int    # words holding a 16-wide k slice (Q4_0: a half block's values sit in all 4 words)
    scale: object = None    # device fn (scales, the row's first scale element, word index in row) -> (scale, min)
    has_min: bool = False   # a value is scale * quant - min (Q4_K's sub-block offsets)
    header_bits: bool = False   # kernels read the scales as uint16 bits (Q4_K's headers), not float16


FORMATS = {
    T.F32: Format(1, 0, _f32, _elem_plain, 16),
    T.F16: Format(2, 0, _f16, _elem_plain, 8),
    T.BF16: Format(2, 0, _bf16, _elem_plain, 8),
    T.Q8_0: Format(4, 8, _q8_0, _elem_plain, 4, _block_scale(8)),
    T.Q4_0: Format(8, 4, _nibbles(8), _elem_q4_0, 4, _block_scale(4)),
    # a sub-block of 4 words has one of its block's 16 header bytes' (scale, min): 2 bytes' worth, wps 4
    T.Q4_K: Format(8, 4, _nibbles(0), _elem_q4_0, 4, _q4_k_scale, True, True),
}
