"""The drafter room (runtime.experts): while a prompt is read, the drafter's expert slots serve as more prefill
ring slots, in place, and are given back before decode. What a user relies on: the drafter's experts come back
bitwise; greedy output with the room open and drafting is bitwise the output with it shut and no drafting;
the threshold counts the tokens a request reads, not its prompt; a request stopped while the room is open
leaves it to the next one to close; an engine with no room refuses to open one.

Simulated passes are slow: one glm4moe of one MoE block and its NextN block, 4 experts, none cached, a 2-slot
ring and prompts of one or two 8-token chunks."""

import numpy as np
import pytest

from codegen.lower.weights import read_gguf
from planner.errors import StratumError
from planner.header import read_header
from planner.search import solve
from planner.workload import Workload
from runtime.engine import Engine
from runtime.synthetic import write_model
from tests.test_engine import mtp_model, write_profile

CHUNK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return mtp_model(tmp_path_factory.mktemp("room"))


@pytest.fixture(scope="module")
def plan(tmp_path_factory, model):
    # a budget that leaves no cache slot (since cee68b7 prices each streamed copy's latency, 580 KiB buys one)
    plan = solve(write_profile(tmp_path_factory.mktemp("profiles"), 570), model, context=128, kv="f32",
                 page_tokens=16, pins={"chunk_tokens": CHUNK, "ring_slots": 2})
    knobs = plan.knobs
    assert knobs["expert_cache_slots"] == [0] and knobs["prefill_ring_slots"] == 2 and knobs["room_slots"] == 4
    return plan


def drafter_slots(engine) -> np.ndarray:
    experts = engine.experts
    return experts.blobs[experts.room_first:experts.room_first + experts.n_room].copy_to_host()


def expected_drafter_slots(engine, model) -> np.ndarray:
    """The drafter's experts from the GGUF, placed as the slot layout says: expert e in room slot e."""
    layout, n_room = engine.model.slot_layout, engine.experts.n_room
    slots = np.zeros((n_room, layout.slot_bytes), np.uint8)
    for name, packed in read_gguf(model, read_header(model)).items():
        if engine.model.tensor_class[name] != "drafter_expert":
            continue
        matrix = name.split(".")[2]
        for kind, values in (("data", packed.data), ("scales", packed.scales)):
            if values is not None:
                offset, n_bytes = layout.part(matrix, kind)
                slots[:, offset:offset + n_bytes] = values.reshape(n_room, -1).view(np.uint8)
    return slots


def test_the_room_is_given_back_bitwise_and_changes_no_output(model, plan, rng):
    """Room open (every request) and drafting against room shut and no drafting: the same tokens and bitwise
    the same logits; the ring wrote into the drafter's slots and closing restored them bitwise."""
    prompt = rng.integers(0, 64, size=CHUNK).tolist()
    with Engine(plan, model, progress=False, room_min_read_tokens=0) as engine:
        loaded = drafter_slots(engine)
        assert np.array_equal(loaded, expected_drafter_slots(engine, model))
        streamed = engine.experts.stream_block
        chunk_experts = []      # a chunk routed to at most the ring's 2 experts leaves the room unwritten

        def counting(block, ids, *args):
            chunk_experts.append(np.unique(ids).size)
            return streamed(block, ids, *args)
        engine.experts.stream_block = counting
        roomed = engine.generate(prompt, max_new_tokens=3, return_logits=True, draft_depth=1)
        stats = engine.stats()
        assert stats["room_requests"] == 1 and stats["last_request"]["room_open"]
        assert engine.experts.stats.room_reclaims == int(max(chunk_experts) > 2), \
            f"the ring streamed {chunk_experts} experts a chunk: the room is written exactly when they pass 2"
        assert np.array_equal(drafter_slots(engine), loaded)
        engine.room_min_read_tokens = None
        shut = engine.generate(prompt, max_new_tokens=3, return_logits=True, draft_depth=0)
        assert not engine.stats()["last_request"]["room_open"]
    assert stats["drafted_tokens"] >= 1
    assert roomed.tokens == shut.tokens and np.array_equal(roomed.logits, shut.logits)


def test_the_threshold_counts_read_tokens_and_a_stopped_request_leaves_the_room_to_the_next(model, plan, rng,
                                                                                           monkeypatch):
    prompt = rng.integers(0, 64, size=CHUNK + 2).tolist()
    with Engine(plan, model, progress=False, room_min_read_tokens=CHUNK) as engine:
        loaded = drafter_slots(engine)
        first = engine.generate(prompt, max_new_tokens=1, conversation="c")
        assert engine.stats()["last_request"]["room_open"]
        # the prompt is longer than the threshold, but it reuses the first's K/V and reads 3 tokens
        longer = prompt + rng.integers(0, 64, size=3).tolist()
        again = engine.generate(longer, max_new_tokens=1, conversation="c")
        assert again.reused_tokens == len(prompt) and not engine.stats()["last_request"]["room_open"]
        assert engine.stats()["room_requests"] == 1

        run_prefill = engine._run_prefill
        chunks = []

        def stopped_after_one_chunk(program):
            if chunks:
                raise KeyboardInterrupt
            chunks.append(program)
            run_prefill(program)
        monkeypatch.setattr(engine, "_run_prefill", stopped_after_one_chunk)
        routed_before = engine.experts.routed.copy()
        with pytest.raises(KeyboardInterrupt):
            engine.generate(prompt, max_new_tokens=1)
        # the chunk's batches fill the ring's slots first: the room's are written iff a block routes more
        # experts than the ring holds (a random prompt's chunk of 8 usually does, not always)
        chunk_experts = (engine.experts.routed - routed_before > 0).sum(axis=1)
        assert engine.experts.room_open
        assert engine.experts.room_written == bool((chunk_experts > plan.knobs["prefill_ring_slots"]).any())
        monkeypatch.setattr(engine, "_run_prefill", run_prefill)
        retried = engine.generate(prompt, max_new_tokens=1)
        assert not engine.experts.room_open and np.array_equal(drafter_slots(engine), loaded)
    assert retried.tokens[0] == first.tokens[0]


def test_an_engine_without_a_room_refuses_to_open_one(tmp_path, model):
    profile = write_profile(tmp_path, 2000)
    no_mtp = solve(profile, model, context=128, kv="f32", page_tokens=16, mtp=False)
    with pytest.raises(StratumError, match="no drafter room to open .the plan was made without speculative"):
        Engine(no_mtp, model, progress=False, room_min_read_tokens=0)
    with Engine(no_mtp, model, progress=False) as engine:         # the plan's rule: no room, nothing to refuse
        assert engine.room_min_read_tokens is None
    plan = solve(profile, model, context=128, kv="f32", page_tokens=16)
    with pytest.raises(StratumError, match="room_min_read_tokens -1"):
        Engine(plan, model, progress=False, room_min_read_tokens=-1)
    qwen = write_model(tmp_path / "qwen.gguf", "qwen3moe", seed=2, n_trunk=1)
    with pytest.raises(StratumError, match="no drafter room to open .the model has no NextN layer"):
        Engine(solve(profile, qwen, context=128, kv="f32", page_tokens=16), qwen, progress=False,
               room_min_read_tokens=0)


@pytest.mark.gpu
def test_gpu_room_open_and_drafting_give_the_output_of_room_shut_without_drafting(tmp_path, rng):
    """On the H200, a glm4moe of 512-wide blocks whose plan caches few experts and streams the rest through a
    small ring: a 300-token prompt read with the room open (its 32 slots after the ring's) and 16 tokens
    drafted at depth 3 against the room shut and no drafting: the same tokens, bitwise the same logits; the
    drafter's experts are given back bitwise after each roomed request."""
    model = write_model(tmp_path / "mtp.gguf", "glm4moe", seed=19, n_trunk=3, n_embd=512, n_head=8, n_head_kv=2,
                        head_dim=64, n_rot=32, n_ff=1024, n_ff_exp=256, n_expert=32, n_expert_used=4,
                        n_vocab=4096, types={"experts": "q8_0", "dense": "q8_0"})
    plan = solve(write_profile(tmp_path, 30000), model, context=1024, kv="q8_0", page_tokens=16,
                 pins={"chunk_tokens": 128, "ring_slots": 4})
    prompt = rng.integers(0, 4096, size=300).tolist()
    with Engine(plan, model, progress=False, room_min_read_tokens=0) as engine:
        loaded = drafter_slots(engine)
        assert np.array_equal(loaded, expected_drafter_slots(engine, model))
        roomed = engine.generate(prompt, max_new_tokens=16, return_logits=True, draft_depth=3)
        assert engine.experts.stats.room_reclaims == 1
        assert np.array_equal(drafter_slots(engine), loaded)
        engine.room_min_read_tokens = None
        shut = engine.generate(prompt, max_new_tokens=16, return_logits=True, draft_depth=0)
        stats = engine.stats()
    print(plan.knobs, stats)
    assert roomed.tokens == shut.tokens and np.array_equal(roomed.logits, shut.logits)
    assert stats["drafted_tokens"] > 0


def test_the_drafters_own_per_row_pass_gives_the_output_of_the_batched_one(model, tmp_path, rng):
    """The A/B switch of the drafter's prompt K/V: stored by its own draft steps, a row at a time (from the
    prompt pass's hidden states), instead of in the prompt's batched pass: the same greedy tokens and logits
    (drafts change acceptance only), and the drafter's K/V of the prompt's rows equal but for the two kernel
    families' rounding. The drafter's window (4 positions) is shorter than the prompt (28, one chunk) and its
    ring holds 2 pages of 8: the first row's window (21..24) reaches back into page 2, which neither pass
    stores and the ring has no slot for; the ring's slots and the activations start out NaN (stale bytes), which
    that page must not be read as (the step's router would pick expert ids from NaN)."""
    workload = Workload(prompts=((28, 1.0),), decode_tokens=4, drafter_window=4)
    plan = solve(write_profile(tmp_path, 600), model, context=128, kv="f32", page_tokens=8, workload=workload,
                 pins={"chunk_tokens": 32})
    assert plan.knobs["drafter_kv_pages"] == 2
    prompt = rng.integers(0, 64, size=28).tolist()
    outputs, drafter_kv = [], []
    for drafter_kv_pass in ("batched", "per_row"):
        with Engine(plan, model, progress=False, drafter_kv_pass=drafter_kv_pass) as engine:
            pages = engine.drafter.ring.pages[engine.drafter.layer]
            activations = engine.arena.carver("arena").array((engine.arena.regions["arena"].bytes // 4,), np.int32)
            for data in (pages.k_data, pages.v_data, activations):      # stale bytes: float32 NaN everywhere
                data.copy_to_device(np.full(data.shape, 0x7FC00000, np.int32))
            outputs.append(engine.generate(prompt, max_new_tokens=2, return_logits=True, draft_depth=1))
            # a draft step rewrote only the last rows
            page_tokens, n_kv = pages.page_tokens, pages.n_head_kv
            rows = []
            for data in (pages.k_data, pages.v_data):       # f32 K/V; the window's rows 24..26 sit in page 3, slot 1
                words = data.copy_to_host()[1].view(np.float32).reshape(n_kv, page_tokens, -1)
                rows.append(words[:, :len(prompt) - 1 - 24])
            drafter_kv.append(rows)
    assert outputs[0].tokens == outputs[1].tokens and np.array_equal(outputs[0].logits, outputs[1].logits)
    for batched, per_row in zip(*drafter_kv):
        assert np.linalg.norm(per_row - batched) < 1e-5 * np.linalg.norm(batched)
    with pytest.raises(StratumError, match="drafter_kv_pass 'rows': .batched. or .per_row."):
        Engine(plan, model, progress=False, drafter_kv_pass="rows")
