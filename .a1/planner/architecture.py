"""What each supported architecture is made of: hyperparameters from GGUF metadata, and its tensor layout.

One table per architecture, following llama.cpp's loader (llama-model.cpp) and the GGUF names of
`gguf.constants`. The layout is what a model card expands into (a card is a GGUF header we have not
downloaded) and what the tiny-model generator writes; a real GGUF is read as it is.
"""

from dataclasses import dataclass

from planner.errors import StratumError

SUPPORTED_ARCHITECTURES = ("qwen3moe", "glm4moe")
EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class HParams:
    architecture: str
    n_layer: int            # block_count: trunk blocks plus NextN blocks
    n_nextn: int            # NextN (MTP) blocks at the end: the drafter
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int               # dense FFN width (glm4moe's leading dense blocks)
    n_ff_exp: int           # one routed expert's FFN width
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_leading_dense: int    # blocks before the first MoE block
    n_rot: int              # rotary dims per head (glm4moe rotates only part of each head)
    n_ctx_train: int
    n_vocab: int
    rms_eps: float
    rope_base: float
    expert_weights_scale: float
    expert_weights_norm: bool
    qk_norm: bool           # each head of q and k RMSNormed before RoPE: qwen3moe always, glm4moe where the
                            # model has attn_q_norm/attn_k_norm (GLM-4.5 does, GLM-4.5-Air does not)

    @property
    def n_trunk(self) -> int:
        return self.n_layer - self.n_nextn

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.n_leading_dense


# metadata key (without the '{arch}.' prefix) -> field, required?, default
METADATA_KEYS = {
    "block_count": ("n_layer", True, None),
    "nextn_predict_layers": ("n_nextn", False, 0),
    "embedding_length": ("n_embd", True, None),
    "attention.head_count": ("n_head", True, None),
    "attention.head_count_kv": ("n_head_kv", True, None),
    "attention.key_length": ("head_dim_k", False, None),
    "attention.value_length": ("head_dim_v", False, None),
    "feed_forward_length": ("n_ff", False, 0),
    "expert_feed_forward_length": ("n_ff_exp", True, None),
    "expert_count": ("n_expert", True, None),
    "expert_used_count": ("n_expert_used", True, None),
    "expert_shared_count": ("n_expert_shared", False, 0),
    "leading_dense_block_count": ("n_leading_dense", False, 0),
    "rope.dimension_count": ("n_rot", False, None),
    "context_length": ("n_ctx_train", True, None),
    "vocab_size": ("n_vocab", False, None),
    "attention.layer_norm_rms_epsilon": ("rms_eps", False, 1e-6),
    "rope.freq_base": ("rope_base", False, 10000.0),
    "expert_weights_scale": ("expert_weights_scale", False, 1.0),
    "expert_weights_norm": ("expert_weights_norm", False, None),
}


def hparams_from_metadata(metadata: dict, source: str, vocab_from_tensors: int | None = None,
                          qk_norm: bool = False) -> HParams:
    """Read an architecture's hyperparameters; a missing key is refused by name. qk_norm: whether a glm4moe
    has the q/k norm tensors (no metadata key says it; llama.cpp loads them where they are)."""
    architecture = metadata.get("general.architecture")
    if architecture is None:
        raise StratumError("missing metadata key 'general.architecture'", source=source)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise StratumError(f"unknown architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
                           source=source, field="general.architecture")
    values = {}
    for key, (field, required, default) in METADATA_KEYS.items():
        full_key = f"{architecture}.{key}"
        value = metadata.get(full_key, default)
        if value is None and required:
            raise StratumError(f"missing metadata key {full_key!r}", source=source)
        if value is not None and field not in ("rms_eps", "rope_base", "expert_weights_scale",
                                                "expert_weights_norm"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StratumError(f"expected a non-negative integer, got {value!r}", source=source, field=full_key)
        values[field] = value
    if architecture == "qwen3moe":
        values["n_nextn"], values["n_leading_dense"], values["n_expert_shared"] = 0, 0, 0
        values["expert_weights_norm"] = True   # qwen3moe always renormalises its top-k weights
        values["expert_weights_scale"] = 1.0   # and llama.cpp applies no weight scale to it
    values["qk_norm"] = qk_norm or architecture == "qwen3moe"
    if values["expert_weights_norm"] is None:
        values["expert_weights_norm"] = False
    if values["n_head"] == 0:
        raise StratumError("must be positive", source=source, field=f"{architecture}.attention.head_count")
    for field in ("head_dim_k", "head_dim_v"):
        if values[field] is None:
            values[field] = values["n_embd"] // values["n_head"]
    if values["n_rot"] is None:
        values["n_rot"] = values["head_dim_k"]
    if values["n_vocab"] is None:
        values["n_vocab"] = vocab_from_tensors or len(metadata.get("tokenizer.ggml.tokens", ()))
    hp = HParams(architecture=architecture, **values)
    _check(hp, source)
    return hp


def _check(hp: HParams, source: str):
    prefix = hp.architecture + "."
    checks = [
        (hp.n_layer > hp.n_nextn, "block_count", "must exceed nextn_predict_layers"),
        (hp.n_embd > 0, "embedding_length", "must be positive"),
        (0 < hp.n_head_kv <= hp.n_head and hp.n_head % hp.n_head_kv == 0, "attention.head_count_kv",
         "must be positive and divide attention.head_count"),
        (hp.n_expert > 0, "expert_count", "must be positive"),
        (0 < hp.n_expert_used <= hp.n_expert, "expert_used_count", "must be between 1 and expert_count"),
        (hp.n_ff_exp > 0, "expert_feed_forward_length", "must be positive"),
        (hp.n_leading_dense < hp.n_trunk, "leading_dense_block_count", "leaves no MoE block"),
        (hp.n_leading_dense == 0 or hp.n_ff > 0, "feed_forward_length", "is needed by the leading dense blocks"),
        (hp.n_rot <= hp.head_dim_k and hp.n_rot % 2 == 0, "rope.dimension_count",
         "must be even and at most the head size"),
        (hp.n_vocab > 0, "vocab_size", "is unknown (no vocab_size key, token_embd tensor or token list)"),
    ]
    for ok, key, message in checks:
        if not ok:
            raise StratumError(message, source=source, field=prefix + key)


def tensor_layout(hp: HParams) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor an architecture has, as (name, shape in GGUF order: row length first)."""
    e, q_dim = hp.n_embd, hp.n_head * hp.head_dim_k
    k_dim, v_dim = hp.n_head_kv * hp.head_dim_k, hp.n_head_kv * hp.head_dim_v
    tensors = [("token_embd.weight", (e, hp.n_vocab)), ("output_norm.weight", (e,)),
               ("output.weight", (e, hp.n_vocab))]
    for layer in range(hp.n_layer):
        blk = f"blk.{layer}."
        block = [("attn_norm.weight", (e,)), ("attn_q.weight", (e, q_dim)), ("attn_k.weight", (e, k_dim)),
                 ("attn_v.weight", (e, v_dim)), ("attn_output.weight", (q_dim, e))]
        if hp.qk_norm:
            block += [("attn_q_norm.weight", (hp.head_dim_k,)), ("attn_k_norm.weight", (hp.head_dim_k,))]
        if hp.architecture == "qwen3moe":
            block += [("ffn_norm.weight", (e,))]
        else:
            block += [("attn_q.bias", (q_dim,)), ("attn_k.bias", (k_dim,)), ("attn_v.bias", (v_dim,)),
                      ("post_attention_norm.weight", (e,))]
        if not hp.is_moe_layer(layer):
            block += [("ffn_gate.weight", (e, hp.n_ff)), ("ffn_up.weight", (e, hp.n_ff)),
                      ("ffn_down.weight", (hp.n_ff, e))]
        else:
            block += [("ffn_gate_inp.weight", (e, hp.n_expert)),
                      ("ffn_gate_exps.weight", (e, hp.n_ff_exp, hp.n_expert)),
                      ("ffn_up_exps.weight", (e, hp.n_ff_exp, hp.n_expert)),
                      ("ffn_down_exps.weight", (hp.n_ff_exp, e, hp.n_expert))]
            if hp.architecture == "glm4moe":
                shared_ff = hp.n_ff_exp * hp.n_expert_shared
                block += [("exp_probs_b.bias", (hp.n_expert,))]
                if shared_ff:
                    block += [("ffn_gate_shexp.weight", (e, shared_ff)), ("ffn_up_shexp.weight", (e, shared_ff)),
                              ("ffn_down_shexp.weight", (shared_ff, e))]
        if layer >= hp.n_trunk:
            block += [("nextn.eh_proj.weight", (2 * e, e)), ("nextn.enorm.weight", (e,)),
                      ("nextn.hnorm.weight", (e,)), ("nextn.shared_head_norm.weight", (e,))]
        tensors += [(blk + name, shape) for name, shape in block]
    return tensors


def tensor_role(name: str) -> str:
    """`blk.7.ffn_down_exps.weight` -> `ffn_down_exps`; `attn_q.bias` keeps its suffix: a bias is its own role."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2:
        parts = parts[2:]
    if parts[-1] == "weight":
        parts = parts[:-1]
    return ".".join(parts)


def tensor_layer(name: str) -> int | None:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        return int(parts[1])
    return None
