"""MTP decode at 1K depth for two K/V ring sizes, with the K/V ring sized per request and without (issue 5).

The question users ask: a bigger K/V ring costs expert-cache slots, so speculative decode at short depth slows
down. With lending, a request that needs fewer pages than the ring lends the rest to the expert cache
(`planner.kv_lending`), and the big ring costs short requests nothing.

The model and card as in `benchmarks/room.py`: GLM-4.5-Air's shape at Q8_0 with `--layers` trunk blocks and
its NextN drafter (random weights with skewed routing), on an emulated `--card` (its VRAM share of the trunk,
the H200's compute and this run's measured links). Two plans for a context of `--context` positions: the ring
pinned to `--small-ring-pages` pages, and to the whole context; each run with lending on and off (the engine's
`kv_lending` switch) on the same `--prompt-tokens` random prompt, decoding `--new-tokens` greedy tokens without
drafting and at `--depth` drafts a window (every window size captured first). Random weights' drafter is never right, so drafts are replaced by
the greedy output's tokens at `--rate` (`benchmarks/mtp.py`'s set acceptance): the verify windows accept as a
drafter of that quality would, and the draft steps' cost is paid as usual. Every drafted run's tokens are
checked equal to the run without drafting. Commands (prefix from DEVICE.md):

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/kv_lending.py --layers 3
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.e2e import emulated_profile, measure_links, nearest
from benchmarks.mtp import decode_rate, propose_at_rate
from benchmarks.room import CARD, HEADS, resident_bytes
from codegen.lower.cuda import cuda
from planner.kv_lending import needed_pages
from planner.model import load_model
from planner.search import PAGE_TOKENS, solve
from planner.workload import Workload
from runtime.engine import Engine
from runtime.synthetic import realistic_weights, reduced_card


def plans(profile: Path, card: Path, context: int, prompt_tokens: int, new_tokens: int, small_pages: int,
          chunk_tokens: int) -> dict:
    """name -> plan: the ring pinned small, and to the whole context."""
    workload = Workload(prompts=((prompt_tokens, 1.0),), decode_tokens=new_tokens, draft_acceptance=0.8)
    full_pages = int(needed_pages(context, PAGE_TOKENS))
    return {f"{pages} pages": solve(profile, card, context=context, kv="f16", mtp=True, workload=workload,
                                    pins={"kv_pages": pages, "chunk_tokens": chunk_tokens})
            for pages in (small_pages, full_pages)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--card", default="rtx-5070-ti-16g")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--small-ring-pages", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--plan-only", action="store_true", help="print the plans and their predictions only")
    args = parser.parse_args()
    ceilings, links = measure_links() if not args.plan_only else ({}, {})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        card = reduced_card(args.layers, folder, CARD, types="q8_0", metadata=HEADS)
        model = load_model(card)
        profile = emulated_profile(args.card, links, args.layers, folder, CARD, extra_bytes=resident_bytes(model))
        solved = plans(profile, card, args.context, args.prompt_tokens, args.new_tokens, args.small_ring_pages,
                       args.chunk_tokens)
        depth = args.prompt_tokens + args.new_tokens // 2
        for name, plan in solved.items():
            row = nearest(plan.predictions["decode"], "depth", depth)
            print(f"plan, K/V ring of {name}: {plan.device_bytes(0) / 2 ** 30:.2f} GiB, cache slots "
                  f"{plan.knobs['expert_cache_slots'][0]} (+ lent at depth {row['depth']}: "
                  f"{row['expert_cache_slots'][0] - plan.knobs['expert_cache_slots'][0]}), predicted hit rate "
                  f"{plan.predictions['expert_hit_rate']:.1%} -> {row['expert_hit_rate']:.1%} with lending, decode "
                  f"{row['tok_s_without_mtp']:.0f} tok/s, MTP {row['tok_s']:.0f} (depth {plan.knobs['draft_depth']})")
        if args.plan_only:
            return
        started = time.perf_counter()
        tensors = list(realistic_weights(card, seed=1, skew=1.0))
        print(f"weights built in {time.perf_counter() - started:.0f} s")
        prompt = np.random.default_rng(0).integers(0, model.hparams.n_vocab, size=args.prompt_tokens).tolist()
        rows = []
        for name, plan in solved.items():
            for lending in (False, True):
                with Engine(plan, card, tensors=tensors, progress=False, kv_lending=lending) as engine:
                    for drafts in range(1, args.depth + 1):     # every verify window size captured before timing
                        engine.generate(prompt[:64], max_new_tokens=args.depth + 3, draft_depth=drafts)
                    plain, _, truth = decode_rate(engine, prompt, args.new_tokens, 0)
                    hit = engine.stats()["expert_cache_hit_rate"]
                    lent = engine.stats()["expert_slots_lent"]
                    propose_at_rate(engine, len(prompt), truth, args.rate, np.random.default_rng(1))
                    drafted, acceptance, tokens = decode_rate(engine, prompt, args.new_tokens, args.depth)
                    assert tokens == truth, f"{name}, lending {lending}: drafting changed the greedy output"
                rows.append((name, plan, lending, lent, hit, plain, drafted, acceptance))
                print(rows[-1][:3], f"{plain:.1f} {drafted:.1f} tok/s, hit {hit:.1%}, lent {lent}", flush=True)
                cuda.current_context().deallocations.clear()
    print()
    print(f"{CARD} shape at Q8_0, {args.layers} trunk blocks + NextN, emulated {args.card} (pinned "
          f"{ceilings['pinned'] / 1e9:.1f} GB/s, zero-copy {ceilings['zero_copy'] / 1e9:.1f} GB/s), context "
          f"{args.context}, prompt {args.prompt_tokens}, {args.new_tokens} new tokens, K/V f16, drafts at depth "
          f"{args.depth} right at {args.rate:.0%}")
    print("| K/V ring | lending | cache slots + lent | hit rate | decode tok/s | MTP tok/s | acceptance | "
          "predicted decode / MTP |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, plan, lending, lent, hit, plain, drafted, acceptance in rows:
        row = nearest(plan.predictions["decode"], "depth", depth)
        predicted = f"{row['tok_s_without_mtp']:.0f} / {row['tok_s']:.0f}" if lending else "-"
        print(f"| {name} | {'on' if lending else 'off'} | {plan.knobs['expert_cache_slots'][0]} + {lent} | "
              f"{hit:.1%} | {plain:.1f} | {drafted:.1f} | {acceptance:.0%} | {predicted} |")


if __name__ == "__main__":
    main()
