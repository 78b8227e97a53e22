"""End to end on the H200: the engine running a Qwen3-30B-A3B-shaped model at Q8_0 (random weights with
skewed routing, built in memory by `runtime.synthetic.realistic_weights`), under three plans:

  h200-141g           every expert resident: decode against the roofline (active bytes per token / measured
                      read bandwidth), and the Python overhead per step (wall time beside the replayed graph's);
  rtx-5070-ti-16g     emulated: the card's VRAM with the H200's other figures and measured links, its plan
  rtx-2060-super-8g   run on the H200 (the engine allocates only the plan's bytes): prefill against the streaming
                      floor (the expert bytes it copied / measured pinned bandwidth), decode against the floor its
                      measured expert-cache hit rate implies (hits at read bandwidth, misses read in place over the
                      link).

Beside each figure, the planner's prediction and its error. Commands (prefix from DEVICE.md):

    NUMBA_ENABLE_CUDASIM=0 python3 benchmarks/e2e.py --layers 6 [--plans h200-141g rtx-5070-ti-16g ...]

`--layers` keeps the card's shape but fewer blocks (every figure is per token and per block alike; the
weights take less time to build); an emulated card's usable VRAM shrinks in the same proportion.
"""

import argparse
import cProfile
import hashlib
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from runtime.ceilings import (kernel_launch_s, pinned_copy_bytes_per_s, read_bandwidth_bytes_per_s, time_s,
                                 zero_copy_read_bytes_per_s)
from codegen.lower.cuda import cuda, device_name, free_device_bytes
from planner.model import load_model
from planner.profile import load_profile
from planner.units import parse_bytes
from planner.workload import Workload
from plans import HARDWARE_DIR, MODELS_DIR
from planner.search import solve
from runtime.engine import Engine
from runtime.synthetic import CARD, realistic_weights, reduced_card

CONTEXT = 8192


def built_weights(layers: int, folder: Path, card_name: str = CARD) -> tuple:
    """(the card with `layers` blocks, its realistic weights): built once, loaded by every plan a run measures."""
    card = reduced_card(layers, folder, card_name)
    started = time.perf_counter()
    tensors = list(realistic_weights(card, seed=1, skew=1.0))
    print(f"weights built in {time.perf_counter() - started:.0f} s")
    return card, tensors


def emulated_profile(name: str, measured: dict, layers: int, folder: Path, card_name: str = CARD,
                     extra_bytes: int = 0) -> Path:
    """The card's VRAM on the H200: every other GPU figure the H200 profile's, with its links as measured in
    this run (so the plan is priced as it runs), and the usable VRAM scaled by layers / the card's trunk blocks
    (the card holds the same share of the trunk), plus extra_bytes (what does not shrink with the trunk)."""
    profile = yaml.safe_load((HARDWARE_DIR / f"{name}.yaml").read_text())
    h200 = yaml.safe_load((HARDWARE_DIR / "h200-141g.yaml").read_text())["gpus"][0]
    metadata = yaml.safe_load((MODELS_DIR / f"{card_name}.yaml").read_text())["metadata"]
    trunk_blocks = metadata["block_count"] - metadata.get("nextn_predict_layers", 0)
    for gpu in profile["gpus"]:
        gpu.update({field: value for field, value in h200.items() if field not in ("name", "vram", "reserved")})
        gpu.update(measured)
        vram, reserved = parse_bytes(gpu["vram"]), parse_bytes(gpu["reserved"])
        gpu["vram"] = f"{reserved + (vram - reserved) * layers // trunk_blocks + extra_bytes} B"
        gpu["reserved"] = f"{reserved} B"
    profile["name"] = f"{name}-on-h200-links-{layers}-blocks"
    path = folder / f"{profile['name']}.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def active_bytes(model) -> tuple:
    """(dense bytes a decode step reads, routed-expert bytes it reads): every dense matrix but the embedding
    table (one row), and k experts of every MoE block."""
    dense = sum(t.n_bytes for t in model.tensors
                if model.tensor_class[t.name] == "dense" and not t.name.startswith("token_embd"))
    blob = model.largest_expert_blob_bytes
    n_moe = sum(model.hparams.is_moe_layer(b) for b in range(model.hparams.n_trunk))
    return dense, n_moe * model.hparams.n_expert_used * blob


def nearest(rows: list, key: str, value: int) -> dict:
    return min(rows, key=lambda row: abs(row[key] - value))


def random_prompts(rng, vocab: int):
    """prompt(n): n random token ids."""
    return lambda n: rng.integers(0, vocab, size=n).tolist()


MEASURED_REQUESTS = (3, 25)   # a row's figures: the median of at least 3 requests, more (up to 25) until they
MEASURED_S = 1.0              # have taken a second: a tiny model's single requests vary 2x


def predicted(plan, prompt_tokens: int, new_tokens: int) -> tuple:
    """(the plan's prefill tok/s for a prompt of `prompt_tokens`, its decode row for a request that then makes
    `new_tokens`: the row at the request's mean depth, with the cache slots its K/V ring lends it)."""
    return (nearest(plan.predictions["prefill"], "prompt_tokens", prompt_tokens)["tok_s"],
            nearest(plan.predictions["decode"], "depth", prompt_tokens + new_tokens // 2))


def run_plan(name, profile, card, tensors, ceilings, prompt_tokens, new_tokens, rng, host_profile=0, histogram=None,
             context=CONTEXT, prompt=None):
    """One plan's engine: a warm-up request of the measured length (it binds that length's prefill programs,
    which a user's first prompt of a length pays once), then MEASURED_REQUESTS measured ones (at least
    MEASURED_S of them), each of fresh tokens: their median prefill and decode step. histogram: a traced expert popularity to plan with (the
    planner's hit-rate curve and the cache's first experts), else the default skew; prompt: prompt(n) gives n
    token ids (default random ids); without MTP (a model's drafter is validated apart)."""
    workload = Workload(prompts=((prompt_tokens, 1.0),), decode_tokens=new_tokens, histogram=histogram)
    plan = solve(profile, card, context=context, kv="f16", workload=workload, mtp=False)
    model = load_model(card)
    started = time.perf_counter()
    free_before = free_device_bytes()
    engine = Engine(plan, card, tensors=tensors)
    start_s = time.perf_counter() - started
    allocated = free_before - free_device_bytes()
    try:
        prompt = prompt or random_prompts(rng, model.hparams.n_vocab)
        engine.generate(prompt(prompt_tokens), 4)         # warm the host paths and this length's programs
        copied = engine.experts.stats.streamed_bytes
        profiler = cProfile.Profile() if host_profile else None
        if profiler:
            profiler.enable()
        outs, measuring = [], time.perf_counter()
        fewest, most = MEASURED_REQUESTS
        while len(outs) < fewest or (len(outs) < most and time.perf_counter() - measuring < MEASURED_S):
            outs.append(engine.generate(prompt(prompt_tokens), new_tokens))
        if profiler:
            profiler.disable()
            print(f"{name}: host time of the measured requests, top {host_profile} functions by own time")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(host_profile)
        stats = engine.stats()
        streamed = (stats["expert_bytes_copied"] - copied) / len(outs)
        prefill_s = float(np.median([out.prefill_s for out in outs]))
        step_s = float(np.median([out.decode_s / (len(out.tokens) - 1) for out in outs]))
        first_token_s = float(np.median([out.first_token_s for out in outs]))
        graph_s = time_s(lambda: engine.graphs["decode", 1].replay(engine.compute), repeats=20, warmup=2)
    finally:
        engine.close()
    dense, experts = active_bytes(model)
    hit = stats["expert_cache_hit_rate"]
    floor_decode_s = dense / ceilings["read"] + experts * (hit / ceilings["read"] + (1 - hit) / ceilings["zero_copy"])
    floor_prefill_s = streamed / ceilings["pinned"]
    predicted_prefill, decode_row = predicted(plan, prompt_tokens, new_tokens)
    predicted_decode = decode_row["tok_s_without_mtp"]
    prefill_tok_s, decode_tok_s = prompt_tokens / prefill_s, 1 / step_s
    return {
        "plan": name, "device GiB": plan.device_bytes(0) / 2 ** 30,
        "allocated - plan MiB": (allocated - plan.allocated_bytes(0)) / 2 ** 20, "start s": start_s,
        "cache slots": plan.knobs["expert_cache_slots"][0], "lent slots": stats["expert_slots_lent"],
        "ring slots": plan.knobs["prefill_ring_slots"],
        "chunk": plan.knobs["chunk_tokens"], "kv pages": plan.knobs["kv_pages"],
        "prefill tok/s": prefill_tok_s, "prefill floor": floor_prefill_s / prefill_s if streamed else None,
        "prefill predicted": predicted_prefill, "prefill error": predicted_prefill / prefill_tok_s - 1,
        "decode tok/s": decode_tok_s, "of floor": floor_decode_s / step_s, "hit rate": hit,
        "hit predicted": decode_row["expert_hit_rate"],
        "decode predicted": predicted_decode, "decode error": predicted_decode / decode_tok_s - 1,
        # the graph replayed alone repeats the last step's routing: only where every expert is cached, or none,
        # does its time stand for an average step's GPU time (with a partial cache the replay's hits differ
        # from the steps', and the share read -30% to +16% in validation run 17)
        "python overhead": 1 - graph_s / step_s if hit in (0.0, 1.0) else None, "first token s": first_token_s,
        # the same arguments draw the same prompts: two builds of the engine that compute the same bits print
        # the same digest
        "tokens digest": hashlib.sha256(np.asarray(outs[0].tokens, np.int64).tobytes()).hexdigest()[:12],
    }


PERCENT_COLUMNS = ("prefill floor", "of floor", "hit rate", "hit predicted", "prefill error", "decode error",
                   "python overhead")


def print_table(rows: list, percent: tuple = PERCENT_COLUMNS) -> None:
    """Rows (dicts of the same keys) as a markdown table; `percent`: the columns written as percentages (signed
    where the name says error)."""
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows:
        cells = []
        for key in columns:
            value = row[key]
            if value is None:
                cells.append("-")
            elif key in percent:
                cells.append(f"{value:+.0%}" if "error" in key else f"{value:.0%}")
            elif isinstance(value, float):
                cells.append(f"{value:.3g}" if value < 100 else f"{value:.0f}")
            else:
                cells.append(str(value))
        print("| " + " | ".join(cells) + " |")


def measure_links() -> tuple[dict, dict]:
    """(this GPU's ceilings, printed; the profile fields an emulated card takes from them)."""
    ceilings = {"read": read_bandwidth_bytes_per_s(), "pinned": pinned_copy_bytes_per_s(),
                "zero_copy": zero_copy_read_bytes_per_s(), "launch": kernel_launch_s()}
    print(f"{device_name()}: read {ceilings['read'] / 1e12:.2f} TB/s, pinned host->device "
          f"{ceilings['pinned'] / 1e9:.1f} GB/s, zero-copy read {ceilings['zero_copy'] / 1e9:.1f} GB/s, "
          f"a kernel launch from Python {ceilings['launch'] * 1e6:.1f} us")
    # kernel_launch is the host's: the H200 profile's figure, fitted to whole prompt chunks (copies and events
    # included); the bare launch measured above is printed beside it
    host_calls = load_profile("h200-141g").gpus[0].kernel_launch_s
    links = {"host_to_device": f"{ceilings['pinned'] / 1e9:.1f} GB/s",
             "zero_copy_read": f"{ceilings['zero_copy'] / 1e9:.1f} GB/s",
             "kernel_launch": f"{host_calls * 1e6:.1f} us"}
    return ceilings, links


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--plans", nargs="+", default=["h200-141g", "rtx-5070-ti-16g", "rtx-2060-super-8g"])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--card", default=CARD, help="the bundled model card whose shape and types are built "
                        f"(default {CARD}; e.g. qwen3-30b-a3b-q4_k_m: Q4_K with Q6_K where llama.cpp puts it)")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="profile the measured request's host time (cProfile) and print its top N functions")
    args = parser.parse_args()
    ceilings, measured_links = measure_links()
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        card, tensors = built_weights(args.layers, folder, args.card)
        for name in args.plans:
            profile = name if name == "h200-141g" else emulated_profile(name, measured_links, args.layers, folder,
                                                                        args.card)
            rows.append(run_plan(name, profile, card, tensors, ceilings, args.prompt_tokens, args.new_tokens, rng,
                                 args.host_profile))
            cuda.current_context().deallocations.clear()
            print_table(rows[-1:])
    print()
    print(f"{args.card} shape, {args.layers} blocks, prompt {args.prompt_tokens} tokens, {args.new_tokens} new, K/V f16")
    print_table(rows)


if __name__ == "__main__":
    main()
