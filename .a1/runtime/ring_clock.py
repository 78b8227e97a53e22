"""Host clocks around the prefill ring's calls: what the host spends on each MoE block that streams experts.

A streaming block is a serialisation point (`runtime.engine`'s `_run_prefill`): the host waits for the block's
routing (a sync), works out the ring's batches from it, and issues each batch's copies, events and two expert
kernels, while the GPU waits for the first. `RingClock` times those calls in a running engine with host clocks
only (events would cost the host more than some of the calls they time), one `BlockClock` a streaming block.
The calibration fits the prefill-ring families of `planner.profile.Kernels` from them (`runtime.calibrate`), and
`benchmarks/prefill_timeline.py` prints them.
"""

import time
from dataclasses import dataclass, field

import runtime.experts


@dataclass
class BlockClock:
    """One streaming block's host seconds."""
    block: int
    sync_s: float                   # waiting for its routing (the GPU's work before it, and the sync itself)
    issue_s: float = 0.0            # issuing its batches (`ExpertStore.stream_block`), all of it
    copy_s: list = field(default_factory=list)      # each `_copy_in` (a matrix's run of experts)
    driver_copies: int = 0          # the pitched driver copies those made (data and scales apart)
    batch_s: list = field(default_factory=list)     # each batch's two expert-kernel launches

    @property
    def rest_s(self) -> float:
        """Issue time beyond the copies and launches: the routing's bincount, the batches' tables and tile
        counts, the events, the Python between."""
        return self.issue_s - sum(self.copy_s) - sum(self.batch_s)


class RingClock:
    """While `on`, a `BlockClock` for each block an engine's expert store streams (`blocks`)."""

    def __init__(self, engine):
        self.engine, self.store = engine, engine.experts
        self.on, self.blocks = False, []
        self._last_sync_s, self._streaming = 0.0, False
        self._stream_block, self._copy_in = self.store.stream_block, self.store._copy_in
        self._synchronize = engine.compute.synchronize
        self._copy_into_rows = runtime.experts.copy_into_rows
        self.store.stream_block, self.store._copy_in = self.stream_block, self.copy_in
        engine.compute.synchronize = self.synchronize
        runtime.experts.copy_into_rows = self.copy_into_rows

    def close(self) -> None:
        """Put the engine's own calls back."""
        self.store.stream_block, self.store._copy_in = self._stream_block, self._copy_in
        self.engine.compute.synchronize = self._synchronize
        runtime.experts.copy_into_rows = self._copy_into_rows

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def begin(self) -> None:
        self.on, self.blocks = True, []

    def end(self) -> list:
        self.on = False
        return self.blocks

    def synchronize(self):
        started = time.perf_counter()
        self._synchronize()
        self._last_sync_s = time.perf_counter() - started

    def copy_into_rows(self, *args):
        if self._streaming:         # only the ring's, not a refresh's or a room's
            self.blocks[-1].driver_copies += 1
        self._copy_into_rows(*args)

    def copy_in(self, block, matrix, first, count, slot, stream):
        if not self._streaming:     # a refresh's or a room's copy: not the ring's
            return self._copy_in(block, matrix, first, count, slot, stream)
        started = time.perf_counter()
        self._copy_in(block, matrix, first, count, slot, stream)
        self.blocks[-1].copy_s.append(time.perf_counter() - started)

    def stream_block(self, block, ids, compute, run_batch):
        if not self.on:
            return self._stream_block(block, ids, compute, run_batch)
        clock = BlockClock(block, self._last_sync_s)
        self.blocks.append(clock)

        def clocked_batch(lo, hi, tiles):
            started = time.perf_counter()
            run_batch(lo, hi, tiles)
            clock.batch_s.append(time.perf_counter() - started)
        started, self._streaming = time.perf_counter(), True
        try:
            self._stream_block(block, ids, compute, clocked_batch)
        finally:
            self._streaming = False
        clock.issue_s = time.perf_counter() - started
