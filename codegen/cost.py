"""Roofline time of a pass graph on a GPU: each node takes max(FLOPs / peak, bytes / bandwidth).

Activations are float32 and the kernels run on CUDA cores, so the FP32 peak is the compute roof. Routed
experts are not costed here beyond their arithmetic: whether an expert's bytes come from a cache slot, the
prefill ring or mapped host memory is the planner's business (`planner.predict`), so their weight bytes are
returned apart, per layer.
"""

from dataclasses import dataclass, field

import networkx as nx

from planner.profile import GPU


@dataclass
class PassCost:
    dense_s: float = 0.0                  # every node but the routed-expert ops, weights read from VRAM
    expert_compute_s: dict = field(default_factory=dict)   # layer -> arithmetic + activations of its expert ops
    kv_read_bytes_per_token: int = 0      # K/V bytes one more context position adds to the pass
    n_nodes: int = 0                      # kernel launches (graph nodes) the pass replays

    def launch_s(self, gpu: GPU) -> float:
        return self.n_nodes * gpu.graph_node_overhead_s


def pass_cost(graph: nx.DiGraph, gpu: GPU, context_tokens: int, resident_tokens: int | None = None) -> PassCost:
    """Cost of one pass whose attention spans `context_tokens` positions, of which `resident_tokens` (default
    all) are in VRAM; the K/V of the others is the planner's to stream."""
    resident = context_tokens if resident_tokens is None else min(resident_tokens, context_tokens)
    cost = PassCost()
    for name, node in graph.nodes(data=True):
        if node["op"] in ("input",):
            continue
        cost.n_nodes += 1
        flops = node["flops"] + node.get("flops_per_context_token", 0.0) * context_tokens
        moved = node["out_bytes"] + sum(graph.nodes[p]["out_bytes"] for p in graph.predecessors(name))
        kv_read = node.get("kv_read", 0)
        cost.kv_read_bytes_per_token += kv_read
        moved += node["weight_bytes"] + kv_read * resident + node.get("kv_write", 0)
        seconds = max(flops / gpu.fp32_flops, moved / gpu.memory_bandwidth_bytes_per_s)
        if "expert_layer" in node:
            layer = node["expert_layer"]
            cost.expert_compute_s[layer] = cost.expert_compute_s.get(layer, 0.0) + seconds
        else:
            cost.dense_s += seconds
    return cost
