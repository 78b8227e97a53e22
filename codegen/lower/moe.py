"""Routed experts: (row, slot) pairs grouped by expert, each expert's SwiGLU gate/up and its down projection
with the route-weighted sum fused, on the matmul cores of `codegen.lower.matmul` (same dots, same orders).

The groups buffer (`codegen.graph.moe_groups_length`): offsets[n_expert + 1], then pairs[rows * k] (pair =
row * k + slot, ascending within an expert), then active[n_expert + 1] (the count of experts with pairs, then
those experts ascending). Grids never depend on it: blocks past the work it describes return at once. A
prefill launch whose routing the host knows (the engine reads it back for the prefill ring) may be given its
exact work instead (`range_work`): grids of the tiles its pairs make and as many down passes as ranks occur,
not the bounds of every possible routing (which, for the narrow ranges a shallow ring streams, launch mostly
idle blocks and empty passes: BENCHMARKS.md, the prefill ring's timeline).

Two weight sources. Expert e's gate/up/down rows are read from the VRAM slot arrays at slot slot_of[e] when
slot_of[e] >= 0 (the expert cache, the prefill ring, the drafter's block), else from the host arrays
(n_expert, rows, cols) at index e (the mapped pinned host copy, zero-copy). A slot array is (n_slots, rows,
cols) contiguous, or blob-major (`slot_bytes` > 0: slot s starts s * slot_bytes after slot 0, the runtime's
`planner.model.SlotLayout`); a kernel takes each source's expert as a view starting at its first row
(`ExpertStrides`). Same packed layout, same code path: a result is bitwise the same whichever source or
slot an expert is read from.

The weighted sum: each output row adds its k terms in ascending expert id order (top-k picks distinct
experts per row), out[r] = out[r] + w * dot from out[r] = 0 (decode: the same order, summed in registers).

decode family: a window's rows pick distinct experts each (top-k does), so an expert has at most
  MAX_WINDOW pairs. gate/up: block (column group, y) computes every pair of the y-th active expert with one
  read of its rows. down: a block owns a few output columns; its groups take the active experts in turn,
  each expert's rows read once, the pairs' dots and experts kept in shared memory; then each output is the
  route-weighted sum over the row's experts, ascending. One launch over every expert.
prefill family: each expert is a small GEMM over its gathered pairs, tiled by the prefill core; tiles are
  numbered across the experts of the launch's range lo <= e < hi (an in-block scan of the offsets maps a
  block to its expert and tile); pairs of other experts are not touched (gate/up leaves their act rows).
  down runs min(k, hi - lo) passes (or the routing's `RangeWork.passes`), pass q over the pairs whose expert
  has rank q among its row's experts in the range (ascending ids), each row once per pass, every term added
  to out (a launch from lo = 0 zeroes it first), so the weighted sum is in ascending expert order, and
  launches over [0, a), [a, b), ..., [z, n_expert) in turn give bitwise the out of one launch over
  [0, n_expert) (the ranges a prefill ring streams experts in; a one-expert range is one pass). Each pass
  reads an expert's weights once. A first kernel of the launch finds the rank of every pair of the range's
  experts (one scan of their part of the pairs list per block of rows) and keeps it in the spare high bits of
  the pair's list entry (RANK_AT..30); the launch's last kernel clears them, so the groups buffer is as it
  was once the launch is done. Prefill kernels mask the bits off wherever they read pairs; nothing else may
  read the pairs list while a prefill down launch is in flight.
"""

import functools
from typing import NamedTuple

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.lower.cuda import SIMULATOR, cuda, fill_zero, launch_kernel
from codegen.lower.matmul import (ALIGN, BIDX, BK, BN, IDX, PAD, ROW_VALUES, THREADS, W_TILE, DecodeShape,
                                  check, check_aligned, decode_core, prefill_core, silu, window_rows, words)
from codegen.lower.word_formats import FORMATS

GROUP_THREADS = 1024    # at most, for make_moe_groups: a block's threads, each a run of consecutive pairs
PREFILL_BM = 64         # pair rows of a prefill expert tile (an expert gets rows * k / n_expert on average)
X_TILE = (2, BK, PREFILL_BM + PAD)


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
    row_words = n_in // fmt.vpw
    host = (n_rows * row_words, n_rows * row_words // fmt.wps if fmt.wps else 0)
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

    @cuda.jit
    def kernel(ids, groups, levels):
        counts = cuda.shared.array(GROUP_THREADS, np.int32)     # every expert's pairs, then their running sum
        runs = cuda.shared.array(GROUP_THREADS, np.int32)       # the thread's matches, then their running sum
        flags = cuda.shared.array(GROUP_THREADS, np.int32)
        t = cuda.threadIdx.x & IDX
        e = cuda.blockIdx.x & BIDX
        threads = 1 << levels
        n_pairs = ids.shape[0] * k
        active = n_expert + 1 + n_pairs
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
            if t < n_expert:
                groups[t] = counts[t] - total
            if t == 0:
                groups[n_expert] = n_pairs
            flags[t] = 1 if t < n_expert and total > 0 else 0
            _scan(flags, t, levels)
            if t < n_expert and total > 0:
                groups[active + flags[t]] = t
            if t == 0:
                groups[active] = flags[threads - 1]

    def launch(stream, ids, groups):
        # a thread a pair up to GROUP_THREADS; the simulator, which runs each thread in Python, takes the
        # fewest its scans allow (the buffer is the same for any count)
        threads = 32
        while threads < max(n_expert, 0 if SIMULATOR else min(ids.shape[0] * k, GROUP_THREADS)):
            threads *= 2
        launch_kernel(kernel, n_expert, threads, stream, ids, groups, threads.bit_length() - 1)
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
    dot, reduce = decode_core(ggml_type, n_in, nr, nr, tg, shape.unroll, window)
    red_shape, acc_shape = (groups, 2 * nr * window, tg), (2 * nr, window)

    @cuda.jit
    def kernel(x, grouped, slot_of, ga, gs, ua, us, hga, hgs, hua, hus, act):
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
        dot(wa, sa, wb, sb, n0, n0, n_ff - 1, n_ff - 1, x, xrow, nx, lane, acc)
        reduce(red, g, lane, acc, nx)
        for j in range(lane, nr * window, tg):
            i, r = j // window, j % window
            if r < nx and n0 + i < n_ff:
                act[pair[r], n0 + i] = silu(red[g, j, 0]) * red[g, (nr + i) * window + r, 0]

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
    terms in ascending expert id order."""
    tg, groups, nr, window = shape.tg, shape.groups, shape.nr, shape.window
    dot, reduce = decode_core(ggml_type, n_ff, nr, 0, tg, shape.unroll, window)
    red_shape, dots_shape, acc_shape = (groups, nr * window, tg), (window * k, nr), (nr, window)
    n_pairs = window * k

    @cuda.jit
    def kernel(act, grouped, route_w, slot_of, dw, ds, hdw, hds, out):
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
            dot(wa, sa, wa, sa, n0, 0, n_out - 1, 0, act, xrow, nx, lane, acc)
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
            if n0 + i < n_out:
                j = order[r * k]
                total = route_w[r, j] * dots[r * k + j, i]
                for m in range(1, k):
                    j = order[r * k + m]
                    total += route_w[r, j] * dots[r * k + j, i]
                out[r, n0 + i] = total

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


RANK_AT = 26               # during a down launch, bits 26..30 of a pair's list entry hold its rank
PAIR_MASK = (1 << RANK_AT) - 1
MAX_RANKED_K = 1 << (31 - RANK_AT)
RANK_PAIRS = 8192          # pairs of the rows a rank block owns: their experts sit in shared memory (int16)


@functools.cache
def rank_kernels(n_expert: int, k: int):
    """(rank, unrank, rows per rank block): rank[ceil(rows / that), THREADS](groups, n_pairs, lo, hi) sets
    bits RANK_AT.. of the list entry of each pair of an expert lo <= e < hi to the pair's rank among its row's
    experts in that range (ascending ids; a repeated expert, which top-k never gives, ranks by slot);
    unrank[ceil(n_pairs / 64), 64](groups, n_pairs) clears them. A rank block owns RANK_PAIRS // k rows: one
    scan of the range's part of the list finds the expert of each of their pairs in it (a binary search of
    the offsets), a second writes the ranks. Only the range's part is read: a narrow range (a prefill ring's
    batch) ranks in a few us, where a scan of the whole list took ~0.15 ms a launch (BENCHMARKS.md)."""
    if not 0 < k <= MAX_RANKED_K:
        raise ValueError(f"top {k} experts: the prefill down projection ranks at most {MAX_RANKED_K} per row")
    window = RANK_PAIRS // k
    pairs_at = n_offsets = n_expert + 1

    @cuda.jit
    def rank(grouped, n_pairs, lo, hi):
        expert_of = cuda.shared.array(RANK_PAIRS, np.int16)      # -1: the pair's expert is outside the range
        offsets = cuda.shared.array(n_offsets, np.int32)
        t = cuda.threadIdx.x & IDX
        p0 = (cuda.blockIdx.x & BIDX) * window * k
        p1 = min(n_pairs, p0 + window * k)
        for e in range(t, n_offsets, THREADS):
            offsets[e] = grouped[e]
        for i in range(t, window * k, THREADS):
            expert_of[i] = -1
        cuda.syncthreads()
        start, end = offsets[lo], offsets[hi]
        for pos in range(start + t, end, THREADS):
            p = grouped[pairs_at + pos] & PAIR_MASK
            if p0 <= p < p1:
                below, above = lo, hi - 1    # the last expert whose pairs start at or before pos
                while below < above:
                    mid = (below + above + 1) >> 1
                    if offsets[mid] <= pos:
                        below = mid
                    else:
                        above = mid - 1
                expert_of[p - p0] = below
        cuda.syncthreads()
        for pos in range(start + t, end, THREADS):
            p = grouped[pairs_at + pos] & PAIR_MASK
            if p0 <= p < p1:
                i = p - p0
                j = i % k
                mine = expert_of[i]
                r = 0
                for m in range(k):
                    other = expert_of[i - j + m]
                    if other >= 0 and (other < mine or (other == mine and m < j)):
                        r += 1
                grouped[pairs_at + pos] = p | (r << RANK_AT)

    @cuda.jit
    def unrank(grouped, n_pairs):
        pos = (cuda.blockIdx.x & BIDX) * 64 + (cuda.threadIdx.x & IDX)
        if pos < n_pairs:
            grouped[pairs_at + pos] = grouped[pairs_at + pos] & PAIR_MASK

    return rank, unrank, window


@functools.cache
def prefill_kernel(ggml_type, n_in: int, n_cols: int, n_expert: int, k: int, down: bool, strides: ExpertStrides):
    """kernel[(col tiles, tiles), THREADS](x, groups, route_w, slot_of, wa, sa, wb, sb, hwa, hsa, hwb, hsb,
    out, rank, lo, hi): one tile of one expert e (lo <= e < hi) of its pairs; e's rows from the slot arrays
    (w*, s*) at slot_of[e], or the host arrays (hw*, hs*) at e when slot_of[e] < 0. Pairs are read masked
    (PAIR_MASK): their entries may carry ranks.
    gate/up (down False; rank -1, route_w unused): the expert's pairs in list order, x rows pair // k, tile
      rows 0..63 gate and 64..127 up for the same 64 columns; out (act) row pair = silu(gate) * up.
    down (rank q; the entries carry ranks, `rank_kernels`): the expert's pairs of rank q, numbered in list
      order, x (act) rows pair; out row pair // k += route_w * dot."""
    bm = PREFILL_BM
    tile = prefill_core(ggml_type, n_in, bm)
    tm = bm // 16
    cols = BN if down else BN // 2
    pairs_at = n_expert + 1                        # the pairs list's start in the groups buffer

    @cuda.jit
    def kernel(x, grouped, route_w, slot_of, wa, sa, wb, sb, hwa, hsa, hwb, hsb, out, rank, lo, hi):
        xs = cuda.shared.array(X_TILE, np.float32, alignment=ALIGN)
        ws = cuda.shared.array(W_TILE, np.float32, alignment=ALIGN)
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
        if down:
            # the pairs of rank `rank`, numbered in list order: number m goes to tile m // bm, row m % bm
            per_thread = -(-count // THREADS)
            levels = _levels(-(-count // per_thread))
            q0, q1 = t * per_thread, min(count, (t + 1) * per_thread)
            mine = 0
            for q in range(q0, q1):
                if grouped[pairs_at + first + q] >> RANK_AT == rank:
                    mine += 1
            if t < bm:
                pairs[t] = -1
            scan[t] = mine
            _scan(scan, t, levels)
            if tile_no * bm >= scan[(1 << levels) - 1]:
                return
            number = scan[t] - mine
            for q in range(q0, q1):
                entry = grouped[pairs_at + first + q]
                if entry >> RANK_AT == rank:
                    if tile_no * bm <= number < (tile_no + 1) * bm:
                        pairs[number - tile_no * bm] = entry & PAIR_MASK
                    number += 1
        elif t < bm:
            q = tile_no * bm + t
            pairs[t] = grouped[pairs_at + first + q] & PAIR_MASK if q < count else -1
        cuda.syncthreads()
        if t < bm:
            xrows[t] = -1 if pairs[t] < 0 else (pairs[t] & PAIR_MASK if down else pairs[t] // k)
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
                weight = route_w[p // k, p % k] if down else np.float32(0)
                for j in range(8 if down else 4):
                    n = n0 + (j // 4) * (BN // 2) + tx * 4 + j % 4
                    if n < n_cols:
                        if not down:
                            out[p, n] = silu(acc[i, j]) * acc[i, j + 4]
                        else:
                            out[p // k, n] = out[p // k, n] + weight * acc[i, j]

    return kernel, -(-n_cols // cols)


class RangeWork(NamedTuple):
    """What a prefill launch over one expert range has to do, from the routing: the tiles its experts' pairs
    make (the grid's rows) and the most experts one row has in the range (the down launch's passes)."""
    tiles: int
    passes: int


def range_work(ids: np.ndarray, n_expert: int, edges) -> list:
    """RangeWork of each expert range [edges[i], edges[i + 1]) for a chunk routed to ids (rows, k): what the
    kernels would find in the groups buffer, counted on the host."""
    ids = np.asarray(ids).reshape(len(ids), -1)
    edges = np.asarray(edges, np.int64)
    tiles_of = -(-np.bincount(ids.reshape(-1), minlength=n_expert) // PREFILL_BM)
    cumulative = np.concatenate([[0], np.cumsum(tiles_of)])
    n_ranges = len(edges) - 1
    range_of = np.searchsorted(edges, ids, side="right") - 1
    cells = np.arange(len(ids))[:, None] * n_ranges + range_of
    in_row = np.bincount(cells.reshape(-1), minlength=len(ids) * n_ranges).reshape(len(ids), n_ranges)
    passes = in_row.max(axis=0) if len(ids) else np.zeros(n_ranges, np.int64)
    return [RangeWork(int(cumulative[b] - cumulative[a]), int(q)) for a, b, q in zip(edges, edges[1:], passes)]


def _max_tiles(rows: int, k: int, n_range: int) -> int:
    """Tiles the pairs of n_range experts can make at most: the sum over them of ceil(pairs / PREFILL_BM) is
    at most floor(P / PREFILL_BM) + the experts with pairs, where rows give P <= rows * min(k, n_range) such
    pairs (top-k's experts are distinct)."""
    n_pairs = rows * min(k, n_range)
    return n_pairs // PREFILL_BM + min(n_range, n_pairs)


def _range(family: str, n_expert: int, lo, hi, work=None) -> tuple:
    """(lo, hi) checked: prefill takes any 0 <= lo <= hi <= n_expert; decode runs over every expert, its grid
    from no routing (a captured graph replays it for any)."""
    hi = n_expert if hi is None else hi
    if family == "decode":
        if work is not None:
            raise ValueError("a decode-family launch takes no RangeWork: its grid covers any routing")
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
    """launch(stream, x, groups, slot_of, gate, up, host_gate, host_up, act, lo=0, hi=None, work=None):
    act[r * k + j] = silu(G @ x[r]) * (U @ x[r]) for the pairs whose expert e = ids[r, j] has lo <= e < hi
    (hi None: n_expert; decode: every expert, no range), other act rows untouched; G, U = gate[slot_of[e]],
    up[slot_of[e]] (gate/up: slots of n_ff x n_in, contiguous or `slot_bytes` apart), or host_gate[e],
    host_up[e] (host_* (n_expert, n_ff, n_in), contiguous) when slot_of[e] < 0. work (prefill only): the
    range's `RangeWork`, else the grid covers any routing."""
    check(family, ggml_type, n_in, n_ff)
    strides = expert_strides(ggml_type, n_ff, n_in, slot_bytes)
    if family == "decode":
        def launch(stream, x, grouped, slot_of, gate, up, host_gate, host_up, act, lo=0, hi=None, work=None):
            _range(family, n_expert, lo, hi, work)
            check_aligned("a routed gate/up's activations", x)
            shape = decode_swiglu_shape(window_rows(x))
            decode_swiglu(T(ggml_type), n_in, n_ff, n_expert, k, shape, strides)(
                stream, x, grouped, slot_of, *words(gate), *words(up), *words(host_gate), *words(host_up),
                act)
        return launch
    kernel, col_tiles = prefill_kernel(T(ggml_type), n_in, n_ff, n_expert, k, False, strides)

    def launch(stream, x, grouped, slot_of, gate, up, host_gate, host_up, act, lo=0, hi=None, work=None):
        lo, hi = _range(family, n_expert, lo, hi)
        tiles = _max_tiles(x.shape[0], k, hi - lo) if work is None else work.tiles
        if tiles:
            launch_kernel(kernel, (col_tiles, tiles), THREADS, stream,
                x, grouped, x, slot_of, *words(gate), *words(up), *words(host_gate), *words(host_up), act,
                -1, lo, hi)     # x: no route_w
    return launch


@functools.cache
def make_moe_down_matmul(family: str, ggml_type, n_ff: int, n_out: int, n_expert: int, k: int, slot_bytes: int = 0):
    """launch(stream, act, groups, route_w, slot_of, down, host_down, out, lo=0, hi=None, work=None): out[r] =
    the sum over the row's experts e = ids[r, j], in ascending id order, of route_w[r, j] * (D @ act[r * k + j]), with
    D = down[slot_of[e]] (down: slots of n_out x n_ff, contiguous or `slot_bytes` apart), or host_down[e]
    ((n_expert, n_out, n_ff)) when slot_of[e] < 0. prefill: only the terms of experts lo <= e < hi (hi None:
    n_expert); every term adds to out[r], which a launch from lo = 0 zeroes first, so launches over [0, a),
    [a, b), ..., [z, n_expert) in that order give bitwise the out of one launch over every expert (with or without their
    `RangeWork`: the passes it skips have no pairs). decode: every expert, no range, no work."""
    check(family, ggml_type, n_ff, n_out)
    strides = expert_strides(ggml_type, n_out, n_ff, slot_bytes)
    if family == "decode":
        def launch(stream, act, grouped, route_w, slot_of, down, host_down, out, lo=0, hi=None, work=None):
            _range(family, n_expert, lo, hi, work)
            check_aligned("a routed down projection's activations", act)
            shape = decode_down_shape(window_rows(route_w))
            decode_down(T(ggml_type), n_ff, n_out, n_expert, k, shape, strides)(
                stream, act, grouped, route_w, slot_of, *words(down), *words(host_down), out)
        return launch
    kernel, col_tiles = prefill_kernel(T(ggml_type), n_ff, n_out, n_expert, k, True, strides)
    rank_pairs, unrank_pairs, rank_rows = rank_kernels(n_expert, k)

    def launch(stream, act, grouped, route_w, slot_of, down, host_down, out, lo=0, hi=None, work=None):
        lo, hi = _range(family, n_expert, lo, hi)
        rows = route_w.shape[0]
        if work is None:
            work = RangeWork(_max_tiles(rows, k, hi - lo), min(k, hi - lo))
        tiles, n_pairs = work.tiles, rows * k
        if n_pairs > PAIR_MASK:
            raise ValueError(f"{rows} rows x top {k}: the prefill down projection takes at most {PAIR_MASK} pairs")
        if lo == 0:     # the ranges' terms add from zero
            fill_zero(out, stream)
        if not tiles:
            return
        dw, ds = words(down)
        hw, hs = words(host_down)
        launch_kernel(rank_pairs, -(-rows // rank_rows), THREADS, stream, grouped, n_pairs, lo, hi)
        for q in range(work.passes):    # pass q: each row's q-th smallest expert in the range, ascending
            launch_kernel(kernel, (col_tiles, tiles), THREADS, stream, act, grouped, route_w, slot_of, dw, ds, dw,
                          ds, hw, hs, hw, hs, out, q, lo, hi)
        launch_kernel(unrank_pairs, -(-n_pairs // 64), 64, stream, grouped, n_pairs)
    return launch
