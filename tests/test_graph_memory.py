"""Pass graphs, their static arena, and the representative-block shortcut the planner takes."""

import dataclasses

import networkx as nx
import pytest

from codegen.cost import pass_cost
from codegen.graph import (ROUTER_OPS, build_pass, launch_members, launched, nodes_in_order,
                           representative_layers, written_at)
from codegen.memory import ARENA_ALIGNMENT_BYTES, buffer_of, full_pass_offsets, lifetimes, plan_arena
from planner.kv import parse_kv_type
from planner.model import load_model
from planner.profile import load_profile

KV = parse_kv_type("q8_0")


@pytest.fixture(scope="module")
def air():
    return load_model("glm-4.5-air-q4_k_m")


@pytest.fixture(scope="module")
def qwen():
    return load_model("qwen3-30b-a3b-q4_k_m")


@pytest.mark.parametrize("kind, tokens", [("prefill", 96), ("decode", 1), ("decode", 5), ("draft", 1)])
def test_graphs_are_dags_built_in_topological_order(air, kind, tokens):
    graph = build_pass(air, kind, tokens, KV, with_drafter=True)
    assert nx.is_directed_acyclic_graph(graph)
    order = {name: i for i, name in enumerate(nodes_in_order(graph))}
    assert all(order[a] < order[b] for a, b in graph.edges)


def test_prefill_computes_logits_for_the_last_position_only(air):
    graph = build_pass(air, "prefill", 4096, KV)
    assert graph.nodes["logits"]["shape"] == (1, air.hparams.n_vocab)
    window = build_pass(air, "decode", 5, KV)
    assert window.nodes["logits"]["shape"] == (5, air.hparams.n_vocab)


def test_every_dense_and_expert_weight_is_read_by_the_full_graph(air):
    graph = build_pass(air, "decode", 1, KV)
    read = {w for _, node in graph.nodes(data=True) for w in node["weights"]}
    trunk = {t.name for t in air.tensors if air.tensor_class[t.name] in ("dense", "expert")}
    assert trunk - read == set()


@pytest.mark.parametrize("kind, tokens", [("prefill", 128), ("decode", 3)])
def test_live_tensors_never_share_bytes(qwen, kind, tokens):
    graph = build_pass(qwen, kind, tokens, KV, layers=range(4))
    arena = plan_arena(graph)
    names = list(arena.lifetimes)
    assert set(arena.offsets) == {n for n, node in graph.nodes(data=True) if node["out_bytes"]}
    for i, a in enumerate(names):
        assert arena.offsets[a] % ARENA_ALIGNMENT_BYTES == 0
        assert arena.offsets[a] + arena.sizes[a] <= arena.size_bytes
        for b in names[i + 1:]:
            (fa, la), (fb, lb) = arena.lifetimes[a], arena.lifetimes[b]
            if fa <= lb and fb <= la:
                assert arena.offsets[a] + arena.sizes[a] <= arena.offsets[b] or \
                    arena.offsets[b] + arena.sizes[b] <= arena.offsets[a], (a, b)


@pytest.mark.parametrize("kind, tokens", [("prefill", 64), ("decode", 2)])
def test_a_fused_launch_writes_its_tensors_where_the_arena_says_they_are_live(qwen, kind, tokens):
    """q's RoPE rotates k too (and stores k and v), a decode window's q launch computes k and v, the router writes its weights (and
    a decode window's groups): each such tensor is live from its writer's launch, so nothing the arena places
    there in between is overwritten."""
    graph = build_pass(qwen, kind, tokens, KV, layers=range(2))
    order = {name: i for i, name in enumerate(nodes_in_order(graph))}
    spans = lifetimes(graph)
    fused = {"blk.1.k_rope": "blk.1.q_rope", "blk.1.route_weights": "blk.1.topk"}
    if kind == "decode":
        fused |= {"blk.1.k": "blk.1.q", "blk.1.v": "blk.1.q", "blk.1.moe_groups": "blk.1.topk"}
    for member, writer in fused.items():
        assert written_at(graph, member) == writer and not launched(graph.nodes[member])
        assert member in launch_members(graph, writer)
        assert spans[buffer_of(graph, member)][0] <= order[writer]
    # the K/V store (no tensor: it writes the pages) is the RoPE launch's too
    assert written_at(graph, "blk.1.kv_store") == "blk.1.q_rope" and not launched(graph.nodes["blk.1.kv_store"])
    launches = [name for name in graph if launched(graph.nodes[name]) and name.startswith("blk.1.")]
    assert len(launches) == (11 if kind == "decode" else 14)     # a qwen3moe block's kernels


@pytest.mark.parametrize("n_expert", [128, 1024])
def test_a_decode_window_routes_in_one_launch_prefill_in_two(qwen, n_expert):
    """Top-k and route weights are one launch in every pass; a decode window's groups are in it too, for every
    model the router takes (its warps hold the experts, its block the window's pairs)."""
    model = dataclasses.replace(qwen, hparams=dataclasses.replace(qwen.hparams, n_expert=n_expert))
    for kind, op in (("decode", "moe_route"), ("prefill", "topk")):
        graph = build_pass(model, kind, 4, KV, layers=[0])
        assert graph.nodes["blk.0.topk"]["op"] == op and op in ROUTER_OPS
        assert written_at(graph, "blk.0.route_weights") == "blk.0.topk"
        assert launched(graph.nodes["blk.0.moe_groups"]) == (kind == "prefill")


def test_the_residual_stream_is_one_buffer(qwen):
    graph = build_pass(qwen, "prefill", 64, KV, layers=range(3))
    arena = plan_arena(graph)
    assert {arena.offsets[f"blk.{b}.{op}"] for b in range(3) for op in ("attn_out", "moe_combine")} == \
        {arena.offsets["embed"]}


@pytest.mark.parametrize("card, kind, tokens", [("glm-4.5-air-q4_k_m", "prefill", 256),
                                                 ("qwen3-30b-a3b-q4_k_m", "prefill", 512),
                                                 ("glm-4.5-air-q4_k_m", "decode", 5)])
def test_the_representative_arena_serves_the_full_pass(card, kind, tokens):
    """The planner sizes the arena on one block of each kind; the runtime places every block's tensors at their
    representative's offsets: no two tensors alive at once may share bytes, and nothing lies beyond the arena."""
    model = load_model(card)
    full = build_pass(model, kind, tokens, KV, with_drafter=model.has_drafter)
    rep = plan_arena(build_pass(model, kind, tokens, KV, layers=representative_layers(model.hparams),
                                with_drafter=model.has_drafter))
    offsets = full_pass_offsets(full, rep, model.hparams)
    spans = lifetimes(full)
    ranges = sorted((offsets[b], offsets[b] + -(-full.nodes[b]["out_bytes"] // ARENA_ALIGNMENT_BYTES)
                     * ARENA_ALIGNMENT_BYTES, first, last) for b, (first, last) in spans.items())
    assert max(end for _, end, _, _ in ranges) <= rep.size_bytes
    for i, (start_a, end_a, first_a, last_a) in enumerate(ranges):
        for start_b, end_b, first_b, last_b in ranges[i + 1:]:
            if start_b >= end_a:
                break
            assert not (first_a <= last_b and first_b <= last_a), "two live tensors share bytes"


def test_arena_grows_with_the_chunk(qwen):
    sizes = [plan_arena(build_pass(qwen, "prefill", t, KV, layers=[0])).size_bytes for t in (64, 512, 4096)]
    assert sizes[0] < sizes[1] < sizes[2]


@pytest.mark.parametrize("kind, tokens", [("prefill", 512), ("decode", 1), ("decode", 4)])
def test_representative_cost_equals_the_full_graphs_cost(air, kind, tokens):
    """Blocks of one kind differ only in their weights' types: a representative priced with each block's
    own weight bytes must cost what the full graph costs."""
    gpu = load_profile("rtx-3090-24g").gpus[0]
    blocks = range(air.hparams.n_trunk)
    full = pass_cost(build_pass(air, kind, tokens, KV, with_drafter=True), gpu, air, blocks)
    rep = pass_cost(build_pass(air, kind, tokens, KV, layers=representative_layers(air.hparams), with_drafter=True),
                    gpu, air, blocks)
    assert rep.n_nodes == full.n_nodes
    assert rep.kv_bytes_per_token == full.kv_bytes_per_token
    for context in (1000, 20000):
        assert rep.dense_s(context, context) == pytest.approx(full.dense_s(context, context), rel=1e-12)


def test_decode_reads_the_weights_once_per_window(air):
    """A verify window of 5 reads the same dense bytes as a step of 1."""
    one = sum(n["weight_bytes"] for _, n in build_pass(air, "decode", 1, KV).nodes(data=True) if n["op"] != "embed")
    five = sum(n["weight_bytes"] for _, n in build_pass(air, "decode", 5, KV).nodes(data=True) if n["op"] != "embed")
    assert one == five
