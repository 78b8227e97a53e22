"""From a solved layout to a Plan: regions, predictions, what binds, and why each knob has its value.

The explanations are counterfactuals priced by the same cost model: each knob moved one step either way
(the expert cache taking up or giving back the difference) and what that would cost or gain.
"""

import numpy as np

from planner import __version__
from planner.kv_lending import needed_pages
from planner.layout import REGION_PURPOSE, host_page_table_bytes
from planner.plan import Plan
from planner.search import (MIN_RING_SLOTS, Knobs, Problem, chunk_candidates, decode_per_draft_depth, feasible_cache,
                           pinned_host_bytes, prefill_s, regions, request_s)
from planner.units import format_bytes, format_rate

STANDARD_PROMPT_TOKENS = (512, 4096, 16384)
STANDARD_DEPTHS = (1024, 4096, 16384, 32768, 131072)


def assemble(problem: Problem, knobs: Knobs) -> Plan:
    model, profile, wl = problem.model, problem.profile, problem.workload
    layout = regions(problem, knobs)
    pinned = pinned_host_bytes(problem, knobs)
    devices = []
    for i, share in enumerate(problem.shares):
        own = [r for r in layout if r.device == i]
        page_tables = int(host_page_table_bytes(share.gpu, sum(pinned[i].values())))
        used = max(r.end for r in own) + page_tables
        devices.append({
            "index": i, "gpu": share.gpu.name, "vram_bytes": share.gpu.vram_bytes,
            "reserved_bytes": share.gpu.reserved_bytes, "usable_bytes": share.gpu.usable_bytes,
            "host_page_tables_bytes": page_tables, "used_bytes": used, "free_bytes": share.gpu.usable_bytes - used,
            "blocks": [share.blocks[0], share.blocks[-1] + 1], "holds_drafter": share.last and problem.mtp,
            "regions": [{"name": r.name, "offset": r.offset, "bytes": r.bytes, "purpose": REGION_PURPOSE[r.name]}
                        for r in own]})
    plan_knobs = {
        "chunk_tokens": knobs.chunk_tokens, "page_tokens": problem.page_tokens, "kv_pages": knobs.kv_pages,
        "kv_resident_tokens": int(problem.resident_tokens(knobs.kv_pages)),
        "expert_cache_slots": list(knobs.cache_slots), "prefill_ring_slots": knobs.ring_slots,
        "slot_bytes": problem.slot_bytes, "draft_depth": knobs.draft_depth,
        "drafter_window_tokens": knobs.drafter_window_tokens,
        "drafter_kv_pages": problem.drafter_pages,
        "room_slots": problem.room_slots, "room_min_read_tokens": knobs.room_min_read_tokens,
        "cache_policy": "frequency"}
    return Plan(
        model={"name": model.name, "fingerprint": model.fingerprint, "summary": model.summary},
        profile={"name": profile.name, "fingerprint": profile.fingerprint},
        settings={"context_tokens": problem.context_tokens, "kv": problem.kv.name, "mtp": problem.mtp,
                  "stratum": __version__,
                  "workload": {"prompts": [{"tokens": t, "weight": w} for t, w in wl.prompts],
                               "decode_tokens": wl.decode_tokens, "reused_prefix": wl.reused_prefix,
                               "draft_acceptance": wl.draft_acceptance, "drafter_window": wl.drafter_window,
                               "expert_popularity": {"skew": wl.skew} if wl.histogram is None else
                               {"histogram": np.asarray(wl.histogram).tolist()}},
                  "host_pinned_bytes": {part: sum(device[part] for device in pinned) for part in pinned[0]}},
        devices=devices, knobs=plan_knobs, predictions=predictions(problem, knobs),
        binding=binding(problem, knobs, devices), explanations=explanations(problem, knobs, devices))


def _sig(x: float) -> float:
    """Four significant digits: predictions are estimates, and plans must be stable text."""
    return float(f"{float(x):.4g}")


def _prefill_with_rule(problem: Problem, knobs: Knobs, read: int, start: int) -> tuple[float, bool]:
    room = knobs.room_min_read_tokens is not None and read >= knobs.room_min_read_tokens
    seconds = prefill_s(problem, read, start, knobs.chunk_tokens, knobs.kv_pages, knobs.ring_slots,
                        list(knobs.cache_slots), room=room)
    return float(seconds) + (problem.room_reclaim_s if room else 0.0), room


def predictions(problem: Problem, knobs: Knobs) -> dict:
    wl = problem.workload
    longest = problem.context_tokens - wl.decode_tokens
    prompts = sorted({t for t, _ in wl.prompts} | {t for t in STANDARD_PROMPT_TOKENS if t <= longest})
    prefill = []
    for tokens in prompts:
        read = wl.read_tokens(tokens)
        seconds, room = _prefill_with_rule(problem, knobs, read, tokens - read)
        prefill.append({"prompt_tokens": tokens, "read_tokens": read, "seconds": _sig(seconds),
                        "tok_s": _sig(read / seconds), "room_open": room})
    # the standard depths, the context, and the workload's own requests (the depth their decode steps average)
    depths = sorted({d for d in STANDARD_DEPTHS if d <= problem.context_tokens} | {problem.context_tokens}
                    | {min(t + wl.decode_tokens // 2, problem.context_tokens) for t, _ in wl.prompts})
    decode = []
    for depth in depths:
        per_depth = [float(t) for t in decode_per_draft_depth(problem, depth, knobs.kv_pages,
                                                              list(knobs.cache_slots))]
        row = {"depth": depth, "tok_s": _sig(1.0 / per_depth[knobs.draft_depth]),
               "tok_s_without_mtp": _sig(1.0 / per_depth[0]),
               "best_draft_depth": min(range(len(per_depth)), key=per_depth.__getitem__),
               "expert_cache_slots": [int(s) for s in problem.decode_cache_slots(knobs.kv_pages,
                                                                                 list(knobs.cache_slots), depth)],
               "expert_hit_rate": _sig(hit_rate(problem, knobs, depth))}
        decode.append(row)
    objective = request_s(problem, knobs.chunk_tokens, knobs.kv_pages, knobs.ring_slots, list(knobs.cache_slots),
                          knobs.draft_depth)
    result = {"prefill": prefill, "decode": decode, "expert_hit_rate": _sig(hit_rate(problem, knobs)),
              "request_seconds": _sig(objective)}
    unrated = unrated_decode_types(problem)
    if unrated:
        result["unrated_decode_types"] = unrated
    return result


def unrated_decode_types(problem: Problem) -> list[str]:
    """The model's matrix types, beyond F32 and Q8_0 (what the decode families are calibrated on), that some GPU
    of the plan has no measured decode rate for (`GPU.decode_weight_rates`): its decode is priced as if they read
    at Q8_0's rate, which 4-bit types do not (BENCHMARKS.md, run 46)."""
    return sorted(name for name in problem.model.matrix_type_names - {"F32", "Q8_0"}
                  if any(name not in dict(share.gpu.decode_weight_rates) for share in problem.shares))


def hit_rate(problem: Problem, knobs: Knobs, depth: int | None = None) -> float:
    """Share of a decode step's routed-expert bytes found in the cache: the plan's slots, or at `depth` with
    the slots the K/V ring lends a request of that depth too."""
    total = sum(c.step_expert_bytes for c in problem.costs)
    slots = knobs.cache_slots if depth is None else problem.decode_cache_slots(knobs.kv_pages, list(knobs.cache_slots),
                                                                               depth)
    miss = sum(float(c.step_miss_bytes.total(s)) for c, s in zip(problem.costs, slots))
    return 1.0 - miss / total if total else 1.0


def binding(problem: Problem, knobs: Knobs, devices: list) -> list[str]:
    lines = []
    for device, cost, slots in zip(devices, problem.costs, knobs.cache_slots):
        if slots >= problem.cache_slots_max(device["index"]):
            lines.append(f"GPU {device['index']}: every routed expert is cached; VRAM does not bind "
                         f"({format_bytes(device['free_bytes'])} left free)")
        else:
            lines.append(f"GPU {device['index']}: VRAM binds: the expert cache takes the last "
                         f"{format_bytes(slots * problem.slot_bytes)} ({slots} slots of "
                         f"{len(cost.moe_blocks) * problem.model.hparams.n_expert}); each prefill-ring slot, "
                         f"{format_bytes(problem.slot_bytes)} of K/V ring or of arena costs one cache slot")
    gpu = problem.shares[0].gpu
    rate = hit_rate(problem, knobs)
    lines.append(f"decode: {rate:.1%} of routed-expert bytes hit the cache; misses read host memory at "
                 f"{format_rate(gpu.zero_copy_read_bytes_per_s)} against {format_rate(gpu.memory_bandwidth_bytes_per_s)} "
                 "from VRAM")
    longest = max(t for t, _ in problem.workload.prompts)
    read = problem.workload.read_tokens(longest)
    chunk = min(knobs.chunk_tokens, read)
    streamed = sum(float(c.window_tables(chunk)[0].total(s)) for c, s in zip(problem.costs, knobs.cache_slots))
    copy_s = sum(float(c.window_tables(chunk)[0].total(s)) / c.gpu.host_to_device_bytes_per_s
                 for c, s in zip(problem.costs, knobs.cache_slots))
    whole = float(prefill_s(problem, chunk, 0, knobs.chunk_tokens, knobs.kv_pages, knobs.ring_slots,
                            list(knobs.cache_slots), room=False))
    bound = "the host link" if copy_s >= 0.5 * whole else "compute"
    lines.append(f"prefill: a {chunk}-token chunk streams {format_bytes(streamed)} of experts over the GPUs' "
                 f"host links ({copy_s * 1e3:.1f} ms of copying) in a "
                 f"{whole * 1e3:.1f} ms chunk: bound by {bound}")
    return lines


def _objective(problem: Problem, knobs: Knobs, **changes) -> float | None:
    """The request time with some knobs changed and the cache refilled from what is left; None: no fit."""
    chunk = changes.get("chunk_tokens", knobs.chunk_tokens)
    pages = changes.get("kv_pages", knobs.kv_pages)
    ring = changes.get("ring_slots", knobs.ring_slots)
    if pages < problem.min_pages(chunk) or pages > problem.full_pages or ring < MIN_RING_SLOTS:
        return None
    cache = feasible_cache(problem, chunk, np.array(pages), np.array(ring), problem.arena_bytes(chunk))
    if any(int(c) < 0 for c in cache):
        return None
    return float(request_s(problem, chunk, pages, ring, [int(c) for c in cache]))


def _lending_note(problem: Problem, knobs: Knobs) -> str:
    """Which of the K/V ring's pages hold K/V and which are lent to the expert cache, at the standard depths."""
    if all(s >= problem.cache_slots_max(i) for i, s in enumerate(knobs.cache_slots)):
        return "Every routed expert is cached: no K/V page is lent to the cache"
    rows = []
    for depth in sorted({d for d in STANDARD_DEPTHS if d <= problem.context_tokens} | {problem.context_tokens}):
        request = int(problem.request_tokens(depth))
        kept = min(int(needed_pages(request, problem.page_tokens)), knobs.kv_pages)
        lent = sum(int(s) for s in problem.decode_cache_slots(knobs.kv_pages, [0] * len(problem.shares), depth))
        if kept == knobs.kv_pages:
            rows.append(f"a request of {request} positions (decode at depth {depth}) stores all {kept} pages: none lent")
            continue
        rows.append(f"a request of {request} positions (decode at depth {depth}) stores pages 0-{kept - 1}; pages "
                    f"{kept}-{knobs.kv_pages - 1} of every layer serve as {lent} expert-cache slots "
                    f"({format_bytes(lent * problem.slot_bytes)}), hit rate {hit_rate(problem, knobs, depth):.1%} "
                    f"against {hit_rate(problem, knobs):.1%} with the plan's slots alone")
    return ("A request lends the pages it cannot reach to decode's expert cache, in place (the "
            "expert slots wholly inside each layer's unreached K and V pages): " + "; ".join(rows))


def _versus(base: float, other: float | None, what: str) -> str:
    if other is None:
        return f"{what} would not fit (or is below the minimum)"
    change = (other - base) / base
    return f"{what} would make a request {abs(change):.1%} {'slower' if change >= 0 else 'faster'}"


def explanations(problem: Problem, knobs: Knobs, plan_devices: list) -> dict:
    base = _objective(problem, knobs)
    notes = {}
    chunks = sorted(set(chunk_candidates(problem)) | {knobs.chunk_tokens})    # a pinned chunk may be off the grid
    i = chunks.index(knobs.chunk_tokens)
    options = [c for c in (chunks[i - 1] if i else None, chunks[i + 1] if i + 1 < len(chunks) else None) if c]
    notes["chunk_tokens"] = (f"{knobs.chunk_tokens} positions per prefill pass (arena "
                             f"{format_bytes(problem.arena_bytes(knobs.chunk_tokens))}); " +
                             "; ".join(_versus(base, _objective(problem, knobs, chunk_tokens=c), f"{c}")
                                       for c in options))
    step = max(1, knobs.kv_pages // 8)
    notes["kv_pages"] = (f"{knobs.kv_pages} pages of {problem.page_tokens} positions keep the last "
                         f"{int(problem.resident_tokens(knobs.kv_pages))} of {problem.context_tokens} positions' K/V in "
                         "VRAM; " + "; ".join(_versus(base, _objective(problem, knobs, kv_pages=p), f"{p} pages")
                                              for p in (knobs.kv_pages - step, knobs.kv_pages + step)))
    notes["prefill_ring_slots"] = (f"{knobs.ring_slots} slots of {format_bytes(problem.slot_bytes)}; " +
                                   "; ".join(_versus(base, _objective(problem, knobs, ring_slots=r), f"{r} slot{'s' * (r != 1)}")
                                             for r in (knobs.ring_slots - 1, knobs.ring_slots + 1,
                                                       2 * knobs.ring_slots)))
    page_tables = ", ".join(format_bytes(device["host_page_tables_bytes"]) for device in plan_devices)
    notes["expert_cache_slots"] = (f"what is left of each GPU after the other regions and the page tables that map "
                                   f"its pinned host copies ({page_tables}): more cache never costs time; decode hit "
                                   f"rate {hit_rate(problem, knobs):.1%}")
    notes["kv_pages"] += ". " + _lending_note(problem, knobs)
    if problem.mtp:
        depth = max(t for t, _ in problem.workload.prompts)
        per_n = []
        resident = problem.resident_at(knobs.kv_pages, depth)
        cache = problem.decode_cache_slots(knobs.kv_pages, list(knobs.cache_slots), depth)
        draft = sum(c.draft_s(depth, problem.workload.drafter_window) for c in problem.costs)
        a = problem.workload.draft_acceptance
        for n in range(0, 5):
            verify = sum(float(c.window_s(1 + n, depth, s, resident)) for c, s in zip(problem.costs, cache))
            per_n.append(f"{n}: {sum(a ** i for i in range(n + 1)) / (n * draft + verify):.1f} tok/s")
        notes["draft_depth"] = (f"{knobs.draft_depth} draft{'s' * (knobs.draft_depth != 1)} per verify window at acceptance {a}; at depth {depth}: "
                                + ", ".join(per_n))
        notes["drafter_window_tokens"] = (f"{knobs.drafter_window_tokens} positions, from the workload's "
                                          "drafter_window; its ring holds them plus one page")
        gain = problem.room_reclaim_s
        if knobs.room_min_read_tokens is None:
            notes["room_min_read_tokens"] = (f"the room ({problem.room_slots} extra ring slots from the drafter's "
                                             f"experts) never saves more than the {gain * 1e3:.0f} ms that copying "
                                             "them back costs: it stays shut")
        else:
            notes["room_min_read_tokens"] = (f"the room adds {problem.room_slots} ring slots while a prompt is read; "
                                             f"giving it back costs {gain * 1e3:.0f} ms (copying "
                                             f"{format_bytes(problem.model.drafter_expert_bytes)} of drafter experts), "
                                             f"which reads of {knobs.room_min_read_tokens} tokens or more repay")
    return notes
