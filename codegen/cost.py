"""Time of a pass on a GPU: each node takes its family's latency plus its roofline time, max(FLOPs / peak,
bytes / bandwidth), over its family's efficiency (`planner.profile.Kernels`, measured by `stratum profile
--detect`; an uncalibrated profile prices the plain roofline).

Activations are float32 and the kernels run on CUDA cores, so the FP32 peak is the compute roof. The graph
may hold one representative block per kind (`graph.representative_layers`); each representative stands for
every block of its kind that the device runs, with that block's own weight bytes, so the cost is exact
without building the full graph. Routed experts are costed here only for their arithmetic and activations:
whether an expert's bytes come from a cache slot, the prefill ring or mapped host memory is the planner's
business (`planner.predict`).

Times take numpy arrays for the context: the planner evaluates many candidate layouts at once.
"""

from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from codegen.graph import representative_of
from planner.architecture import tensor_layer
from planner.profile import GPU, KernelFit

MATMUL_OPS = ("matmul", "swiglu_matmul")
ATTENTION_OPS = ("attention", "attention_combine")


def kernel_family(node: dict, decode: bool) -> str:
    """The `planner.profile.Kernels` field that prices a node: its kind's, in the decode or the prefill family."""
    kind = ("experts" if "expert_layer" in node else "matmul" if node["op"] in MATMUL_OPS
            else "attention" if node["op"] in ATTENTION_OPS else "grouping" if node["op"] == "moe_groups"
            else "small")
    return f"{'decode' if decode else 'prefill'}_{kind}"


def kernel_fit(gpu: GPU, node: dict, decode: bool) -> KernelFit:
    return getattr(gpu.kernels, kernel_family(node, decode))


def fitted_s(fit: KernelFit, roofline_s):
    return fit.latency_s + roofline_s / fit.efficiency


@dataclass
class PassCost:
    fixed_s: float = 0.0              # every node but attention and routed experts
    attention: list = field(default_factory=list)   # (flops, flops per context token, bytes, K/V bytes per
    #                                                    resident context token, blocks it stands for, its fit)
    block_fixed_s: float = 0.0        # one MoE block's fixed part (attention excluded): the ring's prefetch window
    expert_compute_s: float = 0.0     # one MoE block's expert arithmetic and activations (weights excluded)
    expert_efficiency: float = 1.0    # the expert kernels' fit: the planner divides their weight reads by it
    kv_bytes_per_token: int = 0       # K/V bytes one context position adds, over all the pass's blocks
    n_nodes: int = 0                  # kernel launches the pass replays
    peak_flops: float = 1.0
    bandwidth: float = 1.0

    def attention_s(self, context_tokens, resident_tokens, per_block: bool = False):
        total = 0.0
        for flops, flops_per_token, moved, kv_per_token, blocks, fit in self.attention:
            seconds = fitted_s(fit, np.maximum((flops + flops_per_token * context_tokens) / self.peak_flops,
                                               (moved + kv_per_token * resident_tokens) / self.bandwidth))
            if per_block:
                return seconds
            total = total + blocks * seconds
        return total

    def dense_s(self, context_tokens, resident_tokens):
        """Everything but the routed experts, with `resident_tokens` of the context's K/V read from VRAM."""
        return self.fixed_s + self.attention_s(context_tokens, resident_tokens)

    def block_s(self, context_tokens, resident_tokens):
        """One MoE block's dense part: the time the prefill ring's copy engine idles in each streaming block (its
        experts are known only once its router has run)."""
        return self.block_fixed_s + self.attention_s(context_tokens, resident_tokens, per_block=True)


def pass_cost(graph: nx.DiGraph, gpu: GPU, model, blocks, with_globals: tuple = (True, True)) -> PassCost:
    """Cost of `graph` run over trunk `blocks` (plus the drafter's block where the graph has it).

    with_globals: (runs the embedding, runs the output head), for a device holding part of the blocks.
    """
    hp = model.hparams
    represented = {}            # representative block -> the blocks it stands for
    for block in blocks:
        represented.setdefault(representative_of(hp, block), []).append(block)
    cost = PassCost(peak_flops=gpu.fp32_flops, bandwidth=gpu.memory_bandwidth_bytes_per_s)
    decode = graph.graph["kind"] != "prefill"
    cost.expert_efficiency = (gpu.kernels.decode_experts if decode else gpu.kernels.prefill_experts).efficiency
    for name, node in graph.nodes(data=True):
        if node["op"] == "input":
            continue
        rep = tensor_layer(name)
        if rep is None or rep >= hp.n_trunk:
            # the embedding runs where the first block is; the head and the drafter where the last one is
            stands_for = [None] if with_globals[0 if name == "embed" else 1] else []
        else:
            stands_for = represented.get(rep, [])
        if not stands_for:
            continue
        activations = activation_bytes(graph, name)
        cost.n_nodes += len(stands_for)
        fit = kernel_fit(gpu, node, decode)
        if node["op"] == "attention":
            moved = activations + node["weight_bytes"]
            cost.attention.append((node["flops"], node["flops_per_context_token"], moved, node["kv_read"],
                                   len(stands_for), fit))
            cost.kv_bytes_per_token += node["kv_read"] * len(stands_for)
            continue
        moved = activations + node.get("kv_write", 0)
        if "expert_layer" in node:
            cost.expert_compute_s += fitted_s(fit, max(node["flops"] / gpu.fp32_flops,
                                                       moved / gpu.memory_bandwidth_bytes_per_s))
            continue
        if stands_for == [None]:
            weights = np.array([node["weight_bytes"]], dtype=np.float64)
        else:
            weights = model.block_weight_bytes(tuple(node["weights"]), rep, tuple(stands_for))
        seconds = fitted_s(fit, np.maximum(node["flops"] / gpu.fp32_flops,
                                           (moved + weights) / gpu.memory_bandwidth_bytes_per_s))
        cost.fixed_s += float(seconds.sum())
        if rep is not None and rep in stands_for and hp.is_moe_layer(rep):
            cost.block_fixed_s += float(seconds[stands_for.index(rep)])
    return cost


def activation_bytes(graph: nx.DiGraph, name: str) -> int:
    """The activations a node reads and writes."""
    return graph.nodes[name]["out_bytes"] + sum(graph.nodes[p]["out_bytes"] for p in graph.predecessors(name))


def node_roofline_s(graph: nx.DiGraph, name: str, gpu: GPU, model, context_tokens: int) -> float:
    """The roofline time of one node of a pass graph that holds every block, with `context_tokens` of K/V in
    VRAM: its FLOPs at the FP32 peak or its bytes at the read bandwidth, whichever is longer (what
    `pass_cost` charges it, before calibration). A routed-expert node reads the weights of as many experts as
    its rows can use (k a row, at most all of them)."""
    node = graph.nodes[name]
    flops, moved = node["flops"], activation_bytes(graph, name) + node.get("kv_write", 0)
    if node["op"] == "attention":
        flops += node["flops_per_context_token"] * context_tokens
        moved += node["weight_bytes"] + node["kv_read"] * context_tokens
    elif "expert_layer" in node:
        hp = model.hparams
        used = min(hp.n_expert, graph.graph["tokens"] * hp.n_expert_used)
        moved += sum(model.tensor_bytes[w] for w in node["weights"]) * used / hp.n_expert
    else:
        moved += node["weight_bytes"]
    return max(flops / gpu.fp32_flops, moved / gpu.memory_bandwidth_bytes_per_s)
