"""A sweep that cannot fail silently (issue 6): random plans (memory budget, context, K/V type, MTP on or off,
chunk size) for one small glm4moe with a NextN drafter, each run for a short prompt and a few decode steps. Every
run must start (no out-of-memory), take no device memory beyond its plan, and give bitwise the logits of the
reference layout (every expert resident, chunk 16, MTP off) of its K/V type: DESIGN.md's promise that a plan
changes speed, never results (an MTP plan drafts at a drawn depth 1-4, and must still give those logits). A
budget the planner refuses is counted apart (a refusal names what does not fit; it is not a failure).

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/sweep.py --plans 100 [--kv f16 q8_0] [--log sweep.txt]

Each run's line is printed (and appended to --log) as it ends, so a cut-off sweep keeps what it did.
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from codegen.lower.cuda import SIMULATOR, cuda, device_name
from planner.errors import DoesNotFit
from planner.search import solve
from runtime.engine import Engine
from runtime.synthetic import write_model

KV_TYPES = ("f16", "q8_0", "q4_0", "k8v4")
CONTEXTS = (128, 256, 512)
CHUNKS = (8, 16, 32, 64)
PROMPT_TOKENS = 40
NEW_TOKENS = 4
MAX_DRAFT_DEPTH = 4     # drafted depths 1..this on MTP plans
RESIDENT_KIB = 64 * 1024      # the references: every expert resident


def small_model(folder: Path) -> Path:
    """A glm4moe with a NextN drafter: 256 wide on a GPU; the simulator (a smoke run) gets one of test size."""
    if SIMULATOR:
        return write_model(folder / "sweep.gguf", "glm4moe", seed=21, n_trunk=1, n_leading_dense=0, n_vocab=64,
                           n_head=2, n_head_kv=1, n_expert=4)
    return write_model(folder / "sweep.gguf", "glm4moe", seed=21, n_trunk=2, n_leading_dense=1, n_embd=256,
                       n_head=4, n_head_kv=2, head_dim=64, n_rot=32, n_ff=512, n_ff_exp=128, n_expert=16,
                       n_expert_used=4, n_vocab=512, types={"experts": "q8_0", "dense": "q8_0"})


def profile(folder: Path, vram_kib: int) -> Path:
    """A GPU of `vram_kib` whose other figures are the H200's order of magnitude; kernel launches priced at 0,
    so the tiny model's layout follows its bytes, and no host page tables (its pinned copies, KiB, fit in the
    piece a CUDA context starts with: run 25)."""
    path = folder / f"sweep-{vram_kib}.yaml"
    path.write_text(f"""name: sweep-{vram_kib}
gpus:
  - name: sweep GPU
    vram: {vram_kib} KiB
    sms: 132
    reserved: 64 KiB
    memory_bandwidth: 4000 GB/s
    fp32: 50 TFLOPS
    host_to_device: 50 GB/s
    device_to_host: 50 GB/s
    kernel_launch: 0 us
    host_page_table_entry: 0 B
host:
  ram: 4 GiB
  pinned_budget: 2 GiB
""")
    return path


def run(plan, model, prompt, draft_depth: int = 0) -> dict:
    """One plan's engine: device memory it took beyond the plan, and its logits for the prompt and new tokens
    (drafted at `draft_depth`: 0 off)."""
    free_before = None if SIMULATOR else cuda.current_context().get_memory_info()[0]
    with Engine(plan, model, progress=False) as engine:
        taken = None if SIMULATOR else free_before - cuda.current_context().get_memory_info()[0]
        out = engine.generate(prompt, max_new_tokens=NEW_TOKENS, return_logits=True, draft_depth=draft_depth)
        lent = engine.stats()["expert_slots_lent"]
    if not SIMULATOR:
        cuda.current_context().deallocations.clear()
    return {"beyond_plan": None if taken is None else taken - plan.allocated_bytes(0), "logits": out.logits,
            "tokens": out.tokens, "lent": lent}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", type=int, default=100, help="plans to run (refusals not counted)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--kv", nargs="+", default=list(KV_TYPES), help=f"K/V types to draw from (default {KV_TYPES})")
    parser.add_argument("--log", help="append each run's line here as it ends")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    log = open(args.log, "a") if args.log else None

    def say(line: str) -> None:
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    say(f"{device_name()}: {args.plans} plans, seed {args.seed}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = small_model(folder)
        prompt = rng.integers(0, 64, size=PROMPT_TOKENS).tolist()
        references = {}
        for kv in args.kv:
            plan = solve(profile(folder, RESIDENT_KIB), model, context=max(CONTEXTS), kv=kv, mtp=False,
                         pins={"chunk_tokens": 16})
            references[kv] = run(plan, model, prompt)
            resident_kib = plan.device_bytes(0) // 1024
            say(f"reference {kv}: tokens {references[kv]['tokens']}")
        ran, refused, failures, worst_beyond, lending = 0, 0, [], 0, 0
        started = time.perf_counter()
        while ran < args.plans and ran + refused < 4 * args.plans:
            kv, context = str(rng.choice(args.kv)), int(rng.choice(CONTEXTS))
            mtp, chunk = bool(rng.integers(2)), int(rng.choice(CHUNKS))
            # from well below the dense floor (refused) to every expert and the drafter resident
            vram_kib = int(rng.integers(resident_kib // 4, resident_kib * 2)) + 64
            what = f"{vram_kib} KiB, context {context}, kv {kv}, mtp {'on' if mtp else 'off'}, chunk {chunk}"
            try:
                plan = solve(profile(folder, vram_kib), model, context=context, kv=kv, mtp=mtp,
                             pins={"chunk_tokens": chunk})
            except DoesNotFit as refusal:
                refused += 1
                say(f"refused  {what}: {str(refusal).splitlines()[0][:100]}")
                continue
            ran += 1
            knobs = plan.knobs
            # an MTP plan drafts at a drawn depth, whatever the planner chose (it predicts that drafting rarely
            # pays for this model), so the sweep exercises drafting, not only the drafter's regions
            depth = int(rng.integers(1, MAX_DRAFT_DEPTH + 1)) if mtp else 0
            layout = (f"cache {knobs['expert_cache_slots'][0]}, ring {knobs['prefill_ring_slots']}, "
                      f"kv pages {knobs['kv_pages']}, depth {depth} (plan's {knobs['draft_depth']})")
            try:
                result = run(plan, model, prompt, depth)
            except Exception as error:      # an OOM or any failure: the sweep's point is to see it
                failures.append(f"{what}: {type(error).__name__}: {error}")
                say(f"FAILED   {what} ({layout}): {type(error).__name__}: {str(error)[:200]}")
                continue
            reference = references[kv]
            same = result["tokens"] == reference["tokens"] and np.array_equal(result["logits"], reference["logits"])
            beyond = result["beyond_plan"]
            worst_beyond = max(worst_beyond, beyond or 0)
            if not same:
                failures.append(f"{what}: logits differ from the reference layout's")
            lending += result["lent"] > 0
            say(f"{'ok' if same else 'DIFFERS'}       {what} ({layout}, {result['lent']} cache slots lent by the "
                f"K/V ring): device beyond the plan {'-' if beyond is None else f'{beyond / 2**20:.1f} MiB'}")
    say(f"\n{ran} plans ran ({lending} with K/V pages lent to the cache), {refused} budgets refused by the planner, "
        f"{len(failures)} failures, device memory beyond a plan at most {worst_beyond / 2**20:.1f} MiB, "
        f"{time.perf_counter() - started:.0f} s")
    for failure in failures:
        say(f"  {failure}")
    if log:
        log.close()
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
