"""How a 32-bit word of a packed weight (`codegen.lower.weights`) becomes float32 values, for every type the
matmul kernels read: a word holds 1 (F32), 2 (F16, BF16), 4 (Q8_0) or 8 (Q4_0) values, decoded exactly and
cheaply. A quant's bit field is or-ed into the mantissa of a float whose exponent makes its lowest bit weigh 1,
and one float subtraction leaves the quant (no int-to-float conversion, and for most fields no shift); f16
moves its bits into a float32 scaled by 2^112 (exact for every finite value). Scales are not applied here.
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
# Q4_0: nibbles at bits 0, 4, 8, 12, 16 in place, those at 20, 24, 28 after one shift by 12
_N = {p: _field(p, 4, 8) for p in (0, 4, 8, 12, 16)}


@cuda.jit(device=True, inline=True)
def _f32(word, vals, i, base):
    vals[i, base] = bits_to_f32(word)


@cuda.jit(device=True, inline=True)
def _f16(word, vals, i, base):
    for v in range(2):
        h = (word >> np.int32(16 * v)) & np.int32(0xFFFF)
        mag = bits_to_f32((h & np.int32(0x7FFF)) << np.int32(13)) * _F16_SCALE
        vals[i, base + v] = bits_to_f32(f32_to_bits(mag) | ((h & np.int32(0x8000)) << np.int32(16)))


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


_N0, _N4, _N8, _N12, _N16 = (_N[p] for p in (0, 4, 8, 12, 16))


@cuda.jit(device=True, inline=True)
def _q4_0(word, vals, i, base):
    # byte j of a block holds value j (low nibble) and j + 16 (high): vals = 4 low nibbles, then 4 high
    high = word >> np.int32(12)
    vals[i, base] = bits_to_f32((word & _N0[0]) | _N0[1]) - _N0[2]
    vals[i, base + 4] = bits_to_f32((word & _N4[0]) | _N4[1]) - _N4[2]
    vals[i, base + 1] = bits_to_f32((word & _N8[0]) | _N8[1]) - _N8[2]
    vals[i, base + 5] = bits_to_f32((word & _N12[0]) | _N12[1]) - _N12[2]
    vals[i, base + 2] = bits_to_f32((word & _N16[0]) | _N16[1]) - _N16[2]
    vals[i, base + 6] = bits_to_f32((high & _N8[0]) | _N8[1]) - _N8[2]
    vals[i, base + 3] = bits_to_f32((high & _N12[0]) | _N12[1]) - _N12[2]
    vals[i, base + 7] = bits_to_f32((high & _N16[0]) | _N16[1]) - _N16[2]


@cuda.jit(device=True, inline=True)
def _elem_plain(word_index, v, vpw):
    return word_index * vpw + v


@cuda.jit(device=True, inline=True)
def _elem_q4_0(word_index, v, vpw):
    # shifts and masks, not // and %: indices are >= 0, and the compiler then adds no sign fix-ups
    return ((word_index >> 2) << 5) + ((word_index & 3) << 2) + (v & 3) + ((v >> 2) << 4)


class Format(NamedTuple):
    vpw: int            # values per 32-bit word
    wps: int            # words per scale (0: no scales)
    decode: object      # device fn (word, vals, i, base): vals[i, base:base + vpw] = the word's values
    elem: object        # device fn (word index in row, v, vpw) -> the value's index in the row
    slice_words: int    # words holding a 16-wide k slice (Q4_0: a half block's values sit in all 4 words)


FORMATS = {
    T.F32: Format(1, 0, _f32, _elem_plain, 16),
    T.F16: Format(2, 0, _f16, _elem_plain, 8),
    T.BF16: Format(2, 0, _bf16, _elem_plain, 8),
    T.Q8_0: Format(4, 8, _q8_0, _elem_plain, 4),
    T.Q4_0: Format(8, 4, _q4_0, _elem_q4_0, 4),
}
