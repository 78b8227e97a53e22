"""K/V cache types: one GGML type for K and one for V, named as users name them.

`q8_0` means both K and V in Q8_0; `k8v4` means K in Q8_0 and V in Q4_0 (`16` is F16). Byte sizes come
from `gguf.constants.GGML_QUANT_SIZES`, like every other size in the planner.
"""

import re
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from planner.errors import StratumError

KV_TYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16,
            "q8_0": GGMLQuantizationType.Q8_0, "q5_1": GGMLQuantizationType.Q5_1,
            "q5_0": GGMLQuantizationType.Q5_0, "q4_1": GGMLQuantizationType.Q4_1,
            "q4_0": GGMLQuantizationType.Q4_0}
_MIX_BITS = {"16": GGMLQuantizationType.F16, "8": GGMLQuantizationType.Q8_0, "4": GGMLQuantizationType.Q4_0}


@dataclass(frozen=True)
class KVType:
    name: str
    k_type: GGMLQuantizationType
    v_type: GGMLQuantizationType


def parse_kv_type(text: str) -> KVType:
    name = str(text).strip().lower()
    if name in KV_TYPES:
        return KVType(name, KV_TYPES[name], KV_TYPES[name])
    mix = re.fullmatch(r"k(16|8|4)v(16|8|4)", name)
    if mix:
        return KVType(name, _MIX_BITS[mix.group(1)], _MIX_BITS[mix.group(2)])
    raise StratumError(f"unknown K/V type {text!r}; expected one of {', '.join(KV_TYPES)} or a K/V mix "
                       "kXvY with X, Y in 16, 8, 4 (e.g. k8v4: K in q8_0, V in q4_0)", field="kv")


def row_bytes(n_elements: int, ggml_type: GGMLQuantizationType) -> int:
    """Bytes of one row of `n_elements` values; the row must hold whole quant blocks."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if n_elements % block_size:
        raise StratumError(f"a row of {n_elements} values cannot be stored as {ggml_type.name} "
                           f"(blocks of {block_size})")
    return n_elements // block_size * type_size
