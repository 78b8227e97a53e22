"""The K/V ring sized per request: the pages a request cannot reach, lent to decode's expert cache in place.

A request of N positions (prompt and new tokens) stores pages 0..ceil(N / page_tokens) - 1 only. When the
plan's ring has more pages than that, the rest of every layer's pages hold nothing this request reads, and
their bytes serve as more expert-cache slots until a request needs them again. Nothing is moved: the
`kv_ring` region lies right after the expert regions (`planner.layout.REGION_ORDER`), so a slot-aligned span
of it is expert slot `first + k` of the one slot array (`planner.model.SlotLayout`), and expert slots are
multiples of 256 bytes, so the region starts on the slot grid.

The region is carved layer by layer (`runtime.kv_ring`); a layer's K/V is 2 to 4 arrays (K quants, K scales
when quantized apart, V quants, V scales), each slot-major, so the unreached pages are one tail of each array.
A lent expert slot lies wholly inside one tail: the planner counts, and the runtime uses, exactly these.
"""

from dataclasses import dataclass

import numpy as np

from planner.kv import KVType
from planner.model import split_bytes


@dataclass(frozen=True)
class LentSlot:
    slot: int           # expert slot counted from the kv_ring region's start (slot_bytes apart)
    layer: int          # the trunk layer whose pages it is taken from (its position in the region)
    part: str           # which of that layer's arrays: "K", "K scales", "V", "V scales"


def page_parts(kv: KVType, page_tokens: int, n_head_kv: int, head_dim_k: int, head_dim_v: int) -> dict:
    """name -> bytes one page of one layer holds in each array, in the order the runtime carves them
    (`codegen.lower.kv_pages.kv_arrays`: quants, then their scales when the type keeps them apart)."""
    parts = {}
    for name, ggml_type, head_dim in (("K", kv.k_type, head_dim_k), ("V", kv.v_type, head_dim_v)):
        quants, scales = split_bytes(ggml_type, page_tokens * n_head_kv * head_dim)
        parts[name] = quants
        if scales:
            parts[f"{name} scales"] = scales
    return parts


def needed_pages(request_tokens, page_tokens: int):
    """Pages a request of `request_tokens` positions stores."""
    return -(-np.asarray(request_tokens) // page_tokens)


def part_offsets(parts: dict, n_layers: int, ring_pages) -> dict:
    """(layer, part) -> where that array starts, in bytes from the region's start (ring pages may be a numpy
    array): the runtime checks its carve against these."""
    page_bytes = sum(parts.values())
    offsets = {}
    for layer in range(n_layers):
        at = layer * ring_pages * page_bytes
        for name, part_bytes in parts.items():
            offsets[layer, name] = at
            at = at + ring_pages * part_bytes
    return offsets


def _lent_ranges(parts: dict, n_layers: int, ring_pages, request_tokens, page_tokens: int, slot_bytes: int):
    """(layer, part, first slot, end slot) of the expert slots wholly inside each array's unreached pages,
    slots counted from the region's start (numpy arrays of ring pages broadcast; end <= first: none)."""
    request_pages = np.minimum(needed_pages(request_tokens, page_tokens), ring_pages)
    for (layer, name), start in part_offsets(parts, n_layers, ring_pages).items():
        first_byte = start + request_pages * parts[name]
        end_byte = start + ring_pages * parts[name]
        yield layer, name, -(-first_byte // slot_bytes), end_byte // slot_bytes


def lent_slot_count(parts: dict, n_layers: int, ring_pages, request_tokens, page_tokens: int, slot_bytes: int):
    """Expert slots a request of `request_tokens` positions lends (numpy arrays of ring pages broadcast; 0
    where the request needs every page of the ring)."""
    total = np.zeros(np.shape(ring_pages), np.int64)
    for _layer, _name, first, end in _lent_ranges(parts, n_layers, np.asarray(ring_pages), request_tokens,
                                                  page_tokens, slot_bytes):
        total = total + np.maximum(0, end - first)
    return total


def lent_slots(parts: dict, n_layers: int, ring_pages: int, request_tokens: int, page_tokens: int,
               slot_bytes: int) -> list[LentSlot]:
    """Every expert slot a request of `request_tokens` positions lends, in ascending slot order."""
    return [LentSlot(slot, layer, name)
            for layer, name, first, end in _lent_ranges(parts, n_layers, ring_pages, request_tokens, page_tokens,
                                                        slot_bytes)
            for slot in range(int(first), int(end))]
