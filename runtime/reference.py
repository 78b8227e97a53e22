"""The oracle: a numpy float64 forward pass of qwen3moe and glm4moe, following llama.cpp's conventions.

The building blocks below are what every kernel test compares with; `forward` chains them over a GGUF file.
Conventions (llama.cpp, llama-graph.cpp / llama-model.cpp):
  - linear weights are numpy (out, in): y = x @ W.T (+ bias); routed experts are (n_expert, out, in);
  - RMSNorm: x / sqrt(mean(x^2) + eps) * w; qwen3moe also norms each q and k head before RoPE;
  - NEOX RoPE on the first `n_rot` dims of each head: pairs (i, i + n_rot/2), theta = pos * base^(-2i/n_rot);
  - attention: scale 1/sqrt(head_dim), causal, query head h reads K/V head h // (n_head / n_head_kv);
  - the K/V cache stores K and V rounded through its type (f16, q8_0, q4_0 as ggml quantizes);
  - routing: qwen3moe takes softmax probabilities' top k and renormalises them; glm4moe selects on
    sigmoid + exp_probs_b but weights by the unbiased sigmoid (renormalised when expert_weights_norm),
    times expert_weights_scale; ties go to the lower expert index.
"""

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as T


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
