"""Pointwise and routing kernels: embedding, RMSNorm, NEOX RoPE (with the q/k norm before it and the K/V store
after it), concat, router top-k and route weights, argmax. (The residual adds are the epilogues of the
projections that end a block's halves: `codegen.lower.matmul`, `codegen.lower.moe`.)

Every kernel gives each row (or each row's head) its own block, or its own threads for the elementwise ones,
so a row's result never depends on how many rows the launch holds; the reductions (sum of squares, argmax)
add each thread's elements in index order, then combine the threads through shared memory in one fixed tree
(the router's softmax sum: fixed warp butterflies over fixed runs of experts, added in order). Block sizes
come from the constants alone. Each thread issues its loads before it uses them (values held in registers),
so a lone row (a decode step) waits for memory once, not per element.
"""

import functools
import math

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import ARGMAX_BLOCK_VALUES, argmax_blocks
from codegen.lower import kv_pages
from codegen.lower.cuda import begin_after_prior_grids, better, cuda, launch_kernel, overlapping, warp_sum
from codegen.lower.word_formats import FORMATS

WARP = 32
ELEMENTWISE_THREADS = 256
EMBED_THREADS = 256      # at most, per embedded row
NORM_THREADS = 256       # at most, per row of an RMSNorm or head of a RoPE
MAX_ROUTER_EXPERTS = 1024   # a thread an expert in prefill's router block
MIN_ROUTER_SLICE = 16       # experts a router thread compares against at least (fewer: more threads, no faster)
ARGMAX_THREADS = 256     # a block of the argmax's runs (`make_argmax_partials`)
ARGMAX_UNROLL = ARGMAX_BLOCK_VALUES // ARGMAX_THREADS     # independent loads in flight per thread
ARGMAX_FINAL_THREADS = 1024     # at most, for the merge of a row's runs: so rows of up to 4M values

GATINGS = ("softmax", "sigmoid")
NEG_INF = np.float32(-np.inf)


@cuda.jit(device=True, inline=True)
def silu(g):
    return g / (np.float32(1) + math.exp(-g))


def _threads(count: int, cap: int) -> int:
    """A block for `count` items: the smallest power of two >= count, at least a warp, at most `cap`."""
    threads = WARP
    while threads < min(count, cap):
        threads *= 2
    return threads


def _check_router(n_expert: int, k: int, gating: str) -> None:
    if gating not in GATINGS:
        raise ValueError(f"unknown gating {gating!r}; expected one of {GATINGS}")
    if not 0 < k <= n_expert <= MAX_ROUTER_EXPERTS:
        raise ValueError(f"top {k} of {n_expert} experts: the router takes 1..{MAX_ROUTER_EXPERTS} experts")


def _per_row(kernel, threads: int, blocks_per_row: int = 1):
    """launch(stream, *arrays): `kernel` over `blocks_per_row` blocks for each row of the first array."""
    def launch(stream, *arrays):
        launch_kernel(kernel, arrays[0].shape[0] * blocks_per_row, threads, stream, *arrays)
    return launch


# ---------------------------------------------------------------------------------------------------------
# block reductions: every thread of the block calls them (they sync), in a fixed tree over `threads` slots


@cuda.jit(device=True, inline=True)
def _sum_tree(partial, tid, threads):
    """The sum of partial[:threads], pairs added in a fixed tree (slot t takes t + stride)."""
    stride = threads // 2
    while stride > 0:
        cuda.syncthreads()
        if tid < stride:
            partial[tid] += partial[tid + stride]
        stride //= 2
    cuda.syncthreads()
    return partial[0]


@cuda.jit(device=True, inline=True)
def _best_tree(values, indices, tid, threads):
    """Leaves the largest of values[:threads] and its lowest index in values[0], indices[0]."""
    stride = threads // 2
    while stride > 0:
        cuda.syncthreads()
        if tid < stride and better(values[tid + stride], indices[tid + stride], values[tid], indices[tid]):
            values[tid] = values[tid + stride]
            indices[tid] = indices[tid + stride]
        stride //= 2
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _sigmoid(x):
    return np.float32(1) / (np.float32(1) + np.float32(math.exp(-x)))


# ---------------------------------------------------------------------------------------------------------
# embedding


@functools.cache
def make_embed(ggml_type, n_embd: int):
    """launch(stream, ids, table, out): out[r] = the dequantized row ids[r] of `table` (a DeviceWeight of any
    type the matmuls read, (n_vocab, n_embd)), exactly `weights.dequantize`'s values (scale times quant, less
    the min: gguf-py's roundings). A thread takes runs of 4 values, reading the words that hold them as the
    prefill family does (`Format.slice_word`); it issues all its loads before its first store."""
    ggml_type = T(ggml_type)
    if ggml_type not in FORMATS:
        raise ValueError(f"no embedding kernel for {ggml_type.name}")
    fmt = FORMATS[ggml_type]
    slice_word, slice_quants, block_scale, has_min = fmt.slice_word, fmt.slice_quants, fmt.scale, fmt.has_min
    scaled, held_words = fmt.block_scales > 0, fmt.slice_words
    if n_embd % 16:
        raise ValueError(f"an embedding of {n_embd} values: the kernel reads whole slices of 16")
    items = n_embd // 4
    threads = _threads(items, EMBED_THREADS)
    steps = -(-items // threads)
    whole = items % threads == 0
    held_size = steps * held_words      # a local array's size must be a constant, not an expression

    @overlapping
    @cuda.jit
    def kernel(ids, data, scales, out):
        begin_after_prior_grids()
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        token = ids[row]
        held = cuda.local.array(held_size, np.int32)
        scale = cuda.local.array(steps, np.float32)
        low = cuda.local.array(steps, np.float32)
        vals = cuda.local.array((1, 4), np.float32)
        for u in range(steps):
            item = tid + u * threads
            if whole or item < items:
                for q in range(held_words):
                    held[u * held_words + q] = data[token, slice_word((item >> 2) << 4, item & 3, q)]
                if scaled:
                    scale[u], low[u] = block_scale(scales[token], 0, 4 * item)
        for u in range(steps):
            item = tid + u * threads
            if whole or item < items:
                slice_quants(held, u * held_words, (item >> 2) << 4, vals)
                for v in range(4):
                    value = vals[0, v]
                    if has_min:
                        value = scale[u] * value - low[u]
                    elif scaled:
                        value = scale[u] * value
                    out[row, 4 * item + v] = value

    def launch(stream, ids, table, out):
        data = table.data.view(np.int32)
        scales = table.scales.view(np.uint16) if fmt.header_bits else table.scales
        launch_kernel(kernel, ids.shape[0], threads, stream, ids, data, scales, out)
    return launch


# ---------------------------------------------------------------------------------------------------------
# RMSNorm


@functools.cache
def _run_norm(length: int, eps: float):
    """(threads, steps, whole, load, normalize) for RMSNorms of runs of `length` values, a block a run:
    load(x, row, first, values) takes thread tid's values j = tid + u * threads of x[row, first:first + length]
    into registers; normalize(values, weights, weight, partial) loads the thread's weights, then scales its
    values to x / sqrt(mean(x^2) + eps) * weight: each thread sums its squares in index order, the block's tree
    adds the threads'."""
    threads = _threads(length, NORM_THREADS)
    steps = -(-length // threads)
    whole = length % threads == 0
    eps32, length32 = np.float32(eps), np.float32(length)

    @cuda.jit(device=True, inline=True)
    def load(x, row, first, values):
        tid = cuda.threadIdx.x
        for u in range(steps):
            j = tid + u * threads
            values[u] = np.float32(0)
            if whole or j < length:
                values[u] = x[row, first + j]

    @cuda.jit(device=True, inline=True)
    def normalize(values, weights, weight, partial):
        tid = cuda.threadIdx.x
        for u in range(steps):
            j = tid + u * threads
            weights[u] = np.float32(0)
            if whole or j < length:
                weights[u] = weight[j]
        total = np.float32(0)
        for u in range(steps):
            total += values[u] * values[u]
        partial[tid] = total
        scale = np.float32(1) / np.float32(math.sqrt(_sum_tree(partial, tid, threads) / length32 + eps32))
        for u in range(steps):
            values[u] = values[u] * scale * weights[u]

    return threads, steps, whole, load, normalize


@functools.cache
def make_rmsnorm(n: int, eps: float):
    """launch(stream, x, weight, out): out = x / sqrt(mean(x^2) + eps) * weight per row (`_run_norm`); out may
    be x. A block a row; its values and weights are loaded before any is used."""
    threads, steps, whole, load, normalize = _run_norm(n, eps)

    @overlapping
    @cuda.jit
    def kernel(x, weight, out):
        begin_after_prior_grids()
        row = cuda.blockIdx.x
        partial = cuda.shared.array(threads, np.float32)
        values = cuda.local.array(steps, np.float32)
        weights = cuda.local.array(steps, np.float32)
        load(x, row, 0, values)
        normalize(values, weights, weight, partial)
        for u in range(steps):
            j = cuda.threadIdx.x + u * threads
            if whole or j < n:
                out[row, j] = values[u]

    return _per_row(kernel, threads)


# ---------------------------------------------------------------------------------------------------------
# RoPE, with the q/k norm before it and the K/V store after it


@functools.cache
def make_rope(kv_type_name, n_q_heads: int, n_k_heads: int, head_dim_k: int, head_dim_v: int, n_rot: int,
              base: float, eps: float | None, page_tokens: int):
    """launch(stream, q, q_weight, k, k_weight, v, positions, page_table, pages, host_pages=None): NEOX RoPE in
    place on q (rows, n_q_heads * head_dim_k) and k (rows, n_k_heads * head_dim_k) at int32 positions (rows,),
    then k and v (rows, n_k_heads * head_dim_v) stored into their pages as `kv_pages.make_kv_store` stores them
    (the same bits; into the host copy too with `host_pages`), in one launch: the store was a launch of its own,
    and a decode step pays ~2 us for each (BENCHMARKS.md). RoPE rotates pairs (i, i + n_rot/2) of each head,
    theta = pos * base^(-2i/n_rot) and its cos/sin in float64, the rotation in float32; dims >= n_rot keep
    their value. With `eps`, each head is first RMSNormed with its tensor's weight (head_dim_k,) (qwen3moe's q/k
    norm); without, the weights are 1-element placeholders, never read.

    A block per (row, head): q's heads, k's, then v's (which only store). Each thread loads its values (and
    weights) before it uses them, sums its squares in index order, then the block's fixed tree adds the
    threads'; the normed head goes through shared memory, since a rotated value needs its pair's, and pair i's
    thread writes both of its values; a k head's block stores the head once every thread has written it."""
    if n_rot % 2 or not 0 < n_rot <= head_dim_k:
        raise ValueError(f"n_rot {n_rot} must be even and within the head ({head_dim_k})")
    kv = kv_pages.kv_types(kv_type_name)
    kv_pages.check_head_dims(head_dim_k=head_dim_k, head_dim_v=head_dim_v)
    store_k, k_units = kv_pages.block_store(kv.k_type, n_k_heads, head_dim_k, page_tokens)
    store_v, v_units = kv_pages.block_store(kv.v_type, n_k_heads, head_dim_v, page_tokens)
    half = n_rot // 2
    rotated_heads = n_q_heads + n_k_heads
    inv_freq = base ** (-2.0 * np.arange(half) / n_rot)      # float64, as the reference computes it
    normed = eps is not None
    threads, steps, whole, load, normalize = _run_norm(head_dim_k, eps or 0.0)

    @cuda.jit(device=True, inline=True)
    def rotate(x, weight, row, first, position, head, partial, values, weights):
        tid = cuda.threadIdx.x
        load(x, row, first, values)
        if normed:
            normalize(values, weights, weight, partial)
        for u in range(steps):
            j = tid + u * threads
            if whole or j < head_dim_k:
                head[j] = values[u]
        cuda.syncthreads()
        for u in range(steps):
            j = tid + u * threads
            if j < half:        # pair j's thread: its angle once, both rotated values
                theta = position * cuda.const.array_like(inv_freq)[j]
                cos, sin = np.float32(math.cos(theta)), np.float32(math.sin(theta))
                x[row, first + j] = head[j] * cos - head[j + half] * sin
                x[row, first + j + half] = head[j] * sin + head[j + half] * cos
            elif j >= n_rot and (whole or j < head_dim_k) and normed:
                x[row, first + j] = values[u]

    @overlapping
    @cuda.jit
    def kernel(q, q_weight, k, k_weight, v, positions, page_table, k_data, k_scales, v_data, v_scales, hk_data,
               hk_scales, hv_data, hv_scales, through):
        begin_after_prior_grids()
        tid = cuda.threadIdx.x
        block = cuda.blockIdx.x
        row, h = block // (rotated_heads + n_k_heads), block % (rotated_heads + n_k_heads)
        head = cuda.shared.array(head_dim_k, np.float32)
        partial = cuda.shared.array(threads, np.float32)
        values = cuda.local.array(steps, np.float32)
        weights = cuda.local.array(steps, np.float32)
        position = np.float64(positions[row])
        # (each branch is the same for the whole block)
        if h < n_q_heads:
            rotate(q, q_weight, row, h * head_dim_k, position, head, partial, values, weights)
        elif h < rotated_heads:
            kv_head = h - n_q_heads
            rotate(k, k_weight, row, kv_head * head_dim_k, position, head, partial, values, weights)
            cuda.syncthreads()      # the head's rotated values, written by other threads, are the store's
            for u in range(tid, k_units, threads):
                store_k((row * n_k_heads + kv_head) * k_units + u, k, positions, page_table, k_data, k_scales,
                        hk_data, hk_scales, through)
        else:
            kv_head = h - rotated_heads
            for u in range(tid, v_units, threads):
                store_v((row * n_k_heads + kv_head) * v_units + u, v, positions, page_table, v_data, v_scales,
                        hv_data, hv_scales, through)

    def launch(stream, q, q_weight, k, k_weight, v, positions, page_table, pages, host_pages=None):
        if q.shape[0]:
            launch_kernel(kernel, q.shape[0] * (rotated_heads + n_k_heads), threads, stream, q, q_weight, k, k_weight,
                          v, positions, page_table, *pages.arrays(), *kv_pages.host_arrays(pages, host_pages),
                          int(host_pages is not None))
    return launch


# ---------------------------------------------------------------------------------------------------------
# concat


def _elementwise_blocks(rows: int, width: int) -> int:
    return -(-rows * width // ELEMENTWISE_THREADS)


@functools.cache
def make_concat(n_a: int, n_b: int):
    """launch(stream, a, b, out): out (rows, n_a + n_b) = [a ; b] per row."""
    width = n_a + n_b

    @overlapping
    @cuda.jit
    def kernel(a, b, out):
        begin_after_prior_grids()
        i = cuda.grid(1)
        row, col = i // width, i % width
        if row < out.shape[0]:
            out[row, col] = a[row, col] if col < n_a else b[row, col - n_a]

    def launch(stream, a, b, out):
        launch_kernel(kernel, _elementwise_blocks(out.shape[0], width), ELEMENTWISE_THREADS, stream, a, b, out)
    return launch


# ---------------------------------------------------------------------------------------------------------
# router


@cuda.jit(device=True, inline=True)
def _logit_score(logit, bias, expert):
    return logit


@cuda.jit(device=True, inline=True)
def _biased_sigmoid_score(logit, bias, expert):
    return _sigmoid(logit) + bias[expert]


@functools.cache
def block_router(n_expert: int, k: int, gating: str, normalize: bool, scale: float, threads: int):
    """route(logits, bias, row, ids, weights): a block's routing of logits[row]; all `threads` threads (a
    multiple of a warp) call it, and it returns after a barrier, so the caller may read what it wrote.

    ids[row] (k,) int32: the k best experts, best first, ties to the lower index, selected on the logits
    (softmax) or on sigmoid(logit) + bias[e] (sigmoid; bias (n_expert,), a 1-element placeholder for
    softmax); a NaN score counts as -inf, so non-finite logits still give k distinct experts (no kernel reads
    past a slot table). An expert's rank is the count of experts that beat it (`better`), counted over
    `parts` slices of the experts at once and summed: exact, so the ids never depend on the block's size.
    `ids` may be a shared array (`moe.make_moe_route` groups from it).

    weights[row] (k,) float32: the chosen experts' softmax probabilities over all n_expert logits (each warp
    sums the exps of 32 experts in `warp_sum`'s fixed butterfly, then one thread adds those sums in order) or
    their unbiased sigmoids; divided by their sum (in slot order) when `normalize`; times `scale`. Expert e is
    always lane e % 32 of the run e // 32, so the bits are the same for any `threads`: prefill's router and
    the decode routing launch agree bitwise.

    Why counting: one warp choosing k experts in k rounds of shuffles was one serial chain of about 1500
    instructions; here the comparisons are independent and a row waits on four barriers. Measured warm for one
    row of 128 experts (BENCHMARKS.md, runs 33-35): the warp 5.6 us, this block 7.8 us at 128 threads and 5.4 at
    512 (a thread's comparisons are a chain of shared-memory loads, ~19 ns each); the decode routing launch
    took 10.5 us a block in a step either way."""
    _check_router(n_expert, k, gating)
    score = _logit_score if gating == "softmax" else _biased_sigmoid_score
    softmax = gating == "softmax"
    parts = max(1, min(threads // n_expert, n_expert // MIN_ROUTER_SLICE))
    slice_len = -(-n_expert // parts)
    runs = -(-n_expert // WARP)                 # 32 experts each, one warp_sum
    rounds = -(-n_expert // threads)            # a thread's experts: t, t + threads, ...
    scale32 = np.float32(scale)

    @cuda.jit(device=True, inline=True)
    def _weight(logit, top, total):
        return np.float32(math.exp(logit - top)) / total if softmax else _sigmoid(logit)

    @cuda.jit(device=True, inline=True)
    def route(logits, bias, row, ids, weights):
        raw = cuda.shared.array(n_expert, np.float32)
        scores = cuda.shared.array(n_expert, np.float32)
        beaten = cuda.shared.array((parts, n_expert), np.int32)
        slice_top = cuda.shared.array(parts, np.float32)
        run_sums = cuda.shared.array(runs, np.float32)
        chosen = cuda.shared.array(k, np.int32)
        exps = cuda.local.array(1, np.float32)
        t = cuda.threadIdx.x
        for e in range(t, n_expert, threads):
            logit = logits[row, e]
            value = score(logit, bias, e)
            raw[e] = logit
            scores[e] = NEG_INF if value != value else value       # NaN ranks last, so ids stay a permutation
        cuda.syncthreads()
        for item in range(t, parts * n_expert, threads):
            part, e = item // n_expert, item % n_expert
            mine = scores[e]
            beats = 0
            top = NEG_INF
            for j in range(part * slice_len, min(n_expert, (part + 1) * slice_len)):
                other = scores[j]
                beats += better(other, j, mine, e)
                top = max(top, other)
            beaten[part, e] = beats
            if e == 0:
                slice_top[part] = top
        cuda.syncthreads()
        top = NEG_INF
        for part in range(parts):
            top = max(top, slice_top[part])     # the best score: for softmax, the largest finite logit
        for r in range(rounds):                 # every thread the same count: warp_sum needs every lane
            e = t + r * threads
            exps[0] = 0
            if e < n_expert:
                rank = 0
                for part in range(parts):
                    rank += beaten[part, e]
                if rank < k:
                    chosen[rank] = e
                if softmax:
                    exps[0] = np.float32(math.exp(raw[e] - top))
            if softmax:
                warp_sum(exps, 1)
                if e % WARP == 0 and e < n_expert:
                    run_sums[e // WARP] = exps[0]
        cuda.syncthreads()
        if t < k:
            total = np.float32(0)
            if softmax:
                for run in range(runs):
                    total += run_sums[run]
            expert = chosen[t]
            weight = _weight(raw[expert], top, total)
            if normalize:
                norm = np.float32(0)
                for slot in range(k):
                    norm += _weight(raw[chosen[slot]], top, total)
                weight = weight / norm
            ids[row, t] = expert
            weights[row, t] = weight * scale32
        cuda.syncthreads()

    return route


@functools.cache
def make_router(n_expert: int, k: int, gating: str, normalize: bool, scale: float):
    """launch(stream, logits, bias, ids, weights): ids (rows, k) int32 and weights (rows, k) float32, each
    row's `block_router` on its own block, a thread an expert."""
    threads = _threads(n_expert, MAX_ROUTER_EXPERTS)
    route = block_router(n_expert, k, gating, normalize, scale, threads)

    @overlapping
    @cuda.jit
    def kernel(logits, bias, ids, weights):
        begin_after_prior_grids()
        route(logits, bias, cuda.blockIdx.x, ids, weights)

    return _per_row(kernel, threads)


# ---------------------------------------------------------------------------------------------------------
# argmax


@cuda.jit(device=True, inline=True)
def _argmax_step(logits, row, first, threads, n, checked, loaded, best, best_index):
    """A thread's next ARGMAX_UNROLL elements, first + u * threads: all loaded, then compared in index order
    (so `>` keeps the first of equal values). The index is cast unsigned: no negative-index wraparound."""
    for u in range(ARGMAX_UNROLL):
        j = first + u * threads
        loaded[u] = logits[row, np.uint64(j)] if not checked or j < n else NEG_INF
    for u in range(ARGMAX_UNROLL):
        if loaded[u] > best:
            best, best_index = loaded[u], np.int32(first + u * threads)
    return best, best_index


@functools.cache
def make_argmax_partials(n: int):
    """launch(stream, logits, partials): partials f32 (rows, argmax_blocks(n), 2), each block's (maximum, its
    first index) of ARGMAX_BLOCK_VALUES consecutive logits of a row: a block per (row, run), each thread
    ARGMAX_UNROLL coalesced loads in flight, then a fixed tree picks the best (value, lowest index). Its runs
    spread a row over the GPU: one block a row read Qwen3's 151936 logits in 9.8 us (BENCHMARKS.md run 31). A run
    of -inf still gets a real index, its first."""
    if n >= 1 << 24:
        raise ValueError(f"argmax over {n} values: the partials hold indices as float32, exact below 2**24")
    blocks = argmax_blocks(n)
    checked = n % ARGMAX_BLOCK_VALUES != 0       # the last run is partial: its loads are bounds checked

    @overlapping
    @cuda.jit
    def kernel(logits, partials):
        begin_after_prior_grids()
        row, run = cuda.blockIdx.x // blocks, cuda.blockIdx.x % blocks
        tid = cuda.threadIdx.x
        values = cuda.shared.array(ARGMAX_THREADS, np.float32)
        indices = cuda.shared.array(ARGMAX_THREADS, np.int32)
        loaded = cuda.local.array(ARGMAX_UNROLL, np.float32)
        first = run * ARGMAX_BLOCK_VALUES + tid
        best, best_index = _argmax_step(logits, row, first, ARGMAX_THREADS, n, checked and run == blocks - 1,
                                        loaded, NEG_INF, np.int32(first))
        values[tid], indices[tid] = best, best_index
        _best_tree(values, indices, tid, ARGMAX_THREADS)
        if tid == 0:
            partials[row, run, 0] = values[0]
            partials[row, run, 1] = np.float32(indices[0])

    return _per_row(kernel, ARGMAX_THREADS, blocks)


@functools.cache
def make_argmax(n: int):
    """launch(stream, partials, ids, host_ids=None): ids (rows,) int32, the first index of each row's maximum,
    from `make_argmax_partials`' runs by the same fixed tree (ties go to the lower index, so to the earlier
    run), a block a row; the ids also go to `host_ids` (mapped host memory, where the runtime reads a window's
    greedy tokens: no copy node after the step)."""
    blocks = argmax_blocks(n)
    threads = _threads(blocks, ARGMAX_FINAL_THREADS)
    if blocks > threads:
        raise ValueError(f"argmax over {n} values: {blocks} runs, more than one block of {threads} merges")

    @overlapping
    @cuda.jit
    def kernel(partials, ids, host_ids):
        begin_after_prior_grids()
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        values = cuda.shared.array(threads, np.float32)
        indices = cuda.shared.array(threads, np.int32)
        values[tid], indices[tid] = NEG_INF, np.int32(n)     # past the runs: loses every tie
        if tid < blocks:
            values[tid], indices[tid] = partials[row, tid, 0], np.int32(partials[row, tid, 1])
        _best_tree(values, indices, tid, threads)
        if tid == 0:
            ids[row] = indices[0]
            host_ids[row] = indices[0]

    def launch(stream, partials, ids, host_ids=None):
        launch_kernel(kernel, partials.shape[0], threads, stream, partials, ids, ids if host_ids is None else host_ids)
    return launch
