"""A pass graph lowered: every node bound to its kernel, its weights, the K/V pages and its arena slice.

`lower` binds the graph's nodes, in order, each to a `Step` (a compiled kernel's launch function and the
device arrays it takes). Running a program is calling the steps in order on one stream; nothing is allocated
and nothing synchronises, so the runtime can capture a decode window's program into a CUDA graph and replay
it. The activation arena is the one the planner sized: every block's tensors sit at their representative
block's offsets (`codegen.memory.full_pass_offsets`).

A step and a tensor's view are made when first asked for: a new program's first run binds each step just
before it is launched, so the binding (Python: 10-20 ms for a 6-block prefill on the H200's host, mostly numba
making device array views) overlaps the GPU running the steps launched before it instead of delaying a prompt's
first kernel.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from codegen.graph import ROUTER_OPS, build_pass, launch_members, launched, nodes_in_order, representative_layers
from codegen.lower import attention, attention_combine, matmul, moe, pointwise
from codegen.lower.cuda import cuda
from codegen.memory import full_pass_offsets, plan_arena
from planner.architecture import tensor_layer

_DTYPES = {"f32": np.float32, "i32": np.int32}


@dataclass(frozen=True)
class Step:
    name: str           # the tensor the step writes
    launch: object
    args: tuple

    def run(self, stream) -> None:
        self.launch(stream, *self.args)


class Steps(Sequence):
    """A program's steps in launch order, each bound on first access (iterating binds them one by one)."""

    def __init__(self, lowering, names: list):
        self._lowering, self._names = lowering, names
        self._bound = {}

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.named(self._names[index])

    def named(self, name: str) -> Step:
        """The step that writes tensor `name`."""
        if name not in self._bound:
            self._bound[name] = self._lowering.step(name)
        return self._bound[name]


@dataclass
class Program:
    graph: object
    steps: Steps
    tensors: Mapping       # tensor name -> device array view into the arena

    def run(self, stream) -> None:
        for step in self.steps:
            step.run(stream)

    def bind(self) -> "Program":
        """Bind every step now (an engine's start: a node no kernel lowers fails there, not in a request)."""
        for _step in self.steps:
            pass
        return self


def arena_layout(model, kind: str, tokens: int, kv, with_drafter: bool = False, drafter_kv_rows: bool = True):
    """(full graph, arena bytes, offsets): the pass over every block, placed in the representative arena."""
    graph = build_pass(model, kind, tokens, kv, with_drafter=with_drafter, drafter_kv_rows=drafter_kv_rows)
    representative = build_pass(model, kind, tokens, kv, layers=representative_layers(model.hparams),
                                with_drafter=with_drafter, drafter_kv_rows=drafter_kv_rows)
    arena = plan_arena(representative)
    return graph, arena.size_bytes, full_pass_offsets(graph, arena, model.hparams)


class _ArenaViews(Mapping):
    """tensor name -> its device array view into the arena, made on first access."""

    def __init__(self, graph, arena, offsets: dict):
        self._graph, self._arena, self._offsets = graph, arena, offsets
        self._names = [name for name in nodes_in_order(graph)
                       if graph.nodes[name]["op"] == "select_rows" or graph.nodes[name]["out_bytes"]]
        self._known = set(self._names)
        self._views = {}

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self):
        return iter(self._names)

    def __getitem__(self, name: str):
        if name not in self._known:
            raise KeyError(name)
        if name not in self._views:
            node = self._graph.nodes[name]
            if node["op"] == "select_rows":      # the last rows of its input: a view, not a copy
                source = self[next(iter(self._graph.predecessors(name)))]
                self._views[name] = source[source.shape[0] - node["shape"][0]:]
            else:
                start = self._offsets[name]
                view = self._arena[start:start + node["out_bytes"]].view(_DTYPES[node["dtype"]])
                self._views[name] = view.reshape(node["shape"])
        return self._views[name]


class _Lowering:
    def __init__(self, graph, hparams, weights, kv_pages, page_tables, arena, offsets, expert_slots,
                 host_experts, host_kv, attention_windows, routed_ids, greedy):
        self.graph, self.hp, self.weights = graph, hparams, weights
        self.host_kv, self.attention_windows, self.routed_ids = host_kv, attention_windows, routed_ids
        self.greedy = greedy
        self.kv_pages, self.page_tables, self.expert_slots = kv_pages, page_tables, expert_slots
        self.host_experts = host_experts
        self.family = "prefill" if graph.graph["kind"] == "prefill" else "decode"
        self.kv_type = graph.graph["kv"]
        self.tensors = _ArenaViews(graph, arena, offsets)
        self.f32_placeholder = arena[:4].view(np.float32)     # never read: no bias; allocates nothing

    def weight(self, name: str):
        if name not in self.weights:
            raise KeyError(f"the model has no tensor {name!r}")
        return self.weights[name]

    def vector(self, name: str):
        """A norm weight or bias as a float32 vector."""
        return self.weight(name).data

    def step(self, name: str) -> Step:
        node, hp = self.graph.nodes[name], self.hp
        op, shape = node["op"], node["shape"]
        inputs = [self.tensors.get(p) for p in self.graph.predecessors(name)]
        out = self.tensors.get(name)
        layer = tensor_layer(name)
        weights = node["weights"]
        family = self.family
        if op == "embed":
            table = self.weight(weights[0])
            return Step(name, pointwise.make_embed(table.ggml_type, hp.n_embd), (inputs[0], table, out))
        if op == "rmsnorm":
            return Step(name, pointwise.make_rmsnorm(shape[1], hp.rms_eps), (inputs[0], self.vector(weights[0]), out))
        if op == "rope":        # q's, which rotates k too and stores k and v; with weights: each head is
            (x, positions), (k_name, store_name) = inputs, node["fuses"]    # RMSNormed first (qwen3moe)
            k_node = self.graph.nodes[k_name]
            _k, v_name, _positions = self.graph.predecessors(store_name)
            q_norm, k_norm = ((self.vector(weights[0]), self.vector(k_node["weights"][0])) if weights
                              else (self.f32_placeholder, self.f32_placeholder))
            launch = pointwise.make_rope(self.kv_type, shape[1] // hp.head_dim_k, k_node["shape"][1] // hp.head_dim_k,
                                         hp.head_dim_k, hp.head_dim_v, hp.n_rot, hp.rope_base,
                                         hp.rms_eps if weights else None, self.page_tokens(layer))
            return Step(name, launch, (x, q_norm, self.tensors[k_name], k_norm, self.tensors[v_name], positions,
                                       self.page_tables[layer], self.kv_pages[layer], self.host_kv.get(layer)))
        if op == "matmul" and "fuses" in node:     # a decode window's q, with k and v
            args, parts = [], []
            for member in launch_members(self.graph, name):
                member_node = self.graph.nodes[member]
                w, bias = self.matmul_weights(member_node)
                args += [w, bias, self.tensors[member]]
                parts.append(matmul.DecodePart(w.ggml_type, w.shape[-2], len(member_node["weights"]) > 1))
            return Step(name, matmul.make_qkv_matmul(hp.n_embd, tuple(parts)), (inputs[0], *args))
        if op == "matmul":      # in place on the residual stream, where there is one: out is its buffer
            w, bias = self.matmul_weights(node)
            has_bias = len(weights) > 1
            launch = matmul.make_matmul(node.get("family", family), w.ggml_type, w.shape[-1], w.shape[-2], has_bias,
                                        residual=node["inplace"] is not None)
            return Step(name, launch, (inputs[0], w, bias, out))
        if op == "swiglu_matmul":
            gate, up = self.weight(weights[0]), self.weight(weights[1])
            launch = matmul.make_swiglu_matmul(family, gate.ggml_type, gate.shape[-1], gate.shape[-2])
            return Step(name, launch, (inputs[0], gate, up, out))
        if op == "concat":
            a, b = inputs
            return Step(name, pointwise.make_concat(a.shape[1], b.shape[1]), (a, b, out))
        if op in ROUTER_OPS:    # top-k and route weights; a decode window's groups too (moe_route)
            bias = self.vector(weights[0]) if weights else self.f32_placeholder
            weighing = self.graph.nodes[node["fuses"][0]]      # the route weights' node (then the groups')
            make = moe.make_moe_route if op == "moe_route" else pointwise.make_router
            launch = make(hp.n_expert, hp.n_expert_used, node["gating"], weighing["normalize"], weighing["scale"])
            host_ids = (self.routed_ids.get(layer),) if op == "moe_route" else ()   # (None: the arena's only)
            return Step(name, launch, (inputs[0], bias, out, *(self.tensors[m] for m in node["fuses"]), *host_ids))
        if op == "argmax_partials":
            return Step(name, pointwise.make_argmax_partials(hp.n_vocab), (inputs[0], out))
        if op == "argmax":
            return Step(name, pointwise.make_argmax(hp.n_vocab), (inputs[0], out, self.greedy))
        if op == "moe_groups":
            return Step(name, moe.make_moe_groups(hp.n_expert, hp.n_expert_used), (inputs[0], out))
        if op == "moe_swiglu_matmul":
            h, groups = inputs
            gate, up = self.weight(weights[0]), self.weight(weights[1])
            launch = moe.make_moe_swiglu_matmul(family, gate.ggml_type, gate.shape[-1], gate.shape[-2],
                                                   hp.n_expert, hp.n_expert_used, gate.slot_bytes)
            host_gate, host_up, _ = self.host_experts.get(layer, (gate, up, None))     # none: the slot arrays
            return Step(name, launch, (h, groups, self.expert_slots[layer], gate, up, host_gate, host_up, out))
        if op == "moe_down_matmul":
            # h: an input only to stay live (codegen.graph); decode: then the residual stream, out's buffer
            act, groups, *route_weights = inputs[:3] if family == "decode" else inputs[:2]
            down = self.weight(weights[0])
            launch = moe.make_moe_down_matmul(family, down.ggml_type, down.shape[-1], down.shape[-2],
                                                 hp.n_expert, hp.n_expert_used, down.slot_bytes)
            host_down = self.host_experts.get(layer, (None, None, down))[2]
            # prefill: no route weights (its terms are weighed by the combine)
            return Step(name, launch, (act, groups, *route_weights, self.expert_slots[layer], down, host_down, out))
        if op == "moe_combine":     # terms, ids, route weights, then the residual stream: out's buffer
            return Step(name, moe.make_moe_combine(hp.n_embd, hp.n_expert_used), (*inputs[:3], out))
        if op == "attention":
            q, _stored, positions = inputs
            launch = attention.make_attention(family, self.kv_type, hp.n_head, hp.n_head_kv, hp.head_dim_k,
                                              hp.head_dim_v, self.page_tokens(layer),
                                              self.attention_windows.get(layer, 0))
            return Step(name, launch, (q, positions, self.page_tables[layer], self.kv_pages[layer], out,
                                       self.host_kv.get(layer)))
        if op == "attention_combine":
            return Step(name, attention_combine.make_attention_combine(hp.n_head, hp.head_dim_v), (inputs[0], out))
        raise ValueError(f"no kernel lowers op {op!r} (node {name})")

    def matmul_weights(self, node: dict) -> tuple:
        """(weight, bias or the placeholder) of a matmul node."""
        weights = node["weights"]
        return self.weight(weights[0]), self.vector(weights[1]) if len(weights) > 1 else self.f32_placeholder

    def page_tokens(self, layer: int) -> int:
        return self.kv_pages[layer].page_tokens


def lower(graph, hparams, weights: dict, kv_pages: dict, page_tables: dict, arena, offsets: dict,
          expert_slots: dict | None = None, host_experts: dict | None = None, host_kv: dict | None = None,
          attention_windows: dict | None = None, routed_ids: dict | None = None, greedy=None) -> Program:
    """Bind every node of `graph` to its kernel.

    weights: GGUF tensor name -> DeviceWeight; kv_pages: layer -> the layer's K/V pages on the device
    (`kv_pages.kv_arrays(...)`, allocated); page_tables: layer -> int32 device array (logical page -> slot);
    arena: a device uint8 array of the pass's arena bytes; offsets: tensor -> byte offset (`arena_layout`);
    expert_slots: MoE layer -> int32 device array (expert id -> index in that layer's expert weights, the
    VRAM slot arrays; -1: read from the host copy; the identity when omitted); host_experts: MoE layer ->
    (host_gate, host_up, host_down) DeviceWeights of every expert (n_expert, ...), the mapped host copy that
    experts with slot -1 are read from (a layer without: its slot arrays are passed as the host arrays, so
    with every slot >= 0 nothing changes); host_kv: layer -> the host copy of its K/V pages (the whole context,
    page p at index p, mapped host memory): stores write through to it, and attention reads a page from it when
    the page table says -1 (a layer without: every page must have a slot); attention_windows: layer -> the
    positions a row's attention reaches back (the drafter's window; a layer without reads its whole context);
    routed_ids: MoE layer -> a (MAX_WINDOW, k) int32 device view of mapped host memory where a decode window's
    routing launch writes its ids too, for the host to read after the step (a layer without: only the arena);
    greedy: a (MAX_WINDOW,) int32 device view of mapped host memory where the argmax writes the pass's greedy
    tokens too (none: only the arena).
    The steps launch the MoE kernels over every expert (lo=0, hi=None). A node's kernel, weights and tables
    are checked when its step is bound (on first use).
    """
    if expert_slots is None:
        identity = cuda.to_device(np.arange(hparams.n_expert, dtype=np.int32))
        expert_slots = {layer: identity for layer in range(hparams.n_layer)}
    lowering = _Lowering(graph, hparams, weights, kv_pages, page_tables, arena, offsets, expert_slots,
                         host_experts or {}, host_kv or {}, attention_windows or {}, routed_ids or {}, greedy)
    names = [name for name in nodes_in_order(graph) if launched(graph.nodes[name])]
    return Program(graph, Steps(lowering, names), lowering.tensors)
