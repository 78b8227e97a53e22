"""Pass graphs: one networkx DiGraph per pass kind, the single model of the network.

Passes (DESIGN.md): a prefill chunk of `tokens` prompt positions; a decode window of `tokens` positions
(1 for a decode step, 1 + n for a verify window); a draft step of the NextN block. The planner asks a graph
for bytes and FLOPs (`codegen.cost`) and for its activation arena (`codegen.memory`); codegen lowers its
nodes; the runtime replays them in `order`.

Every node is one op producing one tensor (the node's name is the tensor's name), with:
  op, order (a topological position: the build order), shape, dtype, out_bytes,
  flops, weights (names of the weight tensors it reads), weight_bytes (dense weights it reads),
  inplace (the input whose buffer the op overwrites: the residual stream is one buffer for the whole
  pass, so every block of a kind sees the same surroundings and gets the same arena offsets),
  expert_layer (for routed-expert ops: the layer whose experts it reads; their bytes are the planner's,
  who knows which are cached and which stream), kv_layer / kv_read (for attention: K/V bytes read per
  context token; kv_reads, prefill: how often a position read from the host copy crosses the link),
  family ("decode" on a prefill node lowered and priced as the decode family: the output head's one row),
  n_in (matmuls: the weights' width; with the node's op and shape it gives its tiles, `prefill_tiling`),
  output (True for tensors that leave the pass),
  fuses / launched_by (a launch that computes several tensors: the first node lists the others, each of
  which names it; `launched`, `launch_members`).
Edges run from the producer of a tensor to each of its consumers.

Prefill computes the output head for the last position only: a full-chunk logits buffer is
vocab x chunk x 4 bytes (5 GB at 8K tokens), a classic OOM.
"""

from typing import NamedTuple

import networkx as nx
import numpy as np

from planner.architecture import HParams
from planner.kv import KVType, row_bytes

PASS_KINDS = ("prefill", "decode", "draft")
VIEW_OPS = ("input", "select_rows")     # tensors no kernel writes: a pass's inputs, views of a tensor's rows
ATTENTION_SPLITS = 64   # tile sets a decode/draft window's attention is split into
ARGMAX_BLOCK_VALUES = 4096      # logits a block of the argmax's first launch takes (`argmax_blocks` runs a row)
EXPERT_TILE_ROWS = 64   # pair rows of a prefill expert tile (an expert's last one computes all its rows: codegen.cost)
TILE_WEIGHT_ROWS = 128  # weight rows of a prefill matmul tile (SwiGLU: 64 gate and the same 64 up)
TILED_OPS = ("matmul", "swiglu_matmul", "moe_swiglu_matmul", "moe_down_matmul")
ROUTER_OPS = ("topk", "moe_route")      # the ops that write a MoE block's routed ids
PREFILL_QUERY_VECTORS = 32  # a prefill attention block's query vectors (rows x query heads), padded to a multiple
ACTIVATION_BYTES = 4    # float32 activations
INDEX_BYTES = 4         # int32 token and expert ids


def expert_tiles(ids, n_expert: int) -> np.ndarray:
    """[expert]: the EXPERT_TILE_ROWS-row tiles each expert's pairs make in a prefill chunk routed to ids
    (rows, k): ceil(pairs / EXPERT_TILE_ROWS)."""
    return -(-np.bincount(np.asarray(ids).reshape(-1), minlength=n_expert) // EXPERT_TILE_ROWS)


def prefill_tile_rows(n_out: int) -> int:
    """A dense prefill matmul tile's rows: 128 for wide weights; 64 when there are few columns, so a chunk still
    fills the GPU."""
    return 128 if n_out >= 4096 else 64


def tile_cols(gated: bool) -> int:
    """The outputs a prefill matmul tile computes: its TILE_WEIGHT_ROWS weight rows, or half of them when they
    are a SwiGLU's gate and up rows for the same outputs."""
    return TILE_WEIGHT_ROWS // 2 if gated else TILE_WEIGHT_ROWS


class Tiling(NamedTuple):
    """How the prefill family's kernel tiles a node (`codegen.lower.matmul_prefill`, `codegen.lower.moe`)."""
    tile_rows: int      # activation rows (routed experts: pair rows) of a tile
    col_tiles: int      # tiles across the outputs
    n_in: int           # the weights' width: a tile dequantizes TILE_WEIGHT_ROWS x n_in elements

    @property
    def tile_flops(self) -> float:
        return 2.0 * self.tile_rows * TILE_WEIGHT_ROWS * self.n_in

    def tiles(self, rows: int) -> int:
        """A dense node's tiles over `rows` activation rows (the kernel's grid)."""
        return -(-rows // self.tile_rows) * self.col_tiles


def prefill_tiling(node: dict) -> Tiling:
    """The tiles of a prefill-family matmul node (op in TILED_OPS) for any rows: ceil(rows / tile_rows) of them
    down its rows (a routed expert's: ceil(pairs / EXPERT_TILE_ROWS) each), col_tiles across."""
    n_out = node["shape"][1]
    cols = tile_cols(node["op"] in ("swiglu_matmul", "moe_swiglu_matmul"))
    rows = EXPERT_TILE_ROWS if "expert_layer" in node else prefill_tile_rows(n_out)
    return Tiling(rows, -(-n_out // cols), node["n_in"])


def prefill_attention_rows(group: int) -> int:
    """The chunk rows a prefill attention block holds for a kv head of `group` query heads."""
    return max(1, PREFILL_QUERY_VECTORS // group)


class _Builder:
    def __init__(self, model, kind: str, tokens: int, kv: KVType):
        self.model, self.kind, self.tokens, self.kv = model, kind, tokens, kv
        self.hp: HParams = model.hparams
        self.bytes = model.tensor_bytes
        self.graph = nx.DiGraph(kind=kind, tokens=tokens, kv=kv.name, model=model.name)

    def op(self, name: str, op: str, inputs: list[str], shape: tuple, *, dtype: str = "f32", flops: float = 0,
           weights: tuple = (), weight_bytes: int | None = None, inplace: str | None = None, **attrs) -> str:
        present = tuple(w for w in weights if w in self.bytes)
        if weight_bytes is None:
            weight_bytes = 0 if "expert_layer" in attrs else sum(self.bytes[w] for w in present)
        element_bytes = INDEX_BYTES if dtype == "i32" else ACTIVATION_BYTES
        n_elements = 1
        for dim in shape:
            n_elements *= dim
        self.graph.add_node(name, op=op, order=self.graph.number_of_nodes(), shape=shape, dtype=dtype,
                            out_bytes=n_elements * element_bytes, flops=flops, weights=present,
                            weight_bytes=weight_bytes, inplace=inplace, output=False, **attrs)
        for source in inputs:
            self.graph.add_edge(source, name)
        return name

    def fuse(self, writer: str, *members: str) -> None:
        """One launch computes `members` too (its kernel writes their tensors): a launch fewer each, which is
        what a node of a decode step costs (BENCHMARKS.md). Their inputs must be ready when the writer runs."""
        nodes, fused = self.graph.nodes, {writer, *members}
        late = [p for m in members for p in self.graph.predecessors(m)
                if p not in fused and nodes[p]["order"] > nodes[writer]["order"]]
        if late:
            raise ValueError(f"{writer} cannot compute {members}: {late} run after it")
        nodes[writer]["fuses"] = members
        for member in members:
            nodes[member]["launched_by"] = writer

    def matmul(self, name: str, x: str, weight: str, rows: int, n_in: int, n_out: int, residual: str | None = None,
               **attrs) -> str:
        """x @ weight.T (+ its bias, fused); with `residual`, added in place to that tensor (the residual
        stream: the add is the kernel's epilogue)."""
        weights = (f"{weight}.weight", f"{weight}.bias")
        return self.op(name, "matmul", [x] + ([residual] if residual else []), (rows, n_out),
                       flops=2.0 * rows * n_in * n_out + (rows * n_out if residual else 0), weights=weights,
                       n_in=n_in, inplace=residual, **attrs)

    def norm(self, name: str, x: str, weight: str, rows: int) -> str:
        e = self.hp.n_embd
        return self.op(name, "rmsnorm", [x], (rows, e), flops=4.0 * rows * e, weights=(f"{weight}.weight",))

    def attention_block(self, layer: int, x: str, rows: int, compute_ffn: bool = True) -> str:
        """One transformer block over `rows` positions; returns the block's output (the residual stream).
        With compute_ffn False it stops once the block's K/V are stored (the drafter in a prompt pass)."""
        hp, p = self.hp, f"blk.{layer}."
        q_dim, k_dim, v_dim = hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k, hp.n_head_kv * hp.head_dim_v
        e = hp.n_embd
        h = self.norm(p + "attn_norm", x, p + "attn_norm", rows)
        q = self.matmul(p + "q", h, p + "attn_q", rows, e, q_dim)
        k = self.matmul(p + "k", h, p + "attn_k", rows, e, k_dim)
        v = self.matmul(p + "v", h, p + "attn_v", rows, e, v_dim)
        if self.kind != "prefill":      # a window's three projections in one launch (`make_qkv_matmul`)
            self.fuse(q, k, v)
        qk_norm = hp.qk_norm    # each head of q and k normed before the rotation: one kernel does both
        q = self.op(p + "q_rope", "rope", [q, "positions"], (rows, q_dim),
                    flops=6.0 * rows * hp.n_head * hp.n_rot // 2 + (4.0 * rows * q_dim if qk_norm else 0),
                    weights=(p + "attn_q_norm.weight",) if qk_norm else (), inplace=q)
        k = self.op(p + "k_rope", "rope", [k, "positions"], (rows, k_dim),
                    flops=6.0 * rows * hp.n_head_kv * hp.n_rot // 2 + (4.0 * rows * k_dim if qk_norm else 0),
                    weights=(p + "attn_k_norm.weight",) if qk_norm else (), inplace=k)
        kv_row_bytes = row_bytes(k_dim, self.kv.k_type) + row_bytes(v_dim, self.kv.v_type)
        stored = self.op(p + "kv_store", "kv_store", [k, v, "positions"], (0,), kv_layer=layer,
                         kv_write=rows * kv_row_bytes)
        self.fuse(q, k, stored)     # one launch rotates both and stores k and v (`make_rope`)
        if not compute_ffn:
            return stored
        kv_attrs = dict(flops_per_context_token=4.0 * rows * hp.n_head * hp.head_dim_k, kv_layer=layer,
                        kv_read=kv_row_bytes)
        if self.kind == "prefill":
            # each block of a kv head's query slices reads every position it reaches: a position read from the
            # host copy crosses the link once a slice (kv_reads), where VRAM's L2 serves the repeats
            slices = -(-rows // prefill_attention_rows(hp.n_head // hp.n_head_kv))
            attn = self.op(p + "attention", "attention", [q, stored, "positions"], (rows, hp.n_head * hp.head_dim_v),
                           kv_reads=slices, **kv_attrs)
        else:
            # a window's few queries cannot fill the GPU: the context is split into ATTENTION_SPLITS tile sets
            # (attention tile i in set i mod ATTENTION_SPLITS), each giving a partial softmax (max, sum, weighted V),
            # combined in set order, so the split never depends on the context's length or the window's size
            partials = self.op(p + "attention_partials", "attention", [q, stored, "positions"],
                               (rows, hp.n_head, ATTENTION_SPLITS, hp.head_dim_v + 2), **kv_attrs)
            attn = self.op(p + "attention", "attention_combine", [partials], (rows, hp.n_head * hp.head_dim_v),
                           flops=rows * hp.n_head * ATTENTION_SPLITS * (hp.head_dim_v + 2))
        # the residual adds are the epilogues of the projections that end each half of the block, in the order
        # a separate add took them: x + attention, then + the routed experts' sum, then + the shared expert
        x = self.matmul(p + "attn_out", attn, p + "attn_output", rows, hp.n_head * hp.head_dim_v, e, residual=x)
        ffn_norm = "ffn_norm" if hp.architecture == "qwen3moe" else "post_attention_norm"
        h = self.norm(p + "ffn_norm", x, p + ffn_norm, rows)
        if hp.is_moe_layer(layer):
            return self.moe(layer, h, rows, x)
        return self.dense_ffn(p, h, rows, hp.n_ff, "", x)

    def dense_ffn(self, p: str, h: str, rows: int, width: int, suffix: str, residual: str) -> str:
        """SwiGLU FFN added to `residual`; the activation is fused into the gate/up op, so only silu(gate) * up
        is stored."""
        e = self.hp.n_embd
        act = self.op(f"{p}ffn_gate_up{suffix}", "swiglu_matmul", [h], (rows, width), flops=4.0 * rows * e * width,
                      weights=(f"{p}ffn_gate{suffix}.weight", f"{p}ffn_up{suffix}.weight"), n_in=e)
        return self.matmul(f"{p}ffn_down{suffix}", act, f"{p}ffn_down{suffix}", rows, width, e, residual=residual)

    def moe(self, layer: int, h: str, rows: int, x: str) -> str:
        """The routed experts (and the shared expert, where there is one) of `h`, added to x in place."""
        hp, p, e = self.hp, f"blk.{layer}.", self.hp.n_embd
        k, f = hp.n_expert_used, hp.n_ff_exp
        logits = self.matmul(p + "router", h, p + "ffn_gate_inp", rows, e, hp.n_expert)
        # one launch selects and weighs the experts; a window's few rows are grouped in it too (`moe_route`)
        route = self.kind != "prefill"
        ids = self.op(p + "topk", "moe_route" if route else "topk", [logits], (rows, k), dtype="i32",
                      flops=rows * hp.n_expert * k,
                      weights=(p + "exp_probs_b.bias",),
                      gating="softmax" if hp.architecture == "qwen3moe" else "sigmoid")
        weights = self.op(p + "route_weights", "route_weights", [logits, ids], (rows, k), flops=rows * k * 4,
                          normalize=hp.expert_weights_norm, scale=hp.expert_weights_scale)
        # (row, slot) pairs grouped by expert, so each expert's weights are read once for all its rows
        groups = self.op(p + "moe_groups", "moe_groups", [ids], (moe_groups_length(hp.n_expert, rows * k),),
                         dtype="i32")
        if route:
            self.fuse(ids, weights, groups)
        else:
            self.fuse(ids, weights)
        act = self.op(p + "moe_gate_up", "moe_swiglu_matmul", [h, groups], (rows * k, f),
                      flops=4.0 * rows * k * e * f, weights=(p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"),
                      expert_layer=layer, n_in=e)
        # h is an input of down too, only to keep it live: the runtime interleaves gate/up and down batch by
        # batch as the prefill ring streams experts, so down's output must not take h's bytes while gate/up
        # still reads them
        down = dict(flops=2.0 * rows * k * f * e, weights=(p + "ffn_down_exps.weight",), expert_layer=layer, n_in=f)
        if self.kind == "prefill":
            # a term row per pair, so each expert's pairs are one GEMM whatever the expert ranges the ring
            # streams; the combine adds a row's route-weighted terms in ascending expert order, then x
            terms = self.op(p + "moe_down", "moe_down_matmul", [act, groups, h], (rows * k, e), **down)
            x = self.op(p + "moe_combine", "moe_combine", [terms, ids, weights, x], (rows, e),
                        flops=2.0 * rows * k * e + rows * e, inplace=x)
        else:       # the weighted sum over a row's k experts is summed in the down kernel, in the same order
            down["flops"] += rows * e
            x = self.op(p + "moe_down", "moe_down_matmul", [act, groups, weights, h, x], (rows, e), inplace=x, **down)
        if hp.n_expert_shared and f"{p}ffn_up_shexp.weight" in self.bytes:
            x = self.dense_ffn(p, h, rows, f * hp.n_expert_shared, "_shexp", x)
        return x

    def head(self, x: str, rows: int, norm: str) -> str:
        """Output head over `rows` positions (the last ones); returns the greedy token ids."""
        hp = self.hp
        h = self.norm("head_norm", x, norm, rows)
        # prefill's one row through the decode family's GEMV, which reads the weights once, where the prefill
        # family's 128-row tiles would compute 128 rows (1.84 ms against 0.13 for Qwen3-30B's head on the H200)
        family = {"family": "decode"} if self.kind == "prefill" else {}
        logits = self.matmul("logits", h, "output", rows, hp.n_embd, hp.n_vocab, **family)
        self.graph.nodes[logits]["output"] = True
        # the greedy tokens in two launches: each run of ARGMAX_BLOCK_VALUES logits a block, then the runs merged
        runs = self.op("argmax_runs", "argmax_partials", [logits], (rows, argmax_blocks(hp.n_vocab), 2),
                       flops=rows * hp.n_vocab)
        ids = self.op("argmax", "argmax", [runs], (rows,), dtype="i32", flops=rows * argmax_blocks(hp.n_vocab))
        self.graph.nodes[ids]["output"] = True
        return ids

    def embed(self, name: str, token_ids: str, rows: int) -> str:
        """Embedding lookup: reads one table row per position, not the table."""
        table = "token_embd.weight"
        return self.op(name, "embed", [token_ids], (rows, self.hp.n_embd), weights=(table,),
                       weight_bytes=rows * (self.bytes[table] // self.hp.n_vocab))

    def nextn_input(self, layer: int, token_ids: str, hidden: str, rows: int) -> str:
        """The NextN block's input: eh_proj([enorm(embed(token)) ; hnorm(h)])."""
        p, e = f"blk.{layer}.", self.hp.n_embd
        embedded = self.embed(p + "nextn_embed", token_ids, rows)
        enorm = self.norm(p + "enorm", embedded, p + "nextn.enorm", rows)
        hnorm = self.norm(p + "hnorm", hidden, p + "nextn.hnorm", rows)
        joined = self.op(p + "eh_concat", "concat", [enorm, hnorm], (rows, 2 * e))
        return self.matmul(p + "eh_proj", joined, p + "nextn.eh_proj", rows, 2 * e, e)


def build_pass(model, kind: str, tokens: int, kv: KVType, layers=None, with_drafter: bool = False,
               drafter_kv_rows: bool = True) -> nx.DiGraph:
    """The graph of one pass over `tokens` positions.

    layers: the trunk blocks to include (default all). Blocks of one kind have identical graphs and only the
    residual stream crosses them, so the planner builds one block of each kind to size the arena
    (`representative_layers`), and codegen builds them all.
    with_drafter: a prefill chunk keeps every position's hidden state (`hidden_out`, the drafter's input) and,
    with drafter_kv_rows, stores the drafter's K/V for its positions in the same batched pass (without: the
    drafter's own pass stores them, a row at a time, from those hidden states).
    """
    if kind not in PASS_KINDS:
        raise ValueError(f"unknown pass kind {kind!r}; expected one of {PASS_KINDS}")
    if tokens < 1:
        raise ValueError("a pass needs at least one token")
    b = _Builder(model, kind, tokens, kv)
    hp = b.hp
    ids = b.op("token_ids", "input", [], (tokens,), dtype="i32")
    b.op("positions", "input", [], (tokens,), dtype="i32")    # each row's absolute position
    hidden_rows = kind == "prefill" and with_drafter and hp.n_nextn
    drafter_rows = hidden_rows and drafter_kv_rows
    if drafter_rows:    # written before the pass like the other inputs, so live from its start
        next_ids = b.op("next_token_ids", "input", [], (tokens,), dtype="i32")
    if kind == "draft":
        nextn = hp.n_trunk
        hidden = b.op("hidden_in", "input", [], (tokens, hp.n_embd))
        x = b.nextn_input(nextn, ids, hidden, tokens)
        x = b.attention_block(nextn, x, tokens)
        b.head(x, tokens, f"blk.{nextn}.nextn.shared_head_norm")
        return b.graph
    x = b.embed("embed", ids, tokens)
    for layer in range(hp.n_trunk) if layers is None else layers:
        x = b.attention_block(layer, x, tokens)
    head_rows = 1 if kind == "prefill" else tokens
    if hidden_rows:
        hidden = b.norm("hidden_out", x, "output_norm", tokens)   # h for every position feeds the drafter
        b.graph.nodes[hidden]["output"] = True     # read after the pass: the last row's by the first draft step
    if drafter_rows:
        drafter_x = b.nextn_input(hp.n_trunk, next_ids, hidden, tokens)
        b.attention_block(hp.n_trunk, drafter_x, tokens, compute_ffn=False)
    last = b.op("last_rows", "select_rows", [x], (head_rows, hp.n_embd)) if head_rows < tokens else x
    b.head(last, head_rows, "output_norm")
    if kind == "decode":
        hidden = b.graph.nodes["head_norm"]
        hidden["output"] = True      # the drafter's next input
    return b.graph


def argmax_blocks(n_vocab: int) -> int:
    """The runs of ARGMAX_BLOCK_VALUES logits a row's argmax is split into (Qwen3's 151936: 38)."""
    return -(-n_vocab // ARGMAX_BLOCK_VALUES)


def moe_groups_length(n_expert: int, n_pairs: int) -> int:
    """int32s of a `moe_groups` buffer: offsets[n_expert + 1] (expert e's pairs are pairs[offsets[e]:offsets[e+1]]),
    pairs[n_pairs] (pair row * k + slot, ascending within an expert), active[n_expert + 1] (the count of experts
    with pairs, then those experts ascending)."""
    return 2 * (n_expert + 1) + n_pairs


def representative_layers(hparams: HParams) -> list[int]:
    """One trunk block of each kind (leading dense, MoE): enough to size a pass's arena."""
    layers = [0] if hparams.n_leading_dense else []
    return layers + [hparams.n_leading_dense]


def representative_of(hparams: HParams, layer: int) -> int:
    """The representative of a trunk block's kind (the drafter's block stands for itself)."""
    if layer >= hparams.n_trunk:
        return layer
    return hparams.n_leading_dense if hparams.is_moe_layer(layer) else 0


def nodes_in_order(graph: nx.DiGraph) -> list[str]:
    return sorted(graph.nodes, key=lambda n: graph.nodes[n]["order"])


def launched(node: dict) -> bool:
    """Whether a node is a kernel launch of its own: not an input or a view, not computed by another's launch."""
    return node["op"] not in VIEW_OPS and "launched_by" not in node


def launch_members(graph: nx.DiGraph, name: str) -> list[str]:
    """The nodes the launch of `name` computes: itself, then those it fuses."""
    return [name, *graph.nodes[name].get("fuses", ())]


def written_at(graph: nx.DiGraph, name: str) -> str:
    """The node whose launch writes tensor `name`."""
    return graph.nodes[name].get("launched_by", name)
