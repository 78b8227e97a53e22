"""Random MoE models shaped like real ones: tiny GGUF files for tests, real-shape packed weights for benchmarks.

    write_model(path, "glm4moe", seed=1, types={"experts": "q8_0", "dense": "f16"})   # a valid GGUF, ~100 KB
    write_weights(path, "glm4moe", trained, name="demo", n_embd=512, ...)            # given values, same layout
    for name, packed in realistic_weights("qwen3-30b-a3b-q8_0", seed=1):             # one tensor at a time
        ...upload(packed)...

Every tensor's name and shape come from the planner's layout (`planner.architecture.tensor_layout`); each draws
its values from its own random stream (the seed and its name), so a model's values do not depend on the types
it is stored in, nor on which other tensors are generated. Values keep activations O(1) through the layers:
matrices normal(0, 1/sqrt(fan_in)), norms near 1, embeddings of unit RMS plus one massive dimension (below).

Expert popularity is skewed like a trained model's, by `skew`: each MoE block ranks its experts by its own
permutation of normal quantiles (the popularity profile), scaled so that `skew=1` gives the top quarter of the
experts about half the routed slots (calibrated for the model's expert count and top-k on idealised router
logits, independent normals); 0 leaves no designed preference; more is steeper. glm4moe gets it through
`exp_probs_b`, which biases selection only. qwen3moe has no bias tensor: its routers read one hidden dimension
that carries a large constant (as trained models' "massive activations" do): the embeddings set it, and no
attention or FFN matrix reads or writes it, so every normed hidden state carries it and each router row's
weight there is a per-expert offset of the router logits (scaled by the expected growth of the residual
stream with depth, so deep blocks are skewed like shallow ones). The random part of every router row skips
that dimension, so `skew=0` leaves no designed preference in either architecture.
"""

import functools
import math
import zlib
from pathlib import Path
from statistics import NormalDist

import numpy as np
import yaml
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from codegen.lower.weights import Q4_K_HEADER_BYTES, QUANT_BLOCK, PackedWeight, quantize, unpack
from codegen.lower.weights import check_kernel_type, packed_layout
from planner.architecture import (EXPERT_ROLES, METADATA_KEYS, SUPPORTED_ARCHITECTURES, HParams, hparams_from_metadata,
                                  tensor_layer, tensor_layout, tensor_role)
from planner.errors import StratumError
from planner.model import SCALE_BYTES, load_model
from plans import MODELS_DIR

# shape keyword -> (metadata keys without the '<arch>.' prefix, GGUF value kind), from the planner's own table
# (head_dim sets K's and V's; block_count and nextn_predict_layers come from n_trunk and nextn)
def _shape_keys() -> dict:
    value_kinds = {int: "u32", float: "f32", bool: "bool"}
    keys = {}
    for key, (field, _, _) in METADATA_KEYS.items():
        if field not in ("n_layer", "n_nextn"):
            keyword = "head_dim" if field in ("head_dim_k", "head_dim_v") else field
            keys[keyword] = (keys.get(keyword, ((),))[0] + (key,), value_kinds[HParams.__annotations__[field]])
    return keys


_SHAPE_KEYS = _shape_keys()
# n_trunk: blocks before the NextN blocks (block_count = n_trunk + nextn). head_dim 32: quant blocks fit a head,
# so K/V may be quantized; glm4moe rotates half of each head, as GLM-4.5 does.
_DEFAULT_SHAPES = {
    "qwen3moe": dict(n_trunk=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_rot=32, n_ff=96, n_ff_exp=32,
                     n_expert=8, n_expert_used=2, n_vocab=128, n_ctx_train=4096, rms_eps=1e-6, rope_base=10000.0),
    "glm4moe": dict(n_trunk=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_rot=16, n_ff=96, n_ff_exp=32,
                    n_expert=8, n_expert_used=2, n_expert_shared=1, n_leading_dense=1, n_vocab=128,
                    n_ctx_train=4096, rms_eps=1e-5, rope_base=10000.0, expert_weights_scale=2.5,
                    expert_weights_norm=True),
}
_DEFAULT_NEXTN = {"qwen3moe": 0, "glm4moe": 1}
_GATING_SIGMOID = 2         # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID, what converted GLM files carry
_TYPE_GROUPS = ("experts", "dense", "default")
_F32_ROLES = {"ffn_gate_inp"}   # the router stays F32 unless a type names its role, as llama.cpp leaves it

_STRUCTURE_STREAM = 0x5EED      # the random stream of the massive dimension and the popularity profiles
MASSIVE = 1.0           # the massive dimension's value in the embeddings, in units of sqrt(n_embd)
NORM_JITTER = 0.05      # norm weights: 1 + normal(0, NORM_JITTER)
BIAS_STD = 0.2          # q and k biases
V_BIAS_STD = 0.02       # v biases stay small: a constant in V is a constant in every attention output, which the
                        # routers would read as a preference
RESIDUAL_GROWTH = 0.2   # mean square each block adds to the residual stream per dimension (the tiny models' figure)
TOP_QUARTER_SHARE = 0.5     # the top quarter of the experts' share of the routed slots at skew 1
# matrices that read the residual stream (their input dims) and that write it (their output dims)
_READERS = {"attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_gate_shexp", "ffn_up_shexp", "ffn_gate_exps",
            "ffn_up_exps", "nextn.eh_proj"}
_WRITERS = {"attn_output", "ffn_down", "ffn_down_shexp", "ffn_down_exps", "nextn.eh_proj"}


def write_model(path, architecture: str, *, seed: int, types: dict | None = None, skew: float = 1.0,
                nextn: int | None = None, **shape) -> Path:
    """Write a complete GGUF of `architecture` with random weights; returns its path.

    shape: any of n_trunk, n_embd, n_head, n_head_kv, head_dim, n_rot, n_ff, n_ff_exp, n_expert, n_expert_used,
    n_expert_shared, n_leading_dense, n_vocab, n_ctx_train, rms_eps, rope_base, expert_weights_scale,
    expert_weights_norm (defaults: a tiny model, `_DEFAULT_SHAPES`), and qk_norm (glm4moe: the q/k head norms
    GLM-4.5 has; qwen3moe always has them). nextn: NextN blocks (glm4moe 1, qwen3moe 0).
    types: tensor type per tensor name (`blk.1.ffn_down_exps.weight`: one block's, as K-quant mixes store
    some blocks' tensors in another type), role (`attn_q`, `ffn_down_exps`, ...) or group (`experts`: the
    routed experts, `dense`: every other matrix, `default`), the first that names a tensor, as f32, f16, bf16,
    q8_0, q4_0, q4_k or q6_k; F32 otherwise. Norms, biases and the router stay F32 unless their own role or
    name is named.
    """
    metadata, hp = _describe(architecture, nextn, shape)
    return _write(path, f"stratum synthetic {architecture}", metadata, hp, _Structure(hp, seed, skew).values, types)


def write_weights(path, architecture: str, tensors: dict, *, name: str, types: dict | None = None,
                  nextn: int | None = None, strings: dict | None = None, **shape) -> Path:
    """Write given weights (a trained model's) as a GGUF of `architecture`; returns its path.

    tensors: every tensor of the layout by name, float values in numpy order (linear (out, in), experts
    (n_expert, out, in)); name: the model's `general.name`; strings: more metadata, string values (a
    tokenizer's); shape, nextn and types as in `write_model`.
    """
    metadata, hp = _describe(architecture, nextn, shape)
    layout = {tensor: tuple(reversed(gguf_shape)) for tensor, gguf_shape in tensor_layout(hp)}
    unexpected = sorted(set(tensors) ^ set(layout))
    if unexpected:
        which = "not in" if unexpected[0] in tensors else "missing from"
        raise StratumError(f"tensor {unexpected[0]!r} is {which} the {architecture} layout of this shape")
    for tensor, numpy_shape in layout.items():
        if tuple(np.shape(tensors[tensor])) != numpy_shape:
            raise StratumError(f"tensor {tensor!r} has shape {list(np.shape(tensors[tensor]))}, expected "
                               f"{list(numpy_shape)} (numpy order)")
    metadata.update({key: ("str", value) for key, value in (strings or {}).items()})
    return _write(path, name, metadata, hp, lambda tensor, _: tensors[tensor], types)


def shape_hparams(architecture: str, nextn: int | None = None, **shape) -> HParams:
    """The hyperparameters `write_model` and `write_weights` write for a shape (the defaults for the rest)."""
    return _describe(architecture, nextn, shape)[1]


def _write(path, name: str, metadata: dict, hp: HParams, values, types: dict | None) -> Path:
    """The GGUF of `hp`'s layout: tensor values from values(name, numpy shape), stored in `types`."""
    shapes = [(tensor, tuple(reversed(gguf_shape))) for tensor, gguf_shape in tensor_layout(hp)]
    resolve = _type_resolver(types, [tensor for tensor, _ in shapes])
    tensor_types = [resolve(tensor, shape, T.F32) for tensor, shape in shapes]     # refused before a file exists
    path = Path(path)
    writer = GGUFWriter(str(path), hp.architecture)
    writer.add_name(name)
    adders = {"u32": writer.add_uint32, "f32": writer.add_float32, "bool": writer.add_bool, "str": writer.add_string}
    for key, (kind, value) in metadata.items():
        adders[kind](key, value)
    for (tensor, shape), ggml_type in zip(shapes, tensor_types):
        packed = quantize(values(tensor, shape), ggml_type)
        writer.add_tensor(tensor, unpack(packed).reshape(*shape[:-1], -1), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_packed(shape, ggml_type, rng: np.random.Generator, std: float | None = None) -> PackedWeight:
    """Random weights of numpy `shape` (..., n_out, n_in) generated directly in the packed layout (no quantize
    pass: fast for GBs). Values have standard deviation `std` (default 1/sqrt(n_in)): F32/F16/BF16 normal;
    Q8_0 quants uniform in [-127, 127], Q4_0 nibbles uniform, with float16 block scales around that size; Q4_K
    and Q5_K as `_random_with_mins`, Q6_K as `_random_q6_k`."""
    ggml_type, shape = T(ggml_type), tuple(int(d) for d in shape)
    check_kernel_type(ggml_type, shape)
    std = 1.0 / math.sqrt(shape[-1]) if std is None else std
    if ggml_type in (T.Q4_K, T.Q5_K):
        return _random_with_mins(ggml_type, shape, rng, std)
    if ggml_type == T.Q6_K:
        return _random_q6_k(shape, rng, std)
    if ggml_type in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal(shape, dtype=np.float32)
        values *= np.float32(std)
        if ggml_type == T.F32:
            return PackedWeight(ggml_type, shape, values, None)
        if ggml_type == T.F16:
            return PackedWeight(ggml_type, shape, values.astype(np.float16), None)
        return PackedWeight(ggml_type, shape, (values.view(np.uint32) >> 16).astype(np.uint16), None)
    n_quants = math.prod(shape) if ggml_type == T.Q8_0 else math.prod(shape) // 2
    data = np.frombuffer(rng.bytes(n_quants), dtype=np.uint8 if ggml_type == T.Q4_0 else np.int8).copy()
    if ggml_type == T.Q8_0:
        np.maximum(data, -127, out=data)   # ggml's Q8_0 never stores -128
        data, quant_std = data.reshape(shape), 127.0 / math.sqrt(3.0)
    else:
        data, quant_std = data.reshape(*shape[:-1], shape[-1] // 2), math.sqrt((16 * 16 - 1) / 12.0)
    scales = rng.uniform(0.75, 1.25, (*shape[:-1], shape[-1] // QUANT_BLOCK)) * (std / quant_std)
    return PackedWeight(ggml_type, shape, data, scales.astype(np.float16))


def _random_with_mins(ggml_type, shape, rng: np.random.Generator, std: float) -> PackedWeight:
    """Q4_K or Q5_K of random quants q (any bytes of the packed layout are valid) and random 6-bit sub-block
    scales sc and mins m (the 12 packed header bytes), each value d * sc * q - dmin * m. dmin = mean(q) d makes
    its expected value 0, and d (within +-25% per block) gives values of standard deviation about `std`."""
    (data_shape, _), _ = packed_layout(ggml_type, shape)
    n_blocks = math.prod(shape) // GGML_QUANT_SIZES[ggml_type][0]
    data = np.frombuffer(rng.bytes(math.prod(data_shape)), np.uint8).reshape(data_shape).copy()
    header = np.frombuffer(rng.bytes(n_blocks * Q4_K_HEADER_BYTES), np.uint8).reshape(n_blocks, -1).copy()
    levels = 16 if ggml_type == T.Q4_K else 32
    q_mean, q_var = (levels - 1) / 2, (levels * levels - 1) / 12.0
    six_bit_mean, six_bit_var = 31.5, (64 * 64 - 1) / 12.0
    value_var = (six_bit_mean ** 2 + six_bit_var) * q_var + 2 * q_mean ** 2 * six_bit_var   # in units of d^2
    d = rng.uniform(0.75, 1.25, n_blocks) * (std / math.sqrt(value_var))
    header[:, :4] = np.stack([d, q_mean * d], axis=1).astype(np.float16).view(np.uint8)
    scales = header.view(np.float16).reshape(*shape[:-1], shape[-1] // QUANT_BLOCK)
    return PackedWeight(ggml_type, shape, data, scales)


def _random_q6_k(shape, rng: np.random.Generator, std: float) -> PackedWeight:
    """Q6_K of random 6-bit quants q (any bytes of the packed layout are valid) and random int8 run scales sc
    in [32, 127], each value d * sc * (q - 32); d (within +-25% per block) gives values of standard deviation
    about `std` (their mean is -0.03 std: q - 32 averages -0.5)."""
    (data_shape, _), scales_shape = packed_layout(T.Q6_K, shape)
    n_blocks = math.prod(shape) // GGML_QUANT_SIZES[T.Q6_K][0]
    data = np.frombuffer(rng.bytes(math.prod(data_shape)), np.uint8).reshape(data_shape).copy()
    header = np.empty((n_blocks, SCALE_BYTES[T.Q6_K]), np.uint8)
    header[:, :16] = rng.integers(32, 128, (n_blocks, 16), dtype=np.uint8)
    q_square, sc_square = (64 * 64 - 1) / 12.0 + 0.25, 79.5 ** 2 + (96 * 96 - 1) / 12.0
    d = rng.uniform(0.75, 1.25, n_blocks) * (std / math.sqrt(q_square * sc_square))
    header[:, 16:] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return PackedWeight(T.Q6_K, shape, data, header.view(np.float16).reshape(scales_shape))


def realistic_weights(card, seed: int, skew: float = 1.0, types: dict | None = None):
    """Yield (name, PackedWeight) for every tensor of a model card (a bundled card's name, a card file or a GGUF
    header), one at a time, in the card's types unless `types` names others (as in `write_model`). Norms,
    biases, routers and embeddings carry the same structure as `write_model`'s; other matrices come from
    `random_packed`. Nothing is written to disk."""
    model = load_model(card)
    hp = model.hparams
    structure = _Structure(hp, seed, skew)
    resolve = _type_resolver(types, [t.name for t in model.tensors])
    for tensor in model.tensors:
        numpy_shape = tuple(reversed(tensor.shape))
        ggml_type = resolve(tensor.name, numpy_shape, tensor.ggml_type)
        if structure.is_structured(tensor.name):
            yield tensor.name, quantize(structure.values(tensor.name, numpy_shape), ggml_type)
        else:
            packed = random_packed(numpy_shape, ggml_type, _tensor_rng(seed, tensor.name))
            yield tensor.name, structure.reserve(tensor.name, packed)


def _describe(architecture: str, nextn: int | None, shape: dict) -> tuple[dict, HParams]:
    """The GGUF metadata (full key -> (kind, value)), tokenizer-free, and the hyperparameters the planner reads
    from it (its checks refuse an inconsistent shape)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise StratumError(f"unknown architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    unknown = sorted(set(shape) - set(_SHAPE_KEYS) - {"n_trunk", "qk_norm"})
    if unknown:
        raise TypeError(f"unknown shape keyword {unknown[0]!r}; known: n_trunk, qk_norm, {', '.join(_SHAPE_KEYS)}")
    shape = {**_DEFAULT_SHAPES[architecture], **shape}
    qk_norm = shape.pop("qk_norm", False)
    nextn = _DEFAULT_NEXTN[architecture] if nextn is None else nextn
    if architecture == "qwen3moe" and nextn:
        raise StratumError("qwen3moe has no NextN blocks; nextn must be 0")
    prefix = architecture + "."
    metadata = {prefix + "block_count": ("u32", shape.pop("n_trunk") + nextn)}
    for field, value in shape.items():
        keys, kind = _SHAPE_KEYS[field]
        for key in keys:
            metadata[prefix + key] = (kind, value)
    if architecture == "glm4moe":
        metadata[prefix + "nextn_predict_layers"] = ("u32", nextn)
        metadata[prefix + "expert_gating_func"] = ("u32", _GATING_SIGMOID)
    values = {key: value for key, (_, value) in metadata.items()}
    hp = hparams_from_metadata({**values, "general.architecture": architecture}, f"synthetic {architecture}",
                               qk_norm=qk_norm)
    return metadata, hp


def _type_resolver(types: dict | None, names: list):
    """(name, numpy shape, fallback type) -> the type a tensor of `names` is stored in (`write_model`'s types)."""
    types = dict(types or {})
    roles = {tensor_role(name) for name in names}
    unknown = sorted(set(types) - roles - set(names) - set(_TYPE_GROUPS))
    if unknown:
        raise StratumError(f"unknown tensor, tensor role or group {unknown[0]!r}; groups: {', '.join(_TYPE_GROUPS)}; "
                           f"roles: {', '.join(sorted(roles))}", field="types")
    parsed = {}
    for key, text in types.items():
        try:
            parsed[key] = T[str(text).upper()]
        except KeyError:
            raise StratumError(f"unknown GGML type {text!r}; e.g. f32, f16, bf16, q8_0, q4_0",
                               field=f"types.{key}") from None

    def resolve(name: str, shape: tuple, fallback: T) -> T:
        role = tensor_role(name)
        if name in parsed:
            ggml_type = parsed[name]
        elif role in parsed:
            ggml_type = parsed[role]
        elif len(shape) == 1 or role in _F32_ROLES:
            ggml_type = T.F32
        else:
            group = "experts" if role in EXPERT_ROLES else "dense"
            ggml_type = parsed.get(group, parsed.get("default", fallback))
        check_kernel_type(ggml_type, shape)
        return ggml_type
    return resolve


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


class _Structure:
    """What makes random weights route like a trained model's: the massive dimension and each MoE block's
    popularity profile, drawn from their own stream of the seed."""

    def __init__(self, hp: HParams, seed: int, skew: float):
        self.hp, self.seed = hp, seed
        rng = np.random.default_rng([seed, _STRUCTURE_STREAM])
        self.massive_dim = int(rng.integers(hp.n_embd))
        profile = _normal_quantiles(hp.n_expert)
        popularity = np.stack([rng.permutation(profile) for _ in range(hp.n_layer)])
        gating = "softmax" if hp.architecture == "qwen3moe" else "sigmoid"
        self.offsets = float(skew) * _offset_scale(hp.n_expert, hp.n_expert_used, gating) * popularity

    @staticmethod
    def is_structured(name: str) -> bool:
        role = tensor_role(name)
        return (role in ("token_embd", "nextn.embed_tokens", "ffn_gate_inp") or role.endswith("norm")
                or role.endswith(".bias"))

    def values(self, name: str, shape: tuple) -> np.ndarray:
        """float32 values of tensor `name`, numpy `shape`."""
        hp, role, layer = self.hp, tensor_role(name), tensor_layer(name)
        noise = _tensor_rng(self.seed, name).standard_normal(shape, dtype=np.float32)
        if role in ("token_embd", "nextn.embed_tokens"):
            noise[..., self.massive_dim] = MASSIVE * math.sqrt(hp.n_embd)
            return noise
        if role == "exp_probs_b.bias":
            return self.offsets[layer].astype(np.float32)
        if role.endswith(".bias"):
            return noise * np.float32(V_BIAS_STD if role == "attn_v.bias" else BIAS_STD)
        if role.endswith("norm"):
            return 1 + noise * np.float32(NORM_JITTER)
        if role == "ffn_gate_inp":
            return self._router(noise, layer)
        matrix = PackedWeight(T.F32, shape, noise * np.float32(1.0 / math.sqrt(shape[-1])), None)
        return self.reserve(name, matrix).data

    def reserve(self, name: str, packed: PackedWeight) -> PackedWeight:
        """Zero, in place, what a matrix would read from or write to the massive dimension."""
        role, dim = tensor_role(name), self.massive_dim
        if role in _READERS:
            for column in (dim, dim + self.hp.n_embd) if role == "nextn.eh_proj" else (dim,):
                _zero_input(packed, column)
        if role in _WRITERS:      # a quantized row's scales zero (K-quants: its whole headers) zero its values
            (packed.data if packed.scales is None else packed.scales)[..., dim, :] = 0
        return packed

    def _router(self, noise: np.ndarray, layer: int) -> np.ndarray:
        """Unit rows (router logits of about unit spread) that skip the massive dimension; qwen3moe's read it
        with its per-expert offsets."""
        hp, dim = self.hp, self.massive_dim
        mean_square = 1 + MASSIVE ** 2 + RESIDUAL_GROWTH * layer        # of the residual stream at this block
        rows = noise.astype(np.float64)
        rows[:, dim] = 0
        # the massive dimension takes MASSIVE**2 / mean_square of a normed hidden state's square
        rows *= math.sqrt(mean_square / (mean_square - MASSIVE ** 2)) / np.linalg.norm(rows, axis=1, keepdims=True)
        if hp.architecture == "qwen3moe":
            norm_weight = self.values(f"blk.{layer}.ffn_norm.weight", (hp.n_embd,))[dim]
            rows[:, dim] = self.offsets[layer] / (norm_weight * MASSIVE * math.sqrt(hp.n_embd / mean_square))
        return rows.astype(np.float32)


def _zero_input(packed: PackedWeight, column: int) -> None:
    """Every row's value at `column` made 0 in place, in the packed layout (`codegen.lower.weights`): its quant
    set to the one that means 0 (Q4_K, Q5_K: quant 0, and its sub-block's min 0, which lifts that sub-block's
    other values by their min)."""
    ggml_type, data = packed.ggml_type, packed.data
    if ggml_type in (T.Q4_0, T.Q4_K):
        block, within = divmod(column, QUANT_BLOCK)      # byte j of a (sub-)block: element j low, j + 16 high
        byte = block * (QUANT_BLOCK // 2) + within % (QUANT_BLOCK // 2)
        zero = 8 if ggml_type == T.Q4_0 else 0
        keep, zero = (0xF0, zero) if within < QUANT_BLOCK // 2 else (0x0F, zero << 4)
        data[..., byte] = (data[..., byte] & keep) | zero
        if ggml_type == T.Q4_K:
            _zero_q4_k_min(packed.scales.view(np.uint8)[..., column // 256 * Q4_K_HEADER_BYTES:], block % 8)
    elif ggml_type == T.Q5_K:
        chunk, within = divmod(column, 128)              # a chunk's 80 bytes: 4 sub-blocks' nibbles, fifth bits
        sub_block, value = divmod(within, QUANT_BLOCK)
        half, j = divmod(value, 16)
        data[..., chunk * 80 + sub_block * 16 + j] &= 0xF0 if half == 0 else 0x0F
        bits = chunk * 80 + 64 + j                       # word j // 4, byte j % 4
        data[..., bits] &= ~np.uint8(1 << (4 * half + sub_block))
        _zero_q4_k_min(packed.scales.view(np.uint8)[..., column // 256 * Q4_K_HEADER_BYTES:], (column // 32) % 8)
    elif ggml_type == T.Q6_K:
        chunk, within = divmod(column, 64)               # a chunk's 48 bytes: nibbles of run g, then bit pairs
        run, b = divmod(within, 16)
        nibble, bits = chunk * 48 + (run // 2) * 16 + b, chunk * 48 + 32 + b
        data[..., nibble] &= 0xF0 if run % 2 == 0 else 0x0F
        data[..., bits] = (data[..., bits] & ~np.uint8(3 << 2 * run)) | np.uint8(2 << 2 * run)     # quant 32
    else:
        data[..., column] = 0


def _zero_q4_k_min(header: np.ndarray, sub_block: int) -> None:
    """The 6-bit min of `sub_block` in Q4_K (and Q5_K) headers (header[..., :16] bytes: d, dmin, 12 packed) set to 0."""
    j = sub_block
    if j < 4:
        header[..., 8 + j] &= 0xC0
    else:
        header[..., 8 + j] &= 0x0F
        header[..., 4 + j] &= 0x3F


def top_quarter_share(expert_ids, n_expert: int) -> float:
    """The share of routed slots (an array of expert ids, any shape) that the most popular quarter of the
    experts takes: 0.25 for uniform routing, 1 when a quarter of the experts takes every slot."""
    return counts_top_quarter_share(np.bincount(np.ravel(expert_ids), minlength=n_expert))


def counts_top_quarter_share(counts) -> float:
    """The same from routing counts per expert (the last axis; leading axes, e.g. blocks, summed over)."""
    counts = np.asarray(counts)
    top = np.sort(counts, axis=-1)[..., ::-1][..., :_top_quarter(counts.shape[-1])]
    return float(top.sum() / counts.sum())


def _top_quarter(n_expert: int) -> int:
    return max(1, n_expert // 4)


def _normal_quantiles(n: int) -> np.ndarray:
    return np.array([NormalDist().inv_cdf((j + 0.5) / n) for j in range(n)])


@functools.cache
def _offset_scale(n_expert: int, k: int, gating: str) -> float:
    """The popularity scale at which the top quarter of the experts takes TOP_QUARTER_SHARE of the routed slots,
    on idealised router logits (independent standard normals; sigmoid gating adds the offsets to probabilities)."""
    logits = np.random.default_rng(_STRUCTURE_STREAM).standard_normal((2048, n_expert))
    scores = 1 / (1 + np.exp(-logits)) if gating == "sigmoid" else logits    # softmax ranks as its logits do
    profile = _normal_quantiles(n_expert)
    target = min(TOP_QUARTER_SHARE, 0.9 * min(1.0, _top_quarter(n_expert) / k))    # what the top quarter can take

    def share(scale: float) -> float:
        return top_quarter_share(np.argpartition(-(scores + scale * profile), k - 1, axis=1)[:, :k], n_expert)

    low, high = 0.0, 1.0
    while share(high) < target:
        low, high = high, 2 * high
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if share(middle) < target else (low, middle)
    return (low + high) / 2


CARD = "qwen3-30b-a3b-q8_0"     # the realistic shape benchmarks and calibration build


def reduced_card(layers: int, folder: Path, card_name: str = CARD, types: str | None = None,
                 metadata: dict | None = None) -> Path:
    """The bundled card with `layers` trunk blocks (and its NextN blocks), every matrix in `types` if given,
    `metadata` changed."""
    card = yaml.safe_load((MODELS_DIR / f"{card_name}.yaml").read_text())
    card["name"] = f"{card_name}-{layers}-blocks" + (f"-{types}" if types else "")
    card["metadata"].update(metadata or {})
    card["metadata"]["block_count"] = layers + card["metadata"].get("nextn_predict_layers", 0)
    if types:
        card["types"], card["overrides"] = {"default": types}, []
    path = folder / f"{card['name']}.yaml"
    path.write_text(yaml.safe_dump(card))
    return path
