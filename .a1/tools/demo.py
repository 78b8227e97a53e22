"""The demo model (issue 5, part 5): a small glm4moe with a NextN drafter and a byte-level vocabulary, trained on
the Python standard library's source by tools/train_demo.py, so that drafting has a real acceptance rate and
routing a real skew. What the trainer and the tests share, without torch: the shape, the tensor types, the
corpus and its held-out files, the export to GGUF and the measures.
"""

import sysconfig
import zlib
from pathlib import Path

import numpy as np

from planner import vocab
from runtime import reference
from runtime.synthetic import shape_hparams, write_weights

ARCHITECTURE = "glm4moe"
NEXTN = 1
# 23.4M parameters, 25.1 MB at Q8_0: 5 trunk blocks (the first dense) and the NextN block; 32 routed experts of
# width 64 (4 used) and one shared expert per MoE block; heads of 64 (as the engine's GPU tests), a quarter of
# the heads' K/V heads (GQA 4), half of each head rotated (as GLM-4.5)
SHAPE = dict(n_trunk=5, n_leading_dense=1, n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_rot=32, n_ff=1536,
             n_ff_exp=64, n_expert=32, n_expert_used=4, n_expert_shared=1, n_vocab=vocab.BYTE_VOCAB_SIZE,
             rms_eps=1e-5, rope_base=10000.0, expert_weights_scale=2.5, expert_weights_norm=True)
TINY_SHAPE = dict(n_vocab=vocab.BYTE_VOCAB_SIZE)      # runtime.synthetic's tiny glm4moe, with the byte vocabulary
TYPES = {"experts": "q8_0", "dense": "q8_0"}          # norms, biases and routers stay F32 (runtime.synthetic)
DEMO_PATH = Path(__file__).resolve().parents[1] / "plans" / "demo" / "stratum-demo.gguf"
HELD_OUT_EVERY = 50         # a library file is held out when the crc32 of its path is a multiple of this


def hparams(shape: dict):
    return shape_hparams(ARCHITECTURE, NEXTN, **shape)


def export(path, tensors: dict, shape: dict, context_tokens: int, description: str, types: dict = TYPES) -> Path:
    """Write trained `tensors` (name -> float values, numpy order) as the demo's GGUF, its vocabulary marked
    byte-level; context_tokens: the length it was trained on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    strings = {vocab.TOKENIZER_MODEL_KEY: vocab.BYTE_TOKENIZER, "general.description": description}
    return write_weights(path, ARCHITECTURE, tensors, name="stratum demo", types=types, nextn=NEXTN,
                         strings=strings, n_ctx_train=context_tokens, **shape)


def library_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the standard library's *.py files, sorted, installed packages left out.
    A file is held out by its path's crc32, so the files both sets hold are held out wherever they exist."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(path.relative_to(root).parts))
    held_out = {path for path in files if zlib.crc32(path.relative_to(root).as_posix().encode()) % HELD_OUT_EVERY == 0}
    return [path for path in files if path not in held_out], sorted(held_out)


def read_files(files) -> bytes:
    return b"".join(path.read_bytes() for path in files)


def held_out_text(n_bytes: int) -> bytes:
    """n_bytes of held-out source: from the first line after the middle of the first held-out file at least four
    times that long (the tests' sample)."""
    for path in library_files()[1]:
        data = path.read_bytes()
        if len(data) >= 4 * n_bytes:
            start = data.index(b"\n", len(data) // 2) + 1
            return data[start:start + n_bytes]
    raise FileNotFoundError(f"no held-out standard library file of {4 * n_bytes} bytes")


def bits_per_byte(logits, targets) -> float:
    """Mean cross-entropy in bits of logits (rows, 256) for the target byte of each row."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(z)), np.asarray(targets)].mean() / np.log(2))


def top1_accuracy(logits, targets) -> float:
    return float(np.mean(np.argmax(logits, axis=1) == np.asarray(targets)))


def measures(logits, drafts, token_ids) -> dict:
    """The demo's measures on one text: logits (n, 256) of the trunk at positions 0..n-1, drafts (n - 1, 256) of
    the NextN block (row i drafts the byte at i + 2). `draft_agreement` is a depth-1 draft's greedy acceptance:
    how often the draft is the trunk's own greedy choice one position on."""
    ids = np.asarray(token_ids)
    return {"bits_per_byte": bits_per_byte(logits[:-1], ids[1:]),
            "nextn_top1": top1_accuracy(drafts[:-1], ids[2:]),
            "draft_agreement": top1_accuracy(drafts[:-1], np.argmax(logits[1:-1], axis=1))}


def reference_measures(path, text: bytes) -> dict:
    """`measures` of a GGUF on `text` as runtime.reference computes them (float64, from the file's weights)."""
    model = reference.load(path)
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    return measures(reference.forward(model, ids), reference.nextn_forward(model, ids), ids)
