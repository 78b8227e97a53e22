"""`stratum trace` (runtime.commands.trace, Engine.trace): a file's prompts served and written as a workload that
the planner reads: the prompts' lengths, the tokens generated, and every MoE block's routing counts."""

import numpy as np

from planner.cli import main
from planner.search import solve
from planner.workload import load_workload
from runtime.synthetic import write_model
from tests.test_engine import write_profile

K = 2           # the tiny qwen3moe's experts a token


def test_a_trace_counts_every_routing_and_the_planner_plans_for_it(tmp_path, rng, capsys):
    model = write_model(tmp_path / "qwen.gguf", "qwen3moe", seed=4, n_trunk=1)
    profile = write_profile(tmp_path, 800)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (5, 3, 5)]
    (tmp_path / "prompts.txt").write_text("\n".join(",".join(map(str, p)) for p in prompts) + "\n\n")
    out = tmp_path / "trace.yaml"
    assert main(["trace", "--model", str(model), "--hardware", profile, "--prompts", str(tmp_path / "prompts.txt"),
                 "--max-new-tokens", "2", "--quiet", "-o", str(out)]) == 0
    assert "3 prompts" in capsys.readouterr().err
    workload = load_workload(out)
    assert dict(workload.prompts) == {3: 1.0, 5: 2.0} and workload.decode_tokens == 2
    histogram = np.asarray(workload.histogram)
    # every prompt token and every decode step (one a request: its second token) routes K experts a block
    assert histogram.shape == (1, 8) and histogram.sum() == K * (sum(map(len, prompts)) + len(prompts))
    plan = solve(profile, model, context=256, workload=workload)
    assert np.array_equal(plan.settings["workload"]["expert_popularity"]["histogram"], histogram)


def test_a_traced_plan_starts_the_cache_with_the_most_routed_experts(tmp_path, rng):
    """A plan solved from a histogram (the plan records it) fills a 5-slot cache with the histogram's 5 most
    routed experts, not the lowest ids, and counts it as the frequency policy's prior; placement changes
    where an expert is read from, never a logit."""
    from planner.workload import Workload
    from runtime.engine import Engine
    from runtime.experts import PRIOR_ROUTINGS

    model = write_model(tmp_path / "qwen.gguf", "qwen3moe", seed=4, n_trunk=1)
    profile = write_profile(tmp_path, 560)
    counts = rng.permutation(8) + 1.0               # distinct counts: the hottest five are one set
    traced = solve(profile, model, context=256, workload=Workload(prompts=((8, 1.0),), decode_tokens=3,
                                                                  histogram=tuple(counts)))
    untraced = solve(profile, model, context=256, workload=Workload(prompts=((8, 1.0),), decode_tokens=3))
    assert traced.knobs["expert_cache_slots"] == untraced.knobs["expert_cache_slots"] == [5]
    prompt = rng.integers(0, 128, size=8).tolist()
    outputs = []
    for plan, expected in ((traced, set(np.argsort(-counts)[:5].tolist())), (untraced, set(range(5)))):
        with Engine(plan, model, progress=False) as engine:
            (block,) = engine.experts.blocks
            assert set(engine.experts.resident[block]) == expected
            table = engine.experts.decode_tables[block].copy_to_host()
            assert set(np.flatnonzero(table >= 0).tolist()) == expected
            outputs.append(engine.generate(prompt, max_new_tokens=2, return_logits=True))
        if plan is traced:      # the prior, and the one decode step's routings
            assert np.isclose(engine.experts.counts[0].sum(), PRIOR_ROUTINGS + K)
    assert outputs[0].tokens == outputs[1].tokens
    assert np.array_equal(outputs[0].logits, outputs[1].logits)


def test_trace_refuses_bad_prompts_in_one_line(tmp_path, capsys):
    model = write_model(tmp_path / "qwen.gguf", "qwen3moe", seed=4, n_trunk=1)
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "text.txt").write_text("def f():\n")
    for prompts, extra, message in (("empty.txt", [], "has no prompt"),
                                    ("text.txt", ["--text"], "--text needs a byte-level vocabulary"),
                                    ("text.txt", [], "takes token ids"), ("missing.txt", [], "cannot read")):
        code = main(["trace", "--model", str(model), "--hardware", "h200-141g", "--prompts", str(tmp_path / prompts),
                     "-o", str(tmp_path / "t.yaml"), *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (prompts, err)
