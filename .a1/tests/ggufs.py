"""Write GGUF files for tests: a model card's header (tensor infos only, no data) as llama.cpp would write it."""

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from planner.card import card_header


def write_header_only(card_path, out_path, extra_metadata: dict | None = None):
    """The GGUF a partial download of the card's model would be: metadata and tensor infos, then nothing."""
    header = card_header(card_path)
    arch = header.metadata["general.architecture"]
    writer = GGUFWriter(str(out_path), arch)
    for key, value in {**header.metadata, **(extra_metadata or {})}.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    for t in header.tensors:
        block_size, type_size = GGML_QUANT_SIZES[t.ggml_type]
        byte_shape = tuple(reversed(t.shape[1:])) + (t.shape[0] // block_size * type_size,)
        writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.n_bytes, raw_dtype=t.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return header
