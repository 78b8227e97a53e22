"""Pointwise and routing kernels: embedding, RMSNorm (whole rows and per head), NEOX RoPE, residual adds,
concat, router top-k and route weights, argmax.

Every kernel gives each row (or each row's head) its own block, or its own threads for the elementwise ones,
so a row's result never depends on how many rows the launch holds; the reductions (sum of squares, softmax
max and sum, argmax) add each thread's elements in index order, then combine the threads through shared
memory in one fixed tree. Block sizes are powers of two chosen from the constants alone.
"""

import functools
import math

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.lower.cuda import bits_to_f32, cuda

WARP = 32
ELEMENTWISE_THREADS = 256
EMBED_THREADS = 128
NORM_THREADS = 256       # at most, per row (or head) of an RMSNorm
ROPE_THREADS = 128       # at least one head's pairs; more heads per pass when a head has fewer pairs
ROUTER_THREADS = 1024    # at most, per router row
ARGMAX_THREADS = 1024    # at most, per argmax row
ARGMAX_UNROLL = 16       # independent loads in flight per thread and pass
ARGMAX_MIN_LOADS = 4     # fewer threads (down to a warp) for short rows: at least this many passes' worth each

GATINGS = ("softmax", "sigmoid")
NEG_INF = np.float32(-np.inf)


def _threads(count: int, cap: int) -> int:
    """A block for `count` items: the smallest power of two >= count, at least a warp, at most `cap`."""
    threads = WARP
    while threads < min(count, cap):
        threads *= 2
    return threads


def _router_threads(n_expert: int, k: int, gating: str) -> int:
    if gating not in GATINGS:
        raise ValueError(f"unknown gating {gating!r}; expected one of {GATINGS}")
    if not 0 < k <= n_expert:
        raise ValueError(f"top {k} of {n_expert} experts")
    return _threads(n_expert, ROUTER_THREADS)


def _per_row(kernel, threads: int, blocks_per_row: int = 1):
    """launch(stream, *arrays): `kernel` over `blocks_per_row` blocks for each row of the first array."""
    def launch(stream, *arrays):
        kernel[arrays[0].shape[0] * blocks_per_row, threads, stream](*arrays)
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
def _better(value, index, best, best_index):
    """Whether (value, index) beats (best, best_index): larger, or equal at a lower index."""
    return value > best or (value == best and index < best_index)


@cuda.jit(device=True, inline=True)
def _best_tree(values, indices, tid, threads):
    """Leaves the largest of values[:threads] and its lowest index in values[0], indices[0]."""
    stride = threads // 2
    while stride > 0:
        cuda.syncthreads()
        if tid < stride and _better(values[tid + stride], indices[tid + stride], values[tid], indices[tid]):
            values[tid] = values[tid + stride]
            indices[tid] = indices[tid + stride]
        stride //= 2
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _sigmoid(x):
    return np.float32(1) / (np.float32(1) + np.float32(math.exp(-x)))


# ---------------------------------------------------------------------------------------------------------
# embedding


@cuda.jit(device=True, inline=True)
def _float_value(stored):
    return np.float32(stored)


@cuda.jit(device=True, inline=True)
def _bf16_value(stored):
    signed = (np.int32(stored) ^ np.int32(0x8000)) - np.int32(0x8000)     # the high half, as a signed int16
    return bits_to_f32(np.int32(signed * np.int32(0x10000)))


@cuda.jit(device=True, inline=True)
def _byte(word, i):
    return (word >> (8 * i)) & 0xFF


@cuda.jit(device=True, inline=True)
def _q8_0_word(out, row, w, word, scale):
    """Word w of a Q8_0 row: elements 4w..4w+3, signed bytes."""
    for i in range(4):
        byte = _byte(word, i)
        out[row, 4 * w + i] = scale * np.float32(byte - ((byte & 0x80) << 1))


@cuda.jit(device=True, inline=True)
def _q4_0_word(out, row, w, word, scale):
    """Word w of a Q4_0 row: bytes 4(w % 4)..+3 of block w // 4; byte j holds element j (low nibble) and
    j + 16 (high), stored value + 8."""
    first = (w // 4) * 32 + (w % 4) * 4
    for i in range(4):
        byte = _byte(word, i)
        out[row, first + i] = scale * np.float32((byte & 0xF) - 8)
        out[row, first + 16 + i] = scale * np.float32((byte >> 4) - 8)


_QUANT_WORDS = {T.Q8_0: (8, _q8_0_word), T.Q4_0: (4, _q4_0_word)}     # 32-bit words per block, their writer


@functools.cache
def make_embed(ggml_type, n_embd: int):
    """launch(stream, ids, table, out): out[r] = the dequantized row ids[r] of `table` (a DeviceWeight of
    F32/F16/BF16/Q8_0/Q4_0, (n_vocab, n_embd)), exactly `weights.dequantize`'s values (all exact in float32).
    Quants are read as 32-bit words, one word a thread per step."""
    ggml_type = T(ggml_type)
    threads = EMBED_THREADS
    if ggml_type in (T.F32, T.F16, T.BF16):
        value = _bf16_value if ggml_type == T.BF16 else _float_value

        @cuda.jit
        def float_kernel(ids, table, out):
            row = cuda.blockIdx.x
            token = ids[row]
            for j in range(cuda.threadIdx.x, n_embd, threads):
                out[row, j] = value(table[token, j])

        def launch(stream, ids, table, out):
            float_kernel[ids.shape[0], threads, stream](ids, table.data, out)
        return launch

    if ggml_type not in _QUANT_WORDS:
        raise ValueError(f"no embedding kernel for {ggml_type.name}")
    words_per_block, write_word = _QUANT_WORDS[ggml_type]
    words_per_row = n_embd // 32 * words_per_block

    @cuda.jit
    def quant_kernel(ids, words, scales, out):
        row = cuda.blockIdx.x
        token = ids[row]
        for w in range(cuda.threadIdx.x, words_per_row, threads):
            write_word(out, row, w, words[token, w], np.float32(scales[token, w // words_per_block]))

    def launch(stream, ids, table, out):
        quant_kernel[ids.shape[0], threads, stream](ids, table.data.view(np.int32), table.scales, out)
    return launch


# ---------------------------------------------------------------------------------------------------------
# RMSNorm


@functools.cache
def _make_norm(n_segments: int, length: int, eps: float):
    """RMSNorm of each of a row's `n_segments` runs of `length` values, one block per run."""
    threads = _threads(length, NORM_THREADS)
    per_thread = -(-length // threads)
    eps32, length32 = np.float32(eps), np.float32(length)

    @cuda.jit
    def kernel(x, weight, out):
        block = cuda.blockIdx.x
        row = block // n_segments
        first = (block % n_segments) * length
        tid = cuda.threadIdx.x
        partial = cuda.shared.array(threads, np.float32)
        values = cuda.local.array(per_thread, np.float32)
        total = np.float32(0)
        for u in range(per_thread):
            j = tid + u * threads
            v = x[row, first + j] if j < length else np.float32(0)
            values[u] = v
            total += v * v
        partial[tid] = total
        scale = np.float32(1) / np.float32(math.sqrt(_sum_tree(partial, tid, threads) / length32 + eps32))
        for u in range(per_thread):
            j = tid + u * threads
            if j < length:
                out[row, first + j] = values[u] * scale * weight[j]

    return _per_row(kernel, threads, n_segments)


def make_rmsnorm(n: int, eps: float):
    """launch(stream, x, weight, out): out = x / sqrt(mean(x^2) + eps) * weight per row; out may be x."""
    return _make_norm(1, n, eps)


def make_head_rmsnorm(n_heads: int, head_dim: int, eps: float):
    """launch(stream, x, weight, out): RMSNorm of each head of rows (rows, n_heads * head_dim), one weight
    (head_dim,) for every head; out may be x."""
    return _make_norm(n_heads, head_dim, eps)


# ---------------------------------------------------------------------------------------------------------
# RoPE


@functools.cache
def make_rope(n_heads: int, head_dim: int, n_rot: int, base: float):
    """launch(stream, x, positions): NEOX RoPE in place on x (rows, n_heads * head_dim) at int32 positions
    (rows,): pairs (i, i + n_rot/2) of each head, theta = pos * base^(-2i/n_rot) and its cos/sin in float64,
    the rotation in float32; dims >= n_rot untouched."""
    if n_rot % 2 or not 0 < n_rot <= head_dim:
        raise ValueError(f"n_rot {n_rot} must be even and within the head ({head_dim})")
    half = n_rot // 2
    inv_freq = base ** (-2.0 * np.arange(half) / n_rot)      # float64, as the reference computes it
    heads_per_pass = max(1, ROPE_THREADS // half)
    threads = half * heads_per_pass

    @cuda.jit
    def kernel(x, positions):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        i = tid % half
        theta = np.float64(positions[row]) * cuda.const.array_like(inv_freq)[i]
        cos, sin = np.float32(math.cos(theta)), np.float32(math.sin(theta))
        for head in range(tid // half, n_heads, heads_per_pass):
            a = head * head_dim + i
            x0, x1 = x[row, a], x[row, a + half]
            x[row, a] = x0 * cos - x1 * sin
            x[row, a + half] = x0 * sin + x1 * cos

    return _per_row(kernel, threads)


# ---------------------------------------------------------------------------------------------------------
# residual adds and concat


def _elementwise_blocks(rows: int, width: int) -> int:
    return -(-rows * width // ELEMENTWISE_THREADS)


@functools.cache
def make_add(n: int, n_addends: int):
    """launch(stream, x, *addends): x += a (+ b) in place, rows (rows, n), added in that order."""
    if n_addends not in (1, 2):
        raise ValueError(f"an add takes 1 or 2 addends, not {n_addends}")
    two = n_addends == 2

    @cuda.jit
    def kernel(x, a, b):
        i = cuda.grid(1)
        row, col = i // n, i % n
        if row < x.shape[0]:
            total = x[row, col] + a[row, col]
            if two:
                total += b[row, col]
            x[row, col] = total

    def launch(stream, x, *addends):
        kernel[_elementwise_blocks(x.shape[0], n), ELEMENTWISE_THREADS, stream](x, addends[0], addends[-1])
    return launch


@functools.cache
def make_concat(n_a: int, n_b: int):
    """launch(stream, a, b, out): out (rows, n_a + n_b) = [a ; b] per row."""
    width = n_a + n_b

    @cuda.jit
    def kernel(a, b, out):
        i = cuda.grid(1)
        row, col = i // width, i % width
        if row < out.shape[0]:
            out[row, col] = a[row, col] if col < n_a else b[row, col - n_a]

    def launch(stream, a, b, out):
        kernel[_elementwise_blocks(out.shape[0], width), ELEMENTWISE_THREADS, stream](a, b, out)
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
def make_topk(n_expert: int, k: int, gating: str):
    """launch(stream, logits, bias, ids): ids (rows, k) int32, the k best experts of each row best first,
    ties to the lower index; selected on the logits (softmax) or on sigmoid(logit) + bias[e] (sigmoid; bias
    (n_expert,), a 1-element placeholder for softmax). Each expert's rank is the number of experts that beat
    it, so the order is exact and independent of the block's shape."""
    threads = _router_threads(n_expert, k, gating)
    score = _logit_score if gating == "softmax" else _biased_sigmoid_score

    @cuda.jit
    def kernel(logits, bias, ids):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        scores = cuda.shared.array(n_expert, np.float32)
        for e in range(tid, n_expert, threads):
            scores[e] = score(logits[row, e], bias, e)
        cuda.syncthreads()
        for e in range(tid, n_expert, threads):
            mine = scores[e]
            rank = 0
            for other in range(n_expert):
                if _better(scores[other], other, mine, e):
                    rank += 1
            if rank < k:
                ids[row, rank] = e

    return _per_row(kernel, threads)


@functools.cache
def make_route_weights(n_expert: int, k: int, gating: str, normalize: bool, scale: float):
    """launch(stream, logits, ids, weights): weights (rows, k) of the chosen experts ids (rows, k): their
    softmax probabilities over all n_expert logits (softmax) or unbiased sigmoids (sigmoid); divided by their
    sum (in slot order) when `normalize`; times `scale`."""
    threads = _router_threads(n_expert, k, gating)
    softmax = gating == "softmax"
    scale32 = np.float32(scale)

    @cuda.jit
    def kernel(logits, ids, weights):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        chosen = cuda.shared.array(k, np.float32)
        maxima = cuda.shared.array(threads, np.float32)
        where = cuda.shared.array(threads, np.int32)
        sums = cuda.shared.array(threads, np.float32)
        top, total = np.float32(0), np.float32(1)
        if softmax:
            best, best_index = NEG_INF, n_expert
            for e in range(tid, n_expert, threads):
                if _better(logits[row, e], e, best, best_index):
                    best, best_index = logits[row, e], e
            maxima[tid], where[tid] = best, best_index
            _best_tree(maxima, where, tid, threads)
            top = maxima[0]
            partial = np.float32(0)
            for e in range(tid, n_expert, threads):
                partial += np.float32(math.exp(logits[row, e] - top))
            sums[tid] = partial
            total = _sum_tree(sums, tid, threads)
        for slot in range(tid, k, threads):
            logit = logits[row, ids[row, slot]]
            if softmax:
                chosen[slot] = np.float32(math.exp(logit - top)) / total
            else:
                chosen[slot] = _sigmoid(logit)
        cuda.syncthreads()
        for slot in range(tid, k, threads):
            weight = chosen[slot]
            if normalize:
                norm = np.float32(0)
                for j in range(k):
                    norm += chosen[j]
                weight = weight / norm
            weights[row, slot] = weight * scale32

    return _per_row(kernel, threads)


# ---------------------------------------------------------------------------------------------------------
# argmax


@functools.cache
def make_argmax(n: int):
    """launch(stream, logits, ids): ids (rows,) int32, the first index of each row's maximum. One block per
    row; each thread keeps ARGMAX_UNROLL coalesced loads in flight per pass, then a fixed tree picks the best
    (value, lowest index)."""
    threads = _threads(-(-n // (ARGMAX_UNROLL * ARGMAX_MIN_LOADS)), ARGMAX_THREADS)
    span = threads * ARGMAX_UNROLL
    passes = -(-n // span)

    @cuda.jit
    def kernel(logits, ids):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        values = cuda.shared.array(threads, np.float32)
        indices = cuda.shared.array(threads, np.int32)
        loaded = cuda.local.array(ARGMAX_UNROLL, np.float32)
        best, best_index = NEG_INF, n
        for p in range(passes):
            for u in range(ARGMAX_UNROLL):
                j = p * span + u * threads + tid
                loaded[u] = logits[row, j] if j < n else NEG_INF
            for u in range(ARGMAX_UNROLL):
                j = p * span + u * threads + tid
                if _better(loaded[u], j, best, best_index):
                    best, best_index = loaded[u], j
        values[tid], indices[tid] = best, best_index
        _best_tree(values, indices, tid, threads)
        if tid == 0:
            ids[row] = indices[0]

    return _per_row(kernel, threads)
