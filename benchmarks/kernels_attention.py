"""Attention kernels on the GPU: numbered versions of decode attention (llm.c dev/cuda style, each checked
against the float64 reference and timed), then the production kernels of `codegen.lower.attention`: decode
attention over 32K tokens of K/V and prefill attention, against the ceilings `runtime.ceilings` measures in
the same run.

    NUMBA_ENABLE_CUDASIM=0 PYTHONPATH=. python3 benchmarks/kernels_attention.py [--sweep] [--prefill | --decode]

Shape: Qwen3-30B-A3B (32 query heads, 4 kv heads, head dim 128), pages of 256 positions, K/V in f16 and q8_0.
Decode: a window of 1 or 4 rows at positions 32764..32767 (32K tokens of K/V); a figure is partials + combine
(v2-v5; "v5 alone": its partials kernel without the combine).
Timing: the launches are captured into a CUDA graph (as the runtime replays a decode step) and the graph
replayed; each launch reads its own layer's K/V, enough layers to cycle >= 256 MB, so the 50 MB L2 holds none.
Bytes = the K/V pages read (the window's q, partials and output are < 2% more); "% BW" is of the read
bandwidth measured here. Decode is also bound by FP32 FMA: a window of w rows costs 512 FLOPs per query head
and token (q.k and p.v), 0.54 GFLOP per row over 32K tokens (8 us at 67 TFLOP/s), so "bound" is the best
fraction of bandwidth the FMA peak measured here allows (w = 4 cannot reach 60% at FP32 on this chip).

Versions (decode):
  v1  one thread per (row, query head) over every key, online softmax per key: 32 threads for one row
  v2  the keys split into the 64 page sets (a thread per row, head and set) + the combine kernel
  v3  a block per (kv head, page set) for every head of the group and every row of the window; tiles of K/V
      dequantized once into shared memory (the next tile's words in flight meanwhile), 16-dim query slices in
      registers against each K row, P V over 4 token subsets; values unpacked from words in software
      (codegen.lower.attention with Tuning(convert=frozenset()))
  v4  v3 with f16 (and f32) tiles read through a float16 view, converted by hardware (one cvt a value
      instead of ~12 instructions); "v4 +q8" converts q8_0 too (int8 view, I2F, times the scale); the
      cut of prefill v1
  v5  production (codegen.lower.attention_decode): a warp per tile of 32 positions, a lane per position for
      the scores (its K row read straight from the page, 8 chunks in flight for f16, 4 for q8_0) and per V
      dims for P V (16 rows in flight for f16, 8 for q8_0; before run 53 4 and 8 for both), the tile's max by
      shuffles, DECODE_WARPS warps a block merged at the end
Prefill (--prefill: only this table; --decode: only the decode table): v1, the previous kernel (`codegen.lower.attention`, a block's 8 rows one
after another, five barriers a row and tile); v2, production (`codegen.lower.attention_prefill`, a block's 32
query vectors against each staged tile at once, register-blocked scores and P V).
With --sweep, v4 is timed under other block cuts (`attention.Tuning`) and v5 with other warps a block. (v6, the
combine folded into v5's kernel, measured slower and was removed: BENCHMARKS.md; its code is in 328846e.)
"""

import math
import sys

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from runtime.ceilings import fp32_peak_flops, graph_seconds, l2_defeating_copies, read_bandwidth_bytes_per_s
from codegen.graph import ATTENTION_SPLITS
from codegen.lower import attention as att
from codegen.lower.attention_combine import make_attention_combine
from codegen.lower.attention_decode import DECODE_WARPS, make_decode_attention
from codegen.lower import kv_pages
from codegen.lower.cuda import cuda
from planner.kv import parse_kv_type, row_bytes
from runtime.reference import attention as reference_attention, kv_round

QWEN3_30B = dict(n_head=32, n_head_kv=4, dk=128, dv=128, page_tokens=256)
CONTEXT = 32768
DECODE_KV = ("f16", "q8_0")
WINDOWS = (1, 4)
PREFILL_CHUNKS = (512, 2048)
CHECK_ROWS = 32                 # prefill rows checked against float64 (the chunk's last)
SOFTWARE = att.Tuning(convert=frozenset())
ALL_CONVERTED = frozenset(att._VIEWS)
VERSIONS = {"v3": SOFTWARE, "v4": att.TUNING, "v4 +q8": att.Tuning(convert=ALL_CONVERTED)}
SWEEP = (att.Tuning(32, 256), att.Tuning(16, 256, False), att.Tuning(16, 128),
         att.Tuning(16, 256, False, convert=ALL_CONVERTED), att.Tuning(32, 256, convert=ALL_CONVERTED))
FLOPS_PER_HEAD_TOKEN = 2 * (QWEN3_30B["dk"] + QWEN3_30B["dv"])


# ---------------------------------------------------------------------------------------------------------
# timing, tables


def print_table(title: str, header: list, rows: list) -> None:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    for line in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))


def relative_error(got, ref) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


# ---------------------------------------------------------------------------------------------------------
# data: one layer's K/V stored by the production store kernel, copied to as many layers as defeat the L2


class Layers:
    def __init__(self, rng, kv_name: str, context: int, q_rows: int, copies: int = 0):
        """copies: layers in all (0: `l2_defeating_copies`)."""
        s = QWEN3_30B
        self.kv_name, self.kv = kv_name, parse_kv_type(kv_name)
        self.context = context
        n_pages = -(-context // s["page_tokens"])
        self.table = cuda.to_device(rng.permutation(n_pages).astype(np.int32))
        k = rng.standard_normal((context, s["n_head_kv"] * s["dk"]), dtype=np.float32)
        v = rng.standard_normal((context, s["n_head_kv"] * s["dv"]), dtype=np.float32)
        self.q = rng.standard_normal((q_rows, s["n_head"] * s["dk"]), dtype=np.float32)
        pages = kv_pages.kv_arrays(kv_name, n_pages, s["page_tokens"], s["n_head_kv"], s["dk"], s["dv"])
        first = pages.allocate(lambda shape, dtype: cuda.device_array(shape, dtype))
        kv_pages.make_kv_store(kv_name, s["n_head_kv"], s["dk"], s["dv"], s["page_tokens"])(
            0, cuda.to_device(k), cuda.to_device(v), cuda.to_device(np.arange(context, dtype=np.int32)), self.table,
            first)
        self.kv_bytes = context * (row_bytes(s["n_head_kv"] * s["dk"], self.kv.k_type)
                                   + row_bytes(s["n_head_kv"] * s["dv"], self.kv.v_type))
        self.layers = [first] + [pages.allocate(lambda shape, dtype: cuda.device_array(shape, dtype))
                                 for _ in range((copies or l2_defeating_copies(pages.nbytes)) - 1)]
        for layer in self.layers[1:]:
            for src, dst in zip(first.arrays(), layer.arrays()):
                dst.copy_to_device(src)
        self.k_ref, self.v_ref = kv_round(k, self.kv.k_type), kv_round(v, self.kv.v_type)
        self.window_references = None
        cuda.synchronize()

    def window_reference(self, rows: int) -> np.ndarray:
        """The reference for a decode window of `rows`: the last rows of q at the context's last positions."""
        if self.window_references is None:
            every = len(self.q)
            self.window_references = self.reference(self.q, np.arange(self.context - every, self.context))
        return self.window_references[len(self.q) - rows:]

    def reference(self, q, positions) -> np.ndarray:
        """float64 attention of rows q at `positions`, one kv head at a time (GQA repeats K/V per head)."""
        s = QWEN3_30B
        group = s["n_head"] // s["n_head_kv"]
        ctx = int(positions.max()) + 1
        heads = [reference_attention(q[:, h * group * s["dk"]:(h + 1) * group * s["dk"]],
                                     self.k_ref[:ctx, h * s["dk"]:(h + 1) * s["dk"]],
                                     self.v_ref[:ctx, h * s["dv"]:(h + 1) * s["dv"]], positions, group, 1)
                 for h in range(s["n_head_kv"])]
        return np.concatenate(heads, axis=1)


# ---------------------------------------------------------------------------------------------------------
# v1, v2: simple decode kernels (f16 and q8_0 K/V), kept here to show what each change buys


def _element_at(ggml_type: T, dim: int, page_tokens: int):
    """at(data, scales, slot, head, t, d): dim d of a stored row, dequantized (F16, Q8_0)."""
    per_word = {T.F16: 2, T.Q8_0: 4}[ggml_type]
    row_words, blocks = dim // per_word, dim // kv_pages.QUANT_BLOCK
    _, value = kv_pages.element_format(ggml_type)
    quantized = ggml_type == T.Q8_0

    @cuda.jit(device=True, inline=True)
    def at(data, scales, slot, head, t, d):
        row = head * page_tokens + t
        scale = np.float32(1)
        if quantized:
            scale = np.float32(scales[slot, row * blocks + d // kv_pages.QUANT_BLOCK])
        return value(data[slot, row * row_words + d // per_word], d % per_word, scale)
    return at


def _simple_decode(kv_name: str, split: bool):
    """v1 (split False): a thread per (row, head) over keys 0..p, writing out (rows, n_head*dv);
    v2 (split True): a thread per (row, head, page set) over its pages, writing decode partials."""
    s = QWEN3_30B
    kv = parse_kv_type(kv_name)
    n_head, dk, dv, page_tokens = s["n_head"], s["dk"], s["dv"], s["page_tokens"]
    group = n_head // s["n_head_kv"]
    k_at, v_at = _element_at(kv.k_type, dk, page_tokens), _element_at(kv.v_type, dv, page_tokens)
    scale = np.float32(1.0 / math.sqrt(dk))
    sets = ATTENTION_SPLITS if split else 1

    @cuda.jit
    def kernel(q, positions, page_table, k_data, k_scales, v_data, v_scales, out):
        i = cuda.grid(1)
        if i < q.shape[0] * n_head * sets:
            row, head, first = i // (n_head * sets), (i // sets) % n_head, i % sets
            kv_head = head // group
            pos = positions[row]
            acc = cuda.local.array(dv, np.float32)
            for d in range(dv):
                acc[d] = np.float32(0)
            m, total = att.NEG_INF, np.float32(0)
            for page in range(first, pos // page_tokens + 1, sets):
                slot = page_table[page]
                for t in range(min(page_tokens, pos - page * page_tokens + 1)):
                    score = np.float32(0)
                    for d in range(dk):
                        score += q[row, head * dk + d] * k_at(k_data, k_scales, slot, kv_head, t, d)
                    score *= scale
                    m_new = max(m, score)
                    alpha, p = math.exp(m - m_new), math.exp(score - m_new)
                    total = total * alpha + p
                    for d in range(dv):
                        acc[d] = acc[d] * alpha + p * v_at(v_data, v_scales, slot, kv_head, t, d)
                    m = m_new
            if split:
                out[row, head, first, 0] = m
                out[row, head, first, 1] = total
                for d in range(dv):
                    out[row, head, first, 2 + d] = acc[d]
            else:
                for d in range(dv):
                    out[row, head * dv + d] = acc[d] / total

    threads = 128

    def launch(stream, q, positions, page_table, pages, out):
        n = q.shape[0] * n_head * sets
        kernel[-(-n // threads), threads, stream](q, positions, page_table, *pages.arrays(), out)
    return launch


def decode_runs(layers: Layers, rows: int, version: str, cut):
    """(enqueue functions, one per layer, and the output array of layer 0) for a decode window of `rows`."""
    s = QWEN3_30B
    positions = cuda.to_device(np.arange(layers.context - rows, layers.context, dtype=np.int32))
    q = cuda.to_device(layers.q[len(layers.q) - rows:])
    out = cuda.device_array((rows, s["n_head"] * s["dv"]), np.float32)
    if version == "v1":
        launch = _simple_decode(layers.kv_name, split=False)
        return [lambda stream, p=p: launch(stream, q, positions, layers.table, p, out) for p in layers.layers], out
    partials = cuda.device_array((rows, s["n_head"], ATTENTION_SPLITS, s["dv"] + 2), np.float32)
    if version in ("v5", "v5 alone"):
        launch = make_decode_attention(layers.kv_name, s["n_head"], s["n_head_kv"], s["dk"], s["dv"],
                                       s["page_tokens"], warps=cut)
    elif version == "v2":
        launch = _simple_decode(layers.kv_name, split=True)
    else:
        launch = att._attention_launch("decode", layers.kv_name, s["n_head"], s["n_head_kv"], s["dk"], s["dv"],
                                       s["page_tokens"], cut)
    combine = make_attention_combine(s["n_head"], s["dv"]) if version != "v5 alone" else None

    def enqueue(stream, pages):
        launch(stream, q, positions, layers.table, pages, partials)
        if combine is not None:
            combine(stream, partials, out)
    return [lambda stream, p=p: enqueue(stream, p) for p in layers.layers], out


def decode_row(layers: Layers, rows: int, version: str, label: str, bandwidth: float, peak: float, cut) -> list:
    """cut: the v3/v4 kernel's `attention.Tuning`, or v5's warps a block. The error is taken after the first
    launch and again after the timed replays (the worse; "v5 alone" has no output: its time is the partials
    kernel's share of v5)."""
    enqueues, out = decode_runs(layers, rows, version, cut)
    enqueues[0](cuda.default_stream())
    want = layers.window_reference(rows)
    err = relative_error(out.copy_to_host(), want)
    slow = version == "v1"
    seconds = graph_seconds(enqueues[:1] if slow else enqueues, repeats=2 if slow else 10)
    err = max(err, relative_error(out.copy_to_host(), want))
    flops = rows * QWEN3_30B["n_head"] * layers.context * FLOPS_PER_HEAD_TOKEN
    bound = min(1.0, (layers.kv_bytes / bandwidth) / (flops / peak))
    return [label, layers.kv_name, rows, f"{seconds * 1e6:.1f}", f"{layers.kv_bytes / seconds / 1e9:.0f}",
            f"{layers.kv_bytes / seconds / bandwidth:.0%}", f"{bound:.0%}",
            "-" if version == "v5 alone" else f"{err:.1e}"]


DECODE_HEADER = ["version", "kv", "rows", "us", "GB/s", "% BW", "bound", "rel err"]


def decode_versions(rng, bandwidth: float, peak: float, sweep: bool) -> None:
    rows = []
    for kv_name in DECODE_KV:
        layers = Layers(rng, kv_name, CONTEXT, max(WINDOWS))
        for window in WINDOWS:
            for version in ("v1", "v2") if window == 1 else ("v2",):    # v1 takes ~1 s a launch
                rows.append(decode_row(layers, window, version, version, bandwidth, peak, att.TUNING))
            for label, tuning in VERSIONS.items():
                if label != "v4 +q8" or kv_name == "q8_0":
                    rows.append(decode_row(layers, window, "tiled", label, bandwidth, peak, tuning))
            for version in ("v5", "v5 alone"):
                rows.append(decode_row(layers, window, version, version, bandwidth, peak, DECODE_WARPS))
            if sweep:
                for warps in (2, 6, 8):
                    rows.append(decode_row(layers, window, "v5", f"v5 {warps} warps", bandwidth, peak, warps))
                for tuning in SWEEP:
                    label = (f"v4 {tuning.tile} x{tuning.threads}{' hold q' if tuning.hold_q else ''}"
                             f"{' +q8' if T.Q8_0 in tuning.convert else ''}")
                    rows.append(decode_row(layers, window, "tiled", label, bandwidth, peak, tuning))
        del layers
    print_table(f"decode attention, {CONTEXT} tokens of K/V (target >= 60% BW)", DECODE_HEADER,
                rows)


# ---------------------------------------------------------------------------------------------------------
# prefill


def prefill_table(rng, peak: float) -> None:
    s = QWEN3_30B
    rows = []
    for kv_name in DECODE_KV:
        for chunk in PREFILL_CHUNKS:
            layers = Layers(rng, kv_name, chunk, chunk, copies=1)
            positions = np.arange(chunk, dtype=np.int32)
            out = cuda.device_array((chunk, s["n_head"] * s["dv"]), np.float32)
            d_q, d_positions = cuda.to_device(layers.q), cuda.to_device(positions)
            check = positions[-CHECK_ROWS:]
            for version, launch in prefill_versions(kv_name).items():
                enqueues = [lambda stream, p=p, launch=launch: launch(stream, d_q, d_positions, layers.table, p, out)
                            for p in layers.layers]
                enqueues[0](cuda.default_stream())
                err = relative_error(out.copy_to_host()[check], layers.reference(layers.q[check], check))
                seconds = graph_seconds(enqueues, repeats=5)
                flops = s["n_head"] * FLOPS_PER_HEAD_TOKEN * chunk * (chunk + 1) / 2
                rows.append([version, kv_name, chunk, f"{seconds * 1e6:.0f}", f"{flops / seconds / 1e12:.1f}",
                             f"{flops / seconds / peak:.0%}", f"{err:.1e}"])
    print_table("prefill attention, a chunk from position 0 (causal FLOPs)",
                ["version", "kv", "chunk", "us", "TFLOP/s", "% FMA peak", "rel err"], rows)


def prefill_versions(kv_name: str) -> dict:
    """v1: the previous kernel (`codegen.lower.attention`, a block's rows one after another); v2: production
    (`codegen.lower.attention_prefill`, flash-attention style over a block's query vectors at once)."""
    s = QWEN3_30B
    shape = (kv_name, s["n_head"], s["n_head_kv"], s["dk"], s["dv"], s["page_tokens"])
    return {"v1": att._attention_launch("prefill", *shape, att.TUNING), "v2": att.make_attention("prefill", *shape)}


def main(argv=()):
    rng = np.random.default_rng(0)
    bandwidth, peak = read_bandwidth_bytes_per_s(), fp32_peak_flops()
    print(f"{cuda.get_current_device().name}: read bandwidth {bandwidth / 1e12:.2f} TB/s, FP32 FMA peak "
          f"{peak / 1e12:.1f} TFLOP/s")
    if "--prefill" not in argv:
        decode_versions(rng, bandwidth, peak, "--sweep" in argv)
    if "--decode" not in argv:
        prefill_table(rng, peak)


if __name__ == "__main__":
    main(sys.argv[1:])
