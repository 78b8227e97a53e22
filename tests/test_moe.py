"""Routed-expert kernels (codegen.lower.moe) against the float64 reference: the groups and route launches,
the expert FFN of both families from VRAM slots or mapped host memory, expert ranges, and the ordered combine.

Simulator tests use tiny shapes; `gpu` tests the real ones on the H200."""


import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import EXPERT_TILE_ROWS, moe_groups_length
from codegen.lower import MAX_WINDOW, moe, pointwise, weights
from codegen.lower.cuda import cuda, mapped_device_view, mapped_filled
from runtime import reference
from tests.test_matmul import TOL, activations, rel_err

E, K = 4, 2                      # experts, used per row
D_IN, D_FF, D_OUT = 32, 32, 32   # n_embd, n_ff_exp, n_embd out


def expected_groups(ids, n_expert):
    flat = ids.reshape(-1)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=n_expert))])
    pairs = np.concatenate([np.flatnonzero(flat == e) for e in range(n_expert)])
    active = [e for e in range(n_expert) if offsets[e + 1] > offsets[e]]
    return offsets, pairs, active


def run_groups(ids, n_expert, k):
    groups = cuda.to_device(np.full(moe_groups_length(n_expert, ids.size), -7, np.int32))
    moe.make_moe_groups(n_expert, k)(0, cuda.to_device(ids), groups)
    return groups


def check_groups(groups, ids, n_expert):
    got = groups.copy_to_host()
    offsets, pairs, active = expected_groups(ids, n_expert)
    n = ids.size
    assert np.array_equal(got[:n_expert + 1], offsets)
    assert np.array_equal(got[n_expert + 1:n_expert + 1 + n], pairs)
    assert got[n_expert + 1 + n] == len(active)
    assert np.array_equal(got[n_expert + 2 + n:n_expert + 2 + n + len(active)], active)


def top_ids(rng, rows, n_expert=E, k=K, chosen=None):
    """Distinct experts per row, as top-k gives, from the first `chosen` experts (all); expert 1 never."""
    pool = [e for e in range(chosen or n_expert) if e != 1]
    return np.array([rng.choice(pool, k, replace=False) for _ in range(rows)], np.int32)


@pytest.mark.parametrize("rows, n_expert, k", [(1, 6, 2), (5, 6, 2), (40, 8, 3), (1100, 5, 2)])
def test_moe_groups_lists_pairs_by_expert(rng, rows, n_expert, k):
    ids = top_ids(rng, rows, n_expert, k)
    check_groups(run_groups(ids, n_expert, k), ids, n_expert)


def test_moe_groups_takes_repeated_experts(rng):
    ids = rng.integers(0, 4, (7, 3)).astype(np.int32)
    check_groups(run_groups(ids, 4, 3), ids, 4)


def test_moe_groups_refuses_too_many_experts():
    with pytest.raises(ValueError, match="1..1024 experts"):
        moe.make_moe_groups(2048, 8)


ROUTE_CASES = [("softmax", True, 1.0), ("sigmoid", True, 2.5), ("sigmoid", False, 1.0)]


def check_moe_route(rng, n_expert, k, gating, normalize, scale, rows):
    """The decode family's routing launch: bitwise the ids and weights of the prefill family's router (which
    runs a smaller block), the groups buffer of the grouping kernel, the ids in the host's copy too (a
    window's rows of it; the rest untouched)."""
    logits = (rng.standard_normal((rows, n_expert)) * 2).astype(np.float32)
    logits[0, 5] = logits[0, 9]          # a tie: the lower index first
    bias = ((rng.standard_normal(n_expert) * 0.1).astype(np.float32) if gating == "sigmoid"
            else np.zeros(1, np.float32))
    d_logits, d_bias = cuda.to_device(logits), cuda.to_device(bias)
    ids, route_w = cuda.device_array((rows, k), np.int32), cuda.device_array((rows, k), np.float32)
    groups = cuda.to_device(np.full(moe_groups_length(n_expert, rows * k), -7, np.int32))
    host_ids = mapped_filled((MAX_WINDOW, k), np.int32, -3)
    moe.make_moe_route(n_expert, k, gating, normalize, scale)(0, d_logits, d_bias, ids, route_w, groups,
                                                             mapped_device_view(host_ids))
    cuda.synchronize()
    one_by_one_ids, one_by_one_w = cuda.device_array((rows, k), np.int32), cuda.device_array((rows, k), np.float32)
    pointwise.make_router(n_expert, k, gating, normalize, scale)(0, d_logits, d_bias, one_by_one_ids, one_by_one_w)
    np.testing.assert_array_equal(ids.copy_to_host(), one_by_one_ids.copy_to_host())
    np.testing.assert_array_equal(route_w.copy_to_host(), one_by_one_w.copy_to_host())
    expected_ids, _ = reference.route(logits, k, gating, bias if gating == "sigmoid" else None)
    np.testing.assert_array_equal(ids.copy_to_host(), expected_ids)
    np.testing.assert_array_equal(host_ids[:rows], expected_ids)
    assert (host_ids[rows:] == -3).all()
    check_groups(groups, ids.copy_to_host(), n_expert)


@pytest.mark.parametrize("gating, normalize, scale", ROUTE_CASES)
@pytest.mark.parametrize("rows", [1, 3, MAX_WINDOW])
def test_moe_route_is_topk_weights_and_groups_in_one_launch(rng, gating, normalize, scale, rows):
    """For any window; more experts than the simulator's routing block has threads."""
    check_moe_route(rng, 40, 4, gating, normalize, scale, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("gating, normalize, scale", ROUTE_CASES)
@pytest.mark.parametrize("rows", [1, 5])
def test_gpu_moe_route(rng, gating, normalize, scale, rows):
    """At Qwen3-30B-A3B's 128 experts, top 8: the decode block counts beats over four slices, prefill's over
    one."""
    check_moe_route(rng, 128, 8, gating, normalize, scale, rows)


def test_moe_route_refuses_more_experts_than_the_router_takes():
    with pytest.raises(ValueError, match="1..1024 experts"):
        moe.make_moe_route(2048, 8, "softmax", True, 1.0)


def random_q8_0(rng, shape):
    """Q8_0 weights made from random quants and scales directly (quantizing 600M floats takes minutes)."""
    scales = (rng.random((*shape[:-1], shape[-1] // 32)) * 0.02 + 0.001).astype(np.float16)
    return weights.PackedWeight(T.Q8_0, shape, rng.integers(-127, 128, shape, dtype=np.int8), scales)


_NAN_BITS = {T.F32: np.float32(np.nan), T.F16: np.float16(np.nan), T.BF16: np.uint16(0x7FC0)}


def select_experts(packed, experts):
    """The packed weights of the listed experts, in that order; -1 lists a poisoned one (NaN wherever read:
    float values NaN, quant scales NaN)."""
    experts = np.asarray(experts)
    index = np.maximum(experts, 0)
    data = packed.data[index]
    scales = None if packed.scales is None else packed.scales[index]
    if packed.scales is None:
        data[experts < 0] = _NAN_BITS[packed.ggml_type]
    else:
        scales[experts < 0] = np.nan
    return weights.PackedWeight(packed.ggml_type, (len(experts), *packed.shape[1:]), data, scales)


def mixed_slots(rng, n_expert):
    """slot_of with half the experts in VRAM slots at shuffled indices (one spare slot, poisoned, too), the
    other half only in the host copy (-1)."""
    slot_of = np.full(n_expert, -1, np.int32)
    cached = rng.permutation(n_expert)[:n_expert // 2]
    slot_of[cached] = rng.permutation(len(cached) + 1)[:len(cached)]
    return slot_of


class Experts:
    """Random experts (expert order) placed by a slot_of: expert e in the VRAM slot arrays at slot_of[e] when
    that is >= 0, else only in the host arrays (mapped memory) at e. Whatever a kernel must not read (spare
    slots, host copies of cached experts) is poisoned, so reading the wrong source shows as NaN."""

    def __init__(self, rng, ggml_type, n_expert=E, d_in=D_IN, d_ff=D_FF, d_out=D_OUT, quantized=False,
                 slot_of=None):
        self.type, self.n_expert = ggml_type, n_expert
        shapes = ((n_expert, d_ff, d_in), (n_expert, d_ff, d_in), (n_expert, d_out, d_ff))
        if quantized:       # already quants (Q8_0)
            self.packed = [random_q8_0(rng, shape) for shape in shapes]
        else:
            self.packed = [weights.quantize(rng.standard_normal(shape).astype(np.float32), ggml_type)
                           for shape in shapes]
        self.d_ff, self.d_out = d_ff, d_out
        self.place(mixed_slots(rng, n_expert) if slot_of is None else slot_of)

    def place(self, slot_of):
        """Put the experts where slot_of says (all slots: a permutation; all host: -1 everywhere)."""
        self.slot_of = np.asarray(slot_of, np.int32)
        cached = self.slot_of >= 0
        in_slot = np.full(max(1, self.slot_of.max() + 1), -1)
        in_slot[self.slot_of[cached]] = np.flatnonzero(cached)
        in_host = np.where(cached, -1, np.arange(self.n_expert))
        self.slots = [weights.upload(select_experts(p, in_slot)) for p in self.packed]
        # the simulator's mapped memory is a plain simulated array: there this checks the two-source logic,
        # on a GPU the kernels read host memory itself
        self.host = [weights.mapped_upload(select_experts(p, in_host)) for p in self.packed]
        return self

    def reference(self, experts):
        """float64 gate, up, down of the listed experts, in that order."""
        return [weights.dequantize(select_experts(p, experts)) for p in self.packed]

    def launches(self, family, d_in, k=K):
        swiglu = moe.make_moe_swiglu_matmul(family, self.type, d_in, self.d_ff, self.n_expert, k)
        down = moe.make_moe_down_matmul(family, self.type, self.d_ff, self.d_out, self.n_expert, k)
        return swiglu, down

    def run(self, family, x, ids, route_w, residual, k=K, ranges=((0, None),), trace=None, exact=False):
        """(act, out) of gate/up then down over each expert range in turn (as the prefill ring streams them),
        then (prefill) the combine, out starting as `residual` (the kernels add the block's output to it);
        `trace`, a list: (act, terms) after each range is appended to it; exact:
        each range launched with its tiles from the routing (`range_tiles`), as the engine launches them."""
        swiglu, down = self.launches(family, x.shape[1], k)
        groups = run_groups(ids, self.n_expert, k)
        slot_of = cuda.to_device(self.slot_of)
        ids_device, x, route_w = cuda.to_device(ids), cuda.to_device(x), cuda.to_device(route_w)
        act = cuda.to_device(np.full((ids.size, self.d_ff), np.nan, np.float32))
        out = cuda.to_device(np.ascontiguousarray(residual))
        terms = cuda.to_device(np.full((ids.size, self.d_out), np.nan, np.float32))
        (gate, up, dw), (host_gate, host_up, host_down) = self.slots, self.host
        edges = [lo for lo, _ in ranges] + [self.n_expert]
        tiles = moe.range_tiles(ids, self.n_expert, edges) if exact else [None] * len(ranges)
        for (lo, hi), range_tiles in zip(ranges, tiles):
            swiglu(0, x, groups, slot_of, gate, up, host_gate, host_up, act, lo, hi, tiles=range_tiles)
            if family == "decode":
                down(0, act, groups, route_w, slot_of, dw, host_down, out)
                continue
            down(0, act, groups, slot_of, dw, host_down, terms, lo, hi, tiles=range_tiles)
            if trace is not None:
                trace.append((act.copy_to_host(), terms.copy_to_host()))
        if family == "prefill":
            moe.make_moe_combine(self.d_out, k)(0, terms, ids_device, route_w, out)
        check_groups(groups, ids, self.n_expert)     # as it was
        return act.copy_to_host(), out.copy_to_host()


def moe_inputs(rng, rows, k=K, d_in=D_IN, n_expert=E, d_out=D_OUT):
    """(x, ids, route weights, the residual stream the block's output is added to)"""
    return (activations(rng, rows, d_in), top_ids(rng, rows, n_expert, k), rng.random((rows, k)).astype(np.float32),
            activations(rng, rows, d_out))


def check_moe(experts, x, ids, route_w, residual, act, out):
    used, local = np.unique(ids, return_inverse=True)
    local = local.reshape(ids.shape)
    gate, up, down = experts.reference(used)
    x64, k = x.astype(np.float64), ids.shape[1]
    ref_act = np.stack([reference.swiglu(x64[p // k][None], gate[e], up[e])[0]
                        for p, e in enumerate(local.reshape(-1))])
    assert rel_err(act, ref_act) < TOL
    assert rel_err(out, residual + reference.moe(x64, local, route_w, gate, up, down)) < TOL


def test_moe_prefill_matches_reference_for_any_chunk(rng):
    """Gate/up and down against the reference, half the experts read from VRAM slots, half from the host
    copy; then a chunk of 3 of those rows gives their bits again (the GPU test repeats this at Qwen3-30B-A3B's
    shape)."""
    experts = Experts(rng, T.Q4_0)
    x, ids, route_w, residual = moe_inputs(rng, 7)
    act, whole = experts.run("prefill", x, ids, route_w, residual)
    check_moe(experts, x, ids, route_w, residual, act, whole)
    part = slice(3, 6)
    assert np.array_equal(experts.run("prefill", x[part], ids[part], route_w[part], residual[part])[1], whole[part])


def test_moe_decode_matches_reference_for_any_window(rng):
    """A window of 5 against the reference, experts from slots and host; row 0 alone (its experts then
    grouped with no other row) gives the same bits."""
    experts = Experts(rng, T.Q8_0)
    x, ids, route_w, residual = moe_inputs(rng, 5)
    act, window = experts.run("decode", x, ids, route_w, residual)
    check_moe(experts, x, ids, route_w, residual, act, window)
    assert np.array_equal(experts.run("decode", x[:1], ids[:1], route_w[:1], residual[:1])[1], window[:1])


@pytest.mark.parametrize("family", ["decode", "prefill"])
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_moe_k_quant_matches_reference(rng, family, ggml_type):
    """K-quant experts (rows of one 256-value block), half from slots and half from the host copy."""
    experts = Experts(rng, ggml_type, d_in=256, d_ff=256)
    x, ids, route_w, residual = moe_inputs(rng, 2, d_in=256)
    check_moe(experts, x, ids, route_w, residual, *experts.run(family, x, ids, route_w, residual))


@pytest.mark.parametrize("family, rows", [("decode", 4), ("prefill", 5)])
def test_moe_reads_the_same_bits_from_slots_or_host(rng, family, rows):
    """Every expert from VRAM slots (shuffled), then every expert from the host copy: act and out equal."""
    experts = Experts(rng, T.Q8_0, slot_of=rng.permutation(E))
    x, ids, route_w, residual = moe_inputs(rng, rows)
    from_slots = experts.run(family, x, ids, route_w, residual)
    from_host = experts.place(np.full(E, -1)).run(family, x, ids, route_w, residual)
    assert not np.isnan(from_slots[1]).any()
    assert all(np.array_equal(a, b) for a, b in zip(from_slots, from_host))


RANGES = ((0, 3), (3, 7), (7, None))
N_RANGED = 8        # experts of the range tests (RANGES covers them)


@pytest.mark.parametrize("exact", [False, True], ids=["any routing", "the routing's tiles"])
def test_moe_prefill_over_expert_ranges_equals_one_launch(rng, exact):
    """gate/up then down over experts [0, 3), [3, 7), [7, 8) in turn, then the combine, give bitwise the act
    and out of one launch over all (a row's terms add in ascending expert order whatever the ranges, here 3
    per row), with grids for any routing or each range's tiles; a range writes only its experts' act and term
    rows (both start as NaN)."""
    experts = Experts(rng, T.F16, n_expert=N_RANGED)
    x, ids, route_w, residual = moe_inputs(rng, 6, k=3, n_expert=N_RANGED)
    act, out = experts.run("prefill", x, ids, route_w, residual, k=3)
    check_moe(experts, x, ids, route_w, residual, act, out)
    trace = []
    ranged = experts.run("prefill", x, ids, route_w, residual, k=3, ranges=RANGES, trace=trace, exact=exact)
    assert np.array_equal(ranged[0], act) and np.array_equal(ranged[1], out)
    pair_experts = ids.reshape(-1)
    for (_, hi), (seen_act, seen_terms) in zip(RANGES, trace):
        done = pair_experts < (hi or N_RANGED)
        assert np.array_equal(seen_act[done], act[done]) and np.isnan(seen_act[~done]).all()
        assert not np.isnan(seen_terms[done]).any() and np.isnan(seen_terms[~done]).all()


def test_moe_prefill_over_expert_ranges_for_any_chunk(rng):
    """A chunk split in two, each half over the expert ranges: the rows of one whole launch, bitwise."""
    experts = Experts(rng, T.Q8_0, n_expert=N_RANGED)
    x, ids, route_w, residual = moe_inputs(rng, 5, n_expert=N_RANGED)
    _, whole = experts.run("prefill", x, ids, route_w, residual)
    for part in (slice(0, 2), slice(2, 5)):
        _, out = experts.run("prefill", x[part], ids[part], route_w[part], residual[part], ranges=RANGES)
        assert np.array_equal(out, whole[part])


def test_range_tiles_counts_the_tiles_the_routing_makes(rng):
    """Each range's tiles are the sum over its experts of ceil(pairs / EXPERT_TILE_ROWS) (brute force over a
    random routing, ranges of 0 to 5 experts)."""
    n_expert, rows, k = 16, 300, 4
    ids = top_ids(rng, rows, n_expert, k)
    edges = [0, 0, 1, 5, 5, 7, 12, 16]
    pairs = np.bincount(ids.reshape(-1), minlength=n_expert)
    expected = [sum(-(-pairs[e] // EXPERT_TILE_ROWS) for e in range(a, b)) for a, b in zip(edges, edges[1:])]
    assert moe.range_tiles(ids, n_expert, edges) == expected
    assert expected[0] == 0 and expected[2] >= 4


def test_moe_combine_adds_each_rows_terms_in_ascending_expert_order(rng):
    """out[r] += the sum of route_w[r, j] * terms[r * k + j] over the row's slots sorted by expert id, from 0, in
    float32 in that order (bitwise), whatever order top-k listed the experts in, added to the residual last."""
    rows, k, n_out = 6, 4, 40
    ids = np.stack([rng.permutation(9)[:k] for _ in range(rows)]).astype(np.int32)
    terms = rng.standard_normal((rows * k, n_out)).astype(np.float32)
    route_w = rng.random((rows, k)).astype(np.float32)
    residual = rng.standard_normal((rows, n_out)).astype(np.float32)
    out = cuda.to_device(residual)
    moe.make_moe_combine(n_out, k)(0, cuda.to_device(terms), cuda.to_device(ids), cuda.to_device(route_w), out)
    expected = np.zeros((rows, n_out), np.float32)
    for r in range(rows):
        for j in np.argsort(ids[r], kind="stable"):
            expected[r] = expected[r] + route_w[r, j] * terms[r * k + j]
    assert np.array_equal(out.copy_to_host(), residual + expected)


def test_moe_combine_refuses_more_terms_than_it_orders():
    with pytest.raises(ValueError, match="at most 32 terms a row"):
        moe.make_moe_combine(64, 33)


@pytest.mark.parametrize("lo, hi", [(1, None), (0, 3)])
def test_moe_decode_refuses_an_expert_range(lo, hi):
    """Decode runs over every expert in one launch: a range is refused before anything is read."""
    swiglu = moe.make_moe_swiglu_matmul("decode", T.F32, D_IN, D_FF, E, K)
    down = moe.make_moe_down_matmul("decode", T.F32, D_FF, D_OUT, E, K)
    with pytest.raises(ValueError, match="decode runs over all 4 experts"):
        swiglu(0, None, None, None, None, None, None, None, None, lo, hi)
    with pytest.raises(ValueError, match="decode runs over all 4 experts"):
        down(0, None, None, None, None, None, None, None, lo, hi)


def test_moe_decode_refuses_a_tile_count():
    """A decode window's grid covers any routing (its graph is replayed for every step): no tile count."""
    down = moe.make_moe_down_matmul("decode", T.F32, D_FF, D_OUT, E, K)
    with pytest.raises(ValueError, match="takes no tile count"):
        down(0, None, None, None, None, None, None, None, tiles=1)


def test_moe_prefill_refuses_a_range_outside_the_experts():
    swiglu = moe.make_moe_swiglu_matmul("prefill", T.F32, D_IN, D_FF, E, K)
    with pytest.raises(ValueError, match=r"need 0 <= lo <= hi <= 4"):
        swiglu(0, None, None, None, None, None, None, None, None, 3, 5)


# ---------------------------------------------------------------------------------------------------------
# real shapes on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["decode", "prefill"])
def test_gpu_moe_qwen3_30b_shape(rng, family):
    """128 experts of Qwen3-30B-A3B's shape, half in VRAM slots and half in mapped host memory; a prefill
    chunk's 96 rows use 24 of them (so each gets ~32 pairs, and the float64 reference dequantizes 24, not 128).
    Then: a few rows again give their bits; prefill over three expert ranges gives the bits of one launch,
    with grids for any routing and with the routing's tiles (`range_tiles`); every expert read from the host copy gives
    the bits of every expert read from slots."""
    experts = Experts(rng, T.Q8_0, n_expert=128, d_in=2048, d_ff=768, d_out=2048, quantized=True)
    rows = 5 if family == "decode" else 96
    ids = top_ids(rng, rows, 128, 8, chosen=None if family == "decode" else 24)
    x, route_w = activations(rng, rows, 2048), rng.random((rows, 8)).astype(np.float32)
    residual = activations(rng, rows, 2048)
    act, out = experts.run(family, x, ids, route_w, residual, k=8)
    check_moe(experts, x, ids, route_w, residual, act, out)
    part = slice(1, 4)
    _, out_part = experts.run(family, x[part], ids[part], route_w[part], residual[part], k=8)
    assert np.array_equal(out_part, out[part])
    if family == "prefill":
        for exact in (False, True):
            ranged = experts.run(family, x, ids, route_w, residual, k=8, ranges=((0, 7), (7, 16), (16, None)),
                                 exact=exact)
            assert np.array_equal(ranged[0], act) and np.array_equal(ranged[1], out)
    from_slots = experts.place(rng.permutation(128)).run(family, x, ids, route_w, residual, k=8)
    from_host = experts.place(np.full(128, -1)).run(family, x, ids, route_w, residual, k=8)
    assert all(np.array_equal(a, b) for a, b in zip(from_slots, from_host))
    assert np.array_equal(from_slots[1], out)
