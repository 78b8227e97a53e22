"""The byte-level vocabulary: 256 token ids, each one byte value, so a text's tokens are its UTF-8 bytes.

A GGUF says it has this vocabulary with `tokenizer.ggml.model` = "stratum-bytes", a value of this project's
(llama.cpp's tokenizers come with token lists; this one needs none). Only for such a model does `stratum run`
take a text prompt and print text.
"""

import codecs

TOKENIZER_MODEL_KEY = "tokenizer.ggml.model"
BYTE_TOKENIZER = "stratum-bytes"
BYTE_VOCAB_SIZE = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def text_decoder():
    """An incremental decoder of token ids' bytes: a character whose bytes arrive as several tokens comes out
    once it is whole; bytes that are not UTF-8 come out as U+FFFD."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def decode(token_ids) -> str:
    return text_decoder().decode(bytes(token_ids), final=True)
