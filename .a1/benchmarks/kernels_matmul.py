"""Matmul kernels on the GPU: numbered versions of the decode GEMV and the prefill GEMM (llm.c dev/cuda style,
each checked against the float64 reference and timed), then the production kernels of
`codegen.lower.matmul` / `codegen.lower.moe` against the ceilings `runtime.ceilings` measures in the same run.

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/kernels_matmul.py [SECTION ...] [--types Q8_0,Q4_K]
        [--shapes 12288x4096,4096x12288]

(sections: every one by default; --types and --shapes narrow the decode table, n_out x n_in)

Timing: kernels are captured into a CUDA graph (as the runtime replays a decode step) and the graph replayed,
so a figure is the kernel plus its ~1 us graph node, not Python's launch cost; each launch in the graph reads
its own copy of the weights, enough copies to cycle >= 256 MB, so the 50 MB L2 holds none of them.
Decode bytes = weights (quants + scales) + activations in and out; prefill FLOPs = 2 * rows * n_in * n_out.

Tensor cores (not used here: numba exposes no mma): prefill is compute-bound from chunk ~64 on, and the H200's
dense TF32 mma peaks near 495 TFLOP/s, BF16 near 990, against ~67 for FP32 FMA. Q8_0/Q4_0 quants (and the
f16 scale's exponent aside, nothing else) are exact in TF32 and BF16, so a quantized GEMM can run the mma on
the raw quants of each 32-wide block and apply the block's f16 scale in FP32 afterwards; only the float32
activations lose bits, which a split x = x_hi + x_lo (two TF32 mmas per block) restores to FP32 accuracy, the
1e-5 the tests hold: about 3x the FP32 peak in practice, 6-7x for single TF32 where 1e-3 would do. numba
reaches them by linking CUDA C++: `cuda.jit(link=["mma.cu"])` with a `__device__` function holding
`mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32` (or a CUTLASS wgmma kernel with TMA loads, Hopper's
full rate), declared with `cuda.declare_device`; kept behind `codegen/lower/cuda.py`, which would give the
simulator a numpy version of the same fragment so CI still runs every kernel.
"""

import argparse

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from runtime.ceilings import (fp32_peak_flops, graph_seconds, l2_defeating_copies, read_bandwidth_bytes_per_s,
                              read_seconds)
from codegen.cost import measured_tile_rows_per_pair
from codegen.graph import moe_groups_length
from codegen.lower import matmul, matmul_decode, moe, weights
from codegen.lower.cuda import cuda, device_name
from codegen.lower.word_formats import FORMATS
from runtime import reference
from runtime.synthetic import random_packed

MIN_LAUNCHES = 8                # launches per timed graph, at least
DECODE_TYPES = (T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K)
DECODE_SHAPES = [(2048, 768), (768, 2048), (4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]
LARGE = 4096 * 4096             # weights of at least this many values are "large" (the >= 70% target)
PREFILL_SHAPES = [(4096, 4096), (2048, 768)]
CHUNKS = [512, 2048, 8192]
MOE_PREFILL_CHUNKS = [512, 2048, 4096]
QWEN3_30B = dict(n_embd=2048, n_ff=768, n_expert=128, k=8)
CHECK_ROWS = 64                 # output columns (decode) / rows (prefill) checked against float64


# ---------------------------------------------------------------------------------------------------------
# timing and data


def launches(enqueue, count: int) -> list:
    """enqueue(stream, i) for i < count, as the list `graph_seconds` captures (launch i reads copy i)."""
    return [lambda stream, i=i: enqueue(stream, i) for i in range(count)]


def rows_of(packed, index) -> np.ndarray:
    """float64 values of the selected output rows of a 2-D packed weight."""
    scales = None if packed.scales is None else packed.scales[index]
    part = weights.PackedWeight(packed.ggml_type, (len(index), packed.shape[1]), packed.data[index], scales)
    return weights.dequantize(part)


def rel_err(got, ref) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def table(title, header, rows):
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


# ---------------------------------------------------------------------------------------------------------
# decode versions: one token through a Q8_0 (n_out, n_in) matrix; q int8 (n_out, n_in), s f16 (n_out, n_in/32)

V_WARPS = 8


@cuda.jit
def _gemv_v1(x, q, s, out):
    """v1: a thread per output row, walking its row one int8 at a time (uncoalesced), int -> float converts."""
    n = cuda.grid(1)
    if n < q.shape[0]:
        acc = np.float32(0)
        for k in range(q.shape[1]):
            acc += np.float32(s[n, k // 32]) * np.float32(q[n, k]) * x[0, k]
        out[0, n] = acc


@cuda.jit(device=True, inline=True)
def _warp_sum(red, w, lane, acc):
    red[w, lane] = acc
    for level in range(5):
        cuda.syncthreads()
        if lane < (16 >> level):
            red[w, lane] += red[w, lane + (16 >> level)]
    cuda.syncthreads()
    return red[w, 0]


@cuda.jit(device=True, inline=True)
def _warp_row(n_out):
    """(warp, lane, row, row clamped to the matrix): a warp per output row."""
    w, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    row = cuda.blockIdx.x * V_WARPS + w
    return w, lane, row, min(row, n_out - 1)


@cuda.jit(device=True, inline=True)
def _store_row(red, w, lane, acc, row, n, out):
    total = _warp_sum(red, w, lane, acc)
    if lane == 0 and row == n:
        out[0, n] = total


@cuda.jit(device=True, inline=True)
def _byte(word, v):
    """Signed byte v of a word, by arithmetic that holds at any integer width (numba widens int32 shifts)."""
    return (((word >> np.int32(8 * v)) & np.int32(0xFF)) ^ np.int32(0x80)) - np.int32(0x80)


def _warp_per_row(word_loads: bool):
    """v2 (byte loads) and v3 (word loads): the same warp-per-row kernel but for how a lane reads quants."""
    @cuda.jit
    def kernel(x, q, s, out):
        red = cuda.shared.array((V_WARPS, 32), np.float32)
        w, lane, row, n = _warp_row(q.shape[0])
        acc = np.float32(0)
        if word_loads:      # q: int32 words, 4 quants each; the block's scale once per word
            for wi in range(lane, q.shape[1], 32):
                p = np.float32(0)
                for v in range(4):
                    p += np.float32(_byte(q[n, wi], v)) * x[0, 4 * wi + v]
                acc += np.float32(s[n, wi // 8]) * p
        else:               # q: int8, lanes on consecutive bytes
            for k in range(lane, q.shape[1], 32):
                acc += np.float32(s[n, k // 32]) * np.float32(q[n, k]) * x[0, k]
        _store_row(red, w, lane, acc, row, n, out)
    return kernel


_gemv_v2, _gemv_v3 = _warp_per_row(False), _warp_per_row(True)


V4_ROWS, V4_FLIGHT = 2, 4


@cuda.jit
def _gemv_v4(x, q32, s, out):
    """v4: v3 with two rows per warp sharing each activation load and 4 words per row in flight per lane
    (loads issued together, unrolled), still int -> float converts."""
    red = cuda.shared.array((V_WARPS, 32), np.float32)
    w, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    n0 = (cuda.blockIdx.x * V_WARPS + w) * V4_ROWS
    n_out, words = q32.shape
    acc = cuda.local.array(V4_ROWS, np.float32)
    held = cuda.local.array((V4_FLIGHT, V4_ROWS), np.int32)
    for i in range(V4_ROWS):
        acc[i] = np.float32(0)
    for base in range(0, words, 32 * V4_FLIGHT):
        for f in range(V4_FLIGHT):
            for i in range(V4_ROWS):
                held[f, i] = q32[min(n0 + i, n_out - 1), min(base + f * 32 + lane, words - 1)]
        for f in range(V4_FLIGHT):
            wi = base + f * 32 + lane
            if wi < words:
                xs = cuda.local.array(4, np.float32)
                for v in range(4):
                    xs[v] = x[0, 4 * wi + v]
                for i in range(V4_ROWS):
                    p = np.float32(0)
                    for v in range(4):
                        p += np.float32(_byte(held[f, i], v)) * xs[v]
                    acc[i] += np.float32(s[min(n0 + i, n_out - 1), wi // 8]) * p
    for i in range(V4_ROWS):
        total = _warp_sum(red, w, lane, acc[i])
        if lane == 0 and n0 + i < n_out:
            out[0, n0 + i] = total


def decode_versions(rng, bandwidth):
    n_out, n_in = 12288, 4096
    packed = random_packed((n_out, n_in), T.Q8_0, rng)
    copies = l2_defeating_copies(packed.nbytes)
    device = [weights.upload(packed) for _ in range(copies)]
    x = cuda.to_device(rng.standard_normal((1, n_in), dtype=np.float32))
    out = cuda.device_array((1, n_out), np.float32)
    check = np.r_[0:CHECK_ROWS // 2, n_out - CHECK_ROWS // 2:n_out]
    ref = x.copy_to_host().astype(np.float64) @ rows_of(packed, check).T
    production = matmul.make_matmul("decode", T.Q8_0, n_in, n_out, False)
    placeholder = cuda.to_device(np.zeros(1, np.float32))
    blocks = -(-n_out // V_WARPS)
    versions = [
        ("v1", "thread per output row, byte loads, int->float", lambda s, d: _gemv_v1[-(-n_out // 128), 128, s](
            x, d.data, d.scales, out)),
        ("v2", "warp per row: coalesced byte loads, shared-memory tree", lambda s, d: _gemv_v2[blocks, 256, s](
            x, d.data, d.scales, out)),
        ("v3", "32-bit word loads, one scale per word", lambda s, d: _gemv_v3[blocks, 256, s](
            x, d.data.view(np.int32), d.scales, out)),
        ("v4", "2 rows per warp share x, 4 words in flight per lane", lambda s, d: _gemv_v4[
            -(-n_out // (V_WARPS * V4_ROWS)), 256, s](x, d.data.view(np.int32), d.scales, out)),
        ("v5", "production: float-trick dequant (no int->float), group size from the work",
         lambda s, d: production(s, x, d, placeholder, out)),
    ]
    nbytes = packed.nbytes + 4 * (n_in + n_out)
    rows = []
    for name, change, run in versions:
        seconds = graph_seconds(launches(lambda s, i: run(s, device[i % copies]), max(copies, MIN_LAUNCHES)))
        run(0, device[0])
        err = rel_err(out.copy_to_host()[:, check], ref)
        rows.append((name, change, f"{seconds * 1e6:.1f}", f"{nbytes / seconds / 1e9:.0f}",
                     f"{nbytes / seconds / bandwidth:.0%}", f"{err:.1e}"))
    table(f"Decode GEMV versions: one token, Q8_0 {n_out} x {n_in} ({nbytes / 1e6:.1f} MB)",
          ["version", "change", "us", "GB/s", "of read BW", "rel err"], rows)


# ---------------------------------------------------------------------------------------------------------
# prefill versions: F32 (n_out, n_in) weights, a chunk of rows


@cuda.jit
def _gemm_v1(x, w, out):
    """v1: a thread per output, both operands from global memory."""
    n, r = cuda.grid(2)
    if r < x.shape[0] and n < w.shape[0]:
        acc = np.float32(0)
        for k in range(x.shape[1]):
            acc += x[r, k] * w[n, k]
        out[r, n] = acc


S_TILE = 32
S_SHAPE = (S_TILE, S_TILE + 1)      # padded: column reads hit 32 banks


@cuda.jit
def _gemm_v2(x, w, out):
    """v2: 32 x 32 output tiles, a thread per output, k in 32-wide steps through shared memory."""
    xs = cuda.shared.array(S_SHAPE, np.float32)
    ws = cuda.shared.array(S_SHAPE, np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    n, r = cuda.blockIdx.x * S_TILE + tx, cuda.blockIdx.y * S_TILE + ty
    rows, n_out = x.shape[0], w.shape[0]
    acc = np.float32(0)
    for k0 in range(0, x.shape[1], S_TILE):
        xs[ty, tx] = x[r, k0 + tx] if r < rows else np.float32(0)
        ws[ty, tx] = w[min(cuda.blockIdx.x * S_TILE + ty, n_out - 1), k0 + tx]
        cuda.syncthreads()
        for kk in range(S_TILE):
            acc += xs[ty, kk] * ws[tx, kk]
        cuda.syncthreads()
    if r < rows and n < n_out:
        out[r, n] = acc


R_TILE, R_K = 128, 8


@cuda.jit
def _gemm_v3(x, w, out):
    """v3: 128 x 128 tiles, each thread an 8 x 8 register tile (rows ty + 16 i, columns tx + 16 j), scalar
    shared loads, one shared buffer."""
    xs = cuda.shared.array((R_K, R_TILE), np.float32)
    ws = cuda.shared.array((R_K, R_TILE), np.float32)
    t = cuda.threadIdx.x
    tx, ty = t % 16, t // 16
    r0, n0 = cuda.blockIdx.y * R_TILE, cuda.blockIdx.x * R_TILE
    rows, n_out = x.shape[0], w.shape[0]
    acc = cuda.local.array((8, 8), np.float32)
    a = cuda.local.array(8, np.float32)
    b = cuda.local.array(8, np.float32)
    for i in range(8):
        for j in range(8):
            acc[i, j] = np.float32(0)
    for k0 in range(0, x.shape[1], R_K):
        for l in range(R_TILE * R_K // 256):
            rr, kk = (l * 256 + t) // R_K, t % R_K
            xs[kk, rr] = x[r0 + rr, k0 + kk] if r0 + rr < rows else np.float32(0)
            ws[kk, rr] = w[min(n0 + rr, n_out - 1), k0 + kk]
        cuda.syncthreads()
        for kk in range(R_K):
            for i in range(8):
                a[i] = xs[kk, ty + 16 * i]
                b[i] = ws[kk, tx + 16 * i]
            for i in range(8):
                for j in range(8):
                    acc[i, j] += a[i] * b[j]
        cuda.syncthreads()
    for i in range(8):
        for j in range(8):
            if r0 + ty + 16 * i < rows and n0 + tx + 16 * j < n_out:
                out[r0 + ty + 16 * i, n0 + tx + 16 * j] = acc[i, j]


def prefill_versions(rng, peak):
    n_out, n_in, rows = 4096, 4096, 2048
    packed = random_packed((n_out, n_in), T.F32, rng)
    w = weights.upload(packed)
    x = cuda.to_device(rng.standard_normal((rows, n_in), dtype=np.float32))
    out = cuda.device_array((rows, n_out), np.float32)
    check = np.r_[0:CHECK_ROWS // 2, rows - CHECK_ROWS // 2:rows]
    ref = x.copy_to_host()[check].astype(np.float64) @ packed.data.astype(np.float64).T
    production = matmul.make_matmul("prefill", T.F32, n_in, n_out, False)
    placeholder = cuda.to_device(np.zeros(1, np.float32))
    versions = [
        ("v1", "thread per output, global loads", lambda s: _gemm_v1[(n_out // 16, rows // 16), (16, 16), s](
            x, w.data, out)),
        ("v2", "32 x 32 shared-memory tiles", lambda s: _gemm_v2[(n_out // S_TILE, rows // S_TILE), (S_TILE, S_TILE),
                                                                 s](x, w.data, out)),
        ("v3", "128 x 128 tiles, 8 x 8 register tile per thread", lambda s: _gemm_v3[
            (n_out // R_TILE, rows // R_TILE), 256, s](x, w.data, out)),
        ("v4", "production: 16-byte aligned tiles read as float4, double buffer, dequant on load",
         lambda s: production(s, x, w, placeholder, out)),
    ]
    flops = 2.0 * rows * n_in * n_out
    table_rows = []
    for name, change, run in versions:
        seconds = graph_seconds(launches(lambda s, i: run(s), 1), repeats=5)
        run(0)
        err = rel_err(out.copy_to_host()[check], ref)
        table_rows.append((name, change, f"{seconds * 1e3:.2f}", f"{flops / seconds / 1e12:.1f}",
                           f"{flops / seconds / peak:.0%}", f"{err:.1e}"))
    table(f"Prefill GEMM versions: F32 {n_out} x {n_in}, chunk {rows}",
          ["version", "change", "ms", "TFLOP/s", "of FMA peak", "rel err"], table_rows)


# ---------------------------------------------------------------------------------------------------------
# production kernels


def decode_table(rng, bandwidth, types=DECODE_TYPES, shapes=DECODE_SHAPES):
    def timed_rows():       # each row printed as it is timed: a run cut short keeps what it measured
        for ggml_type in types:
            for n_out, n_in in shapes:
                packed = random_packed((n_out, n_in), ggml_type, rng)
                copies = l2_defeating_copies(packed.nbytes)
                device = [weights.upload(packed) for _ in range(copies)]
                launch = matmul.make_matmul("decode", ggml_type, n_in, n_out, False)
                placeholder = cuda.to_device(np.zeros(1, np.float32))
                check = np.r_[0:CHECK_ROWS // 2, n_out - CHECK_ROWS // 2:n_out]
                reference_rows = rows_of(packed, check)
                figures = []
                for window in (1, 8):
                    x = cuda.to_device(rng.standard_normal((window, n_in), dtype=np.float32))
                    out = cuda.device_array((window, n_out), np.float32)
                    seconds = graph_seconds(launches(lambda s, i: launch(s, x, device[i % copies], placeholder, out),
                                            max(copies, MIN_LAUNCHES)))
                    nbytes = packed.nbytes + 4 * window * (n_in + n_out)
                    err = rel_err(out.copy_to_host()[:, check], x.copy_to_host().astype(np.float64) @ reference_rows.T)
                    figures.append((seconds, nbytes, err))
                (s1, b1, e1), (s8, _, e8) = figures
                read_s = read_seconds(b1)
                large = "yes" if n_out * n_in >= LARGE else ""
                yield (ggml_type.name, f"{n_out} x {n_in}", f"{b1 / 1e6:.1f}", f"{s1 * 1e6:.1f}",
                       f"{b1 / s1 / 1e9:.0f}", f"{b1 / s1 / bandwidth:.0%}", large, f"{read_s * 1e6:.1f}",
                       f"{read_s / s1:.0%}", f"{s8 * 1e6:.1f}", f"{max(e1, e8):.1e}")
    table("Decode matmul (production), one token; a plain read of the same bytes (its ramp and drain included) "
          "and an 8-row window alongside",
          ["type", "n_out x n_in", "MB", "us", "GB/s", "of read BW", "large", "read us", "of same-size read",
           "8 rows us", "rel err"], timed_rows())


def decode_sweep(rng, bandwidth):
    """The decode kernel's free parameters (lanes per row group, rows per group, chunks in flight) at one
    token, Q8_0, beside the choice `matmul_decode.decode_shape` makes."""
    rows = []
    fmt = FORMATS[T.Q8_0]
    placeholder = cuda.to_device(np.zeros(1, np.float32))
    for n_out, n_in in [(4096, 4096), (12288, 4096), (151936, 4096)]:
        packed = random_packed((n_out, n_in), T.Q8_0, rng)
        copies = l2_defeating_copies(packed.nbytes)
        device = [matmul.words(weights.upload(packed)) for _ in range(copies)]
        x = cuda.to_device(rng.standard_normal((1, n_in), dtype=np.float32))
        out = cuda.device_array((1, n_out), np.float32)
        chosen = matmul_decode.decode_shape(fmt, n_in, n_out, 1)
        for tg, nr, unroll in [(t, n, u) for t in (32, 64, 128, 256) for n in (2, 4) for u in (1, 2)]:
            shape = chosen._replace(tg=tg, groups=256 // tg, nr=nr, unroll=unroll)
            launch = matmul_decode.decode_kernel(T.Q8_0, n_in, False, False, shape)
            seconds = graph_seconds(launches(lambda s, i: launch(s, x, *device[i % copies], *device[i % copies],
                                                        placeholder, out), max(copies, MIN_LAUNCHES)))
            rows.append((f"{n_out} x {n_in}", tg, nr, unroll, f"{seconds * 1e6:.1f}",
                         f"{packed.nbytes / seconds / bandwidth:.0%}", "chosen" if shape == chosen else ""))
    table("Decode matmul sweep, Q8_0, one token", ["n_out x n_in", "lanes per row", "rows per group",
                                                    "chunks in flight", "us", "of read BW", ""], rows)


def moe_decode_step(rng, bandwidth, sweep=False):
    """One decode step of a Qwen3-30B-A3B MoE layer (Q8_0): groups, gate/up, down; expert ids on the device,
    each captured step using 8 other experts (16 steps cycle through all 128: nothing stays in L2). Experts
    read from VRAM slots, then (slot_of -1) from the mapped host copy.
    `sweep`: also time gate/up and down over their free shape parameters."""
    e_dim, f_dim, n_expert, k = (QWEN3_30B[key] for key in ("n_embd", "n_ff", "n_expert", "k"))
    gate, up = (random_packed((n_expert, f_dim, e_dim), T.Q8_0, rng) for _ in range(2))
    down = random_packed((n_expert, e_dim, f_dim), T.Q8_0, rng)
    dg, du, dd = (weights.upload(p) for p in (gate, up, down))
    hg, hu, hd = (weights.mapped_upload(p) for p in (gate, up, down))
    slot_of = cuda.to_device(np.arange(n_expert, dtype=np.int32))
    from_host = cuda.to_device(np.full(n_expert, -1, np.int32))
    steps = n_expert // k
    order = rng.permutation(n_expert).astype(np.int32)
    logits = [rng.standard_normal((1, n_expert), dtype=np.float32) for _ in range(steps)]
    for s, row in enumerate(logits):     # step s routes to its 8 experts of `order`, best first (all of them
        # far above the other logits: at 10 - 7 = 3, one of 120 normals beat the 8th in about a step of 7)
        row[0, order[s * k:(s + 1) * k]] = 20.0 - np.arange(k, dtype=np.float32)
    logits = [cuda.to_device(row) for row in logits]
    no_bias = cuda.to_device(np.zeros(1, np.float32))
    ids = [cuda.device_array((1, k), np.int32) for _ in range(steps)]
    route_w = [cuda.device_array((1, k), np.float32) for _ in range(steps)]
    x = cuda.to_device(rng.standard_normal((1, e_dim), dtype=np.float32))
    groups = [cuda.device_array(moe_groups_length(n_expert, k), np.int32) for _ in range(steps)]
    act = cuda.device_array((k, f_dim), np.float32)
    out = cuda.device_array((1, e_dim), np.float32)
    route = moe.make_moe_route(n_expert, k, "softmax", True, 1.0)
    gate_up = moe.make_moe_swiglu_matmul("decode", T.Q8_0, e_dim, f_dim, n_expert, k)
    down_proj = moe.make_moe_down_matmul("decode", T.Q8_0, f_dim, e_dim, n_expert, k)
    parts = {
        "route (top-k, weights, groups)": lambda s, i: route(s, logits[i], no_bias, ids[i], route_w[i], groups[i]),
        "gate/up": lambda s, i: gate_up(s, x, groups[i], slot_of, dg, du, hg, hu, act),
        "down": lambda s, i: down_proj(s, act, groups[i], route_w[i], slot_of, dd, hd, out),
    }
    host_parts = {
        "gate/up, experts in host memory": lambda s, i: gate_up(s, x, groups[i], from_host, dg, du, hg, hu, act),
        "down, experts in host memory": lambda s, i: down_proj(s, act, groups[i], route_w[i], from_host, dd, hd,
                                                               out),
    }
    for i in range(steps):
        parts["route (top-k, weights, groups)"](0, i)
    assert all(np.array_equal(np.sort(ids[s].copy_to_host()[0]), np.sort(order[s * k:(s + 1) * k]))
               for s in range(steps))
    per_expert = (gate.nbytes + up.nbytes + down.nbytes) // n_expert
    nbytes = k * per_expert + 4 * (e_dim * 2 + k * f_dim * 2)
    step = graph_seconds(launches(lambda s, i: [part(s, i) for part in parts.values()], steps))
    rows = [(name, f"{graph_seconds(launches(part, steps)) * 1e6:.1f}") for name, part in parts.items()]
    host_rows = [(name, f"{graph_seconds(launches(part, steps)) * 1e6:.1f}") for name, part in host_parts.items()]
    zeros = np.zeros((1, e_dim), np.float32)       # down adds its sum to out (the residual stream)
    out.copy_to_device(zeros)
    for part in parts.values():
        part(0, 0)
    chosen = order[:k]
    deq = [weights.dequantize(weights.PackedWeight(T.Q8_0, (k, *p.shape[1:]), p.data[chosen], p.scales[chosen]))
           for p in (gate, up, down)]
    local_ids = np.array([[list(chosen).index(e) for e in ids[0].copy_to_host()[0]]])   # step 0's, in deq
    ref = reference.moe(x.copy_to_host(), local_ids, route_w[0].copy_to_host(), *deq)
    from_slots = out.copy_to_host()
    err = rel_err(from_slots, ref)
    out.copy_to_device(zeros)
    for part in host_parts.values():
        part(0, 0)
    same = np.array_equal(out.copy_to_host(), from_slots)
    rows.append(("step (graph of the three)", f"{step * 1e6:.1f}"))
    rows += host_rows
    table(f"MoE decode step, Qwen3-30B-A3B layer shape (n_embd {e_dim}, n_ff_exp {f_dim}, {n_expert} experts, "
          f"{k} used, Q8_0): {nbytes / 1e6:.1f} MB of expert weights read; {nbytes / step / 1e9:.0f} GB/s = "
          f"{nbytes / step / bandwidth:.0%} of read BW; rel err {err:.1e}; host reads give the slots' bits: "
          f"{same}", ["kernel", "us"], rows)
    if not sweep:
        return
    swiglu_base, down_base = moe.decode_swiglu_shape(1), moe.decode_down_shape(1)
    gate_strides = moe.expert_strides(T.Q8_0, f_dim, e_dim, 0)
    down_strides = moe.expert_strides(T.Q8_0, e_dim, f_dim, 0)

    def sweep_rows():       # each row printed as it is timed: a run cut short keeps what it measured
        # chunks in flight per lane (unroll) only at a warp a row, the chosen width: each variant compiles anew
        for tg, unroll in ((32, 1), (64, 1), (128, 1), (32, 2), (32, 4)):
            for nr in (1, 2, 4, 8):
                shape = swiglu_base._replace(tg=tg, groups=256 // tg, nr=nr, unroll=unroll)
                if nr <= 4:
                    kernel = moe.decode_swiglu(T.Q8_0, e_dim, f_dim, n_expert, k, shape, gate_strides)
                    seconds = graph_seconds(launches(lambda s, i: kernel(s, x, groups[i], slot_of, *matmul.words(dg),
                                                                *matmul.words(du), *matmul.words(dg),
                                                                *matmul.words(du), act), steps))
                    yield ("gate/up", tg, nr, unroll, f"{seconds * 1e6:.1f}",
                           "chosen" if shape == swiglu_base else "")
                shape = down_base._replace(tg=tg, groups=256 // tg, nr=nr, unroll=unroll)
                kernel = moe.decode_down(T.Q8_0, f_dim, e_dim, n_expert, k, shape, down_strides)
                seconds = graph_seconds(launches(lambda s, i: kernel(s, act, groups[i], route_w[i], slot_of,
                                                                     *matmul.words(dd), *matmul.words(dd), out), steps))
                yield "down", tg, nr, unroll, f"{seconds * 1e6:.1f}", "chosen" if shape == down_base else ""

    table("MoE decode kernels' sweep (one token)",
          ["kernel", "lanes per row", "rows per group", "chunks in flight", "us", ""],
          sweep_rows())


def skewed_top_ids(rng, rows: int, n_expert: int, k: int, skew: float = 1.0) -> np.ndarray:
    """(rows, k) distinct expert ids per row, popular experts chosen more often (Gumbel top-k over log
    popularity ~ skew * normal), as `runtime.synthetic`'s routers skew them."""
    log_popularity = skew * rng.standard_normal(n_expert)
    keys = log_popularity + rng.gumbel(size=(rows, n_expert))
    return np.argsort(-keys, axis=1)[:, :k].astype(np.int32)


def moe_prefill(rng, peak):
    """A prefill chunk through one Qwen3-30B-A3B MoE layer (Q8_0, every expert in VRAM, skewed routing):
    groups, gate/up, down (a term row per pair), combine, each timed as a graph replay; FLOPs are the useful
    ones (4 * pairs * n_embd * n_ff for gate/up, half that for down); "tile rows" is the rows the 64-row expert
    tiles compute per useful pair row (the padding of each expert's last tile)."""
    e_dim, f_dim, n_expert, k = (QWEN3_30B[key] for key in ("n_embd", "n_ff", "n_expert", "k"))
    gate, up = (random_packed((n_expert, f_dim, e_dim), T.Q8_0, rng) for _ in range(2))
    down = random_packed((n_expert, e_dim, f_dim), T.Q8_0, rng)
    dg, du, dd = (weights.upload(p) for p in (gate, up, down))
    slot_of = cuda.to_device(np.arange(n_expert, dtype=np.int32))
    make_groups = moe.make_moe_groups(n_expert, k)
    gate_up = moe.make_moe_swiglu_matmul("prefill", T.Q8_0, e_dim, f_dim, n_expert, k)
    down_proj = moe.make_moe_down_matmul("prefill", T.Q8_0, f_dim, e_dim, n_expert, k)
    combine = moe.make_moe_combine(e_dim, k)
    rows = []
    for chunk in MOE_PREFILL_CHUNKS:
        host_ids = skewed_top_ids(rng, chunk, n_expert, k)
        ids = cuda.to_device(host_ids)
        pairs = chunk * k
        x = cuda.to_device(rng.standard_normal((chunk, e_dim), dtype=np.float32))
        route_w = cuda.to_device(rng.random((chunk, k), dtype=np.float32))
        groups = cuda.device_array(moe_groups_length(n_expert, pairs), np.int32)
        act = cuda.device_array((pairs, f_dim), np.float32)
        terms = cuda.device_array((pairs, e_dim), np.float32)
        out = cuda.device_array((chunk, e_dim), np.float32)
        parts = {"groups": (lambda s: make_groups(s, ids, groups), 0),
                 "gate/up": (lambda s: gate_up(s, x, groups, slot_of, dg, du, dg, du, act), 4.0 * pairs * e_dim * f_dim),
                 "down": (lambda s: down_proj(s, act, groups, slot_of, dd, dd, terms), 2.0 * pairs * f_dim * e_dim),
                 "combine": (lambda s: combine(s, terms, ids, route_w, out), 0)}
        for part, _ in parts.values():
            part(0)
        check = np.unique(host_ids[:2])
        local = np.searchsorted(check, host_ids[:2])
        deq = [weights.dequantize(weights.PackedWeight(T.Q8_0, (len(check), *p.shape[1:]), p.data[check],
                                                       p.scales[check])) for p in (gate, up, down)]
        ref = reference.moe(x.copy_to_host()[:2].astype(np.float64), local, route_w.copy_to_host()[:2], *deq)
        err = rel_err(out.copy_to_host()[:2], ref)
        tile_rows = measured_tile_rows_per_pair(host_ids, n_expert)
        total = 0.0
        for name, (part, flops) in parts.items():
            seconds = graph_seconds(launches(lambda s, i, part=part: part(s), 2), repeats=5)
            total += seconds
            rows.append((chunk, name, f"{seconds * 1e6:.0f}", f"{flops / seconds / 1e12:.1f}" if flops else "",
                         f"{flops / seconds / peak:.0%}" if flops else "", f"{tile_rows:.2f}" if flops else "",
                         f"{err:.1e}" if name == "combine" else ""))
        rows.append((chunk, "layer", f"{total * 1e6:.0f}", f"{6.0 * pairs * e_dim * f_dim / total / 1e12:.1f}",
                     f"{6.0 * pairs * e_dim * f_dim / total / peak:.0%}", "", ""))
    table("MoE prefill, one Qwen3-30B-A3B layer (Q8_0, 128 experts, 8 used, skewed routing)",
          ["chunk", "kernel", "us", "TFLOP/s", "of FMA peak", "tile rows", "rel err (2 rows)"], rows)


def prefill_table(rng, peak, theoretical):
    rows = []
    for ggml_type in (T.F32, T.Q8_0, T.Q4_K, T.Q6_K):
        for n_out, n_in in PREFILL_SHAPES:
            packed = random_packed((n_out, n_in), ggml_type, rng)
            w = weights.upload(packed)
            dense = weights.dequantize(packed)
            launch = matmul.make_matmul("prefill", ggml_type, n_in, n_out, False)
            placeholder = cuda.to_device(np.zeros(1, np.float32))
            for chunk in CHUNKS:
                x = cuda.to_device(rng.standard_normal((chunk, n_in), dtype=np.float32))
                out = cuda.device_array((chunk, n_out), np.float32)
                seconds = graph_seconds(launches(lambda s, i: launch(s, x, w, placeholder, out), 2), repeats=5)
                check = np.r_[0:CHECK_ROWS // 2, chunk - CHECK_ROWS // 2:chunk]
                err = rel_err(out.copy_to_host()[check], x.copy_to_host()[check].astype(np.float64) @ dense.T)
                flops = 2.0 * chunk * n_in * n_out
                rows.append((ggml_type.name, f"{n_out} x {n_in}", chunk, f"{seconds * 1e6:.0f}",
                             f"{flops / seconds / 1e12:.1f}", f"{flops / seconds / peak:.0%}",
                             f"{flops / seconds / theoretical:.0%}" if theoretical else "n/a", f"{err:.1e}"))
    table("Prefill matmul (production)",
          ["type", "n_out x n_in", "chunk", "us", "TFLOP/s", "of FMA peak", "of theoretical", "rel err"], rows)


def theoretical_fp32_flops():
    """SMs x 128 FP32 lanes x 2 FLOPs x the boost clock the driver reports (None if it reports none)."""
    device = cuda.get_current_device()
    try:
        clock_hz = device.CLOCK_RATE * 1e3
    except Exception:       # newer drivers drop the attribute
        return None
    return device.MULTIPROCESSOR_COUNT * 128 * 2 * clock_hz


def main():
    sections = ["decode-versions", "decode-sweep", "decode", "moe", "moe-sweep", "moe-prefill", "prefill-versions",
                "prefill"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", choices=sections, default=sections)
    parser.add_argument("--types", default=",".join(t.name for t in DECODE_TYPES), help="the decode table's types")
    parser.add_argument("--shapes", default=",".join(f"{o}x{i}" for o, i in DECODE_SHAPES),
                        help="the decode table's shapes, n_out x n_in")
    args = parser.parse_args()
    decode_types = [T[name] for name in args.types.split(",")]
    decode_shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    rng = np.random.default_rng(2026)
    bandwidth, peak, theoretical = read_bandwidth_bytes_per_s(), fp32_peak_flops(), theoretical_fp32_flops()
    device = cuda.get_current_device()
    print(f"{device_name()}: read bandwidth {bandwidth / 1e12:.2f} TB/s, FP32 FMA peak "
          f"{peak / 1e12:.1f} TFLOP/s measured" + (f", {theoretical / 1e12:.1f} theoretical "
                                                   f"({device.MULTIPROCESSOR_COUNT} SMs x 128 lanes x 2 x clock)"
                                                   if theoretical else ""))
    run = {"decode-versions": lambda: decode_versions(rng, bandwidth),
           "decode-sweep": lambda: decode_sweep(rng, bandwidth),
           "decode": lambda: decode_table(rng, bandwidth, decode_types, decode_shapes),
           "moe": lambda: moe_decode_step(rng, bandwidth),
           "moe-sweep": lambda: moe_decode_step(rng, bandwidth, sweep=True),
           "moe-prefill": lambda: moe_prefill(rng, peak),
           "prefill-versions": lambda: prefill_versions(rng, peak),
           "prefill": lambda: prefill_table(rng, peak, theoretical)}
    for name in args.sections:
        run[name]()


if __name__ == "__main__":
    main()
