"""Time of a pass on a GPU: each node takes its family's latency plus its roofline time, max(FLOPs / peak,
bytes / bandwidth), over its family's efficiency (`planner.profile.Kernels`, measured by `stratum profile
--detect`; an uncalibrated profile prices the plain roofline).

Prefill's matmuls and routed experts (the tiled families) are priced by their tiles (`tiled_s`): each SM runs
ceil(tiles / SMs) of them, so a node of fewer tiles than SMs takes one tile's time whatever its rows and a
node's time steps at each wave. On the H200, Qwen3-30B's k, v and router projections take one tile's k loop
(175-182 us) at 512 and at 2048 rows, which no roofline of useful FLOPs can price (BENCHMARKS.md, run 12).

Activations are float32 and the kernels run on CUDA cores, so the FP32 peak is the compute roof. The graph
may hold one representative block per kind (`graph.representative_layers`); each representative stands for
every block of its kind that the device runs, with that block's own weight bytes, so the cost is exact
without building the full graph. Routed experts are costed here only for their arithmetic and activations:
whether an expert's bytes come from a cache slot, the prefill ring or mapped host memory is the planner's
business (`planner.predict`).

A prefill expert tile computes EXPERT_TILE_ROWS pair rows whatever its expert's pairs fill of its last one, so
the routed experts' arithmetic is their useful FLOPs times `tile_rows_per_pair`: the routing's (calibration,
`measured_tile_rows_per_pair`) or the one a popularity implies (the planner, `expected_tile_rows_per_pair`).
At 512 tokens of a Qwen3-30B-shaped block that is ~2.3 (32 pairs an expert on average), at 4096 ~1.1.

Times take numpy arrays for the context: the planner evaluates many candidate layouts at once.
"""

from dataclasses import dataclass, field

import networkx as nx
import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import (ATTENTION_SPLITS, EXPERT_TILE_ROWS, TILE_WEIGHT_ROWS, TILED_OPS, Tiling, expert_tiles,
                           launch_members, launched, prefill_tiling, representative_of)
from planner.architecture import tensor_layer
from planner.kv import parse_kv_type
from planner.model import split_bytes
from planner.profile import GPU, TILED_FAMILIES, KernelFit

MATMUL_OPS = ("matmul", "swiglu_matmul")
ATTENTION_OPS = ("attention", "attention_combine")
GROUPING_OPS = ("moe_groups", "moe_route")     # one thread block each: they follow no roofline
DECODE_ROUND_BYTES = 32 * 16    # a warp's loads of a weight row in flight at once: a 16-byte chunk a lane
#                                 (codegen.lower.matmul_decode.CHUNK_WORDS words), one chunk in flight (unroll 1)
# decode attention's shape (codegen.lower.attention_decode, whose constants tests/test_cost.py checks these
# against): a warp's tile of positions, its K rows' load size, and a block's warps on a GPU; what it keeps in
# flight is `decode_attention_in_flight`, which the kernel takes from here
DECODE_ATTENTION_TILE = 32
DECODE_ATTENTION_K_CHUNK_BYTES = 16
DECODE_ATTENTION_WARPS = 4
FLOAT_KV = (T.F32, T.F16)


def kernel_family(node: dict, decode: bool, in_l2: bool = False) -> str:
    """The `planner.profile.Kernels` field that prices a node: its kind's, in the decode or the prefill family
    (the pass's, or the node's own `family`), the `*_l2_*` one when its model's weights stay in L2 (`in_l2`,
    `weights_in_l2`)."""
    kind = ("experts" if "expert_layer" in node else "matmul" if node["op"] in MATMUL_OPS
            else "attention" if node["op"] in ATTENTION_OPS else "grouping" if node["op"] in GROUPING_OPS
            else "small")
    family = "decode" if decode or node.get("family") == "decode" else "prefill"
    return f"{family}_l2_{kind}" if in_l2 else f"{family}_{kind}"


def kernel_fit(gpu: GPU, node: dict, decode: bool, in_l2: bool = False) -> KernelFit:
    return getattr(gpu.kernels, kernel_family(node, decode, in_l2))


def weights_in_l2(model, blocks, gpu: GPU) -> bool:
    """Whether every weight a device's decode steps read (its trunk `blocks`' dense and routed experts, the
    embedding, head and drafter) fits in its L2 cache at once: a step then reads them from L2, where the
    previous step left them (the 25 MB demo model on the H200's 60 MiB). The K/V is left out: at such a model's
    contexts it is a few MB."""
    blocks = set(blocks)
    read_bytes = sum(t.n_bytes for t in model.tensors
                     if (layer := tensor_layer(t.name)) is None or layer in blocks or layer >= model.hparams.n_trunk)
    return 0 < read_bytes <= gpu.l2_bytes


def fitted_s(fit: KernelFit, roofline_s, walk_tokens=0):
    """A node's time by its family's fit: latency + roofline / efficiency, or its K/V walk of `walk_tokens`
    positions where that takes longer (prefill attention's `KernelFit.walk_token_s`; 0 elsewhere)."""
    seconds = roofline_s / fit.efficiency
    if fit.walk_token_s:
        seconds = np.maximum(seconds, fit.walk_token_s * walk_tokens)
    return fit.latency_s + seconds


def is_tiled(node: dict, decode: bool) -> bool:
    return kernel_family(node, decode) in TILED_FAMILIES and node["op"] in TILED_OPS


def tile_terms(gpu: GPU, tiling: Tiling, tiles):
    """(waves, one tile's FLOPs at an SM's share of the FP32 peak, the weight elements it dequantizes) for a
    node of `tiles` tiles (an array): what `tiled_s` prices and `runtime.calibrate` fits."""
    waves = -(-tiles // gpu.sms)       # ceil; plain arithmetic serves floats and arrays (the solver's scalars)
    return waves, tiling.tile_flops * gpu.sms / gpu.fp32_flops, TILE_WEIGHT_ROWS * tiling.n_in


def tiled_sm_s(fit: KernelFit, waves, peak_s, weight_elements):
    """The busiest SM's time over its `waves` tiles (`tile_terms`): the first at its full time, each further
    one at `fit.further_tile` of it (tiles on an SM overlap)."""
    tile_s = peak_s / fit.efficiency + weight_elements * fit.weight_element_s
    return tile_s * (1.0 + fit.further_tile * (waves - 1.0)) * (waves > 0)


def tiled_s(fit: KernelFit, gpu: GPU, tiling: Tiling, tiles, moved_bytes, launches=1.0):
    """Seconds of a tiled-family node of `tiles` tiles moving `moved_bytes`: its busiest SM's tiles, or its
    bytes at the read bandwidth where those take longer, plus the family's latency. In `launches` launches of
    an even share each (the prefill ring's batches), each launch's grid its share of the tiles; the latency is
    the node's once (what a further launch adds is the profile's `prefill_ring_batch`)."""
    sm_s = tiled_sm_s(fit, *tile_terms(gpu, tiling, tiles / launches))
    bytes_s = moved_bytes / launches / gpu.memory_bandwidth_bytes_per_s
    return fit.latency_s + launches * 0.5 * (sm_s + bytes_s + abs(sm_s - bytes_s))     # the larger of the two


@dataclass
class PassCost:
    gpu: GPU
    tokens: int                       # the graph's rows; `dense_s` and the rest price any rows up to them
    fixed_s: float = 0.0              # every node but attention, routed experts and tiled matmuls
    attention: list = field(default_factory=list)   # (flops, flops per context token, bytes, K/V bytes per
    #                                                    resident context token, blocks it stands for, its fit)
    tiled: list = field(default_factory=list)       # prefill's dense matmuls: (tiling, activation bytes, weight
    #                                                 bytes [a block it stands for], index of the representative
    #                                                 MoE block among them or None, its fit)
    block_fixed_s: float = 0.0        # one MoE block's fixed part (attention excluded): the ring's prefetch window
    experts: list = field(default_factory=list)     # one MoE block's routed-expert nodes: (flops, bytes, fit,
    #                                                 tiling: prefill's, None for decode's; pairs)
    expert_efficiency: float = 1.0    # the expert kernels' fit: the planner divides their weight reads by it
    expert_launches: int = 0          # a trunk MoE block's routed-expert launches (decode)
    expert_load_rounds: int = 0       # ... the rounds of weight loads a warp of them waits for, summed
    #                                   (`decode_load_rounds`)
    kv_tile_rounds: int = 0           # decode: the rounds of K/V loads a warp waits for in one tile of one row,
    #                                   summed over the pass's attention launches (`decode_kv_rounds`)
    kv_bytes_per_token: int = 0       # K/V bytes one context position adds, over all the pass's blocks
    host_kv_reads: int = 1            # how often attention reads a position held only in the host copy
    n_nodes: int = 0                  # kernel launches the pass replays
    _tiled_memo: dict = field(default_factory=dict, repr=False)

    def expert_compute_s(self, tile_rows_per_pair=1.0, tokens=None, launches=1.0):
        """One MoE block's expert arithmetic and activations (weights excluded) for `tokens` rows (default the
        graph's): prefill's by their tiles, ceil(pairs / EXPERT_TILE_ROWS) an expert, `tile_rows_per_pair`
        rows computed a pair, in `launches` launches (the prefill ring's batches, `tiled_s`); decode's by
        their FLOPs, which compute only their pairs."""
        scale = (tokens or self.tokens) / self.tokens
        total = 0.0
        for flops, moved, fit, tiling, pairs in self.experts:
            if tiling is None:
                total = total + fitted_s(fit, np.maximum(scale * flops / self.gpu.fp32_flops,
                                                         scale * moved / self.gpu.memory_bandwidth_bytes_per_s))
            else:
                tiles = expert_node_tiles(tiling, scale * pairs, tile_rows_per_pair)
                total = total + tiled_s(fit, self.gpu, tiling, tiles, scale * moved, launches)
        return total

    def attention_s(self, context_tokens, resident_tokens, per_block: bool = False, tokens=None):
        scale = (tokens or self.tokens) / self.tokens
        peak, bandwidth = self.gpu.fp32_flops, self.gpu.memory_bandwidth_bytes_per_s
        total = 0.0
        for flops, flops_per_token, moved, kv_per_token, blocks, fit in self.attention:
            seconds = fitted_s(fit, np.maximum(scale * (flops + flops_per_token * context_tokens) / peak,
                                               (scale * moved + kv_per_token * resident_tokens) / bandwidth),
                               context_tokens)
            if per_block:
                return seconds
            total = total + blocks * seconds
        return total

    def tiled_matmuls_s(self, tokens, per_block: bool = False):
        """Prefill's dense matmuls over `tokens` rows, by their tiles (their waves do not scale with the rows)."""
        key = (tokens, per_block)
        if key not in self._tiled_memo:         # the solver prices a chunk size thousands of times
            self._tiled_memo[key] = self._tiled_matmuls_s(tokens, per_block)
        return self._tiled_memo[key]

    def _tiled_matmuls_s(self, tokens, per_block: bool):
        total = 0.0
        for tiling, activations, weights, block_index, fit in self.tiled:
            moved = activations * tokens / self.tokens + weights
            seconds = tiled_s(fit, self.gpu, tiling, tiling.tiles(tokens), moved)
            if per_block:
                total += float(seconds[block_index]) if block_index is not None else 0.0
            else:
                total += float(seconds.sum())
        return total

    def dense_s(self, context_tokens, resident_tokens, tokens=None):
        """Everything but the routed experts over `tokens` rows (default the graph's; fewer are priced as the
        graph's share, tiled matmuls by their tiles), with `resident_tokens` of the context's K/V read from VRAM."""
        scale = (tokens or self.tokens) / self.tokens
        return (scale * self.fixed_s + self.attention_s(context_tokens, resident_tokens, tokens=tokens)
                + self.tiled_matmuls_s(tokens or self.tokens))

    def block_s(self, context_tokens, resident_tokens, tokens=None):
        """One MoE block's dense part: the time the prefill ring's copy engine idles in each streaming block (its
        experts are known only once its router has run)."""
        scale = (tokens or self.tokens) / self.tokens
        return (scale * self.block_fixed_s + self.tiled_matmuls_s(tokens or self.tokens, per_block=True)
                + self.attention_s(context_tokens, resident_tokens, per_block=True, tokens=tokens))


def pass_cost(graph: nx.DiGraph, gpu: GPU, model, blocks, with_globals: tuple = (True, True),
              in_l2: bool = False) -> PassCost:
    """Cost of `graph` run over trunk `blocks` (plus the drafter's block where the graph has it).

    with_globals: (runs the embedding, runs the output head), for a device holding part of the blocks.
    in_l2: the pass's weights stay in L2 (`weights_in_l2`): priced by the `*_l2_*` families.
    """
    hp = model.hparams
    represented = {}            # representative block -> the blocks it stands for
    for block in blocks:
        represented.setdefault(representative_of(hp, block), []).append(block)
    cost = PassCost(gpu=gpu, tokens=graph.graph["tokens"])
    decode = graph.graph["kind"] != "prefill"
    cost.expert_efficiency = kernel_fit(gpu, {"op": "moe_down_matmul", "expert_layer": 0}, decode, in_l2).efficiency
    load_rounds = {}            # trunk MoE block -> its expert launches' rounds
    launches = {}               # ... and their count
    for name, node in graph.nodes(data=True):
        if not launched(node):
            continue
        rep = tensor_layer(name)
        if rep is None or rep >= hp.n_trunk:
            # the embedding runs where the first block is; the head and the drafter where the last one is
            stands_for = [None] if with_globals[0 if name == "embed" else 1] else []
        else:
            stands_for = represented.get(rep, [])
        if not stands_for:
            continue
        cost.n_nodes += len(stands_for)
        fit = kernel_fit(gpu, node, decode, in_l2)
        flops, moved, weight_names, weight_bytes = launch_totals(graph, name)
        if node["op"] == "attention":
            moved += node["weight_bytes"]
            cost.attention.append((node["flops"], node["flops_per_context_token"], moved, node["kv_read"],
                                   len(stands_for), fit))
            cost.kv_bytes_per_token += node["kv_read"] * len(stands_for)
            cost.host_kv_reads = node.get("kv_reads", 1)
            if decode:
                cost.kv_tile_rounds += decode_kv_rounds(model, graph.graph["kv"]) * len(stands_for)
            continue
        tiling = prefill_tiling(node) if is_tiled(node, decode) else None
        if "expert_layer" in node:
            cost.experts.append((node["flops"], moved, fit, tiling, node["shape"][0]))
            if decode and rep is not None and rep < hp.n_trunk:
                load_rounds[rep] = load_rounds.get(rep, 0) + decode_load_rounds(model, node)
                launches[rep] = launches.get(rep, 0) + 1
            continue
        # a decode matmul reads 4-bit types slower than their bytes (`GPU.decode_weight_rates`)
        rates = gpu.decode_weight_rates if decode and node["op"] in MATMUL_OPS else ()
        if stands_for == [None]:
            weights = np.array([model.read_bytes(weight_names, rates) if rates else weight_bytes], dtype=np.float64)
        else:
            weights = model.block_weight_bytes(weight_names, rep, tuple(stands_for), rates)
        in_moe_block = rep is not None and rep in stands_for and hp.is_moe_layer(rep)
        if tiling is not None:
            cost.tiled.append((tiling, moved, weights, stands_for.index(rep) if in_moe_block else None, fit))
            continue
        seconds = fitted_s(fit, np.maximum(flops / gpu.fp32_flops,
                                           (moved + weights) / gpu.memory_bandwidth_bytes_per_s))
        cost.fixed_s += float(seconds.sum())
        if in_moe_block:
            cost.block_fixed_s += float(seconds[stands_for.index(rep)])
    cost.expert_load_rounds = max(load_rounds.values(), default=0)
    cost.expert_launches = max(launches.values(), default=0)
    return cost


def decode_load_rounds(model, node: dict) -> int:
    """The rounds of weight loads one warp of a decode expert launch issues one after another: a weight row's
    quants over the warp's 16-byte chunks (Qwen3-30B-A3B Q8_0: gate/up 4, their rows of 2048 values read
    together; down 2). A round waits the memory's latency, so an expert read from mapped host memory adds
    the link's latency beyond device memory's at each (`planner.predict`)."""
    weight_type = next(t.ggml_type for t in model.tensors if t.name == node["weights"][0])
    return -(-split_bytes(weight_type, node["n_in"])[0] // DECODE_ROUND_BYTES)


def decode_attention_in_flight(k_type, v_type, head_dim_k: int) -> tuple:
    """(chunks of its K row a decode attention lane has in flight, positions whose V words it has in flight).
    Each round of loads waits the memory's latency, and a warp's tile is a chain of rounds (at short contexts
    one tile a warp is the launch), so float K/V, whose loads need no scale registers, keep twice what the
    quantized types keep: 8 and 16 (f16 at head dim 128: 2 rounds of K, 2 of V), against 4 and 8, where more
    spills (ptxas for sm_90: q8_0 takes 251 registers at 4 and 8; f16 255 at 8 and 16, none spilled). K rows
    of fewer than 8 chunks keep 4."""
    k_chunks = split_bytes(k_type, head_dim_k)[0] // DECODE_ATTENTION_K_CHUNK_BYTES
    k_float, v_float = k_type in FLOAT_KV, v_type in FLOAT_KV
    return 8 if k_float and k_chunks >= 8 else 4, 16 if v_float else 8


def decode_kv_rounds(model, kv_name: str) -> int:
    """The rounds of K/V loads one warp of decode attention waits for, one after another, in a tile of one row:
    its lanes' K rows in 16-byte chunks, then the tile's V rows, as many in flight as `decode_attention_in_flight`
    says (f16, head dim 128: 2 + 2 rounds; q8_0: 2 + 4). A tile read from the host copy waits the link's latency
    at each."""
    kv, dk = parse_kv_type(kv_name), model.hparams.head_dim_k
    k_ahead, v_ahead = decode_attention_in_flight(kv.k_type, kv.v_type, dk)
    k_chunks = -(-split_bytes(kv.k_type, dk)[0] // DECODE_ATTENTION_K_CHUNK_BYTES)
    return -(-k_chunks // k_ahead) + DECODE_ATTENTION_TILE // v_ahead


def decode_host_kv_tiles(host_positions):
    """The tiles of host-copy positions the busiest warp of a decode attention launch reads in turn: the
    context's tiles are dealt to ATTENTION_SPLITS blocks of DECODE_ATTENTION_WARPS warps, the oldest first."""
    tiles = -(-np.asarray(host_positions) // DECODE_ATTENTION_TILE)
    return -(-tiles // (ATTENTION_SPLITS * DECODE_ATTENTION_WARPS))


def activation_bytes(graph: nx.DiGraph, name: str) -> int:
    """The activations a node reads and writes."""
    return graph.nodes[name]["out_bytes"] + sum(graph.nodes[p]["out_bytes"] for p in graph.predecessors(name))


def launch_totals(graph: nx.DiGraph, name: str) -> tuple:
    """(FLOPs, activation and K/V bytes moved, weight names, dense weight bytes) of the launch of node `name`,
    over the nodes it computes (`launch_members`)."""
    members = launch_members(graph, name)
    nodes = [graph.nodes[m] for m in members]
    return (sum(node["flops"] for node in nodes),
            sum(activation_bytes(graph, m) + node.get("kv_write", 0) for m, node in zip(members, nodes)),
            tuple(dict.fromkeys(w for node in nodes for w in node["weights"])),
            sum(node["weight_bytes"] for node in nodes))


def node_roofline_s(graph: nx.DiGraph, name: str, gpu: GPU, model, context_tokens: int,
                    tile_rows_per_pair: float = 1.0, host_experts: bool = False) -> float:
    """The roofline time of one node's launch (with the nodes it fuses) in a pass graph that holds every block,
    with `context_tokens` of K/V in VRAM: its FLOPs at the FP32 peak or its bytes at the read bandwidth,
    whichever is longer (what `pass_cost` charges it, before calibration). A routed-expert node reads the
    weights of as many experts as its rows can use (k a row, at most all of them), and computes
    `tile_rows_per_pair` rows a pair; with `host_experts`, it reads them from the mapped host copy, at the
    zero-copy read rate (`Kernels.decode_host_experts`)."""
    node = graph.nodes[name]
    flops, moved, _, weight_bytes = launch_totals(graph, name)
    moved_s = 0.0
    if node["op"] == "attention":
        flops += node["flops_per_context_token"] * context_tokens
        moved += node["weight_bytes"] + node["kv_read"] * context_tokens
    elif "expert_layer" in node:
        hp = model.hparams
        used = min(hp.n_expert, graph.graph["tokens"] * hp.n_expert_used)
        expert_bytes = sum(model.tensor_bytes[w] for w in node["weights"]) * used / hp.n_expert
        if host_experts:
            moved_s = expert_bytes / gpu.zero_copy_read_bytes_per_s
        else:
            moved += expert_bytes
        flops *= tile_rows_per_pair
    else:
        moved += weight_bytes
    return max(flops / gpu.fp32_flops, moved_s + moved / gpu.memory_bandwidth_bytes_per_s)


def expert_node_tiles(tiling: Tiling, pairs, tile_rows_per_pair):
    """The tiles of a prefill routed-expert node over `pairs` (row, slot) pairs computing `tile_rows_per_pair`
    rows a pair: its row tiles (ceil(pairs / EXPERT_TILE_ROWS) an expert) times its column tiles."""
    return np.asarray(tile_rows_per_pair) * pairs / EXPERT_TILE_ROWS * tiling.col_tiles


def node_tiles(graph: nx.DiGraph, name: str, tile_rows_per_pair: float = 1.0):
    """(tiling, tiles) of a prefill tiled-family node of a pass graph (a routed-expert node's tiles from
    `tile_rows_per_pair`, its routing's), None for any other node."""
    node = graph.nodes[name]
    if not is_tiled(node, graph.graph["kind"] != "prefill"):
        return None
    tiling = prefill_tiling(node)
    rows = node["shape"][0]
    if "expert_layer" in node:
        return tiling, float(expert_node_tiles(tiling, rows, tile_rows_per_pair))
    return tiling, tiling.tiles(rows)


def measured_tile_rows_per_pair(ids: np.ndarray, n_expert: int) -> float:
    """The rows prefill's expert tiles compute per pair for a chunk routed to ids (rows, k)."""
    return float(expert_tiles(ids, n_expert).sum() * EXPERT_TILE_ROWS / max(1, np.asarray(ids).size))


def expected_tile_rows_per_pair(popularity: np.ndarray, tokens: int) -> np.ndarray:
    """[block]: the rows prefill's expert tiles compute per pair when `tokens` rows route by `popularity`
    ([block, expert]: the chance a row picks each expert, a row summing to k). Expert e's pairs N ~ Poisson(tokens
    x p_e) take ceil(N / B) tiles of B rows, and E[ceil(N / B)] = the sum over j >= 0 of P(N > jB): P(N > 0)
    exactly, the rest by the normal approximation (continuity-corrected), 1 below 8 sigma under the mean and
    summed over the window within 8 sigma of it. Blocks that share one popularity (no per-block trace) are
    computed once."""
    popularity = np.asarray(popularity, np.float64)
    if len(popularity) > 1 and (popularity == popularity[:1]).all():
        return np.repeat(expected_tile_rows_per_pair(popularity[:1], tokens), len(popularity))
    lam = popularity * tokens
    sigma = np.sqrt(np.maximum(lam, 1e-12))
    first = np.maximum(1, np.floor((lam - 8 * sigma) / EXPERT_TILE_ROWS)).astype(np.int64)    # P(N > jB) ~ 1 below
    window = int(np.ceil(16 * sigma.max(initial=0.0) / EXPERT_TILE_ROWS)) + 2
    tiles = 1.0 - np.exp(-lam) + (first - 1)
    for i in range(window):
        tiles += _upper_tail(((first + i) * EXPERT_TILE_ROWS + 0.5 - lam) / sigma)
    return tiles.sum(axis=-1) * EXPERT_TILE_ROWS / np.maximum(lam.sum(axis=-1), 1e-12)


def _upper_tail(z: np.ndarray) -> np.ndarray:
    """P(Z > z) for a standard normal Z (Abramowitz and Stegun 7.1.26 for erf: error below 1.5e-7)."""
    x = np.abs(z) / np.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    half_erfc = 0.5 * poly * np.exp(-x * x)          # P(Z > |z|)
    return np.where(z >= 0, half_erfc, 1.0 - half_erfc)
