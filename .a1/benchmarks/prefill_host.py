"""Where a resident prompt's wall time goes beyond its nodes' GPU time (issue 6): the host's part of prefill.

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/prefill_host.py --profile detected.yaml [--host-profile N]

For the calibration model (`runtime.calibrate`: the Qwen3-30B-A3B shape with 4 blocks, every expert and the
whole context's K/V in VRAM) at 2048 and 512 tokens and the demo model (`plans/demo`, resident) at 256, 512
and 768, one prompt of one chunk is read after two that warmed it, and split into:

  wall ms        the request's `prefill_s` (what validate measures and the planner predicts);
  nodes ms       its pass's nodes timed back to back between events (`runtime.calibrate.timed_nodes`);
  pass span ms   GPU time from an event before the pass's first launch to one after its last: the nodes plus
                 the GPU's idle time while it waits for the host's launches within the pass;
  host ms        the request's host time in each engine phase (perf_counter around each call), and "other":
                 the wall time outside them.

`--demo-fractions F ...` measures the demo under `benchmarks/validate.py`'s budgets instead (its plans, each
holding fraction F of the resident plan's bytes, solved for each prompt length as validate solves them, with
the default skew, or `--trace`'s routing: a validate run's RUN.trace.json, to rebuild that run's plans): a row per
budget and prompt, with the plan's knobs and its predicted prefill time, so a
validated row that misses can be taken apart. Its prompts are random ids, each request making one token;
`--text` reads validate's instead (held-out Python source, each request then making NEW_TOKENS): run 22
measured the 50% budget's 512-token row at 4.3 ms with random ids and 6.5 ms under validate.

`--host-profile N` prints the top N functions by own time of one more request (cProfile).
"""

import argparse
import cProfile
import functools
import json
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.e2e import predicted, print_table
from benchmarks.validate import DEMO_CONTEXT, DEMO_PROMPTS, demo_budgets, text_prompts
from codegen.lower.cuda import cuda
from planner.profile import load_profile
from planner.search import solve
from planner.workload import Workload
from runtime.calibrate import calibration_plan, timed_nodes
from runtime.engine import Engine
from runtime.synthetic import realistic_weights
from tools.demo import DEMO_PATH

NEW_TOKENS = 32     # the decode tokens validate's plans are solved for
ENGINE_PHASES = ("_lend_kv_pages", "_inputs", "_run_prefill")
STORE_PHASES = ("settle", "refresh", "count_routed", "run_cached_block")


class HostClock:
    """perf_counter totals of named engine and expert-store calls while `on`, and events around each pass."""

    def __init__(self, engine):
        self.engine, self.on, self.totals, self.passes = engine, False, {}, []
        for owner, names in ((engine, ENGINE_PHASES), (engine.experts, STORE_PHASES),
                             (engine.kv_ring, ("claim",)), (engine.compute, ("synchronize",))):
            for name in names:
                setattr(owner, name, self._timed(name, getattr(owner, name)))

    def _timed(self, name, call):
        @functools.wraps(call)
        def wrapper(*args, **kwargs):
            if not self.on:
                return call(*args, **kwargs)
            if name == "_run_prefill":
                before, after = cuda.event(), cuda.event()
                before.record(self.engine.compute)
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - started
                if name == "_run_prefill":
                    after.record(self.engine.compute)
                    self.passes.append((before, after))
        return wrapper

    def request(self, prompt, new_tokens: int = 1) -> dict:
        """One request's wall, pass span and host phases, in ms."""
        self.on, self.passes = True, []
        self.totals = {name: 0.0 for name in ENGINE_PHASES + STORE_PHASES + ("claim", "synchronize")}
        wall_s = self.engine.generate(prompt, new_tokens).prefill_s
        self.on = False
        span_ms = sum(cuda.event_elapsed_time(a, b) for a, b in self.passes)
        row = {"wall ms": wall_s * 1e3, "pass span ms": span_ms}
        row.update({f"{name} ms": s * 1e3 for name, s in sorted(self.totals.items())})
        # the phases that run inside others (the syncs, and the cached blocks' calls within the pass) left out
        row["other ms"] = (wall_s - sum(s for name, s in self.totals.items()
                                        if name not in ("synchronize", "count_routed", "run_cached_block"))) * 1e3
        return row


def measure(engine, gpu, tokens: list, host_profile: int, label: dict | None = None, prompt=None,
            new_tokens: int = 1) -> list:
    """A row a prompt length: warm it twice, then read one more with the host's clocks on, each request
    making `new_tokens`; `label`'s columns lead each row. prompt(n): n token ids (default random ids)."""
    rng = np.random.default_rng(0)
    prompt = prompt or (lambda n: rng.integers(0, engine.hp.n_vocab, size=n).tolist())
    clock = HostClock(engine)
    rows = []
    for n in tokens:
        for _ in range(2):
            engine.generate(prompt(n), new_tokens)
        row = {**(label or {}), "tokens": n, **clock.request(prompt(n), new_tokens)}
        # a prompt longer than the plan's chunk reads in chunks: a full chunk's pass is timed, at the prompt's context
        nodes = timed_nodes(engine, gpu, "prefill", min(n, engine.chunk_tokens), n)
        row["nodes ms"] = sum(sample.measured_s for sample in nodes) * 1e3
        row["beyond nodes ms"] = row["wall ms"] - row["nodes ms"]
        rows.append(row)
        if host_profile:
            profiler = cProfile.Profile()
            profiler.enable()
            engine.generate(rng.integers(0, engine.hp.n_vocab, size=n).tolist(), 1)
            profiler.disable()
            print(f"\nhost profile, {n} tokens:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(host_profile)
    return rows


def demo_budget_rows(profile: Path, gpu, fractions: list, tokens: list, host_profile: int, histogram=None,
                     text: bool = False) -> list:
    """`measure`'s rows for the demo under validate's budgets of `fractions`, a plan per budget and prompt
    (planned from `histogram`, a trace's routing counts, when given); with `text`, validate's prompts (held-out
    Python source) and its requests' NEW_TOKENS, not random ids and one token."""
    prompt = text_prompts(np.random.default_rng(0)) if text else None
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label, budget in demo_budgets(profile, Path(folder), fractions):
            for n in tokens:
                workload = Workload(prompts=((n, 1.0),), decode_tokens=NEW_TOKENS, histogram=histogram)
                plan = solve(budget, DEMO_PATH, context=DEMO_CONTEXT, kv="f16", workload=workload, mtp=False)
                knobs = plan.knobs
                predicted_ms = n / predicted(plan, n, NEW_TOKENS)[0] * 1e3
                with Engine(plan, DEMO_PATH, progress=False) as engine:
                    rows += measure(engine, gpu, [n], host_profile, {
                        "budget": label, "cache": knobs["expert_cache_slots"][0], "ring": knobs["prefill_ring_slots"],
                        "chunk": knobs["chunk_tokens"], "kv pages": knobs["kv_pages"], "predicted ms": predicted_ms},
                        prompt, NEW_TOKENS if text else 1)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="this machine's profile (stratum profile --detect)")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N")
    parser.add_argument("--demo-fractions", type=float, nargs="+", metavar="F",
                        help="the demo under validate's budgets of these fractions (e.g. 0.5 0.6 0.7 0.8)")
    parser.add_argument("--trace", help="with --demo-fractions: plan from this validate run's RUN.trace.json")
    parser.add_argument("--text", action="store_true",
                        help="with --demo-fractions: validate's text prompts and new tokens, not random ids")
    args = parser.parse_args()
    profile = Path(args.profile)
    gpu = load_profile(profile).gpus[0]
    if args.demo_fractions:
        histogram = (tuple(map(tuple, json.loads(Path(args.trace).read_text())["expert_popularity"]["histogram"]))
                     if args.trace else None)
        print_table(demo_budget_rows(profile, gpu, args.demo_fractions, list(DEMO_PROMPTS), args.host_profile,
                                     histogram, args.text))
        return
    with tempfile.TemporaryDirectory() as folder:
        card, plan = calibration_plan(profile, Path(folder))
        with Engine(plan, card, tensors=realistic_weights(card, seed=1, skew=1.0), progress=False) as engine:
            print(f"calibration model ({card.stem}, {len(engine.moe_blocks)} MoE blocks):")
            print_table(measure(engine, gpu, [2048, 512], args.host_profile))
    plan = solve(profile, DEMO_PATH, context=1024, kv="f16", workload=Workload(prompts=((768, 1.0),)),
                 pins={"chunk_tokens": 1024}, mtp=False)
    with Engine(plan, DEMO_PATH, progress=False) as engine:
        print(f"\ndemo model ({len(engine.moe_blocks)} MoE blocks, "
              f"{engine.experts.n_cache} of {engine.experts.n_expert * len(engine.moe_blocks)} experts cached):")
        print_table(measure(engine, gpu, [256, 512, 768], args.host_profile))


if __name__ == "__main__":
    main()
