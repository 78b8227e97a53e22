"""Byte-exact VRAM regions of one GPU, in the order the runtime carves them from its one device arena.

Every region starts on a 256-byte boundary and every tensor inside `dense` / `drafter_dense` does too, so a
region's bytes are exactly what the runtime will place there: the plan is the truth (DESIGN.md invariant 1).
"""

from dataclasses import dataclass

import numpy as np

from codegen.memory import ARENA_ALIGNMENT_BYTES
from planner.architecture import tensor_layer

# expert_cache, prefill_ring and drafter_experts lie back to back: one array of expert slots (model.SlotLayout);
# kv_ring right after them, so the pages a request cannot reach are expert slots too (planner.kv_lending)
REGION_ORDER = ("dense", "drafter_dense", "expert_cache", "prefill_ring", "drafter_experts", "kv_ring", "drafter_kv",
                "arena", "tables")
REGION_PURPOSE = {
    "dense": "attention, norms, router, shared expert, embeddings, output head: read every token",
    "drafter_dense": "the NextN (MTP) block's dense tensors",
    "drafter_experts": "the drafter's routed experts, a slot each (decode only); lent to the prefill ring as the room",
    "kv_ring": "K/V of the last resident positions, page p in slot p mod pages, over a host copy; the pages a "
               "request cannot reach are lent to the expert cache",
    "drafter_kv": "the drafter's K/V ring, sized from its window",
    "expert_cache": "decode's slots for the hottest routed experts; misses read mapped host memory",
    "prefill_ring": "slots through which a prompt chunk streams the experts it needs",
    "arena": "activations of the largest pass (static offsets from codegen.memory)",
    "tables": "the K/V page table and each MoE block's expert-slot tables (decode and prefill)",
}


def aligned(n_bytes):
    """Rounded up to the region alignment (works on numpy arrays of sizes too)."""
    return -(-n_bytes // ARENA_ALIGNMENT_BYTES) * ARENA_ALIGNMENT_BYTES


@dataclass(frozen=True)
class Region:
    name: str
    device: int
    offset: int
    bytes: int

    @property
    def end(self) -> int:
        return self.offset + self.bytes


def tensors_bytes(model, names) -> int:
    """Bytes of a set of tensors placed one after another, each on an aligned offset."""
    return sum(aligned(model.tensor_bytes[name]) for name in names)


def dense_tensor_names(model, blocks, first: bool, last: bool) -> list[str]:
    """The dense tensors a device holds: its blocks', the embedding on the first, the head on the last."""
    blocks = set(blocks)
    names = []
    for t in model.tensors:
        if model.tensor_class[t.name] != "dense":
            continue
        layer = tensor_layer(t.name)
        if layer is None:
            if (t.name.startswith("token_embd") and first) or (not t.name.startswith("token_embd") and last):
                names.append(t.name)
        elif layer in blocks:
            names.append(t.name)
    return names


def drafter_tensor_names(model, cls: str) -> list[str]:
    return [t.name for t in model.tensors if model.tensor_class[t.name] == cls]


def table_sizes(full_pages: int, n_expert: int, moe_blocks, drafter: bool = False) -> dict:
    """The runtime's device tables on one GPU, name -> bytes, carved in this order on aligned offsets: the
    page table (logical K/V page -> ring slot, shared by every block), per MoE block the expert-slot tables
    decode and prefill read (expert -> VRAM slot, or -1 for the host copy), and with the drafter its own page
    table (its ring) and its expert table (every expert in place: expert e in slot e)."""
    sizes = {"page_table": 4 * full_pages}
    for block in moe_blocks:
        sizes[f"blk.{block}.decode_slots"] = 4 * n_expert
        sizes[f"blk.{block}.prefill_slots"] = 4 * n_expert
    if drafter:
        sizes["drafter_page_table"] = 4 * full_pages
        sizes["drafter_slots"] = 4 * n_expert
    return sizes


def fixed_region_sizes(model, blocks, first: bool, last: bool, mtp: bool, full_pages: int) -> dict:
    """The regions whose size no knob changes: a GPU's dense weights and tables, and the drafter's on the
    last GPU."""
    moe_blocks = [b for b in blocks if model.hparams.is_moe_layer(b)]
    tables = table_sizes(full_pages, model.hparams.n_expert, moe_blocks, drafter=mtp and last)
    sizes = {"dense": tensors_bytes(model, dense_tensor_names(model, blocks, first, last)),
             "tables": sum(aligned(size) for size in tables.values())}
    if mtp and last:
        sizes["drafter_dense"] = tensors_bytes(model, drafter_tensor_names(model, "drafter_dense"))
        drafter_experts = len(model.drafter_expert_layers) * model.hparams.n_expert
        sizes["drafter_experts"] = drafter_experts * model.slot_layout.slot_bytes      # a slot each
    return sizes


HOST_PAGE_BYTES = 4096


def host_page_table_bytes(gpu, pinned_bytes):
    """Device memory the driver takes beside the plan's arena to map `pinned_bytes` of pinned host memory into
    the GPU's address space (works on numpy arrays): the profile's entry bytes per 4 KiB host page. Run 25 on
    the H200 (benchmarks/results/mapped-probe-2026-12-03-run25.py), numba's mapped and plain pinned arrays
    alike: 1 GiB took 2 MiB, 4 GiB 8 MiB (in one allocation or 42), 16 GiB 32 MiB. The driver takes them in
    2 MiB pieces, the first with room already (256 MiB took none), so it takes up to a piece more or less."""
    pages = -(-np.asarray(pinned_bytes, dtype=np.int64) // HOST_PAGE_BYTES)
    return pages * gpu.host_page_table_entry_bytes


def kv_ring_bytes(pages: int, page_tokens: int, kv_bytes_per_token: int, n_blocks: int) -> int:
    return pages * page_tokens * kv_bytes_per_token * n_blocks


def carve(device: int, sizes: dict) -> list[Region]:
    """Regions in REGION_ORDER, back to back on aligned offsets; empty regions are left out."""
    regions, offset = [], 0
    for name in REGION_ORDER:
        size = sizes.get(name, 0)
        if size:
            regions.append(Region(name, device, offset, size))
            offset = aligned(offset + size)
    return regions
