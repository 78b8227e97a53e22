"""The calibration's fit (runtime.calibration_fit.fit): what `stratum profile --detect` writes for a kernel family is
the latency and efficiency its nodes' times say. The measuring itself needs a GPU (BENCHMARKS.md)."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from codegen.cost import tiled_s, tiled_sm_s
from codegen.graph import Tiling
from planner.profile import KernelFit, Kernels, load_profile, parse_profile
from planner.search import PAGE_TOKENS
from runtime.calibrate import CALIBRATION_BLOCKS, SMALL_CONTEXTS, SMALL_SHAPE, RingBatches, ring_batch_s, uncached_plan
from runtime.calibration_fit import FURTHER_TILE_GRID, Sample, fit, fit_families, fit_tiled, fit_walk, sample_s
from runtime.detect import kernels_document
from runtime.synthetic import reduced_card


def test_fit_recovers_latency_and_efficiency(rng):
    efficiency, latency_s = rng.uniform(0.1, 0.95), rng.uniform(1e-6, 2e-5)
    rooflines = rng.uniform(1e-7, 3e-4, size=12)
    found = fit(rooflines, latency_s + rooflines / efficiency)
    assert found.efficiency == pytest.approx(efficiency, rel=1e-6)
    assert found.latency_s == pytest.approx(latency_s, rel=1e-6)


def test_fit_never_beats_the_roofline_or_goes_below_zero_latency(rng):
    rooflines = rng.uniform(1e-6, 1e-4, size=8)
    faster = fit(rooflines, 0.5 * rooflines + 3e-6)           # kernels "faster" than the roofline
    assert faster.efficiency == 1.0 and faster.latency_s >= 0
    scaled = fit(rooflines, rooflines / 0.25 - 1e-7)           # would need a negative latency
    assert scaled.latency_s == 0.0 and scaled.efficiency == pytest.approx(0.25, rel=0.05)
    assert np.isfinite(scaled.efficiency)


def test_a_kernel_far_below_its_roofline_is_written_so_that_it_reads_back(rng):
    """A one-block kernel's fit (the grouping's: ~1e-4 of its roofline) must survive the profile's writing:
    rounded to 3 decimals it read back as 0, which the profile parser refuses."""
    rooflines = rng.uniform(1e-8, 1e-7, size=6)
    grouping = fit(rooflines, rooflines / 1.3e-4)
    assert grouping.efficiency == pytest.approx(1.3e-4, rel=1e-6)
    document = yaml.safe_load((Path(__file__).parents[1] / "plans/hardware/h200-141g.yaml").read_text())
    document["gpus"][0]["kernels"] = kernels_document(Kernels(prefill_grouping=grouping))
    profile = parse_profile(yaml.safe_load(yaml.safe_dump(document)), source="test")
    assert profile.gpus[0].kernels.prefill_grouping.efficiency == pytest.approx(1.3e-4, rel=1e-2)


def test_the_host_experts_family_is_left_out_until_calibrated_and_reads_back(rng):
    """`decode_host_experts` is None in a profile that never measured it (the planner then prices the link's
    latency a load round), and is written and read back once fitted."""
    document = yaml.safe_load((Path(__file__).parents[1] / "plans/hardware/h200-141g.yaml").read_text())
    document["gpus"][0]["kernels"].pop("decode_host_experts", None)
    assert "decode_host_experts" not in kernels_document(Kernels())
    assert parse_profile(document, source="test").gpus[0].kernels.decode_host_experts is None
    host = KernelFit(efficiency=float(rng.uniform(0.2, 0.9)), latency_s=float(rng.uniform(2e-6, 9e-6)))
    document["gpus"][0]["kernels"] = kernels_document(Kernels(decode_host_experts=host))
    read = parse_profile(yaml.safe_load(yaml.safe_dump(document)), source="test").gpus[0].kernels.decode_host_experts
    assert read.efficiency == pytest.approx(host.efficiency, rel=1e-2)
    assert read.latency_s == pytest.approx(host.latency_s, rel=1e-2)


def test_the_uncached_calibration_plan_caches_no_expert_and_keeps_every_kv_page():
    """`uncached_plan`: the small calibration model on the smallest budget that holds it, so every decode
    expert launch reads the host copy; its whole context's K/V stays in VRAM (attention reads no host K/V)."""
    profile = load_profile("h200-141g")
    with tempfile.TemporaryDirectory() as folder:
        card = reduced_card(CALIBRATION_BLOCKS, Path(folder), metadata=SMALL_SHAPE)
        context = max(SMALL_CONTEXTS) + PAGE_TOKENS
        plan = uncached_plan(profile, card, context, SMALL_CONTEXTS[0])
        assert plan.knobs["expert_cache_slots"] == [0]
        assert plan.knobs["kv_resident_tokens"] >= context


def test_fit_gives_a_familys_nodes_their_measured_total(rng):
    """Nodes of one family that follow no straight line (small ones dominated by launch cost, large ones a bit
    below the roofline's pace): the fitted times still add up to the measured ones, what a pass's prediction
    sums."""
    rooflines = np.concatenate([rng.uniform(1e-6, 1e-5, size=30), rng.uniform(2e-4, 1e-3, size=6)])
    measured = 2e-5 + rooflines / 0.7 + rng.uniform(0, 1e-5, size=rooflines.size) * (rooflines > 1e-4) ** 2
    found = fit(rooflines, measured)
    assert 0 < found.efficiency <= 1 and found.latency_s >= 0
    assert np.sum(found.latency_s + rooflines / found.efficiency) == pytest.approx(np.sum(measured), rel=1e-9)


def _attention_nodes(rng, truth: KernelFit, contexts) -> tuple:
    """(rooflines, contexts, times) of prefill attention nodes of one-chunk prompts priced by `truth`, their
    causal FLOPs' roofline quadratic in the rows (8 heads of 64 dims at 52 TFLOPS), 1% noise."""
    contexts = np.repeat(np.asarray(contexts, float), 4)
    rooflines = contexts * (contexts + 1) / 2 * 8 * 256 / 52e12
    times = truth.latency_s + np.maximum(rooflines / truth.efficiency, truth.walk_token_s * contexts)
    return rooflines, contexts, times * rng.uniform(0.995, 1.005, size=times.size)


def test_fit_walk_recovers_a_walk_bound_short_chunk_and_a_flop_bound_long_one(rng):
    """Short chunks take the walk of their last rows through the context (one wave of blocks), a long one its
    FLOPs: three lengths give the latency, efficiency and walk back, and price a length between them."""
    # (the 4096-row chunk FLOP-bound: 330 us of FLOPs over 0.2-0.3 against a walk of at most 0.82 ms)
    truth = KernelFit(efficiency=rng.uniform(0.2, 0.3), latency_s=rng.uniform(3e-6, 1.2e-5),
                      walk_token_s=rng.uniform(1.5e-7, 2e-7))
    rooflines, contexts, times = _attention_nodes(rng, truth, [256, 512, 4096])
    found = fit_walk(rooflines, contexts, times)
    # 0.5% noise, absolute errors: the 4096-row nodes' few us of noise move the latency, the walk a few percent
    assert found.walk_token_s == pytest.approx(truth.walk_token_s, rel=0.08)
    assert found.efficiency == pytest.approx(truth.efficiency, rel=0.02)
    rooflines, contexts, times = _attention_nodes(rng, truth, [768])
    priced = [sample_s(Kernels(prefill_l2_attention=found), Sample("prefill_l2_attention", "a", r, t, None, int(c)))
              for r, c, t in zip(rooflines, contexts, times)]
    assert priced == pytest.approx(times, rel=0.04)


def test_fit_walk_needs_three_contexts_and_keeps_the_fits_bounds(rng):
    """Two lengths cannot tell a walk from a latency and an efficiency: the plain fit, no walk. Times faster
    than the roofline give efficiency 1 and no negative latency."""
    truth = KernelFit(efficiency=0.3, latency_s=8e-6, walk_token_s=2e-7)
    rooflines, contexts, times = _attention_nodes(rng, truth, [512, 4096])
    assert fit_walk(rooflines, contexts, times) == fit(rooflines, times)
    rooflines, contexts, _ = _attention_nodes(rng, truth, [256, 512, 4096])
    faster = fit_walk(rooflines, contexts, 0.5 * rooflines)
    assert faster.efficiency == 1.0 and faster.latency_s >= 0.0 and faster.walk_token_s >= 0.0


def test_the_l2_attention_family_is_fitted_with_its_walk(rng):
    """fit_families gives prefill attention its walk where its samples span three contexts."""
    truth = KernelFit(efficiency=0.28, latency_s=9e-6, walk_token_s=1.9e-7)
    rooflines, contexts, times = _attention_nodes(rng, truth, [256, 512, 4096])
    samples = [Sample("prefill_l2_attention", f"blk.{i % 4}.attention", r, t, None, int(c))
               for i, (r, c, t) in enumerate(zip(rooflines, contexts, times))]
    found = fit_families(samples)["prefill_l2_attention"]
    assert found.walk_token_s == pytest.approx(truth.walk_token_s, rel=0.08)


def test_a_walk_is_written_so_that_it_reads_back():
    """detect writes a prefill attention family's walk into the profile; the parser reads it back."""
    walked = KernelFit(efficiency=0.275, latency_s=8.2e-6, walk_token_s=1.93e-7)
    document = yaml.safe_load((Path(__file__).parents[1] / "plans/hardware/h200-141g.yaml").read_text())
    document["gpus"][0]["kernels"] = kernels_document(Kernels(prefill_l2_attention=walked))
    kernels = parse_profile(yaml.safe_load(yaml.safe_dump(document)), source="test").gpus[0].kernels
    assert kernels.prefill_l2_attention.walk_token_s == pytest.approx(1.93e-7, rel=1e-3)
    assert kernels.prefill_attention.walk_token_s == 0.0


def _tiled_nodes(rng, n: int):
    """Tile terms of `n` prefill nodes like the calibration's: 64- and 128-row tiles, 512 to 4096 wide, 1-40
    waves (codegen.cost.tile_terms on a 132-SM GPU at 52 TFLOPS)."""
    rows, width = rng.choice([64, 128], size=n), rng.choice([512, 768, 2048, 4096], size=n)
    return [(float(rng.integers(1, 41)), 2.0 * r * 128 * w * 132 / 52e12, 128.0 * w) for r, w in zip(rows, width)]


def test_fit_tiled_recovers_the_tile_model(rng):
    """Nodes priced by codegen.cost.tiled_sm_s from drawn parameters (the further-tile fraction one of the fit's
    grid) give those parameters back."""
    truth = KernelFit(efficiency=rng.uniform(0.4, 0.95), latency_s=rng.uniform(2e-6, 2e-5),
                      weight_element_s=rng.uniform(1e-10, 5e-10),
                      further_tile=float(rng.choice(FURTHER_TILE_GRID[10:-5])))
    tiles = _tiled_nodes(rng, 24)
    times = [truth.latency_s + float(tiled_sm_s(truth, *t)) for t in tiles]
    found = fit_tiled(tiles, times)
    assert found.further_tile == truth.further_tile
    for name in ("efficiency", "latency_s", "weight_element_s"):
        assert getattr(found, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_fit_tiled_keeps_a_given_weight_element_and_its_bounds(rng):
    """The routed experts take the matmuls' weight element (their tiles are one shape); no fit beats the FP32
    peak or takes a negative latency."""
    tiles = _tiled_nodes(rng, 16)
    faster = [0.3 * (t[1] * (1 + 0.8 * (t[0] - 1))) for t in tiles]     # faster than the peak, no latency
    found = fit_tiled(tiles, faster, weight_element_s=2e-10)
    assert found.weight_element_s == 2e-10 and found.efficiency == 1.0 and found.latency_s >= 0.0


def test_each_passs_routed_experts_take_its_own_matmuls_weight_element(rng):
    """The large model's experts take `prefill_matmul`'s weight element, the small model's (`prefill_l2_*`)
    `prefill_l2_matmul`'s: two models' matmuls, each fitted to its own tiles."""
    samples = []
    for prefix, weight_element_s in (("prefill", 3e-10), ("prefill_l2", 1e-10)):
        truth = KernelFit(efficiency=0.8, latency_s=4e-6, weight_element_s=weight_element_s,
                          further_tile=float(FURTHER_TILE_GRID[40]))
        for family, count in ((f"{prefix}_matmul", 24), (f"{prefix}_experts", 8)):
            for tiles in _tiled_nodes(rng, count):
                measured = truth.latency_s + float(tiled_sm_s(truth, *tiles)) * rng.uniform(0.97, 1.03)
                samples.append(Sample(family, "node", 0.0, measured, tiles))
    fits = fit_families(samples)
    for prefix in ("prefill", "prefill_l2"):
        assert fits[f"{prefix}_experts"].weight_element_s == fits[f"{prefix}_matmul"].weight_element_s
    assert fits["prefill_l2_matmul"].weight_element_s < fits["prefill_matmul"].weight_element_s


def test_ring_batch_latency_is_what_batches_add_beyond_their_tiles(rng):
    """Batched launches timed at what the tile model prices their smaller grids at, plus a drawn latency per
    batch after the first: that latency is what `ring_batch_s` gives back (and 0 for one batch)."""
    gpu = load_profile("h200-141g").gpus[0]
    experts = gpu.kernels.prefill_experts
    tilings = (Tiling(64, 12, 2048), Tiling(64, 16, 768))
    ranges = rng.integers(4, 16, size=32)
    extra = rng.uniform(2e-6, 4e-5)

    def once(tiles):
        return sum(float(tiled_s(experts, gpu, t, tiles * t.col_tiles, 0.0)) for t in tilings)
    once_s = once(ranges.sum())
    batched_s = sum(once(r) - 2 * experts.latency_s for r in ranges) + 2 * experts.latency_s + 31 * extra
    measured = RingBatches(once_s, batched_s, ranges.tolist(), tilings)
    assert ring_batch_s(measured, gpu, experts) == pytest.approx(extra, rel=1e-6)
    assert ring_batch_s(RingBatches(once_s, once_s, [int(ranges.sum())], tilings), gpu, experts) == 0.0
