"""Static activation memory: every intermediate of a pass gets a fixed offset in one arena.

Liveness over the graph's topological order, then greedy placement by decreasing size at the best-fitting
gap among the tensors whose lifetimes overlap (as XLA's and TVM's static planners do). The arena's size is
what the planner reserves; the offsets are what the runtime's kernels are given. Nothing is allocated per
step, so nothing can run out of memory mid-request.
"""

from dataclasses import dataclass

import networkx as nx

from codegen.graph import nodes_in_order, representative_of, written_at
from planner.architecture import tensor_layer

ARENA_ALIGNMENT_BYTES = 256     # cudaMalloc's alignment: every tensor starts where a kernel may vector-load


@dataclass(frozen=True)
class Arena:
    size_bytes: int
    offsets: dict          # tensor name -> byte offset in the arena
    lifetimes: dict        # buffer (a tensor not written in place) -> (first, last) position in the pass order
    sizes: dict            # buffer -> aligned bytes


def _aligned(n_bytes: int) -> int:
    return -(-n_bytes // ARENA_ALIGNMENT_BYTES) * ARENA_ALIGNMENT_BYTES


def buffer_of(graph: nx.DiGraph, name: str) -> str:
    """The tensor whose buffer `name` lives in: itself, or what an in-place op overwrote."""
    while graph.nodes[name].get("inplace"):
        name = graph.nodes[name]["inplace"]
    return name


def lifetimes(graph: nx.DiGraph) -> dict:
    """Buffer -> (position where it is first written, last position where it is read); a tensor another node's
    launch computes (`launched_by`) is written at that node's position."""
    order = nodes_in_order(graph)
    position = {name: i for i, name in enumerate(order)}
    end = len(order)
    spans = {}
    for name in order:
        node = graph.nodes[name]
        if node["out_bytes"] == 0:
            continue
        readers = [position[s] for s in graph.successors(name)]
        # inputs (token ids, positions) are read by every block: they live the whole pass, as outputs do
        last = end if node["output"] or node["op"] == "input" else max(readers, default=position[name])
        buffer = buffer_of(graph, name)
        first, previous_last = spans.get(buffer, (position[written_at(graph, name)], last))
        spans[buffer] = (first, max(last, previous_last))
    return spans


def plan_arena(graph: nx.DiGraph) -> Arena:
    """Offsets for every tensor (an in-place op's output shares its input's offset)."""
    spans = lifetimes(graph)
    sizes = {name: _aligned(graph.nodes[name]["out_bytes"]) for name in spans}
    placed: list[tuple[int, int, int, int]] = []     # (offset, size, first, last)
    offsets = {}
    for name in sorted(spans, key=lambda n: (-sizes[n], spans[n][0])):
        first, last = spans[name]
        size = sizes[name]
        busy = sorted((o, s) for o, s, f, l in placed if f <= last and first <= l)
        offset = _best_gap(busy, size)
        offsets[name] = offset
        placed.append((offset, size, first, last))
    size_bytes = max((o + s for o, s, _, _ in placed), default=0)
    for name, node in graph.nodes(data=True):
        if node["out_bytes"] and name not in offsets:
            offsets[name] = offsets[buffer_of(graph, name)]
    return Arena(size_bytes=size_bytes, offsets=offsets, lifetimes=spans, sizes=sizes)


def full_pass_offsets(graph: nx.DiGraph, representative_arena: Arena, hparams) -> dict:
    """Offsets for a pass over every block, from the arena planned on its representative blocks: each block's
    tensors take its representative's offsets. Blocks of a kind have the same graph and only the residual stream
    (one buffer) crosses them, so this is a valid placement, and the arena the planner reserved is exactly the
    one the runtime uses (a greedy packing of the full graph could differ by a few bytes either way)."""
    offsets = {}
    for name, node in graph.nodes(data=True):
        if not node["out_bytes"]:
            continue
        layer = tensor_layer(name)
        if layer is not None:
            name_in_arena = name.replace(f"blk.{layer}.", f"blk.{representative_of(hparams, layer)}.", 1)
        else:
            name_in_arena = name
        offsets[name] = representative_arena.offsets[name_in_arena]
    return offsets


def _best_gap(busy: list[tuple[int, int]], size: int) -> int:
    """The smallest free gap below the top that holds `size` bytes, else the top."""
    best, best_gap, cursor = None, None, 0
    for offset, length in busy:
        gap = offset - cursor
        if gap >= size and (best_gap is None or gap < best_gap):
            best, best_gap = cursor, gap
        cursor = max(cursor, offset + length)
    return cursor if best is None else best
