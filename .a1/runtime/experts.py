"""Routed experts on the device: decode's expert cache, the prefill ring, the drafter's block (the room), and
the host copy.

VRAM slots: the plan's `expert_cache`, `prefill_ring` and `drafter_experts` regions lie back to back, one array
of slots, blob-major (`planner.model.SlotLayout`: slot s starts s * slot_bytes after slot 0, each matrix's
quants and scales at fixed offsets in it): cache slots first (split evenly over the MoE blocks), ring slots
after, then the drafter's experts, expert e in slot `room_first + e`. A block's expert-slot table (in the plan's
`tables` region) maps an expert to its slot, or to -1: the kernel then reads the host copy, mapped pinned
memory, in place (zero-copy, no host sync).

The room: while a long prompt is read, the drafter's slots serve as more ring slots, in place (read only by
the drafter's decode steps, never by a prompt pass). Opening and closing it changes only the ring's slot count:
nothing is freed, moved or laid out again, so lowered passes and captured graphs stay valid. Closing copies the
drafter's experts back from their pinned host copy (taken at start) before decode, when the ring wrote them.

Prefill: per block, the experts the chunk routes to that are not cached stream through the ring in batches of
half the ring, in ascending expert id, so a batch's copies (on the copy stream) overlap the previous batch's
compute. A batch computes every expert in an id range [lo, hi), and the kernels add a token's expert terms in
ascending id: logits never depend on the ring's size or the cache's (DESIGN.md invariant 2).

Decode: the cache starts with each block's lowest ids and is refreshed every `REFRESH_STEPS` steps to the
experts routed most often so far (the plan's `frequency` policy), off the critical path: a swapped expert is
read from the host copy until its copy (on the copy stream) is done, so a step never reads a slot while it is
rewritten, and never waits for one.

Lent slots: the plan's `kv_ring` region follows the expert regions, so the slot array runs on over it, and the
K/V pages a request cannot reach (`planner.kv_lending`) are cache slots for that request (`lend`): each joins
the block with the fewest slots, empty, and `refresh` fills it with that block's most routed uncached expert.
A slot the next request needs for its K/V again gives its expert up first (the expert is read from the host
copy from then on).
"""

import time
from dataclasses import dataclass

import numpy as np

from codegen.lower.cuda import (copy_into_rows, copy_rows, cuda, event_done, mapped_device_view, mapped_filled,
                                mapped_host_view)
from codegen.lower.moe import range_tiles
from codegen.lower.weights import DeviceWeight, packed_layout, placeholder_scales
from planner.architecture import tensor_layer
from planner.errors import StratumError

MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
REFRESH_STEPS = 16
PRIOR_ROUTINGS = 1024   # a traced histogram counts as this many of a block's decode routings (~128 tokens at k 8)


def expert_layout(model) -> tuple[dict, dict]:
    """(matrix -> (n_expert, rows, cols), block -> {matrix: ggml type}) of a model's routed experts, the NextN
    block's too (the planner sizes slots for them all: one slot array holds them). Types may differ between
    blocks (a Q4_K_M file's Q6_K down projections in some): a slot's parts are sized for the largest
    (planner.model.SlotLayout), and each block's kernels read its own type."""
    shapes, types = {}, {}
    for t in model.tensors:
        if model.tensor_class[t.name] not in ("expert", "drafter_expert"):
            continue
        matrix, shape = t.name.split(".")[2], tuple(reversed(t.shape))
        if shapes.setdefault(matrix, shape) != shape:
            raise StratumError(f"{t.name} has shape {shape} but block experts before it {shapes[matrix]}: the "
                               "runtime needs every block's routed experts of one shape")
        types.setdefault(tensor_layer(t.name), {})[matrix] = t.ggml_type
    for block, matrices in types.items():
        if set(matrices) != set(MATRICES):
            raise StratumError(f"block {block}'s routed experts are {sorted(matrices)}; the runtime reads "
                               f"{list(MATRICES)}")
    return shapes, types


@dataclass
class ExpertStats:
    decode_reads: int = 0           # (block, expert) reads by decode steps
    decode_hits: int = 0            # ... of them from a VRAM slot
    streamed_bytes: int = 0         # copied host -> ring by prefill
    refreshed_experts: int = 0      # loaded into the cache by refreshes
    room_requests: int = 0          # requests that read their prompt with the room open
    room_reclaims: int = 0          # of them, those whose ring wrote into the drafter's slots (copied back)
    room_lend_s: float = 0.0        # their time giving the room back (the drafter's experts copied in again)
    lent_slots: int = 0             # cache slots the K/V ring lends the current request

    @property
    def hit_rate(self) -> float:
        return self.decode_hits / self.decode_reads if self.decode_reads else 1.0


class ExpertStore:
    def __init__(self, arena, tables: dict, moe_blocks: list, shapes: dict, types: dict, layout, cache_slots: int,
                 ring_slots: int, refresh_steps: int = REFRESH_STEPS, popularity=None):
        """shapes: matrix -> (n_expert, rows, cols), the same in every block and the drafter's; types: block
        (the drafter's too) -> {matrix: ggml type}, which may differ between blocks (both checked by the
        caller); layout: the model's `SlotLayout`; tables: name -> int32 device table
        (`planner.layout.table_sizes`); popularity: [block, expert] routing counts of a trace (the plan's
        workload histogram) or None: the cache starts with each block's most routed experts and the frequency
        policy counts the trace as PRIOR_ROUTINGS routings; without one, it starts with the lowest ids."""
        self.refresh_steps = refresh_steps
        self.blocks = list(moe_blocks)
        self.n_expert = shapes[MATRICES[0]][0]
        per_block, extra = divmod(cache_slots, max(1, len(self.blocks)))
        counts = [min(self.n_expert, per_block + (i < extra)) for i in range(len(self.blocks))]
        self.n_cache = sum(counts)
        self.n_ring = ring_slots
        self.room_first = self.n_cache + self.n_ring          # the drafter's expert e is slot room_first + e
        self.n_room = self.n_expert if arena.has("drafter_experts") else 0
        self.room_open = False
        self.room_written = False       # whether the ring wrote into the drafter's slots since they were loaded
        self.layout = layout
        regions = [name for name in ("expert_cache", "prefill_ring", "drafter_experts") if arena.has(name)]
        self.kv_first = self.room_first + self.n_room     # the kv_ring region's first byte is this slot's
        kv_region = arena.regions.get("kv_ring")
        lendable = 0
        if kv_region is not None and kv_region.offset == arena.regions[regions[0]].offset + self.kv_first * layout.slot_bytes:
            regions.append("kv_ring")
            lendable = kv_region.bytes // layout.slot_bytes
        self.blobs = arena.carver(*regions).array((self.kv_first + lendable, layout.slot_bytes), np.uint8)
        self.lent = {}          # lent slot -> the block it serves
        self.free = {block: [] for block in moe_blocks}         # lent slots no expert has been copied into yet
        self.types = types
        # (matrix, type) -> the slot array read as that type: each block's kernels read their own
        self.slots = {(m, t): self._slot_weight(m, t, shapes[m]) for block in types.values() for m, t in block.items()}
        self.drafter_host = {}          # matrix -> (data, scales or None): pinned, what closing the room copies
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        prior = np.zeros((len(self.blocks), self.n_expert))
        if popularity is not None:
            popularity = np.broadcast_to(np.asarray(popularity, np.float64), prior.shape)
            prior = popularity * (PRIOR_ROUTINGS / np.maximum(popularity.sum(axis=1, keepdims=True), 1e-300))
        # block -> {expert: slot}: the most routed first (ties, and no trace: the lowest ids)
        ranking = np.argsort(-prior, axis=1, kind="stable")
        self.resident = {b: {int(e): int(starts[i]) + j for j, e in enumerate(ranking[i, :counts[i]])}
                         for i, b in enumerate(self.blocks)}
        self.needs_host = any(c < self.n_expert for c in counts)
        self.host = {}
        # the host copy: (block, matrix) -> its mapped arrays (data, scales or None), the sources of copies
        # into slots (pinned host memory: DMA at the link's rate); kernels read device views of them (self.host)
        self.host_arrays = {}
        self.decode_tables = {b: tables[f"blk.{b}.decode_slots"] for b in self.blocks}
        self.prefill_tables = {b: tables[f"blk.{b}.prefill_slots"] for b in self.blocks}
        self.counts = prior.copy()      # decode's routings so far, after the trace's prior
        self.routed = np.zeros((len(self.blocks), self.n_expert), np.int64)    # every pass's, for traces
        # what a decode step reads from a slot: `resident`, less the experts a pending refresh copies in
        self.cached = np.zeros((len(self.blocks), self.n_expert), bool)
        for i, block in enumerate(self.blocks):
            self.cached[i, list(self.resident[block])] = True
        self.stats = ExpertStats()
        self.copy_stream = cuda.stream()
        # per ring half: copies into it done (compute waits), compute done with it (the next copies wait);
        # recorded again at each batch (a wait takes the record made before it)
        self.ring_copied = [cuda.event(), cuda.event()]
        self.ring_free = [cuda.event(), cuda.event()]
        self.ring_used = [False, False]
        self.steps_since_refresh = 0
        self.pending = None         # event: a refresh's copies are done
        self.incoming = []          # (block index, block, experts) a pending refresh is copying in
        self.table_staging = cuda.pinned_array((len(self.blocks), self.n_expert), np.int32)
        self.prefill_staging = cuda.pinned_array((len(self.blocks), self.n_expert), np.int32)

    # ---------------------------------------------------------------------------------------------------
    # start

    def _slot_weight(self, matrix: str, ggml_type, shape) -> DeviceWeight:
        """What the kernels read of one matrix in every slot: flat views of the blobs from slot 0's part on
        (`DeviceWeight.slot_bytes`)."""
        (data_shape, dtype), scales_shape = packed_layout(ggml_type, shape)
        flat = self.blobs.reshape(-1)
        n_slots, slot_bytes = self.blobs.shape

        def part(kind, dtype, part_shape):
            offset = self.layout.part(matrix, kind)[0]
            n_bytes = int(np.prod(part_shape[1:])) * np.dtype(dtype).itemsize      # one expert's
            return flat[offset:offset + (n_slots - 1) * slot_bytes + n_bytes].view(dtype)
        data = part("data", dtype, data_shape)
        scales = part("scales", np.float16, scales_shape) if scales_shape else placeholder_scales(data)
        return DeviceWeight(ggml_type, (n_slots, *shape[1:]), data, scales, slot_bytes)

    def _write_slots(self, matrix: str, slot: int, data, scales, first: int, count: int, stream) -> None:
        """Experts first..first + count - 1 of one matrix (host arrays, an expert a row) into slots slot.."""
        for kind, source in (("data", data), ("scales", scales)):
            if source is not None:
                copy_into_rows(self.blobs, slot, self.layout.part(matrix, kind)[0], source, first, count, stream)

    def load(self, block: int, matrix: str, packed) -> None:
        """A block's experts of one matrix from the GGUF: the cached ones into their slots, all of them into
        the host copy (mapped pinned memory, taken now, not on the first request) when any can miss."""
        for expert, slot in self.resident[block].items():
            self._write_slots(matrix, slot, packed.data, packed.scales, expert, 1, cuda.default_stream())
        if self.needs_host:
            (data_shape, dtype), scales_shape = packed_layout(packed.ggml_type, packed.shape)
            data = mapped_filled(data_shape, dtype, packed.data)
            scales = mapped_filled(scales_shape, np.float16, packed.scales) if scales_shape else None
            host_scales = None if scales is None else mapped_host_view(scales)
            self.host_arrays[block, matrix] = mapped_host_view(data), host_scales
            data_view = mapped_device_view(data)
            scales_view = mapped_device_view(scales) if scales_shape else placeholder_scales(data_view)
            self.host.setdefault(block, {})[matrix] = DeviceWeight(packed.ggml_type, packed.shape, data_view,
                                                                   scales_view)

    def load_drafter(self, matrix: str, packed, lendable: bool) -> None:
        """The drafter's experts of one matrix into their slots, and (lendable: the room may open) into
        pinned host memory, taken now, which closing the room copies them back from."""
        stream = cuda.default_stream()
        if lendable:
            self.drafter_host[matrix] = tuple(None if array is None else
                                              mapped_host_view(mapped_filled(array.shape, array.dtype, array))
                                              for array in (packed.data, packed.scales))
        self._write_slots(matrix, self.room_first, packed.data, packed.scales, 0, self.n_expert, stream)
        stream.synchronize()

    def write_decode_tables(self, stream=0) -> None:
        for block in self.blocks:
            self.decode_tables[block].copy_to_device(self.decode_table(block), stream=stream)

    def decode_table(self, block: int) -> np.ndarray:
        table = np.full(self.n_expert, -1, np.int32)
        for expert, slot in self.resident[block].items():
            table[expert] = slot
        return table

    def slot_weights(self, block: int) -> tuple:
        """(gate, up, down) the kernels of a block (or the drafter's) read from the slots, in its types."""
        return tuple(self.slots[m, self.types[block][m]] for m in MATRICES)

    def host_weights(self, block: int) -> tuple:
        """(gate, up, down) the kernels read for slot -1: the host copy, or the slots when nothing misses."""
        if block in self.host:
            return tuple(self.host[block][m] for m in MATRICES)
        return self.slot_weights(block)

    # ---------------------------------------------------------------------------------------------------
    # the room

    def open_room(self) -> None:
        """Lend the drafter's slots to the prefill ring (before the ring is used for a request)."""
        if not self.n_room:
            raise StratumError("this engine has no drafter room (no drafter_experts region in the plan)")
        self.room_open = True

    def close_room(self, compute) -> float:
        """Give the room back: the drafter's experts copied in again from their host copy when the ring wrote
        over them, on the copy stream after compute is done with the ring; waits for the copies (decode's
        drafter reads those slots). Returns the seconds it took (0 when nothing was written)."""
        self.room_open = False
        if not self.room_written:
            return 0.0
        started = time.perf_counter()
        done_with_ring = cuda.event()
        done_with_ring.record(compute)
        done_with_ring.wait(self.copy_stream)
        for matrix, (data, scales) in self.drafter_host.items():
            self._write_slots(matrix, self.room_first, data, scales, 0, self.n_expert, self.copy_stream)
        self.copy_stream.synchronize()
        self.room_written = False
        self.stats.room_reclaims += 1
        return time.perf_counter() - started

    # ---------------------------------------------------------------------------------------------------
    # prefill

    @property
    def ring_slots(self) -> int:
        """The prefill ring's slots now: the plan's, and the drafter's while the room is open."""
        return self.n_ring + (self.n_room if self.room_open else 0)

    def prefill_batches(self, block: int, needed) -> tuple:
        """(expert-slot table, [(lo, hi, ring base slot, streamed experts)]) for the experts a chunk needs."""
        resident = self.resident[block]
        streamed = [int(e) for e in needed if int(e) not in resident]
        if streamed and self.ring_slots == 0:
            raise StratumError("the plan has no prefill-ring slots but not every expert is cached")
        half = max(1, self.ring_slots // 2)
        groups = [streamed[i:i + half] for i in range(0, len(streamed), half)] or [[]]
        table = self.decode_table(block)
        batches = []
        for j, group in enumerate(groups):
            base = self.n_cache + (j % 2) * half
            for i, expert in enumerate(group):
                table[expert] = base + i
            lo = 0 if j == 0 else group[0]
            hi = groups[j + 1][0] if j + 1 < len(groups) else self.n_expert
            batches.append((lo, hi, base, group))
        return table, batches

    def all_cached(self, block: int) -> bool:
        return len(self.resident[block]) == self.n_expert

    def count_routed(self, block: int, ids: np.ndarray) -> None:
        """A prefill chunk's routed ids of one block into the counts traces are written from."""
        self.routed[self.blocks.index(block)] += np.bincount(ids.reshape(-1), minlength=self.n_expert)

    def run_cached_block(self, block: int, compute, run_batch) -> None:
        """A chunk's routed experts of a block whose every expert is cached: one batch over all of them, with
        no routing known (its grids cover any routing); the engine counts the routed ids once the chunk is done."""
        index = self.blocks.index(block)
        self.prefill_staging[index] = self.decode_table(block)     # the same bytes every chunk: a pending copy
        copy_rows(self.prefill_tables[block], 0, self.prefill_staging[index], 0, self.n_expert, compute)  # reads them
        run_batch(0, self.n_expert, None)

    def stream_block(self, block: int, ids: np.ndarray, compute, run_batch) -> None:
        """Compute a chunk's routed experts of one block: run_batch(lo, hi, tiles) for each batch (tiles: its
        `range_tiles` from the routing), its experts copied into the ring first (on the copy stream, waiting
        until compute is done with that half)."""
        # the experts the chunk needs, ascending: a bincount, not np.unique's sort (0.33 ms for 2048 x 8 ids,
        # while the GPU waits for this block's batches)
        routed = np.bincount(ids.reshape(-1), minlength=self.n_expert)
        table, batches = self.prefill_batches(block, np.flatnonzero(routed))
        tiles = range_tiles(ids, self.n_expert, [lo for lo, *_ in batches] + [self.n_expert])
        index = self.blocks.index(block)
        self.routed[index] += routed
        self.prefill_staging[index] = table         # pinned: an asynchronous copy (pageable memory would wait)
        copy_rows(self.prefill_tables[block], 0, self.prefill_staging[index], 0, self.n_expert, compute)
        for j, ((lo, hi, base, group), batch_tiles) in enumerate(zip(batches, tiles)):
            half = j % 2
            if group:
                if self.ring_used[half]:
                    self.ring_free[half].wait(self.copy_stream)
                for first, count in _runs(group):
                    slot = base + group.index(first)
                    self.room_written |= slot + count > self.room_first
                    for matrix in MATRICES:
                        self._copy_in(block, matrix, first, count, slot, self.copy_stream)
                self.ring_copied[half].record(self.copy_stream)
                self.ring_copied[half].wait(compute)
            run_batch(lo, hi, batch_tiles)
            self.ring_free[half].record(compute)
            self.ring_used[half] = True

    def _copy_in(self, block: int, matrix: str, first: int, count: int, slot: int, stream) -> None:
        """Experts first..first + count - 1 of a block's matrix from the host copy into slots slot.. (a
        host-to-device copy from pinned memory, asynchronous on `stream`)."""
        data, scales = self.host_arrays[block, matrix]
        self._write_slots(matrix, slot, data, scales, first, count, stream)
        self.stats.streamed_bytes += count * (data.strides[0] + (0 if scales is None else scales.strides[0]))

    # ---------------------------------------------------------------------------------------------------
    # decode

    def record_decode(self, ids: np.ndarray) -> None:
        """Count a decode step's routed experts, ids (blocks, rows, k) in `blocks` order: the frequency
        policy's input, and the hit rate."""
        flat = ids.reshape(len(self.blocks), -1)
        rows = np.arange(len(self.blocks))[:, None]
        np.add.at(self.counts, (rows, flat), 1)
        np.add.at(self.routed, (rows, flat), 1)
        self.stats.decode_reads += flat.size
        self.stats.decode_hits += int(self.cached[rows, flat].sum())

    def after_decode_step(self, compute) -> None:
        """Between steps: finish a refresh whose copies are done, or start one every `refresh_steps` steps."""
        self.steps_since_refresh += 1
        if self.pending is not None and event_done(self.pending):
            self._publish(compute)
        if self.needs_host and self.pending is None and self.steps_since_refresh >= self.refresh_steps:
            self.refresh(compute)
            self.steps_since_refresh = 0

    def settle(self, compute) -> None:
        """Wait for a refresh's copies and publish them (before prefill reads the cache as resident)."""
        if self.pending is not None:
            self.pending.synchronize()
            self._publish(compute)

    def refresh(self, compute) -> None:
        """Fill empty lent slots with the most routed uncached experts, and swap cached experts for more often
        routed ones (an incoming expert must have been routed more often than the one it replaces), off the
        critical path: the arriving experts' table entries point at the host copy at once (ordered on the
        compute stream), the copies run on the copy stream while decode goes on, and the entries point at the
        new slots once the copies are done (`after_decode_step`)."""
        for index, block in enumerate(self.blocks):
            resident, counts, free = self.resident[block], self.counts[index], self.free[block]
            # most routed first, ties to the lower id (a stable sort: 3 us where Python's sorted took 36 for
            # 128 experts on the development CPU; host time between two decode steps)
            order = np.argsort(-counts, kind="stable").tolist()
            wanted = order[:len(resident) + len(free)]
            incoming = [e for e in wanted if e not in resident]
            filled = incoming[:len(free)]
            for expert in filled:
                resident[expert] = free.pop(0)
            keep = set(wanted)
            outgoing = sorted((e for e in resident if e not in keep), key=lambda e: (counts[e], e))
            swaps = [(i, o) for i, o in zip(incoming[len(filled):], outgoing) if counts[i] > counts[o]]
            for expert, out in swaps:
                resident[expert] = resident.pop(out)
                self.cached[index, out] = False
            arriving = filled + [expert for expert, _out in swaps]
            if not arriving:
                continue
            table = self.decode_table(block)
            table[arriving] = -1       # not copied yet: read from the host copy
            self._write_table(index, table, compute)
            self.incoming.append((index, block, arriving))
        if not self.incoming:
            return
        tables_written = cuda.event()
        tables_written.record(compute)
        tables_written.wait(self.copy_stream)
        for _index, block, experts in self.incoming:
            for expert in experts:
                for matrix in MATRICES:
                    self._copy_in(block, matrix, expert, 1, self.resident[block][expert], self.copy_stream)
                self.stats.refreshed_experts += 1
        self.pending = cuda.event()
        self.pending.record(self.copy_stream)

    def lend(self, slots: list, compute) -> None:
        """The slots the K/V ring lends the next request (slot indices of this array). A lent slot it no longer
        lends gives its expert up (the block's table then points at the host copy, written on `compute` before
        the request's passes store K/V there); a newly lent one joins the block with the fewest slots (none
        beyond a block's every expert), empty until `refresh` fills it. No refresh may be pending (`settle`)."""
        keep = set(slots)
        changed = set()
        for slot in [s for s in self.lent if s not in keep]:
            block = self.lent.pop(slot)
            holder = [e for e, at in self.resident[block].items() if at == slot]
            if holder:
                del self.resident[block][holder[0]]
                self.cached[self.blocks.index(block), holder[0]] = False
                changed.add(block)
            else:
                self.free[block].remove(slot)
        for slot in sorted(keep - set(self.lent)):
            index = min(range(len(self.blocks)), key=lambda i: (self._block_slots(self.blocks[i]), i))
            block = self.blocks[index]
            if self._block_slots(block) >= self.n_expert:
                break           # every block can hold all its experts
            self.lent[slot] = block
            self.free[block].append(slot)
        for block in changed:
            index = self.blocks.index(block)
            self._write_table(index, self.decode_table(block), compute)
        self.stats.lent_slots = len(self.lent)

    def _block_slots(self, block: int) -> int:
        return len(self.resident[block]) + len(self.free[block])

    @property
    def lendable_slots(self) -> int:
        """Slots of the array that lie over the kv_ring region (what `lend` may be given)."""
        return self.blobs.shape[0] - self.kv_first

    def _publish(self, compute) -> None:
        for index, block, experts in self.incoming:
            self._write_table(index, self.decode_table(block), compute)
            self.cached[index, experts] = True
        self.incoming, self.pending = [], None

    def _write_table(self, index: int, table: np.ndarray, compute) -> None:
        """A block's decode table, from pinned staging (a pageable copy would wait for the stream)."""
        self.table_staging[index] = table
        copy_rows(self.decode_tables[self.blocks[index]], 0, self.table_staging[index], 0, self.n_expert, compute)


def _runs(experts: list) -> list:
    """(first, count) for each run of consecutive ids in an ascending list."""
    runs = []
    for e in experts:
        if runs and runs[-1][0] + runs[-1][1] == e:
            runs[-1][1] += 1
        else:
            runs.append([e, 1])
    return [tuple(r) for r in runs]
