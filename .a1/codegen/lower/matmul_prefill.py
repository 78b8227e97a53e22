"""The prefill family's matmul (compute-bound): dense (bias fused, a residual add as its epilogue) and SwiGLU
gate/up; `prefill_core` also runs the routed-expert kernels of `codegen.lower.moe`. Entry points:
`codegen.lower.matmul`.

A 256-thread block computes a bm x 128 tile (8 x 8 or 4 x 8 register tiles per thread) over k in ascending
16-wide steps, no split-k; activations and dequantized float32 weights go through double-buffered, 16-byte
aligned shared tiles read with 128-bit loads. The tile's rows are a list (a chunk's rows, or an expert's
gathered pairs), so every output's sum is the same for any chunk size.
"""

import functools

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import TILE_WEIGHT_ROWS, tile_cols
from codegen.lower.cuda import BIDX, IDX, SHARED_ALIGN, SIMULATOR, U, cuda, launch_kernel
from codegen.lower.pointwise import silu
from codegen.lower.word_formats import FORMATS

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
        xs = cuda.shared.array(x_tile, np.float32, alignment=SHARED_ALIGN)
        ws = cuda.shared.array(w_tile, np.float32, alignment=SHARED_ALIGN)
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
