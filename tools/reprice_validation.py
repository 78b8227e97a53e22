"""A validation run's rows priced again by the planner as it is now, offline (no GPU): each row's plan solved from
its budget's profile with the row's knobs pinned (chunk, prefill-ring slots, and the K/V pages where the row
records them), beside what the run measured. A cost-model change is checked against a run's measurements this
way before a GPU run validates it (BENCHMARKS.md, validation runs 18 and 19).

    python3 -m tools.reprice_validation benchmarks/results/validate-2026-12-02-demo-run19.json --demo \\
        --profile benchmarks/results/h200-detected-2026-12-02-run19.yaml

The profile is the run's detected one (the budgets are made from it as `benchmarks/validate.py` makes them);
the rows' trace (`RUN.trace.json` beside the run, when there is one) plans the cache and prices the routed
experts' tiles as the run did (without it the default skew does, and partial-cache rows part from the run's).
A row whose layout the planner no longer gives (another cache size) is marked, not repriced.
"""

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.e2e import CONTEXT, predicted, print_table
from benchmarks.validate import DEMO_CONTEXT, budget_profile, demo_budgets
from planner.errors import StratumError
from planner.search import solve
from planner.workload import Workload
from runtime.synthetic import reduced_card
from tools.demo import DEMO_PATH


def repriced(row: dict, profile: Path, card: Path, context: int, new_tokens: int, histogram) -> dict:
    """The row's measured and repriced tok/s, or why its layout could not be rebuilt."""
    pins = {"chunk_tokens": row["chunk"], "ring_slots": row["ring slots"]}
    if "kv pages" in row:
        pins["kv_pages"] = row["kv pages"]
    out = {"budget": row["budget"], "prompt": row["prompt"], "cache slots": row["cache slots"]}
    workload = Workload(prompts=((row["prompt"], 1.0),), decode_tokens=new_tokens, histogram=histogram)
    try:
        plan = solve(profile, card, context=context, kv="f16", workload=workload, mtp=False, pins=pins)
    except StratumError as error:
        return {**out, "layout": f"refused: {error}"}
    if plan.knobs["expert_cache_slots"][0] != row["cache slots"]:
        return {**out, "layout": f"{plan.knobs['expert_cache_slots'][0]} cache slots now"}
    prefill_tok_s, decode = predicted(plan, row["prompt"], new_tokens)
    return {**out, "layout": "the run's",
            "prefill tok/s": row["prefill tok/s"], "repriced": prefill_tok_s,
            "prefill error": prefill_tok_s / row["prefill tok/s"] - 1,
            "decode tok/s": row["decode tok/s"], "repriced decode": decode["tok_s_without_mtp"],
            "decode error": decode["tok_s_without_mtp"] / row["decode tok/s"] - 1}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a benchmarks/validate.py --json file")
    parser.add_argument("--profile", required=True, help="the run's detected profile")
    parser.add_argument("--demo", action="store_true", help="the run is of the demo model (--model demo)")
    parser.add_argument("--layers", type=int, default=6, help="the Qwen shape's blocks in the run")
    parser.add_argument("--new-tokens", type=int, default=32, help="the run's --new-tokens")
    args = parser.parse_args()
    run = Path(args.run)
    rows = json.loads(run.read_text())
    trace = run.with_suffix(".trace.json")
    histogram = (tuple(map(tuple, json.loads(trace.read_text())["expert_popularity"]["histogram"]))
                 if trace.exists() else None)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.demo:
            card, context, profiles = DEMO_PATH, DEMO_CONTEXT, dict(demo_budgets(Path(args.profile), folder))
        else:
            card, context = reduced_card(args.layers, folder), CONTEXT
            profiles = {row["budget"]: budget_profile(Path(args.profile), int(row["budget"].split()[0]),
                                                      args.layers, folder) for row in rows}
        out = [repriced(row, profiles[row["budget"]], card, context, args.new_tokens, histogram) for row in rows]
    priced = [row for row in out if "repriced" in row]
    if len(priced) < len(out):
        print_table([{"budget": row["budget"], "prompt": row["prompt"], "layout": row["layout"]}
                     for row in out if row not in priced])
    if histogram is None:
        print(f"no {trace.name}: the default skew prices the cache's hit rate and the routed experts' tiles, not the "
              "run's routing")
    if priced:
        print_table(priced)
        errors = [abs(row[key]) for row in priced for key in ("prefill error", "decode error")]
        print(f"\n{len(priced)} of {len(rows)} rows repriced (trace: {'yes' if histogram else 'none'}): "
              f"within 10% {sum(e <= 0.10 for e in errors)} of {len(errors)}, median {np.median(errors):.0%}, "
              f"worst {max(errors):.0%}")


if __name__ == "__main__":
    main()
