"""The planner's cost model: tok/s of a layout, from the pass graphs' roofline plus streaming and caching.

`codegen.cost` prices every node of a pass from VRAM. This module adds what only the layout decides:
- expert cache: each MoE block keeps its hottest experts (frequency-based); decode reads a hit from VRAM and
  a miss from mapped pinned host memory (zero-copy), so a step needs no copy and no host sync;
- prefill ring: a chunk streams every expert its tokens touch and the cache lacks, over the host link.
  Per expert, copy time c and compute time g; a ring slot serves one expert per (latency + c + g), so D slots
  stream at max(c, (latency + c + g) / D) per expert. A block's experts are known only once its router has
  run (the host reads them back), so the copy engine idles through each streaming block's dense part
  (attention, projections); within the block, batches of D / 2 experts alternate between the ring's halves,
  the first batch's copy (and the host's issue of it) ahead of any expert kernel and the last batch's kernels
  after every copy. Each batch's expert kernels take their share of the block's tiles (a small batch's grids
  leave SMs idle), plus the profile's `prefill_ring_batch`: what a batch adds beyond its tiles (BENCHMARKS.md,
  the ring's timeline). A chunk takes max(compute, streaming, issuing): they run on separate engines and the
  host, which launches each kernel from Python (a node at the profile's `prefill_launch`; a batch's copies at
  `prefill_ring_copy` each and the rest of it at `prefill_ring_call`, or uncalibrated its two kernels at
  `kernel_launch`, its copies at `copy_call` and its four event calls at `event_call`), so a shallow ring's
  many small batches cost launches. A streaming block's wait for its routing and the host's work from it to
  the first batch (`prefill_ring_block`) hold the host, the GPU and the copy engine alike; each chunk adds
  the profile's `prefill_host`: what the host takes that the GPU's work does not hide (inputs staged, logits
  and routing read back, the pass's first launches);
- K/V ring: the last `resident` positions are in VRAM; attention over older ones streams them over the link;
- MTP: a round drafts n tokens and verifies 1 + n in one window, yielding 1 + a + a^2 + ... + a^n tokens;
- the host: a decode window or draft step is one graph replay, its copies in and out captured with it: one
  `kernel_launch` a pass (`WINDOW_HOST_CALLS`).

Every function takes numpy arrays for the layout variables (cache slots, ring slots, resident tokens), so the
solver prices thousands of candidate layouts in a few vector operations.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

from codegen.cost import decode_host_kv_tiles, expected_tile_rows_per_pair, pass_cost, weights_in_l2
from codegen.graph import build_pass, representative_layers
from planner.kv import KVType
from planner.profile import GPU
from planner.workload import Workload

MAX_DRAFT_DEPTH = 4
# Driver calls the engine (runtime.engine) makes from Python around each pass it replays, each priced at the
# profile's `kernel_launch` (a launch or a copy issued from Python): a decode window's and a draft step's
# input and output copies (the drafter's hidden states too) are part of their captured graphs, so each is one
# graph launch. tests/test_engine.py counts them.
WINDOW_HOST_CALLS = 1
DRAFT_STEP_HOST_CALLS = 1
CHUNK_SAMPLES = 8       # chunks priced per prompt; a longer prompt's chunks are sampled evenly and scaled


COPIES_PER_RUN = 6       # a run of consecutive streamed experts: data and scales of gate, up and down
BATCH_KERNELS = 2        # a prefill ring batch's expert kernels (gate/up, down)
BATCH_EVENT_CALLS = 4    # its halves' events: the copy stream waits for free and records copied, compute the reverse
# host calls a MoE block whose every expert is cached adds to its two kernels (runtime.engine._run_prefill):
# its routing's copy back and that copy's event, its expert table's copy in
CACHED_BLOCK_CALLS = 3


class ChunkStreaming(NamedTuple):
    """What a prefill chunk of some size costs in routed experts, whatever its context (`chunk_streaming`).
    Host issue: each call at the profile's cost of its kind (module doc); a chunk's (every node's kernel and
    every batch's calls) overlaps the GPU's work and binds only when it is the longest."""
    expert_compute_s: object    # their arithmetic, the ring batches' launches included
    touched_read_s: float       # their weights read from VRAM
    streamed_bytes: object
    streamed_count: object      # experts streamed
    copies: object              # host-to-device copies, each paying the profile's copy_latency
    stall_per_expert_s: object  # the ring's stall per streamed expert
    streaming_blocks: object    # blocks still streaming
    fill_s: object              # a streaming block's first batch's copy, ahead of any of its expert kernels
    drain_s: object             # its last batch's kernels, after every copy
    issue_s: object             # its routing's round trip and the host's issue of its first batch: nothing of
    #                             the block runs before them
    launch_s: object            # the host's issue of the whole chunk


def _uncached_sums(per_expert: np.ndarray) -> np.ndarray:
    """[block, s]: the sum of per_expert[b, e] over the experts a block holding its s hottest does not cache
    (experts sorted hottest first; s = 0..n_expert)."""
    suffix = np.cumsum(per_expert[:, ::-1], axis=1)[:, ::-1]                        # sum from e on
    return np.hstack([suffix, np.zeros((per_expert.shape[0], 1))])


class SlotTable:
    """Sum over a device's MoE blocks of a per-block function of its cache slots.

    A device's `slots` cache slots are spread evenly over its MoE blocks, the first `slots % n` blocks
    taking one more. values[b, s] is the function for block b holding its s hottest experts.
    """

    def __init__(self, values: np.ndarray):
        n_blocks, n_columns = values.shape
        self.n_blocks = n_blocks
        self.n_slots_max = n_blocks * (n_columns - 1)
        self.base_total = values.sum(axis=0)                       # every block at s slots
        step = np.diff(values, axis=1)                             # block b going from s to s + 1
        self.extra = np.vstack([np.zeros((1, n_columns - 1)), np.cumsum(step, axis=0)])

    def total(self, slots):
        if self.n_blocks == 0:              # a device that holds no MoE block
            return np.zeros(np.shape(slots))
        slots = np.minimum(np.asarray(slots), self.n_slots_max)
        base, extra_blocks = np.divmod(slots, self.n_blocks)
        full = base >= self.extra.shape[1]
        base_clipped = np.minimum(base, self.extra.shape[1] - 1)
        return np.where(full, self.base_total[-1], self.base_total[base_clipped] + self.extra[extra_blocks, base_clipped])


@dataclass
class DeviceShare:
    """The part of the model one GPU runs."""
    index: int
    gpu: GPU
    blocks: tuple           # trunk blocks
    first: bool             # runs the embedding
    last: bool              # runs the output head and the drafter


class DeviceCost:
    def __init__(self, model, share: DeviceShare, kv: KVType, workload: Workload, mtp: bool):
        self.model, self.share, self.kv, self.workload, self.mtp = model, share, kv, workload, mtp
        self.gpu = share.gpu
        hp = model.hparams
        self.moe_blocks = [b for b in share.blocks if hp.is_moe_layer(b)]
        blob_of = {layer.layer: layer.blob_bytes for layer in model.expert_layers}
        self.blobs = np.array([blob_of[b] for b in self.moe_blocks], dtype=np.float64)
        # an expert's bytes at Q8_0's decode rate (`GPU.decode_weight_rates`): what a cache hit's read costs
        self.read_blobs = self.blobs        # (the same array where no rate is measured: its tables are reused)
        if self.gpu.decode_weight_rates:
            read_blob_of = model.expert_read_blob_bytes(self.gpu.decode_weight_rates)
            self.read_blobs = np.array([read_blob_of[b] for b in self.moe_blocks], dtype=np.float64)
        self.mean_blob = float(self.blobs.mean()) if self.moe_blocks else 0.0
        all_pop = workload.popularity(hp.n_expert, hp.n_expert_used, len(model.expert_layers))
        index_of = {layer.layer: i for i, layer in enumerate(model.expert_layers)}
        self.popularity = all_pop[[index_of[b] for b in self.moe_blocks]] if self.moe_blocks else all_pop[:0]
        self.n_expert = hp.n_expert
        self._memo = {}     # graphs, their costs and expert tables, by pass kind and tokens

    # --- graphs and their roofline -------------------------------------------------------------------
    def graph(self, kind: str, tokens: int):
        key = (kind, tokens)
        if key not in self._memo:
            layers = representative_layers(self.model.hparams)
            self._memo[key] = build_pass(self.model, kind, tokens, self.kv, layers=layers,
                                           with_drafter=self.mtp and self.share.last)
        return self._memo[key]

    def cost(self, kind: str, tokens: int):
        key = ("cost", kind, tokens)
        if key not in self._memo:
            draft = kind == "draft"     # the NextN block alone, on the GPU that holds the head
            self._memo[key] = pass_cost(self.graph(kind, tokens), self.gpu, self.model,
                                        () if draft else self.share.blocks,
                                        (False, True) if draft else (self.share.first, self.share.last),
                                        in_l2=self.weights_in_l2)
        return self._memo[key]

    @cached_property
    def weights_in_l2(self) -> bool:
        return weights_in_l2(self.model, self.share.blocks, self.gpu)

    # --- expert tables ---------------------------------------------------------------------------------
    def _table(self, per_expert: np.ndarray, blobs: np.ndarray | None = None) -> SlotTable:
        """SlotTable of the sum over uncached experts of per_expert[b, e], times blobs[b] where given."""
        left = _uncached_sums(per_expert)
        return SlotTable(left if blobs is None else left * blobs[:, None])

    @cached_property
    def step_miss_bytes(self) -> SlotTable:
        return self._table(self.popularity, self.blobs)

    @cached_property
    def step_miss_read_bytes(self) -> SlotTable:
        """`step_miss_bytes` at Q8_0's decode rate (`read_blobs`)."""
        if self.read_blobs is self.blobs:
            return self.step_miss_bytes
        return self._table(self.popularity, self.read_blobs)

    @cached_property
    def step_expert_bytes(self) -> float:
        return float((self.popularity.sum(axis=1) * self.blobs).sum())

    @cached_property
    def step_expert_read_bytes(self) -> float:
        return float((self.popularity.sum(axis=1) * self.read_blobs).sum())

    def host_read_blocks(self, tokens: int) -> SlotTable:
        """SlotTable of the chance that a window of `tokens` rows routes a block to an expert it does not cache
        (then its expert launches read mapped host memory), each expert routed independently at its
        popularity: 1 - the product over uncached experts of (1 - p) ** tokens."""
        key = ("host read blocks", tokens)
        if key not in self._memo:
            with np.errstate(divide="ignore"):
                log_unused = tokens * np.log1p(-np.minimum(self.popularity, 1.0))
            self._memo[key] = SlotTable(1.0 - np.exp(_uncached_sums(log_unused)))
        return self._memo[key]

    def touched(self, tokens: int) -> np.ndarray:
        """[block, expert]: the chance that a batch of `tokens` positions uses each expert."""
        return 1.0 - (1.0 - np.minimum(self.popularity, 1.0)) ** tokens

    def tile_rows_per_pair(self, tokens: int) -> np.ndarray:
        """[block]: the rows a chunk of `tokens` positions makes its expert tiles compute per pair."""
        key = ("tile rows", tokens)
        if key not in self._memo:
            self._memo[key] = expected_tile_rows_per_pair(self.popularity, tokens)
        return self._memo[key]

    def expert_compute_s(self, kind: str, tokens: int) -> float:
        """The routed experts' arithmetic of a `kind` pass over `tokens` rows: one MoE block's (decode, draft),
        every MoE block's (prefill: each block's tiles at its popularity), from the graph of the next power of
        two (prefill) or of `tokens`."""
        key = ("expert compute", kind, tokens)
        if key not in self._memo:
            if kind == "prefill":
                cost = self.cost(kind, 1 << (tokens - 1).bit_length())
                self._memo[key] = float(np.sum(cost.expert_compute_s(self.tile_rows_per_pair(tokens), tokens)))
            else:
                self._memo[key] = float(self.cost(kind, tokens).expert_compute_s())
        return self._memo[key]

    def _mean_block_experts(self, tokens: int) -> tuple:
        """(tile rows a pair, the routed experts' arithmetic in one launch) of a MoE block at the blocks' mean
        tile rows: the block a ring's batches are priced on."""
        key = ("mean block experts", tokens)
        if key not in self._memo:
            cost = self.cost("prefill", 1 << (tokens - 1).bit_length())
            rows = float(np.mean(self.tile_rows_per_pair(tokens)))
            self._memo[key] = (rows, float(cost.expert_compute_s(rows, tokens)))
        return self._memo[key]

    def window_tables(self, tokens: int):
        key = ("window", tokens)
        if key not in self._memo:
            touched = self.touched(tokens)
            self._memo[key] = (self._table(touched, self.blobs), self._table(touched),
                               float((touched.sum(axis=1) * self.blobs).sum()), float(touched.sum()))
        return self._memo[key]

    def window_read_tables(self, tokens: int):
        """(SlotTable of the uncached experts' bytes, every touched expert's bytes) of a window of `tokens`
        rows at Q8_0's decode rate (`read_blobs`)."""
        if self.read_blobs is self.blobs:
            miss_table, _, touched_bytes, _ = self.window_tables(tokens)
            return miss_table, touched_bytes
        key = ("window read", tokens)
        if key not in self._memo:
            touched = self.touched(tokens)
            self._memo[key] = (self._table(touched, self.read_blobs),
                               float((touched.sum(axis=1) * self.read_blobs).sum()))
        return self._memo[key]

    # --- decode ----------------------------------------------------------------------------------------
    def window_s(self, tokens: int, depth, cache_slots, resident_tokens):
        """One decode window (a step, or the verify of 1 + n) at `depth`: every block's dense weights once, the
        resident K/V from VRAM, the rest read by attention from the host copy zero-copy (as prefill's), cache
        hits from VRAM and misses zero-copy. A block whose window misses also pays what its expert launches' latency
        adds when they read the host copy: the profile's `decode_host_experts` fit where calibrated,
        else the link's latency beyond device memory's at each round of their loads
        (`codegen.cost.decode_load_rounds`): the demo model's steps took 24-35 us more than their bytes once any
        expert missed (BENCHMARKS.md, run 31)."""
        g = self.gpu
        cost = self.cost("decode", tokens)
        resident = np.minimum(depth, resident_tokens)
        if tokens == 1:
            miss = self.step_miss_bytes.total(cache_slots)
            hit_read = self.step_expert_read_bytes - self.step_miss_read_bytes.total(cache_slots)
        else:
            miss = self.window_tables(tokens)[0].total(cache_slots)
            miss_read_table, total_read = self.window_read_tables(tokens)
            hit_read = total_read - miss_read_table.total(cache_slots)
        host = g.kernels.decode_host_experts
        link_latency_s = max(0.0, g.zero_copy_latency_s - g.read_latency_s)
        # hits: their bytes at the types' decode rates; misses: at the link's (it binds, not the kernel's decode)
        hits_s = hit_read / g.memory_bandwidth_bytes_per_s / cost.expert_efficiency
        if host is None:        # uncalibrated: the link's latency beyond device memory's at each round of loads
            experts_s = hits_s + miss / g.zero_copy_read_bytes_per_s / cost.expert_efficiency
            missing_block_s = cost.expert_load_rounds * link_latency_s
        else:                   # calibrated: what a launch that reads the host copy adds to one that reads slots
            experts_s = hits_s + miss / g.zero_copy_read_bytes_per_s / host.efficiency
            missing_block_s = cost.expert_launches * host.latency_s
        # host K/V: its bytes at the zero-copy rate, and the link's latency beyond device memory's at each round
        # of loads the busiest warp of each attention launch waits for, row after row (`decode_kv_rounds`): the
        # demo's step took 33 us more than its 288 host positions' bytes (BENCHMARKS.md, run 37)
        streamed_kv = ((depth - resident) * cost.kv_bytes_per_token / g.zero_copy_read_bytes_per_s
                       + tokens * cost.kv_tile_rounds * decode_host_kv_tiles(depth - resident) * link_latency_s)
        host_latency_s = (self.host_read_blocks(tokens).total(cache_slots) * missing_block_s
                          if missing_block_s > 0 else 0.0)     # (the solver's hot path)
        return (cost.dense_s(depth, resident) + streamed_kv + experts_s + host_latency_s
                + len(self.moe_blocks) * self.expert_compute_s("decode", tokens)
                + cost.n_nodes * g.graph_node_overhead_s + self._host_calls_s(WINDOW_HOST_CALLS))

    def _host_calls_s(self, calls: int) -> float:
        """The engine's Python calls around a pass, counted once: on the GPU that holds the head."""
        return calls * self.gpu.kernel_launch_s if self.share.last else 0.0

    def draft_s(self, depth, window_tokens: int):
        """One MTP draft step: the NextN block (its experts live in VRAM) and the shared output head."""
        if not (self.mtp and self.share.last):
            return 0.0
        cost = self.cost("draft", 1)
        span = np.minimum(depth, window_tokens)
        drafter = self.model.drafter_expert_layers[0]
        experts_s = (self.model.hparams.n_expert_used * drafter.blob_bytes / self.gpu.memory_bandwidth_bytes_per_s
                     / cost.expert_efficiency)
        return (cost.dense_s(span, span) + experts_s + self.expert_compute_s("draft", 1)
                + cost.n_nodes * self.gpu.graph_node_overhead_s + self._host_calls_s(DRAFT_STEP_HOST_CALLS))

    # --- prefill ---------------------------------------------------------------------------------------
    def chunk_s(self, tokens: int, context, ring_slots, resident_tokens, streaming):
        """One prefill chunk of `tokens` positions ending at `context`, its experts' streaming priced by
        `chunk_streaming` (the same for every chunk of that size). A short (last) chunk is priced from the
        graph of the next power of two: its tiled matmuls by their tiles at its rows, the rest scaled (linear in
        its positions)."""
        g = self.gpu
        graph_tokens = 1 << (tokens - 1).bit_length()
        cost = self.cost("prefill", graph_tokens)
        scale = tokens / graph_tokens
        start = context - tokens
        resident = np.minimum(start, resident_tokens) + tokens     # this chunk's own K/V is being written
        # attention reads older positions the K/V ring no longer holds from the host copy, zero-copy, once per
        # query slice of the chunk: time on the compute stream and on the link
        host_kv_s = ((start - np.minimum(start, resident_tokens)) * cost.kv_bytes_per_token
                     * cost.host_kv_reads * scale / g.zero_copy_read_bytes_per_s)
        compute = cost.dense_s(context, resident, tokens) + cost.n_nodes * g.graph_node_overhead_s + host_kv_s
        if not self.moe_blocks:
            return compute + g.kernels.prefill_host.latency_s
        ring = streaming
        compute = (compute + ring.expert_compute_s + ring.touched_read_s
                   + ring.streaming_blocks * (ring.fill_s + ring.issue_s))
        stream = (ring.streamed_bytes / g.host_to_device_bytes_per_s + ring.copies * g.copy_latency_s + host_kv_s
                  + ring.streamed_count * ring.stall_per_expert_s
                  + ring.streaming_blocks * (cost.block_s(context, resident, tokens) + ring.issue_s + ring.drain_s))
        return np.maximum(np.maximum(compute, stream), ring.launch_s) + g.kernels.prefill_host.latency_s

    def chunk_streaming(self, tokens: int, cache_slots, ring_slots) -> ChunkStreaming | None:
        """What a chunk of `tokens` positions costs in experts, whatever its context (`ChunkStreaming`).

        A streaming block's experts launch batch by batch, each batch's grids its share of the block's tiles
        (`PassCost.expert_compute_s`): a shallow ring's small batches leave SMs idle in every wave. The engine
        waits for a streaming block's routing, so nothing runs on the GPU or the copy engine until the host has
        issued that block's first batch."""
        g = self.gpu
        if not self.moe_blocks:
            return None
        graph_tokens = 1 << (tokens - 1).bit_length()
        cost = self.cost("prefill", graph_tokens)
        miss_table, count_table, touched_bytes, touched_count = self.window_tables(tokens)
        streamed_bytes = miss_table.total(cache_slots)
        streamed_count = count_table.total(cache_slots)
        expert_compute = self.expert_compute_s("prefill", tokens)
        per_expert_compute = expert_compute / max(touched_count, 1e-9)
        copy = self.mean_blob / g.host_to_device_bytes_per_s     # a typical expert's copy, for the ring's stalls
        slot_cycle = g.copy_latency_s + copy + per_expert_compute
        stall_per_expert = np.maximum(0.0, slot_cycle / ring_slots - copy)
        half = np.maximum(1, np.asarray(ring_slots) // 2)
        streaming_blocks = self._blocks_streaming(cache_slots)
        streamed_per_block = streamed_count / np.maximum(streaming_blocks, 1)
        per_block = np.minimum(half, streamed_per_block)        # a first batch's experts
        batches = np.maximum(1.0, np.ceil(streamed_per_block / half))   # a streaming block's
        extra_batches = streaming_blocks * (batches - 1.0)     # beyond each block's one launch
        mean_rows, one_launch_s = self._mean_block_experts(tokens)
        split_s = cost.expert_compute_s(mean_rows, tokens, batches) - one_launch_s
        expert_compute = (expert_compute + streaming_blocks * split_s
                          + extra_batches * g.kernels.prefill_ring_batch.latency_s)
        # a batch's copies: two (data, scales) per matrix for each run of consecutive expert ids (a cached
        # expert between two streamed ones splits a run)
        cached_share = np.minimum(1.0, np.asarray(cache_slots) / len(self.moe_blocks) / self.n_expert)
        batch_copies = COPIES_PER_RUN * (1 + (half - 1) * cached_share)
        batch_issue_s = (batch_copies * (g.kernels.prefill_ring_copy.latency_s or g.copy_call_s)
                         + (g.kernels.prefill_ring_call.latency_s
                            or BATCH_KERNELS * g.kernel_launch_s + BATCH_EVENT_CALLS * g.event_call_s))
        routing_s = g.kernels.prefill_ring_block.latency_s
        return ChunkStreaming(
            expert_compute, touched_bytes / g.memory_bandwidth_bytes_per_s, streamed_bytes, streamed_count,
            streaming_blocks * batches * batch_copies, stall_per_expert, streaming_blocks, per_block * copy,
            per_block * per_expert_compute, routing_s + batch_issue_s,
            cost.n_nodes * (g.kernels.prefill_launch.latency_s or g.kernel_launch_s)
            + streaming_blocks * (batches * batch_issue_s + routing_s)
            + (len(self.moe_blocks) - streaming_blocks) * CACHED_BLOCK_CALLS * g.kernel_launch_s)

    def _blocks_streaming(self, cache_slots):
        """How many MoE blocks still stream at least one expert."""
        n = len(self.moe_blocks)
        base, extra = np.divmod(np.asarray(cache_slots), n)
        return np.where(base >= self.n_expert, 0, np.where(base + 1 >= self.n_expert, n - extra, n))

    def prefill_s(self, read_tokens: int, chunk_tokens: int, cache_slots, ring_slots, resident_tokens,
                  start: int = 0):
        """A prompt read of `read_tokens` positions after a reused prefix of `start`, in chunks."""
        n_chunks = -(-read_tokens // chunk_tokens)
        samples = range(n_chunks) if n_chunks <= CHUNK_SAMPLES else \
            sorted(set(np.linspace(0, n_chunks - 1, CHUNK_SAMPLES).round().astype(int).tolist()))
        total = 0.0
        streaming = {}          # chunk tokens -> chunk_streaming: full chunks, and a short last one
        for i in samples:
            tokens = min(chunk_tokens, read_tokens - i * chunk_tokens)
            if tokens not in streaming:
                streaming[tokens] = self.chunk_streaming(tokens, cache_slots, ring_slots)
            total = total + self.chunk_s(tokens, start + i * chunk_tokens + tokens, ring_slots, resident_tokens,
                                         streaming[tokens])
        return total * (n_chunks / len(samples))
