"""The decode family's matmul (rows <= MAX_WINDOW, memory-bound): dense (bias fused, a residual add as its
epilogue), SwiGLU gate/up and the q/k/v triple; `decode_core` also runs the routed-expert kernels of
`codegen.lower.moe`. Entry points: `codegen.lower.matmul`.

A group of `tg` threads owns `nr` weight rows; its lanes read consecutive 16-byte chunks of each row (`load4`:
coalesced, `unroll` chunks in flight per lane), decode them once into registers, and apply them to every window
row (activations read through L1, 16 bytes a load). Each lane's partial sums, in chunk order, meet in a fixed
tree (a warp's shuffles for a 32-lane group, else shared memory). A window row's result is computed by the same
operations whatever the window holds, and each weight is read once per window.
"""

import functools
import math
from typing import NamedTuple

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.lower import MAX_WINDOW
from codegen.lower.cuda import (BIDX, IDX, SHARED_BYTES, SIMULATOR, U, check_aligned, cuda, launch_kernel,
                                let_dependents_launch, load4, overlapping, syncwarp, wait_for_prior_grids, warp_sum)
from codegen.lower.pointwise import silu
from codegen.lower.word_formats import FORMATS, Format

MW = MAX_WINDOW

MAX_UNROLL = 4
ROW_VALUES = 4      # weight rows x window rows a lane accumulates, at most: its sums stay in registers
CHUNK_WORDS = 4     # a lane's chunk of a row: one 16-byte load (`load4`), but for Q5_K, Q6_K (`Format.chunk_words`)


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


@functools.cache
def decode_shape(fmt: Format, n_in: int, n_out: int, window: int) -> DecodeShape:
    """A group takes 2 rows, or as many as its sums allow (ROW_VALUES / window: a chunk's activation loads
    then serve more rows), fewer while that leaves under 1024 warps; one chunk per lane in flight while the
    previous one is applied (more cost registers and measured slower: BENCHMARKS.md's sweep). The simulator
    keeps the fuller groups: it runs every thread as a Python thread, and a group's rows leave its sums as
    they are."""
    tg = group_threads(fmt, n_in, n_out)
    # a lane holds the words of its rows' chunks twice (in flight and applied): Q6_K's 12-word chunks (Q5_K's
    # 20), fewer rows
    nr = max(1, max(2, ROW_VALUES // window) * CHUNK_WORDS // fmt.chunk_words)
    while nr > n_out or (not SIMULATOR and nr > 1 and -(-n_out // nr) * tg < 32 * 1024):
        nr //= 2
    return DecodeShape(tg, 256 // tg, nr, 1, window)


@functools.cache
def decode_core(ggml_type, n_in: int, n_a: int, n_b: int, tg: int, unroll: int, window: int):
    """(dot, reduce) device functions for groups of `tg` lanes over `n_a` rows of matrix a and `n_b` of b,
    compiled for activation windows of up to `window` rows.

    dot(wa, sa, wb, sb, row_a, row_b, x, xrow, nx, lane, acc): the lane's partial sums acc[i, r] of weight
      row i (rows row_a.. of a, then row_b.. of b, all of which must exist: `group_first_row`) with
      activation row xrow[r] of x, r < nx <= window (nothing, not even a load, when nx is 0). Its first
      weights are in flight before it waits for the previous kernel (`wait_for_prior_grids`), then it lets the
      next kernel launch: its caller reads nothing a kernel writes before it, or waits at its top itself (the
      MoE kernels read their routing first; dot's wait then returns at once).
    reduce(red, g, lane, acc, nx): group g's lanes summed in a fixed tree: totals in red[g, i * window + r, 0]
      (for the group's lanes to read; a warp's shuffles when tg is 32, else a shared-memory tree).
    A sum's operations depend on (type, n_in, tg) only: every window and row count gives bitwise the same.

    A chunk is 4 words of a row (Q6_K 12, Q5_K 20), read in 16-byte loads, and is applied in steps
    (`Format.step`): the words whose values fill whole float4s of x (F32 4 words, F16 2, Q8_0 1; Q4_0 1 word,
    two float4s, as a word holds values j and j + 16 of its block; Q6_K 3 words, four float4s; Q5_K 5 words'
    halves, four float4s of four sub-blocks), each step's x read in 16-byte
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
        decoded once and applied to all of them. A type with mins (Q4_K, Q5_K) sums each run's x too: its
        values are scale * q - min, so a run adds scale * sum(q x) - min * sum(x)."""
        c = (it + u) * tg + lane
        if full or c < chunks:
            x0 = c * m
            for i in range(nw):
                for r in range(window):
                    for g in range(runs):
                        part[i, r, g] = np.float32(0)
            if has_min:
                for r in range(window):
                    for g in range(runs):
                        xsum[r, g] = np.float32(0)
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
                                xsum[r, (e // 4) * runs // quads] += xs[r, e]
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
                                acc[i, r] += scale[u, i, g] * part[i, r, g] - low[u, i, g] * xsum[r, g]
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
    def dot(wa, sa, wb, sb, row_a, row_b, x, xrow, nx, lane, acc):
        for i in range(nw):
            for r in range(window):
                acc[i, r] = np.float32(0)
        if nx > 0:
            # consecutive rows, not each clamped to the matrix: a base address a matrix, not a register pair a
            # row (ptxas: Q4_0 92-94 -> 78 registers, Q8_0 at n_out 4096 92-94 -> 71-72, so 3 blocks an SM, not
            # 2; BENCHMARKS.md run 47)
            woff = cuda.local.array(nw, np.int64)
            for i in range(nw):
                woff[i] = row_a + i if i < n_a else row_b + i - n_a
            held = cuda.local.array((unroll, nw, cw), np.int32)
            scale = cuda.local.array((unroll, nw, runs), np.float32)
            low = cuda.local.array((unroll, nw, runs), np.float32)
            ahead = cuda.local.array((unroll, nw, cw), np.int32)
            ahead_scale = cuda.local.array((unroll, nw, runs), np.float32)
            ahead_low = cuda.local.array((unroll, nw, runs), np.float32)
            vals = cuda.local.array((1, step_values), np.float32)
            xs = cuda.local.array((window, step_values), np.float32)
            part = cuda.local.array((nw, window, runs), np.float32)
            xsum = cuda.local.array((window, runs), np.float32)
            fetch(0, wa, sa, wb, sb, woff, lane, held, scale, low)
            # the weights are no kernel's output: their first loads overlap the previous kernel's drain. The
            # wait's 0 joins the index of every load of x, through the lane `apply` takes (joined to the weights'
            # lane too, or to each window row, it cost up to 15 registers and 21 instructions a loop, ptxas:
            # BENCHMARKS.md run 50; this way both are as without the wait)
            x_lane = lane + wait_for_prior_grids()
            let_dependents_launch()
            for it in range(0, padded, unroll):
                # the next chunks' loads go out before these chunks' arithmetic: loads always in flight
                if it + unroll < padded:
                    fetch(it + unroll, wa, sa, wb, sb, woff, lane, ahead, ahead_scale, ahead_low)
                # written out, not a loop: the compiler would not unroll a loop this big, and the chunks'
                # registers must be indexed by constants
                apply(0, it, held, scale, low, vals, xs, part, xsum, x, xrow, nx, x_lane, acc)
                if unroll > 1:
                    apply(1, it, held, scale, low, vals, xs, part, xsum, x, xrow, nx, x_lane, acc)
                if unroll > 2:
                    apply(2, it, held, scale, low, vals, xs, part, xsum, x, xrow, nx, x_lane, acc)
                if unroll > 3:
                    apply(3, it, held, scale, low, vals, xs, part, xsum, x, xrow, nx, x_lane, acc)
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


@cuda.jit(device=True, inline=True)
def group_first_row(n0, nr, n_rows):
    """The first of the nr consecutive rows a group computes to give rows n0..: n0, or for the matrix's last
    group the last nr rows (so `dot` reads no row past the end); rows below n0 are another group's, and not
    stored. A row's sum is the same whichever group computes it."""
    return min(n0, n_rows - nr)


def check_group_rows(what: str, n_rows: int, nr: int) -> None:
    if n_rows < nr:
        raise ValueError(f"{what} of {n_rows} rows: its decode kernel computes {nr} rows a group (at most the rows)")


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
        row0 = group_first_row(n0, nr, n_out)
        dot(wa, sa, wb, sb, row0, row0, x, xrow, nx, lane, acc)
        reduce(red, g, lane, acc, nx)
        for j in range(lane, nr * window, tg):
            i, r = j // window, j % window
            row = row0 + i
            if r < nx and row >= n0:
                value = red[g, j, 0]
                if swiglu:
                    value = silu(value) * red[g, (nr + i) * window + r, 0]
                elif bias:
                    value += b[row]
                if residual:
                    value += out[r, row]
                out[r, row] = value

    # a warp's butterfly leaves its totals in lane 0's slot only
    return rows, groups * nr, (groups, (nr + n_b) * window, tg if tg > 32 else 1)


@functools.cache
def decode_kernel(ggml_type, n_in: int, bias: bool, swiglu: bool, shape: DecodeShape, residual: bool = False):
    """launch(stream, x, wa, sa, wb, sb, b, out): the decode family's dense kernel (`decode_rows`), a block per
    `rows_a_block` outputs."""
    rows, rows_a_block, red_shape = decode_rows(ggml_type, n_in, bias, swiglu, shape, residual)

    @overlapping        # `dot` waits for the previous kernel; nothing before it reads what a kernel writes
    @cuda.jit
    def kernel(x, wa, sa, wb, sb, b, out):
        red = cuda.shared.array(red_shape, np.float32)
        rows(x, wa, sa, wb, sb, b, out, cuda.blockIdx.x & BIDX, red)

    def launch(stream, x, wa, sa, wb, sb, b, out):
        check_aligned("a decode matmul's activations", x)
        check_group_rows("a decode matmul", out.shape[1], shape.nr)
        launch_kernel(kernel, -(-out.shape[1] // rows_a_block), shape.groups * shape.tg, stream,
                      x, wa, sa, wb, sb, b, out)
    return launch


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

    @overlapping        # as decode_kernel's
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
