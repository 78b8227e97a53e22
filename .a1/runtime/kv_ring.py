"""The K/V ring: the context's latest pages in VRAM, every page also in a host copy when the ring is shorter.

Page p (positions p * page_tokens ..) lives in slot p mod n_slots of each layer's pages (the plan's `kv_pages`,
carved from the `kv_ring` region). When the plan keeps fewer pages than its context needs, a host copy of the
whole context is taken at start (mapped pinned memory, page p at index p): every K/V row a pass stores is
written through to it, and attention reads a page the ring no longer holds from it, in place (zero-copy, no
host sync, the same bits). The page table (the plan's `tables` region, shared by every layer) says where each
page is: its slot, or -1.

The ring remembers which page each slot holds. A page is in VRAM only while its slot still holds it: a
conversation reused after its decode steps wrote further finds its older pages in the host copy, not in slots
that later pages took.

A request that needs fewer pages than the ring has lends the other slots of every layer to the expert cache
(`planner.kv_lending`, `lend`): they hold no page while lent, and a pass that would store into one is refused.
"""

import numpy as np

from codegen.lower.cuda import copy_rows, cuda
from codegen.lower.kv_pages import kv_arrays, mapped_host_copy
from planner.errors import StratumError
from planner.kv_lending import page_parts, part_offsets


class KVRing:
    def __init__(self, arena, page_table, kv, hparams, n_slots: int, page_tokens: int, context_tokens: int,
                 progress, region: str = "kv_ring", layers=None, host_copy: bool = True):
        """page_table: the int32 device table of every page of the context; progress: `runtime.progress`;
        layers: the blocks whose pages the ring holds (default the trunk's), carved from `region`; host_copy
        False: pages the ring no longer holds are gone (the drafter, whose attention reads only the window
        its ring holds)."""
        self.page_table, self.n_slots, self.page_tokens = page_table, n_slots, page_tokens
        self.full_pages = -(-context_tokens // page_tokens)
        layers = list(range(hparams.n_trunk) if layers is None else layers)

        def layout(slots):
            return kv_arrays(kv.name, slots, page_tokens, hparams.n_head_kv, hparams.head_dim_k, hparams.head_dim_v)
        carver = arena.carver(region, alignment=4)
        self.parts = page_parts(kv, page_tokens, hparams.n_head_kv, hparams.head_dim_k, hparams.head_dim_v)
        offsets = part_offsets(self.parts, len(layers), n_slots)
        first_part = next(iter(self.parts))
        self.pages = {}
        for i, layer in enumerate(layers):
            if carver.used != offsets[i, first_part]:
                raise StratumError(f"layer {layer}'s K/V pages start at byte {carver.used} of {region}, not at the "
                                   f"{offsets[i, first_part]} planner.kv_lending counts")
            self.pages[layer] = layout(n_slots).carve(carver.array)
        self.host = {}          # layer -> the host copy of its pages (none when the ring holds the context)
        if host_copy and n_slots < self.full_pages:
            whole = layout(self.full_pages)
            progress.start("pinning the host copy of the K/V", len(layers) * whole.nbytes, "B")
            for layer in layers:
                self.host[layer] = mapped_host_copy(whole)
                progress.advance(whole.nbytes)
            progress.finish()
        self.holds = np.full(n_slots, -1, np.int64)           # slot -> the page it holds
        self.lent_from = n_slots        # slots lent_from.. are lent to the expert cache
        self.zero_rows = {}             # (row shape, dtype) -> a pinned row of zeros (`clear`)
        self.pages_index = np.arange(self.full_pages)
        self.staging = cuda.pinned_array(self.full_pages, np.int32)
        self.staging[:] = -1        # no page yet: a pass that claims none (the drafter's, early in a prompt) stores none
        copy_rows(self.page_table, 0, self.staging, 0, self.full_pages, cuda.default_stream())
        cuda.default_stream().synchronize()

    def claim(self, start: int, end: int, stream) -> None:
        """Before a pass that stores positions start..end - 1: their pages take their slots, and the table
        says where every page now is (written on `stream` from pinned staging; every pass ends in a host
        sync, so the staging is free again by the next claim)."""
        pages = range(start // self.page_tokens, (end - 1) // self.page_tokens + 1)
        if all(self.holds[page % self.n_slots] == page for page in pages):
            return          # the table follows from `holds` alone, and they have not changed (most decode steps)
        for page in pages:
            if page % self.n_slots >= self.lent_from:
                raise StratumError(f"page {page} would be stored in K/V slot {page % self.n_slots}, which this "
                                   f"request lent to the expert cache (it said it needs {self.lent_from} pages)")
            self.holds[page % self.n_slots] = page
        self._write_table(stream)

    def lend(self, request_pages: int, stream) -> None:
        """Lend slots request_pages.. of every layer to the expert cache for a request that stores only pages
        0..request_pages - 1 (none when it needs the whole ring): the pages they held are gone from VRAM (the
        host copy, when there is one, still has them)."""
        self.lent_from = min(request_pages, self.n_slots)
        if (self.holds[self.lent_from:] >= 0).any():
            self.holds[self.lent_from:] = -1
            self._write_table(stream)

    def clear(self, slots, stream) -> None:
        """Zero these slots of every layer's pages (copied in from pinned zero rows), so a pass that reads a page
        no pass has stored reads zeros, not another page's bytes."""
        for pages in self.pages.values():
            for array in pages.stored_arrays():
                key = (array.shape[1:], array.dtype)
                if key not in self.zero_rows:
                    self.zero_rows[key] = cuda.pinned_array((1, *array.shape[1:]), array.dtype)
                    self.zero_rows[key][:] = 0
                for slot in slots:
                    copy_rows(array, slot, self.zero_rows[key], 0, 1, stream)

    def _write_table(self, stream) -> None:
        slots = self.pages_index % self.n_slots
        self.staging[:] = np.where(self.holds[slots] == self.pages_index, slots, -1)
        copy_rows(self.page_table, 0, self.staging, 0, self.full_pages, stream)

