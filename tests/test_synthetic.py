"""The model generator: valid GGUF files the planner and gguf-py read back tensor by tensor, weights that keep
activations O(1), expert popularity skewed as asked, and real-shape packed weights generated directly."""

import numpy as np
import pytest
import yaml
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T

from codegen.lower import weights
from planner.architecture import EXPERT_ROLES, tensor_layout, tensor_role
from planner.errors import StratumError
from planner.header import read_header
from planner.model import load_model
from runtime import reference, synthetic
from runtime.synthetic import random_packed, realistic_weights, write_model

ARCHITECTURES = ("qwen3moe", "glm4moe")
MIXED_TYPES = {"experts": "q8_0", "dense": "f16", "attn_v": "q4_0", "output": "bf16"}


def seed_of(rng) -> int:
    return int(rng.integers(2 ** 31))


def expected_type(name: str, shape: tuple) -> T:
    """MIXED_TYPES as the generator must apply them: role, then group; norms, biases and the router F32."""
    role = tensor_role(name)
    if role == "attn_v":
        return T.Q4_0
    if role == "output":
        return T.BF16
    if len(shape) == 1 or role == "ffn_gate_inp":
        return T.F32
    return T.Q8_0 if role in EXPERT_ROLES else T.F16


def relative_l2(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_round_trip_tensor_by_tensor(tmp_path, rng, architecture):
    seed = seed_of(rng)
    path = write_model(tmp_path / "mixed.gguf", architecture, seed=seed, types=MIXED_TYPES)
    twin = reference.load(write_model(tmp_path / "f32.gguf", architecture, seed=seed))
    header, model = read_header(path), load_model(path)
    hp = model.hparams
    assert hp == twin.hparams and hp.architecture == architecture
    assert (hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.n_expert, hp.n_expert_used) == (64, 4, 2, 32, 8, 2)
    assert hp.n_nextn == (1 if architecture == "glm4moe" else 0)

    reader = GGUFReader(path)
    assert [t.name for t in reader.tensors] == [name for name, _ in tensor_layout(hp)]
    assert model.total_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    infos = {t.name: t for t in header.tensors}
    for tensor, (name, shape) in zip(reader.tensors, tensor_layout(hp)):
        info = infos[name]
        assert tuple(int(d) for d in tensor.shape) == shape == info.shape
        assert tensor.tensor_type == info.ggml_type == expected_type(name, shape), name
        assert int(tensor.n_bytes) == info.n_bytes == model.tensor_bytes[name]
        assert int(tensor.data_offset) == header.data_offset + info.offset
        # the same values as the F32 twin, rounded through the tensor's type
        got, want = reference.load(path).weights[name], twin.weights[name]
        tolerance = {T.F32: 0.0, T.F16: 1e-3, T.BF16: 1e-2, T.Q8_0: 1e-2, T.Q4_0: 0.15}[info.ggml_type]
        if tolerance == 0.0:
            assert np.array_equal(got, want), name
        else:
            assert 0 < relative_l2(got, want) < tolerance, name


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_values_keep_activations_order_one(tmp_path, rng, architecture):
    seed = seed_of(rng)
    path = write_model(tmp_path / "a.gguf", architecture, seed=seed)
    model = reference.load(path)
    for name, values in model.weights.items():
        role = tensor_role(name)
        if role.endswith("norm"):
            assert abs(values.mean() - 1) < 0.05 and values.std() < 0.1, name
        elif values.ndim > 1 and role not in ("token_embd", "ffn_gate_inp"):
            assert abs(values.std() * np.sqrt(values.shape[-1]) - 1) < 0.15, name
    ids = rng.integers(0, model.hparams.n_vocab, 24)
    logits, hidden = reference.forward_states(model, ids)
    assert np.all(np.isfinite(logits)) and 0.3 < logits.std() < 3
    assert np.allclose(np.sqrt((hidden ** 2).mean(axis=1)), 1, atol=0.2)
    # the same seed writes the same bytes; another seed other values
    again = write_model(tmp_path / "b.gguf", architecture, seed=seed)
    assert again.read_bytes() == path.read_bytes()
    other = reference.load(write_model(tmp_path / "c.gguf", architecture, seed=seed + 1))
    assert not np.array_equal(other.weights["output.weight"], model.weights["output.weight"])


def top_quarter_share(path, rng, prompts: int = 16, length: int = 64) -> float:
    """The share of the routed slots that go to each MoE block's most popular quarter of experts, averaged
    over the blocks, on random prompts."""
    model = reference.load(path)
    hp = model.hparams
    routes = [reference.routing(model, rng.integers(0, hp.n_vocab, length)) for _ in range(prompts)]
    return float(np.mean([synthetic.top_quarter_share([r[layer] for r in routes], hp.n_expert) for layer in routes[0]]))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_expert_popularity_follows_skew(tmp_path, rng, architecture):
    """Each share is the mean over two models' seeds: most of a share's spread is its model's random router
    (8 experts), not the prompts' sampling. One model left glm4moe's realistic share 4 sigma above 0.40 and its
    uniform one, skewed upwards, 5 below it (one run in several thousand failing by chance); two leave 5.7."""
    seeds = [seed_of(rng) for _ in range(2)]
    shares = [float(np.mean([top_quarter_share(write_model(tmp_path / f"s{skew}.gguf", architecture, seed=seed,
                                                           skew=skew), rng) for seed in seeds]))
              for skew in (0.0, 1.0, 3.0)]
    uniform, realistic, steep = shares
    # 350-400 seeds of one model (16 prompts of 64) gave 0.28-0.38, 0.43-0.58 and 0.72-0.85 (standard deviations
    # 0.017, 0.026 and 0.021 for glm4moe, less for qwen3moe); with 4 prompts a seed gave 0.37 and 0.42 (the
    # uniform share's sampling bias is larger on fewer slots)
    assert uniform < 0.40, shares           # 0.25 plus the sampling of 2048 slots over 8 experts
    assert 0.40 < realistic < 0.65, shares  # skew 1: the top quarter takes about half
    assert steep > 0.68, shares
    assert uniform < realistic - 0.05 and realistic < steep - 0.1, shares


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0])
def test_random_packed_layouts_and_scale(rng, ggml_type):
    shape = (3, 64, 96)
    packed = random_packed(shape, ggml_type, rng)
    assert packed.shape == shape and packed.ggml_type == ggml_type
    data_shape = shape if ggml_type != T.Q4_0 else (3, 64, 48)
    assert packed.data.shape == data_shape
    assert packed.data.dtype == {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16, T.Q8_0: np.int8,
                                 T.Q4_0: np.uint8}[ggml_type]
    if ggml_type in (T.Q8_0, T.Q4_0):
        assert packed.scales.shape == (3, 64, 3) and packed.scales.dtype == np.float16
        assert packed.nbytes == 3 * 64 * 96 // 32 * (34 if ggml_type == T.Q8_0 else 18)
    else:
        assert packed.scales is None
    if ggml_type == T.Q8_0:
        assert packed.data.min() >= -127
    values = weights.dequantize(packed)
    assert abs(values.std() * np.sqrt(96) - 1) < 0.1
    assert abs(weights.dequantize(random_packed(shape, ggml_type, rng, std=2.0)).std() / 2 - 1) < 0.1


@pytest.mark.parametrize("ggml_type, quant_bytes, header_bytes",
                         [(T.Q4_K, 128, 16), (T.Q5_K, 160, 16), (T.Q6_K, 192, 18)], ids=["Q4_K", "Q5_K", "Q6_K"])
def test_random_packed_k_quant_has_the_layout_pack_makes_and_the_scale_asked(rng, ggml_type, quant_bytes,
                                                                              header_bytes):
    shape = (3, 64, 512)
    packed = random_packed(shape, ggml_type, rng)
    assert (packed.data.shape, packed.data.dtype) == ((3, 64, 2 * quant_bytes), np.uint8)
    assert (packed.scales.shape, packed.scales.dtype) == ((3, 64, header_bytes), np.float16)
    assert packed.nbytes == 3 * 64 * 512 // 256 * (quant_bytes + header_bytes)
    values = weights.dequantize(packed) * np.sqrt(512)
    assert abs(values.std() - 1) < 0.1 and abs(values.mean()) < 0.1


@pytest.mark.parametrize("ggml_type", [t for t in weights.KERNEL_TYPES], ids=lambda t: t.name)
def test_the_massive_dimension_is_zeroed_in_the_packed_layout_of_every_type(rng, ggml_type):
    """What realistic weights reserve for the massive dimension (a reader's column, a writer's row) is exactly 0
    in gguf-py's values, and its neighbours are not."""
    hp = load_model("qwen3-30b-a3b-q8_0").hparams
    structure = synthetic._Structure(hp, seed=seed_of(rng), skew=1.0)
    dim = structure.massive_dim
    shape = (4, hp.n_embd)
    reader = weights.dequantize(structure.reserve("blk.0.attn_q.weight", random_packed(shape, ggml_type, rng)))
    assert np.all(reader[:, dim] == 0)
    assert np.any(reader[:, dim - 1] != 0) and np.any(reader[:, (dim + 1) % hp.n_embd] != 0)
    writer = weights.dequantize(structure.reserve("blk.0.attn_output.weight",
                                                  random_packed((hp.n_embd, 256), ggml_type, rng)))
    assert np.all(writer[dim] == 0) and np.any(writer[dim - 1] != 0)


def test_random_packed_refuses_what_no_kernel_reads(rng):
    with pytest.raises(StratumError, match="Q3_K"):
        random_packed((64, 256), T.Q3_K, rng)
    with pytest.raises(StratumError, match="whole blocks"):
        random_packed((64, 48), T.Q8_0, rng)


TINY_CARDS = {
    "qwen3moe": {"block_count": 2, "context_length": 4096, "embedding_length": 64, "feed_forward_length": 96,
                 "expert_feed_forward_length": 32, "expert_count": 8, "expert_used_count": 2,
                 "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
                 "attention.value_length": 32, "vocab_size": 96},
    "glm4moe": {"block_count": 3, "nextn_predict_layers": 1, "context_length": 4096, "embedding_length": 64,
                "feed_forward_length": 96, "expert_feed_forward_length": 32, "expert_count": 8,
                "expert_used_count": 2, "expert_shared_count": 1, "leading_dense_block_count": 1,
                "expert_weights_scale": 2.5, "expert_weights_norm": True, "attention.head_count": 4,
                "attention.head_count_kv": 2, "attention.key_length": 32, "attention.value_length": 32,
                "rope.dimension_count": 16, "vocab_size": 96},
}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_realistic_weights_follow_the_card(tmp_path, rng, architecture):
    card = tmp_path / f"tiny-{architecture}.yaml"
    card.write_text(yaml.safe_dump({"name": card.stem, "architecture": architecture,
                                    "metadata": TINY_CARDS[architecture],
                                    "types": {"default": "q8_0", "attn_q": "q4_0", "output": "f16"}}))
    model = load_model(card)
    generated = dict(realistic_weights(card, seed=seed_of(rng), types={"experts": "q4_0"}))
    assert list(generated) == [t.name for t in model.tensors]
    massive = None
    for tensor in model.tensors:
        packed = generated[tensor.name]
        role = tensor_role(tensor.name)
        want = T.Q4_0 if role in EXPERT_ROLES else tensor.ggml_type
        assert packed.ggml_type == want and packed.shape == tuple(reversed(tensor.shape)), tensor.name
        if want == tensor.ggml_type:
            assert packed.nbytes == tensor.n_bytes, tensor.name
        if role == "token_embd":
            values = weights.dequantize(packed)
            # the massive dimension: the one column all embeddings share
            massive = int(np.argmin(values.std(axis=0)))
            assert values[:, massive].std() < 1e-2 * abs(values[:, massive].mean())
    # no attention or FFN matrix reads or writes the massive dimension, whatever its packing
    for name, packed in generated.items():
        role = tensor_role(name)
        values = weights.dequantize(packed)
        if role in ("attn_q", "attn_k", "attn_v", "ffn_gate_exps", "ffn_up_exps", "ffn_gate", "ffn_up"):
            assert np.all(values[..., massive] == 0) and np.any(values[..., massive - 1] != 0), name
        if role in ("attn_output", "ffn_down_exps", "ffn_down"):
            assert np.all(values[..., massive, :] == 0), name
        if role == "exp_probs_b.bias":
            assert values.std() > 0.05


def test_realistic_weights_refuse_a_type_no_kernel_reads(tmp_path):
    """A card's Q3_K tensor (a Q3_K_M file's default type) is refused when it is reached, after the K-quants the
    kernels read."""
    card = tmp_path / "tiny-q3_k.yaml"
    card.write_text(yaml.safe_dump({"name": card.stem, "architecture": "qwen3moe",
                                    "metadata": {**TINY_CARDS["qwen3moe"], "embedding_length": 256},
                                    "types": {"default": "q8_0", "attn_q": "q4_k", "attn_k": "q6_k",
                                              "attn_v": "q3_k"}}))
    names = []
    with pytest.raises(StratumError, match="Q3_K"):
        for name, _ in realistic_weights(card, seed=0):
            names.append(name)
    assert "blk.0.attn_k.weight" in names and "blk.0.attn_v.weight" not in names


def test_write_model_refusals(tmp_path):
    with pytest.raises(StratumError, match="unknown architecture"):
        write_model(tmp_path / "x.gguf", "llama", seed=0)
    with pytest.raises(TypeError, match="n_layers"):
        write_model(tmp_path / "x.gguf", "qwen3moe", seed=0, n_layers=3)
    with pytest.raises(StratumError, match="ffn_gat"):
        write_model(tmp_path / "x.gguf", "qwen3moe", seed=0, types={"ffn_gat": "q8_0"})
    with pytest.raises(StratumError, match="unknown GGML type"):
        write_model(tmp_path / "x.gguf", "qwen3moe", seed=0, types={"experts": "q9_9"})
    with pytest.raises(StratumError, match="whole blocks"):
        write_model(tmp_path / "x.gguf", "qwen3moe", seed=0, n_ff_exp=48, types={"experts": "q8_0"})
    with pytest.raises(StratumError, match="NextN"):
        write_model(tmp_path / "x.gguf", "qwen3moe", seed=0, nextn=1)
    with pytest.raises(StratumError, match="head_count_kv"):
        write_model(tmp_path / "x.gguf", "glm4moe", seed=0, n_head_kv=3)
    assert not (tmp_path / "x.gguf").exists()


def test_shapes_and_depth_are_parameters(tmp_path):
    path = write_model(tmp_path / "deep.gguf", "glm4moe", seed=0, n_trunk=4, n_leading_dense=2, nextn=0,
                       n_expert=16, n_expert_used=4, n_vocab=96, expert_weights_norm=False)
    hp = load_model(path).hparams
    assert (hp.n_layer, hp.n_trunk, hp.n_nextn, hp.n_leading_dense) == (4, 4, 0, 2)
    assert (hp.n_expert, hp.n_expert_used, hp.n_vocab, hp.expert_weights_norm) == (16, 4, 96, False)
    assert not any(name.startswith("blk.4.") for name in reference.load(path).weights)
    assert len(tensor_layout(hp)) == len(GGUFReader(path).tensors)
