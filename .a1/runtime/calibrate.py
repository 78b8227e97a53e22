"""Calibration: how this project's kernels run on this GPU, one fit per kernel family (`planner.profile.Kernels`).
This module times the nodes on the GPU; the fits named below (`fit`, `fit_tiled`, `fit_walk`, `fit_ring_host`)
are `runtime.calibration_fit`'s, which need no GPU.

A Qwen3-30B-A3B-shaped model at Q8_0 with a few blocks (random weights with skewed routing, built in memory)
reads prompts of one chunk (2048 and 512 tokens) under a plan that keeps every expert and the whole context's
K/V in VRAM. After each, every node of that pass is timed between events; so is a decode step after 2048 and
after 16384 positions (decode attention's time grows with the context: one context alone cannot tell its
latency from its efficiency). Nodes are timed while a spinning kernel holds the GPU, so they run back to back
as in a replayed graph; the events' own cost (the summed node times less the step replayed without events, per
node) is taken off each decode node. Each node's roofline is the cost model's
(`codegen.cost.node_roofline_s` at the measured bandwidth and FP32 peak), and a family's fit is the latency and
efficiency that give its nodes' times best (least squares on absolute error, `fit`): time = latency +
roofline / efficiency. The tiled families (prefill's matmuls and routed experts) are fitted on their tiles
instead (`fit_tiled`, the model of `codegen.cost.tiled_s`): the calibration's 64- and 128-row tiles, its
matrices 512 to 4096 wide and its nodes of one to 39 waves tell a tile's FLOPs from its weights' dequantization
and a first tile from a further one. `prefill_ring_batch` is measured directly (`time_ring_batches`,
`ring_batch_s`): what a block's routed experts cost, launched in the prefill ring's batches, beyond their one
launch and beyond what the batches' smaller grids cost by the tile model. `prefill_host` is measured directly
too (`prefill_host_terms`): a one-chunk prompt's wall time beyond its nodes' GPU time (or beyond its launches' host
time, where those take longer: the planner prices a chunk at the larger of the two), on both calibration models:
what a chunk costs the host that the GPU's work does not hide (its inputs staged, its logits and routing read
back, the GPU waiting on launches at the pass's start and between short nodes); `prefill_launch` is the host's
time to launch one of those passes' nodes (`issue_s`, behind a spinning kernel), which `kernel_launch` (a
launch of a MoE kernel's 16 arrays) overstates for the rest. The prefill ring's host calls are clocked in the
small model's engine under plans that stream half its experts through rings of RING_DEPTHS slots
(`ring_host_terms`, `runtime.ring_clock`): `prefill_ring_copy` is a driver copy's host time there, and each
streaming block's other host time (its issue beyond its copies and launches, and its wait for the routing) is
fitted as `prefill_ring_block` plus, per batch, `prefill_ring_call` less the batch's launches (bounded least
squares over the blocks of both depths, whose batch counts differ).

The `decode_l2_*` families (a model whose weights fit in L2, `codegen.cost.weights_in_l2`) come from a second,
small model of the same architecture (SMALL_SHAPE: 512 wide, 32 experts of width 128, 4 blocks; about 30 MB)
decoding after SMALL_CONTEXTS positions: its steps re-read their weights from L2, and its nodes take about half
the 2048-wide model's time (BENCHMARKS.md). Its one-chunk prompts of SMALL_PREFILL_TOKENS give the
`prefill_l2_*` families the same way: the large model's fits price a small model's norms and attention at about
twice their time (BENCHMARKS.md, validation run 18). Three lengths tell prefill attention's walk
(`KernelFit.walk_token_s`, `fit_walk`) from its latency and efficiency: at 256 and 512 rows a chunk's blocks
all fit on the SMs and its time follows the last rows' walk through the context, at 4096 its FLOPs. A GPU whose
L2 cannot hold it gives the `*_l2_*` families the `decode_*` and `prefill_*` fits.

`decode_host_experts` is what a decode expert launch adds when it reads its experts from the mapped host copy (a
cache miss): both models decode once more under plans that cache no expert (`uncached_plan`), and each expert
launch's time beyond the same launch's with every expert cached is fitted against its experts' bytes at the
zero-copy read rate (`host_expert_samples`): the calibration model's tens of MB a launch tell the rate, the
small model's few hundred KB the latency.
"""

import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from codegen.cost import (kernel_family, measured_tile_rows_per_pair, node_roofline_s, node_tiles,
                          tile_terms, tiled_sm_s, weights_in_l2)
from codegen.graph import prefill_tiling
from codegen.lower.cuda import CapturedGraph, cuda
from codegen.lower.moe import range_tiles
from planner.architecture import tensor_layer
from planner.errors import StratumError
from planner.kv_lending import needed_pages
from planner.model import load_model
from planner.profile import GPU, L2_FAMILIES, TILED_FAMILIES, KernelFit, Kernels, load_profile
from planner.search import MIN_RING_SLOTS, PAGE_TOKENS, solve
from planner.workload import Workload
from runtime.calibration_fit import Sample, fit_families, fit_ring_host, sample_s
from runtime.ceilings import spin, time_s
from runtime.synthetic import realistic_weights, reduced_card

CALIBRATION_BLOCKS = 4     # their dense weights (~80 MB) overflow the 50 MB L2 of an H100/H200 between runs
CHUNK_TOKENS = 2048
SHORT_CHUNK_TOKENS = 512     # prefill nodes timed at two sizes: a fit needs two to tell latency from efficiency
LONG_CONTEXT_TOKENS = 16384  # decode steps timed at two contexts, 2048 and this, for the same reason
REPEATS = 15
HOST_REQUESTS = 5           # one-chunk prompts whose median wall time `prefill_host_terms` takes
RING_BATCH_EXPERTS = 4      # experts a batch of `ring_batch_s` (half of an 8-slot ring, the bundled cards' depth)
SMALL_SHAPE = {"embedding_length": 512, "expert_feed_forward_length": 128, "expert_count": 32,
               "expert_used_count": 4, "attention.head_count": 8, "attention.head_count_kv": 2,
               "attention.key_length": 64, "attention.value_length": 64, "vocab_size": 4096}
SMALL_CONTEXTS = (512, 4096)     # decode attention's time grows with the context: two tell its two terms
SMALL_PREFILL_TOKENS = (256,) + SMALL_CONTEXTS     # prefill attention's walk makes three terms
RING_DEPTHS = (4, 16)       # ring slots of `ring_host_terms`' plans: batches of 2 and 8 experts
RING_TOKENS = 256           # its prompts' tokens, one chunk each
RING_PROMPTS = 4            # clocked prompts a depth, after two that lower the passes


def node_times_s(steps, stream, repeats: int, spin_us: int) -> np.ndarray:
    """[repeats, steps] seconds of each step, queued behind a `spin_us` spinning kernel and timed between events."""
    events = [cuda.event() for _ in range(len(steps) + 1)]
    times = np.empty((repeats, len(steps)))
    for r in range(repeats):
        spin[1, 1, stream](spin_us)
        events[0].record(stream)
        for step, after in zip(steps, events[1:]):
            step.run(stream)
            after.record(stream)
        stream.synchronize()
        times[r] = [cuda.event_elapsed_time(a, b) / 1e3 for a, b in zip(events, events[1:])]
    return times


def replay_s(steps, stream, repeats: int) -> float:
    """The steps captured as one graph, replayed without events."""
    graph = CapturedGraph(lambda s: [step.run(s) for step in steps], stream)
    try:
        return time_s(lambda: graph.replay(stream), repeats=repeats, warmup=2)
    finally:
        graph.close()


def calibrate(profile_path: Path, gpu: GPU, note=print) -> tuple[Kernels, list]:
    """Kernels fitted on this GPU, and the `Sample`s behind them.
    `profile_path` is a profile of this machine with its measured figures (used to plan the calibration model);
    `gpu` the same figures, against which rooflines are taken."""
    from runtime.engine import Engine       # the engine imports the planner and every kernel: only when run

    samples, host_gaps, launches, decode_samples = [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        card, plan = calibration_plan(profile_path, Path(folder))
        note(f"calibration model: {card.stem}, prompts of {CHUNK_TOKENS} and {SHORT_CHUNK_TOKENS} tokens (one "
             f"chunk each), then decode after {CHUNK_TOKENS} and {LONG_CONTEXT_TOKENS}")
        rng = np.random.default_rng(0)
        with Engine(plan, card, tensors=realistic_weights(card, seed=1, skew=1.0), progress=False) as engine:
            if engine.experts.n_cache < engine.experts.n_expert * len(engine.experts.blocks):
                raise RuntimeError("the calibration model's experts do not all fit in VRAM on this GPU")
            vocab = engine.hp.n_vocab
            # each pass is timed right after requests that ran it: passes share the arena, so another pass's
            # activations would overwrite its inputs (token ids)
            for tokens in (CHUNK_TOKENS, SHORT_CHUNK_TOKENS):
                timed, gap_s, launch_s = prefill_host_terms(engine, gpu, tokens, rng, note)
                if tokens == CHUNK_TOKENS:
                    ring_batches = time_ring_batches(engine, tokens)
                samples.extend(timed)
                host_gaps.append(gap_s)
                launches.append(launch_s)
            for tokens in (CHUNK_TOKENS, LONG_CONTEXT_TOKENS):
                for _ in range(2):      # the pass is lowered by the second
                    engine.generate(rng.integers(0, vocab, size=tokens).tolist(), 2)
                decode_samples += timed_nodes(engine, gpu, "decode", 1, tokens)
        samples.extend(decode_samples)
        (Path(folder) / "small").mkdir()
        small_samples, small_gaps, small_launches = small_model_samples(profile_path, gpu, Path(folder) / "small",
                                                                        note)
        ring_fits = ring_host_terms(profile_path, Path(folder) / "small", note)
        samples.extend(host_expert_samples(profile_path, gpu, card, (SHORT_CHUNK_TOKENS,), decode_samples, note))
        if small_samples:       # (none where the small model's weights overflow L2: the large model's alone)
            small_card = reduced_card(CALIBRATION_BLOCKS, Path(folder) / "small", metadata=SMALL_SHAPE)
            samples.extend(host_expert_samples(profile_path, gpu, small_card, SMALL_CONTEXTS, small_samples, note))
        samples.extend(small_samples)
        host_gaps.extend(small_gaps)
        launches.extend(small_launches)
    fits = fit_families(samples)
    for family, fallback in L2_FAMILIES.items():
        fits.setdefault(family, fits[fallback])
    counts = defaultdict(int)
    for sample in samples:
        counts[sample.family] += 1
    for family, fitted in fits.items():
        tiled = (f", {fitted.weight_element_s * 1e12:.3g} ps a weight element, further tiles at "
                 f"{fitted.further_tile:.0%}") if family in TILED_FAMILIES else ""
        if fitted.walk_token_s:
            tiled += f", or a walk of {fitted.walk_token_s * 1e9:.3g} ns a context position where longer"
        note(f"  {family}: {counts[family]} nodes, {fitted.efficiency:.0%} of the roofline + "
             f"{fitted.latency_s * 1e6:.3g} us{tiled}")
    batch_s = ring_batch_s(ring_batches, gpu, fits["prefill_experts"])
    note(f"  a prefill ring batch of {RING_BATCH_EXPERTS} experts: {batch_s * 1e6:.3g} us beyond its tiles "
         f"(measured {ring_batches.beyond_one_launch_s * 1e6:.0f} us beyond its block's one launch)")
    fits["prefill_ring_batch"] = KernelFit(efficiency=1.0, latency_s=batch_s)
    fits["prefill_host"] = KernelFit(efficiency=1.0, latency_s=float(np.mean(host_gaps)))
    fits["prefill_launch"] = KernelFit(efficiency=1.0, latency_s=float(np.mean(launches)))
    fits.update(ring_fits)
    note(f"  a prefill node's launch: {fits['prefill_launch'].latency_s * 1e6:.3g} us of host time (the mean of "
         f"{', '.join(f'{launch * 1e6:.3g}' for launch in launches)} us)")
    note(f"  a prefill chunk's host time beyond its GPU work: {fits['prefill_host'].latency_s * 1e3:.3g} ms "
         f"(the mean of {', '.join(f'{gap * 1e3:.3g}' for gap in host_gaps)} ms)")
    return Kernels(**fits), samples


def calibration_plan(profile_path: Path, folder: Path) -> tuple:
    """(the calibration model's card, written into `folder`; its plan on this machine: every expert and the
    whole context's K/V in VRAM, chunks of CHUNK_TOKENS)."""
    card = reduced_card(CALIBRATION_BLOCKS, folder)
    context = LONG_CONTEXT_TOKENS + CHUNK_TOKENS
    plan = solve(profile_path, card, context=context, kv="f16",
                 workload=Workload(prompts=((CHUNK_TOKENS, 1.0),), decode_tokens=8),
                 pins={"chunk_tokens": CHUNK_TOKENS, "kv_pages": int(needed_pages(context, PAGE_TOKENS))})
    return card, plan


def prefill_host_terms(engine, gpu: GPU, tokens: int, rng, note=print,
                       in_l2: bool = False) -> tuple[list, float, float]:
    """(the `timed_nodes` of a `tokens`-row prefill pass, the host's part of a chunk, the host's time to launch
    a node of it): the median wall time of HOST_REQUESTS prompts of `tokens` tokens (one chunk each, after two
    that lowered the pass) beyond the larger of its nodes' GPU time and its launches' host time (`issue_s`)."""
    walls = []
    for _ in range(2 + HOST_REQUESTS):
        out = engine.generate(rng.integers(0, engine.hp.n_vocab, size=tokens).tolist(), 1)
        walls.append(out.prefill_s)
    # timed right after the requests that ran the pass: passes share the arena, so another pass's activations
    # would overwrite its inputs (token ids)
    timed = timed_nodes(engine, gpu, "prefill", tokens, tokens, in_l2)
    steps = engine._program("prefill", tokens).steps
    launch_s = issue_s(steps, engine.compute) / len(steps)
    wall_s, nodes_s = float(np.median(walls[2:])), sum(sample.measured_s for sample in timed)
    note(f"  prefill of {tokens} tokens: {wall_s * 1e3:.2f} ms wall (median of {HOST_REQUESTS}), its nodes' GPU "
         f"time {nodes_s * 1e3:.2f} ms, their launches' host time {len(steps) * launch_s * 1e3:.2f} ms "
         f"({launch_s * 1e6:.3g} us a node)")
    return timed, max(0.0, wall_s - max(nodes_s, len(steps) * launch_s)), launch_s


def issue_s(steps, stream, repeats: int = 3) -> float:
    """Host seconds to launch a pass's steps, queued behind a spinning kernel (the launches never wait for the
    GPU): the best of `repeats`."""
    best = np.inf
    for _ in range(repeats):
        spin[1, 1, stream](200000)
        started = time.perf_counter()
        for step in steps:
            step.run(stream)
        best = min(best, time.perf_counter() - started)
        stream.synchronize()
    return float(best)


class RingBatches(NamedTuple):
    """A block's routed experts timed at once and in ring batches (`time_ring_batches`)."""
    once_s: float
    batched_s: float
    range_tiles: list               # row tiles of each batch's expert range
    tilings: tuple                  # (gate/up's, down's) `codegen.graph.Tiling`

    @property
    def beyond_one_launch_s(self) -> float:
        """What a batch after the first added, measured."""
        return max(0.0, (self.batched_s - self.once_s) / max(1, len(self.range_tiles) - 1))


def ring_batch_s(measured: RingBatches, gpu: GPU, experts: KernelFit) -> float:
    """The `prefill_ring_batch` latency: what a batch after a block's first adds beyond what its tiles cost
    (the fitted `experts` tile model prices each batch's grids, `codegen.cost.tiled_s`), from `measured`."""
    if len(measured.range_tiles) < 2:
        return 0.0          # every expert in one batch: nothing beyond the one launch
    split_s = 0.0
    for tiling in measured.tilings:
        tiles = np.asarray(measured.range_tiles, float) * tiling.col_tiles
        split_s += float(np.sum(tiled_sm_s(experts, *tile_terms(gpu, tiling, tiles)))
                         - tiled_sm_s(experts, *tile_terms(gpu, tiling, tiles.sum())))
    return max(0.0, (measured.batched_s - measured.once_s - split_s) / (len(measured.range_tiles) - 1))


def time_ring_batches(engine, tokens: int) -> RingBatches:
    """A block's routed experts launched at once and in batches of RING_BATCH_EXPERTS consecutive experts (as
    the prefill ring streams them, each with its routing's `range_tiles`): the first MoE block of the
    engine's `tokens`-row prefill, its experts all in VRAM (no copies), both ways timed between events,
    medians. The pass's earlier steps run first, so the block's inputs are the prompt's (the engine has just
    read one of `tokens` tokens)."""
    program = engine._program("prefill", tokens)
    gate_up = next(step for step in program.steps
                   if program.graph.nodes[step.name]["op"] == "moe_swiglu_matmul")
    block = tensor_layer(gate_up.name)
    down = program.steps.named(f"blk.{block}.moe_down")
    for step in program.steps[:program.steps.index(gate_up)]:
        step.run(engine.compute)
    routed = program.tensors[f"blk.{block}.topk"].copy_to_host(stream=engine.compute)
    engine.compute.synchronize()
    n_expert = engine.experts.n_expert
    edges = list(range(0, n_expert, RING_BATCH_EXPERTS)) + [n_expert]
    batched = list(zip(edges, edges[1:], range_tiles(routed, n_expert, edges)))
    once = [(0, n_expert, range_tiles(routed, n_expert, [0, n_expert])[0])]

    def launches(ranges):
        def run(stream):
            for lo, hi, tiles in ranges:
                gate_up.launch(stream, *gate_up.args, lo=lo, hi=hi, tiles=tiles)
                down.launch(stream, *down.args, lo=lo, hi=hi, tiles=tiles)
        return run
    once_s, batched_s = [float(np.median(node_times_s([SimpleNamespace(run=launches(r))], engine.compute, REPEATS,
                                                      20000))) for r in (once, batched)]
    tilings = tuple(prefill_tiling(program.graph.nodes[step.name]) for step in (gate_up, down))
    return RingBatches(once_s, batched_s, [int(tiles) for *_range, tiles in batched], tilings)


def small_model_samples(profile_path: Path, gpu: GPU, folder: Path, note=print) -> tuple[list, list, list]:
    """(samples, `prefill_host_terms` gaps, its nodes' launch times) of the SMALL_SHAPE model, whose weights fit in
    this GPU's L2: the `decode_l2_*` families' samples (its decode steps after each of SMALL_CONTEXTS positions),
    the `prefill_l2_*` families' (its one-chunk prompts of SMALL_PREFILL_TOKENS), and those prompts' host gaps
    and launch times; none, with a note, on a GPU whose L2 cannot hold it."""
    from runtime.engine import Engine

    card = reduced_card(CALIBRATION_BLOCKS, folder, metadata=SMALL_SHAPE)
    model = load_model(card)
    if not weights_in_l2(model, range(model.hparams.n_trunk), gpu):
        note(f"  the small model's {model.total_bytes / 2**20:.0f} MiB do not fit in this GPU's "
             f"{gpu.l2_bytes / 2**20:.0f} MiB of L2: the *_l2_* families take the others' fits")
        return [], [], []
    context = max(SMALL_CONTEXTS) + PAGE_TOKENS
    plan = solve(profile_path, card, context=context, kv="f16",
                 workload=Workload(prompts=((max(SMALL_CONTEXTS), 1.0),), decode_tokens=8),
                 pins={"kv_pages": int(needed_pages(context, PAGE_TOKENS)), "chunk_tokens": max(SMALL_CONTEXTS)})
    note(f"small model (decode from L2): {model.total_bytes / 2**20:.0f} MiB, prompts of one chunk of "
         f"{', '.join(map(str, SMALL_PREFILL_TOKENS))} tokens, decode after {' and '.join(map(str, SMALL_CONTEXTS))} "
         "positions")
    rng = np.random.default_rng(0)
    samples, gaps, launches = [], [], []
    with Engine(plan, card, tensors=realistic_weights(card, seed=1, skew=1.0), progress=False) as engine:
        for tokens in SMALL_PREFILL_TOKENS:
            timed, gap_s, launch_s = prefill_host_terms(engine, gpu, tokens, rng, note, in_l2=True)
            samples.extend(timed)
            gaps.append(gap_s)
            launches.append(launch_s)
            if tokens not in SMALL_CONTEXTS:
                continue
            for _ in range(2):
                engine.generate(rng.integers(0, engine.hp.n_vocab, size=tokens).tolist(), 2)
            samples.extend(timed_nodes(engine, gpu, "decode", 1, tokens, in_l2=True))
    return samples, gaps, launches


def host_expert_samples(profile_path: Path, gpu: GPU, card: Path, contexts: tuple, resident: list,
                        note=print) -> list:
    """The `decode_host_experts` samples of `card`'s model: what each decode expert launch adds when it reads
    its experts from the mapped host copy instead of VRAM slots. The launches run under a plan that caches none
    of its experts (`uncached_plan`), after each of `contexts` positions; from each is taken the median time of
    the same node in `resident` (that model's decode samples with every expert cached); its roofline is its
    experts' bytes at the zero-copy read rate. The calibration model's launches (tens of MB) tell the link's
    rate, the small model's (a few hundred KB) its latency (the demo model's misses, BENCHMARKS.md run 37)."""
    from runtime.engine import Engine

    cached = defaultdict(list)
    for sample in resident:
        if sample.family.startswith("decode") and sample.family.endswith("_experts"):
            cached[sample.node].append(sample.measured_s)
    plan = uncached_plan(load_profile(profile_path), card, max(contexts) + PAGE_TOKENS, contexts[0])
    rng = np.random.default_rng(0)
    samples = []
    with Engine(plan, card, tensors=realistic_weights(card, seed=1, skew=1.0), progress=False) as engine:
        if engine.experts.n_cache:
            raise RuntimeError(f"the uncached calibration plan caches {engine.experts.n_cache} experts")
        for tokens in contexts:
            for _ in range(2):      # the pass is lowered by the second
                engine.generate(rng.integers(0, engine.hp.n_vocab, size=tokens).tolist(), 2)
            samples += [sample._replace(measured_s=sample.measured_s - float(np.median(cached[sample.node])))
                        for sample in timed_nodes(engine, gpu, "decode", 1, tokens, host_experts=True)
                        if sample.family == "decode_host_experts" and sample.node in cached]
    if not samples:
        raise RuntimeError(f"{card.stem}: no decode expert launch was timed with its experts cached")
    added, roofline = (sum(getattr(s, key) for s in samples) / len(contexts) for key in ("measured_s", "roofline_s"))
    note(f"  {card.stem}, every expert read from the host copy: its decode expert launches take {added * 1e6:.4g} "
         f"us a step more than from slots ({len(samples) // len(contexts)} launches; their bytes at the zero-copy "
         f"rate {roofline * 1e6:.4g} us)")
    return samples


def uncached_plan(profile, card: Path, context: int, chunk_tokens: int):
    """The plan of `card` on the smallest VRAM that `profile`'s GPU can hold it in with every K/V page of
    `context` resident, chunks of `chunk_tokens` and the fewest ring slots: one that caches no expert (the cache
    takes what is left, so the smallest budget that fits leaves it none)."""
    workload = Workload(prompts=((context, 1.0),), decode_tokens=8)
    pins = {"kv_pages": int(needed_pages(context, PAGE_TOKENS)), "chunk_tokens": chunk_tokens,
            "ring_slots": MIN_RING_SLOTS}

    def plan_on(vram_bytes: int):
        try:
            return solve(profile.with_vram(vram_bytes), card, context=context, kv="f16", workload=workload, pins=pins)
        except StratumError:
            return None

    fits, fails = profile.gpus[0].vram_bytes, profile.gpus[0].reserved_bytes
    if plan_on(fits) is None:
        raise RuntimeError(f"{card.stem} does not fit on this GPU")
    while fits - fails > 1:      # the smallest budget that fits, by bisection
        middle = (fits + fails) // 2
        fits, fails = (middle, fails) if plan_on(middle) is not None else (fits, middle)
    return plan_on(fits)


def ring_host_terms(profile_path: Path, folder: Path, note=print) -> dict:
    """The prefill ring's host families (`prefill_ring_copy`, `prefill_ring_call`, `prefill_ring_block`), clocked
    in the SMALL_SHAPE model's engine (its card written into `folder`) under plans that cache half its experts
    and stream the rest through rings of RING_DEPTHS slots: RING_PROMPTS one-chunk prompts of RING_TOKENS tokens
    a depth (`runtime.ring_clock`). A small model's passes are short, so the host should bind, as it did the
    demo model's (BENCHMARKS.md, run 25), and each block's wait for its routing be the sync's round trip and the
    GPU's last nodes, not a long pass."""
    from runtime.engine import Engine
    from runtime.ring_clock import RingClock

    card = reduced_card(CALIBRATION_BLOCKS, folder, metadata=SMALL_SHAPE)
    model, profile = load_model(card), load_profile(profile_path)
    workload = Workload(prompts=((RING_TOKENS, 1.0),), decode_tokens=8)
    resident = solve(profile, card, context=4 * RING_TOKENS, kv="f16", workload=workload,
                     pins={"chunk_tokens": RING_TOKENS, "ring_slots": max(RING_DEPTHS)})
    half_bytes = model.hparams.n_expert * CALIBRATION_BLOCKS // 2 * resident.knobs["slot_bytes"]
    streaming = profile.with_vram(profile.gpus[0].reserved_bytes + resident.allocated_bytes(0) - half_bytes)
    rng = np.random.default_rng(0)
    blocks = []
    for depth in RING_DEPTHS:
        plan = solve(streaming, card, context=4 * RING_TOKENS, kv="f16", workload=workload,
                     pins={"chunk_tokens": RING_TOKENS, "ring_slots": depth})
        with Engine(plan, card, tensors=realistic_weights(card, seed=1, skew=1.0), progress=False) as engine, \
                RingClock(engine) as clock:
            for request in range(2 + RING_PROMPTS):
                if request == 2:        # after the two that lower the passes
                    clock.begin()
                engine.generate(rng.integers(0, engine.hp.n_vocab, size=RING_TOKENS).tolist(), 1)
            blocks += clock.end()
    fits = fit_ring_host(blocks)
    batches = [len(b.batch_s) for b in blocks]
    note(f"  the prefill ring's host calls ({len(blocks)} streaming blocks, {min(batches)}-{max(batches)} batches "
         f"each): a driver copy {fits['prefill_ring_copy'].latency_s * 1e6:.3g} us, a batch's other calls "
         f"{fits['prefill_ring_call'].latency_s * 1e6:.3g} us, a block's routing "
         f"{fits['prefill_ring_block'].latency_s * 1e6:.3g} us")
    return fits


def timed_nodes(engine, gpu: GPU, kind: str, tokens: int, context: int, in_l2: bool = False,
                host_experts: bool = False) -> list:
    """A `Sample` of every node of the engine's `kind` pass over `tokens` rows (a prefill pass's routed-expert
    nodes computing the tiles of the routing the engine last read back), in the `*_l2_*` families if `in_l2`;
    with `host_experts` (an engine that caches no expert), its routed-expert nodes in `decode_host_experts`."""
    program = engine._program(kind, tokens)
    steps = program.steps
    decode = kind == "decode"
    times = np.median(node_times_s(steps, engine.compute, REPEATS, 20000 if decode else 200000), axis=0)
    if decode:      # the events' cost, spread over the nodes (a prefill node's is negligible)
        times = np.maximum(times - (times.sum() - replay_s(steps, engine.compute, REPEATS)) / len(steps), 1e-7)
    tile_rows = {} if decode else {
        block: measured_tile_rows_per_pair(engine.routed_ids[i, :tokens], engine.hp.n_expert)
        for i, block in enumerate(engine.moe_blocks)}
    samples = []
    for step, measured in zip(steps, times):
        rows = tile_rows.get(tensor_layer(step.name), 1.0)
        tiled = node_tiles(program.graph, step.name, rows)
        node = program.graph.nodes[step.name]
        from_host = host_experts and "expert_layer" in node
        samples.append(Sample("decode_host_experts" if from_host else kernel_family(node, decode, in_l2), step.name,
                              node_roofline_s(program.graph, step.name, gpu, engine.model, context + decode, rows,
                                              from_host),
                              float(measured), None if tiled is None else
                              tuple(float(term) for term in tile_terms(gpu, *tiled)), context + decode))
    return samples


def by_family(timed: list, kernels: Kernels) -> dict:
    """family -> (measured s, the calibration's s) summed over `timed_nodes`' samples: where a pass's
    prediction and its measurement part."""
    totals = defaultdict(lambda: [0.0, 0.0])
    for sample in timed:
        totals[sample.family][0] += sample.measured_s
        totals[sample.family][1] += sample_s(kernels, sample)
    return {family: tuple(pair) for family, pair in totals.items()}
