"""MTP speculative decoding on the H200 (issue 5): decode tok/s with and without drafting, on the trained demo
model (tools/train_demo.py: a glm4moe with a NextN drafter, byte vocabulary), its plan on `--hardware`, a
prompt of held-out Python source (tools/demo.py).

1. Depths 1..4 against no drafting, with the acceptance the drafter measures.
2. Two K/V ring sizes: the plan's (the whole context in VRAM) and one of `--small-ring-tokens` (older pages
   read in place from the host copy), each without drafting and at `--depth`.
3. Set acceptance rates at `--depth`: the drafts replaced by the greedy output's tokens (known from the run
   without drafting) with probability `rate` each, else a wrong token, so a verify window accepts as a drafter
   of that quality would; the draft steps run as usual (their cost is paid), only their proposals change.

Every drafted run's tokens are checked equal to the run without drafting; each window size is run once before
it is timed (its kernels compile and its graph is captured on first use).

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/mtp.py [--model plans/demo/stratum-demo.gguf]
"""

import argparse

import numpy as np

from planner.search import solve
from runtime.engine import Engine
from tools.demo import DEMO_PATH, held_out_text

PAGE_TOKENS = 16


def decode_rate(engine, prompt: list, new_tokens: int, depth: int):
    """(decode tok/s, acceptance of this request's drafts or None, tokens), after an untimed run."""
    engine.generate(prompt, max_new_tokens=new_tokens, draft_depth=depth)
    before = engine.stats()
    out = engine.generate(prompt, max_new_tokens=new_tokens, draft_depth=depth)
    after = engine.stats()
    drafted = after.get("drafted_tokens", 0) - before.get("drafted_tokens", 0)
    accepted = after.get("accepted_drafts", 0) - before.get("accepted_drafts", 0)
    return (len(out.tokens) - 1) / out.decode_s, accepted / drafted if drafted else None, out.tokens


def propose_at_rate(engine, prompt_tokens: int, truth: list, rate: float, rng) -> None:
    """The engine's draft proposals replaced: the truth's token with probability `rate`, else a wrong one."""
    draft = engine._draft

    def proposed(token, position, depth, temperature=0.0):
        drafts, distributions = draft(token, position, depth, temperature)
        # draft i stands at position + 2 + i; the first generated token stands at prompt_tokens
        for i in range(len(drafts)):
            right = truth[min(position + 2 + i - prompt_tokens, len(truth) - 1)]
            drafts[i] = right if rng.random() < rate else (right + 1) % engine.hp.n_vocab
        return drafts, distributions
    engine._draft = proposed


def measure(engine, name: str, prompt: list, new_tokens: int, depths, rows: list) -> list:
    plain, _, truth = decode_rate(engine, prompt, new_tokens, 0)
    for depth in depths:
        drafted, acceptance, tokens = decode_rate(engine, prompt, new_tokens, depth)
        assert tokens == truth, f"{name}, depth {depth}: drafting changed the greedy output"
        rows.append((name, engine.knobs["kv_pages"], depth, plain, drafted, acceptance))
    return truth


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_PATH))
    parser.add_argument("--hardware", default="h200-141g")
    parser.add_argument("--prompt-tokens", type=int, default=768)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--small-ring-tokens", type=int, default=256)
    parser.add_argument("--rates", type=float, nargs="*", default=[0.0, 0.5, 0.8, 1.0])
    args = parser.parse_args()
    prompt = list(held_out_text(args.prompt_tokens))
    context = args.prompt_tokens + args.new_tokens + 64
    # pages of 16 positions: a context this short is 4 pages of the planner's default 256
    plan = solve(args.hardware, args.model, context=context, kv="f16", mtp=True, page_tokens=PAGE_TOKENS)
    small = solve(args.hardware, args.model, context=context, kv="f16", mtp=True, page_tokens=PAGE_TOKENS,
                  pins={"kv_pages": -(-args.small_ring_tokens // PAGE_TOKENS) + 1, "chunk_tokens": 128})
    rows = []
    rng = np.random.default_rng(0)
    with Engine(plan, args.model, progress=False) as engine:
        truth = measure(engine, "plan's K/V ring", prompt, args.new_tokens, (1, 2, 3, 4), rows)
        for rate in args.rates:
            propose_at_rate(engine, len(prompt), truth, rate, rng)
            measure(engine, f"set rate {rate:.0%}", prompt, args.new_tokens, (args.depth,), rows)
            del engine._draft         # the engine's own proposals again
    with Engine(small, args.model, progress=False) as engine:
        measure(engine, f"K/V ring of {args.small_ring_tokens} tokens", prompt, args.new_tokens, (args.depth,), rows)
    print(f"{args.model}, plan for {args.hardware} (draft depth {plan.knobs['draft_depth']}), a {len(prompt)}-byte "
          f"held-out Python prompt, {args.new_tokens} new tokens, K/V f16")
    print("| run | K/V pages | draft depth | decode tok/s, no drafting | with drafting | speed-up | acceptance |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, pages, depth, plain, drafted, acceptance in rows:
        accepted = "-" if acceptance is None else f"{acceptance:.0%}"
        print(f"| {name} | {pages} | {depth} | {plain:.1f} | {drafted:.1f} | {drafted / plain:.2f}x | {accepted} |")


if __name__ == "__main__":
    main()
