"""The cost model's pieces that are not a roofline: tiles and their waves, expert tile padding, and prefill's
reads of host K/V."""

import dataclasses

import numpy as np
import pytest

import codegen.cost as codegen_cost
from codegen.cost import (expected_tile_rows_per_pair, kernel_family, measured_tile_rows_per_pair, node_tiles,
                          pass_cost, tile_terms, tiled_s, tiled_sm_s)
from codegen.graph import EXPERT_TILE_ROWS, build_pass, launched, prefill_attention_rows, representative_layers
from planner.kv import parse_kv_type
from planner.model import load_model
from planner.predict import DeviceCost, DeviceShare
from planner.profile import KernelFit, load_profile
from planner.workload import Workload

KV = parse_kv_type("f16")


@pytest.fixture(scope="module")
def qwen():
    return load_model("qwen3-30b-a3b-q8_0")


def test_measured_tile_rows_count_each_experts_last_tile_whole():
    """65 pairs of expert 0 take two 64-row tiles, 1 pair of expert 2 one: 192 rows for 66 pairs."""
    ids = np.array([[0]] * 65 + [[2]], np.int32)
    assert measured_tile_rows_per_pair(ids, 4) == 3 * EXPERT_TILE_ROWS / 66


@pytest.mark.parametrize("tokens", [64, 512, 2048, 8192])
def test_expected_tile_rows_match_routed_chunks(rng, tokens):
    """The padding a popularity implies against chunks drawn from it (k distinct experts a row, skewed),
    within 3%. The mean is over 25600 rows or more (400 chunks of 64): its standard error stays under 0.5%,
    where 10 chunks of 64 rows left 1.4% and failed one draw in thirty."""
    n_expert, k = 64, 4
    log_popularity = rng.standard_normal(n_expert)

    def chunk(rows):
        keys = log_popularity + rng.gumbel(size=(rows, n_expert))
        return np.argsort(-keys, axis=1)[:, :k]
    popularity = np.bincount(chunk(100_000).reshape(-1), minlength=n_expert) / 100_000
    chunks = max(10, 25_600 // tokens)
    measured = np.mean([measured_tile_rows_per_pair(chunk(tokens), n_expert) for _ in range(chunks)])
    expected = expected_tile_rows_per_pair(popularity[None], tokens)[0]
    assert expected == pytest.approx(measured, rel=0.03)
    assert expected >= 1.0


def test_prefill_attention_reads_host_kv_once_a_query_slice(qwen):
    """A prefill chunk's attention node says how often a host-held position crosses the link: once per block
    of `prefill_attention_rows` rows (Qwen3-30B: 8 query heads a kv head, 4 rows a block)."""
    graph = build_pass(qwen, "prefill", 512, KV, layers=representative_layers(qwen.hparams))
    rows = prefill_attention_rows(qwen.hparams.n_head // qwen.hparams.n_head_kv)
    assert rows == 4
    attention = [node for _, node in graph.nodes(data=True) if node["op"] == "attention"]
    assert attention and all(node["kv_reads"] == 512 // rows for node in attention)


def test_a_chunk_reading_host_kv_is_slower_by_its_rereads_over_the_link(qwen):
    """The same chunk at the same context, its older positions in the K/V ring or only in the host copy: the
    difference is those positions' K/V bytes, once per query slice, at the zero-copy bandwidth."""
    gpu = load_profile("h200-141g").gpus[0]
    share = DeviceShare(0, gpu, tuple(range(qwen.hparams.n_trunk)), True, True)
    device = DeviceCost(qwen, share, KV, Workload(prompts=((4096, 1.0),), decode_tokens=8), mtp=False)
    n_cache = qwen.hparams.n_expert * len(device.moe_blocks)
    streaming = device.chunk_streaming(512, n_cache, 2)
    context, start = 4096, 4096 - 512
    resident = device.chunk_s(512, context, 2, context, streaming)
    from_host = device.chunk_s(512, context, 2, 0, streaming)
    cost = pass_cost(device.graph("prefill", 512), gpu, qwen, share.blocks)
    attention_gap = cost.attention_s(context, context) - cost.attention_s(context, 512)
    host_read_s = start * cost.kv_bytes_per_token * 512 / prefill_attention_rows(8) / gpu.zero_copy_read_bytes_per_s
    assert float(from_host - resident) == pytest.approx(host_read_s - float(attention_gap), rel=1e-6)


@pytest.mark.parametrize("tokens, host_tokens, tiles_a_warp", [(1, 3072, 1), (3, 3072, 1), (1, 8192 + 32, 2)])
def test_a_decode_window_reads_the_positions_its_ring_lost_from_the_host_copy_zero_copy(
        rng, qwen, tokens, host_tokens, tiles_a_warp):
    """A decode window at a depth its K/V ring does not hold reads the older positions' K/V from the host copy
    through mapped memory, as prefill's attention does: their bytes at the zero-copy bandwidth, not the pinned
    copy's (run 31's 8 GB row at 4096 tokens, priced at the copy's, ran 11% under its prediction); and each of
    its 48 attention launches waits the link's latency beyond device memory's at each of its busiest warp's
    rounds of loads, for each of its rows: Qwen3-30B's f16 K row of a head is 16 chunks, 2 rounds of 8, then a
    tile's 32 V rows 2 more, 16 in flight. A warp takes one tile of 32 positions in 256 (64 splits of 4 warps): 3072 host positions
    are one tile a warp, 8224 two (the demo's 50% / 768 row took 33 us a step beyond its host bytes, run 37)."""
    gpu = load_profile("h200-141g").gpus[0]
    gpu = dataclasses.replace(gpu, zero_copy_read_bytes_per_s=gpu.host_to_device_bytes_per_s / 3,
                              read_latency_s=rng.uniform(0.2e-6, 0.5e-6), zero_copy_latency_s=rng.uniform(1e-6, 3e-6))
    share = DeviceShare(0, gpu, tuple(range(qwen.hparams.n_trunk)), True, True)
    device = DeviceCost(qwen, share, KV, Workload(prompts=((4096, 1.0),), decode_tokens=8), mtp=False)
    n_cache = qwen.hparams.n_expert * len(device.moe_blocks)
    depth = 16384
    ring_tokens = depth - host_tokens
    resident = device.window_s(tokens, depth, n_cache, depth)
    from_host = device.window_s(tokens, depth, n_cache, ring_tokens)
    cost = device.cost("decode", tokens)
    attention_gap = cost.attention_s(depth, depth) - cost.attention_s(depth, ring_tokens)
    host_read_s = host_tokens * cost.kv_bytes_per_token / gpu.zero_copy_read_bytes_per_s
    latency_s = tokens * 48 * 4 * tiles_a_warp * (gpu.zero_copy_latency_s - gpu.read_latency_s)
    assert float(from_host - resident) == pytest.approx(host_read_s + latency_s - float(attention_gap), rel=1e-6)


def test_decode_attentions_rounds_follow_its_kernel():
    """The cost model's copy of the decode attention kernel's shape is the kernel's: a tile a lane's position,
    16-byte K chunks, and 4 warps a block for the bundled models' heads; the rounds a tile waits for, with what
    it keeps in flight (f16: 8 K chunks and 16 V rows; quantized: 4 and 8)."""
    from codegen.lower import attention_decode
    assert codegen_cost.DECODE_ATTENTION_TILE == attention_decode.LANES
    assert codegen_cost.DECODE_ATTENTION_K_CHUNK_BYTES == attention_decode.CHUNK_WORDS * 4
    for name in ("qwen3-30b-a3b-q8_0", "glm-4.5-air-q4_k_m"):
        hp = load_model(name).hparams
        assert attention_decode.block_warps(hp.n_head // hp.n_head_kv, hp.head_dim_k, hp.head_dim_v,
                                            codegen_cost.DECODE_ATTENTION_WARPS) == codegen_cost.DECODE_ATTENTION_WARPS
    qwen = load_model("qwen3-30b-a3b-q8_0")
    assert [codegen_cost.decode_kv_rounds(qwen, kv) for kv in ("f16", "q8_0", "q4_0", "k8v4")] == [4, 6, 5, 6]


def test_decode_expert_launches_wait_their_load_rounds(qwen):
    """A Qwen3-30B-A3B Q8_0 warp reads a gate/up row of 2048 quants in 4 rounds of 32 16-byte chunks (gate's and
    up's together), a down row of 768 in 2: 6 rounds a block. A round is what the decode kernels load at once."""
    from codegen.lower.matmul_decode import CHUNK_WORDS
    from codegen.lower.pointwise import WARP
    assert codegen_cost.DECODE_ROUND_BYTES == WARP * CHUNK_WORDS * 4
    graph = build_pass(qwen, "decode", 1, KV, layers=representative_layers(qwen.hparams))
    rounds = {node["op"]: codegen_cost.decode_load_rounds(qwen, node) for _, node in graph.nodes(data=True)
              if "expert_layer" in node}
    assert rounds == {"moe_swiglu_matmul": 4, "moe_down_matmul": 2}
    gpu = load_profile("h200-141g").gpus[0]
    assert pass_cost(graph, gpu, qwen, tuple(range(qwen.hparams.n_trunk))).expert_load_rounds == 6
    assert pass_cost(build_pass(qwen, "prefill", 64, KV, layers=representative_layers(qwen.hparams)), gpu, qwen,
                     tuple(range(qwen.hparams.n_trunk))).expert_load_rounds == 0


@pytest.mark.parametrize("cached_share", [0.0, 0.5, 1.0])
def test_a_decode_step_that_misses_waits_the_links_latency_at_each_load_round(rng, qwen, cached_share):
    """The same step, priced with a zero-copy read's latency above device memory's and without: the difference
    is the link's extra latency times the expert launches' 6 rounds, for each block the step's routing sends
    to an expert it does not cache (its chance: 1 - the product over uncached experts of 1 - popularity).
    Nothing when every expert is cached. (A profile without the `decode_host_experts` calibration.)"""
    gpu = load_profile("h200-141g").gpus[0]
    gpu = dataclasses.replace(gpu, kernels=dataclasses.replace(gpu.kernels, decode_host_experts=None))
    read_s, link_s = rng.uniform(0.2e-6, 0.5e-6), rng.uniform(1e-6, 3e-6)
    costs = []
    for zero_copy_latency_s in (read_s, link_s):
        measured = dataclasses.replace(gpu, read_latency_s=read_s, zero_copy_latency_s=zero_copy_latency_s)
        share = DeviceShare(0, measured, tuple(range(qwen.hparams.n_trunk)), True, True)
        costs.append(DeviceCost(qwen, share, KV, Workload(prompts=((2048, 1.0),), decode_tokens=8), mtp=False))
    per_block = int(cached_share * qwen.hparams.n_expert)
    slots = per_block * len(costs[0].moe_blocks)
    gap = costs[1].window_s(1, 2048, slots, 2048) - costs[0].window_s(1, 2048, slots, 2048)
    uncached = np.minimum(costs[0].popularity[:, per_block:], 1.0)
    chance = 1.0 - np.prod(1.0 - uncached, axis=1)
    assert float(gap) == pytest.approx(chance.sum() * 6 * (link_s - read_s), rel=1e-9, abs=1e-15)
    assert (gap == 0.0) == (cached_share == 1.0)


@pytest.mark.parametrize("cached_share", [0.0, 0.5, 1.0])
def test_a_calibrated_decode_step_prices_its_misses_by_the_host_experts_fit(rng, qwen, cached_share):
    """With `decode_host_experts` fitted, a step's missed expert bytes take the zero-copy rate over that fit's
    efficiency, and each block that misses pays the fit's latency for each of its 2 expert launches (the load
    rounds' estimate is then unused). Nothing changes when every expert is cached."""
    gpu = load_profile("h200-141g").gpus[0]
    efficiency, latency_s = rng.uniform(0.3, 0.9), rng.uniform(1e-6, 8e-6)
    fits = [KernelFit(efficiency, latency_s), KernelFit(efficiency, latency_s + 3e-6),
            KernelFit(efficiency / 2, latency_s)]
    costs = []
    for host in fits:
        calibrated = dataclasses.replace(gpu, kernels=dataclasses.replace(gpu.kernels, decode_host_experts=host))
        share = DeviceShare(0, calibrated, tuple(range(qwen.hparams.n_trunk)), True, True)
        costs.append(DeviceCost(qwen, share, KV, Workload(prompts=((2048, 1.0),), decode_tokens=8), mtp=False))
    per_block = int(cached_share * qwen.hparams.n_expert)
    slots = per_block * len(costs[0].moe_blocks)
    steps = [float(cost.window_s(1, 2048, slots, 2048)) for cost in costs]
    uncached = np.minimum(costs[0].popularity[:, per_block:], 1.0)
    chance = 1.0 - np.prod(1.0 - uncached, axis=1)
    assert steps[1] - steps[0] == pytest.approx(chance.sum() * 2 * 3e-6, rel=1e-9, abs=1e-15)
    miss_bytes = costs[0].step_miss_bytes.total(slots)
    assert steps[2] - steps[0] == pytest.approx(miss_bytes / gpu.zero_copy_read_bytes_per_s / efficiency,
                                                rel=1e-9, abs=1e-15)
    assert (steps[0] == steps[1] == steps[2]) == (cached_share == 1.0)


def test_a_host_expert_nodes_roofline_reads_its_experts_at_the_zero_copy_rate(qwen):
    """`node_roofline_s(host_experts=True)` (the `decode_host_experts` calibration's): a decode expert launch's
    expert bytes at the zero-copy read rate instead of device memory's; other nodes unchanged."""
    graph = build_pass(qwen, "decode", 1, KV, layers=representative_layers(qwen.hparams))
    gpu = load_profile("h200-141g").gpus[0]
    for name, node in graph.nodes(data=True):
        if not launched(node):
            continue
        device_s, host_s = (codegen_cost.node_roofline_s(graph, name, gpu, qwen, 512, host_experts=host)
                            for host in (False, True))
        if "expert_layer" not in node:
            assert host_s == device_s
            continue
        expert_bytes = sum(qwen.tensor_bytes[w] for w in node["weights"]) * qwen.hparams.n_expert_used \
            / qwen.hparams.n_expert
        assert host_s - device_s == pytest.approx(expert_bytes / gpu.zero_copy_read_bytes_per_s
                                                  - expert_bytes / gpu.memory_bandwidth_bytes_per_s, rel=1e-6)


def test_prefills_output_head_row_is_a_decode_family_node(qwen):
    """A prefill chunk's one head row goes through the decode family's GEMV (it reads the weights once; the
    prefill tiles would compute 128 rows): priced as decode_matmul, every other matmul as prefill_matmul."""
    graph = build_pass(qwen, "prefill", 64, KV, layers=representative_layers(qwen.hparams))
    families = {name: kernel_family(node, False) for name, node in graph.nodes(data=True) if node["op"] == "matmul"}
    assert families.pop("logits") == "decode_matmul"
    assert graph.nodes["logits"]["shape"] == (1, qwen.hparams.n_vocab)
    assert families and set(families.values()) == {"prefill_matmul"}


@pytest.mark.parametrize("kind, tokens", [("decode", 1), ("decode", 4), ("prefill", 64)])
def test_a_launch_that_computes_several_nodes_is_priced_once(qwen, kind, tokens):
    """A fused launch (q with k and v, the routing's three tensors, q's RoPE with k's) pays its family's latency
    once, for the FLOPs and bytes of all its nodes; views and inputs are no launches at all."""
    gpu = load_profile("h200-141g").gpus[0]
    graph = build_pass(qwen, kind, tokens, KV, layers=[0])
    cost = pass_cost(graph, gpu, qwen, [0])
    launches = [name for name, node in graph.nodes(data=True) if launched(node)]
    assert cost.n_nodes == len(launches) < len(graph) - 2      # the two inputs, and the fused nodes
    unfused = graph.copy()
    for name, node in unfused.nodes(data=True):
        node.pop("fuses", None)
        node.pop("launched_by", None)
    separate = pass_cost(unfused, gpu, qwen, [0])
    fused_away = {graph.nodes[m]["op"] for name in launches for m in graph.nodes[name].get("fuses", ())}
    assert fused_away == ({"rope", "kv_store", "matmul", "route_weights", "moe_groups"} if kind == "decode"
                          else {"rope", "kv_store", "route_weights"})
    assert separate.n_nodes - cost.n_nodes == len(graph) - len(launches) - (3 if kind == "prefill" else 2)
    assert cost.fixed_s < separate.fixed_s


def test_prefill_matmuls_are_priced_by_their_tiles_waves(qwen):
    """A matmul of no more tiles than SMs takes one tile's time at any rows (Qwen3-30B's k projection: 4 column
    tiles of 64-row tiles, 32 tiles at 512 rows, 128 at 2048, on 132 SMs); q at 2048 rows (512 tiles of 128 rows)
    takes four waves: its first tile, then three at the further-tile fraction."""
    gpu = load_profile("h200-141g").gpus[0]
    fit = gpu.kernels.prefill_matmul
    seconds = {}
    for tokens in (512, 2048):
        graph = build_pass(qwen, "prefill", tokens, KV, layers=representative_layers(qwen.hparams))
        for name in ("blk.0.k", "blk.0.q"):
            tiling, tiles = node_tiles(graph, name)
            seconds[name, tokens] = float(tiled_s(fit, gpu, tiling, tiles, 0.0))
            one_tile = fit.latency_s + float(tiled_sm_s(fit, *tile_terms(gpu, tiling, 1)))
    assert seconds["blk.0.k", 512] == seconds["blk.0.k", 2048]
    tiling, tiles = node_tiles(graph, "blk.0.q")
    assert (tiling.tile_rows, tiles) == (128, 512)
    first = float(tiled_sm_s(fit, *tile_terms(gpu, tiling, 1)))
    assert seconds["blk.0.q", 2048] == pytest.approx(fit.latency_s + first * (1 + 3 * fit.further_tile), rel=1e-12)
    assert seconds["blk.0.q", 512] == pytest.approx(one_tile, rel=1e-12)


def test_a_short_chunks_matmuls_cost_their_own_tiles(qwen):
    """A last chunk of 100 tokens is priced from the 128-token graph: its matmuls by the tiles 100 rows make
    (as many as 128 rows make), not by 100/128 of the graph's; one row more can start a wave."""
    gpu = load_profile("h200-141g").gpus[0]
    share = DeviceShare(0, gpu, tuple(range(qwen.hparams.n_trunk)), True, True)
    def cost(tokens):
        graph = build_pass(qwen, "prefill", tokens, KV, layers=representative_layers(qwen.hparams))
        return pass_cost(graph, gpu, qwen, share.blocks)
    small = cost(128)
    assert small.tiled and small.tiled_matmuls_s(100) == small.tiled_matmuls_s(128)
    # 513 rows make q's fifth row of 128-row tiles: 160 tiles, a second wave on 132 SMs
    assert cost(1024).tiled_matmuls_s(512) < cost(1024).tiled_matmuls_s(513)


def _streaming_device(qwen, gpu):
    share = DeviceShare(0, gpu, tuple(range(qwen.hparams.n_trunk)), True, True)
    return DeviceCost(qwen, share, KV, Workload(prompts=((2048, 1.0),), decode_tokens=8), mtp=False)


def test_a_shallow_rings_small_batches_cost_their_tiles(qwen):
    """With no latency a ring batch (prefill_ring_batch 0), a shallower ring still prices a streaming block's
    experts higher: its batches' grids hold fewer tiles, so more waves run under-filled."""
    gpu = load_profile("h200-141g").gpus[0]
    gpu = dataclasses.replace(gpu, kernels=dataclasses.replace(gpu.kernels, prefill_ring_batch=KernelFit()))
    device = _streaming_device(qwen, gpu)
    rings = np.array([4, 16, 64, 256])
    experts = device.chunk_streaming(2048, np.zeros(4, dtype=np.int64), rings).expert_compute_s
    assert np.all(np.diff(experts) < 0)
    whole = device.expert_compute_s("prefill", 2048)
    assert experts[-1] == pytest.approx(whole, rel=1e-9)        # 128 slots a half: each block in one batch


def test_each_streamed_copy_pays_the_copy_latency(qwen):
    """A larger per-copy latency slows a streaming chunk by its copies' count (the streaming engine binds),
    and leaves a resident one as it is."""
    base = load_profile("h200-141g").gpus[0]
    slow = dataclasses.replace(base, copy_latency_s=base.copy_latency_s + 1e-4)
    n_cache = qwen.hparams.n_expert * qwen.hparams.n_trunk
    times = {}
    for name, gpu in (("base", base), ("slow", slow)):
        device = _streaming_device(qwen, gpu)
        for slots in (0, n_cache):
            streaming = device.chunk_streaming(2048, slots, 8)
            times[name, slots] = float(device.chunk_s(2048, 2048, 8, 2048, streaming))
    copies = float(_streaming_device(qwen, base).chunk_streaming(2048, 0, 8).copies)
    assert copies > 0
    assert times["slow", 0] - times["base", 0] == pytest.approx(copies * 1e-4, rel=1e-6)
    assert times["slow", n_cache] == times["base", n_cache]


def without_ring_clocks(gpu):
    """The GPU as a profile whose calibration did not clock the prefill ring's host calls prices them."""
    return dataclasses.replace(gpu, kernels=dataclasses.replace(
        gpu.kernels, prefill_ring_copy=KernelFit(), prefill_ring_call=KernelFit(), prefill_ring_block=KernelFit()))


def test_a_ring_batch_issues_its_kernels_copies_and_events_each_at_its_own_cost(qwen):
    """A streaming block's batch costs the host its two expert kernels at `kernel_launch`, each copy (data and
    scales of three matrices for a run of streamed experts) at `copy_call` and four event calls at
    `event_call`: making one kind dearer adds that many calls to every batch's issue, and to the chunk's launch
    bound once for each of its batches."""
    from planner.predict import BATCH_EVENT_CALLS, BATCH_KERNELS, COPIES_PER_RUN
    base = without_ring_clocks(load_profile("h200-141g").gpus[0])
    extra_s = 7e-6
    issue, launch = {}, {}
    for kind in ("base", "kernel_launch_s", "copy_call_s", "event_call_s"):
        gpu = base if kind == "base" else dataclasses.replace(base, **{kind: getattr(base, kind) + extra_s})
        streaming = _streaming_device(qwen, gpu).chunk_streaming(2048, 0, 8)
        issue[kind], launch[kind] = float(streaming.issue_s), float(streaming.launch_s)
        batches = float(streaming.copies) / COPIES_PER_RUN      # no expert cached: a batch is one run of ids
    for kind, calls in (("kernel_launch_s", BATCH_KERNELS), ("copy_call_s", COPIES_PER_RUN),
                        ("event_call_s", BATCH_EVENT_CALLS)):
        assert issue[kind] - issue["base"] == pytest.approx(calls * extra_s, rel=1e-9)
        if kind != "kernel_launch_s":       # the nodes launch at prefill_launch, a measured figure of its own
            assert launch[kind] - launch["base"] == pytest.approx(batches * calls * extra_s, rel=1e-9)


def test_the_ring_calls_measured_in_the_engine_replace_the_microbenchmarks(qwen):
    """Calibrated, a batch's copies cost `prefill_ring_copy` each and the rest of it `prefill_ring_call`, the
    profile's `copy_call`, `kernel_launch` and `event_call` no longer; each streaming block's routing
    (`prefill_ring_block`) holds its first batch back and adds to the chunk's launch bound once a block."""
    from planner.predict import COPIES_PER_RUN
    base = without_ring_clocks(load_profile("h200-141g").gpus[0])
    copy_s, call_s, block_s = 11e-6, 63e-6, 230e-6
    kernels = dataclasses.replace(base.kernels, prefill_ring_copy=KernelFit(latency_s=copy_s),
                                  prefill_ring_call=KernelFit(latency_s=call_s),
                                  prefill_ring_block=KernelFit(latency_s=block_s))
    results = {}
    for name, gpu in (("calibrated", dataclasses.replace(base, kernels=kernels)),
                      ("dearer launches", dataclasses.replace(base, kernels=kernels, kernel_launch_s=1e-3,
                                                              copy_call_s=1e-3, event_call_s=1e-3))):
        streaming = _streaming_device(qwen, gpu).chunk_streaming(2048, 0, 8)
        results[name] = (float(streaming.issue_s), float(streaming.launch_s))
    streaming = _streaming_device(qwen, base).chunk_streaming(2048, 0, 8)
    assert results["calibrated"][0] == pytest.approx(block_s + COPIES_PER_RUN * copy_s + call_s, rel=1e-9)
    assert results["dearer launches"][0] == results["calibrated"][0]
    blocks, batches = float(streaming.streaming_blocks), float(streaming.copies) / COPIES_PER_RUN
    uncalibrated_batch_s = float(streaming.issue_s)
    assert results["calibrated"][1] - float(streaming.launch_s) == pytest.approx(
        batches * (COPIES_PER_RUN * copy_s + call_s - uncalibrated_batch_s) + blocks * block_s, rel=1e-9)


def test_a_chunk_adds_its_host_time_and_launches_its_nodes_at_the_measured_rate(qwen):
    """Each chunk adds the profile's `prefill_host` whatever binds it; the launch bound takes each node at
    `prefill_launch` and a MoE block whose every expert is cached at CACHED_BLOCK_CALLS `kernel_launch`s (its
    routing's copy and event, its table's copy); a profile without `prefill_launch` launches nodes at
    `kernel_launch`."""
    from planner.predict import CACHED_BLOCK_CALLS
    gpu = load_profile("h200-141g").gpus[0]
    resident = qwen.hparams.n_expert * sum(qwen.hparams.is_moe_layer(b) for b in range(qwen.hparams.n_trunk))
    n_moe = sum(qwen.hparams.is_moe_layer(b) for b in range(qwen.hparams.n_trunk))
    prices = {}
    for launch_s, host_s in ((17e-6, 0.0), (17e-6, 4e-4), (0.0, 0.0)):
        kernels = dataclasses.replace(gpu.kernels, prefill_launch=KernelFit(latency_s=launch_s),
                                      prefill_host=KernelFit(latency_s=host_s))
        device = _streaming_device(qwen, dataclasses.replace(gpu, kernels=kernels))
        for slots in (0, resident):
            streaming = device.chunk_streaming(512, slots, 8)
            prices[launch_s, host_s, slots] = (float(device.chunk_s(512, 512, 8, 512, streaming)),
                                               float(streaming.launch_s))
    n_nodes = device.cost("prefill", 512).n_nodes
    assert prices[17e-6, 0.0, resident][1] == pytest.approx(
        n_nodes * 17e-6 + n_moe * CACHED_BLOCK_CALLS * gpu.kernel_launch_s, rel=1e-12)
    assert prices[0.0, 0.0, resident][1] == pytest.approx(
        (n_nodes + n_moe * CACHED_BLOCK_CALLS) * gpu.kernel_launch_s, rel=1e-12)
    for slots in (0, resident):
        assert prices[17e-6, 4e-4, slots][0] - prices[17e-6, 0.0, slots][0] == pytest.approx(4e-4, rel=1e-9)
    assert prices[17e-6, 0.0, 0][1] > prices[17e-6, 0.0, resident][1]     # a streaming block's batches' calls


def test_a_model_whose_weights_fit_in_l2_is_priced_by_the_l2_families(qwen, tmp_path):
    """The demo-sized model (its weights within the H200's 60 MiB of L2) prices its decode step's nodes by the
    `decode_l2_*` fits, its prefill by the `prefill_l2_*` ones; Qwen3-30B's decode by `decode_*`; a GPU with no L2
    counted, or one too small, prices the small model like any other."""
    from runtime.calibrate import SMALL_SHAPE
    from runtime.synthetic import reduced_card
    gpu = load_profile("h200-141g").gpus[0]
    small = load_model(reduced_card(4, tmp_path, metadata=SMALL_SHAPE))
    blocks = range(small.hparams.n_trunk)
    assert codegen_cost.weights_in_l2(small, blocks, gpu)
    assert not codegen_cost.weights_in_l2(qwen, range(qwen.hparams.n_trunk), gpu)
    assert not codegen_cost.weights_in_l2(small, blocks, dataclasses.replace(gpu, l2_bytes=small.total_bytes - 1))
    assert not codegen_cost.weights_in_l2(small, blocks, dataclasses.replace(gpu, l2_bytes=0))
    decode = build_pass(small, "decode", 1, KV, layers=representative_layers(small.hparams))
    nodes = [node for name, node in decode.nodes(data=True) if node["op"] != "input"]
    assert {kernel_family(node, True, in_l2=True) for node in nodes} == {
        "decode_l2_matmul", "decode_l2_attention", "decode_l2_experts", "decode_l2_grouping", "decode_l2_small"}
    share = DeviceShare(0, gpu, tuple(blocks), True, True)
    device = DeviceCost(small, share, KV, Workload(prompts=((512, 1.0),), decode_tokens=8), mtp=False)
    assert device.weights_in_l2
    in_l2 = device.cost("decode", 1)
    from_memory = pass_cost(decode, gpu, small, share.blocks)
    l2_fits = [f.latency_s for f in (gpu.kernels.decode_l2_matmul, gpu.kernels.decode_l2_small)]
    memory_fits = [f.latency_s for f in (gpu.kernels.decode_matmul, gpu.kernels.decode_small)]
    assert all(a < b for a, b in zip(l2_fits, memory_fits)) and in_l2.fixed_s < from_memory.fixed_s
    prefill = device.graph("prefill", 64)
    assert {kernel_family(node, False, in_l2=True) for name, node in prefill.nodes(data=True)
            if node["op"] != "input"} == {"prefill_l2_matmul", "prefill_l2_attention", "prefill_l2_experts",
                                          "prefill_l2_grouping", "prefill_l2_small", "decode_l2_matmul"}
    assert device.cost("prefill", 64).fixed_s == pass_cost(prefill, gpu, small, share.blocks, in_l2=True).fixed_s


def test_a_short_chunks_attention_takes_its_walk_through_the_context(qwen, rng):
    """With a walk in its family's fit, a prefill attention node takes its latency plus the larger of its
    roofline over efficiency and its context's positions at walk_token_s each: a 256-row chunk from 0 walks
    256 positions, the same chunk after 3840 others walks 4096; decode attention has no walk."""
    gpu = load_profile("h200-141g").gpus[0]
    walk = KernelFit(efficiency=0.3, latency_s=rng.uniform(2e-6, 1e-5), walk_token_s=rng.uniform(1e-6, 2e-6))
    gpu = dataclasses.replace(gpu, kernels=dataclasses.replace(gpu.kernels, prefill_attention=walk))
    graph = build_pass(qwen, "prefill", 256, KV, layers=representative_layers(qwen.hparams))
    cost = pass_cost(graph, gpu, qwen, [0])
    flops, per_token, moved, kv_per_token, _, _ = cost.attention[0]
    for context in (256, 4096):
        roofline = max((flops + per_token * context) / gpu.fp32_flops,
                       (moved + kv_per_token * context) / gpu.memory_bandwidth_bytes_per_s)
        assert walk.walk_token_s * context > roofline / walk.efficiency      # this walk binds
        assert float(cost.attention_s(context, context)) == pytest.approx(
            walk.latency_s + walk.walk_token_s * context, rel=1e-12)
    decode = pass_cost(build_pass(qwen, "decode", 1, KV, layers=representative_layers(qwen.hparams)), gpu, qwen, [0])
    assert decode.attention[0][-1].walk_token_s == 0.0


def test_a_decode_matmul_reads_its_weights_at_their_types_rate():
    """Q4_K_M's attention matrices (Q4_K, a few Q6_K) at a measured Q4_K rate of 0.5: a decode step's dense
    nodes take exactly the Q4_K matrices' bytes once more at the read bandwidth over the matmul family's
    efficiency (memory-bound nodes: their bytes take twice as long); the Q6_K ones, the head and the routed
    experts' arithmetic are unchanged, and prefill's tiles are not priced by the rate."""
    model = load_model("qwen3-30b-a3b-q4_k_m")
    gpu = load_profile("h200-141g").gpus[0]
    rated = dataclasses.replace(gpu, decode_weight_rates=(("Q4_K", 0.5),))
    blocks = tuple(range(model.hparams.n_trunk))
    graph = build_pass(model, "decode", 1, KV, layers=representative_layers(model.hparams))
    plain_cost, rated_cost = (pass_cost(graph, g, model, blocks) for g in (gpu, rated))
    q4_k_attention = sum(t.n_bytes for t in model.tensors if t.ggml_type.name == "Q4_K"
                         and t.name.split(".")[-2] in ("attn_q", "attn_k", "attn_v", "attn_output"))
    extra_s = q4_k_attention / gpu.memory_bandwidth_bytes_per_s / gpu.kernels.decode_matmul.efficiency
    assert rated_cost.fixed_s - plain_cost.fixed_s == pytest.approx(extra_s, rel=1e-9)
    assert rated_cost.expert_compute_s() == plain_cost.expert_compute_s()
    prefill = build_pass(model, "prefill", 512, KV, layers=representative_layers(model.hparams))
    assert pass_cost(prefill, rated, model, blocks).tiled == pass_cost(prefill, gpu, model, blocks).tiled
