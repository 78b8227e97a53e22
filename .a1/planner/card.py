"""Model cards: plan a model you have not downloaded.

A card (`plans/models/*.yaml`) gives the architecture, its metadata, and the quant type of each tensor role.
It expands into the GGUF header the real file would have (same names, shapes and types), so the inventory
code is the same for both, and a plan made from a card accepts the real GGUF that matches it.

    name: qwen3-30b-a3b-q8_0
    architecture: qwen3moe
    metadata: {block_count: 48, embedding_length: 2048, ...}   # GGUF keys without the '<arch>.' prefix
    types: {default: q8_0, output: q6_k}                       # role -> GGML type
    overrides:                                                 # optional, per layer
      - {role: ffn_down_exps, layers: use_more_bits, type: q6_k}
    qk_norm: true      # glm4moe only, optional: the model norms q and k heads (GLM-4.5; qwen3moe always does)

Norms, biases and the router (`ffn_gate_inp`) are F32, as llama.cpp leaves them, unless a type names them.
"""

from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from planner.architecture import hparams_from_metadata, tensor_layer, tensor_layout, tensor_role
from planner.document import read_document
from planner.errors import StratumError
from planner.header import GGUFHeader, TensorInfo

_ALIGNMENT = 32
_F32_ROLES = {"ffn_gate_inp"}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the blocks that Q4_K_M/Q5_K_M give more bits (llama-quant.cpp)."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def card_header(path) -> GGUFHeader:
    source = str(path)
    card = read_document(path, "model card")
    if not isinstance(card, dict):
        raise StratumError("expected a mapping with architecture, metadata and types", source=source)
    unknown = sorted(set(card) - {"name", "description", "architecture", "metadata", "types", "overrides",
                                  "qk_norm"})
    if unknown:
        raise StratumError("unknown field; known: name, description, architecture, metadata, types, overrides, "
                           "qk_norm", source=source, field=unknown[0])
    architecture = card.get("architecture")
    if not isinstance(card.get("metadata"), dict):
        raise StratumError("expected a mapping of GGUF metadata keys", source=source, field="metadata")
    metadata = {"general.architecture": architecture, "general.name": card.get("name", Path(path).stem)}
    metadata.update({f"{architecture}.{key}": value for key, value in card["metadata"].items()})
    qk_norm = card.get("qk_norm", False)
    if not isinstance(qk_norm, bool) or (qk_norm and architecture != "glm4moe"):
        raise StratumError("expected true or false, and only for glm4moe (qwen3moe always norms q and k)",
                           source=source, field="qk_norm")
    hp = hparams_from_metadata(metadata, source, qk_norm=qk_norm)
    types = _types(card, source)
    overrides = _overrides(card, hp.n_layer, source)
    tensors, offset = [], 0
    for name, shape in tensor_layout(hp):
        role = tensor_role(name)
        ggml_type = overrides.get((role, tensor_layer(name)), types.get(role))
        if ggml_type is None:
            ggml_type = GGMLQuantizationType.F32 if len(shape) == 1 or role in _F32_ROLES else types["default"]
        block_size, _ = GGML_QUANT_SIZES[ggml_type]
        if shape[0] % block_size:
            raise StratumError(f"{name} has rows of {shape[0]} values, not a multiple of {ggml_type.name}'s "
                               f"block of {block_size}; give its role another type",
                               source=source, field=f"types.{role}")
        tensor = TensorInfo(name=name, shape=shape, ggml_type=ggml_type, offset=offset)
        tensors.append(tensor)
        offset += -(-tensor.n_bytes // _ALIGNMENT) * _ALIGNMENT
    return GGUFHeader(source=source, version=3, metadata=metadata, tensors=tuple(tensors), alignment=_ALIGNMENT,
                      data_offset=0, header_bytes=0)


def _ggml_type(text, source: str, field: str) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType[str(text).upper()]
    except KeyError:
        raise StratumError(f"unknown GGML type {text!r}; e.g. f16, q8_0, q4_k, q6_k", source=source,
                           field=field) from None


def _types(card: dict, source: str) -> dict:
    types = card.get("types")
    if not isinstance(types, dict) or "default" not in types:
        raise StratumError("expected a mapping of tensor role to GGML type with a 'default'", source=source,
                           field="types")
    return {role: _ggml_type(text, source, f"types.{role}") for role, text in types.items()}


def _overrides(card: dict, n_layers: int, source: str) -> dict:
    """(role, layer) -> type, from entries whose `layers` is a list of blocks or `use_more_bits`."""
    result = {}
    for i, entry in enumerate(card.get("overrides") or []):
        where = f"overrides[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"role", "layers", "type"}:
            raise StratumError("expected a mapping with role, layers and type", source=source, field=where)
        layers = entry["layers"]
        if layers == "use_more_bits":
            layers = [layer for layer in range(n_layers) if use_more_bits(layer, n_layers)]
        elif not isinstance(layers, list) or not all(isinstance(x, int) and 0 <= x < n_layers for x in layers):
            raise StratumError(f"expected a list of block indices below {n_layers} or 'use_more_bits'",
                               source=source, field=where + ".layers")
        ggml_type = _ggml_type(entry["type"], source, where + ".type")
        result.update({(entry["role"], layer): ggml_type for layer in layers})
    return result
