"""The drafter room on the H200 (issue 5): prefill with the drafter's expert slots lent to the prefill ring
against prefill without, on an emulated small card.

The model: GLM-4.5-Air's shape (64 query heads, not 96: `HEADS`) at Q8_0 with `--layers` trunk blocks and its
NextN block (random weights with skewed routing, built in memory by `runtime.synthetic.realistic_weights`).
The card: `--card`'s VRAM share of
the trunk (its usable VRAM scaled by layers / 46) for the K/V, the ring and the expert cache, plus every dense
weight and the drafter's block, with the H200's compute and this run's measured links (`benchmarks.e2e`). Per
prompt length, paired runs of the same random prompt, room shut (`room_min_read_tokens` None) and open (0), in
alternating order; the prefill time includes giving the room back (the drafter's experts copied in again),
which is also shown on its own. Then, for `--drafter-kv-tokens` prompts (room shut), the drafter's prompt K/V
stored in the prompt's batched pass against the drafter's own pass (a draft step a position of its window).
Commands (prefix from DEVICE.md):

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/room.py --layers 3 --prompt-tokens 4096 16384 32768
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.e2e import emulated_profile, measure_links
from codegen.lower.cuda import cuda
from planner.model import load_model
from planner.search import solve
from planner.workload import Workload
from runtime.engine import Engine
from runtime.synthetic import realistic_weights, reduced_card

CARD = "glm-4.5-air-q4_k_m"
# 64 query heads, not the card's 96: the shape BENCHMARKS.md's table was measured on (the card's group of 12 query
# heads a kv head did not split the prefill attention kernel's tiles then; it does since, not yet run on a GPU)
HEADS = {"attention.head_count": 64}


def resident_bytes(model) -> int:
    """What the emulated card holds besides its share of the card: every dense weight (this model's are at
    Q8_0, the card's plans are for Q4_K_M) and the drafter's block."""
    return model.dense_bytes + model.drafter_dense_bytes + model.hparams.n_expert * model.slot_layout.slot_bytes


def paired_prefill(engine, prompt: list, repeats: int) -> dict:
    """Median prefill tok/s with the room shut and open (pairs in alternating order), the open runs' lend time."""
    rates, lend_s = {None: [], 0: []}, []
    for i in range(repeats):
        for threshold in ((None, 0) if i % 2 == 0 else (0, None)):
            engine.room_min_read_tokens = threshold
            out = engine.generate(prompt, max_new_tokens=1)
            rates[threshold].append(len(prompt) / out.prefill_s)
            if threshold == 0:
                lend_s.append(engine.stats()["last_request"]["room_lend_s"])
    return {"shut": float(np.median(rates[None])), "open": float(np.median(rates[0])),
            "lend_ms": 1e3 * float(np.median(lend_s))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--card", default="rtx-2060-super-8g")
    parser.add_argument("--prompt-tokens", type=int, nargs="*", default=[4096, 16384, 32768],
                        help="prompt lengths of the room's paired runs (none: only the drafter K/V table)")
    parser.add_argument("--repeats", type=int, default=2, help="pairs per prompt length")
    parser.add_argument("--kv", default="f16")
    parser.add_argument("--drafter-kv-tokens", type=int, nargs="*", default=[7168, 14336])
    args = parser.parse_args()
    ceilings, links = measure_links()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        card = reduced_card(args.layers, folder, CARD, types="q8_0", metadata=HEADS)
        model = load_model(card)
        profile = emulated_profile(args.card, links, args.layers, folder, CARD, extra_bytes=resident_bytes(model))
        context = max(args.prompt_tokens + args.drafter_kv_tokens) + 64
        lengths = args.prompt_tokens or args.drafter_kv_tokens
        workload = Workload(prompts=tuple((tokens, 1.0) for tokens in lengths), decode_tokens=1)
        plan = solve(profile, card, context=context, kv=args.kv, mtp=True, workload=workload)
        knobs = plan.knobs
        print(f"plan: {plan.device_bytes(0) / 2 ** 30:.2f} GiB, cache slots {knobs['expert_cache_slots'][0]}, "
              f"ring slots {knobs['prefill_ring_slots']}, room slots {knobs['room_slots']} of "
              f"{knobs['slot_bytes'] / 2 ** 20:.1f} MiB, chunk {knobs['chunk_tokens']}, K/V pages {knobs['kv_pages']}, "
              f"room threshold {knobs['room_min_read_tokens']}")
        started = time.perf_counter()
        tensors = list(realistic_weights(card, seed=1, skew=1.0))
        print(f"weights built in {time.perf_counter() - started:.0f} s")
        predicted = {row["prompt_tokens"]: row for row in plan.predictions["prefill"]}
        rows = []
        with Engine(plan, card, tensors=tensors, room_min_read_tokens=0) as engine:
            engine.generate(rng.integers(0, model.hparams.n_vocab, size=64).tolist(), 1)    # warm the host paths
            for tokens in args.prompt_tokens:
                prompt = rng.integers(0, model.hparams.n_vocab, size=tokens).tolist()
                measured = paired_prefill(engine, prompt, args.repeats)
                row = predicted[tokens]
                rows.append((tokens, measured, row))
                print(f"{tokens} tokens: {measured}", flush=True)
            stats = engine.stats()
        cuda.current_context().deallocations.clear()
        passes = {}
        for drafter_kv_pass in ("batched", "per_row"):
            with Engine(plan, card, tensors=tensors, room_min_read_tokens=None, drafter_kv_pass=drafter_kv_pass,
                        progress=False) as engine:
                engine.generate(rng.integers(0, model.hparams.n_vocab, size=64).tolist(), 1)    # warm the host paths
                for tokens in args.drafter_kv_tokens:
                    prompt = np.random.default_rng(tokens).integers(0, model.hparams.n_vocab, size=tokens).tolist()
                    out = engine.generate(prompt, max_new_tokens=1)
                    passes[drafter_kv_pass, tokens] = tokens / out.prefill_s
            cuda.current_context().deallocations.clear()
    print()
    print(f"{CARD} shape at Q8_0, {args.layers} trunk blocks + NextN, emulated {args.card} "
          f"(pinned {ceilings['pinned'] / 1e9:.1f} GB/s), K/V {args.kv}, {args.repeats} pairs a length")
    print("| prompt tokens | room shut tok/s | room open tok/s | gain | lend ms | predicted tok/s (plan's rule) | "
          "room open in the plan |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for tokens, measured, row in rows:
        print(f"| {tokens} | {measured['shut']:.0f} | {measured['open']:.0f} | "
              f"{measured['open'] / measured['shut'] - 1:+.1%} | {measured['lend_ms']:.1f} | {row['tok_s']:.0f} | "
              f"{row['room_open']} |")
    print(f"stats: room requests {stats['room_requests']}, "
          f"bytes streamed {stats['expert_bytes_copied'] / 2 ** 30:.1f} GiB")
    print()
    print(f"the drafter's prompt K/V (its window: {knobs['drafter_window_tokens']} positions), room shut")
    print("| prompt tokens | batched pass tok/s | drafter's own pass tok/s | batched's gain |")
    print("| ---: | ---: | ---: | ---: |")
    for tokens in args.drafter_kv_tokens:
        batched, per_row = passes["batched", tokens], passes["per_row", tokens]
        print(f"| {tokens} | {batched:.0f} | {per_row:.0f} | {batched / per_row - 1:+.1%} |")


if __name__ == "__main__":
    main()
