"""Routed experts: (row, slot) pairs grouped by expert, each expert's SwiGLU gate/up and its down projection,
then the route-weighted sum, on the matmul cores of `codegen.lower.matmul` (same dots, same orders).

The groups buffer (`codegen.graph.moe_groups_length`): offsets[n_expert + 1], then pairs[rows * k] (pair =
row * k + slot, ascending within an expert), then active[n_expert + 1] (the count of experts with pairs, then
those experts ascending). Grids never depend on it: blocks past the work it describes return at once. A
prefill launch whose routing the host knows (the engine reads it back for the prefill ring) may be given its
exact tile count instead (`range_tiles`), not the bound for every possible routing (which, for the narrow
ranges a shallow ring streams, launches mostly idle blocks: BENCHMARKS.md, the prefill ring's timeline).

Two weight sources. Expert e's gate/up/down rows are read from the VRAM slot arrays at slot slot_of[e] when
slot_of[e] >= 0 (the expert cache, the prefill ring, the drafter's block), else from the host arrays
(n_expert, rows, cols) at index e (the mapped pinned host copy, zero-copy). A slot array is (n_slots, rows,
cols) contiguous, or blob-major (`slot_bytes` > 0: slot s starts s * slot_bytes after slot 0, the runtime's
`planner.model.SlotLayout`); a kernel takes each source's expert as a view starting at its first row
(`ExpertStrides`). Same packed layout, same code path: a result is bitwise the same whichever source or
slot an expert is read from.

The weighted sum: each output row adds its k route-weighted terms in ascending expert id order (top-k picks
distinct experts per row), from 0, then adds that sum to the residual stream in place (the block's residual
add, as the kernel's epilogue).

decode family: a window's rows pick distinct experts each (top-k does), so an expert has at most
  MAX_WINDOW pairs. routing (`make_moe_route`): one block selects, weighs and groups the window's pairs, where
  prefill takes two launches (`pointwise.make_router`, `make_moe_groups`). gate/up: block (column group, y)
  computes every pair of the y-th active expert with one read of its rows. down: a block owns a few output
  columns; its groups take the active experts in turn, each expert's rows read once, the pairs' dots and
  experts kept in shared memory; then each output is the route-weighted sum over the row's experts,
  ascending. One launch over every expert.
prefill family: each expert is a small GEMM over its gathered pairs, tiled by the prefill core; tiles are
  numbered across the experts of the launch's range lo <= e < hi (an in-block scan of the offsets maps a
  block to its expert and tile); pairs of other experts are not touched. gate/up writes a pair's act row,
  down a pair's term row (its dot, an arena row per pair: pairs x n_embd floats), each reading an expert's
  weights once; the combine (`make_moe_combine`, once the block's every range is done) weighs and adds each
  row's k terms in ascending expert order. So launches over [0, a), [a, b), ..., [z, n_expert) (the ranges a
  prefill ring streams experts in) give bitwise the out of one launch over every expert.
"""

import functools
from typing import NamedTuple

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import EXPERT_TILE_ROWS, expert_tiles, tile_cols
from codegen.lower import MAX_WINDOW, pointwise
from codegen.lower.cuda import (BIDX, IDX, SHARED_ALIGN, SIMULATOR, begin_after_prior_grids, check_aligned, cuda,
                                launch_kernel, overlapping)
from codegen.lower.matmul import check, words
from codegen.lower.matmul_decode import (ROW_VALUES, DecodeShape, check_group_rows, decode_core, group_first_row,
                                         window_rows)
from codegen.lower.matmul_prefill import BK, BN, PAD, THREADS, W_TILE, prefill_core
from codegen.lower.pointwise import WARP, silu
from codegen.lower.word_formats import FORMATS

GROUP_THREADS = 1024    # at most, for make_moe_groups: a block's threads, each a run of consecutive pairs
# make_moe_route's block, which takes the window's rows in turn: 512 threads (ptxas for sm_90 gives it 69-92 registers,
# over 1024 threads' 64); the simulator, which runs a thread in Python, one warp
ROUTE_THREADS = WARP if SIMULATOR else 512
X_TILE = (2, BK, EXPERT_TILE_ROWS + PAD)


class ExpertStrides(NamedTuple):
    """Words (int32) and scales (float16) from one expert's first row to the next one's, in the slot arrays
    and in the host copy."""
    slot_words: int
    slot_scales: int
    host_words: int
    host_scales: int


def expert_strides(ggml_type, n_rows: int, n_in: int, slot_bytes: int) -> ExpertStrides:
    """The strides of experts of n_rows x n_in values; slot_bytes 0: slot arrays as contiguous as the host's."""
    fmt = FORMATS[T(ggml_type)]
    host = (n_rows * fmt.row_words(n_in), n_rows * fmt.row_scales(n_in))
    slot = (slot_bytes // 4, slot_bytes // 2) if slot_bytes else host
    return ExpertStrides(*slot, *host)


@cuda.jit(device=True, inline=True)
def _source(slot_of, e, strides, wa, sa, wb, sb, hwa, hsa, hwb, hsb):
    """(words and scales of a, of b) of expert e, each a view from its first row: its VRAM slot, or (slot -1)
    the host copy."""
    s = slot_of[e]
    if s >= 0:
        w, c = s * strides.slot_words, s * strides.slot_scales
        return wa[w:], sa[c:], wb[w:], sb[c:]
    w, c = e * strides.host_words, e * strides.host_scales
    return hwa[w:], hsa[c:], hwb[w:], hsb[c:]


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


@cuda.jit(device=True, inline=True)
def _offsets_and_active(groups, counts, flags, total, t, levels, n_expert, n_pairs):
    """The groups buffer's offsets and active list, from the scanned counts (counts[e]: the pairs of experts
    <= e; thread t's `total`: expert t's own); every thread of the block calls it."""
    if t < n_expert:
        groups[t] = counts[t] - total
    if t == 0:
        groups[n_expert] = n_pairs
    flags[t] = 1 if t < n_expert and total > 0 else 0
    _scan(flags, t, levels)
    active = n_expert + 1 + n_pairs
    if t < n_expert and total > 0:
        groups[active + flags[t]] = t
    if t == 0:
        groups[active] = flags[(1 << levels) - 1]


@functools.cache
def make_moe_groups(n_expert: int, k: int):
    """launch(stream, ids, groups): ids int32 (rows, k) -> the groups buffer. A block per expert, each thread a
    run of consecutive pairs: every block counts all experts (shared-memory atomics: a count is the same in any
    order), scans them to its expert's offset and its threads' matches to their starts, and writes its
    expert's pairs in order; block 0 also writes the offsets and the active list. Each block reads the ids
    twice (they stay in L2), and no block waits on another (the previous kernel was one block whose threads
    each scanned a segment for one expert: 1.3 ms for 2048 rows of 8 of 128, BENCHMARKS.md)."""
    if not 0 < k <= n_expert <= GROUP_THREADS:
        raise ValueError(f"top {k} of {n_expert} experts: the grouping kernel takes 1..{GROUP_THREADS} experts")

    @overlapping
    @cuda.jit
    def kernel(ids, groups, levels):
        begin_after_prior_grids()
        counts = cuda.shared.array(GROUP_THREADS, np.int32)     # every expert's pairs, then their running sum
        runs = cuda.shared.array(GROUP_THREADS, np.int32)       # the thread's matches, then their running sum
        flags = cuda.shared.array(GROUP_THREADS, np.int32)
        t = cuda.threadIdx.x & IDX
        e = cuda.blockIdx.x & BIDX
        threads = 1 << levels
        n_pairs = ids.shape[0] * k
        counts[t] = 0
        cuda.syncthreads()
        length = -(-n_pairs // threads)
        lo, hi = t * length, min(n_pairs, (t + 1) * length)
        mine = 0
        for p in range(lo, hi):
            x = ids[p // k, p % k]
            cuda.atomic.add(counts, x, 1)
            if x == e:
                mine += 1
        runs[t] = mine
        _scan(runs, t, levels)
        total = counts[t]          # (the scan's barriers follow every count)
        _scan(counts, t, levels)
        pos = n_expert + 1 + (counts[e - 1] if e > 0 else 0) + runs[t] - mine      # where its first match goes
        for p in range(lo, hi):
            if ids[p // k, p % k] == e:
                groups[pos] = p
                pos += 1
        if e == 0:
            _offsets_and_active(groups, counts, flags, total, t, levels, n_expert, n_pairs)

    def launch(stream, ids, groups):
        # a thread a pair up to GROUP_THREADS; the simulator, which runs each thread in Python, takes the
        # fewest its scans allow (the buffer is the same for any count)
        threads = 32
        while threads < max(n_expert, 0 if SIMULATOR else min(ids.shape[0] * k, GROUP_THREADS)):
            threads *= 2
        launch_kernel(kernel, n_expert, threads, stream, ids, groups, threads.bit_length() - 1)
    return launch


@functools.cache
def make_moe_route(n_expert: int, k: int, gating: str, normalize: bool, scale: float):
    """launch(stream, logits, bias, ids, weights, groups, host_ids=None): a decode window's routing in one launch,
    a block:
    each row's ids and route weights in turn (`pointwise.block_router`, as prefill's `make_router` runs it on
    fewer threads: the same bits), then their pairs grouped into `make_moe_groups`' buffer (the same values). The
    grouping counts straight from the window's ids in shared memory (at most MAX_WINDOW * k pairs), a thread
    a pair and an expert: an expert's offset is the pairs of lower experts, a pair's place its offset plus the
    same expert's earlier pairs, an active expert's rank the distinct lower experts; one barrier beyond the
    router's. The ids also go to `host_ids` (MAX_WINDOW or more rows, k; the runtime's mapped host memory),
    where the host reads them after the step: a copy node between this launch and the next would hold the
    next one back until the copy is done (no overlapping launch across it), once per MoE block and step."""
    route = pointwise.block_router(n_expert, k, gating, normalize, scale, ROUTE_THREADS)
    max_pairs = MAX_WINDOW * k

    @overlapping
    @cuda.jit
    def kernel(logits, bias, ids, weights, groups, host_ids):
        begin_after_prior_grids()
        chosen = cuda.shared.array((MAX_WINDOW, k), np.int32)
        first = cuda.shared.array(max_pairs, np.int32)        # 1: the pair is its expert's first
        t = cuda.threadIdx.x & IDX
        rows = ids.shape[0]
        for row in range(rows):
            route(logits, bias, row, chosen, weights)
        n_pairs = rows * k
        for p in range(t, n_pairs, ROUTE_THREADS):
            expert = chosen[p // k, p % k]
            ids[p // k, p % k] = expert
            host_ids[p // k, p % k] = expert
            below, before = 0, 0
            for q in range(n_pairs):
                other = chosen[q // k, q % k]
                below += other < expert
                before += (other == expert) & (q < p)
            groups[n_expert + 1 + below + before] = p
            first[p] = before == 0
        for e in range(t, n_expert, ROUTE_THREADS):
            below = 0
            for q in range(n_pairs):
                below += chosen[q // k, q % k] < e
            groups[e] = below
        if t == 0:
            groups[n_expert] = n_pairs
        cuda.syncthreads()
        active = n_expert + 1 + n_pairs
        for p in range(t, n_pairs, ROUTE_THREADS):
            if first[p]:
                expert = chosen[p // k, p % k]
                rank = 0
                for q in range(n_pairs):
                    rank += first[q] & (chosen[q // k, q % k] < expert)
                groups[active + 1 + rank] = expert
        if t == 0:
            distinct = 0
            for q in range(n_pairs):
                distinct += first[q]
            groups[active] = distinct

    def launch(stream, logits, bias, ids, weights, groups, host_ids=None):
        window_rows(logits)
        launch_kernel(kernel, 1, ROUTE_THREADS, stream, logits, bias, ids, weights, groups,
                      ids if host_ids is None else host_ids)
    return launch


# ---------------------------------------------------------------------------------------------------------
# decode family


def decode_swiglu_shape(window: int) -> DecodeShape:
    """A warp per group, 1 gate + 1 up row or as many pairs as its sums allow (ROW_VALUES / 2 / window): an
    expert's columns spread over many blocks, each chunk's activations serve every row."""
    nr = max(1, ROW_VALUES // 2 // window)
    return DecodeShape(32, 8, nr, 1, window)


def decode_down_shape(window: int) -> DecodeShape:
    """A warp per active expert (a one-token step's 8 at once), 2 rows each or ROW_VALUES / window."""
    nr = max(2, ROW_VALUES // window)
    return DecodeShape(32, 8, nr, 1, window)


@functools.cache
def decode_swiglu(ggml_type, n_in: int, n_ff: int, n_expert: int, k: int, shape: DecodeShape,
                  strides: ExpertStrides):
    """launch(stream, x, groups, slot_of, ga, gs, ua, us, hga, hgs, hua, hus, act): the decode family's routed
    gate/up; expert e's rows come from the slot arrays (g*, u*) at slot_of[e], or the host arrays (hg*, hu*)
    at e when slot_of[e] < 0."""
    tg, groups, nr, window = shape.tg, shape.groups, shape.nr, shape.window
    check_group_rows("an expert's gate and up", n_ff, nr)
    dot, reduce = decode_core(ggml_type, n_in, nr, nr, tg, shape.unroll, window)
    red_shape, acc_shape = (groups, 2 * nr * window, tg), (2 * nr, window)

    @overlapping
    @cuda.jit
    def kernel(x, grouped, slot_of, ga, gs, ua, us, hga, hgs, hua, hus, act):
        begin_after_prior_grids()
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
        wa, sa, wb, sb = _source(slot_of, e, strides, ga, gs, ua, us, hga, hgs, hua, hus)
        acc = cuda.local.array(acc_shape, np.float32)
        row0 = group_first_row(n0, nr, n_ff)
        dot(wa, sa, wb, sb, row0, row0, x, xrow, nx, lane, acc)
        reduce(red, g, lane, acc, nx)
        for j in range(lane, nr * window, tg):
            i, r = j // window, j % window
            if r < nx and row0 + i >= n0:
                act[pair[r], row0 + i] = silu(red[g, j, 0]) * red[g, (nr + i) * window + r, 0]

    col_blocks = -(-n_ff // (groups * nr))

    def launch(stream, x, grouped, slot_of, ga, gs, ua, us, hga, hgs, hua, hus, act):
        launch_kernel(kernel, (col_blocks, min(n_expert, x.shape[0] * k)), groups * tg, stream,
            x, grouped, slot_of, ga, gs, ua, us, hga, hgs, hua, hus, act)
    return launch


@functools.cache
def decode_down(ggml_type, n_ff: int, n_out: int, n_expert: int, k: int, shape: DecodeShape,
                strides: ExpertStrides):
    """launch(stream, act, groups, route_w, slot_of, dw, ds, hdw, hds, out): the decode family's routed down
    projection with the weighted sum (expert e's rows from dw/ds at slot_of[e], or hdw/hds at e when
    slot_of[e] < 0); the block's groups take the active experts in turn, then each output sums its row's
    terms in ascending expert id order and adds the sum to out (the residual stream)."""
    tg, groups, nr, window = shape.tg, shape.groups, shape.nr, shape.window
    check_group_rows("an expert's down projection", n_out, nr)
    dot, reduce = decode_core(ggml_type, n_ff, nr, 0, tg, shape.unroll, window)
    red_shape, dots_shape, acc_shape = (groups, nr * window, tg), (window * k, nr), (nr, window)
    n_pairs = window * k

    @overlapping
    @cuda.jit
    def kernel(act, grouped, route_w, slot_of, dw, ds, hdw, hds, out):
        begin_after_prior_grids()
        red = cuda.shared.array(red_shape, np.float32)
        dots = cuda.shared.array(dots_shape, np.float32)
        expert = cuda.shared.array(n_pairs, np.int32)      # pair -> its expert
        order = cuda.shared.array(n_pairs, np.int32)       # row r's slots by ascending expert: order[r * k + q]
        t = cuda.threadIdx.x & IDX
        g, lane = t // tg, t % tg
        rows = route_w.shape[0]
        active = n_expert + 1 + rows * k
        n_active = grouped[active]
        n0 = (cuda.blockIdx.x & BIDX) * nr
        row0 = group_first_row(n0, nr, n_out)      # dots[:, i] is row row0 + i
        pair = cuda.local.array(window, np.int64)
        xrow = cuda.local.array(window, np.int64)     # = pair, kept apart: the hot loop indexes it by constants
        acc = cuda.local.array(acc_shape, np.float32)
        for it in range(-(-n_active // groups)):
            y = it * groups + g
            nx, e = 0, 0
            wa, sa = dw, ds
            if y < n_active:
                e = grouped[active + 1 + y]
                first = grouped[e]
                nx = min(grouped[e + 1] - first, window)
                wa, sa, _wb, _sb = _source(slot_of, e, strides, dw, ds, dw, ds, hdw, hds, hdw, hds)
                for r in range(window):
                    if r < nx:
                        pair[r] = grouped[n_expert + 1 + first + r]
                        xrow[r] = pair[r]
            dot(wa, sa, wa, sa, row0, 0, act, xrow, nx, lane, acc)
            reduce(red, g, lane, acc, nx)
            for j in range(lane, nr * window, tg):
                if j % window < nx:
                    dots[pair[j % window], j // window] = red[g, j, 0]
            if lane == 0:
                for r in range(window):
                    if r < nx:
                        expert[pair[r]] = e
            cuda.syncthreads()
        if t < rows * k:
            r = t // k
            rank = 0
            for j in range(k):      # ties (a repeated expert, which top-k never gives) go by slot
                other = expert[r * k + j]
                if other < expert[t] or (other == expert[t] and j < t % k):
                    rank += 1
            order[r * k + rank] = t % k
        cuda.syncthreads()
        for q in range(t, rows * nr, groups * tg):
            r, i = q // nr, q % nr
            if row0 + i >= n0:
                j = order[r * k]
                total = route_w[r, j] * dots[r * k + j, i]
                for m in range(1, k):
                    j = order[r * k + m]
                    total += route_w[r, j] * dots[r * k + j, i]
                out[r, row0 + i] = out[r, row0 + i] + total

    blocks = -(-n_out // nr)

    def launch(stream, act, grouped, route_w, slot_of, dw, ds, hdw, hds, out):
        launch_kernel(kernel, blocks, groups * tg, stream, act, grouped, route_w, slot_of, dw, ds, hdw, hds, out)
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
def _find_tile(grouped, tile_index, lo, hi, bm, scan, found):
    """(expert, tile) of the block's tile number, tiles counted expert by expert over experts lo..hi - 1
    (ceil(pairs / bm) each); expert -1 past the last tile. Every thread calls it; min(hi - lo, THREADS) of
    them count experts."""
    t = cuda.threadIdx.x & IDX
    n_range = hi - lo
    per_thread = -(-n_range // THREADS)
    levels = _levels(-(-n_range // per_thread))
    mine = 0
    for q in range(per_thread):
        e = lo + t * per_thread + q
        if e < hi:
            mine += -(-(grouped[e + 1] - grouped[e]) // bm)
    if t == 0:
        found[0] = -1
    scan[t] = mine
    _scan(scan, t, levels)
    start = scan[t] - mine
    if start <= tile_index < scan[t]:
        for q in range(per_thread):
            e = lo + t * per_thread + q
            if e < hi:
                tiles = -(-(grouped[e + 1] - grouped[e]) // bm)
                if start <= tile_index < start + tiles:
                    found[0] = e
                    found[1] = tile_index - start
                start += tiles
    cuda.syncthreads()
    return found[0], found[1]


@functools.cache
def prefill_kernel(ggml_type, n_in: int, n_cols: int, n_expert: int, k: int, down: bool, strides: ExpertStrides):
    """kernel[(col tiles, tiles), THREADS](x, groups, slot_of, wa, sa, wb, sb, hwa, hsa, hwb, hsb, out, lo, hi):
    one tile of one expert e (lo <= e < hi) of its pairs, in list order; e's rows from the slot arrays (w*,
    s*) at slot_of[e], or the host arrays (hw*, hs*) at e when slot_of[e] < 0.
    gate/up (down False): x rows pair // k, tile rows 0..63 gate and 64..127 up for the same 64 columns; out
      (act) row pair = silu(gate) * up.
    down (b unused): x (act) rows pair; out (terms) row pair = the dot."""
    bm = EXPERT_TILE_ROWS
    tile = prefill_core(ggml_type, n_in, bm)
    tm = bm // 16
    cols = tile_cols(not down)
    pairs_at = n_expert + 1                        # the pairs list's start in the groups buffer

    @cuda.jit
    def kernel(x, grouped, slot_of, wa, sa, wb, sb, hwa, hsa, hwb, hsb, out, lo, hi):
        xs = cuda.shared.array(X_TILE, np.float32, alignment=SHARED_ALIGN)
        ws = cuda.shared.array(W_TILE, np.float32, alignment=SHARED_ALIGN)
        scan = cuda.shared.array(THREADS, np.int64)
        found = cuda.shared.array(2, np.int64)
        pairs = cuda.shared.array(bm, np.int64)
        xrows = cuda.shared.array(bm, np.int64)
        t = cuda.threadIdx.x & IDX
        e, tile_no = _find_tile(grouped, cuda.blockIdx.y & BIDX, lo, hi, bm, scan, found)
        if e < 0:
            return
        first = grouped[e]
        count = grouped[e + 1] - first
        if t < bm:
            q = tile_no * bm + t
            pairs[t] = grouped[pairs_at + first + q] if q < count else -1
            xrows[t] = -1 if q >= count else (pairs[t] if down else pairs[t] // k)
        cuda.syncthreads()
        n0 = (cuda.blockIdx.x & BIDX) * cols
        a_words, a_scales, b_words, b_scales = _source(slot_of, e, strides, wa, sa, wb, sb, hwa, hsa, hwb, hsb)
        last = n_cols - 1
        acc = cuda.local.array((tm, 8), np.float32)
        tile(x, xrows, a_words, a_scales, b_words, b_scales, n0, n0 + cols - BN // 2, last, last, xs, ws, acc)
        tx, ty = t % 16, t // 16
        for i in range(tm):
            p = pairs[(i // 4) * (bm // (tm // 4)) + ty * 4 + i % 4]
            if p >= 0:
                for j in range(8 if down else 4):
                    n = n0 + (j // 4) * (BN // 2) + tx * 4 + j % 4
                    if n < n_cols:
                        out[p, n] = acc[i, j] if down else silu(acc[i, j]) * acc[i, j + 4]

    return kernel, -(-n_cols // cols)


COMBINE_THREADS = 32 if SIMULATOR else 128     # the simulator runs a thread each: the fewest that hold k
MAX_COMBINED_K = 32


@functools.cache
def make_moe_combine(n_out: int, k: int):
    """launch(stream, terms, ids, route_w, out): out[r] += the sum over the row's experts e = ids[r, j], in
    ascending id order (top-k's are distinct; a repeated id would go by slot), of route_w[r, j] * terms[r * k
    + j], from 0 (out: the residual stream): the prefill down projection's weighted sum (its terms come expert range by expert range as
    the prefill ring streams experts; the sum waits for all of them and never depends on the ranges)."""
    @overlapping
    @cuda.jit
    def kernel(terms, ids, route_w, out):
        begin_after_prior_grids()
        order = cuda.shared.array(MAX_COMBINED_K, np.int32)
        r = cuda.blockIdx.x & BIDX
        t = cuda.threadIdx.x & IDX
        if t < k:
            mine, rank = ids[r, t], 0
            for m in range(k):
                other = ids[r, m]
                if other < mine or (other == mine and m < t):
                    rank += 1
            order[rank] = t
        cuda.syncthreads()
        for n in range((cuda.blockIdx.y & BIDX) * COMBINE_THREADS + t, n_out, COMBINE_THREADS * cuda.gridDim.y):
            total = np.float32(0)
            for q in range(k):
                j = order[q]
                total = total + route_w[r, j] * terms[r * k + j, n]
            out[r, n] = out[r, n] + total

    if not 0 < k <= MAX_COMBINED_K:
        raise ValueError(f"top {k} experts: the prefill combine adds at most {MAX_COMBINED_K} terms a row")
    column_blocks = max(1, min(8, n_out // (4 * COMBINE_THREADS)))

    def launch(stream, terms, ids, route_w, out):
        rows = out.shape[0]
        if rows:
            launch_kernel(kernel, (rows, column_blocks), COMBINE_THREADS, stream, terms, ids, route_w, out)
    return launch


def range_tiles(ids: np.ndarray, n_expert: int, edges) -> list:
    """The tiles of each expert range [edges[i], edges[i + 1]) for a chunk routed to ids (rows, k): the sum
    over its experts of `expert_tiles`, what the kernels would find in the groups buffer, counted on the host (a
    prefill launch given them has grids of exactly that many tiles)."""
    cumulative = np.concatenate([[0], np.cumsum(expert_tiles(ids, n_expert))])
    return [int(cumulative[b] - cumulative[a]) for a, b in zip(edges, edges[1:])]


def _max_tiles(rows: int, k: int, n_range: int) -> int:
    """Tiles the pairs of n_range experts can make at most: the sum over them of ceil(pairs / EXPERT_TILE_ROWS)
    is at most floor(P / EXPERT_TILE_ROWS) + the experts with pairs, where rows give P <= rows * min(k, n_range)
    such pairs (top-k's experts are distinct)."""
    n_pairs = rows * min(k, n_range)
    return n_pairs // EXPERT_TILE_ROWS + min(n_range, n_pairs)


def _range(family: str, n_expert: int, lo, hi, tiles=None) -> tuple:
    """(lo, hi) checked: prefill takes any 0 <= lo <= hi <= n_expert; decode runs over every expert, its grid
    from no routing (a captured graph replays it for any)."""
    hi = n_expert if hi is None else hi
    if family == "decode":
        if tiles is not None:
            raise ValueError("a decode-family launch takes no tile count: its grid covers any routing")
        if lo != 0 or hi != n_expert:
            raise ValueError(f"expert range [{lo}, {hi}) in a decode-family launch: decode runs over all "
                             f"{n_expert} experts at once (lo=0, hi=None); only prefill launches take a range")
    elif not 0 <= lo <= hi <= n_expert:
        raise ValueError(f"expert range [{lo}, {hi}): need 0 <= lo <= hi <= {n_expert} (the layer's experts)")
    return int(lo), int(hi)


# ---------------------------------------------------------------------------------------------------------
# factories


@functools.cache
def make_moe_swiglu_matmul(family: str, ggml_type, n_in: int, n_ff: int, n_expert: int, k: int, slot_bytes: int = 0):
    """launch(stream, x, groups, slot_of, gate, up, host_gate, host_up, act, lo=0, hi=None, tiles=None):
    act[r * k + j] = silu(G @ x[r]) * (U @ x[r]) for the pairs whose expert e = ids[r, j] has lo <= e < hi
    (hi None: n_expert; decode: every expert, no range), other act rows untouched; G, U = gate[slot_of[e]],
    up[slot_of[e]] (gate/up: slots of n_ff x n_in, contiguous or `slot_bytes` apart), or host_gate[e],
    host_up[e] (host_* (n_expert, n_ff, n_in), contiguous) when slot_of[e] < 0. tiles (prefill only): the
    range's tiles from the routing (`range_tiles`), else the grid covers any routing."""
    check(family, ggml_type, n_in, n_ff)
    strides = expert_strides(ggml_type, n_ff, n_in, slot_bytes)
    if family == "decode":
        def launch(stream, x, grouped, slot_of, gate, up, host_gate, host_up, act, lo=0, hi=None, tiles=None):
            _range(family, n_expert, lo, hi, tiles)
            check_aligned("a routed gate/up's activations", x)
            shape = decode_swiglu_shape(window_rows(x))
            decode_swiglu(T(ggml_type), n_in, n_ff, n_expert, k, shape, strides)(
                stream, x, grouped, slot_of, *words(gate), *words(up), *words(host_gate), *words(host_up),
                act)
        return launch
    return _prefill_launch(prefill_kernel(T(ggml_type), n_in, n_ff, n_expert, k, False, strides), n_expert, k)


@functools.cache
def make_moe_down_matmul(family: str, ggml_type, n_ff: int, n_out: int, n_expert: int, k: int, slot_bytes: int = 0):
    """D = down[slot_of[e]] (down: slots of n_out x n_ff, contiguous or `slot_bytes` apart), or host_down[e]
    ((n_expert, n_out, n_ff)) when slot_of[e] < 0, for a pair's expert e = ids[r, j].
    prefill: launch(stream, act, groups, slot_of, down, host_down, terms, lo=0, hi=None, tiles=None): terms[r *
      k + j] = D @ act[r * k + j] for the pairs of experts lo <= e < hi (hi None: n_expert), other rows
      untouched; `make_moe_combine` then weighs and adds a row's terms, so launches over any expert ranges give
      the same sum. tiles: as gate/up's.
    decode: launch(stream, act, groups, route_w, slot_of, down, host_down, out): out[r] += the sum over the
      row's experts, in ascending id order, of route_w[r, j] * (D @ act[r * k + j]), summed in registers (out:
      the residual stream, whose add is this kernel's epilogue)."""
    check(family, ggml_type, n_ff, n_out)
    strides = expert_strides(ggml_type, n_out, n_ff, slot_bytes)
    if family == "decode":
        def launch(stream, act, grouped, route_w, slot_of, down, host_down, out, lo=0, hi=None, tiles=None):
            _range(family, n_expert, lo, hi, tiles)
            check_aligned("a routed down projection's activations", act)
            shape = decode_down_shape(window_rows(route_w))
            decode_down(T(ggml_type), n_ff, n_out, n_expert, k, shape, strides)(
                stream, act, grouped, route_w, slot_of, *words(down), *words(host_down), out)
        return launch
    prefill = _prefill_launch(prefill_kernel(T(ggml_type), n_ff, n_out, n_expert, k, True, strides), n_expert, k)

    def launch(stream, act, grouped, slot_of, down, host_down, terms, lo=0, hi=None, tiles=None):
        prefill(stream, act, grouped, slot_of, down, down, host_down, host_down, terms, lo, hi, tiles)   # no b
    return launch


def _prefill_launch(compiled, n_expert: int, k: int):
    """launch(stream, x, groups, slot_of, a, b, host_a, host_b, out, lo, hi, tiles) of a `prefill_kernel`."""
    kernel, col_tiles = compiled

    def launch(stream, x, grouped, slot_of, a, b, host_a, host_b, out, lo=0, hi=None, tiles=None):
        lo, hi = _range("prefill", n_expert, lo, hi)
        if tiles is None:       # out (act or terms) has a row per pair
            tiles = _max_tiles(out.shape[0] // k, k, hi - lo)
        if tiles:
            launch_kernel(kernel, (col_tiles, tiles), THREADS, stream, x, grouped, slot_of, *words(a), *words(b),
                          *words(host_a), *words(host_b), out, lo, hi)
    return launch
