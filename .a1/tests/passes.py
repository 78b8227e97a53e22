"""Whole passes of a GGUF model run through the lowered kernels, for tests: a prompt read in chunks of a chosen
size, then decode windows. K/V pages are a plain table (page p in slot p) with room for `max_tokens`."""

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import launch_members
from codegen.lower.kv_pages import kv_arrays
from codegen.lower.cuda import cuda
from codegen.lower.program import arena_layout, lower
from codegen.lower.weights import read_gguf, upload
from planner.header import read_header
from planner.kv import parse_kv_type
from planner.model import inventory


class PassRunner:
    def __init__(self, model_path, kv: str = "f32", page_tokens: int = 16, max_tokens: int = 128):
        header = read_header(model_path)
        self.model = inventory(header, name=str(model_path))
        self.hp = self.model.hparams
        self.kv = parse_kv_type(kv)
        self.weights = {name: upload(packed) for name, packed in read_gguf(model_path, header).items()}
        n_pages = -(-max_tokens // page_tokens)
        self.page_table = cuda.to_device(np.arange(n_pages, dtype=np.int32))
        layers = range(self.hp.n_layer)
        self.kv_pages = {layer: kv_arrays(kv, n_pages, page_tokens, self.hp.n_head_kv, self.hp.head_dim_k,
                                          self.hp.head_dim_v).allocate() for layer in layers}
        self.page_tables = {layer: self.page_table for layer in layers}
        self.programs = {}
        self.stream = cuda.stream()

    def program(self, kind: str, tokens: int):
        key = (kind, tokens)
        if key not in self.programs:
            graph, arena_bytes, offsets = arena_layout(self.model, kind, tokens, self.kv)
            # poisoned: 0xFF bytes read as float32 are NaN, so a kernel reading bytes no kernel wrote shows
            arena = cuda.to_device(np.full(arena_bytes, 0xFF, np.uint8))
            self.programs[key] = lower(graph, self.hp, self.weights, self.kv_pages, self.page_tables, arena, offsets)
        return self.programs[key]

    def _run(self, kind: str, token_ids, start: int) -> np.ndarray:
        program = self.program(kind, len(token_ids))
        program.tensors["token_ids"].copy_to_device(np.asarray(token_ids, dtype=np.int32), stream=self.stream)
        positions = np.arange(start, start + len(token_ids), dtype=np.int32)
        program.tensors["positions"].copy_to_device(positions, stream=self.stream)
        program.run(self.stream)
        logits = program.tensors["logits"].copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return logits

    def prefill(self, token_ids, chunk: int, start: int = 0) -> np.ndarray:
        """Read the prompt in chunks of `chunk` tokens; returns each chunk's last-position logits
        (n_chunks, vocab): with chunks of 1, every position's."""
        return np.stack([self._run("prefill", token_ids[begin:begin + chunk], start + begin)[-1]
                         for begin in range(0, len(token_ids), chunk)])

    def decode(self, token_ids, start: int) -> np.ndarray:
        """One decode window over `token_ids` at positions start..; returns (window, vocab) logits."""
        return self._run("decode", token_ids, start)

    def stored_kv(self, n_positions: int) -> dict:
        """trunk layer -> (K, V), float64 [n_positions, n_kv * head dim]: what the kernels stored for positions
        0..n-1, dequantized (f32, f16 and q8_0 K/V; the runner's page table is the identity)."""
        page_tokens = next(iter(self.kv_pages.values())).page_tokens
        positions = np.arange(n_positions)
        pages, rows = positions // page_tokens, positions % page_tokens
        n_kv = self.hp.n_head_kv

        def values(data, scales, ggml_type, head_dim):
            words = data.copy_to_host()
            if ggml_type in (T.F32, T.F16):
                per_row = words.view(np.float32 if ggml_type == T.F32 else np.float16)
                table = per_row.reshape(len(words), n_kv, page_tokens, head_dim).astype(np.float64)
            elif ggml_type == T.Q8_0:
                quants = words.view(np.int8).reshape(len(words), n_kv, page_tokens, head_dim // 32, 32)
                block_scales = scales.copy_to_host().reshape(len(words), n_kv, page_tokens, head_dim // 32, 1)
                table = (quants * block_scales.astype(np.float64)).reshape(len(words), n_kv, page_tokens, head_dim)
            else:
                raise NotImplementedError(f"stored_kv reads f32, f16 and q8_0 K/V, not {ggml_type.name}")
            return table[pages, :, rows, :].reshape(n_positions, n_kv * head_dim)

        return {layer: (values(kv.k_data, kv.k_scales, self.kv.k_type, self.hp.head_dim_k),
                        values(kv.v_data, kv.v_scales, self.kv.v_type, self.hp.head_dim_v))
                for layer, kv in self.kv_pages.items() if layer < self.hp.n_trunk}

    def kv_bytes(self) -> list:
        """Every layer's K/V pages, as host bytes (to compare layouts bitwise)."""
        return [np.concatenate([np.ascontiguousarray(a.copy_to_host()).reshape(-1).view(np.uint8)
                                for a in pages.arrays()]) for pages in self.kv_pages.values()]


def node_errors(runner: PassRunner, kind: str, token_ids, start: int = 0, reference_model=None) -> list:
    """Run one pass step by step and compare every node's output with its float64 reference op computed from
    the node's actual inputs: [(tensor, relative L2 error)], pinpointing the first kernel that goes wrong."""
    from runtime import reference as ref
    model = reference_model or ref.load(runner.model.source)
    hp = runner.hp
    program = runner.program(kind, len(token_ids))
    program.tensors["token_ids"].copy_to_device(np.asarray(token_ids, dtype=np.int32))
    positions = np.arange(start, start + len(token_ids), dtype=np.int32)
    program.tensors["positions"].copy_to_device(positions)
    graph, host, errors = program.graph, {}, []
    keys, values = {}, {}
    for step in program.steps:
        step.run(0)
        cuda.synchronize()
        for name in launch_members(graph, step.name):     # the launch's own node, then those it computes
            node = graph.nodes[name]
            inputs = [host[p] if p in host else program.tensors[p].copy_to_host() if p in program.tensors
                      else None for p in graph.predecessors(name)]
            w = [model.weights[n] for n in node["weights"]]
            op, layer = node["op"], name.split(".")[1] if name.startswith("blk.") else None
            got = program.tensors[name].copy_to_host() if name in program.tensors else None
            if op == "embed":
                want = w[0][np.asarray(token_ids)]
            elif op == "rmsnorm":
                want = ref.rmsnorm(inputs[0], w[0], hp.rms_eps)
            elif op == "rope":
                n_heads = inputs[0].shape[1] // hp.head_dim_k
                normed = ref.head_rmsnorm(inputs[0], w[0], n_heads, hp.rms_eps) if w else inputs[0]
                want = ref.rope_neox(normed, positions, n_heads, hp.n_rot, hp.rope_base)
            elif op == "matmul":        # a second input: the residual stream it adds to
                want = inputs[0] @ w[0].T + (w[1] if len(w) > 1 else 0) + (inputs[1] if len(inputs) > 1 else 0)
            elif op == "swiglu_matmul":
                want = ref.swiglu(inputs[0], w[0], w[1])
            elif op == "kv_store":
                keys[layer] = ref.kv_round(inputs[0], runner.kv.k_type)
                values[layer] = ref.kv_round(inputs[1], runner.kv.v_type)
                continue
            elif op == "attention" and kind == "prefill" and start == 0:
                want = ref.attention(inputs[0], keys[layer], values[layer], positions, hp.n_head, hp.n_head_kv)
            elif op == "topk":
                gating = node["gating"]
                want = ref.route(inputs[0], hp.n_expert_used, gating, bias=w[0] if w else None)[0]
            elif op == "route_weights":
                logits = inputs[0].astype(np.float64)
                if graph.nodes[f"blk.{layer}.topk"]["gating"] == "softmax":
                    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
                    probs /= probs.sum(axis=1, keepdims=True)
                else:
                    probs = 1 / (1 + np.exp(-logits))
                want = np.take_along_axis(probs, inputs[1].astype(np.int64), axis=1)
                if node["normalize"]:
                    want = want / want.sum(axis=1, keepdims=True)
                want = want * node["scale"]
            elif op == "moe_swiglu_matmul":
                ids = host[f"blk.{layer}.topk"]
                rows = [ref.swiglu(inputs[0][r:r + 1], w[0][e], w[1][e])[0] for r in range(len(ids)) for e in ids[r]]
                want = np.stack(rows)
            elif op == "moe_down_matmul" and kind == "prefill":     # a term per pair, weighed by the combine
                ids = host[f"blk.{layer}.topk"].reshape(-1)
                want = np.stack([w[0][e] @ inputs[0][p] for p, e in enumerate(ids)])
            elif op == "moe_down_matmul":
                ids, k = host[f"blk.{layer}.topk"], hp.n_expert_used
                route_w, residual = inputs[2], inputs[4]
                want = residual + np.stack([sum(route_w[r, j] * (w[0][ids[r, j]] @ inputs[0][r * k + j])
                                                for j in range(k))
                                            for r in range(len(ids))])
            elif op == "moe_combine":
                terms, _ids, route_w, residual = inputs
                k = hp.n_expert_used
                want = residual + np.stack([sum(route_w[r, j] * terms[r * k + j].astype(np.float64) for j in range(k))
                                            for r in range(len(route_w))])
            else:
                want = None
            if got is not None:
                host[name] = got
            if want is not None:
                want = np.asarray(want, dtype=np.float64)
                errors.append((name, float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))))
    return errors
