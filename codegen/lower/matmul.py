"""Matmul kernels: dense (bias fused) and SwiGLU gate/up, in both families; the two cores below also run the
routed-expert kernels of `codegen.lower.moe`.

Weights are read as 32-bit words of their packed layout (`codegen.lower.weights`), decoded to float32 by
`codegen.lower.word_formats`. A quantized block's scale multiplies after the block's products are summed
(Q4_K: less its sub-block's min times the sum of those x).
Everything is float32; each output is accumulated in one fixed order. Hot-loop indices
are unsigned and thread ids masked (IDX): numba then emits no negative-index fix-ups, and shared tiles read
as float4.

decode family (rows <= MAX_WINDOW, memory-bound): a group of `tg` threads owns `nr` weight rows; its lanes
  read consecutive 16-byte chunks of each row (`load4`: coalesced, `unroll` chunks in flight per lane), decode
  them once into registers, and apply them to every window row (activations read through L1, 16 bytes a
  load). Each lane's partial sums, in chunk order, meet in a fixed tree (a warp's shuffles for a 32-lane group,
  else shared memory). A window row's result is computed by the same operations whatever the window holds, and
  each weight is read once per window.
prefill family (compute-bound): a 256-thread block computes a bm x 128 tile (8 x 8 or 4 x 8 register tiles
  per thread) over k in ascending 16-wide steps, no split-k; activations and dequantized float32 weights go
  through double-buffered, 16-byte aligned shared tiles read with 128-bit loads. The tile's rows are a list
  (a chunk's rows, or an expert's gathered pairs), so every output's sum is the same for any chunk size.
"""

import functools
import math
import weakref
from typing import NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from codegen.graph import TILE_WEIGHT_ROWS, prefill_tile_rows, tile_cols
from codegen.lower import FAMILIES, MAX_WINDOW
from codegen.lower.cuda import (SIMULATOR, aligned16, cuda, launch_kernel, load4, mapped_device_view, syncwarp,
                                warp_sum)
from codegen.lower.weights import KERNEL_TYPES, QUANT_BLOCK
from codegen.lower.word_formats import FORMATS, Format

MW = MAX_WINDOW
ALIGN = None if SIMULATOR else 16      # shared tiles read as float4 (the simulator takes no alignment)
IDX = 1023                             # thread ids masked with this are provably >= 0: no wraparound code
BIDX = 0x7FFFFFFF
U = np.uint64                          # hot-loop indices cast to unsigned: numba adds no negative-index code
SHARED_BYTES = 48 * 1024               # static shared memory a block may use

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


@cuda.jit(device=True, inline=True)
def silu(g):
    return g / (np.float32(1) + math.exp(-g))


# ---------------------------------------------------------------------------------------------------------
# decode core


MAX_UNROLL = 4
ROW_VALUES = 4      # weight rows x window rows a lane accumulates, at most: its sums stay in registers
CHUNK_WORDS = 4     # a lane's chunk of a row: one 16-byte load (`load4`), but for Q6_K (`Format.chunk_words`)


class DecodeShape(NamedTuple):
    tg: int         # threads of a group (a power of two); fixes the reduction order, so never a window's choice
    groups: int     # groups in a block
    nr: int         # weight rows of a group (per matrix)
    unroll: int     # chunks in flight per lane
    window: int     # activation rows the kernel is compiled for


LANES_IN_FLIGHT = 192 * 1024    # lanes whose loads keep the H200's memory busy (~4.4 TB/s x ~1 us of latency)


def group_threads(fmt: Format, n_in: int, n_out: int) -> int:
    """Lanes per row group: a warp, or up to 128 while a matrix has too few rows to give LANES_IN_FLIGHT
    lanes two rows each (never more than a row has chunks): a short matrix's rows are then read in fewer,
    wider rounds of loads (BENCHMARKS.md's sweep). A function of the matrix alone: a row's sum is then
    computed in the same order whatever window the kernel serves."""
    chunks = fmt.row_words(n_in) // fmt.chunk_words
    tg = 32
    while tg < 128 and tg < chunks and -(-n_out // 2) * tg < LANES_IN_FLIGHT:
        tg *= 2
    return tg


def window_rows(x) -> int:
    """The decode window x holds, checked: a kernel is compiled for each window size it meets."""
    if not 1 <= x.shape[0] <= MW:
        raise ValueError(f"decode window of {x.shape[0]} rows: the decode family takes 1..{MW}")
    return x.shape[0]


def check_aligned(what: str, array) -> None:
    """Refuse an array the decode family's 16-byte loads cannot read (`aligned16`), before a launch faults."""
    if not aligned16(array):
        raise ValueError(f"{what}: the decode family reads 16-byte aligned rows; this array starts or steps at "
                         "an address that is not a multiple of 16 bytes")


@functools.cache
def decode_shape(fmt: Format, n_in: int, n_out: int, window: int) -> DecodeShape:
    """A group takes 2 rows, or as many as its sums allow (ROW_VALUES / window: a chunk's activation loads
    then serve more rows), fewer while that leaves under 1024 warps; one chunk per lane in flight while the
    previous one is applied (more cost registers and measured slower: BENCHMARKS.md's sweep). The simulator
    keeps the fuller groups: it runs every thread as a Python thread, and a group's rows leave its sums as
    they are."""
    tg = group_threads(fmt, n_in, n_out)
    # a lane holds the words of its rows' chunks twice (in flight and applied): Q6_K's 12-word chunks, fewer rows
    nr = max(1, max(2, ROW_VALUES // window) * CHUNK_WORDS // fmt.chunk_words)
    while not SIMULATOR and nr > 1 and -(-n_out // nr) * tg < 32 * 1024:
        nr //= 2
    return DecodeShape(tg, 256 // tg, nr, 1, window)


@functools.cache
def decode_core(ggml_type, n_in: int, n_a: int, n_b: int, tg: int, unroll: int, window: int):
    """(dot, reduce) device functions for groups of `tg` lanes over `n_a` rows of matrix a and `n_b` of b,
    compiled for activation windows of up to `window` rows.

    dot(wa, sa, wb, sb, row_a, row_b, last_a, last_b, x, xrow, nx, lane, acc): the lane's partial sums
      acc[i, r] of weight row i (rows row_a.. of a, then row_b.. of b; clamped to last_*) with activation
      row xrow[r] of x, r < nx <= window (nothing, not even a load, when nx is 0).
    reduce(red, g, lane, acc, nx): group g's lanes summed in a fixed tree: totals in red[g, i * window + r, 0]
      (for the group's lanes to read; a warp's shuffles when tg is 32, else a shared-memory tree).
    A sum's operations depend on (type, n_in, tg) only: every window and row count gives bitwise the same.

    A chunk is 4 words of a row (Q6_K 12), read in 16-byte loads, and is applied in steps (`Format.step`):
    the words whose values fill whole float4s of x (F32 4 words, F16 2, Q8_0 1; Q4_0 1 word, two float4s, as
    a word holds values j and j + 16 of its block; Q6_K 3 words, four float4s), each step's x read in 16-byte
    loads for every window row, then each row's words decoded once and applied to them. A chunk's products go
    into one sum per (row, window row, run of one scale) in value order, which the run's scale then multiplies.
    """
    if not 1 <= unroll <= MAX_UNROLL:
        raise ValueError(f"unroll {unroll}: 1..{MAX_UNROLL} chunks in flight")
    if not 1 <= window <= MW:
        raise ValueError(f"window {window}: the decode family takes 1..{MW} rows")
    fmt = FORMATS[T(ggml_type)]
    step, step_elem, block_scale, has_min = fmt.step, fmt.step_elem, fmt.scale, fmt.has_min
    scaled = fmt.block_scales > 0
    cw, steps, step_values, runs = fmt.chunk_words, fmt.steps, fmt.step_values, fmt.runs
    wpr, spr = fmt.row_words(n_in), fmt.row_scales(n_in)
    chunks = wpr // cw
    iters = -(-chunks // tg)
    padded = -(-iters // unroll) * unroll
    full = chunks % tg == 0 and iters % unroll == 0
    nw, m = n_a + n_b, steps * step_values
    sums = nw * window        # a lane's partial sums, one per (weight row, window row)
    quads = step_values // 4
    run_values = m // runs
    levels = tg.bit_length() - 1

    @cuda.jit(device=True, inline=True)
    def apply(u, it, held, scale, low, vals, xs, part, xsum, x, xrow, nx, lane, acc):
        """Chunk u of the group in flight: per step, x's values for every window row, then each row's words
        decoded once and applied to all of them. A type with mins (Q4_K) sums the chunk's x too: its
        values are scale * q - min, so a chunk adds scale * sum(q x) - min * sum(x)."""
        c = (it + u) * tg + lane
        if full or c < chunks:
            x0 = c * m
            for i in range(nw):
                for r in range(window):
                    for g in range(runs):
                        part[i, r, g] = np.float32(0)
            if has_min:
                for r in range(window):
                    xsum[r] = np.float32(0)
            for t in range(steps):
                for r in range(window):
                    if r < nx:
                        xr = U(xrow[r])
                        for j in range(quads):
                            quad = load4(x, (xr, U(x0 + step_elem(t, 4 * j))))
                            xs[r, 4 * j] = quad[0]
                            xs[r, 4 * j + 1] = quad[1]
                            xs[r, 4 * j + 2] = quad[2]
                            xs[r, 4 * j + 3] = quad[3]
                        if has_min:
                            for e in range(step_values):
                                xsum[r] += xs[r, e]
                for i in range(nw):
                    step(held, u, i, t, vals)
                    for r in range(window):
                        if r < nx:
                            for e in range(step_values):
                                part[i, r, (e // 4) * runs // quads] += vals[0, e] * xs[r, e]
            for i in range(nw):
                for r in range(window):
                    if r < nx:
                        for g in range(runs):
                            if has_min:
                                acc[i, r] += scale[u, i, g] * part[i, r, g] - low[u, i, g] * xsum[r]
                            elif scaled:
                                acc[i, r] += scale[u, i, g] * part[i, r, g]
                            else:
                                acc[i, r] += part[i, r, g]

    @cuda.jit(device=True, inline=True)
    def fetch(it, wa, sa, wb, sb, woff, lane, held, scale, low):
        """Load the words (and scales, mins) of chunks it..it + unroll - 1 of the group's rows."""
        for u in range(unroll):
            c = (it + u) * tg + lane
            if full or c < chunks:
                for i in range(nw):
                    wsrc, ssrc = (wa, sa) if i < n_a else (wb, sb)
                    for q in range(0, cw, 4):
                        words4 = load4(wsrc, U(woff[i] * wpr + c * cw + q))
                        held[u, i, q] = words4[0]
                        held[u, i, q + 1] = words4[1]
                        held[u, i, q + 2] = words4[2]
                        held[u, i, q + 3] = words4[3]
                    if scaled:
                        for g in range(runs):
                            scale[u, i, g], low[u, i, g] = block_scale(ssrc, U(woff[i] * spr),
                                                                       U(c * m + g * run_values))

    @cuda.jit(device=True, inline=True)
    def dot(wa, sa, wb, sb, row_a, row_b, last_a, last_b, x, xrow, nx, lane, acc):
        for i in range(nw):
            for r in range(window):
                acc[i, r] = np.float32(0)
        if nx > 0:
            woff = cuda.local.array(nw, np.int64)
            for i in range(nw):
                if i < n_a:
                    woff[i] = min(row_a + i, last_a)
                else:
                    woff[i] = min(row_b + i - n_a, last_b)
            held = cuda.local.array((unroll, nw, cw), np.int32)
            scale = cuda.local.array((unroll, nw, runs), np.float32)
            low = cuda.local.array((unroll, nw, runs), np.float32)
            ahead = cuda.local.array((unroll, nw, cw), np.int32)
            ahead_scale = cuda.local.array((unroll, nw, runs), np.float32)
            ahead_low = cuda.local.array((unroll, nw, runs), np.float32)
            vals = cuda.local.array((1, step_values), np.float32)
            xs = cuda.local.array((window, step_values), np.float32)
            part = cuda.local.array((nw, window, runs), np.float32)
            xsum = cuda.local.array(window, np.float32)
            fetch(0, wa, sa, wb, sb, woff, lane, held, scale, low)
            for it in range(0, padded, unroll):
                # the next chunks' loads go out before these chunks' arithmetic: loads always in flight
                if it + unroll < padded:
                    fetch(it + unroll, wa, sa, wb, sb, woff, lane, ahead, ahead_scale, ahead_low)
                # written out, not a loop: the compiler would not unroll a loop this big, and the chunks'
                # registers must be indexed by constants
                apply(0, it, held, scale, low, vals, xs, part, xsum, x, xrow, nx, lane, acc)
                if unroll > 1:
                    apply(1, it, held, scale, low, vals, xs, part, xsum, x, xrow, nx, lane, acc)
                if unroll > 2:
                    apply(2, it, held, scale, low, vals, xs, part, xsum, x, xrow, nx, lane, acc)
                if unroll > 3:
                    apply(3, it, held, scale, low, vals, xs, part, xsum, x, xrow, nx, lane, acc)
                for u in range(unroll):
                    for i in range(nw):
                        for q in range(cw):
                            held[u, i, q] = ahead[u, i, q]
                        for g in range(runs):
                            scale[u, i, g] = ahead_scale[u, i, g]
                            low[u, i, g] = ahead_low[u, i, g]

    @cuda.jit(device=True, inline=True)
    def tree_reduce(red, g, lane, acc, nx):
        for i in range(nw):
            for r in range(window):
                if r < nx:
                    red[g, i * window + r, lane] = acc[i, r]
        for level in range(levels):
            stride = tg >> (level + 1)
            cuda.syncthreads()
            if lane < stride:
                for i in range(nw):
                    for r in range(window):
                        if r < nx:
                            red[g, i * window + r, lane] += red[g, i * window + r, lane + stride]
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def warp_reduce(red, g, lane, acc, nx):
        """tg == 32: the tree's additions (lane l + lane l + stride, strides 16..1) as an xor butterfly of
        shuffles, which adds the same pairs in the same order, with no block barrier; lane 0's totals."""
        totals = cuda.local.array(sums, np.float32)
        for i in range(nw):
            for r in range(window):
                totals[i * window + r] = acc[i, r]
        warp_sum(totals, sums)
        if lane == 0:
            for j in range(sums):
                if j % window < nx:
                    red[g, j, 0] = totals[j]
        syncwarp()

    return dot, warp_reduce if tg == 32 else tree_reduce


@functools.cache
def decode_rows(ggml_type, n_in: int, bias: bool, swiglu: bool, shape: DecodeShape, residual: bool = False):
    """(rows, rows_a_block, red_shape): the decode family's dense kernel body as a device function
    rows(x, wa, sa, wb, sb, b, out, block, red), block `block`'s `rows_a_block` output rows of out (rows,
    n_out = out.shape[1]) for x.shape[0] <= shape.window (SwiGLU: a = gate, b = up; residual: out += the
    product), red a shared float32 array of red_shape."""
    tg, groups, nr, window = shape.tg, shape.groups, shape.nr, shape.window
    n_b = nr if swiglu else 0
    dot, reduce = decode_core(ggml_type, n_in, nr, n_b, tg, shape.unroll, window)
    acc_shape = (nr + n_b, window)

    @cuda.jit(device=True, inline=True)
    def rows(x, wa, sa, wb, sb, b, out, block, red):
        t = cuda.threadIdx.x & IDX
        g, lane = t // tg, t % tg
        n0 = (block * groups + g) * nr
        nx, n_out = x.shape[0], out.shape[1]
        xrow = cuda.local.array(window, np.int64)
        for r in range(window):
            xrow[r] = r
        acc = cuda.local.array(acc_shape, np.float32)
        dot(wa, sa, wb, sb, n0, n0, n_out - 1, n_out - 1, x, xrow, nx, lane, acc)
        reduce(red, g, lane, acc, nx)
        for j in range(lane, nr * window, tg):
            i, r = j // window, j % window
            if r < nx and n0 + i < n_out:
                value = red[g, j, 0]
                if swiglu:
                    value = silu(value) * red[g, (nr + i) * window + r, 0]
                elif bias:
                    value += b[n0 + i]
                if residual:
                    value += out[r, n0 + i]
                out[r, n0 + i] = value

    # a warp's butterfly leaves its totals in lane 0's slot only
    return rows, groups * nr, (groups, (nr + n_b) * window, tg if tg > 32 else 1)


@functools.cache
def decode_kernel(ggml_type, n_in: int, bias: bool, swiglu: bool, shape: DecodeShape, residual: bool = False):
    """launch(stream, x, wa, sa, wb, sb, b, out): the decode family's dense kernel (`decode_rows`), a block per
    `rows_a_block` outputs."""
    rows, rows_a_block, red_shape = decode_rows(ggml_type, n_in, bias, swiglu, shape, residual)

    @cuda.jit
    def kernel(x, wa, sa, wb, sb, b, out):
        red = cuda.shared.array(red_shape, np.float32)
        rows(x, wa, sa, wb, sb, b, out, cuda.blockIdx.x & BIDX, red)

    def launch(stream, x, wa, sa, wb, sb, b, out):
        check_aligned("a decode matmul's activations", x)
        launch_kernel(kernel, -(-out.shape[1] // rows_a_block), shape.groups * shape.tg, stream,
                      x, wa, sa, wb, sb, b, out)
    return launch


class DecodePart(NamedTuple):
    """One matrix of a launch that computes several from the same activations (`make_qkv_matmul`)."""
    ggml_type: T
    n_out: int
    bias: bool


@functools.cache
def qkv_kernel(n_in: int, parts: tuple, window: int):
    """The kernel of `make_qkv_matmul` for windows of up to `window` rows: blocks 0.. compute q's rows, then
    k's, then v's, each matrix's by its own `decode_rows` (the shape its own launch would take)."""
    bodies = []
    for part in parts:
        shape = decode_shape(FORMATS[part.ggml_type], n_in, part.n_out, window)
        rows, rows_a_block, red_shape = decode_rows(part.ggml_type, n_in, part.bias, False, shape)
        bodies.append((rows, -(-part.n_out // rows_a_block), red_shape, shape.groups * shape.tg))
    (q_rows, q_blocks, q_red, q_threads), (k_rows, k_blocks, k_red, k_threads), \
        (v_rows, v_blocks, v_red, v_threads) = bodies
    if not q_threads == k_threads == v_threads:
        raise ValueError("q, k and v's decode shapes take different block sizes")
    shared_bytes = 4 * sum(math.prod(red) for _, _, red, _ in bodies)
    if shared_bytes > SHARED_BYTES:
        raise ValueError(f"q, k and v of {[p.n_out for p in parts]} rows need {shared_bytes} bytes of shared memory "
                         f"for a window of {window} (at most {SHARED_BYTES})")

    @cuda.jit
    def kernel(x, qa, qs, qb, q_out, ka, ks, kb, k_out, va, vs, vb, v_out):
        block = cuda.blockIdx.x & BIDX
        if block < q_blocks:        # (the same branch for the whole block)
            red = cuda.shared.array(q_red, np.float32)
            q_rows(x, qa, qs, qa, qs, qb, q_out, block, red)
        elif block < q_blocks + k_blocks:
            red = cuda.shared.array(k_red, np.float32)
            k_rows(x, ka, ks, ka, ks, kb, k_out, block - q_blocks, red)
        else:
            red = cuda.shared.array(v_red, np.float32)
            v_rows(x, va, vs, va, vs, vb, v_out, block - q_blocks - k_blocks, red)

    return kernel, q_blocks + k_blocks + v_blocks, q_threads


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
# prefill core

BN = TILE_WEIGHT_ROWS   # weight rows of a tile (dense: 128 outputs; SwiGLU: 64 gate + the same 64 up), the
#                        geometry the cost model prices (codegen.graph.prefill_tiling)
BK = 16         # k step
THREADS = 256   # 16 x 16 threads; a thread's tile rows and columns are two (or one) runs of 4
PAD = 4         # shared rows padded by 4 floats: fewer bank conflicts on stores, 16-byte aligned rows
W_TILE = (2, BK, BN + PAD)      # two stages of dequantized weights, k-major


@functools.cache
def prefill_core(ggml_type, n_in: int, bm: int):
    """tile(x, xrows, wa, sa, wb, sb, row_a, row_b, last_a, last_b, xs, ws, acc): acc[i, j] = the dot of
    x row xrows[rr(i)] (a zero row where xrows holds -1) with weight row rr'(j) (tile rows 0..63 are rows
    row_a.. of a, 64..127 rows row_b.. of b, clamped to last_*), over k ascending. A thread's tile rows are
    rr(i) = (i // 4) * (bm // hm) + ty * 4 + i % 4 and columns rr'(j) = (j // 4) * 64 + tx * 4 + j % 4.

    Loads: 4 threads share a tile row's 16-wide k slice (4 values each: 4 floats of x, and the words that
    hold 4 of the weight row's values, `Format.slice_word`), so a thread holds few row addresses (bm / 64 of
    x, 2 of weights) and its next slice in registers."""
    fmt = FORMATS[T(ggml_type)]
    slice_word, slice_quants, block_scale, has_min = fmt.slice_word, fmt.slice_quants, fmt.scale, fmt.has_min
    scaled = fmt.block_scales > 0
    wpr, spr = fmt.row_words(n_in), fmt.row_scales(n_in)
    k_tiles = n_in // BK
    tm = bm // 16
    hm = tm // 4
    xh = bm // 64                   # x rows a thread loads
    wq = fmt.slice_words            # words of a weight row a thread loads
    x_held, w_held = 4 * xh, 2 * wq

    @cuda.jit(device=True, inline=True)
    def load(x, xr, wa, sa, wb, sb, wrow, part, k0, xv, wv, sv, mv):
        for h in range(xh):
            for j in range(4):
                xv[h * 4 + j] = x[U(xr[h]), U(k0 + part * 4 + j)] if xr[h] >= 0 else np.float32(0)
        for h in range(2):
            wsrc, ssrc = (wa, sa) if h == 0 else (wb, sb)
            for q in range(wq):
                wv[h * wq + q] = wsrc[U(wrow[h] * wpr + slice_word(k0, part, q))]
            if scaled:
                sv[h], mv[h] = block_scale(ssrc, U(wrow[h] * spr), U(k0))

    @cuda.jit(device=True, inline=True)
    def store(xs, ws, stage, t, part, k0, xv, wv, sv, mv, vals):
        for h in range(xh):
            for j in range(4):
                xs[stage, U(part * 4 + j), U(h * 64 + t // 4)] = xv[h * 4 + j]
        for h in range(2):
            slice_quants(wv, h * wq, k0, vals)
            for v in range(4):
                value = vals[0, v]
                if has_min:     # scale * quant is exact (17 bits times 4): gguf-py's one rounding
                    value = sv[h] * value - mv[h]
                elif scaled:    # gguf-py's one rounding (Q6_K's may round: 19 bits times 6)
                    value = sv[h] * value
                ws[stage, U(part * 4 + v), U(h * 64 + t // 4)] = value

    @cuda.jit(device=True, inline=True)
    def step(xs, ws, stage, kk, ty, tx, a, b, acc):
        for h in range(hm):
            for v in range(4):
                a[h * 4 + v] = xs[U(stage), U(kk), U(h * (bm // hm) + ty * 4 + v)]
        for h in range(2):
            for v in range(4):
                b[h * 4 + v] = ws[U(stage), U(kk), U(h * (BN // 2) + tx * 4 + v)]
        for i in range(tm):
            for j in range(8):
                acc[i, j] += a[i] * b[j]

    @cuda.jit(device=True, inline=True)
    def tile(x, xrows, wa, sa, wb, sb, row_a, row_b, last_a, last_b, xs, ws, acc):
        t = cuda.threadIdx.x & IDX
        tx, ty, part = t % 16, t // 16, t % 4
        xr = cuda.local.array(xh, np.int64)
        for h in range(xh):
            xr[h] = xrows[h * 64 + t // 4]
        wrow = cuda.local.array(2, np.int64)
        wrow[0] = min(row_a + t // 4, last_a)
        wrow[1] = min(row_b + t // 4, last_b)
        for i in range(tm):
            for j in range(8):
                acc[i, j] = np.float32(0)
        xv = cuda.local.array(x_held, np.float32)
        wv = cuda.local.array(w_held, np.int32)
        sv = cuda.local.array(2, np.float32)
        mv = cuda.local.array(2, np.float32)
        vals = cuda.local.array((1, 4), np.float32)
        a = cuda.local.array(tm, np.float32)
        b = cuda.local.array(8, np.float32)
        # the simulator runs every thread in Python: one whose tile rows are all zero rows (xrows -1, past a
        # short chunk's rows or an expert's pairs) skips their products, which no output keeps
        busy = not SIMULATOR
        for i in range(tm if SIMULATOR else 0):
            busy = busy or xrows[(i // 4) * (bm // hm) + ty * 4 + i % 4] >= 0
        load(x, xr, wa, sa, wb, sb, wrow, part, 0, xv, wv, sv, mv)
        store(xs, ws, 0, t, part, 0, xv, wv, sv, mv, vals)
        cuda.syncthreads()
        for kt in range(k_tiles):
            stage = kt % 2
            if kt + 1 < k_tiles:
                load(x, xr, wa, sa, wb, sb, wrow, part, (kt + 1) * BK, xv, wv, sv, mv)
            for kk in range(0, BK if busy else 0, 4):
                # four k steps written out: the loop's own bookkeeping costs a quarter as much
                step(xs, ws, stage, kk, ty, tx, a, b, acc)
                step(xs, ws, stage, kk + 1, ty, tx, a, b, acc)
                step(xs, ws, stage, kk + 2, ty, tx, a, b, acc)
                step(xs, ws, stage, kk + 3, ty, tx, a, b, acc)
            if kt + 1 < k_tiles:
                store(xs, ws, 1 - stage, t, part, (kt + 1) * BK, xv, wv, sv, mv, vals)
            cuda.syncthreads()

    return tile


@functools.cache
def prefill_kernel(ggml_type, n_in: int, bias: bool, swiglu: bool, bm: int, residual: bool = False):
    """launch(stream, x, wa, sa, wb, sb, b, out): the prefill family's dense kernel (SwiGLU: a = gate,
    b = up) for any n_out = out.shape[1]; residual: out += the product."""
    tile = prefill_core(ggml_type, n_in, bm)
    tm = bm // 16
    hm = tm // 4
    cols = tile_cols(swiglu)
    x_tile, w_tile = (2, BK, bm + PAD), W_TILE

    @cuda.jit
    def kernel(x, wa, sa, wb, sb, b, out):
        xs = cuda.shared.array(x_tile, np.float32, alignment=ALIGN)
        ws = cuda.shared.array(w_tile, np.float32, alignment=ALIGN)
        xrows = cuda.shared.array(bm, np.int64)
        t = cuda.threadIdx.x & IDX
        r0 = (cuda.blockIdx.y & BIDX) * bm
        n0 = (cuda.blockIdx.x & BIDX) * cols
        rows, n_out = x.shape[0], out.shape[1]
        if t < bm:
            xrows[t] = r0 + t if r0 + t < rows else -1
        cuda.syncthreads()
        acc = cuda.local.array((tm, 8), np.float32)
        tile(x, xrows, wa, sa, wb, sb, n0, n0 + cols - BN // 2, n_out - 1, n_out - 1, xs, ws, acc)
        tx, ty = t % 16, t // 16
        for i in range(tm):
            r = r0 + (i // 4) * (bm // hm) + ty * 4 + i % 4
            if r < rows:
                for j in range(4 if swiglu else 8):
                    n = n0 + (j // 4) * (BN // 2) + tx * 4 + j % 4
                    if n < n_out:
                        if swiglu:
                            out[r, n] = silu(acc[i, j]) * acc[i, j + 4]
                        else:
                            value = acc[i, j] + b[n] if bias else acc[i, j]
                            out[r, n] = value + out[r, n] if residual else value

    def launch(stream, x, wa, sa, wb, sb, b, out):
        grid = (-(-out.shape[1] // cols), -(-x.shape[0] // bm))
        launch_kernel(kernel, grid, THREADS, stream, x, wa, sa, wb, sb, b, out)
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
