"""The solver: exact and non-overlapping regions, near-optimal layouts, the seeds' trade-offs, refusals."""

import dataclasses
import itertools

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import DoesNotFit, solve
from planner.kv import parse_kv_type
from planner.layout import aligned, dense_tensor_names, tensors_bytes
from planner.model import load_model
from planner.plan import load_plan, parse_plan
from planner.profile import Host, load_profile, parse_profile
from planner.search import (MIN_RING_SLOTS, chunk_candidates, feasible_cache, make_problem, request_s, search)
from planner.workload import Workload
from plans import MODELS_DIR

GIB = 2**30


def small_card(tmp_path, architecture="qwen3moe", blocks=4, experts=8, embedding=256, ff=128, vocab=512,
               nextn=0, leading=0, types=None):
    metadata = {"block_count": blocks + nextn, "context_length": 4096, "embedding_length": embedding,
                "feed_forward_length": 2 * ff, "expert_feed_forward_length": ff, "expert_count": experts,
                "expert_used_count": 2, "attention.head_count": 4, "attention.head_count_kv": 2,
                "attention.key_length": 64, "attention.value_length": 64, "vocab_size": vocab}
    if architecture == "glm4moe":
        metadata.update(nextn_predict_layers=nextn, leading_dense_block_count=leading, expert_shared_count=1,
                        **{"rope.dimension_count": 32})
    path = tmp_path / f"{architecture}-{blocks}-{experts}-{embedding}-{ff}-{nextn}-{leading}.yaml"
    path.write_text(yaml.safe_dump({"architecture": architecture, "metadata": metadata,
                                    "types": types or {"default": "q8_0"}}))
    return path


def profile_with(vram_bytes, reserved=64 * 2**20, link="12 GB/s", bandwidth="400 GB/s", gpus=1,
                 kernel_launch="25 us"):
    gpu = {"name": "test", "vram": f"{vram_bytes} B", "sms": 16, "reserved": f"{reserved} B", "memory_bandwidth": bandwidth,
           "fp32": "10 TFLOPS", "fp16": "40 TFLOPS", "host_to_device": link, "device_to_host": link,
           "kernel_launch": kernel_launch}
    return parse_profile({"gpus": [gpu] * gpus, "host": {"ram": "512 GiB", "pinned_budget": "400 GiB"}},
                         source="test-profile")


def pinned_bytes_of(plan, model, device) -> int:
    """The pinned host memory the runtime takes for a GPU's share, counted from the model and the knobs: its
    blocks' routed experts unless all are cached, its blocks' whole-context K/V unless the ring holds it, and
    the drafter's experts on the last GPU when the plan has a room."""
    blocks = range(*device["blocks"])
    experts = sum(t.n_bytes for t in model.tensors if model.tensor_class[t.name] == "expert"
                  and int(t.name.split(".")[1]) in blocks)
    n_moe = sum(model.hparams.is_moe_layer(b) for b in blocks)
    all_cached = plan.knobs["expert_cache_slots"][device["index"]] >= n_moe * model.hparams.n_expert
    page_tokens, pages = plan.knobs["page_tokens"], plan.knobs["kv_pages"]
    full_pages = -(-plan.settings["context_tokens"] // page_tokens)
    kv = len(blocks) * full_pages * page_tokens * model.kv_bytes_per_token(parse_kv_type(plan.settings["kv"]))
    drafter = model.drafter_expert_bytes if device["holds_drafter"] and plan.knobs["room_slots"] else 0
    return (0 if all_cached else experts) + (kv if pages < full_pages else 0) + drafter


def check_layout(plan, model):
    """Regions are aligned, ordered, non-overlapping, within usable VRAM with the host page tables, and exactly
    the promised bytes."""
    for device in plan.devices:
        end = 0
        for region in device["regions"]:
            assert region["offset"] >= end and region["offset"] % 256 == 0
            end = region["offset"] + region["bytes"]
        # an 8-byte entry per 4 KiB page of the pinned host copies
        assert device["host_page_tables_bytes"] == -(-pinned_bytes_of(plan, model, device) // 4096) * 8
        assert end + device["host_page_tables_bytes"] == device["used_bytes"] <= device["usable_bytes"]
        assert device["used_bytes"] + device["free_bytes"] == device["usable_bytes"]
        sizes = {r["name"]: r["bytes"] for r in device["regions"]}
        share = range(*device["blocks"])
        names = dense_tensor_names(model, share, device["index"] == 0, device["index"] == len(plan.devices) - 1)
        assert sizes["dense"] == tensors_bytes(model, names)
        slot = plan.knobs["slot_bytes"]
        assert slot == model.slot_layout.slot_bytes >= aligned(model.largest_expert_blob_bytes)
        assert sizes.get("expert_cache", 0) == plan.knobs["expert_cache_slots"][device["index"]] * slot
        assert sizes["prefill_ring"] == plan.knobs["prefill_ring_slots"] * slot
        if device["holds_drafter"]:
            # a slot per drafter expert, right after the ring: the room is more ring slots, in place
            assert sizes["drafter_experts"] == model.hparams.n_expert * slot == plan.knobs["room_slots"] * slot
            names = [r["name"] for r in device["regions"]]
            assert names.index("drafter_experts") == names.index("prefill_ring") + 1


@pytest.mark.parametrize("hardware, card, kv", [("rtx-2060-super-8g", "glm-4.5-air-q4_k_m", "q8_0"),
                                                ("rtx-5070-ti-16g", "qwen3-30b-a3b-q8_0", "k8v4"),
                                                ("h200-141g", "qwen3-30b-a3b-q4_k_m", "f16")])
def test_bundled_plans_are_exact(hardware, card, kv):
    plan = solve(hardware=hardware, model=card, context=32768, kv=kv)
    check_layout(plan, load_model(card))
    assert parse_plan(plan.to_dict()).regions == plan.regions


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vram_mib=st.integers(80, 4096), blocks=st.integers(2, 6), experts=st.sampled_from([4, 8, 16]),
       embedding=st.sampled_from([128, 256, 512]), glm=st.booleans(), gpus=st.integers(1, 2),
       kv=st.sampled_from(["f16", "q8_0", "q4_0", "k8v4"]), context=st.sampled_from([512, 1024, 4096]))
def test_random_profiles_and_cards_get_exact_plans_or_a_clear_refusal(tmp_path, vram_mib, blocks, experts,
                                                                      embedding, glm, gpus, kv, context):
    card = small_card(tmp_path, "glm4moe" if glm else "qwen3moe", blocks=blocks, experts=experts,
                      embedding=embedding, nextn=1 if glm else 0, leading=1 if glm else 0)
    model = load_model(card)
    profile = profile_with(vram_mib * 2**20, gpus=gpus)
    try:
        plan = solve(hardware=profile, model=model, context=context, kv=kv,
                     workload=Workload(prompts=((context // 2, 1.0),), decode_tokens=32))
    except DoesNotFit as refusal:
        assert "short" in str(refusal) and "the floor is" in str(refusal)
        return
    check_layout(plan, model)
    assert sum(d["blocks"][1] - d["blocks"][0] for d in plan.devices) == model.hparams.n_trunk


def exhaustive_best(problem):
    """Every chunk, K/V page count, ring depth and cache size (not only the remainder) of the domain."""
    best = np.inf
    for chunk in chunk_candidates(problem):
        arena = problem.arena_bytes(chunk)
        for pages, ring in itertools.product(range(problem.min_pages(chunk), problem.full_pages + 1),
                                             range(MIN_RING_SLOTS, 25)):
            most = feasible_cache(problem, chunk, np.array(pages), np.array(ring), arena)[0]
            if most < 0:
                continue
            caches = np.arange(0, int(most) + 1)
            objective = request_s(problem, chunk, pages, ring, [caches])
            best = min(best, float(np.min(objective)))
    return best


@pytest.mark.parametrize("vram_mib, skew", [(24, 1.0), (40, 0.5), (64, 1.5)])
def test_solver_is_within_one_percent_of_exhaustive_search(tmp_path, vram_mib, skew):
    model = load_model(small_card(tmp_path, blocks=3, experts=8, embedding=256, ff=256, vocab=256))
    workload = Workload(prompts=((300, 1.0), (900, 2.0)), decode_tokens=64, skew=skew)
    problem = make_problem(profile_with(vram_mib * 2**20, reserved=2**20), model, context=1024, kv="q8_0",
                           workload=workload, page_tokens=64)
    knobs = search(problem)
    found = float(request_s(problem, knobs.chunk_tokens, knobs.kv_pages, knobs.ring_slots, list(knobs.cache_slots)))
    assert found <= exhaustive_best(problem) * 1.01


@pytest.fixture(scope="module")
def air_8g():
    return solve(hardware="rtx-2060-super-8g", model="glm-4.5-air-q4_k_m", context=32768, kv="q8_0", mtp=True)


def test_a_bigger_prefill_ring_shrinks_the_cache_the_chunk_or_the_kv_ring(air_8g):
    """The ring's bytes come from somewhere: fewer cache slots, a smaller chunk's arena, or fewer K/V pages
    (which prefill then reads from the host copy: priced, so the plan is slower)."""
    bigger = air_8g.knobs["prefill_ring_slots"] + 24
    forced = solve(hardware="rtx-2060-super-8g", model="glm-4.5-air-q4_k_m", context=32768, kv="q8_0", mtp=True,
                   pins={"ring_slots": bigger})
    assert forced.knobs["prefill_ring_slots"] == bigger
    assert forced.knobs["expert_cache_slots"][0] < air_8g.knobs["expert_cache_slots"][0] or \
        forced.knobs["chunk_tokens"] < air_8g.knobs["chunk_tokens"] or \
        forced.knobs["kv_pages"] < air_8g.knobs["kv_pages"]
    assert forced.predictions["request_seconds"] >= air_8g.predictions["request_seconds"]


def test_a_host_slow_to_issue_kernels_gets_a_deeper_prefill_ring():
    """Prefill issues each ring batch's kernels, copies and events from Python: on a host that takes 300 us a
    call the plan streams a chunk's experts in fewer, larger batches than on one that takes none, and predicts
    a slower prompt read."""
    plans = {launch: solve(profile_with(8 * 2**30, link="25 GB/s", kernel_launch=launch), "qwen3-30b-a3b-q8_0",
                           context=8192, kv="f16") for launch in ("0 us", "300 us")}
    fast, slow = plans["0 us"], plans["300 us"]
    assert slow.knobs["prefill_ring_slots"] > fast.knobs["prefill_ring_slots"]
    rates = [(s["tok_s"], f["tok_s"]) for s, f in zip(slow.predictions["prefill"], fast.predictions["prefill"])]
    assert all(s <= f for s, f in rates) and any(s < f for s, f in rates)


def test_the_room_adds_ring_slots_without_shrinking_the_chunk(air_8g):
    shut = solve(hardware="rtx-2060-super-8g", model="glm-4.5-air-q4_k_m", context=32768, kv="q8_0", mtp=True,
                 workload=Workload(prompts=((64, 1.0),)), pins={"chunk_tokens": air_8g.knobs["chunk_tokens"]})
    assert air_8g.knobs["room_slots"] > 0
    # the room lives in the drafter's expert block, which the plan holds either way: no region grows for it
    drafter = [r for r in air_8g.devices[0]["regions"] if r["name"] == "drafter_experts"][0]
    assert air_8g.knobs["room_slots"] * air_8g.knobs["slot_bytes"] == drafter["bytes"]
    assert shut.knobs["chunk_tokens"] == air_8g.knobs["chunk_tokens"]


def test_the_room_stays_shut_when_its_first_batch_costs_more_than_it_saves(air_8g):
    """The ring streams a block's experts in batches of half its slots, each copied whole before its kernels
    start: the room's 128 slots make a block's first batch 65 experts (0.11 s of copies that no kernel
    overlaps at this card's 6.5 GB/s, as the planner prices it, in each of 45 blocks a chunk), more than the batches and stalls it saves, so no read opens it (BENCHMARKS.md, the
    prefill ring's timeline); the threshold rule agrees at every length the workload reads."""
    assert air_8g.knobs["room_min_read_tokens"] is None
    assert not any(row["room_open"] for row in air_8g.predictions["prefill"])
    problem = make_problem("rtx-2060-super-8g", "glm-4.5-air-q4_k_m", context=32768, kv="q8_0", mtp=True)
    from planner.search import prefill_s
    knobs = air_8g.knobs
    def gain(read):
        args = (problem, read, 0, knobs["chunk_tokens"], knobs["kv_pages"], knobs["prefill_ring_slots"],
                knobs["expert_cache_slots"])
        return float(prefill_s(*args, room=False) - prefill_s(*args, room=True)) - problem.room_reclaim_s
    assert all(gain(row["read_tokens"]) <= 0 for row in air_8g.predictions["prefill"])


def test_reused_prefix_counts_only_the_tokens_read(air_8g):
    reused = solve(hardware="rtx-2060-super-8g", model="glm-4.5-air-q4_k_m", context=32768, kv="q8_0", mtp=True,
                   workload=Workload(reused_prefix=0.99))
    threshold = reused.knobs["room_min_read_tokens"]
    for row in reused.predictions["prefill"]:
        assert row["read_tokens"] < row["prompt_tokens"]
        assert row["room_open"] == (threshold is not None and row["read_tokens"] >= threshold)


def test_a_model_that_cannot_fit_says_by_how_much_and_what_binds():
    with pytest.raises(DoesNotFit, match=r"needs at least .* GiB.*GiB usable: .* short; the floor is the dense "
                                         r"weights"):
        solve(hardware="rtx-2060-super-8g", model="glm-4.5-q4_k_m", context=32768, kv="q8_0", mtp=False)


def test_the_page_tables_of_the_pinned_host_copies_take_vram_from_the_cache(air_8g):
    """GLM-4.5-Air's pinned copies (71 GB, 66 of them experts) map through 132 MiB of the 8 GB card's VRAM:
    the plan counts them, and the cache has that much less (a slot more would not fit beside them)."""
    device = air_8g.devices[0]
    pinned = air_8g.settings["host_pinned_bytes"]
    assert pinned["experts"] == load_model("glm-4.5-air-q4_k_m").bytes_of("expert")
    assert 120 * 2**20 < device["host_page_tables_bytes"] == air_8g.allocated_bytes(0) - air_8g.device_bytes(0)
    assert device["free_bytes"] < air_8g.knobs["slot_bytes"]


def test_a_resident_plan_pins_no_experts_and_a_ring_holding_the_context_no_kv(tmp_path):
    card = small_card(tmp_path)
    plan = solve(hardware=profile_with(4 * GIB), model=card, context=1024)
    assert plan.knobs["kv_pages"] == 4 and plan.knobs["expert_cache_slots"] == [32]
    assert plan.settings["host_pinned_bytes"] == {"experts": 0, "kv": 0, "drafter_experts": 0}
    assert plan.devices[0]["host_page_tables_bytes"] == 0
    assert plan.allocated_bytes(0) == plan.device_bytes(0)


def test_the_host_budget_is_checked():
    profile = load_profile("rtx-5090-32g")
    small_host = dataclasses.replace(profile, host=Host(ram_bytes=64 * GIB, pinned_budget_bytes=32 * GIB))
    with pytest.raises(DoesNotFit, match="host.pinned_budget is 32.00 GiB"):
        solve(hardware=small_host, model="glm-4.5-air-q4_k_m", context=32768)


def test_multi_gpu_split_puts_the_drafter_on_the_last_gpu(tmp_path):
    two = profile_with(12 * GIB, gpus=2)
    plan = solve(hardware=two, model="glm-4.5-air-q4_k_m", context=16384, kv="q8_0")
    model = load_model("glm-4.5-air-q4_k_m")
    check_layout(plan, model)
    assert [d["holds_drafter"] for d in plan.devices] == [False, True]
    assert plan.devices[0]["blocks"][1] == plan.devices[1]["blocks"][0]


def test_plan_round_trips_and_refuses_another_model_or_profile(tmp_path, air_8g):
    path = tmp_path / "plan.yaml"
    air_8g.save(path)
    loaded = load_plan(path, model="glm-4.5-air-q4_k_m", hardware="rtx-2060-super-8g")
    assert loaded.to_dict() == air_8g.to_dict()
    json_path = tmp_path / "plan.json"
    air_8g.save(json_path)
    assert load_plan(json_path).to_dict() == air_8g.to_dict()
    from planner.errors import StratumError
    with pytest.raises(StratumError, match="made for model 'glm-4.5-air-q4_k_m'.*blocks: plan 47, model 93"):
        load_plan(path, model="glm-4.5-q4_k_m")
    with pytest.raises(StratumError, match="made for hardware profile 'rtx-2060-super-8g'"):
        load_plan(path, hardware="rtx-3090-24g")


def test_a_tampered_plan_is_refused(tmp_path, air_8g):
    from planner.errors import StratumError
    document = air_8g.to_dict()
    document["devices"][0]["regions"][1]["offset"] -= 4096
    with pytest.raises(StratumError, match=r"devices\[0\].regions\[1\]: overlaps"):
        parse_plan(document, "p.yaml")
    document = air_8g.to_dict()
    document["schema"] = "stratum-plan/0"
    with pytest.raises(StratumError, match="schema"):
        parse_plan(document, "p.yaml")


def test_card_plan_accepts_the_matching_gguf(tmp_path, air_8g):
    from tests.ggufs import write_header_only
    gguf = tmp_path / "GLM-4.5-Air-Q4_K_M.gguf"
    write_header_only(MODELS_DIR / "glm-4.5-air-q4_k_m.yaml", gguf)
    path = tmp_path / "plan.yaml"
    air_8g.save(path)
    assert load_plan(path, model=gguf).model["name"] == "glm-4.5-air-q4_k_m"


def test_a_decode_step_finds_in_vram_the_positions_its_ring_still_holds(tmp_path, rng):
    """The positions a decode step at `depth` finds in VRAM, against a ring replayed page by page (page p in
    slot p mod pages, each slot holding the last page stored into it): every position of a held page, the
    current partial page's too, so never fewer than the planner's floor of full pages."""
    problem = make_problem(profile_with(2**30), load_model(small_card(tmp_path)), context=4096,
                           workload=Workload(prompts=((1024, 1.0),), decode_tokens=32))
    page_tokens = problem.page_tokens
    for depth, pages in zip(rng.integers(1, 4096, 64), rng.integers(2, problem.full_pages + 2, 64)):
        holds = {}
        for page in range(depth // page_tokens + 1):        # the step stores position `depth` too
            holds[page % pages] = page
        held = sum(1 for position in range(depth) if holds.get((position // page_tokens) % pages) ==
                   position // page_tokens)
        assert int(problem.resident_at(pages, depth)) == held, (depth, pages)
        assert held >= min(depth, int(problem.resident_tokens(pages)))
