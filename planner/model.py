"""The model's inventory, from a GGUF header or a model card: what must be resident, what streams, exact bytes.

Tensor classes (DESIGN.md's vocabulary):
- dense: attention, norms, router, shared expert, embeddings, output head; read every token, always resident;
- expert: a trunk layer's routed experts (`ffn_{gate,up,down}_exps`), the bulk of the bytes;
- drafter_dense / drafter_expert: the NextN block's tensors (the MTP drafter); its routed experts are read
  only by decode, which is why they can be lent to the prefill ring while a prompt is read.
"""

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from planner.architecture import EXPERT_ROLES, HParams, hparams_from_metadata, tensor_layer, tensor_layout, tensor_role
from planner.card import card_header
from planner.errors import StratumError
from planner.header import GGUFHeader, TensorInfo, read_header
from planner.kv import KVType, row_bytes
from plans import MODELS_DIR

# Tensors every block of the layout must have; the rest may be absent (tied output head, optional norms).
_REQUIRED_ROLES = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", *EXPERT_ROLES,
                   "ffn_gate", "ffn_up", "ffn_down", "token_embd", "nextn.eh_proj"}
# Hyperparameters that change the plan but not every tensor shape: part of the fingerprint.
_STRUCTURAL = ("architecture", "n_layer", "n_nextn", "n_embd", "n_head", "n_head_kv", "head_dim_k", "head_dim_v",
               "n_expert", "n_expert_used", "n_expert_shared", "n_leading_dense", "n_vocab")


@dataclass(frozen=True)
class ExpertLayer:
    layer: int
    n_expert: int
    blob_bytes: int         # one expert: its gate, up and down rows, as stored

    @property
    def block_bytes(self) -> int:
        return self.blob_bytes * self.n_expert


# Types whose blocks the kernels read as quants apart from their float16 scales (K-quants: a block's header;
# codegen.lower.weights packs them so); every other type's expert rows fill one part of a slot.
SCALE_BYTES = {T.Q8_0: 2, T.Q4_0: 2, T.Q4_K: 16, T.Q5_K: 16, T.Q6_K: 18}   # a block's bytes read apart from its quants
SCALES_APART = tuple(SCALE_BYTES)
SLOT_PART_ALIGNMENT_BYTES = 16      # the prefill kernels read a slot's words 16 bytes at a time
SLOT_ALIGNMENT_BYTES = 256          # a slot starts where a region may (planner.layout.aligned)


@dataclass(frozen=True)
class SlotLayout:
    """One routed expert in a slot of the expert cache, the prefill ring or the drafter's block, which lie one
    after another (planner.layout.REGION_ORDER) and are read as one array of slots, blob-major: slot s starts
    s * slot_bytes after slot 0 and holds each matrix's quants, then each matrix's scales, at fixed offsets.
    So the drafter's block is ring slots as it stands (the room), and any expert fits any slot."""
    parts: dict         # (role, "data" | "scales") -> (offset in the slot, bytes); scales absent for other types
    slot_bytes: int

    def part(self, role: str, kind: str) -> tuple[int, int]:
        return self.parts[role, kind]


def split_bytes(ggml_type, n_elements: int) -> tuple[int, int]:
    """(quant bytes, scale bytes) of n_elements stored as ggml_type, as the kernels' packed layout holds them."""
    block_size, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    n_blocks = n_elements // block_size
    if T(ggml_type) in SCALES_APART:
        scale_bytes = SCALE_BYTES[T(ggml_type)]
        return n_blocks * (type_size - scale_bytes), n_blocks * scale_bytes
    return n_blocks * type_size, 0


def _round_up(n_bytes: int, alignment: int) -> int:
    return -(-n_bytes // alignment) * alignment


@dataclass(frozen=True)
class Model:
    name: str
    source: str
    hparams: HParams
    tensors: tuple[TensorInfo, ...]
    tensor_class: dict          # tensor name -> 'dense' | 'expert' | 'drafter_dense' | 'drafter_expert'

    @cached_property
    def tensor_bytes(self) -> dict:
        """Tensor name -> bytes as stored."""
        return {t.name: t.n_bytes for t in self.tensors}

    @cached_property
    def tensor_type_names(self) -> dict:
        return {t.name: t.ggml_type.name for t in self.tensors}

    @cached_property
    def matrix_type_names(self) -> frozenset:
        """The types of the matrices matmuls read (every 2-D tensor but the embedding table, a lookup)."""
        return frozenset(t.ggml_type.name for t in self.tensors if len(t.shape) > 1 and t.name != "token_embd.weight")

    def read_bytes(self, names, rates: tuple = ()) -> float:
        """Bytes of the tensors `names`; with `rates` (`planner.profile.GPU.decode_weight_rates`), each tensor's
        bytes over its type's rate: the bytes of Q8_0 weights a decode kernel reads in the same time."""
        rate = dict(rates)
        return float(sum(self.tensor_bytes[n] / rate.get(self.tensor_type_names[n], 1.0) for n in names))

    def block_weight_bytes(self, weights: tuple, representative: int, blocks: tuple, rates: tuple = ()) -> np.ndarray:
        """Bytes of a representative block's tensors `weights` as each of `blocks` stores them (blocks of one
        kind hold the same tensors, each with its own bytes and types: `read_bytes` with `rates`), remembered:
        the solver prices the same nodes for every candidate pass."""
        key = (weights, representative, blocks, rates)
        cache = self._block_weight_bytes
        if key not in cache:
            cache[key] = np.array([self.read_bytes([w.replace(f"blk.{representative}.", f"blk.{b}.", 1)
                                                    for w in weights], rates) for b in blocks], dtype=np.float64)
        return cache[key]

    def expert_read_blob_bytes(self, rates: tuple) -> dict:
        """Trunk layer -> one routed expert's bytes (`ExpertLayer.blob_bytes`) over their types' decode rates
        (`read_bytes`)."""
        blobs: dict[int, float] = {}
        for t in self.tensors:
            if self.tensor_class[t.name] == "expert":
                layer = tensor_layer(t.name)
                blobs[layer] = blobs.get(layer, 0.0) + self.read_bytes([t.name], rates) / self.hparams.n_expert
        return blobs

    @cached_property
    def _block_weight_bytes(self) -> dict:
        return {}

    def bytes_of(self, cls: str) -> int:
        return sum(t.n_bytes for t in self.tensors if self.tensor_class[t.name] == cls)

    @cached_property
    def total_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @cached_property
    def dense_bytes(self) -> int:
        return self.bytes_of("dense")

    @cached_property
    def layer_dense_bytes(self) -> tuple[int, ...]:
        """Dense bytes of each trunk block (what moves with the block in a multi-GPU split)."""
        per_layer = [0] * self.hparams.n_trunk
        for t in self.tensors:
            layer = tensor_layer(t.name)
            if self.tensor_class[t.name] == "dense" and layer is not None:
                per_layer[layer] += t.n_bytes
        return tuple(per_layer)

    @cached_property
    def global_dense_bytes(self) -> dict:
        """Dense tensors outside the blocks: embeddings, final norm, output head."""
        return {t.name: t.n_bytes for t in self.tensors
                if self.tensor_class[t.name] == "dense" and tensor_layer(t.name) is None}

    @cached_property
    def expert_layers(self) -> tuple[ExpertLayer, ...]:
        return tuple(layer for layer in self._expert_layers() if layer.layer < self.hparams.n_trunk)

    @cached_property
    def drafter_expert_layers(self) -> tuple[ExpertLayer, ...]:
        return tuple(layer for layer in self._expert_layers() if layer.layer >= self.hparams.n_trunk)

    def _expert_layers(self) -> list[ExpertLayer]:
        blobs: dict[int, int] = {}
        for t in self.tensors:
            if self.tensor_class[t.name] in ("expert", "drafter_expert"):
                # (row length, rows per expert, experts): one expert is ne1 rows
                blobs[tensor_layer(t.name)] = blobs.get(tensor_layer(t.name), 0) + row_bytes(t.shape[0], t.ggml_type) * t.shape[1]
        return [ExpertLayer(layer, self.hparams.n_expert, blob) for layer, blob in sorted(blobs.items())]

    @cached_property
    def largest_expert_blob_bytes(self) -> int:
        """The size of one prefill-ring / expert-cache slot: any trunk expert fits in it."""
        return max(layer.blob_bytes for layer in self.expert_layers)

    @cached_property
    def slot_layout(self) -> SlotLayout:
        """Every trunk and drafter expert's parts at the offsets of the largest of each (SlotLayout)."""
        largest = {}
        for t in self.tensors:
            if self.tensor_class[t.name] in ("expert", "drafter_expert"):
                parts = split_bytes(t.ggml_type, t.shape[0] * t.shape[1])
                role = tensor_role(t.name)
                for kind, n_bytes in zip(("data", "scales"), parts):
                    if n_bytes:
                        largest[role, kind] = max(largest.get((role, kind), 0), n_bytes)
        parts, offset = {}, 0
        for kind in ("data", "scales"):
            for role in EXPERT_ROLES:
                if (role, kind) in largest:
                    parts[role, kind] = (offset, largest[role, kind])
                    offset = _round_up(offset + largest[role, kind], SLOT_PART_ALIGNMENT_BYTES)
        return SlotLayout(parts, _round_up(offset, SLOT_ALIGNMENT_BYTES))

    @cached_property
    def drafter_dense_bytes(self) -> int:
        return self.bytes_of("drafter_dense")

    @cached_property
    def drafter_expert_bytes(self) -> int:
        return self.bytes_of("drafter_expert")

    @property
    def has_drafter(self) -> bool:
        return self.hparams.n_nextn > 0

    def kv_bytes_per_token(self, kv: KVType) -> int:
        """One token's K and V in one attention block (every block, trunk or NextN, has the same heads)."""
        hp = self.hparams
        return row_bytes(hp.n_head_kv * hp.head_dim_k, kv.k_type) + row_bytes(hp.n_head_kv * hp.head_dim_v, kv.v_type)

    @cached_property
    def summary(self) -> dict:
        """What a plan records of its model, so a refusal can say what differs."""
        hp = self.hparams
        return {"architecture": hp.architecture, "blocks": hp.n_layer, "nextn_blocks": hp.n_nextn,
                "embedding": hp.n_embd, "heads": hp.n_head, "kv_heads": hp.n_head_kv, "experts": hp.n_expert,
                "experts_used": hp.n_expert_used, "vocab": hp.n_vocab, "tensors": len(self.tensors),
                "total_bytes": self.total_bytes, "dense_bytes": self.dense_bytes,
                "expert_bytes": self.bytes_of("expert"), "drafter_dense_bytes": self.drafter_dense_bytes,
                "drafter_expert_bytes": self.drafter_expert_bytes}

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the inventory (names, types, shapes) and structural hyperparameters, not of the file:
        a plan made from a model card accepts the real GGUF that matches it."""
        structure = {key: getattr(self.hparams, key) for key in _STRUCTURAL}
        inventory = sorted((t.name, t.ggml_type.name, list(t.shape)) for t in self.tensors)
        return hashlib.sha256(json.dumps([structure, inventory]).encode()).hexdigest()[:16]


def inventory(header: GGUFHeader, name: str) -> Model:
    """Classify every tensor of a header and check it against its architecture's layout."""
    source = header.source
    embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    present = {t.name: t for t in header.tensors}
    hp = hparams_from_metadata(header.metadata, source, embedding.shape[1] if embedding and len(embedding.shape) > 1
                               else None, qk_norm="blk.0.attn_q_norm.weight" in present)
    for tensor_name, shape in tensor_layout(hp):
        tensor = present.get(tensor_name)
        if tensor is None:
            if tensor_role(tensor_name) in _REQUIRED_ROLES:
                raise StratumError(f"missing tensor {tensor_name!r} that {hp.architecture} needs", source=source)
        elif tuple(tensor.shape) != shape:
            raise StratumError(f"tensor {tensor_name!r} has shape {list(tensor.shape)}, expected {list(shape)} "
                               "from the metadata", source=source)
    classes = {t.name: _classify(t.name, hp) for t in header.tensors}
    return Model(name=name, source=source, hparams=hp, tensors=tuple(header.tensors), tensor_class=classes)


def _classify(name: str, hp: HParams) -> str:
    layer = tensor_layer(name)
    is_expert = tensor_role(name) in EXPERT_ROLES
    if layer is not None and layer >= hp.n_trunk:
        return "drafter_expert" if is_expert else "drafter_dense"
    return "expert" if is_expert else "dense"


def bundled_cards() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def load_model(spec) -> Model:
    """A GGUF file (complete or only its header), a model card YAML, or a bundled card's name."""
    path = Path(spec)
    if path.suffix.lower() == ".gguf" or (path.is_file() and path.suffix.lower() not in (".yaml", ".yml")):
        return inventory(read_header(path), name=path.stem)
    if path.suffix.lower() in (".yaml", ".yml"):
        return inventory(card_header(path), name=path.stem)
    if (MODELS_DIR / f"{spec}.yaml").exists():
        return inventory(card_header(MODELS_DIR / f"{spec}.yaml"), name=str(spec))
    raise StratumError(f"no GGUF file, card file or bundled model card named {str(spec)!r}; bundled cards: "
                       f"{', '.join(bundled_cards())}")
