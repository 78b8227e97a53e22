"""Where a streaming prefill's time goes, MoE block by MoE block (issue 6): a timeline of the prefill ring.

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/prefill_timeline.py --profile detected.yaml [--trace t.json]
        [--budgets 16 12 8] [--prompt-tokens 2048] [--layers 6] [--host-profile N]
    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/prefill_timeline.py --profile detected.yaml --trace demo.trace.json
        --demo-fractions 0.5 0.6 --prompt-tokens 256

`--demo-fractions` times the trained demo model instead, under validate's demo budgets of those fractions of
its resident bytes, on validate's text prompts (held-out Python source).

For each budget (the detected profile with that card's VRAM, scaled to --layers of 48 blocks as
`benchmarks/validate.py` does; --trace plans from a traced histogram, so a validate run's plans are rebuilt
exactly), one prompt is read twice: plain (its wall time), then with every ring batch's copies (copy stream) and
expert kernels (compute stream) between CUDA events and the host's time in each block's routing sync and in
issuing each block's batches measured. A block's row:

  dense ms      GPU time from the previous block's last expert kernel to this block's first copy or kernel:
                its attention, projections, router and grouping, and the host's sync latency;
  issue ms      host time from the block's routing read back to its last batch issued (copies, launches, events);
  copy / experts ms   GPU time the ring's copies / the batches' expert kernels take, summed;
  span ms       from the block's first copy to its last expert kernel's end (what the block's streaming costs);
  overlap       how much of the shorter of copy and experts ran hidden under the other within the span.

If span follows `issue`, the host is what binds; if it follows copy + experts, the copies and kernels run one
after the other on the GPU; if it follows max(copy, experts), they overlap as the planner assumes.

The events cost the host time themselves, so a third read takes host clocks only (`runtime.ring_clock`), per
block: sync and issue ms as above, the mean host time of a ring copy as the store issues it (`_copy_in`, a
matrix's run of experts: its data's and its scales' driver copies) and of a batch's two expert-kernel
launches, and `rest ms`, the issue time beyond those (the routing's bincount, the batches' tables and tile
counts, the events, the Python between).
`--host-profile N` prints the top N functions by own time of the host during one plain read (cProfile).
"""

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.e2e import built_weights, measure_links, nearest, print_table, random_prompts
from benchmarks.validate import DEMO_CONTEXT, budget_profile, demo_budgets, text_prompts
from codegen.lower.cuda import cuda
from planner.model import load_model
from planner.search import solve
from planner.workload import Workload
from runtime.engine import Engine
from runtime.ring_clock import RingClock
from tools.demo import DEMO_PATH

CONTEXT = 8192


class RingTimeline:
    """Events around a store's ring copies and batches, and host clocks around its syncs, while `on`."""

    def __init__(self, engine):
        self.engine, self.store = engine, engine.experts
        self.on = False
        self.blocks = []            # per stream_block call: dict of host times and events
        self._stream_block, self._copy_in = self.store.stream_block, self.store._copy_in
        self._synchronize = engine.compute.synchronize
        self.store.stream_block, self.store._copy_in = self.stream_block, self.copy_in
        engine.compute.synchronize = self.synchronize
        self.start = cuda.event()
        self.last_sync_s = 0.0

    def begin(self) -> None:
        self.on, self.blocks = True, []
        self.start.record(self.engine.compute)

    def synchronize(self):
        started = time.perf_counter()
        self._synchronize()
        self.last_sync_s = time.perf_counter() - started

    def copy_in(self, block, matrix, first, count, slot, stream):
        if not self.on:
            return self._copy_in(block, matrix, first, count, slot, stream)
        before, after = cuda.event(), cuda.event()
        before.record(stream)
        self._copy_in(block, matrix, first, count, slot, stream)
        after.record(stream)
        self.blocks[-1]["copies"].append((before, after))

    def stream_block(self, block, ids, compute, run_batch):
        if not self.on:
            return self._stream_block(block, ids, compute, run_batch)
        row = {"block": block, "sync_s": self.last_sync_s, "copies": [], "batches": []}
        self.blocks.append(row)

        def timed_batch(lo, hi, work):
            before, after = cuda.event(), cuda.event()
            before.record(compute)
            run_batch(lo, hi, work)
            after.record(compute)
            row["batches"].append((before, after))
        started = time.perf_counter()
        self._stream_block(block, ids, compute, timed_batch)
        row["issue_s"] = time.perf_counter() - started

    def rows(self) -> list:
        """One dict a block, times in ms from the timeline's start."""
        def at(event):
            return cuda.event_elapsed_time(self.start, event)
        out, previous_end = [], 0.0
        for row in self.blocks:
            copies = [(at(a), at(b)) for a, b in row["copies"]]
            batches = [(at(a), at(b)) for a, b in row["batches"]]
            first = min([s for s, _ in copies + batches])
            end = max(e for _, e in batches)
            copy_ms = sum(e - s for s, e in copies)
            experts_ms = sum(e - s for s, e in batches)
            span = end - first
            hidden = copy_ms + experts_ms - span
            out.append({"block": row["block"], "dense ms": first - previous_end, "sync ms": row["sync_s"] * 1e3,
                        "issue ms": row["issue_s"] * 1e3, "batches": len(batches), "copies": len(copies),
                        "copy ms": copy_ms, "experts ms": experts_ms, "span ms": span,
                        "overlap": max(0.0, hidden) / max(1e-9, min(copy_ms, experts_ms)) if copies else None})
            previous_end = end
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="this machine's profile (stratum profile --detect)")
    parser.add_argument("--trace", help="a traced histogram to plan with (validate.py's .trace.json)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 12, 8], help="GB")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--demo-fractions", type=float, nargs="+", metavar="F",
                        help="the demo model under validate's budgets of these fractions, not the Qwen shape")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    ceilings, _ = measure_links()
    histogram = None
    if args.trace:
        histogram = tuple(map(tuple, json.loads(Path(args.trace).read_text())["expert_popularity"]["histogram"]))
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.demo_fractions:
            card, tensors, context, prompt = DEMO_PATH, None, DEMO_CONTEXT, text_prompts(rng)
            budgets = demo_budgets(Path(args.profile), folder, args.demo_fractions)
        else:
            card, tensors = built_weights(args.layers, folder)
            context, prompt = CONTEXT, random_prompts(rng, load_model(card).hparams.n_vocab)
            budgets = [(f"{gb} GB", budget_profile(Path(args.profile), gb, args.layers, folder))
                       for gb in args.budgets]
        for label, profile in budgets:
            workload = Workload(prompts=((args.prompt_tokens, 1.0),), decode_tokens=32, histogram=histogram)
            plan = solve(profile, card, context=context, kv="f16", workload=workload, mtp=False)
            predicted = nearest(plan.predictions["prefill"], "prompt_tokens", args.prompt_tokens)["tok_s"]
            with Engine(plan, card, tensors=tensors, progress=False) as engine:
                timeline = RingTimeline(engine)
                engine.generate(prompt(args.prompt_tokens), 1)      # compiles, warms the host paths
                copied = engine.experts.stats.streamed_bytes
                plain = engine.generate(prompt(args.prompt_tokens), 1).prefill_s
                streamed = engine.experts.stats.streamed_bytes - copied
                if args.host_profile:
                    profiler = cProfile.Profile()
                    profiler.enable()
                    engine.generate(prompt(args.prompt_tokens), 1)
                    profiler.disable()
                with RingClock(engine) as clock:
                    clock.begin()
                    clocked = engine.generate(prompt(args.prompt_tokens), 1).prefill_s
                    clock_rows = [{"block": b.block, "sync ms": b.sync_s * 1e3, "issue ms": b.issue_s * 1e3,
                                   "copies": len(b.copy_s), "copy us": np.mean(b.copy_s) * 1e6 if b.copy_s else 0.0,
                                   "driver copies": b.driver_copies, "batches": len(b.batch_s),
                                   "batch us": np.mean(b.batch_s) * 1e6, "rest ms": b.rest_s * 1e3}
                                  for b in clock.end()]
                timeline.begin()
                timed = engine.generate(prompt(args.prompt_tokens), 1).prefill_s
                engine.compute.synchronize()
                rows = timeline.rows()
            cuda.current_context().deallocations.clear()
            knobs = plan.knobs
            print(f"\n{label}: {knobs['expert_cache_slots'][0]} cache slots, {knobs['prefill_ring_slots']} ring "
                  f"slots, chunk {knobs['chunk_tokens']}; a {args.prompt_tokens}-token prompt in {plain * 1e3:.1f} ms "
                  f"({args.prompt_tokens / plain:.0f} tok/s, predicted {predicted:.0f}), {streamed / 1e9:.2f} GB "
                  f"streamed ({streamed / ceilings['pinned'] * 1e3:.1f} ms at the measured pinned bandwidth); "
                  f"with the timeline's events {timed * 1e3:.1f} ms")
            print_table(rows, percent=("overlap",))
            print(f"host clocks only: {clocked * 1e3:.1f} ms")
            print_table(clock_rows)
            totals = defaultdict(float)
            for row in rows:
                for key in ("dense ms", "sync ms", "issue ms", "copy ms", "experts ms", "span ms"):
                    totals[key] += row[key]
            print("totals: " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items()))
            if args.host_profile:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.host_profile)


if __name__ == "__main__":
    main()
