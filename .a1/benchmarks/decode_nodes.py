"""Where a decode step's time goes: the resident plan's decode pass (Qwen3-30B-A3B's shape at Q8_0, as in
`benchmarks/e2e.py`) with an event between every two nodes, queued while a spinning kernel holds the GPU (so the
nodes run back to back, as in the replayed graph); each node's median time, its share of the step, and the
totals by kind of node. The step runs after a prompt, so attention reads that many positions.

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/decode_nodes.py --layers 6 --prompt-tokens 512 1984 16384

`--model demo` times the trained demo model's step instead, under budgets of `--demo-fractions` of its resident
plan's bytes (`benchmarks/validate.py`'s: 50% caches no expert, so every expert launch reads mapped host
memory; 100% caches them all): where a step that misses spends its time beyond one that hits.
"""

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.e2e import CONTEXT
from benchmarks.validate import DEMO_CONTEXT, demo_budgets
from codegen.lower.cuda import device_name
from planner.search import solve
from planner.workload import Workload
from plans import HARDWARE_DIR
from runtime.calibrate import node_times_s, replay_s
from runtime.ceilings import read_bandwidth_bytes_per_s
from runtime.engine import Engine
from runtime.synthetic import realistic_weights, reduced_card
from tools.demo import DEMO_PATH


def node_times_us(engine, repeats: int) -> tuple[list, np.ndarray, float]:
    """(steps, [repeats, nodes] microseconds, whole step's replay seconds without events)."""
    steps = engine._program("decode", 1).steps
    times = node_times_s(steps, engine.compute, repeats, 20000) * 1e6
    return steps, times, replay_s(steps, engine.compute, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("qwen-shape", "demo"), default="qwen-shape")
    parser.add_argument("--layers", type=int, default=6, help="blocks of the Qwen shape")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1984])
    parser.add_argument("--demo-fractions", type=float, nargs="+", default=[0.5, 1.0],
                        help="the demo's budgets, as fractions of its resident plan's bytes")
    parser.add_argument("--profile", default=str(HARDWARE_DIR / "h200-141g.yaml"), help="the profile the demo's budgets scale")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    read = read_bandwidth_bytes_per_s()
    print(f"{device_name()}: read {read / 1e12:.2f} TB/s")
    rng = np.random.default_rng(0)
    timed = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "demo":
            runs = [(label, solve(profile, DEMO_PATH, context=DEMO_CONTEXT, kv="f16", mtp=False), DEMO_PATH, None)
                    for label, profile in demo_budgets(Path(args.profile), Path(tmp), args.demo_fractions)]
        else:
            card = reduced_card(args.layers, Path(tmp))
            workload = Workload(prompts=tuple((tokens, 1.0) for tokens in args.prompt_tokens), decode_tokens=8)
            context = max(CONTEXT, max(args.prompt_tokens) + 1024)
            runs = [("resident", solve("h200-141g", card, context=context, kv="f16", workload=workload), card,
                     realistic_weights(card, seed=1, skew=1.0))]
        for label, plan, card, tensors in runs:
            with Engine(plan, card, tensors=tensors) as engine:
                graph = engine._program("decode", 1).graph
                label += f", {engine.experts.n_cache} cache slots"
                for tokens in args.prompt_tokens:       # each a fresh prompt: the step reads that many positions
                    engine.generate(rng.integers(0, engine.hp.n_vocab, size=tokens).tolist(), 2)
                    timed.append((label, graph, tokens, *node_times_us(engine, args.repeats)))
    for label, graph, tokens, steps, times, whole_s in timed:
        print_nodes(label, graph, tokens, steps, times, whole_s)


def print_nodes(label: str, graph, prompt_tokens: int, steps, times, whole_s: float) -> None:
    median = np.median(times, axis=0)
    total = median.sum()
    print(f"\n{label}: decode step after {prompt_tokens} tokens: {len(steps)} nodes, "
          f"{total:.1f} us with events between nodes, {whole_s * 1e6:.1f} us replayed without")
    print("| node | op | us | share |")
    print("| --- | --- | ---: | ---: |")
    by_op = defaultdict(float)
    for step, us in zip(steps, median):
        op = graph.nodes[step.name]["op"]
        by_op[op] += us
        if not step.name.startswith("blk.") or step.name.startswith("blk.0."):
            print(f"| {step.name} | {op} | {us:.1f} | {us / total:.1%} |")
    print("\n| op (every block) | us | share |")
    print("| --- | ---: | ---: |")
    for op, us in sorted(by_op.items(), key=lambda item: -item[1]):
        print(f"| {op} | {us:.1f} | {us / total:.1%} |")


if __name__ == "__main__":
    main()
