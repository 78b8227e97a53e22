"""Routed experts: (row, slot) pairs grouped by expert, each expert's SwiGLU gate/up and its down projection
with the route-weighted sum fused, on the matmul cores of `codegen.lower.matmul` (same dots, same orders).

The groups buffer (`codegen.graph.moe_groups_length`): offsets[n_expert + 1], then pairs[rows * k] (pair =
row * k + slot, ascending within an expert), then active[n_expert + 1] (the count of experts with pairs, then
those experts ascending). Grids never depend on it: blocks past the work it describes return at once.

decode family: a window's rows pick distinct experts each (top-k does), so an expert has at most
  MAX_WINDOW pairs. gate/up: block (column group, y) computes every pair of the y-th active expert with one
  read of its rows. down: a block owns a few output columns; its groups take the active experts in turn,
  each expert's rows read once, the pairs' dots kept in shared memory; then each output is the
  route-weighted sum over slots j = 0..k-1 in that order.
prefill family: each expert is a small GEMM over its gathered pairs, tiled by the prefill core; tiles are
  numbered across experts (an in-block scan of the offsets maps a block to its expert and tile). down runs
  k passes, pass j over the pairs of slot j (each row once per pass): pass 0 writes, later passes add, so the
  weighted sum is in slot order; each pass reads an expert's weights once.
"""

import functools

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.lower.cuda import cuda
from codegen.lower.matmul import (ALIGN, BIDX, BK, BN, FORMATS, IDX, PAD, ROW_VALUES, THREADS, W_TILE, DecodeShape,
                                  check, chunk_words, decode_core, prefill_core, silu, window_rows, words)

GROUP_THREADS = 1024    # at most, for make_moe_groups: (expert, segment) items, one thread each
GROUP_SEGMENT_PAIRS = 512   # pairs per segment, at least: few pairs (decode) get one segment, one thread each
PREFILL_BM = 64         # pair rows of a prefill expert tile (an expert gets rows * k / n_expert on average)
X_TILE = (2, BK, PREFILL_BM + PAD)


@cuda.jit(device=True, inline=True)
def _scan(buf, t, levels):
    """Inclusive prefix sum of buf[:2**levels] in place (Hillis-Steele); every thread of the block calls it."""
    for level in range(levels):
        cuda.syncthreads()
        value = buf[t]
        if t >= (1 << level):
            value += buf[t - (1 << level)]
        cuda.syncthreads()
        buf[t] = value
    cuda.syncthreads()


@functools.cache
def make_moe_groups(n_expert: int, k: int):
    """launch(stream, ids, groups): ids int32 (rows, k) -> the groups buffer. One block: thread (e, s) counts
    expert e in segment s of the pairs, a scan gives each its start, then it writes its pairs in order. The
    segments (so the threads) grow with the pairs, from the ids' shape: a decode window's few pairs take one
    thread per expert and short scans."""
    if not 0 < k <= n_expert <= GROUP_THREADS:
        raise ValueError(f"top {k} of {n_expert} experts: the grouping kernel takes 1..{GROUP_THREADS} experts")

    @cuda.jit
    def kernel(ids, groups, segments, levels):
        counts = cuda.shared.array(GROUP_THREADS, np.int32)
        flags = cuda.shared.array(GROUP_THREADS, np.int32)
        t = cuda.threadIdx.x & IDX
        n_pairs = ids.shape[0] * k
        active = n_expert + 1 + n_pairs
        length = -(-n_pairs // segments)
        e, seg = t // segments, t % segments
        lo, hi = seg * length, min(n_pairs, (seg + 1) * length)
        mine = 0
        if e < n_expert:
            for p in range(lo, hi):
                if ids[p // k, p % k] == e:
                    mine += 1
        counts[t] = mine
        _scan(counts, t, levels)
        start = counts[t] - mine
        if e < n_expert and seg == 0:
            groups[e] = start
        if t == 0:
            groups[n_expert] = n_pairs
        total = 0
        if t < n_expert:
            total = counts[t * segments + segments - 1] - (counts[t * segments - 1] if t > 0 else 0)
        flags[t] = 1 if total > 0 else 0
        _scan(flags, t, levels)
        if total > 0:
            groups[active + flags[t]] = t
        if t == 0:
            groups[active] = flags[(1 << levels) - 1]
        if e < n_expert:
            pos = n_expert + 1 + start
            for p in range(lo, hi):
                if ids[p // k, p % k] == e:
                    groups[pos] = p
                    pos += 1

    def launch(stream, ids, groups):
        segments = max(1, min(GROUP_THREADS // n_expert, ids.shape[0] * k // GROUP_SEGMENT_PAIRS))
        threads = 32
        while threads < n_expert * segments:
            threads *= 2
        kernel[1, threads, stream](ids, groups, segments, threads.bit_length() - 1)
    return launch


# ---------------------------------------------------------------------------------------------------------
# decode family


def decode_swiglu_shape(ggml_type, n_in: int, window: int) -> DecodeShape:
    """A warp per group, 1 gate + 1 up row or as many pairs as its sums allow (ROW_VALUES / 2 / window): an
    expert's columns spread over many blocks, each chunk's activations serve every row."""
    fmt = FORMATS[T(ggml_type)]
    cw = chunk_words(fmt)
    nr = max(1, ROW_VALUES // 2 // window)
    return DecodeShape(32, 8, nr, cw, 1, window)


def decode_down_shape(ggml_type, n_ff: int, window: int) -> DecodeShape:
    """A warp per active expert (a one-token step's 8 at once), 2 rows each or ROW_VALUES / window."""
    fmt = FORMATS[T(ggml_type)]
    cw = chunk_words(fmt)
    nr = max(2, ROW_VALUES // window)
    return DecodeShape(32, 8, nr, cw, 1, window)


@functools.cache
def decode_swiglu(ggml_type, n_in: int, n_ff: int, n_expert: int, k: int, shape: DecodeShape):
    """launch(stream, x, groups, slot_of, ga, gs, ua, us, act): the decode family's routed gate/up."""
    tg, groups, nr, window = shape.tg, shape.groups, shape.nr, shape.window
    dot, reduce = decode_core(ggml_type, n_in, nr, nr, tg, shape.cw, shape.unroll, window)
    red_shape, acc_shape = (groups, 2 * nr * window, tg), (2 * nr, window)

    @cuda.jit
    def kernel(x, grouped, slot_of, ga, gs, ua, us, act):
        red = cuda.shared.array(red_shape, np.float32)
        t = cuda.threadIdx.x & IDX
        g, lane = t // tg, t % tg
        active = n_expert + 1 + x.shape[0] * k
        y = cuda.blockIdx.y & BIDX
        if y >= grouped[active]:
            return
        e = grouped[active + 1 + y]
        first = grouped[e]
        nx = min(grouped[e + 1] - first, window)
        pair = cuda.local.array(window, np.int64)
        xrow = cuda.local.array(window, np.int64)
        for r in range(window):
            if r < nx:
                pair[r] = grouped[n_expert + 1 + first + r]
                xrow[r] = pair[r] // k
        n0 = ((cuda.blockIdx.x & BIDX) * groups + g) * nr
        base = slot_of[e] * n_ff
        acc = cuda.local.array(acc_shape, np.float32)
        dot(ga, gs, ua, us, base + n0, base + n0, base + n_ff - 1, base + n_ff - 1, x, xrow, nx, lane, acc)
        reduce(red, g, lane, acc, nx)
        for j in range(lane, nr * window, tg):
            i, r = j // window, j % window
            if r < nx and n0 + i < n_ff:
                act[pair[r], n0 + i] = silu(red[g, j, 0]) * red[g, (nr + i) * window + r, 0]

    col_blocks = -(-n_ff // (groups * nr))

    def launch(stream, x, grouped, slot_of, ga, gs, ua, us, act):
        kernel[(col_blocks, min(n_expert, x.shape[0] * k)), groups * tg, stream](
            x, grouped, slot_of, ga, gs, ua, us, act)
    return launch


@functools.cache
def decode_down(ggml_type, n_ff: int, n_out: int, n_expert: int, k: int, shape: DecodeShape):
    """launch(stream, act, groups, route_w, slot_of, dw, ds, out): the decode family's routed down
    projection with the weighted sum; the block's groups take the active experts in turn."""
    tg, groups, nr, window = shape.tg, shape.groups, shape.nr, shape.window
    dot, reduce = decode_core(ggml_type, n_ff, nr, 0, tg, shape.cw, shape.unroll, window)
    red_shape, dots_shape, acc_shape = (groups, nr * window, tg), (window * k, nr), (nr, window)

    @cuda.jit
    def kernel(act, grouped, route_w, slot_of, dw, ds, out):
        red = cuda.shared.array(red_shape, np.float32)
        dots = cuda.shared.array(dots_shape, np.float32)
        t = cuda.threadIdx.x & IDX
        g, lane = t // tg, t % tg
        rows = route_w.shape[0]
        active = n_expert + 1 + rows * k
        n_active = grouped[active]
        n0 = (cuda.blockIdx.x & BIDX) * nr
        pair = cuda.local.array(window, np.int64)
        xrow = cuda.local.array(window, np.int64)     # = pair, kept apart: the hot loop indexes it by constants
        acc = cuda.local.array(acc_shape, np.float32)
        for it in range(-(-n_active // groups)):
            y = it * groups + g
            nx, base = 0, 0
            if y < n_active:
                e = grouped[active + 1 + y]
                first = grouped[e]
                nx = min(grouped[e + 1] - first, window)
                base = slot_of[e] * n_out
                for r in range(window):
                    if r < nx:
                        pair[r] = grouped[n_expert + 1 + first + r]
                        xrow[r] = pair[r]
            dot(dw, ds, dw, ds, base + n0, base, base + n_out - 1, base, act, xrow, nx, lane, acc)
            reduce(red, g, lane, acc, nx)
            for j in range(lane, nr * window, tg):
                if j % window < nx:
                    dots[pair[j % window], j // window] = red[g, j, 0]
            cuda.syncthreads()
        for q in range(t, rows * nr, groups * tg):
            r, i = q // nr, q % nr
            if n0 + i < n_out:
                total = route_w[r, 0] * dots[r * k, i]
                for j in range(1, k):
                    total += route_w[r, j] * dots[r * k + j, i]
                out[r, n0 + i] = total

    blocks = -(-n_out // nr)

    def launch(stream, act, grouped, route_w, slot_of, dw, ds, out):
        kernel[blocks, groups * tg, stream](act, grouped, route_w, slot_of, dw, ds, out)
    return launch


# ---------------------------------------------------------------------------------------------------------
# prefill family


@cuda.jit(device=True, inline=True)
def _levels(count):
    """Scan levels covering `count` entries: the least L with 2**L >= count."""
    levels = 0
    while (1 << levels) < count:
        levels += 1
    return levels


@cuda.jit(device=True, inline=True)
def _find_tile(grouped, tile_index, n_expert, bm, scan, found):
    """(expert, tile) of the block's tile number, tiles counted expert by expert (ceil(pairs / bm) each);
    expert -1 past the last tile. Every thread calls it; min(n_expert, THREADS) of them count experts."""
    t = cuda.threadIdx.x & IDX
    per_thread = -(-n_expert // THREADS)
    levels = _levels(-(-n_expert // per_thread))
    mine = 0
    for q in range(per_thread):
        e = t * per_thread + q
        if e < n_expert:
            mine += -(-(grouped[e + 1] - grouped[e]) // bm)
    if t == 0:
        found[0] = -1
    scan[t] = mine
    _scan(scan, t, levels)
    start = scan[t] - mine
    if start <= tile_index < scan[t]:
        for q in range(per_thread):
            e = t * per_thread + q
            if e < n_expert:
                tiles = -(-(grouped[e + 1] - grouped[e]) // bm)
                if start <= tile_index < start + tiles:
                    found[0] = e
                    found[1] = tile_index - start
                start += tiles
    cuda.syncthreads()
    return found[0], found[1]


@functools.cache
def prefill_kernel(ggml_type, n_in: int, n_cols: int, n_expert: int, k: int, down: bool):
    """kernel[(col tiles, tiles), THREADS](x, groups, route_w, slot_of, wa, sa, wb, sb, out, slot): one tile
    of one expert's pairs.
    gate/up (down False; slot -1, route_w unused): the expert's pairs in list order, x rows pair // k, tile
      rows 0..63 gate and 64..127 up for the same 64 columns; out (act) row pair = silu(gate) * up.
    down (slot j): the expert's pairs of slot j, ranked in list order, x (act) rows pair; out row
      pair // k = route_w * dot (j = 0) or out + route_w * dot (j > 0)."""
    bm = PREFILL_BM
    tile = prefill_core(ggml_type, n_in, bm)
    tm = bm // 16
    cols = BN if down else BN // 2

    @cuda.jit
    def kernel(x, grouped, route_w, slot_of, wa, sa, wb, sb, out, slot):
        xs = cuda.shared.array(X_TILE, np.float32, alignment=ALIGN)
        ws = cuda.shared.array(W_TILE, np.float32, alignment=ALIGN)
        scan = cuda.shared.array(THREADS, np.int64)
        found = cuda.shared.array(2, np.int64)
        pairs = cuda.shared.array(bm, np.int64)
        xrows = cuda.shared.array(bm, np.int64)
        t = cuda.threadIdx.x & IDX
        e, tile_no = _find_tile(grouped, cuda.blockIdx.y & BIDX, n_expert, bm, scan, found)
        if e < 0:
            return
        first = grouped[e]
        count = grouped[e + 1] - first
        if down:
            # the slot's pairs, ranked in list order: rank r goes to tile r // bm, row r % bm
            per_thread = -(-count // THREADS)
            levels = _levels(-(-count // per_thread))
            lo, hi = t * per_thread, min(count, (t + 1) * per_thread)
            mine = 0
            for q in range(lo, hi):
                if grouped[n_expert + 1 + first + q] % k == slot:
                    mine += 1
            if t < bm:
                pairs[t] = -1
            scan[t] = mine
            _scan(scan, t, levels)
            if tile_no * bm >= scan[(1 << levels) - 1]:
                return
            rank = scan[t] - mine
            for q in range(lo, hi):
                p = grouped[n_expert + 1 + first + q]
                if p % k == slot:
                    if tile_no * bm <= rank < (tile_no + 1) * bm:
                        pairs[rank - tile_no * bm] = p
                    rank += 1
        elif t < bm:
            q = tile_no * bm + t
            pairs[t] = grouped[n_expert + 1 + first + q] if q < count else -1
        cuda.syncthreads()
        if t < bm:
            xrows[t] = pairs[t] if down or pairs[t] < 0 else pairs[t] // k
        cuda.syncthreads()
        n0 = (cuda.blockIdx.x & BIDX) * cols
        base = slot_of[e] * n_cols
        last = base + n_cols - 1
        acc = cuda.local.array((tm, 8), np.float32)
        tile(x, xrows, wa, sa, wb, sb, base + n0, base + n0 + cols - BN // 2, last, last, xs, ws, acc)
        tx, ty = t % 16, t // 16
        for i in range(tm):
            p = pairs[(i // 4) * (bm // (tm // 4)) + ty * 4 + i % 4]
            if p >= 0:
                weight = route_w[p // k, slot] if down else np.float32(0)
                for j in range(8 if down else 4):
                    n = n0 + (j // 4) * (BN // 2) + tx * 4 + j % 4
                    if n < n_cols:
                        if not down:
                            out[p, n] = silu(acc[i, j]) * acc[i, j + 4]
                        elif slot == 0:
                            out[p // k, n] = weight * acc[i, j]
                        else:
                            out[p // k, n] = out[p // k, n] + weight * acc[i, j]

    return kernel, -(-n_cols // cols)


def _max_tiles(n_pairs: int, n_expert: int) -> int:
    """Tiles the experts' pairs can make at most: sum over experts of ceil(pairs / PREFILL_BM)."""
    return -(-n_pairs // PREFILL_BM) + min(n_expert, n_pairs)


# ---------------------------------------------------------------------------------------------------------
# factories


@functools.cache
def make_moe_swiglu_matmul(family: str, ggml_type, n_in: int, n_ff: int, n_expert: int, k: int):
    """launch(stream, x, groups, slot_of, gate, up, act): act[r * k + j] = silu(gate[s] @ x[r]) * (up[s] @ x[r])
    with s = slot_of[ids[r, j]]; gate/up (n_slots, n_ff, n_in)."""
    check(family, ggml_type, n_in, n_ff)
    if family == "decode":
        def launch(stream, x, grouped, slot_of, gate, up, act):
            shape = decode_swiglu_shape(ggml_type, n_in, window_rows(x))
            decode_swiglu(T(ggml_type), n_in, n_ff, n_expert, k, shape)(
                stream, x, grouped, slot_of, *words(gate), *words(up), act)
        return launch
    kernel, col_tiles = prefill_kernel(T(ggml_type), n_in, n_ff, n_expert, k, False)

    def launch(stream, x, grouped, slot_of, gate, up, act):
        grid = (col_tiles, _max_tiles(x.shape[0] * k, n_expert))
        kernel[grid, THREADS, stream](x, grouped, x, slot_of, *words(gate), *words(up), act, -1)   # x: no route_w
    return launch


@functools.cache
def make_moe_down_matmul(family: str, ggml_type, n_ff: int, n_out: int, n_expert: int, k: int):
    """launch(stream, act, groups, route_w, slot_of, down, out): out[r] = sum over j = 0..k-1, in order, of
    route_w[r, j] * (down[slot_of[ids[r, j]]] @ act[r * k + j]); down (n_slots, n_out, n_ff)."""
    check(family, ggml_type, n_ff, n_out)
    if family == "decode":
        def launch(stream, act, grouped, route_w, slot_of, down, out):
            shape = decode_down_shape(ggml_type, n_ff, window_rows(route_w))
            decode_down(T(ggml_type), n_ff, n_out, n_expert, k, shape)(
                stream, act, grouped, route_w, slot_of, *words(down), out)
        return launch
    kernel, col_tiles = prefill_kernel(T(ggml_type), n_ff, n_out, n_expert, k, True)

    def launch(stream, act, grouped, route_w, slot_of, down, out):
        grid = (col_tiles, _max_tiles(route_w.shape[0] * k, n_expert))
        dw, ds = words(down)
        for slot in range(k):       # pass j adds slot j's terms: the weighted sum runs in slot order
            kernel[grid, THREADS, stream](act, grouped, route_w, slot_of, dw, ds, dw, ds, out, slot)
    return launch
