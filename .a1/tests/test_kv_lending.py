"""The K/V ring sized per request (planner.kv_lending, runtime.engine): the pages a request cannot reach serve
as expert-cache slots, byte-exact, and the logits never depend on it (DESIGN.md invariant 2)."""

import numpy as np
import pytest

from planner.kv import parse_kv_type
from planner.kv_lending import lent_slot_count, lent_slots, needed_pages, page_parts, part_offsets
from planner.report import explain
from planner.search import solve
from runtime.engine import Engine
from runtime.synthetic import write_model
from tests.test_engine import plan_for, write_profile


def reachable_mask(parts: dict, n_layers: int, ring_pages: int, request_pages: int) -> np.ndarray:
    """Per byte of the region: whether a request of `request_pages` pages may store there (brute force)."""
    mask = np.zeros(n_layers * ring_pages * sum(parts.values()), bool)
    for (layer, name), start in part_offsets(parts, n_layers, ring_pages).items():
        mask[start:start + request_pages * parts[name]] = True
    return mask


@pytest.mark.parametrize("kv", ["f16", "q8_0", "k8v4", "q4_0"])
def test_lent_slots_are_every_slot_wholly_inside_the_unreached_pages(kv, rng):
    for _ in range(20):
        page_tokens = int(rng.choice([16, 64, 256]))
        parts = page_parts(parse_kv_type(kv), page_tokens, int(rng.integers(1, 5)), 32 * int(rng.integers(1, 5)),
                           32 * int(rng.integers(1, 5)))
        n_layers, ring_pages = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        slot_bytes = 256 * int(rng.integers(1, 200))
        request_tokens = int(rng.integers(1, ring_pages * page_tokens + 100))
        request_pages = min(int(needed_pages(request_tokens, page_tokens)), ring_pages)
        stored = reachable_mask(parts, n_layers, ring_pages, request_pages)
        # every slot-aligned span of the region that no stored byte lies in (each array's first page is stored,
        # so the unstored runs are exactly the arrays' tails), each once, and in the array it says
        want = [k for k in range(len(stored) // slot_bytes) if not stored[k * slot_bytes:(k + 1) * slot_bytes].any()]
        lent = lent_slots(parts, n_layers, ring_pages, request_tokens, page_tokens, slot_bytes)
        got = [s.slot for s in lent]
        assert got == want
        for s in lent:
            start = part_offsets(parts, n_layers, ring_pages)[s.layer, s.part]
            assert start + request_pages * parts[s.part] <= s.slot * slot_bytes
            assert (s.slot + 1) * slot_bytes <= start + ring_pages * parts[s.part]
        assert lent_slot_count(parts, n_layers, ring_pages, request_tokens, page_tokens, slot_bytes) == len(got)
        if request_pages == ring_pages:
            assert got == []


def test_the_vectorised_count_is_the_list_for_every_ring_size():
    parts = page_parts(parse_kv_type("q8_0"), 256, 4, 128, 128)
    rings = np.arange(1, 80)
    counts = lent_slot_count(parts, 6, rings, 1100, 256, 5013504)
    assert counts.tolist() == [len(lent_slots(parts, 6, int(r), 1100, 256, 5013504)) for r in rings]
    assert counts[-1] > 0


def test_the_kv_ring_follows_the_expert_slots_and_decode_is_priced_with_the_lent_ones():
    plan = solve("rtx-5070-ti-16g", "qwen3-30b-a3b-q8_0", context=32768)
    names = [r["name"] for r in plan.devices[0]["regions"]]
    assert names[names.index("prefill_ring") + 1] == "kv_ring"
    regions = {r["name"]: r for r in plan.devices[0]["regions"]}
    assert regions["kv_ring"]["offset"] == (regions["expert_cache"]["offset"]
                                            + (plan.knobs["expert_cache_slots"][0] + plan.knobs["prefill_ring_slots"])
                                            * plan.knobs["slot_bytes"])
    rows = {row["depth"]: row for row in plan.predictions["decode"]}
    assert rows[1024]["expert_cache_slots"][0] > plan.knobs["expert_cache_slots"][0]
    assert rows[1024]["expert_hit_rate"] > plan.predictions["expert_hit_rate"]
    assert rows[32768]["expert_cache_slots"] == plan.knobs["expert_cache_slots"]
    assert rows[1024]["tok_s"] > rows[32768]["tok_s"]
    # explain says which pages a request of that depth keeps and which it lends, as how many slots
    lent = rows[1024]["expert_cache_slots"][0] - plan.knobs["expert_cache_slots"][0]
    request_pages = -(-(1024 + 128) // 256)         # the default workload's 256 decode tokens around depth 1024
    assert (f"stores pages 0-{request_pages - 1}; pages {request_pages}-{plan.knobs['kv_pages'] - 1} of every layer "
            f"serve as {lent} expert-cache slots") in " ".join(explain(plan).split())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("lending") / "qwen.gguf", "qwen3moe", seed=5, n_trunk=1)


def test_lent_slots_fill_and_are_taken_back_with_the_logits_of_no_lending(tmp_path, model, rng):
    """A 16-page ring of 16 positions, 2 of 8 experts cached. A request of 9 positions stores page 0 only and
    lends 3 expert slots (one in the K pages, two in the V pages), which fill after its prompt; the next, of
    33 positions in the same conversation, stores pages 0-2, whose V bytes lie in one of those slots: that slot
    gives its expert up first. Tokens and logits are bitwise those of the same plan without lending."""
    plan = plan_for(tmp_path, model, 560, kv_pages=16)
    assert plan.knobs["expert_cache_slots"] == [2]
    first = rng.integers(0, 128, size=7).tolist()
    more = rng.integers(0, 128, size=22).tolist()
    runs = {}
    for lending in (True, False):
        with Engine(plan, model, progress=False, kv_lending=lending) as engine:
            a = engine.generate(first, max_new_tokens=2, conversation="c", return_logits=True)
            after_a = (engine.stats()["expert_slots_lent"], int(engine.experts.cached.sum()))
            b = engine.generate(first + a.tokens + more, max_new_tokens=2, conversation="c", return_logits=True)
            after_b = (engine.stats()["expert_slots_lent"], int(engine.experts.cached.sum()),
                       sorted(engine.experts.resident[0].values()))
            runs[lending] = (a, b, after_a, after_b)
    (a, b, after_a, after_b), (a0, b0, *_) = runs[True], runs[False]
    kv_first = 2 + plan.knobs["prefill_ring_slots"]
    assert after_a == (3, 5)                        # 2 planned + 3 lent slots, filled
    assert after_b[:2] == (2, 4) and kv_first + 3 not in after_b[2]
    assert b.reused_tokens == len(first)
    assert a.tokens == a0.tokens and b.tokens == b0.tokens
    assert np.array_equal(a.logits, a0.logits) and np.array_equal(b.logits, b0.logits)


def test_an_engine_without_a_host_copy_of_the_experts_lends_nothing(tmp_path, model):
    plan = solve(write_profile(tmp_path, 800), model, context=256, kv="f32", page_tokens=16)
    assert plan.knobs["expert_cache_slots"] == [8]
    with Engine(plan, model, progress=False) as engine:
        assert not engine.kv_lending and engine.stats()["expert_slots_lent"] == 0
