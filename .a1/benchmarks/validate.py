"""Estimate against reality (issue 6): the planner's predicted prefill and decode tok/s beside the measured ones,
and the device memory the engine took beside the plan's bytes, for a Qwen3-30B-A3B-shaped model at Q8_0
(random weights with skewed routing, `runtime.synthetic.realistic_weights`) under six memory budgets and three
prompt lengths, on this machine's GPU.

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/validate.py --profile detected.yaml [--layers 6] [--json out.json]

The profile is this machine's, as `stratum profile --detect` wrote it (its links and kernel calibration); each
budget is that profile with less VRAM, scaled by layers / 48 as `benchmarks/e2e.py` does, so a budget holds
the same share of the model as the full card would. "allocated - plan" is what the engine's start took from
the device beyond the plan's bytes, its arena and the page tables that map its pinned host copies (the CUDA
context is taken before it: 0 means exactly the plan).

First a resident engine serves a set of prompts and traces their routing (`Engine.trace`); every plan is then
solved from that trace's histogram (its hit-rate curve, and the experts its cache starts with) and measured on
other prompts, so "hit predicted" beside "hit rate" is a trace's prediction tested on a different prompt set.
`--no-trace` plans with the default Zipf skew instead.

`--model demo` validates the trained demo model (`plans/demo`, its own weights) instead: six budgets that hold
50% to 100% of the bytes its resident plan takes, prompts of held-out Python source, a trace of held-out
source too (other offsets). Plans are without MTP here (the drafter's decode is `benchmarks/mtp.py`'s).
"""

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import yaml

from benchmarks.e2e import CONTEXT, built_weights, measure_links, print_table, random_prompts, run_plan
from codegen.cost import weights_in_l2
from codegen.lower.cuda import cuda
from planner.model import load_model
from planner.profile import load_profile
from planner.search import solve
from planner.units import parse_bytes
from planner.workload import Workload
from runtime.calibrate import by_family, timed_nodes
from runtime.engine import Engine
from runtime.synthetic import CARD
from tools.demo import DEMO_PATH, library_files, read_files

BUDGETS_GB = (8, 12, 16, 24, 48, 141)
PROMPTS = (512, 2048, 4096)
# the demo model: budgets as fractions of its resident plan's bytes (no cache at 50%, every expert at 100%),
# prompts within the 1024 positions it was trained on
DEMO_FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DEMO_PROMPTS = (256, 512, 768)
DEMO_CONTEXT = 1024
TRUNK_BLOCKS = 48


def budget_profile(detected: Path, budget_gb: int, layers: int, folder: Path) -> Path:
    """The detected profile with `budget_gb` of VRAM (the whole card's), its usable part scaled to `layers` of
    the 48 blocks; 141 GB and above: the detected card as it is."""
    document = yaml.safe_load(detected.read_text())
    for gpu in document["gpus"]:
        reserved, vram = parse_bytes(gpu["reserved"]), parse_bytes(gpu["vram"])
        if budget_gb < 141:
            usable = min(vram, budget_gb * 10 ** 9) - reserved
            gpu["vram"] = f"{reserved + usable * layers // TRUNK_BLOCKS} B"
    document["name"] = f"{document.get('name', 'detected')}-{budget_gb}gb-{layers}-blocks"
    path = folder / f"{document['name']}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def demo_budgets(detected: Path, folder: Path, fractions=DEMO_FRACTIONS) -> list:
    """(label, profile) for the demo model: the detected card with VRAM for `fractions` of the bytes its
    resident plan takes (the demo is 25 MB: the cards' budgets would all hold it whole)."""
    resident = solve(detected, DEMO_PATH, context=DEMO_CONTEXT, kv="f16", mtp=False).device_bytes(0)
    document = yaml.safe_load(detected.read_text())
    budgets = []
    for fraction in fractions:
        for gpu in document["gpus"]:
            gpu["vram"] = f"{parse_bytes(gpu['reserved']) + int(fraction * resident)} B"
        document["name"] = f"{detected.stem}-demo-{fraction:.0%}"
        path = folder / f"{document['name']}.yaml"
        path.write_text(yaml.safe_dump(document))
        budgets.append((f"{fraction * resident / 2 ** 20:.1f} MiB ({fraction:.0%})", path))
    return budgets


def text_prompts(rng):
    """prompt(n): n bytes of held-out Python source (the demo model's vocabulary), from a random offset."""
    corpus = read_files(library_files()[1])
    return lambda n: list(corpus[(start := int(rng.integers(0, len(corpus) - n))):start + n])


def traced_histogram(profile: Path, card: Path, tensors, prompts: int, new_tokens: int, prompt, tokens: int,
                     context: int, lengths) -> tuple:
    """(the routing counts of `prompts` prompts of `tokens` tokens (from `prompt(n)`) served by a resident
    engine planned for the longest of `lengths`, `compare_passes`'s (text, samples) on that engine)."""
    workload = Workload(prompts=((max(lengths), 1.0),), decode_tokens=new_tokens)
    plan = solve(profile, card, context=context, kv="f16", workload=workload, mtp=False)
    with Engine(plan, card, tensors=tensors, progress=False) as engine:
        for _ in range(prompts):
            engine.generate(prompt(tokens), new_tokens)
        counts = engine.trace()["expert_popularity"]["histogram"]
        comparison = compare_passes(engine, profile, prompt, lengths)
    cuda.current_context().deallocations.clear()
    print(f"traced {prompts} prompts of {tokens} tokens: {np.sum(counts):.0f} routings")
    return tuple(map(tuple, counts)), comparison


def compare_passes(engine, profile: Path, prompt, lengths) -> tuple[str, list]:
    """The engine's prefill of one chunk of each of `lengths` (those within its chunk), and a decode step after
    it, against the profile's calibration, node family by family (GPU time between events; decode's less the
    events' own cost), and the prefill's wall time: where the prediction of a resident pass parts from it.
    Printed, and returned as (text, every timed node as a `runtime.calibration_fit.Sample` dict with its pass and
    tokens): the summary repeats the text, `--json` keeps the nodes, so a model's fits can be redone offline
    on this model's kernels too."""
    gpu = load_profile(profile).gpus[0]
    in_l2 = weights_in_l2(engine.model, range(engine.hp.n_trunk), gpu)     # as the planner prices its passes
    lines, nodes = [], []
    for tokens in sorted(n for n in lengths if n <= engine.chunk_tokens):
        for kind in ("prefill", "decode"):
            # each pass timed right after requests that ran it: passes share the arena, so another pass's
            # activations would overwrite its inputs
            for _ in range(2):
                out = engine.generate(prompt(tokens), 2)
            timed = timed_nodes(engine, gpu, kind, tokens if kind == "prefill" else 1, tokens,
                                in_l2=in_l2)
            nodes += [{"pass": kind, "tokens": tokens, **sample._asdict()} for sample in timed]
            what = (f"prefill of {tokens} tokens (one chunk), resident: {out.prefill_s * 1e3:.1f} ms wall"
                    if kind == "prefill" else f"a decode step after {tokens} tokens")
            lines += [f"{what}, nodes' GPU time {sum(t.measured_s for t in timed) * 1e3:.3f} ms", "",
                      "| family | measured ms | calibration ms |", "| --- | ---: | ---: |"]
            lines += [f"| {family} | {measured * 1e3:.3f} | {fitted * 1e3:.3f} |"
                      for family, (measured, fitted) in sorted(by_family(timed, gpu.kernels).items())]
            lines.append("")
    text = "\n".join(lines)
    print(text)
    return text, nodes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="this machine's profile (stratum profile --detect)")
    parser.add_argument("--model", choices=("qwen-shape", "demo"), default="qwen-shape",
                        help="the Qwen3-30B-A3B shape (random weights, --layers blocks, random prompts) or the "
                        "trained demo model (its own weights, held-out Python source as prompts)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--card", default=CARD, help=f"the Qwen shape's bundled model card, its types (default "
                        f"{CARD}; e.g. qwen3-30b-a3b-q4_k_m)")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS_GB), help="GB (the Qwen shape)")
    parser.add_argument("--prompts", type=int, nargs="+", help=f"prompt tokens (default {PROMPTS}, the demo "
                        f"{DEMO_PROMPTS})")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--trace-prompts", type=int, default=4, help="prompts of 1024 tokens the trace serves")
    parser.add_argument("--no-trace", action="store_true", help="plan with the default skew, not a trace")
    parser.add_argument("--json", help="also write the rows here, after each row (beside them: the trace's "
                        "histogram, .trace.json, and the resident passes' timed nodes, .nodes.json)")
    args = parser.parse_args()
    ceilings, _ = measure_links()
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.model == "demo":
            card, tensors, context, prompt, trace_tokens = DEMO_PATH, None, DEMO_CONTEXT, text_prompts(rng), 256
            budgets = demo_budgets(Path(args.profile), folder)
            resident = budgets[-1][1]
            lengths = args.prompts or DEMO_PROMPTS
            what = f"the demo model ({DEMO_PATH.name}), held-out Python source as prompts"
        else:
            card, tensors = built_weights(args.layers, folder, args.card)
            context, prompt, trace_tokens = CONTEXT, random_prompts(rng, load_model(card).hparams.n_vocab), 1024
            budgets = [(f"{gb} GB", budget_profile(Path(args.profile), gb, args.layers, folder)) for gb in args.budgets]
            resident = budget_profile(Path(args.profile), 141, args.layers, folder)
            lengths = args.prompts or PROMPTS
            what = f"{args.card} shape, {args.layers} blocks, random prompts"
        histogram, (comparison, nodes) = (None, (None, [])) if args.no_trace else traced_histogram(
            resident, card, tensors, args.trace_prompts, args.new_tokens, prompt, trace_tokens, context, lengths)
        if args.json:
            write_beside(Path(args.json), histogram, nodes)
        for label, profile in budgets:
            for tokens in lengths:
                row = run_plan(label, profile, card, tensors, ceilings, tokens, args.new_tokens, rng,
                               histogram=histogram, context=context, prompt=prompt)
                rows.append({"budget": label, "prompt": tokens, **{k: v for k, v in row.items() if k != "plan"}})
                cuda.current_context().deallocations.clear()
                print_table(rows[-1:])
                if args.json:       # after every row: a run cut off by a time limit keeps what it measured
                    Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\n{what}, context {context}, {args.new_tokens} new tokens, K/V f16, profile {args.profile}")
    print_table(rows)
    if comparison:
        print(f"\n{comparison}\n")
    errors = [abs(row[key]) for row in rows for key in ("prefill error", "decode error")]
    hits = [(row["hit predicted"], row["hit rate"]) for row in rows if 0 < row["hit predicted"] < 1]
    if hits:
        print(f"hit rate with a partial cache: predicted {', '.join(f'{p:.0%}' for p, _ in hits)}; measured "
              f"{', '.join(f'{m:.0%}' for _, m in hits)}")
    print(f"\npredictions within 10%: {sum(e <= 0.10 for e in errors)} of {len(errors)}; median error "
          f"{np.median(errors):.0%}, worst {max(errors):.0%}; allocation beyond the plan: "
          f"{max(row['allocated - plan MiB'] for row in rows):+.0f} MiB at most")


def write_beside(path: Path, histogram, nodes) -> None:
    """Beside the rows' JSON: the trace the plans are solved from (`.trace.json`: they can be re-planned
    offline) and the resident passes' timed nodes (`.nodes.json`: this model's own calibration samples)."""
    if histogram is not None:
        path.with_suffix(".trace.json").write_text(json.dumps({"expert_popularity": {"histogram": histogram}}))
    if nodes:
        path.with_suffix(".nodes.json").write_text(json.dumps(nodes, indent=1))


if __name__ == "__main__":
    main()
