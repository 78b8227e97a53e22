"""Model inventory: exact bytes from a header, the same from a card, and clear refusals."""

import numpy as np
import pytest
import yaml
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType

from planner.errors import StratumError
from planner.header import read_header
from planner.kv import parse_kv_type
from planner.model import bundled_cards, inventory, load_model
from plans import MODELS_DIR
from tests.ggufs import write_header_only


@pytest.mark.parametrize("card", bundled_cards())
def test_card_and_its_gguf_header_give_the_same_inventory(tmp_path, card):
    path = tmp_path / f"{card}.gguf"
    write_header_only(MODELS_DIR / f"{card}.yaml", path)
    from_card, from_file = load_model(card), load_model(path)
    assert from_file.fingerprint == from_card.fingerprint
    assert from_file.summary == from_card.summary
    assert from_file.total_bytes == sum(t.n_bytes for t in read_header(path).tensors)


def test_glm_4_5_norms_q_and_k_heads_and_air_does_not():
    """The card's qk_norm gives every block its attn_q_norm/attn_k_norm (what the real GGUF has, so the plan's
    fingerprint accepts it); a header with them reads as qk_norm, one without as not."""
    full, air = load_model("glm-4.5-q4_k_m"), load_model("glm-4.5-air-q4_k_m")
    assert full.hparams.qk_norm and not air.hparams.qk_norm
    names = {t.name for t in full.tensors}
    assert all(f"blk.{b}.attn_{x}_norm.weight" in names for b in range(full.hparams.n_layer) for x in "qk")
    assert not any("attn_q_norm" in t.name for t in air.tensors)


def test_classes_partition_the_bytes_exactly():
    model = load_model("glm-4.5-air-q4_k_m")
    classes = ("dense", "expert", "drafter_dense", "drafter_expert")
    assert sum(model.bytes_of(c) for c in classes) == model.total_bytes
    hp = model.hparams
    # every trunk MoE block has its experts; the NextN block's are the drafter's
    assert [layer.layer for layer in model.expert_layers] == list(range(hp.n_leading_dense, hp.n_trunk))
    assert [layer.layer for layer in model.drafter_expert_layers] == [hp.n_trunk]
    assert sum(layer.block_bytes for layer in model.expert_layers) == model.bytes_of("expert")
    assert model.drafter_expert_bytes == model.drafter_expert_layers[0].block_bytes
    assert model.largest_expert_blob_bytes == max(layer.blob_bytes for layer in model.expert_layers)


def test_known_size_of_qwen3_30b_a3b_q8_0():
    """DEVICE.md's llama.cpp peer ran a GGUF of this shape at 30.25 GiB."""
    model = load_model("qwen3-30b-a3b-q8_0")
    assert round(model.total_bytes / 2**30, 2) == 30.25
    # one expert: gate and up 768 rows of 2048, down 2048 rows of 768, Q8_0 = 34 bytes per 32 values
    assert model.largest_expert_blob_bytes == (2 * 768 * 2048 + 2048 * 768) // 32 * 34


def test_a_slot_holds_each_experts_quants_then_scales_on_16_byte_offsets():
    model = load_model("qwen3-30b-a3b-q8_0")
    layout = model.slot_layout
    quants, scales = 768 * 2048, 768 * 2048 // 32 * 2       # one matrix of one expert, Q8_0
    assert layout.parts == {
        ("ffn_gate_exps", "data"): (0, quants), ("ffn_up_exps", "data"): (quants, quants),
        ("ffn_down_exps", "data"): (2 * quants, quants), ("ffn_gate_exps", "scales"): (3 * quants, scales),
        ("ffn_up_exps", "scales"): (3 * quants + scales, scales),
        ("ffn_down_exps", "scales"): (3 * quants + 2 * scales, scales)}
    assert layout.slot_bytes == model.largest_expert_blob_bytes     # 5013504 bytes: already 256-aligned


@pytest.mark.parametrize("kv, per_token", [("f16", 2 * 4 * 128 * 2), ("q8_0", 2 * 4 * 128 // 32 * 34),
                                           ("q4_0", 2 * 4 * 128 // 32 * 18),
                                           ("k8v4", 4 * 128 // 32 * 34 + 4 * 128 // 32 * 18)])
def test_kv_bytes_per_token(kv, per_token):
    assert load_model("qwen3-30b-a3b-q8_0").kv_bytes_per_token(parse_kv_type(kv)) == per_token


def test_a_full_gguf_with_data_agrees_with_gguf_py(tmp_path):
    """A small complete file: our inventory's bytes are GGUFReader's, tensor by tensor."""
    rng = np.random.default_rng()
    card = yaml.safe_load((MODELS_DIR / "qwen3-30b-a3b-q8_0.yaml").read_text())
    card["metadata"].update(block_count=2, embedding_length=64, expert_feed_forward_length=32, expert_count=4,
                            expert_used_count=2, vocab_size=96, **{"attention.head_count": 4,
                                                                   "attention.head_count_kv": 2,
                                                                   "attention.key_length": 32,
                                                                   "attention.value_length": 32})
    card["types"] = {"default": "f16"}
    card_path = tmp_path / "tiny.yaml"
    card_path.write_text(yaml.safe_dump(card))
    header = load_model(card_path)
    writer = GGUFWriter(str(tmp_path / "tiny.gguf"), "qwen3moe")
    for key, value in read_tiny_metadata(card_path).items():
        writer.add_uint32(key, value) if isinstance(value, int) else writer.add_float32(key, value)
    for t in header.tensors:
        dtype = np.float16 if t.ggml_type == GGMLQuantizationType.F16 else np.float32
        writer.add_tensor(t.name, rng.standard_normal(tuple(reversed(t.shape))).astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = load_model(tmp_path / "tiny.gguf")
    reader = GGUFReader(tmp_path / "tiny.gguf")
    assert {t.name: int(t.n_bytes) for t in reader.tensors} == model.tensor_bytes
    assert model.fingerprint == header.fingerprint


def read_tiny_metadata(card_path):
    card = yaml.safe_load(card_path.read_text())
    return {f"qwen3moe.{k}": v for k, v in card["metadata"].items()}


def test_header_only_file_plans_without_its_data(tmp_path):
    path = tmp_path / "partial.gguf"
    header = write_header_only(MODELS_DIR / "glm-4.5-air-q4_k_m.yaml", path)
    assert path.stat().st_size < 1_000_000 < header.tensors[-1].offset     # the data is not there
    from planner import solve
    plan = solve(hardware="rtx-2060-super-8g", model=path, context=8192, kv="q8_0")
    assert plan.model["fingerprint"] == load_model("glm-4.5-air-q4_k_m").fingerprint


def _header_with(tmp_path, card_name: str, drop: str | None = None, extra: dict | None = None):
    path = tmp_path / "model.gguf"
    header = write_header_only(MODELS_DIR / f"{card_name}.yaml", path, extra)
    parsed = read_header(path)
    if drop:
        metadata = {k: v for k, v in parsed.metadata.items() if k != drop}
        parsed = type(parsed)(**{**parsed.__dict__, "metadata": metadata})
    return header, parsed


def test_missing_metadata_key_is_named(tmp_path):
    _, parsed = _header_with(tmp_path, "qwen3-30b-a3b-q8_0", drop="qwen3moe.expert_count")
    with pytest.raises(StratumError, match="missing metadata key 'qwen3moe.expert_count'"):
        inventory(parsed, "m")


def test_unknown_architecture_is_refused(tmp_path):
    _, parsed = _header_with(tmp_path, "qwen3-30b-a3b-q8_0")
    metadata = {**parsed.metadata, "general.architecture": "llama"}
    with pytest.raises(StratumError, match="unknown architecture 'llama'"):
        inventory(type(parsed)(**{**parsed.__dict__, "metadata": metadata}), "m")


def test_missing_expert_tensor_is_named(tmp_path):
    _, parsed = _header_with(tmp_path, "qwen3-30b-a3b-q8_0")
    tensors = tuple(t for t in parsed.tensors if t.name != "blk.5.ffn_up_exps.weight")
    with pytest.raises(StratumError, match="missing tensor 'blk.5.ffn_up_exps.weight'"):
        inventory(type(parsed)(**{**parsed.__dict__, "tensors": tensors}), "m")


def test_shape_that_disagrees_with_the_metadata_is_refused(tmp_path):
    _, parsed = _header_with(tmp_path, "qwen3-30b-a3b-q8_0")
    metadata = {**parsed.metadata, "qwen3moe.expert_count": 64}
    with pytest.raises(StratumError, match="ffn_gate_inp.weight' has shape"):
        inventory(type(parsed)(**{**parsed.__dict__, "metadata": metadata}), "m")


@pytest.mark.parametrize("change, message", [
    ({"types": {"default": "q4_k", "ffn_down_exps": "q9_9"}}, "unknown GGML type 'q9_9'"),
    ({"types": {"default": "q4_k"}, "metadata_drop": "embedding_length"}, "missing metadata key"),
    ({"overrides": [{"role": "attn_v", "layers": [999], "type": "q6_k"}]}, "list of block indices"),
    ({"colour": "red"}, "colour: unknown field"),
    ({"qk_norm": "yes"}, "qk_norm: expected true or false"),
])
def test_bad_cards_are_refused_with_the_field(tmp_path, change, message):
    card = yaml.safe_load((MODELS_DIR / "glm-4.5-air-q4_k_m.yaml").read_text())
    drop = change.pop("metadata_drop", None)
    card.update(change)
    if drop:
        del card["metadata"][drop]
    path = tmp_path / "card.yaml"
    path.write_text(yaml.safe_dump(card))
    with pytest.raises(StratumError, match=message):
        load_model(path)


def test_k_quant_on_rows_that_are_not_whole_blocks_is_refused(tmp_path):
    card = yaml.safe_load((MODELS_DIR / "glm-4.5-air-q4_k_m.yaml").read_text())
    card["types"] = {"default": "q4_k"}       # the 1408-wide expert rows are not multiples of 256
    card["overrides"] = []
    path = tmp_path / "card.yaml"
    path.write_text(yaml.safe_dump(card))
    with pytest.raises(StratumError, match="not a multiple of Q4_K's block of 256"):
        load_model(path)


def test_unknown_model_name_lists_the_bundled_cards():
    with pytest.raises(StratumError, match="bundled cards: glm-4.5-air-q4_k_m"):
        load_model("no-such-model")
