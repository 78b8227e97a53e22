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


def _starts(parts: dict, n_layers: int, ring_pages) -> np.ndarray:
    """Where each array starts, in bytes from the region's start: shape (layers, parts, *ring_pages' shape)."""
    ring = np.asarray(ring_pages)
    grid = (slice(None), slice(None)) + (None,) * ring.ndim
    part_bytes = np.array(list(parts.values()), np.int64)
    layers = np.arange(n_layers, dtype=np.int64)[:, None]
    before = (np.cumsum(part_bytes) - part_bytes)[None, :]          # a page's bytes of the arrays before it
    return (layers * part_bytes.sum())[grid] * ring + before[grid] * ring


def part_offsets(parts: dict, n_layers: int, ring_pages: int) -> dict:
    """(layer, part) -> where that array starts, in bytes from the region's start: the runtime checks its
    carve against these."""
    starts = _starts(parts, n_layers, ring_pages)
    return {(layer, name): int(starts[layer, i]) for layer in range(n_layers) for i, name in enumerate(parts)}


def _lent_ranges(parts: dict, n_layers: int, ring_pages, request_tokens, page_tokens: int, slot_bytes: int):
    """(first slot, end slot) of the expert slots wholly inside each array's unreached pages, slots counted
    from the region's start, shaped (layers, parts, *broadcast shape of ring pages and request tokens); end <=
    first: none. One numpy expression for every layer, so the search prices its whole grid at once."""
    ring = np.asarray(ring_pages)
    request_pages = np.minimum(needed_pages(request_tokens, page_tokens), ring)
    grid = (slice(None), slice(None)) + (None,) * np.ndim(request_pages)
    part_bytes = np.array(list(parts.values()), np.int64)[None, :][grid]
    starts = _starts(parts, n_layers, ring)
    first_byte = starts + request_pages * part_bytes
    end_byte = starts + ring * part_bytes
    return -(-first_byte // slot_bytes), end_byte // slot_bytes


def lent_slot_count(parts: dict, n_layers: int, ring_pages, request_tokens, page_tokens: int, slot_bytes: int):
    """Expert slots a request of `request_tokens` positions lends (numpy arrays of ring pages broadcast; 0
    where the request needs every page of the ring)."""
    first, end = _lent_ranges(parts, n_layers, ring_pages, request_tokens, page_tokens, slot_bytes)
    return np.maximum(0, end - first).sum(axis=(0, 1))


def lent_slots(parts: dict, n_layers: int, ring_pages: int, request_tokens: int, page_tokens: int,
               slot_bytes: int) -> list[LentSlot]:
    """Every expert slot a request of `request_tokens` positions lends, in ascending slot order."""
    first, end = _lent_ranges(parts, n_layers, ring_pages, request_tokens, page_tokens, slot_bytes)
    return [LentSlot(slot, layer, name)
            for layer in range(n_layers) for i, name in enumerate(parts)
            for slot in range(int(first[layer, i]), int(end[layer, i]))]
