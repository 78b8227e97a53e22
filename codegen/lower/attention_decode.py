"""Decode attention: a decode step's or verify window's rows against the paged K/V, as split partials.

A block per (kv head, split s) of DECODE_WARPS warps (fewer for groups whose merge would not fit: `block_warps`);
the context is cut into tiles of 32 positions (one a
lane), and split s takes tiles s, s + 64, s + 128, ... (ATTENTION_SPLITS = 64), which its warps share out in
turn: warp w the split's tiles w, w + DECODE_WARPS, ... . Rows are taken one after another, each on its own
(a row's bits never depend on the window's other rows). For each row and tile, a warp

  scores   lane l dots its position's K row (read straight from the page, 16 bytes a load, through the page
           table: a VRAM slot, or the host copy when the table says -1) with every query head of the group,
           kept transposed in shared memory, in dim order; positions outside the row's reach score -inf;
  softmax  the tile's max per head across the lanes (`warp_max`, exact in any order), the running max, and
           each lane's own running sum of exp;
  P V      lane l sums its dims of V (word l, l + 32, ... of each row: a warp reads a row in whole 128-byte
           runs) over the tile's 32 positions in order, with the probabilities from shared memory, into its
           running sums, rescaled by exp(m_old - m_new).

What a lane keeps in flight (its K row's chunks, the V rows ahead) is `codegen.cost.decode_attention_in_flight`:
a tile is a chain of load rounds, each waiting the memory's latency, and at short contexts a warp's one tile is
the whole launch, so float K/V keep 8 chunks and 16 rows (2 + 2 rounds at head dim 128), quantized 4 and 8.

At the row's end each warp adds its lanes' sums of exp (`warp_sum`, a fixed butterfly), and the warps' sums
are merged in warp order into
partials f32 (rows, n_head, ATTENTION_SPLITS, dv + 2) = (max, sum of exp, weighted V sum); a split that
reached no tile writes (-inf, 0, 0). `codegen.lower.attention_combine` merges the splits. Every position a
lane reads is clamped into the row's reach, so no load leaves the pages the row may read (a drafter's ring
holds only its window) and nothing unwritten is multiplied in (its probability is 0, its value finite).

Why this shape: the previous decode kernel (`codegen.lower.attention`, which serves prefill; its decode mode
is the benchmark's v3/v4) staged each tile in shared memory behind five block barriers a tile, at 15% of read
bandwidth over 32K positions; here a warp works alone between shuffle reductions and two warp barriers a tile,
with its next K chunks and V rows in flight while it computes (BENCHMARKS.md: v5). Staging the K tile in shared
memory through `cp.async` (coalesced loads, no registers) was tried and measured slower (64 against 54 us at
32K, f16), as were 2, 6 and 8 warps a block.
"""

import functools
import math

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.cost import decode_attention_in_flight
from codegen.graph import ATTENTION_SPLITS
from codegen.lower import MAX_WINDOW
from codegen.lower.cuda import (SHARED_BYTES, SIMULATOR, U, WARP_MAX_VALUES, begin_after_prior_grids, cuda,
                                f16x2_to_f32, launch_kernel, load4, overlapping, syncwarp, warp_max, warp_sum)
from codegen.lower.kv_pages import QUANT_BLOCK, QUANTIZED, aligned_kernel_arrays, kv_types, page_locator
from codegen.lower.word_formats import FORMATS
from planner.errors import StratumError

# warps a block; the simulator, which runs every thread as a Python thread, takes one (the merge over warps is
# then trivial there; on a GPU it is the same code with more warps)
DECODE_WARPS = 1 if SIMULATOR else 4
LANES = 32                  # = positions a tile
CHUNK_WORDS = 4             # a lane's load of a K row: 16 bytes (`load4`)
MAX_V_WORDS = 4             # words of a V row a lane sums at most (f16: head dim 256)

NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0)


@cuda.jit(device=True, inline=True)
def _f16_words(word, vals, i, base):
    vals[i, base], vals[i, base + 1] = f16x2_to_f32(word)


def _word_format(ggml_type: T):
    """(values a word, decode(word, vals, i, base), elem(word index, e, vpw) -> dim): f16 by hardware
    conversion, the others as the matmul kernels unpack them."""
    fmt = FORMATS[ggml_type]
    return fmt.vpw, (_f16_words if ggml_type == T.F16 else fmt.decode), fmt.elem


def _scratch_floats(group: int, dv: int, warps: int) -> int:
    """Each warp's probabilities of a tile, then each warp's V sums."""
    return max(warps * LANES * group, warps * group * dv)


def shared_floats(group: int, dk: int, dv: int, warps: int) -> int:
    """A block's shared memory in floats: q (transposed), each warp's max, sum of exp and weight, the scratch."""
    return group * dk + 3 * warps * group + _scratch_floats(group, dv, warps)


def block_warps(group: int, dk: int, dv: int, preferred: int = DECODE_WARPS) -> int:
    """Warps a block gets for this shape: `preferred`, or fewer where their merge would overflow the block's
    shared memory (a large group of query heads per kv head); 0 where not even one warp fits."""
    return max([w for w in range(1, preferred + 1) if 4 * shared_floats(group, dk, dv, w) <= SHARED_BYTES],
               default=0)


@functools.cache
def decode_attention_kernel(k_type: T, v_type: T, group: int, dk: int, dv: int, page_tokens: int,
                            window: int, warps: int):
    """The kernel (module doc) and its threads a block; window > 0: a row at position p reads positions
    p - window + 1 .. p only. Results depend on `warps` (the order the warps' sums are merged in)."""
    G, NW, PT, splits = group, warps, page_tokens, ATTENTION_SPLITS
    k_vpw, k_decode, k_elem = _word_format(k_type)
    v_vpw, v_decode, v_elem = _word_format(v_type)
    k_words, v_words = dk // k_vpw, dv // v_vpw               # words a head's row
    v_per_lane = -(-v_words // LANES)                          # V words a lane sums (lanes past the row idle)
    if group > WARP_MAX_VALUES or v_per_lane > MAX_V_WORDS:
        raise StratumError(f"decode attention takes at most {WARP_MAX_VALUES} query heads per kv head and "
                           f"{MAX_V_WORDS * LANES} words a V row (got {group} heads, head dim {dv} in {v_type.name})")
    if 4 * shared_floats(group, dk, dv, warps) > SHARED_BYTES:
        raise StratumError(f"decode attention with {group} query heads per kv head and head dims {dk}/{dv} needs "
                           f"{4 * shared_floats(group, dk, dv, warps)} bytes of shared memory per block "
                           f"(at most {SHARED_BYTES})")
    threads = NW * LANES
    scale = np.float32(1.0 / math.sqrt(dk))
    k_chunks = k_words // CHUNK_WORDS
    k_ahead, v_ahead = decode_attention_in_flight(k_type, v_type, dk)     # (the kernel names up to 8 and 16)
    v_full = v_words % LANES == 0
    k_quantized, v_quantized = k_type in QUANTIZED, v_type in QUANTIZED
    k_words_per_block, v_words_per_block = QUANT_BLOCK // k_vpw, QUANT_BLOCK // v_vpw
    k_blocks, v_blocks = dk // QUANT_BLOCK, dv // QUANT_BLOCK  # scales a head's row
    tile_in_page = PT % LANES == 0                             # a tile's positions share one page
    acc_size = G * v_per_lane * v_vpw
    Q_FLOATS, STATE_FLOATS = G * dk, NW * G                    # shared array sizes (numba takes constants)
    SCRATCH_FLOATS = _scratch_floats(group, dv, warps)
    k_whole = k_chunks % k_ahead == 0
    one = np.float32(1)

    locate = page_locator(PT)

    @cuda.jit(device=True, inline=True)
    def fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, c):
        """Words 4c..4c + 3 of a K row (c clamped to the row) and their block's scale (1 for float types)."""
        c = min(c, k_chunks - 1)
        data = hk_data if host else k_data
        words = load4(data, (U(where), U(k_row + c * CHUNK_WORDS)))
        if k_quantized:
            scales = hk_scales if host else k_scales
            return words, np.float32(scales[U(where), U(k_scale_row + (c * CHUNK_WORDS) // k_words_per_block)])
        return words, one

    @cuda.jit(device=True, inline=True)
    def v_word(data, scales, where, v_row, v_scale_row, i, lane):
        """(word, its block's scale) of the lane's i-th V word; (0, 1) past the row or past v_per_lane."""
        w = lane + LANES * i
        if i < v_per_lane and (v_full or w < v_words):
            if v_quantized:
                return data[U(where), U(v_row + w)], np.float32(scales[U(where), U(v_scale_row + w // v_words_per_block)])
            return data[U(where), U(v_row + w)], one
        return np.int32(0), one

    @cuda.jit(device=True, inline=True)
    def fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host, tile_offset, t0, k_lo,
                k_hi, kv_head, k, lane):
        """The lane's words of the V row of the tile's k-th position (clamped into k_lo..k_hi, the row's
        reach) and their scales."""
        k = min(max(k, k_lo), k_hi)
        if tile_in_page:
            where, host, offset = tile_where, tile_host, tile_offset + k
        else:
            where, host, offset = locate(page_table, t0 + k)
        data = hv_data if host else v_data
        scales = hv_scales if host else v_scales
        v_row = (kv_head * PT + offset) * v_words
        v_scale_row = (kv_head * PT + offset) * v_blocks
        a, sa = v_word(data, scales, where, v_row, v_scale_row, 0, lane)
        b, sb = v_word(data, scales, where, v_row, v_scale_row, 1, lane)
        c, sc = v_word(data, scales, where, v_row, v_scale_row, 2, lane)
        d, sd = v_word(data, scales, where, v_row, v_scale_row, 3, lane)
        return (a, b, c, d), (sa, sb, sc, sd)

    @cuda.jit(device=True, inline=True)
    def apply_k(chunk, c, q_t, k_vals, dots):
        if k_whole or c < k_chunks:
            words, block_scale = chunk
            apply_chunk(words, block_scale, c, q_t, k_vals, dots)

    @cuda.jit(device=True, inline=True)
    def apply_chunk(words, block_scale, c, q_t, k_vals, dots):
        for i in range(CHUNK_WORDS):
            k_decode(words[i], k_vals, i, 0)
        for i in range(CHUNK_WORDS):
            for e in range(k_vpw):
                d = k_elem(c * CHUNK_WORDS + i, e, k_vpw)
                value = k_vals[i, e] * block_scale if k_quantized else k_vals[i, e]
                for h in range(G):
                    dots[h] += q_t[U(d * G + h)] * value

    @cuda.jit(device=True, inline=True)
    def apply_v(fetched, probs, at, v_vals, acc):
        words, block_scales = fetched
        for i in range(v_per_lane):
            v_decode(words[i], v_vals, i, 0)
            if v_quantized:
                for e in range(v_vpw):
                    v_vals[i, e] *= block_scales[i]
        for h in range(G):
            p = probs[U(at + h)]
            for i in range(v_per_lane):
                for e in range(v_vpw):
                    acc[(h * v_per_lane + i) * v_vpw + e] += p * v_vals[i, e]

    @overlapping
    @cuda.jit
    def kernel(q, positions, page_table, k_data, k_scales, v_data, v_scales, hk_data, hk_scales, hv_data,
               hv_scales, out):
        begin_after_prior_grids()
        tid = cuda.threadIdx.x
        lane = tid % LANES
        warp = tid // LANES
        kv_head = cuda.blockIdx.x // splits
        split = cuda.blockIdx.x % splits
        probs = warp * LANES * G            # the warp's probabilities in scratch during the tiles
        q_t = cuda.shared.array(Q_FLOATS, np.float32)              # q_t[d * G + h]
        warp_maxima = cuda.shared.array(STATE_FLOATS, np.float32)  # [warp][head]
        warp_sums = cuda.shared.array(STATE_FLOATS, np.float32)    # [warp][head]: sums of exp
        weights = cuda.shared.array(STATE_FLOATS, np.float32)      # [warp][head]: exp(m_warp - m_block)
        # each warp's probabilities [warp][position][head] during the tiles, then its V sums [warp][head][dim]
        scratch = cuda.shared.array(SCRATCH_FLOATS, np.float32)
        running_max = cuda.local.array(G, np.float32)
        lane_sum = cuda.local.array(G, np.float32)
        scores = cuda.local.array(G, np.float32)
        tile_max = cuda.local.array(G, np.float32)
        dots = cuda.local.array(G, np.float32)
        acc = cuda.local.array(acc_size, np.float32)
        k_vals = cuda.local.array((CHUNK_WORDS, k_vpw), np.float32)
        v_vals = cuda.local.array((MAX_V_WORDS, v_vpw), np.float32)
        nothing = np.int32(0)       # the V rows in flight and their tile's page, before a warp's first active tile
        v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = ((nothing, nothing, nothing, nothing), (one, one, one, one))
        v8 = v9 = v10 = v11 = v12 = v13 = v14 = v15 = v0
        tile_where, tile_host, tile_offset = 0, False, 0

        for row in range(q.shape[0]):
            pos = positions[row]
            lo = max(pos - window + 1, 0) if window else 0
            # the split's tiles j = first..last that meet the row's reach lo..pos
            first = max(0, -(-(lo // LANES - split) // splits))
            last = (pos // LANES - split) // splits if pos >= 0 and pos // LANES >= split else -1
            if last < first:        # (the same for the whole block) no tile: the neutral partial
                for e in range(tid, G * (dv + 2), threads):
                    out[U(row), U(kv_head * G + e // (dv + 2)), U(split), U(e % (dv + 2))] = \
                        NEG_INF if e % (dv + 2) == 0 else _ZERO
                continue
            for e in range(tid, G * dk, threads):
                h = e // dk
                q_t[e % dk * G + h] = q[U(row), U((kv_head * G + h) * dk + e % dk)]
            for h in range(G):
                running_max[h] = NEG_INF
                lane_sum[h] = _ZERO
            for e in range(acc_size):
                acc[e] = _ZERO
            cuda.syncthreads()
            for it in range(-(-(last - first + 1) // NW)):
                j = first + warp + NW * it
                active = j <= last
                t0 = (split + j * splits) * LANES
                k_lo = max(lo - t0, 0)              # the row's reach within the tile
                k_hi = min(pos - t0, LANES - 1)
                for h in range(G):
                    scores[h] = NEG_INF
                if active:
                    # scores: the lane's K row, k_ahead chunks in flight
                    where, host, offset = locate(page_table, t0 + min(max(lane, k_lo), k_hi))
                    k_row = (kv_head * PT + offset) * k_words
                    k_scale_row = (kv_head * PT + offset) * k_blocks
                    for h in range(G):
                        dots[h] = _ZERO
                    c0 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, 0)
                    c1 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, 1)
                    c2 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, 2)
                    c3 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, 3)
                    c4 = c5 = c6 = c7 = c3      # (typed for numba; loaded only when 8 are in flight)
                    if k_ahead == 8:
                        c4 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, 4)
                        c5 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, 5)
                        c6 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, 6)
                        c7 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, 7)
                    for c in range(0, k_chunks, k_ahead):
                        n = c + k_ahead     # the chunk each one's next load takes: its own, k_ahead on
                        apply_k(c0, c, q_t, k_vals, dots)
                        c0 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, n)
                        apply_k(c1, c + 1, q_t, k_vals, dots)
                        c1 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, n + 1)
                        apply_k(c2, c + 2, q_t, k_vals, dots)
                        c2 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, n + 2)
                        apply_k(c3, c + 3, q_t, k_vals, dots)
                        c3 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, n + 3)
                        if k_ahead == 8:
                            apply_k(c4, c + 4, q_t, k_vals, dots)
                            c4 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, n + 4)
                            apply_k(c5, c + 5, q_t, k_vals, dots)
                            c5 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, n + 5)
                            apply_k(c6, c + 6, q_t, k_vals, dots)
                            c6 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, n + 6)
                            apply_k(c7, c + 7, q_t, k_vals, dots)
                            c7 = fetch_k(k_data, k_scales, hk_data, hk_scales, where, host, k_row, k_scale_row, n + 7)
                    if lane >= k_lo and lane <= k_hi:
                        for h in range(G):
                            scores[h] = dots[h] * scale
                    # the tile's first V rows go out now: they do not wait on the scores, so their loads
                    # fly while the softmax runs
                    tile_where, tile_host, tile_offset = locate(page_table, t0 + k_lo)
                    tile_offset -= k_lo
                    v0 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                 tile_offset, t0, k_lo, k_hi, kv_head, 0, lane)
                    v1 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                 tile_offset, t0, k_lo, k_hi, kv_head, 1, lane)
                    v2 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                 tile_offset, t0, k_lo, k_hi, kv_head, 2, lane)
                    v3 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                 tile_offset, t0, k_lo, k_hi, kv_head, 3, lane)
                    v4 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                 tile_offset, t0, k_lo, k_hi, kv_head, 4, lane)
                    v5 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                 tile_offset, t0, k_lo, k_hi, kv_head, 5, lane)
                    v6 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                 tile_offset, t0, k_lo, k_hi, kv_head, 6, lane)
                    v7 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                 tile_offset, t0, k_lo, k_hi, kv_head, 7, lane)
                    if v_ahead == 16:
                        v8 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                      tile_offset, t0, k_lo, k_hi, kv_head, 8, lane)
                        v9 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                      tile_offset, t0, k_lo, k_hi, kv_head, 9, lane)
                        v10 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                      tile_offset, t0, k_lo, k_hi, kv_head, 10, lane)
                        v11 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                      tile_offset, t0, k_lo, k_hi, kv_head, 11, lane)
                        v12 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                      tile_offset, t0, k_lo, k_hi, kv_head, 12, lane)
                        v13 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                      tile_offset, t0, k_lo, k_hi, kv_head, 13, lane)
                        v14 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                      tile_offset, t0, k_lo, k_hi, kv_head, 14, lane)
                        v15 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                      tile_offset, t0, k_lo, k_hi, kv_head, 15, lane)
                for h in range(G):
                    tile_max[h] = scores[h]
                warp_max(tile_max, G)
                if active:
                    for h in range(G):
                        m_new = max(running_max[h], tile_max[h])
                        alpha = math.exp(running_max[h] - m_new)
                        p = math.exp(scores[h] - m_new)
                        lane_sum[h] = lane_sum[h] * alpha + p
                        running_max[h] = m_new
                        scratch[U(probs + lane * G + h)] = p
                        for e in range(v_per_lane * v_vpw):
                            acc[h * v_per_lane * v_vpw + e] *= alpha
                syncwarp()
                if active:
                    # P V: the tile's positions in order, v_ahead positions' words in flight (the first
                    # ones since before the softmax)
                    at = probs
                    for k in range(0, LANES, v_ahead):
                        n = k + v_ahead     # the position each one's next load takes: its own, v_ahead on
                        apply_v(v0, scratch, at + (k) * G, v_vals, acc)
                        v0 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                     tile_offset, t0, k_lo, k_hi, kv_head, n, lane)
                        apply_v(v1, scratch, at + (k + 1) * G, v_vals, acc)
                        v1 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                     tile_offset, t0, k_lo, k_hi, kv_head, n + 1, lane)
                        apply_v(v2, scratch, at + (k + 2) * G, v_vals, acc)
                        v2 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                     tile_offset, t0, k_lo, k_hi, kv_head, n + 2, lane)
                        apply_v(v3, scratch, at + (k + 3) * G, v_vals, acc)
                        v3 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                     tile_offset, t0, k_lo, k_hi, kv_head, n + 3, lane)
                        apply_v(v4, scratch, at + (k + 4) * G, v_vals, acc)
                        v4 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                     tile_offset, t0, k_lo, k_hi, kv_head, n + 4, lane)
                        apply_v(v5, scratch, at + (k + 5) * G, v_vals, acc)
                        v5 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                     tile_offset, t0, k_lo, k_hi, kv_head, n + 5, lane)
                        apply_v(v6, scratch, at + (k + 6) * G, v_vals, acc)
                        v6 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                     tile_offset, t0, k_lo, k_hi, kv_head, n + 6, lane)
                        apply_v(v7, scratch, at + (k + 7) * G, v_vals, acc)
                        v7 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where, tile_host,
                                     tile_offset, t0, k_lo, k_hi, kv_head, n + 7, lane)
                        if v_ahead == 16:
                            apply_v(v8, scratch, at + (k + 8) * G, v_vals, acc)
                            v8 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where,
                                           tile_host, tile_offset, t0, k_lo, k_hi, kv_head, n + 8, lane)
                            apply_v(v9, scratch, at + (k + 9) * G, v_vals, acc)
                            v9 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where,
                                           tile_host, tile_offset, t0, k_lo, k_hi, kv_head, n + 9, lane)
                            apply_v(v10, scratch, at + (k + 10) * G, v_vals, acc)
                            v10 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where,
                                           tile_host, tile_offset, t0, k_lo, k_hi, kv_head, n + 10, lane)
                            apply_v(v11, scratch, at + (k + 11) * G, v_vals, acc)
                            v11 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where,
                                           tile_host, tile_offset, t0, k_lo, k_hi, kv_head, n + 11, lane)
                            apply_v(v12, scratch, at + (k + 12) * G, v_vals, acc)
                            v12 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where,
                                           tile_host, tile_offset, t0, k_lo, k_hi, kv_head, n + 12, lane)
                            apply_v(v13, scratch, at + (k + 13) * G, v_vals, acc)
                            v13 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where,
                                           tile_host, tile_offset, t0, k_lo, k_hi, kv_head, n + 13, lane)
                            apply_v(v14, scratch, at + (k + 14) * G, v_vals, acc)
                            v14 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where,
                                           tile_host, tile_offset, t0, k_lo, k_hi, kv_head, n + 14, lane)
                            apply_v(v15, scratch, at + (k + 15) * G, v_vals, acc)
                            v15 = fetch_v(page_table, v_data, v_scales, hv_data, hv_scales, tile_where,
                                           tile_host, tile_offset, t0, k_lo, k_hi, kv_head, n + 15, lane)
                syncwarp()
            # each warp's state (its lanes' sums of exp added in the butterfly's order), then merged in warp order
            warp_sum(lane_sum, G)
            cuda.syncthreads()
            for h in range(G):
                if lane == 0:
                    warp_maxima[warp * G + h] = running_max[h]
                    warp_sums[warp * G + h] = lane_sum[h]
                for i in range(v_per_lane):
                    w = lane + LANES * i
                    if v_full or w < v_words:
                        for e in range(v_vpw):
                            scratch[U((warp * G + h) * dv + v_elem(w, e, v_vpw))] = \
                                acc[(h * v_per_lane + i) * v_vpw + e]
            cuda.syncthreads()
            for e in range(tid, NW * G, threads):
                top = NEG_INF
                for w in range(NW):
                    top = max(top, warp_maxima[w * G + e % G])
                m = warp_maxima[e]
                weights[e] = _ZERO if m == NEG_INF else math.exp(m - top)
            cuda.syncthreads()
            for e in range(tid, G * (dv + 2), threads):
                h = e // (dv + 2)
                x = e % (dv + 2)
                total = _ZERO
                top = NEG_INF
                for w in range(NW):
                    top = max(top, warp_maxima[w * G + h])
                    weight = weights[w * G + h]
                    if weight != _ZERO and x > 0:
                        total += weight * (warp_sums[w * G + h] if x == 1 else scratch[U((w * G + h) * dv + x - 2)])
                out[U(row), U(kv_head * G + h), U(split), U(x)] = top if x == 0 else total
            cuda.syncthreads()

    return kernel, threads


@functools.cache
def make_decode_attention(kv_type_name, n_head: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                          page_tokens: int, window_tokens: int = 0, warps: int | None = None):
    """launch(stream, q, positions, page_table, pages, partials, host_pages=None): q f32 (rows, n_head*dk)
    with RoPE applied, 1..MAX_WINDOW rows at int32 `positions`, against positions 0..p already stored (a page
    from its slot, or from `host_pages`, the whole context in mapped host memory, where the table says -1);
    partials f32 (rows, n_head, ATTENTION_SPLITS, dv + 2). `codegen.lower.attention.make_attention` checks the
    arguments. `warps`: a block's (`block_warps` by default; others are for the benchmark's sweep)."""
    kv = kv_types(kv_type_name)
    if warps is None:
        warps = block_warps(n_head // n_head_kv, head_dim_k, head_dim_v) or 1   # (0: the kernel says why)
    kernel, threads = decode_attention_kernel(kv.k_type, kv.v_type, n_head // n_head_kv, head_dim_k, head_dim_v,
                                              page_tokens, window_tokens, warps)
    blocks = n_head_kv * ATTENTION_SPLITS

    def launch(stream, q, positions, page_table, pages, partials, host_pages=None):
        rows = q.shape[0]
        if rows > MAX_WINDOW:
            raise ValueError(f"a decode window holds at most {MAX_WINDOW} rows, got {rows}")
        if not rows:
            return
        arrays = aligned_kernel_arrays(pages, host_pages, "decode attention")
        launch_kernel(kernel, blocks, threads, stream, q, positions, page_table, *arrays, partials)
    return launch
