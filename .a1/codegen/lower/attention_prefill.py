"""Prefill attention: a chunk's rows against the paged K/V, flash-attention style on FP32 CUDA cores.

A block of THREADS threads per (kv head, slice of `slice_rows` rows of the launch) holds the slice's query
vectors (its rows x the group's query heads, padded to a multiple of QUERY_GROUP: `_Cut.queries`) transposed in
shared memory, and walks the K/V in tiles of TILE positions aligned to absolute positions, ascending, from the
first tile any of its rows reaches to its last row's. Per tile:

  stage K   lane p reads position t0 + p's K row from its page (16 bytes a load, through the page table: a VRAM
            slot, or the host copy where the table says -1), decodes it and writes it transposed, k[d][p];
            positions outside the block's reach are staged as zeros (never read from their pages);
  scores    each thread a block of 4 query vectors x `positions` positions, summed over d ascending from
            vector loads of q[d][4 queries] and k[d][positions], scaled, -inf past the row's position (and
            before its window), into s[p][q];
  softmax   a thread per query vector: the tile's max, the running max, exp in position order and their sum,
            the factor exp(m_old - m_new) its output is rescaled by; meanwhile every thread stages the tile's
            V rows, v[p][d], into the buffer K had;
  P V       each thread owns 4 query vectors x `dims` output dims in registers: rescaled, then the tile's
            positions added in order.

A row's result depends on its own position and the K/V alone: a tile its block walks beyond the row's reach
scores -inf for it and leaves its state unchanged to the bit (its sums times 1, plus exact zeros), so prefill
rows are bitwise the same whatever the chunk and wherever it starts. The previous prefill kernel
(`codegen.lower.attention`, now the benchmark's v1) took a block's rows one after another, five barriers a
row and tile, at 17% of the FP32 peak (BENCHMARKS.md).
"""

import functools
import math
from dataclasses import dataclass

import numpy as np

from codegen.graph import PREFILL_QUERY_VECTORS, prefill_attention_rows
from codegen.lower.attention_decode import _word_format
from codegen.lower.cuda import SHARED_ALIGN, SHARED_BYTES, SIMULATOR, U, cuda, launch_kernel, load4
from codegen.lower.kv_pages import QUANT_BLOCK, QUANTIZED, aligned_kernel_arrays, kv_types, page_locator
from planner.errors import StratumError

THREADS = 32 if SIMULATOR else 128     # a block's threads: 4 warps (the simulator, which runs each as a Python
#                                         thread, takes one: the same sums, in the same order)
LANES = 32
TILE = 32                   # positions a K/V tile (= lanes: one lane stages one position's K row)
QUERY_GROUP = PREFILL_QUERY_VECTORS     # a block's query vectors are padded to a multiple of this
CHUNK_WORDS = 4             # a lane's load of a K or V row: 16 bytes (`load4`)

NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0)
_ONE = np.float32(1)


@dataclass(frozen=True)
class _Cut:
    """How a block is cut, from the shape alone."""
    group: int          # query heads a kv head
    dk: int
    dv: int
    slice_rows: int     # launch rows a block holds
    queries: int        # its query vectors, padded: slice_rows * group <= queries, a multiple of QUERY_GROUP

    @property
    def query_groups(self) -> int:      # threads along the query vectors, 4 vectors each
        return self.queries // 4

    @property
    def positions(self) -> int:         # positions a thread scores
        return TILE * self.query_groups // THREADS

    @property
    def dims(self) -> int:              # output dims a thread sums
        return self.dv * self.query_groups // THREADS

    @property
    def shared_bytes(self) -> int:
        floats = (self.dk * self.queries + max(self.dk, self.dv) * TILE + TILE * self.queries
                  + 3 * self.queries)
        return 4 * floats


def cut(group: int, dk: int, dv: int) -> _Cut:
    rows = prefill_attention_rows(group)
    queries = -(-rows * group // QUERY_GROUP) * QUERY_GROUP
    shape = _Cut(group, dk, dv, rows, queries)
    if THREADS % shape.query_groups or shape.positions < 1 or dv % (THREADS // shape.query_groups) \
            or shape.shared_bytes > SHARED_BYTES:
        raise StratumError(f"prefill attention cannot cut blocks for {group} query heads per kv head with head dims "
                           f"{dk}/{dv}: {queries} query vectors a block, {shape.shared_bytes} bytes of shared memory "
                           f"(at most {SHARED_BYTES})")
    return shape


@functools.cache
def _chunk_reader(ggml_type, dim: int, page_tokens: int):
    """read(page_table, data, scales, host_data, host_scales, kv_head, position, c, vals): words 4c..4c + 3
    of the position's row (one 16-byte load, from its slot or the host copy) decoded into vals[i, e], times
    their block's scale (a chunk lies within one block)."""
    vpw, decode, _ = _word_format(ggml_type)
    row_words, row_blocks, words_per_block = dim // vpw, dim // QUANT_BLOCK, QUANT_BLOCK // vpw
    quantized = ggml_type in QUANTIZED
    locate = page_locator(page_tokens)

    @cuda.jit(device=True, inline=True)
    def read(page_table, data, scales, host_data, host_scales, kv_head, key, c, vals):
        where, host, offset = locate(page_table, key)
        row = kv_head * page_tokens + offset
        words = load4(host_data if host else data, (U(where), U(row * row_words + c * CHUNK_WORDS)))
        for i in range(CHUNK_WORDS):
            decode(words[i], vals, i, 0)
        if quantized:
            block_scale = np.float32((host_scales if host else scales)[U(where), U(
                row * row_blocks + c * CHUNK_WORDS // words_per_block)])
            for i in range(CHUNK_WORDS):
                for e in range(vpw):
                    vals[i, e] *= block_scale
    return read


@functools.cache
def _outer_product_step(columns: int):
    """step(a, a_at, b, b_at, a_regs, b_regs, acc): acc[i, j] += a[a_at + i] * b[b_at + j] for 4 x `columns`,
    both runs loaded first (vector loads from shared memory)."""
    @cuda.jit(device=True, inline=True)
    def step(a, a_at, b, b_at, a_regs, b_regs, acc):
        for i in range(4):
            a_regs[i] = a[U(a_at + i)]
        for j in range(columns):
            b_regs[j] = b[U(b_at + j)]
        for i in range(4):
            for j in range(columns):
                acc[i, j] += a_regs[i] * b_regs[j]
    return step


@functools.cache
def prefill_attention_kernel(k_type, v_type, group: int, dk: int, dv: int, page_tokens: int, n_head_kv: int,
                             window: int):
    """The kernel (module doc); window > 0: a row at position p reads positions p - window + 1 .. p only."""
    s = cut(group, dk, dv)
    G, PT, QV, QR = group, page_tokens, s.queries, s.slice_rows
    QG, PP, DP = s.query_groups, s.positions, s.dims
    k_vpw, _, k_elem = _word_format(k_type)
    v_vpw, _, v_elem = _word_format(v_type)
    k_words, v_words = dk // k_vpw, dv // v_vpw
    if k_words % CHUNK_WORDS or v_words % CHUNK_WORDS:
        raise StratumError(f"prefill attention reads K/V rows 16 bytes a load: head dims {dk}/{dv} in "
                           f"{k_type.name}/{v_type.name} are not whole 16-byte runs")
    k_chunks, v_chunks = k_words // CHUNK_WORDS, v_words // CHUNK_WORDS
    Q_FLOATS, KV_FLOATS, S_FLOATS = dk * QV, max(dk, dv) * TILE, TILE * QV
    scale = np.float32(1.0 / math.sqrt(dk))
    warps = THREADS // LANES

    read_k = _chunk_reader(k_type, dk, PT)
    read_v = _chunk_reader(v_type, dv, PT)

    @cuda.jit(device=True, inline=True)
    def stage_k(page_table, k_data, k_scales, hk_data, hk_scales, kv_head, t0, lo, hi, tid, vals, buf):
        """buf[d * TILE + p] = K of position t0 + p (zeros outside lo..hi): lane p reads its row, the warps
        taking its 16-byte chunks in turn."""
        p = tid % LANES
        key = t0 + p
        inside = key >= lo and key <= hi
        for c in range(tid // LANES, k_chunks, warps):
            read_k(page_table, k_data, k_scales, hk_data, hk_scales, kv_head, min(max(key, lo), hi), c, vals)
            for i in range(CHUNK_WORDS):
                for e in range(k_vpw):
                    buf[U(k_elem(c * CHUNK_WORDS + i, e, k_vpw) * TILE + p)] = vals[i, e] if inside else _ZERO

    @cuda.jit(device=True, inline=True)
    def stage_v(page_table, v_data, v_scales, hv_data, hv_scales, kv_head, t0, lo, hi, tid, vals, buf):
        """buf[p * dv + d] = V of position t0 + p (zeros outside lo..hi): consecutive threads read consecutive
        16-byte chunks of the tile's rows."""
        for e in range(tid, TILE * v_chunks, THREADS):
            p = e // v_chunks
            c = e % v_chunks
            key = t0 + p
            inside = key >= lo and key <= hi
            read_v(page_table, v_data, v_scales, hv_data, hv_scales, kv_head, min(max(key, lo), hi), c, vals)
            for i in range(CHUNK_WORDS):
                for x in range(v_vpw):
                    buf[U(p * dv + v_elem(c * CHUNK_WORDS + i, x, v_vpw))] = vals[i, x] if inside else _ZERO

    score_step, value_step = _outer_product_step(PP), _outer_product_step(DP)

    @cuda.jit
    def kernel(q, positions, page_table, k_data, k_scales, v_data, v_scales, hk_data, hk_scales, hv_data,
               hv_scales, out):
        tid = cuda.threadIdx.x
        n_rows_all = q.shape[0]
        n_slices = -(-n_rows_all // QR)
        kv_head = cuda.blockIdx.x % n_head_kv
        row0 = (n_slices - 1 - cuda.blockIdx.x // n_head_kv) * QR    # the longest slices first
        n_rows = min(QR, n_rows_all - row0)
        q_t = cuda.shared.array(Q_FLOATS, np.float32, alignment=SHARED_ALIGN)      # q_t[d * QV + query]
        buf = cuda.shared.array(KV_FLOATS, np.float32, alignment=SHARED_ALIGN)     # K as k[d][p], then V as v[p][d]
        s_t = cuda.shared.array(S_FLOATS, np.float32, alignment=SHARED_ALIGN)      # s_t[p * QV + query]
        run_max = cuda.shared.array(QV, np.float32)
        run_sum = cuda.shared.array(QV, np.float32)
        alpha = cuda.shared.array(QV, np.float32)
        row_pos = cuda.shared.array(QR, np.int32)

        last_pos = -1
        lo = 1 << 30
        for r in range(n_rows):
            pos = positions[row0 + r]
            last_pos = max(last_pos, pos)
            lo = min(lo, max(pos - window + 1, 0) if window else 0)
        if tid < n_rows:
            row_pos[tid] = positions[row0 + tid]
        for e in range(tid, Q_FLOATS, THREADS):
            query = e % QV
            d = e // QV
            value = _ZERO
            if query < n_rows * G:
                value = q[U(row0 + query // G), U((kv_head * G + query % G) * dk + d)]
            q_t[e] = value
        if tid < QV:
            run_max[tid] = NEG_INF
            run_sum[tid] = _ZERO

        qg = tid % QG
        lane_group = tid // QG          # the thread's positions (scores) and dims (P V)
        vals = cuda.local.array((CHUNK_WORDS, 8), np.float32)
        qa = cuda.local.array(4, np.float32)
        kb = cuda.local.array(PP, np.float32)
        scores = cuda.local.array((4, PP), np.float32)
        acc = cuda.local.array((4, DP), np.float32)
        vb = cuda.local.array(DP, np.float32)
        for i in range(4):
            for j in range(DP):
                acc[i, j] = _ZERO
        first_tile = lo // TILE
        n_tiles = last_pos // TILE - first_tile + 1 if last_pos >= 0 else 0
        for it in range(n_tiles):
            t0 = (first_tile + it) * TILE
            cuda.syncthreads()      # the last tile's P V has read buf and s_t
            stage_k(page_table, k_data, k_scales, hk_data, hk_scales, kv_head, t0, lo, last_pos, tid, vals, buf)
            cuda.syncthreads()
            # scores: 4 query vectors x PP positions, d ascending
            for i in range(4):
                for j in range(PP):
                    scores[i, j] = _ZERO
            for d in range(0, dk, 4):       # four steps written out: the loop's bookkeeping costs a quarter
                for u in range(4):
                    score_step(q_t, (d + u) * QV + qg * 4, buf, (d + u) * TILE + lane_group * PP, qa, kb, scores)
            for i in range(4):
                query = qg * 4 + i
                r = query // G
                pos = row_pos[r] if r < n_rows else -1
                for j in range(PP):
                    key = t0 + lane_group * PP + j
                    score = NEG_INF
                    if query < n_rows * G and key <= pos and (window == 0 or key > pos - window):
                        score = scores[i, j] * scale
                    s_t[U((lane_group * PP + j) * QV + query)] = score
            cuda.syncthreads()
            if tid < QV:        # softmax of query vector tid over the tile
                m_old = run_max[tid]
                top = m_old
                for p in range(TILE):
                    top = max(top, s_t[U(p * QV + tid)])
                factor = _ONE
                if top != NEG_INF:
                    factor = math.exp(m_old - top)
                total = _ZERO
                for p in range(TILE):
                    e = _ZERO
                    if top != NEG_INF:
                        e = math.exp(s_t[U(p * QV + tid)] - top)
                    s_t[U(p * QV + tid)] = e
                    total += e
                run_sum[tid] = run_sum[tid] * factor + total
                run_max[tid] = top
                alpha[tid] = factor
            stage_v(page_table, v_data, v_scales, hv_data, hv_scales, kv_head, t0, lo, last_pos, tid, vals, buf)
            cuda.syncthreads()
            # P V: rescale, then the tile's positions in order
            for i in range(4):
                factor = alpha[qg * 4 + i]
                for j in range(DP):
                    acc[i, j] *= factor
            for p in range(0, TILE, 2):
                for u in range(2):
                    value_step(s_t, (p + u) * QV + qg * 4, buf, (p + u) * dv + lane_group * DP, qa, vb, acc)
        cuda.syncthreads()
        for i in range(4):
            query = qg * 4 + i
            if query < n_rows * G:
                total = run_sum[query]
                for j in range(DP):
                    out[U(row0 + query // G), U((kv_head * G + query % G) * dv + lane_group * DP + j)] = \
                        acc[i, j] / total

    return kernel, s


@functools.cache
def make_prefill_attention(kv_type_name, n_head: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                           page_tokens: int, window_tokens: int = 0):
    """launch(stream, q, positions, page_table, pages, out, host_pages=None): q f32 (rows, n_head*dk) with
    RoPE applied at int32 `positions`, against positions 0..p already stored (a page from its slot, or from
    `host_pages` where the table says -1); out f32 (rows, n_head*dv). `codegen.lower.attention.make_attention`
    checks the arguments."""
    kv = kv_types(kv_type_name)
    kernel, shape = prefill_attention_kernel(kv.k_type, kv.v_type, n_head // n_head_kv, head_dim_k, head_dim_v,
                                             page_tokens, n_head_kv, window_tokens)

    def launch(stream, q, positions, page_table, pages, out, host_pages=None):
        rows = q.shape[0]
        if not rows:
            return
        arrays = aligned_kernel_arrays(pages, host_pages, "prefill attention")
        launch_kernel(kernel, -(-rows // shape.slice_rows) * n_head_kv, THREADS, stream, q, positions, page_table,
                      *arrays, out)
    return launch
