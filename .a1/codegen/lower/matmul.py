"""Matmul entry points, both families: dense (bias fused, a residual add as its epilogue), SwiGLU gate/up, and
the decode family's q/k/v triple. The kernels are `codegen.lower.matmul_decode` (memory-bound windows of up to
MAX_WINDOW rows) and `codegen.lower.matmul_prefill` (compute-bound chunks); their cores also run the
routed-expert kernels of `codegen.lower.moe`.

Weights are read as 32-bit words of their packed layout (`codegen.lower.weights`), decoded to float32 by
`codegen.lower.word_formats`. A quantized block's scale multiplies after the block's products are summed
(Q4_K: less its sub-block's min times the sum of those x). Everything is float32; each output is accumulated
in one fixed order. Hot-loop indices are unsigned (`U`) and thread ids masked (`IDX`): numba then emits no
negative-index fix-ups, and shared tiles read as float4.
"""

import functools
import weakref
from typing import NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from codegen.graph import prefill_tile_rows
from codegen.lower import FAMILIES
from codegen.lower.cuda import check_aligned, launch_kernel, mapped_device_view
from codegen.lower.matmul_decode import decode_kernel, decode_shape, qkv_kernel, window_rows
from codegen.lower.matmul_prefill import prefill_kernel
from codegen.lower.weights import KERNEL_TYPES, QUANT_BLOCK
from codegen.lower.word_formats import FORMATS, Format


def check(family: str, ggml_type, n_in: int, n_out: int) -> Format:
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    ggml_type = T(ggml_type)
    if ggml_type not in KERNEL_TYPES:
        raise ValueError(f"no matmul kernel for {ggml_type.name}; they read {[t.name for t in KERNEL_TYPES]}")
    block = max(QUANT_BLOCK, GGML_QUANT_SIZES[ggml_type][0])
    if n_in <= 0 or n_out <= 0 or n_in % block:
        raise ValueError(f"matmul {n_out} x {n_in} of {ggml_type.name}: inputs must be a positive multiple of {block}")
    return FORMATS[ggml_type]


def words(weight):
    """(flat int32 words, flat float16 scales) of a DeviceWeight: the arrays every kernel reads. Made once per
    weight: the same array objects at every launch are what lets `launch_kernel` marshal them once. A mapped
    host array (the expert host copy) is viewed as a device array first."""
    key = id(weight)
    made = _words_of.get(key)
    if made is None or made[0]() is not weight:
        data, scales = mapped_device_view(weight.data), mapped_device_view(weight.scales)
        check_aligned("a weight", data)
        scales = scales.reshape(-1)
        if FORMATS[weight.ggml_type].header_bits:      # K-quant headers: bits, read by `word_formats`
            scales = scales.view(np.uint16)
        made = _words_of[key] = (weakref.ref(weight), (data.reshape(-1).view(np.int32), scales))
        weakref.finalize(weight, _words_of.pop, key, None)
    return made[1]


_words_of = {}      # id(DeviceWeight) -> (weak reference, its words)


class DecodePart(NamedTuple):
    """One matrix of a launch that computes several from the same activations (`make_qkv_matmul`)."""
    ggml_type: T
    n_out: int
    bias: bool


@functools.cache
def make_qkv_matmul(n_in: int, parts: tuple):
    """launch(stream, x, q_w, q_b, q_out, k_w, k_b, k_out, v_w, v_b, v_out): a decode window's three attention
    projections of x (rows, n_in) in one launch, `parts` their DecodeParts; each output bitwise what
    make_matmul's decode launch of its matrix gives (the same rows body, shape and order). A decode step's
    q, k and v are too small to fill the GPU one after another (BENCHMARKS.md)."""
    if len(parts) != 3:
        raise ValueError(f"q, k and v: three matrices, got {len(parts)}")
    for part in parts:
        check("decode", part.ggml_type, n_in, part.n_out)

    def launch(stream, x, q_w, q_b, q_out, k_w, k_b, k_out, v_w, v_b, v_out):
        check_aligned("a decode matmul's activations", x)
        kernel, blocks, threads = qkv_kernel(n_in, parts, window_rows(x))
        launch_kernel(kernel, blocks, threads, stream, x, *words(q_w), q_b, q_out, *words(k_w), k_b, k_out,
                      *words(v_w), v_b, v_out)
    return launch


# ---------------------------------------------------------------------------------------------------------
# factories


def _dense(family: str, ggml_type, n_in: int, n_out: int, bias: bool, swiglu: bool, residual: bool = False):
    fmt = check(family, ggml_type, n_in, n_out)
    if family == "prefill":
        return prefill_kernel(T(ggml_type), n_in, bias, swiglu, prefill_tile_rows(n_out), residual)

    def launch(stream, x, wa, sa, wb, sb, b, out):
        shape = decode_shape(fmt, n_in, n_out, window_rows(x))
        decode_kernel(T(ggml_type), n_in, bias, swiglu, shape, residual)(stream, x, wa, sa, wb, sb, b, out)
    return launch


@functools.cache
def make_matmul(family: str, ggml_type, n_in: int, n_out: int, bias: bool, residual: bool = False):
    """launch(stream, x, w, b, out): out (rows, n_out) = x (rows, n_in) @ W.T (+ b); `b` is a 1-element
    placeholder when `bias` is False. residual: out += that instead, out holding the residual stream (a
    block's attention output and FFN down projections: the residual add is their epilogue, one float32
    addition of the same two values a separate add kernel made, so the same bits and one launch fewer).
    decode: rows <= MAX_WINDOW."""
    inner = _dense(family, ggml_type, n_in, n_out, bias, False, residual)

    def launch(stream, x, w, b, out):
        data, scales = words(w)
        inner(stream, x, data, scales, data, scales, b, out)
    return launch


@functools.cache
def make_swiglu_matmul(family: str, ggml_type, n_in: int, n_ff: int):
    """launch(stream, x, gate, up, out): out (rows, n_ff) = silu(x @ gate.T) * (x @ up.T), each dot in
    make_matmul's order."""
    inner = _dense(family, ggml_type, n_in, n_ff, False, True)

    def launch(stream, x, gate, up, out):
        gate_words, gate_scales = words(gate)
        inner(stream, x, gate_words, gate_scales, *words(up), gate_scales, out)
    return launch
