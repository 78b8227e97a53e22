"""The engine (runtime.engine) on tiny generated models through the simulator: the DESIGN.md invariants a
user relies on. The device allocation is the plan's bytes; logits are bitwise the same whatever the plan (K/V
ring, expert cache and prefill ring sizes, chunk size); greedy tokens are the reference's; a reused
conversation gives bitwise the logits of a cold read; bad requests are refused and leave the engine usable.

A simulated pass takes tens of seconds, so prompts are short and decodes a few steps; the `gpu` tests run the
same promises at real shapes on the H200."""

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from codegen.lower import cuda as shim
from codegen.lower.cuda import CapturedGraph
from planner.errors import StratumError
from planner.predict import DRAFT_STEP_HOST_CALLS, WINDOW_HOST_CALLS
from planner.search import solve
from runtime import engine as engine_module
from runtime import kv_ring as kv_ring_module
from runtime import reference
from runtime.engine import Engine
from runtime.synthetic import write_model
from tests.passes import PassRunner

CONTEXT = 256


def write_profile(folder, vram_kib: int) -> str:
    """A small GPU whose Python issues kernels for free (kernel_launch 0): a tiny model's layout is then decided
    by its bytes, as a real model's is, not by launches that would dwarf its microseconds of work. Its pinned
    copies (KiB) need no page tables beyond the piece a CUDA context starts with (run 25: 256 MiB took none)."""
    path = folder / f"tiny-{vram_kib}.yaml"
    path.write_text(f"""name: tiny-{vram_kib}
gpus:
  - name: test GPU
    vram: {vram_kib} KiB
    sms: 16
    reserved: 64 KiB
    memory_bandwidth: 400 GB/s
    fp32: 10 TFLOPS
    fp16: 40 TFLOPS
    host_to_device: 10 GB/s
    device_to_host: 10 GB/s
    kernel_launch: 0 us
    host_page_table_entry: 0 B
host:
  ram: 1 GiB
  pinned_budget: 512 MiB
""")
    return str(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("engine") / "qwen.gguf", "qwen3moe", seed=5, n_trunk=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


def plan_for(folder, model, vram_kib: int, page_tokens: int = 16, **pins):
    return solve(write_profile(folder, vram_kib), model, context=CONTEXT, kv="f32", page_tokens=page_tokens,
                 pins=pins)


class CountingAllocations:
    """Every device allocation made through numba while it is active, in bytes."""

    def __init__(self, monkeypatch):
        self.bytes = []
        cuda = shim.cuda
        for name in ("device_array", "to_device", "device_array_like"):
            original = getattr(cuda, name)

            def counted(*args, _original=original, **kwargs):
                array = _original(*args, **kwargs)
                self.bytes.append(array.nbytes)
                return array
            monkeypatch.setattr(cuda, name, counted)


def test_device_allocation_is_the_plan_and_greedy_tokens_are_the_references(folder, model, monkeypatch, rng):
    """A prompt and three decode steps, half the experts only in the host copy, the cache refreshed after
    every step. The frequency policy starts primed as if experts 4..7 (the ones the cache does not start with)
    had been routed most, so the first refresh swaps them all in, whatever this prompt routes, and the later
    steps read experts that refresh copied."""
    plan = plan_for(folder, model, 600)
    assert plan.knobs["expert_cache_slots"][0] == 4      # half the experts live only in the host copy
    counting = CountingAllocations(monkeypatch)
    prompt = rng.integers(0, 128, size=7).tolist()
    # kv_lending off: the ring's unreached pages would add cache slots (tests/test_kv_lending.py)
    with Engine(plan, model, progress=False, refresh_steps=1, kv_lending=False) as engine:
        assert sorted(engine.experts.resident[0]) == [0, 1, 2, 3]
        engine.experts.counts[:, 4:] = 100
        out = engine.generate(prompt, max_new_tokens=4, return_logits=True)
        assert engine.stats()["experts_refreshed"] == 4 and sorted(engine.experts.resident[0]) == [4, 5, 6, 7]
        last_step_ids = engine.decode_ids[:, 0].copy()     # as its routing launches wrote them (no copy node)
    assert counting.bytes == [plan.device_bytes(0)]
    read = prompt + out.tokens[:-1]
    routes = reference.routing(model, read, plan.settings["kv"])
    np.testing.assert_array_equal(last_step_ids, [routes[block][len(read) - 1] for block in sorted(routes)])
    want = reference.forward(model, read)[len(prompt) - 1:]
    assert out.tokens == [int(np.argmax(row)) for row in want]
    assert np.linalg.norm(out.logits - want) / np.linalg.norm(want) < 1e-4


# Five plans: every expert cached (chunks of 128); none cached (chunks of 64 from here on); 2 of 8 with a 3-slot
# ring; 4 with a 5-slot ring and a K/V ring of 6 pages; 6. (The GPU test reads prompts in several chunks; chunk
# invariance is also each kernel's and each pass's own test.)
FIVE_PLANS = [(800, {}), (500, {}), (550, {"ring_slots": 3}),
              (600, {"chunk_tokens": 64, "ring_slots": 5, "kv_pages": 6}), (650, {})]


def test_the_five_plans_differ(folder, model):
    plans = [plan_for(folder, model, vram, **pins) for vram, pins in FIVE_PLANS]
    layouts = {(p.knobs["chunk_tokens"], p.knobs["kv_pages"], p.knobs["prefill_ring_slots"],
                p.knobs["expert_cache_slots"][0]) for p in plans}
    assert len(layouts) == 5, layouts


@pytest.fixture(scope="module")
def plain_pass(model):
    """(prompt, logits) from the lowered kernels with every expert in place and a plain page table
    (tests/passes.py): what every plan's engine must give, bitwise."""
    prompt = np.random.default_rng(12).integers(0, 128, size=12).tolist()
    return prompt, PassRunner(model, kv="f32", page_tokens=16).prefill(prompt, chunk=len(prompt))[-1]


@pytest.mark.parametrize("vram, pins", FIVE_PLANS, ids=["all-cached", "none-cached", "ring-3", "ring-5-kv-6", "six"])
def test_prompt_logits_are_bitwise_the_same_for_every_plan(folder, model, plain_pass, vram, pins):
    prompt, want = plain_pass
    with Engine(plan_for(folder, model, vram, **pins), model, progress=False) as engine:
        out = engine.generate(prompt, max_new_tokens=1, return_logits=True)
    assert np.array_equal(out.logits[0], want)


def test_a_reused_conversation_gives_the_logits_of_a_cold_read(folder, model, rng):
    """A warm read of a conversation's prefix gives bitwise the cold read's logits; the first request's
    logits are still its own after the two that followed."""
    plan = plan_for(folder, model, 600)
    first = rng.integers(0, 128, size=6).tolist()
    more = rng.integers(0, 128, size=3).tolist()
    first_logits = []
    with Engine(plan, model, progress=False) as engine:
        tokens = list(engine.stream(first, max_new_tokens=1, conversation="c1", logits=first_logits))
        kept = first_logits[0].copy()
        warm = engine.generate(first + tokens + more, max_new_tokens=1, conversation="c1", return_logits=True)
        assert warm.reused_tokens == len(first)
        cold = engine.generate(first + tokens + more, max_new_tokens=1, return_logits=True)
        assert cold.reused_tokens == 0
    assert np.array_equal(warm.logits, cold.logits)
    # a prompt's last logits come back through one pinned row the engine reuses: a request's stay its own
    assert np.array_equal(first_logits[0], kept) and not np.array_equal(cold.logits[0], kept)


def test_a_request_longer_than_the_kv_ring_reads_older_pages_from_the_host_copy(folder, model, rng):
    """A K/V ring of 3 pages of 4 positions: 16 prompt tokens in two chunks (page 3 takes page 0's slot) and a
    decode step at position 16 (page 4 takes page 1's): the reference's greedy tokens. Then the same prompt in the
    same conversation reads only its last position and finds pages 0 and 1 in the host copy, not in the slots
    pages 3 and 4 took: the reference's logits."""
    plan = plan_for(folder, model, 600, page_tokens=4, chunk_tokens=8, kv_pages=3)
    prompt = rng.integers(0, 128, size=16).tolist()
    with Engine(plan, model, progress=False) as engine:
        assert engine.kv_ring.host
        out = engine.generate(prompt, max_new_tokens=2, conversation="c", return_logits=True)
        warm = engine.generate(prompt, max_new_tokens=1, conversation="c", return_logits=True)
    assert warm.reused_tokens == len(prompt) - 1
    want = reference.forward(model, prompt + out.tokens[:-1])[len(prompt) - 1:]
    assert out.tokens == [int(np.argmax(row)) for row in want]
    for got in (out.logits, warm.logits):
        assert np.linalg.norm(got - want[:len(got)]) / np.linalg.norm(want[:len(got)]) < 1e-4


def test_bad_requests_are_refused_and_the_engine_stays_usable(folder, model, rng):
    plan = plan_for(folder, model, 600, chunk_tokens=64, kv_pages=6)
    prompt = rng.integers(0, 128, size=5).tolist()
    with Engine(plan, model, progress=False) as engine:
        with pytest.raises(StratumError, match="outside the vocabulary"):
            engine.generate([1, 999])
        with pytest.raises(StratumError, match="exceed the plan's context of 256 positions"):
            engine.generate(prompt, max_new_tokens=252)
        with pytest.raises(StratumError, match="empty"):
            engine.generate([])
        cancelled = engine.stream(prompt, max_new_tokens=5, conversation="c")
        next(cancelled)
        cancelled.close()
        out = engine.generate(prompt, max_new_tokens=1, conversation="c", return_logits=True)
    assert out.reused_tokens == len(prompt) - 1
    want = reference.forward(model, prompt)[-1]
    assert out.tokens == [int(np.argmax(want))]


def test_a_q4_k_m_type_mix_gives_the_references_greedy_tokens(folder, tmp_path, rng):
    """A model with a Q4_K_M file's types where its rows allow (K-quant rows are whole 256-value blocks: the
    attention output in Q4_K; the routed experts' down projections in Q6_K in block 0 and Q4_K in block 1, as
    Q4_K_M gives some blocks more bits), 2 of each block's 8 experts cached and the rest in the host copy, so
    slots of one size serve both types: the reference's greedy tokens and logits."""
    model = write_model(tmp_path / "k-quants.gguf", "qwen3moe", seed=7, n_trunk=2, n_head=4, n_head_kv=2,
                        head_dim=64, n_ff_exp=256, types={"attn_output": "q4_k", "ffn_down_exps": "q6_k",
                                                          "blk.1.ffn_down_exps.weight": "q4_k"})
    plan = plan_for(folder, model, 2000)
    assert plan.knobs["expert_cache_slots"][0] == 4
    prompt = rng.integers(0, 96, size=5).tolist()
    with Engine(plan, model, progress=False) as engine:
        assert [w.ggml_type for w in engine.experts.slot_weights(1)] == [T.F32, T.F32, T.Q4_K]
        assert engine.experts.slot_weights(0)[2].ggml_type == T.Q6_K
        out = engine.generate(prompt, max_new_tokens=2, return_logits=True)
    want = reference.forward(model, prompt + out.tokens[:-1])[len(prompt) - 1:]
    assert out.tokens == [int(np.argmax(row)) for row in want]
    assert np.linalg.norm(out.logits - want) / np.linalg.norm(want) < 1e-4


def test_a_gate_and_up_of_two_types_are_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    model = write_model(tmp_path / "mixed.gguf", "qwen3moe", seed=7, n_trunk=1, types={"ffn_up_exps": "q8_0"})
    plan = plan_for(tmp_path, model, 1300)
    monkeypatch.setattr(engine_module, "DeviceArena", None)     # an allocation would fail loudly
    with pytest.raises(StratumError, match=r"mixed.gguf: blk.0.ffn_gate_exps.weight is F32 but "
                                           r"blk.0.ffn_up_exps.weight is Q8_0: the SwiGLU kernel reads"):
        Engine(plan, model, progress=False)


def test_a_file_with_a_type_no_kernel_reads_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    """A Q3_K_M-like file's Q3_K tensors (a Q4_K_M card with Q3_K where it has Q6_K; here a partial
    download's header: its data is never read)."""
    from plans import MODELS_DIR
    from tests.ggufs import write_header_only
    card = tmp_path / "qwen3-30b-a3b-q3_k.yaml"
    card.write_text((MODELS_DIR / "qwen3-30b-a3b-q4_k_m.yaml").read_text().replace("q6_k", "q3_k"))
    path = tmp_path / "partial.gguf"
    write_header_only(card, path)
    plan = solve(hardware="rtx-2060-super-8g", model=path, context=4096, kv="q8_0")
    monkeypatch.setattr(engine_module, "DeviceArena", None)     # an allocation would fail loudly
    with pytest.raises(StratumError, match=r"partial.gguf: 49 of its 579 tensors are Q3_K, which no kernel reads "
                                           r"yet \(the first: output.weight\)"):
        Engine(plan, path)


def test_a_plan_for_another_model_is_refused(folder, model, tmp_path):
    other = write_model(tmp_path / "other.gguf", "qwen3moe", seed=6, n_trunk=1, n_expert=4)
    with pytest.raises(StratumError, match="this plan was made for model"):
        Engine(plan_for(folder, model, 600), other, progress=False)


@pytest.mark.gpu
def test_gpu_five_plans_decode_conversations_and_allocation(tmp_path, rng):
    """On the H200, a glm4moe of 512-wide blocks with Q8_0 weights and q8_0 K/V under five plans (64, 28, 7
    and 1 of 64 experts cached; prefill rings of 2, 3 and 6 slots; chunks of 256, 128 and 64; a K/V ring of
    10 pages): device allocations equal to each plan, prompt and decode logits bitwise equal across plans,
    greedy tokens the reference's over 20 captured steps (the cache refreshes at step 16), and a reused
    conversation bitwise a cold read."""
    model = write_model(tmp_path / "mid.gguf", "glm4moe", seed=7, n_trunk=3, n_embd=512, n_head=8, n_head_kv=2,
                        head_dim=64, n_rot=32, n_ff=1024, n_ff_exp=256, n_expert=32, n_expert_used=4,
                        n_vocab=4096, types={"experts": "q8_0", "dense": "q8_0"})
    settings = [(60000, {}), (40000, {}), (30000, {}), (32000, {"ring_slots": 3}),
                (28000, {"chunk_tokens": 64, "kv_pages": 10, "ring_slots": 6})]
    plans = [solve(write_profile(tmp_path, vram), model, context=1024, kv="q8_0", page_tokens=16, pins=pins)
             for vram, pins in settings]
    prompt = rng.integers(0, 4096, size=100).tolist()
    results = []
    for plan in plans:
        counting = CountingAllocations(pytest.MonkeyPatch())
        with Engine(plan, model, progress=False) as engine:
            results.append(engine.generate(prompt, max_new_tokens=20, return_logits=True))
            assert counting.bytes == [plan.device_bytes(0)]
            if plan is plans[1]:
                more = rng.integers(0, 4096, size=5).tolist()
                follow = prompt + results[-1].tokens + more
                engine.generate(prompt, max_new_tokens=1, conversation="c")
                warm = engine.generate(follow, max_new_tokens=1, conversation="c", return_logits=True)
                cold = engine.generate(follow, max_new_tokens=1, return_logits=True)
                assert warm.reused_tokens == len(prompt) and np.array_equal(warm.logits, cold.logits)
                assert engine.stats()["experts_refreshed"] > 0
    want = reference.forward(model, prompt + results[0].tokens[:-1], kv_type="q8_0")[len(prompt) - 1:]
    assert results[0].tokens == [int(np.argmax(row)) for row in want]
    for other in results[1:]:
        assert other.tokens == results[0].tokens
        assert np.array_equal(other.logits, results[0].logits)


@pytest.mark.gpu
def test_gpu_a_second_process_loads_every_kernel_from_the_disk_cache(tmp_path, rng):
    """On the H200, `stratum run` twice in fresh processes over one kernel cache, on a glm4moe whose plan streams
    experts through the prefill ring and misses the expert cache: the first process compiles every kernel and
    stores each one (none is left uncached), the second loads every one and compiles none, and both print the
    same tokens."""
    import os
    import re
    import subprocess
    import sys
    model = write_model(tmp_path / "mid.gguf", "glm4moe", seed=9, n_trunk=3, n_embd=512, n_head=8, n_head_kv=2,
                        head_dim=64, n_rot=32, n_ff=1024, n_ff_exp=256, n_expert=32, n_expert_used=4,
                        n_vocab=4096, types={"experts": "q8_0", "dense": "q8_0"})
    plan_path = tmp_path / "plan.yaml"
    solve(write_profile(tmp_path, 28000), model, context=1024, kv="q8_0", page_tokens=16,
          pins={"chunk_tokens": 64}).save(plan_path)
    prompt = ",".join(map(str, rng.integers(0, 4096, size=100)))
    command = [sys.executable, "-c", "import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))",
               "run", "--plan", str(plan_path), "--model", str(model), "--quiet", "--max-new-tokens", "8",
               "--prompt-ids", prompt]
    env = dict(os.environ, STRATUM_KERNEL_CACHE=str(tmp_path / "kernels"))
    runs = [subprocess.run(command, env=env, capture_output=True, text=True, timeout=600) for _ in range(2)]
    for run in runs:
        print(run.stderr.splitlines()[-1])
        assert run.returncode == 0, run.stderr
    counts = [dict((how, int(n)) for n, how in re.findall(r"(\d+) (loaded|compiled, not cached|compiled)\b",
                                                         run.stderr.split("kernels (")[-1].split(")")[0]))
              for run in runs]
    assert counts[0].get("compiled", 0) > 10 and "loaded" not in counts[0] and "compiled, not cached" not in counts[0]
    assert counts[1] == {"loaded": counts[0]["compiled"]}
    assert runs[0].stdout.split() == runs[1].stdout.split() and len(runs[0].stdout.split()) == 8


def test_stratum_run_refuses_bad_input_in_one_line(folder, model, tmp_path, capsys):
    from planner.cli import main
    plan_path = tmp_path / "plan.yaml"
    plan_for(folder, model, 600).save(plan_path)
    other = write_model(tmp_path / "other.gguf", "qwen3moe", seed=8, n_trunk=1, n_expert=4)
    assert main(["run", "--plan", str(plan_path), "--model", str(model), "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids takes token ids" in capsys.readouterr().err
    assert main(["run", "--plan", str(plan_path), "--model", str(other), "--prompt-ids", "1,2"]) == 2
    assert "this plan was made for model" in capsys.readouterr().err


def test_stratum_run_prints_the_greedy_token_and_the_time_to_the_first(folder, model, tmp_path, capsys, rng):
    from planner.cli import main
    plan_path = tmp_path / "plan.yaml"
    plan_for(folder, model, 800).save(plan_path)
    prompt = rng.integers(0, 128, size=5).tolist()
    capsys.readouterr()         # the seed line
    assert main(["run", "--plan", str(plan_path), "--model", str(model), "--quiet", "--max-new-tokens", "1",
                 "--prompt-ids", ",".join(map(str, prompt))]) == 0
    out = capsys.readouterr()
    assert out.out.split() == [str(int(np.argmax(reference.forward(model, prompt)[-1])))]
    assert "first token" in out.err and "s after the command started" in out.err



# ---------------------------------------------------------------------------------------------------------
# MTP speculative decoding (the glm4moe NextN drafter)

def mtp_model(folder):
    """The smallest glm4moe with a drafter: one MoE trunk block and the NextN block, one kv head, 4 experts
    (a simulated decode window's cost is mostly its attention and MoE blocks)."""
    return write_model(folder / "mtp.gguf", "glm4moe", seed=13, n_trunk=1, n_leading_dense=0, n_vocab=64, n_head=2,
                       n_head_kv=1, n_expert=4)


def test_greedy_tokens_with_drafting_are_bitwise_those_without(folder, tmp_path, rng, monkeypatch):
    """Drafts (depth 2) decide only how many tokens a verify window accepts: the tokens and every logit row are
    bitwise those of step-by-step decoding (the second request reuses the first's prompt, so it reads one
    token), and the engine counts the drafts it checked. Then a decode window and a draft step make exactly
    the Python driver calls the planner prices (planner.predict's *_HOST_CALLS)."""
    model = mtp_model(tmp_path)
    plan = solve(write_profile(folder, 2000), model, context=128, kv="f32", page_tokens=16)
    assert plan.settings["mtp"] and plan.knobs["drafter_kv_pages"] > 0
    prompt = rng.integers(0, 64, size=4).tolist()
    with Engine(plan, model, progress=False) as engine:
        plain = engine.generate(prompt, max_new_tokens=4, conversation="c", return_logits=True, draft_depth=0)
        drafted = engine.generate(prompt, max_new_tokens=4, conversation="c", return_logits=True, draft_depth=2)
        stats = engine.stats()
        calls, nested = [], [0]

        def counted(function):      # calls from Python only: the simulator runs a replay's copies in Python
            def call(*args, **kwargs):
                if not nested[0]:
                    calls.append(function.__name__)
                nested[0] += 1
                try:
                    return function(*args, **kwargs)
                finally:
                    nested[0] -= 1
            return call
        for module in (engine_module, kv_ring_module):
            monkeypatch.setattr(module, "copy_rows", counted(module.copy_rows))
        monkeypatch.setattr(CapturedGraph, "replay", counted(CapturedGraph.replay))
        engine._verify([plain.tokens[0]], len(prompt))          # pages already claimed: no table copy
        assert len(calls) == WINDOW_HOST_CALLS, calls        # the drafter's hidden states too
        calls.clear()
        engine._draft(plain.tokens[0], len(prompt) - 1, 1)
        assert len(calls) == DRAFT_STEP_HOST_CALLS, calls
    assert drafted.reused_tokens == len(prompt) - 1
    assert drafted.tokens == plain.tokens and np.array_equal(drafted.logits, plain.logits)
    assert stats["draft_windows"] >= 1 and stats["drafted_tokens"] >= 2       # the first window drafts 2
    assert stats["decode_tokens"] == 6
    want = reference.forward(model, prompt + plain.tokens[:-1])[len(prompt) - 1:]
    assert plain.tokens == [int(np.argmax(row)) for row in want]


def test_draft_depths_the_engine_cannot_run_are_refused(folder, model, tmp_path):
    with Engine(plan_for(folder, model, 800), model, progress=False) as engine:        # qwen3moe: no NextN
        with pytest.raises(StratumError, match="no drafter .the model has no NextN layer"):
            engine.generate([1, 2], max_new_tokens=2, draft_depth=1)
        assert engine.stats().get("draft_windows") is None
    drafting = mtp_model(tmp_path)
    plan = solve(write_profile(folder, 2000), drafting, context=128, kv="f32", page_tokens=16)
    with Engine(plan, drafting, progress=False) as engine:
        with pytest.raises(StratumError, match="draft_depth 5: 0 .off. to 4"):
            engine.generate([1, 2], max_new_tokens=2, draft_depth=5)
    no_mtp = solve(write_profile(folder, 2000), drafting, context=128, kv="f32", page_tokens=16, mtp=False)
    with Engine(no_mtp, drafting, progress=False) as engine:
        with pytest.raises(StratumError, match="made without speculative decoding"):
            engine.generate([1, 2], max_new_tokens=2, draft_depth=2)


def test_accepted_drafts_are_the_leading_ones_the_window_confirms():
    from runtime.drafter import accepted_drafts
    assert accepted_drafts([5, 7, 9], np.array([5, 7, 1, 4])) == 2
    assert accepted_drafts([5, 7, 9], np.array([6, 7, 9, 4])) == 0
    assert accepted_drafts([5, 7, 9], np.array([5, 7, 9, 4])) == 3
    assert accepted_drafts([], np.array([3])) == 0


@pytest.mark.gpu
def test_gpu_drafting_at_every_depth_gives_the_tokens_and_logits_of_single_steps(tmp_path, rng):
    """On the H200, a glm4moe of 512-wide blocks with a NextN drafter, under a plan whose experts and K/V ring
    are smaller than the model's: 24 greedy tokens after a 200-token prompt with draft depths 1 to 4 are bitwise
    those of depth 0 (tokens and every logit row), and the drafter's windows are counted."""
    model = write_model(tmp_path / "mtp.gguf", "glm4moe", seed=17, n_trunk=3, n_embd=512, n_head=8, n_head_kv=2,
                        head_dim=64, n_rot=32, n_ff=1024, n_ff_exp=256, n_expert=32, n_expert_used=4,
                        n_vocab=4096, types={"experts": "q8_0", "dense": "q8_0"})
    plan = solve(write_profile(tmp_path, 40000), model, context=1024, kv="q8_0", page_tokens=16,
                 pins={"chunk_tokens": 64, "kv_pages": 10})     # 35 of 96 experts cached, 144 positions resident
    prompt = rng.integers(0, 4096, size=200).tolist()
    with Engine(plan, model, progress=False) as engine:
        plain = engine.generate(prompt, max_new_tokens=24, return_logits=True, draft_depth=0)
        for depth in range(1, 5):
            drafted = engine.generate(prompt, max_new_tokens=24, return_logits=True, draft_depth=depth)
            assert drafted.tokens == plain.tokens, depth
            assert np.array_equal(drafted.logits, plain.logits), depth
        stats = engine.stats()
    print(stats)
    assert stats["draft_windows"] > 0 and stats["drafted_tokens"] >= stats["draft_windows"]


def test_speculative_sampling_emits_the_targets_distribution(rng):
    """Drafts drawn from q and kept with probability min(1, p/q), a rejection resampled from max(0, p - q): the
    first emitted token is distributed as p_0 and a kept draft's follower as p_1, whatever q (fresh random
    distributions over 6 tokens, 40000 draws: each frequency within 0.015 of its probability, > 4 sigma).
    Half of q_0 is p_0, so that at least half the first drafts are kept and p_1 is checked on 20000 followers or
    more: a free q_0 kept too few of them one draw in 2000 (fewer than 4000, or 0.015 under 2 sigma); the other
    half of q_0 still differs from p_0, so about a fifth of the drafts are resampled from the residual."""
    from runtime.drafter import speculative_accept
    vocab, draws = 6, 40000
    p = rng.dirichlet(np.ones(vocab), size=3)
    q = rng.dirichlet(np.ones(vocab), size=2)
    q[0] = (q[0] + p[0]) / 2
    first, second = np.zeros(vocab), np.zeros(vocab)
    for _ in range(draws):
        drafts = [int(rng.choice(vocab, p=q[0])), int(rng.choice(vocab, p=q[1]))]
        kept, last = speculative_accept(drafts, list(q), list(p), rng)
        emitted = drafts[:kept] + [last]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    assert np.abs(first / draws - p[0]).max() < 0.015
    assert second.sum() > draws / 3 and np.abs(second / second.sum() - p[1]).max() < 0.015
