"""The float64 oracle: properties that can fail (causality, RoPE's relative positions, attention against an
explicit loop, hand-computed routing, the K/V cache's rounding, the drafter's head), and on the device an
independent check against Hugging Face transformers' implementations of both architectures."""

import dataclasses
import math
import os

import numpy as np
import pytest

from planner.errors import StratumError
from runtime import reference
from runtime.synthetic import write_model

ARCHITECTURES = ("qwen3moe", "glm4moe")


def relative_l2(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny F32 model of each architecture, fresh random weights per run (the seed is printed)."""
    folder = tmp_path_factory.mktemp("models")
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"model seed {seed}")
    return {arch: reference.load(write_model(folder / f"{arch}.gguf", arch, seed=seed)) for arch in ARCHITECTURES}


def tokens(rng, model, n: int) -> np.ndarray:
    return rng.integers(0, model.hparams.n_vocab, n)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_forward_is_causal(models, rng, architecture):
    model = models[architecture]
    ids = tokens(rng, model, 12)
    full = reference.forward(model, ids)
    for n in (1, 5, 11):
        assert np.allclose(reference.forward(model, ids[:n]), full[:n], rtol=1e-12, atol=1e-12)
    # a later token changes nothing before it, and changes its own row
    changed = ids.copy()
    changed[7] = (changed[7] + 1) % model.hparams.n_vocab
    other = reference.forward(model, changed)
    assert np.allclose(other[:7], full[:7], rtol=1e-12, atol=1e-12) and not np.allclose(other[7], full[7])
    if model.hparams.n_nextn:
        drafts = reference.nextn_forward(model, ids)
        assert np.allclose(reference.nextn_forward(model, ids[:6]), drafts[:5], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_rot", [32, 16])
def test_rope_depends_only_on_the_position_difference(rng, n_rot):
    n_heads, head_dim, base = 3, 32, 10000.0
    q, k = rng.standard_normal((2, 1, n_heads * head_dim))

    def dots(p_q, p_k):
        rq = reference.rope_neox(q, np.array([p_q]), n_heads, n_rot, base).reshape(n_heads, head_dim)
        rk = reference.rope_neox(k, np.array([p_k]), n_heads, n_rot, base).reshape(n_heads, head_dim)
        return (rq * rk).sum(axis=1)

    for p_q, p_k, shift in ((5, 2, 7), (3, 3, 100), (0, 9, 1234)):
        assert np.allclose(dots(p_q, p_k), dots(p_q + shift, p_k + shift), rtol=1e-10, atol=1e-12)
    assert not np.allclose(dots(5, 2), dots(5, 3))
    rotated = reference.rope_neox(q, np.array([17]), n_heads, n_rot, base).reshape(n_heads, head_dim)
    heads = q.reshape(n_heads, head_dim)
    assert np.array_equal(rotated[:, n_rot:], heads[:, n_rot:])          # dims past n_rot pass through
    assert np.allclose(np.linalg.norm(rotated, axis=1), np.linalg.norm(heads, axis=1))
    assert np.array_equal(reference.rope_neox(q, np.array([0]), n_heads, n_rot, base), q)
    # NEOX pairs dim i with i + n_rot/2 at frequency base^(-2i/n_rot)
    i, half, p = 3, n_rot // 2, 17
    theta = p * base ** (-2 * i / n_rot)
    x0, x1 = heads[0, i], heads[0, i + half]
    assert np.isclose(rotated[0, i], x0 * math.cos(theta) - x1 * math.sin(theta))
    assert np.isclose(rotated[0, i + half], x0 * math.sin(theta) + x1 * math.cos(theta))


def test_attention_matches_an_explicit_loop(rng):
    n_head, n_head_kv, dk, dv, ctx = 4, 2, 8, 6, 7
    positions = np.array([2, 5, 6])
    q = rng.standard_normal((len(positions), n_head * dk))
    k = rng.standard_normal((ctx, n_head_kv * dk))
    v = rng.standard_normal((ctx, n_head_kv * dv))
    got = reference.attention(q, k, v, positions, n_head, n_head_kv)
    want = np.zeros((len(positions), n_head * dv))
    for row, position in enumerate(positions):
        for head in range(n_head):
            kv = head // (n_head // n_head_kv)
            query = q[row, head * dk:(head + 1) * dk]
            scores = [query @ k[j, kv * dk:(kv + 1) * dk] / math.sqrt(dk) for j in range(position + 1)]
            weights = np.exp(np.array(scores) - max(scores))
            weights /= weights.sum()
            for j in range(position + 1):
                want[row, head * dv:(head + 1) * dv] += weights[j] * v[j, kv * dv:(kv + 1) * dv]
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_softmax_routing_by_hand():
    ids, weights = reference.route(np.array([[1.0, 3.0, 2.0, 0.0]]), 2, "softmax")
    assert ids.tolist() == [[1, 2]]
    e3, e2 = math.exp(3), math.exp(2)
    assert np.allclose(weights, [[e3 / (e3 + e2), e2 / (e3 + e2)]])
    # unnormalised: the softmax probabilities themselves; a tie goes to the lower index
    total = sum(math.exp(x) for x in (2.0, 2.0, 1.0, 2.0))
    ids, weights = reference.route(np.array([[2.0, 2.0, 1.0, 2.0]]), 2, "softmax", normalize=False)
    assert ids.tolist() == [[0, 1]] and np.allclose(weights, [[math.exp(2) / total] * 2])


def test_sigmoid_routing_selects_biased_but_weights_unbiased():
    logits, bias = np.array([[0.0, 1.0, -1.0, 2.0]]), np.array([0.5, 0.0, 0.6, -0.9])
    sigmoid = [1 / (1 + math.exp(-x)) for x in logits[0]]        # 0.5, 0.731, 0.269, 0.881
    # biased scores: 1.0, 0.731, 0.869, -0.019 -> experts 0 then 2 (expert 3's 0.881 loses to its bias)
    ids, weights = reference.route(logits, 2, "sigmoid", bias=bias, normalize=True, scale=2.5)
    assert ids.tolist() == [[0, 2]]
    chosen = np.array([sigmoid[0], sigmoid[2]])
    assert np.allclose(weights, [chosen / chosen.sum() * 2.5])
    ids, weights = reference.route(logits, 2, "sigmoid", bias=bias, normalize=False, scale=2.5)
    assert np.allclose(weights, [chosen * 2.5])
    ids, _ = reference.route(logits, 2, "sigmoid")
    assert ids.tolist() == [[3, 1]]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_kv_cache_types_differ_but_stay_close(tmp_path, models, rng, architecture):
    # every expert used: no routing choice can flip, so the error grows smoothly with the K/V rounding
    model = reference.load(write_model(tmp_path / "m.gguf", architecture, seed=int(rng.integers(2 ** 31)),
                                       n_expert=4, n_expert_used=4))
    ids = tokens(rng, model, 10)
    exact = reference.forward(model, ids, kv_type="f32")
    errors = {kv: relative_l2(reference.forward(model, ids, kv_type=kv), exact) for kv in ("f16", "q8_0", "k8v4")}
    # 60 seeds gave f16 0.9-1.9e-4, q8_0 2.5-4.6e-3, k8v4 (V in q4_0) 3.4-6.5e-2, at least 10x q8_0's
    assert 0 < errors["f16"] < 1e-3
    assert 3 * errors["f16"] < errors["q8_0"] < 1e-2
    assert 4 * errors["q8_0"] < errors["k8v4"] < 0.15
    model = models[architecture]
    ids = tokens(rng, model, 10)
    # the first position attends to itself only: V's rounding reaches it, K's does not
    assert np.array_equal(reference.forward(model, ids[:1], kv_type="k4v16"),
                          reference.forward(model, ids[:1], kv_type="f16"))
    with pytest.raises(StratumError, match="unknown K/V type"):
        reference.forward(model, ids, kv_type="q3")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_forward_states_and_the_head(models, rng, architecture):
    model = models[architecture]
    hp = model.hparams
    ids = tokens(rng, model, 9)
    logits, hidden = reference.forward_states(model, ids)
    assert logits.shape == (9, hp.n_vocab) and hidden.shape == (9, hp.n_embd)
    assert np.all(np.isfinite(logits)) and logits.dtype == np.float64
    assert np.allclose(logits, hidden @ model.weights["output.weight"].T)
    assert np.array_equal(reference.forward(model, ids), logits)
    # a file without output.weight ties the head to the embeddings, as llama.cpp does
    tied = dataclasses.replace(model, weights={k: v for k, v in model.weights.items() if k != "output.weight"})
    assert np.allclose(reference.forward(tied, ids), hidden @ model.weights["token_embd.weight"].T)
    routes = reference.routing(model, ids)
    assert sorted(routes) == [layer for layer in range(hp.n_trunk) if hp.is_moe_layer(layer)]
    for ids_of_layer in routes.values():
        assert ids_of_layer.shape == (9, hp.n_expert_used)
        assert all(len(set(row)) == hp.n_expert_used for row in ids_of_layer.tolist())


def test_nextn_block_heads_and_embeddings(models, rng):
    model = models["glm4moe"]
    hp = model.hparams
    ids = tokens(rng, model, 8)
    drafts = reference.nextn_forward(model, ids)
    assert drafts.shape == (7, hp.n_vocab) and np.all(np.isfinite(drafts))
    assert not np.allclose(drafts, reference.forward(model, ids)[1:])
    p = f"blk.{hp.n_trunk}.nextn."
    # its own shared_head_head, when the file has one, replaces the output head
    doubled = dataclasses.replace(model, weights={**model.weights,
                                                  p + "shared_head_head.weight": 2 * model.weights["output.weight"]})
    assert np.allclose(reference.nextn_forward(doubled, ids), 2 * drafts)
    # its own embed_tokens, when present, replaces token_embd for the next token (not for the trunk)
    table = model.weights["token_embd.weight"]
    same = dataclasses.replace(model, weights={**model.weights, p + "embed_tokens.weight": table.copy()})
    assert np.array_equal(reference.nextn_forward(same, ids), drafts)
    other = dataclasses.replace(model, weights={**model.weights, p + "embed_tokens.weight": table[::-1].copy()})
    assert not np.allclose(reference.nextn_forward(other, ids), drafts)
    assert np.array_equal(reference.forward(other, ids), reference.forward(model, ids))
    # the trunk's hidden state at i feeds row i: changing the last token changes no draft row
    changed = ids.copy()
    changed[-1] = (changed[-1] + 1) % hp.n_vocab
    assert np.allclose(reference.nextn_forward(model, changed)[:-1], drafts[:-1], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="two tokens"):
        reference.nextn_forward(model, ids[:1])


def test_nextn_refused_without_a_nextn_layer(models):
    with pytest.raises(StratumError, match="no NextN layer"):
        reference.nextn_forward(models["qwen3moe"], [1, 2, 3])


def test_load_reads_every_tensor_once_per_file(tmp_path, rng):
    path = write_model(tmp_path / "m.gguf", "qwen3moe", seed=int(rng.integers(2 ** 31)),
                       types={"experts": "q4_0"})
    model = reference.load(path)
    assert reference.load(str(path)) is model
    assert model.weights["blk.0.ffn_gate_exps.weight"].shape == (8, 32, 64)
    assert model.weights["blk.0.attn_q.weight"].shape == (128, 64)
    assert all(w.dtype == np.float64 for w in model.weights.values())
    write_model(path, "qwen3moe", seed=int(rng.integers(2 ** 31)) + 1)    # rewritten: read again
    assert reference.load(path) is not model
    with pytest.raises(StratumError, match="cannot read"):
        reference.load(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="token ids"):
        reference.forward(model, [0, model.hparams.n_vocab])


# ---- on the device: Hugging Face transformers' implementations as an independent oracle ----

def hf_state(model) -> dict:
    """The GGUF's tensors under the names of the Hugging Face checkpoints (experts one by one, as published)."""
    hp, w = model.hparams, model.weights
    state = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"],
             "lm_head.weight": w["output.weight"]}
    ffn_norm = "ffn_norm" if hp.architecture == "qwen3moe" else "post_attention_norm"
    for layer in range(hp.n_trunk):
        blk, hf = f"blk.{layer}.", f"model.layers.{layer}."
        pairs = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": ffn_norm + ".weight",
                 "self_attn.o_proj.weight": "attn_output.weight"}
        for proj, role in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
            pairs[f"self_attn.{proj}_proj.weight"] = role + ".weight"
            pairs[f"self_attn.{proj}_proj.bias"] = role + ".bias"
        pairs.update({"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                      "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                      "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
                      "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
                      "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
                      "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
                      "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"})
        state.update({hf + name: w[blk + gguf] for name, gguf in pairs.items() if blk + gguf in w})
        if hp.is_moe_layer(layer):
            for expert in range(hp.n_expert):
                for proj in ("gate", "up", "down"):
                    state[f"{hf}mlp.experts.{expert}.{proj}_proj.weight"] = w[f"{blk}ffn_{proj}_exps.weight"][expert]
    return state


def hf_config(transformers, hp):
    common = dict(vocab_size=hp.n_vocab, hidden_size=hp.n_embd, intermediate_size=hp.n_ff,
                  num_hidden_layers=hp.n_trunk, num_attention_heads=hp.n_head, num_key_value_heads=hp.n_head_kv,
                  head_dim=hp.head_dim_k, hidden_act="silu", max_position_embeddings=hp.n_ctx_train,
                  rms_norm_eps=hp.rms_eps, rope_theta=hp.rope_base, moe_intermediate_size=hp.n_ff_exp,
                  num_experts_per_tok=hp.n_expert_used, norm_topk_prob=True, tie_word_embeddings=False)
    if hp.architecture == "qwen3moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=hp.n_expert, decoder_sparse_step=1,
                                           mlp_only_layers=[], attention_bias=False, use_sliding_window=False)
    return transformers.Glm4MoeConfig(**{**common, "norm_topk_prob": hp.expert_weights_norm},
                                      partial_rotary_factor=hp.n_rot / hp.head_dim_k, attention_bias=True,
                                      n_routed_experts=hp.n_expert, n_shared_experts=hp.n_expert_shared,
                                      routed_scaling_factor=hp.expert_weights_scale, n_group=1, topk_group=1,
                                      first_k_dense_replace=hp.n_leading_dense, use_qk_norm=False)


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_matches_hugging_face_transformers(tmp_path, rng, architecture):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    if architecture == "glm4moe" and not hasattr(transformers, "Glm4MoeForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Glm4MoeForCausalLM")
    model = reference.load(write_model(tmp_path / "m.gguf", architecture, seed=int(rng.integers(2 ** 31))))
    folder = tmp_path / "hf"
    hf_config(transformers, model.hparams).save_pretrained(folder)
    # F32 GGUF values are float32 exactly: the checkpoint holds the same numbers
    safetensors_torch.save_file({name: torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
                                 for name, values in hf_state(model).items()}, str(folder / "model.safetensors"))
    cls = transformers.Qwen3MoeForCausalLM if architecture == "qwen3moe" else transformers.Glm4MoeForCausalLM
    # eager: the per-expert loop; the grouped-matmul kernels take no float64
    hf, info = cls.from_pretrained(folder, attn_implementation="eager", experts_implementation="eager",
                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys"), info
    hf = hf.to(torch.float64).eval()
    ids = tokens(rng, model, 16)
    with torch.no_grad():
        want = hf(torch.tensor(ids[None, :], dtype=torch.long)).logits[0].numpy()
    got = reference.forward(model, ids)
    print(f"{architecture}: transformers {transformers.__version__}, relative L2 {relative_l2(got, want):.2e}")
    assert relative_l2(got, want) < 1e-5
