"""Paged attention over the K/V pages of `codegen.lower.kv_pages`: `make_attention`, the entry point of both
families (prefill chunks go to `codegen.lower.attention_prefill`, decode windows to
`codegen.lower.attention_decode`), and the previous kernel of both, which no longer serves the runtime: it is
the benchmark's prefill v1 and decode v3/v4, the numbered versions `benchmarks/kernels_attention.py` times
against the production kernels.

Attention (both modes) runs one block per (kv head, set of pages, set of rows); the block walks its pages
in tiles of `Tuning.tile` positions aligned to absolute positions, ascending. A tile's K and V are dequantized once
into shared memory (the next tile's raw words are already in flight, loaded into registers while this one is
computed; f16 and f32 through a typed view of the words, so the hardware converts each value in one
instruction) and serve every query head of the kv head's group and every row of the block:
  scores   each thread keeps 16 dims of 4 query heads in registers and dots them with its tokens' K;
           the 16-dim partial sums are added in dim order by one thread per (head, token);
  softmax  online over tiles: per head the tile's max, the running max, exp, and the tile's sum, each in a
           fixed order (segments of 8 tokens, then segments in order);
  P V      each thread sums 4 dims of 4 heads over every NS-th token of the tile; the NS partial sums are
           added in order and folded into the row's running sum (rescaled by exp(m_old - m_new)), which lives
           in the output itself (a decode partial, or a prefill output row, finished at the end).
A row's result depends only on its own position: prefill rows are bitwise the same whatever the chunk and
wherever it starts, decode rows the same whatever the window. Tokens past the block's last position (a page's
unwritten tail) are zeroed when staged and masked from the scores.

  prefill  out f32 (rows, n_head*dv): a block per (kv head, MAX_WINDOW rows), all pages up to its last row.
  decode   partials f32 (rows, n_head, ATTENTION_SPLITS, dv + 2) = (running max, sum of exp, weighted V sum):
           a block per (kv head, split s) over tiles s, s + 64, s + 128, ... and every row of the window, so
           the window reads each tile once and a short context still spreads over 64 blocks per kv head; a
           split with no tile writes (-inf, 0, 0).
  combine  out f32 (rows, n_head*dv): the splits of each (row, head) merged in order 0..63
           (`codegen.lower.attention_combine`).
"""

import functools
import math
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import ATTENTION_SPLITS
from codegen.lower import FAMILIES, MAX_WINDOW
from codegen.lower.attention_decode import make_decode_attention
from codegen.lower.attention_prefill import make_prefill_attention
from codegen.lower.cuda import SHARED_BYTES, U, cuda, launch_kernel
from codegen.lower.kv_pages import (ELEMENTS_PER_WORD, QUANT_BLOCK, QUANTIZED, check_head_dims,
                                     converted_element_format, element_format, host_arrays, kv_types)
from planner.errors import StratumError


SCORE_DIMS = 16           # dims of a query head a score thread holds in registers
SCORE_HEADS = 4           # query heads a score thread holds (fewer when the group is not a multiple of 4)
VALUE_DIMS = 4            # dims of the output a P V thread sums (more when the block is too small)
MAX_SUBSETS = 4           # token subsets the P V sums are split into (shared memory bounds it)
SEGMENT = 8               # tokens per softmax segment


@dataclass(frozen=True)
class Tuning:
    """How an attention block is cut (results depend on `tile`: rows are bitwise stable for one tuning)."""
    tile: int = 32          # positions per K/V tile (an online-softmax step), aligned to absolute positions
    threads: int = 128      # at most, per block (128: two blocks of 254 registers a thread fit an SM)
    hold_q: bool = True     # a lone row keeps its query slice in registers across tiles (else reloads it)
    shared_bytes: int = SHARED_BYTES    # static shared memory a block may use
    # types whose tiles are read as elements through a typed view of the words (float32, float16, int8) and
    # converted by hardware (one cvt each); the others as words unpacked in software (the same values)
    convert: frozenset = frozenset({T.F32, T.F16})


TUNING = Tuning()


NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0)


# ---------------------------------------------------------------------------------------------------------
# attention


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclass(frozen=True)
class _Shape:
    """The block's decomposition, from the constants alone (module doc)."""
    group: int          # query heads per kv head
    dk: int
    dv: int
    page_tokens: int
    tile: int           # positions per tile
    score_heads: int    # GT: query heads a score thread holds
    head_groups: int    # GG = group / GT
    dim_chunks: int     # KC = dk / SCORE_DIMS: partial sums per score
    lanes: int          # token lanes of the score phase
    threads: int        # = GG * KC * lanes
    value_dims: int     # DVT: dims a P V thread sums
    value_chunks: int   # DVC = dv / DVT (dims d = chunk + DVC * j, so neighbours read neighbours)
    value_roles: int    # PVR = (group / GT) * DVC
    subsets: int        # NS: token subsets of the P V sums
    segment: int        # tokens per softmax segment
    shared_limit: int   # bytes of shared memory a block may use

    @property
    def k_stride(self) -> int:     # a K row in shared memory, padded so token lanes hit distinct banks
        return self.dk + 1

    @property
    def score_partials(self) -> int:     # floats: a tile's 16-dim partial dot products
        return self.group * self.tile * self.dim_chunks

    @property
    def value_partials(self) -> int:     # floats: a tile's P V sums of subsets 1..NS-1
        return max(self.subsets - 1, 1) * self.group * self.dv

    def _shared_floats(self, scratch: int) -> int:
        return (self.tile * self.k_stride + self.tile * self.dv + scratch + self.group * self.tile
                + 2 * self.group * (self.tile // self.segment) + 2 * MAX_WINDOW * self.group + 2 * self.group)

    @property
    def separate(self) -> bool:
        """Whether both partials get their own shared memory (else they share it, and the next scores wait
        for the last fold)."""
        return 4 * self._shared_floats(self.score_partials + self.value_partials) <= self.shared_limit

    @property
    def scratch(self) -> int:
        both = self.score_partials + self.value_partials
        return both if self.separate else max(self.score_partials, self.value_partials)

    @property
    def shared_bytes(self) -> int:
        return 4 * self._shared_floats(self.scratch)


def _shape(group: int, dk: int, dv: int, page_tokens: int, tuning: Tuning) -> _Shape:
    tile, max_threads = tuning.tile, tuning.threads
    tile = math.gcd(page_tokens, tile)
    gt = _largest_divisor(group, SCORE_HEADS)
    kc = dk // SCORE_DIMS
    lanes = _largest_divisor(tile, max(1, max_threads // (group // gt * kc)))
    threads = group // gt * kc * lanes
    dvt = VALUE_DIMS
    while group // gt * dv // dvt > threads and dv % (2 * dvt) == 0:
        dvt *= 2
    roles = group // gt * dv // dvt
    subsets = 1
    while 2 * subsets <= MAX_SUBSETS and 2 * subsets * roles <= threads and tile % (2 * subsets) == 0:
        subsets *= 2
    segment = min(tile, SEGMENT)
    if roles > threads or group * (tile // segment) > threads:
        raise StratumError(f"attention blocks of {threads} threads cannot cover {group} query heads per kv head "
                           f"with head dims {dk}/{dv}")
    return _Shape(group, dk, dv, page_tokens, tile, gt, group // gt, kc, lanes, threads, dvt, dv // dvt, roles,
                  subsets, segment, tuning.shared_bytes)


_VIEWS = {T.F32: np.float32, T.F16: np.float16, T.Q8_0: np.int8}     # element views converted by hardware


def _converts(ggml_type: T, tuning: Tuning) -> bool:
    if not tuning.convert <= _VIEWS.keys():
        raise StratumError(f"hardware conversion covers {', '.join(t.name for t in _VIEWS)}, not "
                           f"{', '.join(t.name for t in tuning.convert - _VIEWS.keys())}")
    return ggml_type in tuning.convert


def _data_view(data, ggml_type: T, tuning: Tuning):
    """The data array as the kernel reads it: a typed view of the same bytes where hardware converts."""
    return data.view(_VIEWS[ggml_type]) if _converts(ggml_type, tuning) else data


def _tile_io(ggml_type: T, page_tokens: int, dim: int, s: _Shape, stride: int, convert: bool):
    """(load, store, words per thread, register dtype) for one tensor's tile: load(data, scales, slot, head,
    first, tid, raw, raw_scales) issues the loads of a tile's words into registers; store(raw, raw_scales, tid,
    keep, buf) writes them dequantized to buf[token * stride + dim] (zeros for tokens >= keep: never written).
    Thread tid holds words w0 + a * WT of tokens t0 + b * TT (w0, t0 = tid % WT, tid // WT), so its loads
    and stores are one base address plus constants. With `convert`, a word is one element of a typed view
    (float32, float16, int8), turned to float32 by one conversion instruction."""
    per_word = 1 if convert else ELEMENTS_PER_WORD[ggml_type]
    register = (np.int32 if ggml_type == T.Q8_0 else _VIEWS[ggml_type]) if convert else np.int32
    row_words = dim // per_word
    # the most threads whose loads split the tile evenly: a block of 12 query heads (GLM-4.5's 96 over 8 kv
    # heads) has 96 threads, and 64 of them load a tile of 128-word rows
    wt = _largest_divisor(row_words, s.threads)
    tt = _largest_divisor(s.tile, s.threads // wt)
    n_a, n_b = row_words // wt, s.tile // tt
    per_thread = n_a * n_b
    quantized = ggml_type in QUANTIZED
    words_per_block = QUANT_BLOCK // per_word
    blocks_per_row = dim // QUANT_BLOCK
    element_dim, element_value = converted_element_format(ggml_type) if convert else element_format(ggml_type)

    @cuda.jit(device=True, inline=True)
    def load(data, scales, slot, head, first, tid, raw, raw_scales):
        if tid < wt * tt:
            row = head * page_tokens + first + tid // wt
            w0 = tid % wt
            for b in range(n_b):
                for a in range(n_a):
                    raw[b * n_a + a] = data[U(slot), U((row + b * tt) * row_words + w0 + a * wt)]
                    if quantized:
                        raw_scales[b * n_a + a] = np.float32(
                            scales[U(slot), U((row + b * tt) * blocks_per_row + (w0 + a * wt) // words_per_block)])

    @cuda.jit(device=True, inline=True)
    def store(raw, raw_scales, tid, keep, buf):
        if tid < wt * tt:
            t0 = tid // wt
            w0 = tid % wt
            for b in range(n_b):
                for a in range(n_a):
                    for e in range(per_word):
                        value = _ZERO
                        if t0 + b * tt < keep:
                            value = element_value(raw[b * n_a + a], e, raw_scales[b * n_a + a])
                        buf[U((t0 + b * tt) * stride + element_dim(w0 + a * wt, e))] = value
    return load, store, per_thread, register


def _outputs(decode: bool, group: int, dv: int, threads: int):
    """(get, set, finish) for the running P V sums, which live in the output: a decode partial's V sum
    (rows, n_head, splits, dv + 2), or a prefill output row (rows, n_head * dv), divided at the end."""
    if decode:
        def get(out, row, head, split, d):
            return out[row, head, split, 2 + d]

        def put(out, row, head, split, d, value):
            out[row, head, split, 2 + d] = value

        def finish(out, tid, row0, n_rows, kv_head, split, run_max, run_sum):
            for e in range(tid, n_rows * group * (dv + 2), threads):
                r = e // (group * (dv + 2))
                g = (e // (dv + 2)) % group
                x = e % (dv + 2)
                m = run_max[r * group + g]
                if x == 0:
                    out[r, kv_head * group + g, split, 0] = m
                elif x == 1:
                    out[r, kv_head * group + g, split, 1] = run_sum[r * group + g]
                elif m == NEG_INF:
                    out[r, kv_head * group + g, split, x] = _ZERO
    else:
        def get(out, row, head, split, d):
            return out[row, head * dv + d]

        def put(out, row, head, split, d, value):
            out[row, head * dv + d] = value

        def finish(out, tid, row0, n_rows, kv_head, split, run_max, run_sum):
            for e in range(tid, n_rows * group * dv, threads):
                r = e // (group * dv)
                g = (e // dv) % group
                col = (kv_head * group + g) * dv + e % dv
                out[row0 + r, col] = out[row0 + r, col] / run_sum[r * group + g]
    return tuple(cuda.jit(device=True, inline=True)(f) for f in (get, put, finish))


@functools.cache
def _attention_kernel(decode: bool, k_type: T, v_type: T, group: int, dk: int, dv: int, page_tokens: int,
                      n_head_kv: int, tuning: Tuning, window: int = 0):
    """The attention kernel and its block's thread count (module doc); window > 0: a row at position p reads
    positions p - window + 1 .. p only (tiles wholly before every row's window are not read)."""
    s = _shape(group, dk, dv, page_tokens, tuning)
    hold_q = tuning.hold_q
    if s.shared_bytes > s.shared_limit:
        raise StratumError(f"attention with {group} query heads per kv head and head dims {dk}/{dv} needs "
                           f"{s.shared_bytes} bytes of shared memory per block (at most {s.shared_limit})")
    T_, PT, G, GT, KC, DT = s.tile, page_tokens, group, s.score_heads, s.dim_chunks, SCORE_DIMS
    LANES, GG, NT, TPL = s.lanes, s.head_groups, s.threads, s.tile // s.lanes
    DVT, DVC, PVR, NS, TPS = s.value_dims, s.value_chunks, s.value_roles, s.subsets, s.tile // s.subsets
    SEGL = s.segment
    NSEG = T_ // SEGL
    KSTR = s.k_stride
    SCRATCH = s.scratch
    SEPARATE = s.separate
    VP = s.score_partials if SEPARATE else 0      # where the P V partials start in scratch
    SCORE_ROLES = SEGMENTS = G * NSEG
    K_TILE, V_TILE, PROBS, RUNNING = T_ * KSTR, T_ * dv, G * T_, MAX_WINDOW * G
    Q_REGS, ACC_REGS = GT * DT, GT * DVT
    scale = np.float32(1.0 / math.sqrt(dk))
    load_k, store_k, WK, K_REG = _tile_io(k_type, PT, dk, s, KSTR, _converts(k_type, tuning))
    load_v, store_v, WV, V_REG = _tile_io(v_type, PT, dv, s, dv, _converts(v_type, tuning))
    splits = ATTENTION_SPLITS

    state_get, state_set, finish = _outputs(decode, G, dv, NT)

    @cuda.jit(device=True, inline=True)
    def load_page(page_table, page, first, k_data, k_scales, v_data, v_scales, hk_data, hk_scales, hv_data,
                  hv_scales, kv_head, tid, k_raw, k_raw_scales, v_raw, v_raw_scales):
        """A tile of a page's K and V into registers: from its VRAM slot, or from the host copy (mapped
        memory, read in place) when the page table says -1 (a page older than the ring keeps)."""
        slot = page_table[page]
        if slot >= 0:
            load_k(k_data, k_scales, slot, kv_head, first, tid, k_raw, k_raw_scales)
            load_v(v_data, v_scales, slot, kv_head, first, tid, v_raw, v_raw_scales)
        else:
            load_k(hk_data, hk_scales, page, kv_head, first, tid, k_raw, k_raw_scales)
            load_v(hv_data, hv_scales, page, kv_head, first, tid, v_raw, v_raw_scales)

    @cuda.jit(device=True, inline=True)
    def fold(out, tid, r, row, kv_head, split, v_chunk, v_heads, acc, prev, scratch, old_max, new_max, seg_sum,
             run_max, run_sum):
        """A row's tile into its running sums: subset 0 adds the other subsets' P V sums in order to its own
        and to the running sum rescaled by exp(m_old - m_new); the sum of exp likewise."""
        if tid < PVR:
            for a in range(GT):
                g = v_heads * GT + a
                m_old = old_max[g]
                alpha = math.exp(m_old - new_max[g])
                for j in range(DVT):
                    d = v_chunk + DVC * j
                    total = acc[a * DVT + j]
                    for u in range(NS - 1):
                        total += scratch[U(VP + (u * G + g) * dv + d)]
                    if m_old != NEG_INF:
                        total = prev[a * DVT + j] * alpha + total
                    state_set(out, row, kv_head * G + g, split, d, total)
        if tid < G:
            total = _ZERO
            for k in range(NSEG):
                total += seg_sum[tid * NSEG + k]
            run_sum[r * G + tid] = run_sum[r * G + tid] * math.exp(old_max[tid] - new_max[tid]) + total
            run_max[r * G + tid] = new_max[tid]


    @cuda.jit
    def kernel(q, positions, page_table, k_data, k_scales, v_data, v_scales, hk_data, hk_scales, hv_data, hv_scales,
               out):
        tid = cuda.threadIdx.x
        block = cuda.blockIdx.x
        if decode:
            kv_head = block // splits
            split = block % splits
            tile_step = splits
            row0 = 0
            n_rows = q.shape[0]
        else:
            kv_head = block % n_head_kv
            split = 0
            tile_step = 1
            row0 = (block // n_head_kv) * MAX_WINDOW
            n_rows = min(MAX_WINDOW, q.shape[0] - row0)
        k_tile = cuda.shared.array(K_TILE, np.float32)
        v_tile = cuda.shared.array(V_TILE, np.float32)
        scratch = cuda.shared.array(SCRATCH, np.float32)
        probs = cuda.shared.array(PROBS, np.float32)
        seg_max = cuda.shared.array(SEGMENTS, np.float32)
        seg_sum = cuda.shared.array(SEGMENTS, np.float32)
        run_max = cuda.shared.array(RUNNING, np.float32)
        run_sum = cuda.shared.array(RUNNING, np.float32)
        new_max = cuda.shared.array(G, np.float32)
        old_max = cuda.shared.array(G, np.float32)
        for e in range(tid, RUNNING, NT):
            run_max[e] = NEG_INF
            run_sum[e] = _ZERO

        last_pos = -1
        first_pos = 1 << 30
        for r in range(n_rows):
            last_pos = max(last_pos, positions[row0 + r])
            first_pos = min(first_pos, positions[row0 + r])
        last_tile = last_pos // T_
        first_tile = split
        if window:      # the split's first tile that some row's window reaches
            window_tile = max(first_pos - window + 1, 0) // T_
            if window_tile > split:
                first_tile = split + -(-(window_tile - split) // tile_step) * tile_step
        n_tiles = 0
        if last_pos >= 0 and first_tile <= last_tile:
            n_tiles = (last_tile - first_tile) // tile_step + 1

        lane = tid % LANES
        head_group = (tid // LANES) % GG
        chunk = tid // (LANES * GG)
        score_head = tid // NSEG
        score_segment = tid % NSEG
        v_chunk = tid % DVC
        v_heads = (tid // DVC) % GG
        subset = tid // PVR
        k_raw = cuda.local.array(WK, K_REG)
        k_raw_scales = cuda.local.array(WK, np.float32)
        v_raw = cuda.local.array(WV, V_REG)
        v_raw_scales = cuda.local.array(WV, np.float32)
        q_regs = cuda.local.array(Q_REGS, np.float32)
        k_vals = cuda.local.array(DT, np.float32)
        v_vals = cuda.local.array(DVT, np.float32)
        acc = cuda.local.array(ACC_REGS, np.float32)
        prev = cuda.local.array(ACC_REGS, np.float32)

        if n_tiles > 0:
            load_page(page_table, first_tile * T_ // PT, first_tile * T_ % PT, k_data, k_scales, v_data, v_scales, hk_data, hk_scales, hv_data,
                      hv_scales, kv_head, tid, k_raw, k_raw_scales, v_raw, v_raw_scales)
        cuda.syncthreads()
        # phases end at a sync; a row's fold waits for the next phase (the next staging or the next scores)
        pending = False
        fold_r = 0
        fold_row = 0
        for i in range(n_tiles):
            t0 = (first_tile + i * tile_step) * T_
            if pending:
                fold(out, tid, fold_r, fold_row, kv_head, split, v_chunk, v_heads, acc, prev, scratch, old_max,
                     new_max, seg_sum, run_max, run_sum)
                pending = False
            keep = last_pos - t0 + 1
            store_k(k_raw, k_raw_scales, tid, keep, k_tile)
            store_v(v_raw, v_raw_scales, tid, keep, v_tile)
            if i + 1 < n_tiles:
                t1 = (first_tile + (i + 1) * tile_step) * T_
                load_page(page_table, t1 // PT, t1 % PT, k_data,
                          k_scales, v_data, v_scales, hk_data, hk_scales, hv_data, hv_scales, kv_head, tid, k_raw,
                          k_raw_scales, v_raw, v_raw_scales)
            cuda.syncthreads()
            for r in range(n_rows):
                row = row0 + r
                pos = positions[row]
                if pos >= t0 and (window == 0 or t0 + T_ > pos - window + 1):
                    if pending:
                        fold(out, tid, fold_r, fold_row, kv_head, split, v_chunk, v_heads, acc, prev, scratch,
                             old_max, new_max, seg_sum, run_max, run_sum)
                        pending = False
                        if not SEPARATE:
                            cuda.syncthreads()
                    # scores: 16-dim partial dot products of GT heads with this lane's tokens
                    if i == 0 or n_rows > 1 or not hold_q:
                        for a in range(GT):
                            for j in range(DT):
                                q_regs[a * DT + j] = q[U(row), U(((kv_head * G + head_group * GT + a) * KC + chunk) * DT + j)]
                    for k in range(TPL):
                        t = lane + k * LANES
                        for j in range(DT):
                            k_vals[j] = k_tile[U(t * KSTR + chunk * DT + j)]
                        for a in range(GT):
                            dot = _ZERO
                            for j in range(DT):
                                dot += q_regs[a * DT + j] * k_vals[j]
                            scratch[U((chunk * G + head_group * GT + a) * T_ + t)] = dot
                    cuda.syncthreads()
                    # each (head, segment): scores in dim-chunk order, masked past the row; the segment's max
                    if tid < SCORE_ROLES:
                        g = score_head
                        top = NEG_INF
                        for k in range(SEGL):
                            t = score_segment * SEGL + k
                            score = _ZERO
                            for c in range(KC):
                                score += scratch[U((c * G + g) * T_ + t)]
                            score = score * scale
                            if t0 + t > pos or (window and t0 + t <= pos - window):
                                score = NEG_INF
                            probs[U(g * T_ + t)] = score
                            top = max(top, score)
                        seg_max[tid] = top
                    cuda.syncthreads()
                    # each (head, segment): the new running max, probabilities, the segment's sum
                    if tid < SCORE_ROLES:
                        g = score_head
                        m_old = run_max[r * G + g]
                        m_new = m_old
                        for k in range(NSEG):
                            m_new = max(m_new, seg_max[U(g * NSEG + k)])
                        total = _ZERO
                        for k in range(SEGL):
                            t = score_segment * SEGL + k
                            p = math.exp(probs[U(g * T_ + t)] - m_new)
                            probs[U(g * T_ + t)] = p
                            total += p
                        seg_sum[tid] = total
                        if score_segment == 0:
                            new_max[g] = m_new
                            old_max[g] = m_old
                    cuda.syncthreads()
                    # P V: GT heads x DVT dims over every NS-th token; subsets 1.. hand theirs over
                    if tid < NS * PVR:
                        for a in range(GT):
                            g = v_heads * GT + a
                            for j in range(DVT):
                                acc[a * DVT + j] = _ZERO
                                if subset == 0 and old_max[g] != NEG_INF:
                                    prev[a * DVT + j] = state_get(out, row, kv_head * G + g, split,
                                                                  v_chunk + DVC * j)
                        for k in range(TPS):
                            t = subset + k * NS
                            for j in range(DVT):
                                v_vals[j] = v_tile[U(t * dv + v_chunk + DVC * j)]
                            for a in range(GT):
                                p = probs[U((v_heads * GT + a) * T_ + t)]
                                for j in range(DVT):
                                    acc[a * DVT + j] += p * v_vals[j]
                        if subset > 0:
                            for a in range(GT):
                                for j in range(DVT):
                                    scratch[U(VP + ((subset - 1) * G + v_heads * GT + a) * dv + v_chunk + DVC * j)] = \
                                        acc[a * DVT + j]
                    cuda.syncthreads()
                    pending = True
                    fold_r = r
                    fold_row = row

        if pending:
            fold(out, tid, fold_r, fold_row, kv_head, split, v_chunk, v_heads, acc, prev, scratch, old_max, new_max,
                 seg_sum, run_max, run_sum)
        cuda.syncthreads()
        finish(out, tid, row0, n_rows, kv_head, split, run_max, run_sum)

    return kernel, s


def _check_attention(family: str, n_head: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                     page_tokens: int) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise StratumError(f"{n_head} query heads cannot be grouped over {n_head_kv} kv heads")
    if page_tokens <= 0:
        raise StratumError(f"page_tokens = {page_tokens}")
    check_head_dims(head_dim_k=head_dim_k, head_dim_v=head_dim_v)


def _attention_launch(family: str, kv_type_name, n_head: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                      page_tokens: int, tuning: Tuning, window: int = 0):
    kv = kv_types(kv_type_name)
    _check_attention(family, n_head, n_head_kv, head_dim_k, head_dim_v, page_tokens)
    decode = family == "decode"
    kernel, shape = _attention_kernel(decode, kv.k_type, kv.v_type, n_head // n_head_kv, head_dim_k, head_dim_v,
                                      page_tokens, n_head_kv, tuning, window)
    threads = shape.threads

    def launch(stream, q, positions, page_table, pages, out, host_pages=None):
        rows = q.shape[0]
        if decode:
            if rows > MAX_WINDOW:
                raise ValueError(f"a decode window holds at most {MAX_WINDOW} rows, got {rows}")
            blocks = n_head_kv * ATTENTION_SPLITS
        else:
            blocks = -(-rows // MAX_WINDOW) * n_head_kv
        if rows:
            hk_data, hk_scales, hv_data, hv_scales = host_arrays(pages, host_pages)
            launch_kernel(kernel, blocks, threads, stream, q, positions, page_table,
                          _data_view(pages.k_data, kv.k_type, tuning), pages.k_scales,
                          _data_view(pages.v_data, kv.v_type, tuning), pages.v_scales,
                          _data_view(hk_data, kv.k_type, tuning), hk_scales, _data_view(hv_data, kv.v_type, tuning),
                          hv_scales, out)
    return launch


@functools.cache
def make_attention(family: str, kv_type_name, n_head: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                   page_tokens: int, window_tokens: int = 0):
    """prefill: launch(stream, q, positions, page_table, pages, out, host_pages=None); decode: launch(stream,
    q, positions, page_table, pages, partials, host_pages=None) (`codegen.lower.attention_decode`). q f32
    (rows, n_head*dk) with RoPE applied, at int32 `positions`, reads the positions 0..p already stored: a page
    from its slot, or from `host_pages` (the whole context in mapped host memory, page p at index p) when the
    page table says -1; out f32 (rows, n_head*dv); partials f32 (rows, n_head, 64, dv + 2). window_tokens > 0:
    a row at position p reads only positions p - window_tokens + 1 .. p (the drafter's window: its ring holds
    no older pages)."""
    if window_tokens < 0:
        raise ValueError(f"window_tokens {window_tokens}: 0 (the whole context) or more")
    _check_attention(family, n_head, n_head_kv, head_dim_k, head_dim_v, page_tokens)
    make = make_decode_attention if family == "decode" else make_prefill_attention
    return make(kv_type_name, n_head, n_head_kv, head_dim_k, head_dim_v, page_tokens, window_tokens)
