"""The oracle: a numpy float64 forward pass of qwen3moe and glm4moe, following llama.cpp's conventions.

The building blocks below are what every kernel test compares with; `forward` chains them over a GGUF file,
whose tensors gguf-py dequantizes to float64 (`load`). Conventions, checked against llama.cpp's source
(src/models/qwen3moe.cpp, glm4-moe.cpp, llama-graph.cpp build_moe_ffn, llama-model.cpp llama_model_rope_type):
  - linear weights are numpy (out, in): y = x @ W.T (+ bias where the file has one); routed experts are
    (n_expert, out, in); a missing `output.weight` means the head is tied to `token_embd.weight`;
  - RMSNorm: x / sqrt(mean(x^2) + eps) * w;
  - a block: h = attn_norm(x); q, k, v = h @ W.T (+ q/k/v bias: glm4moe has them); q and k are RMS-normed per
    head before RoPE (qwen3moe always; glm4moe only if `attn_q_norm`/`attn_k_norm` exist); x += attention @ Wo.T;
    then the FFN on ffn_norm(x) (glm4moe: post_attention_norm(x)), added to x;
  - NEOX RoPE (both architectures) on the first `n_rot` dims of each head (glm4moe: rope.dimension_count, part
    of the head), pairs (i, i + n_rot/2), theta = pos * base^(-2i/n_rot); the other dims pass through;
  - attention: scale 1/sqrt(head_dim), causal, query head h reads K/V head h // (n_head / n_head_kv);
  - the K/V cache stores K (after RoPE) and V rounded through its type (f32, f16, q8_0, q4_0 as ggml quantizes);
  - FFNs are SwiGLU: down(silu(gate(h)) * up(h)); glm4moe's leading blocks are dense (ffn_gate/up/down);
  - routing: qwen3moe takes softmax probabilities' top k and renormalises them (no scale); glm4moe selects on
    sigmoid + exp_probs_b but weights by the unbiased sigmoid (renormalised when expert_weights_norm),
    times expert_weights_scale; ties go to the lower expert index; glm4moe adds its shared expert's FFN;
  - after the trunk: output_norm, then the output head; the normed hidden state is what the drafter reads;
  - glm4moe's NextN block (the drafter) at position i: eh_proj([enorm(embed(t[i+1])) ; hnorm(h[i])]) through
    the block's attention (its own K/V) and MoE FFN, then shared_head_norm and the head (`nextn.shared_head_head`
    if the file has it, else `output.weight`); the embedding is `nextn.embed_tokens` if present, else
    `token_embd` (as llama.cpp's MTP graph for glm4moe does).
Independently, tests/test_reference.py runs the whole forward pass of both architectures against Hugging Face
transformers' Qwen3MoeForCausalLM and Glm4MoeForCausalLM in float64 (relative L2 about 1e-7).
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, quants
from gguf.constants import GGMLQuantizationType as T

from planner.architecture import HParams
from planner.errors import StratumError
from planner.kv import KVType, parse_kv_type, row_bytes
from planner.model import load_model


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, dtype=np.float64)


def head_rmsnorm(x: np.ndarray, weight: np.ndarray, n_heads: int, eps: float) -> np.ndarray:
    """RMSNorm of each head of rows laid out (rows, n_heads * head_dim), one weight for every head."""
    rows = np.asarray(x, dtype=np.float64).reshape(len(x), n_heads, -1)
    return rmsnorm(rows, weight, eps).reshape(len(x), -1)


def rope_neox(x: np.ndarray, positions: np.ndarray, n_heads: int, n_rot: int, base: float) -> np.ndarray:
    heads = np.array(x, dtype=np.float64).reshape(len(x), n_heads, -1)
    half = n_rot // 2
    theta = np.asarray(positions, dtype=np.float64)[:, None] * base ** (-2.0 * np.arange(half) / n_rot)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = heads[..., :half].copy(), heads[..., half:n_rot].copy()
    heads[..., :half] = x0 * cos - x1 * sin
    heads[..., half:n_rot] = x0 * sin + x1 * cos
    return heads.reshape(len(x), -1)


def kv_round(x: np.ndarray, ggml_type) -> np.ndarray:
    """Rows as the K/V cache holds them: rounded through `ggml_type` (blocks run along each row)."""
    ggml_type = T(ggml_type)
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if ggml_type == T.F32:
        return x32.astype(np.float64)
    return quants.dequantize(quants.quantize(x32, ggml_type), ggml_type).astype(np.float64).reshape(x32.shape)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray, n_head: int,
              n_head_kv: int) -> np.ndarray:
    """Causal GQA attention. q (rows, n_head*dk) at `q_positions`; k (ctx, n_kv*dk), v (ctx, n_kv*dv) hold
    positions 0..ctx-1; the query at position p reads keys 0..p. Returns (rows, n_head*dv)."""
    rows, ctx = len(q), len(k)
    qh = np.asarray(q, dtype=np.float64).reshape(rows, n_head, -1)
    kh = np.asarray(k, dtype=np.float64).reshape(ctx, n_head_kv, -1)
    vh = np.asarray(v, dtype=np.float64).reshape(ctx, n_head_kv, -1)
    group = n_head // n_head_kv
    kh, vh = np.repeat(kh, group, axis=1), np.repeat(vh, group, axis=1)
    scores = np.einsum("rhd,chd->rhc", qh, kh) / np.sqrt(qh.shape[-1])
    visible = np.arange(ctx)[None, :] <= np.asarray(q_positions)[:, None]
    scores = np.where(visible[:, None, :], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("rhc,chd->rhd", probs, vh).reshape(rows, -1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return silu(x @ gate.T) * (x @ up.T)


def route(logits: np.ndarray, k: int, gating: str, bias: np.ndarray | None = None, normalize: bool = True,
          scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Top-k experts per row and their weights: (ids int32 (rows, k) best first, weights float64 (rows, k))."""
    logits = np.asarray(logits, dtype=np.float64)
    if gating == "softmax":
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        scores = probs
    elif gating == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
        scores = probs if bias is None else probs + np.asarray(bias, dtype=np.float64)
    else:
        raise ValueError(f"unknown gating {gating!r}")
    ids = np.argsort(-scores, axis=-1, kind="stable")[:, :k].astype(np.int32)
    weights = np.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights * scale


def moe(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate_exps: np.ndarray, up_exps: np.ndarray,
        down_exps: np.ndarray) -> np.ndarray:
    """Routed experts: each row's k experts' SwiGLU FFNs, summed with the route weights."""
    out = np.zeros((len(x), down_exps.shape[1]))
    for row in range(len(x)):
        for expert, weight in zip(ids[row], weights[row]):
            out[row] += weight * (swiglu(x[row:row + 1], gate_exps[expert], up_exps[expert]) @ down_exps[expert].T)[0]
    return out


# ---- the model-level forward pass over a GGUF file ----

@dataclass(frozen=True)
class ReferenceModel:
    """A GGUF model with every tensor dequantized to float64, in numpy order."""
    path: str
    hparams: HParams
    weights: dict           # tensor name -> float64 ndarray: linear (out, in), experts (n_expert, out, in)

    def weight(self, name: str) -> np.ndarray:
        if name not in self.weights:
            raise StratumError(f"missing tensor {name!r} that {self.hparams.architecture} needs", source=self.path)
        return self.weights[name]

    def optional(self, name: str) -> np.ndarray | None:
        return self.weights.get(name)


def load(model_path) -> ReferenceModel:
    """Hyperparameters from the planner's header reader (which checks the layout), tensors dequantized by gguf-py.
    Loads are cached per path in-process (a file rewritten since is read again)."""
    path = Path(model_path).resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise StratumError(f"cannot read GGUF file: {e.strerror or e}", source=str(model_path)) from None
    return _load(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> ReferenceModel:
    hparams = load_model(path).hparams
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise StratumError(f"cannot read the tensor data: {e}", source=path) from None
    weights = {}
    for tensor in reader.tensors:
        values = quants.dequantize(tensor.data, tensor.tensor_type)
        weights[tensor.name] = values.astype(np.float64).reshape(tuple(int(d) for d in reversed(tensor.shape)))
    return ReferenceModel(path, hparams, weights)


def forward(model, token_ids, kv_type: str = "f32", kv_cache: dict | None = None) -> np.ndarray:
    """float64 logits [len(token_ids), n_vocab] for every position 0..n-1. `model`: a path or a ReferenceModel;
    `kv_type`: a planner K/V type name (f32, f16, q8_0, q4_0, k8v4, ...), the K/V cache's rounding.
    `kv_cache`: trunk layer -> (K, V) [n, n_kv * head dim] to attend to instead of the rounded K/V this pass
    computes (a kernel pass's stored K/V: its rounding, not the reference's, is then the cache's), and where
    each layer's own rounded (K, V) is left when the dict starts empty."""
    return forward_states(model, token_ids, kv_type, kv_cache)[0]


def forward_states(model, token_ids, kv_type: str = "f32", kv_cache: dict | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(logits [n, n_vocab], hidden [n, n_embd]): the hidden state after output_norm, the drafter's input."""
    model = _as_model(model)
    x = _trunk(model, token_ids, _kv(model, kv_type), kv_cache=kv_cache)
    hidden = rmsnorm(x, model.weight("output_norm.weight"), model.hparams.rms_eps)
    return _head(model, hidden, "output.weight"), hidden


def routing(model, token_ids, kv_type: str = "f32") -> dict[int, np.ndarray]:
    """The experts each position selects in each MoE trunk block: layer -> int32 ids (n, n_expert_used)."""
    model = _as_model(model)
    routes: dict[int, np.ndarray] = {}
    _trunk(model, token_ids, _kv(model, kv_type), routes)
    return routes


def nextn_forward(model, token_ids, kv_type: str = "f32") -> np.ndarray:
    """glm4moe's NextN block (the drafter) over positions 0..n-2: row i reads the trunk's hidden state at i and
    the token at i + 1, and gives the logits of the token at i + 2. Returns [len(token_ids) - 1, n_vocab]."""
    model = _as_model(model)
    hp = model.hparams
    if hp.n_nextn == 0:
        raise StratumError(f"this {hp.architecture} model has no NextN layer (nextn_predict_layers is 0), "
                           "so there is no drafter to run", source=model.path)
    token_ids = _token_ids(model, token_ids)
    if len(token_ids) < 2:
        raise ValueError("the NextN block needs at least two tokens: a hidden state and the token after it")
    kv = _kv(model, kv_type)
    _, hidden = forward_states(model, token_ids, kv_type)
    layer = hp.n_trunk
    p = f"blk.{layer}.nextn."
    table = model.optional(p + "embed_tokens.weight")
    table = model.weight("token_embd.weight") if table is None else table
    embedded = rmsnorm(table[token_ids[1:]], model.weight(p + "enorm.weight"), hp.rms_eps)
    previous = rmsnorm(hidden[:-1], model.weight(p + "hnorm.weight"), hp.rms_eps)
    x = _linear(model, p + "eh_proj", np.concatenate([embedded, previous], axis=1))
    x = _block(model, layer, x, np.arange(len(x)), kv)
    out = rmsnorm(x, model.weight(p + "shared_head_norm.weight"), hp.rms_eps)
    return _head(model, out, p + "shared_head_head.weight")


def _as_model(model) -> ReferenceModel:
    return model if isinstance(model, ReferenceModel) else load(model)


def _kv(model: ReferenceModel, kv_type: str) -> KVType:
    kv = parse_kv_type(kv_type)
    hp = model.hparams
    row_bytes(hp.n_head_kv * hp.head_dim_k, kv.k_type)     # refuses a row that is not whole quant blocks
    row_bytes(hp.n_head_kv * hp.head_dim_v, kv.v_type)
    return kv


def _token_ids(model: ReferenceModel, token_ids) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or len(ids) == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError("token_ids must be a non-empty 1-D sequence of integers")
    if ids.min() < 0 or ids.max() >= model.hparams.n_vocab:
        raise ValueError(f"token ids must lie in [0, {model.hparams.n_vocab})")
    return ids.astype(np.int64)


def _trunk(model: ReferenceModel, token_ids, kv: KVType, routes: dict | None = None,
           kv_cache: dict | None = None) -> np.ndarray:
    """The residual stream after the last trunk block, positions 0..n-1."""
    token_ids = _token_ids(model, token_ids)
    positions = np.arange(len(token_ids))
    x = model.weight("token_embd.weight")[token_ids]
    for layer in range(model.hparams.n_trunk):
        x = _block(model, layer, x, positions, kv, routes, kv_cache)
    return x


def _block(model: ReferenceModel, layer: int, x: np.ndarray, positions: np.ndarray, kv: KVType,
           routes: dict | None = None, kv_cache: dict | None = None) -> np.ndarray:
    hp, p = model.hparams, f"blk.{layer}."
    qwen = hp.architecture == "qwen3moe"
    h = rmsnorm(x, model.weight(p + "attn_norm.weight"), hp.rms_eps)
    q, k, v = (_linear(model, p + name, h) for name in ("attn_q", "attn_k", "attn_v"))
    q_norm = model.weight(p + "attn_q_norm.weight") if qwen else model.optional(p + "attn_q_norm.weight")
    k_norm = model.weight(p + "attn_k_norm.weight") if qwen else model.optional(p + "attn_k_norm.weight")
    if q_norm is not None:
        q = head_rmsnorm(q, q_norm, hp.n_head, hp.rms_eps)
    if k_norm is not None:
        k = head_rmsnorm(k, k_norm, hp.n_head_kv, hp.rms_eps)
    q = rope_neox(q, positions, hp.n_head, hp.n_rot, hp.rope_base)
    k = kv_round(rope_neox(k, positions, hp.n_head_kv, hp.n_rot, hp.rope_base), kv.k_type)
    v = kv_round(v, kv.v_type)
    if kv_cache is not None:
        k, v = kv_cache.setdefault(layer, (k, v))
    x = x + _linear(model, p + "attn_output", attention(q, k, v, positions, hp.n_head, hp.n_head_kv))
    h = rmsnorm(x, model.weight(p + ("ffn_norm" if qwen else "post_attention_norm") + ".weight"), hp.rms_eps)
    if not hp.is_moe_layer(layer):
        return x + _dense_ffn(model, p, h, "")
    logits = _linear(model, p + "ffn_gate_inp", h)
    if qwen:
        ids, weights = route(logits, hp.n_expert_used, "softmax")
    else:
        ids, weights = route(logits, hp.n_expert_used, "sigmoid", bias=model.weight(p + "exp_probs_b.bias"),
                             normalize=hp.expert_weights_norm, scale=hp.expert_weights_scale)
    if routes is not None:
        routes[layer] = ids
    ffn = moe(h, ids, weights, *(model.weight(p + role + ".weight")
                                 for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")))
    if model.optional(p + "ffn_up_shexp.weight") is not None:
        ffn = ffn + _dense_ffn(model, p, h, "_shexp")
    return x + ffn


def _linear(model: ReferenceModel, name: str, x: np.ndarray) -> np.ndarray:
    y = x @ model.weight(name + ".weight").T
    bias = model.optional(name + ".bias")
    return y if bias is None else y + bias


def _dense_ffn(model: ReferenceModel, p: str, h: np.ndarray, suffix: str) -> np.ndarray:
    gate, up = model.weight(f"{p}ffn_gate{suffix}.weight"), model.weight(f"{p}ffn_up{suffix}.weight")
    return swiglu(h, gate, up) @ model.weight(f"{p}ffn_down{suffix}.weight").T


def _head(model: ReferenceModel, hidden: np.ndarray, name: str) -> np.ndarray:
    """The output head `name`, else `output.weight`, else the embedding table (a tied head)."""
    for candidate in (name, "output.weight"):
        table = model.optional(candidate)
        if table is not None:
            return hidden @ table.T
    return hidden @ model.weight("token_embd.weight").T
