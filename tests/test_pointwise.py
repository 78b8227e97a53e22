"""Pointwise and routing kernels against runtime.reference: tiny shapes in the CUDA simulator, real shapes on
a GPU (`NUMBA_ENABLE_CUDASIM=0 pytest -m gpu tests/test_pointwise.py`)."""

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import ARGMAX_BLOCK_VALUES, argmax_blocks
from codegen.lower import kv_pages, pointwise, weights
from codegen.lower.cuda import cuda, mapped_device_view, mapped_filled
from planner.errors import StratumError
from runtime import reference
from tests.test_matmul import random_k_quant

TOLERANCE = 1e-5
EPS = 1e-6


def rel_l2(got, ref) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(np.asarray(got, dtype=np.float64) - ref) / np.linalg.norm(ref))


def run(launch, *arrays, results=None):
    """Upload `arrays` (an array passed twice is one device array: an in-place launch), launch on a stream,
    return the host copies of the arrays at positions `results` (default: the last one)."""
    stream = cuda.stream()
    uploaded = {id(a): cuda.to_device(np.ascontiguousarray(a), stream=stream) for a in arrays}
    device = [uploaded[id(a)] for a in arrays]
    launch(stream, *device)
    stream.synchronize()
    picked = [device[i].copy_to_host() for i in (results or [-1])]
    return picked[0] if results is None else picked


def rows_one_by_one(launch, *arrays, results=None):
    """The same launch for each row alone (arrays whose length is the row count are cut to that row; the
    others, weights, go whole), stacked: must equal the batched launch bitwise."""
    rows = len(arrays[0])
    singles = []
    for r in range(rows):
        per_row = [a[r:r + 1] if len(a) == rows else a for a in arrays]
        singles.append(run(launch, *per_row, results=results))
    return np.concatenate(singles) if results is None else [np.concatenate(p) for p in zip(*singles)]


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# --- embed -------------------------------------------------------------------------------------------------

def check_embed(rng, ggml_type, n_vocab, n_embd, rows):
    packed = weights.quantize(randn(rng, n_vocab, n_embd), ggml_type)
    table = weights.upload(packed)
    ids = rng.integers(0, n_vocab, rows).astype(np.int32)
    ids[-1] = n_vocab - 1
    ids[0] = ids[1]                                        # a repeated token
    stream = cuda.stream()
    out = cuda.device_array((rows, n_embd), np.float32)
    pointwise.make_embed(ggml_type, n_embd)(stream, cuda.to_device(ids), table, out)
    stream.synchronize()
    expected = weights.dequantize(packed)[ids].astype(np.float32)
    np.testing.assert_array_equal(out.copy_to_host(), expected)


@pytest.mark.parametrize("ggml_type", weights.KERNEL_TYPES, ids=lambda t: t.name)
def test_embed_every_type_exact(rng, ggml_type):
    """(K-quants: rows of whole 256-value blocks.)"""
    check_embed(rng, ggml_type, n_vocab=40, n_embd=256 if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K) else 96, rows=5)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_embed_k_quant_of_random_bytes_exact(rng, ggml_type):
    """Every scale (and min) and every quant (random bytes): gguf-py's values exactly."""
    packed = random_k_quant(rng, ggml_type, (12, 512))
    ids = rng.integers(0, 12, 4).astype(np.int32)
    out = cuda.device_array((4, 512), np.float32)
    pointwise.make_embed(ggml_type, 512)(0, cuda.to_device(ids), weights.upload(packed), out)
    np.testing.assert_array_equal(out.copy_to_host(), weights.dequantize(packed)[ids].astype(np.float32))


# --- RMSNorm -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [64, 600])       # 600: several elements a thread and a partial last step
def test_rmsnorm(rng, n):
    x, w = randn(rng, 4, n, scale=3.0), randn(rng, n)
    launch = pointwise.make_rmsnorm(n, EPS)
    got = run(launch, x, w, np.empty_like(x))
    assert rel_l2(got, reference.rmsnorm(x, w, EPS)) < TOLERANCE
    np.testing.assert_array_equal(run(launch, x, w, x, results=[0])[0], got)        # in place
    np.testing.assert_array_equal(rows_one_by_one(launch, x, w, np.empty_like(x)), got)


# --- RoPE, with qwen3moe's q/k norm before it and the K/V store after it -----------------------------------

PLACEHOLDER = np.zeros(1, np.float32)       # a RoPE without the norm never reads its weight
PAGE_TOKENS = 256


class RopeCase:
    """One RoPE launch's inputs: q, k, v, positions, and a permuted page table with spare slots (pages no
    position of the launch reaches have none); `pages()` makes zeroed pages and the full-context host copy."""

    def __init__(self, rng, kv_name, n_heads, n_k_heads, head_dim, n_rot, base, positions, norm):
        rows = len(positions)
        self.kv_name, self.n_k_heads, self.head_dim = kv_name, n_k_heads, head_dim
        self.q = randn(rng, rows, n_heads * head_dim, scale=2.0)
        self.k = randn(rng, rows, n_k_heads * head_dim, scale=2.0)
        self.v = randn(rng, rows, n_k_heads * head_dim, scale=2.0)
        self.positions = np.asarray(positions, dtype=np.int32)
        self.q_w, self.k_w = (randn(rng, head_dim), randn(rng, head_dim)) if norm else (PLACEHOLDER, PLACEHOLDER)
        self.n_pages = int(self.positions.max()) // PAGE_TOKENS + 1
        used = np.unique(self.positions // PAGE_TOKENS)
        self.table = np.full(self.n_pages, -1, np.int32)
        self.table[used] = rng.permutation(len(used) + 2)[:len(used)]
        self.n_slots = len(used) + 2
        self.launch = pointwise.make_rope(kv_name, n_heads, n_k_heads, head_dim, head_dim, n_rot, base,
                                          EPS if norm else None, PAGE_TOKENS)

    def pages(self):
        spec = lambda slots: kv_pages.kv_arrays(self.kv_name, slots, PAGE_TOKENS, self.n_k_heads, self.head_dim,
                                                self.head_dim).allocate()
        return spec(self.n_slots), spec(self.n_pages)

    def run(self, rows=slice(None), pages=None, q=None):
        """(q, k) rotated and the (slot pages, host copy) the launch stored into, for `rows` launched alone."""
        pages, host = pages or self.pages()
        q_d, k_d = cuda.to_device((self.q if q is None else q)[rows]), cuda.to_device(self.k[rows])
        self.launch(0, q_d, cuda.to_device(self.q_w), k_d, cuda.to_device(self.k_w), cuda.to_device(self.v[rows]),
                    cuda.to_device(self.positions[rows]), cuda.to_device(self.table), pages, host)
        cuda.synchronize()
        return q_d.copy_to_host(), k_d.copy_to_host(), (pages, host)


def page_bytes(pages) -> list:
    return [a.copy_to_host() for store in pages for a in store.stored_arrays()]


def check_rope(rng, kv_name, n_heads, n_k_heads, head_dim, n_rot, base, positions, norm=False):
    """The kernel against the reference (head_rmsnorm, then rope_neox) on q and k of one launch, and its pages
    bitwise what `make_kv_store` stores from the rotated k and v (slots and host copy): (case, q and k rotated,
    the pages)."""
    case = RopeCase(rng, kv_name, n_heads, n_k_heads, head_dim, n_rot, base, positions, norm)
    got_q, got_k, stored = case.run()
    rows = len(positions)
    for x, w, heads, rotated in ((case.q, case.q_w, n_heads, got_q), (case.k, case.k_w, n_k_heads, got_k)):
        normed = reference.head_rmsnorm(x, w, heads, EPS) if norm else x
        assert rel_l2(rotated, reference.rope_neox(normed, case.positions, heads, n_rot, base)) < TOLERANCE
        after, before = rotated.reshape(rows, heads, head_dim), normed.reshape(rows, heads, head_dim)
        if norm and n_rot < head_dim:
            assert rel_l2(after[..., n_rot:], before[..., n_rot:]) < TOLERANCE
        elif not norm:      # dims past the rotation are left as they were
            np.testing.assert_array_equal(after[..., n_rot:], before[..., n_rot:])
    pages, host = case.pages()
    kv_pages.make_kv_store(kv_name, n_k_heads, head_dim, head_dim, PAGE_TOKENS)(
        0, cuda.to_device(got_k), cuda.to_device(case.v), cuda.to_device(case.positions), cuda.to_device(case.table),
        pages, host)
    cuda.synchronize()
    for got, want in zip(page_bytes(stored), page_bytes((pages, host))):
        np.testing.assert_array_equal(got, want)
    assert any(a.any() for a in page_bytes(stored))
    return case, (got_q, got_k), stored


# full and partial rotary; head dims of one element a thread and of several (288: a partial last step)
@pytest.mark.parametrize("kv_name, n_heads, n_k_heads, head_dim, n_rot, base", [("f16", 3, 1, 32, 32, 10000.0),
                                                                                ("q8_0", 3, 2, 32, 16, 1000000.0),
                                                                                ("k8v4", 2, 1, 288, 128, 1000000.0)])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "norm+rope"])
def test_rope(rng, kv_name, n_heads, n_k_heads, head_dim, n_rot, base, norm):
    positions = [0, 1, int(rng.integers(2, 4096)), 29999, int(rng.integers(30000, 32768))]
    case, got, stored = check_rope(rng, kv_name, n_heads, n_k_heads, head_dim, n_rot, base, positions, norm)
    alone = case.pages()
    for r in range(len(positions)):     # each row launched alone rotates and stores the same bits
        q, k, _ = case.run(slice(r, r + 1), alone)
        np.testing.assert_array_equal(q, got[0][r:r + 1])
        np.testing.assert_array_equal(k, got[1][r:r + 1])
    for one_by_one, batched in zip(page_bytes(alone), page_bytes(stored)):
        np.testing.assert_array_equal(one_by_one, batched)


def test_rope_norms_each_head_on_its_own(rng):
    n_heads, head_dim = 3, 32
    case, (got_q, got_k), _ = check_rope(rng, "f16", n_heads, 2, head_dim, head_dim, 10000.0, [3, 70, 900], norm=True)
    scaled = case.q.copy()
    scaled[:, :head_dim] *= 7
    again_q, again_k, _ = case.run(q=scaled)
    np.testing.assert_array_equal(again_q[:, head_dim:], got_q[:, head_dim:])
    np.testing.assert_array_equal(again_k, got_k)        # k's heads do not see q's
    assert rel_l2(again_q[:, :head_dim], got_q[:, :head_dim]) < TOLERANCE     # a norm does not see a head's scale


def test_rope_rejects_odd_or_oversized_rotation_and_heads_the_store_cannot_hold():
    with pytest.raises(ValueError, match="n_rot 15 must be even"):
        pointwise.make_rope("f16", 2, 1, 32, 32, 15, 10000.0, None, PAGE_TOKENS)
    with pytest.raises(ValueError, match="within the head"):
        pointwise.make_rope("f16", 2, 1, 32, 32, 64, 10000.0, None, PAGE_TOKENS)
    with pytest.raises(StratumError, match="head_dim_v = 48"):
        pointwise.make_rope("f16", 2, 1, 32, 48, 32, 10000.0, None, PAGE_TOKENS)


# --- concat ------------------------------------------------------------------------------------------------

def test_concat(rng):
    a, b = randn(rng, 3, 40), randn(rng, 3, 24)
    got = run(pointwise.make_concat(40, 24), a, b, np.empty((3, 64), np.float32))
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=1))


# --- router ------------------------------------------------------------------------------------------------

def scores64(logits, gating, bias):
    logits = logits.astype(np.float64)
    return logits if gating == "softmax" else 1 / (1 + np.exp(-logits)) + bias


def separated_logits(rng, rows, n_expert, k, gating, bias, gap=1e-4):
    """Random logits whose k + 1 best scores are at least `gap` apart, so float32 rounding cannot change
    which experts win (ties are tested on their own)."""
    logits = randn(rng, rows, n_expert, scale=2.0)
    while True:
        top = -np.sort(-scores64(logits, gating, bias), axis=1)[:, :k + 1]
        close = np.any(np.diff(-top, axis=1) < gap, axis=1)
        if not close.any():
            return logits
        logits[close] = randn(rng, int(close.sum()), n_expert, scale=2.0)


def router_bias(rng, gating, n_expert):
    return randn(rng, n_expert, scale=0.1) if gating == "sigmoid" else np.zeros(1, np.float32)


def route(logits, bias, k, gating, normalize=True, scale=1.0, ids=None):
    """The router's (ids, weights) of every row."""
    ids = np.empty((len(logits), k), np.int32) if ids is None else ids
    launch = pointwise.make_router(logits.shape[1], k, gating, normalize, scale)
    return run(launch, logits, bias, ids, np.full((len(logits), k), np.nan, np.float32), results=[2, 3])


def check_topk(logits, bias, k, gating):
    ids, _ = route(logits, bias, k, gating)
    expected, _ = reference.route(logits, k, gating, bias if gating == "sigmoid" else None)
    np.testing.assert_array_equal(ids, expected)


@pytest.mark.parametrize("gating", pointwise.GATINGS)
def test_topk(rng, gating):
    n_expert, k = 64, 8
    bias = router_bias(rng, gating, n_expert)
    check_topk(separated_logits(rng, 4, n_expert, k, gating, bias), bias, k, gating)


@pytest.mark.parametrize("gating", pointwise.GATINGS)
def test_topk_ties_go_to_the_lower_index(rng, gating):
    n_expert, k = 50, 6          # the second run of 32 experts partial
    logits = rng.choice(np.float32([-1.0, -0.5, 0.0, 0.5, 1.0]), size=(4, n_expert)).astype(np.float32)
    logits[0] = 1.0                                           # every expert tied
    bias = np.full(n_expert, 0.25, np.float32) if gating == "sigmoid" else np.zeros(1, np.float32)
    check_topk(logits, bias, k, gating)


@pytest.mark.parametrize("gating", pointwise.GATINGS)
def test_topk_ranks_nan_last_so_ids_stay_distinct_experts(rng, gating):
    """Non-finite router logits (a drafter reading stale K/V once did) still give k distinct experts in range,
    the NaN ones last: a kernel indexing slot tables by these ids never reads out of bounds."""
    n_expert, k = 16, 6
    bias = router_bias(rng, gating, n_expert)
    logits = separated_logits(rng, 3, n_expert, k, gating, bias)
    logits[0, rng.choice(n_expert, size=12, replace=False)] = np.nan     # 4 finite experts, k = 6
    logits[1] = np.nan
    ids, _ = route(logits, bias, k, gating, ids=np.full((3, k), -7, np.int32))
    for row in range(3):
        assert len(set(ids[row])) == k and all(0 <= e < n_expert for e in ids[row])
    finite = np.flatnonzero(~np.isnan(logits[0]))
    assert set(ids[0, :len(finite)]) == set(finite)           # the 4 finite experts first
    assert list(ids[1]) == list(range(k))                     # all NaN: ties to the lower index
    np.testing.assert_array_equal(ids[2], reference.route(logits[2:], k, gating,
                                                          bias if gating == "sigmoid" else None)[0][0])


@pytest.mark.parametrize("gating, normalize, scale", [("softmax", True, 1.0), ("softmax", False, 1.0),
                                                      ("sigmoid", True, 2.5), ("sigmoid", False, 1.0)])
def test_route_weights(rng, gating, normalize, scale):
    n_expert, k = 40, 8         # two runs of 32 experts for the softmax sum, the second partial
    bias = router_bias(rng, gating, n_expert)
    logits = separated_logits(rng, 4, n_expert, k, gating, bias)
    _, expected = reference.route(logits, k, gating, bias if gating == "sigmoid" else None, normalize, scale)
    launch = pointwise.make_router(n_expert, k, gating, normalize, scale)
    arrays = (logits, bias, np.empty((4, k), np.int32), np.empty((4, k), np.float32))
    got = run(launch, *arrays, results=[3])[0]
    assert rel_l2(got, expected) < TOLERANCE
    np.testing.assert_array_equal(rows_one_by_one(launch, *arrays, results=[3])[0], got)


@pytest.mark.parametrize("gating", pointwise.GATINGS)
def test_router_bits_do_not_depend_on_the_block(rng, gating):
    """The same row's ids and weights, bitwise, from a block of 32 threads (two experts each), 64 and 128 (the
    beats counted over two slices): prefill's router and the decode routing launch run different blocks."""
    n_expert, k, rows = 40, 8, 3
    bias = router_bias(rng, gating, n_expert)
    logits = separated_logits(rng, rows, n_expert, k, gating, bias)
    logits[0, 7] = logits[0, 30]                     # a tie across the two slices
    got = []
    for threads in (32, 64, 128):
        route = pointwise.block_router(n_expert, k, gating, True, 1.5, threads)

        @cuda.jit
        def kernel(logits, bias, ids, weights):
            route(logits, bias, cuda.blockIdx.x, ids, weights)

        arrays = [cuda.to_device(a) for a in (logits, bias, np.full((rows, k), -1, np.int32),
                                               np.full((rows, k), np.nan, np.float32))]
        kernel[rows, threads](*arrays)
        got.append((arrays[2].copy_to_host(), arrays[3].copy_to_host()))
    for ids, weights in got[1:]:
        np.testing.assert_array_equal(ids, got[0][0])
        np.testing.assert_array_equal(weights, got[0][1])
    np.testing.assert_array_equal(got[0][0], reference.route(logits, k, gating,
                                                             bias if gating == "sigmoid" else None)[0])


def test_router_refuses_unknown_gating_and_too_many_experts():
    with pytest.raises(ValueError, match="unknown gating 'relu'"):
        pointwise.make_router(64, 8, "relu", True, 1.0)
    with pytest.raises(ValueError, match="top 8 of 2048 experts: the router takes 1..1024 experts"):
        pointwise.make_router(2048, 8, "softmax", True, 1.0)
    with pytest.raises(ValueError, match="top 9 of 8 experts"):
        pointwise.make_router(8, 9, "softmax", True, 1.0)


# --- argmax ------------------------------------------------------------------------------------------------

def tied_argmax_rows(rng, rows, n):
    """Random rows; in all but the first the maximum is repeated at several places (in different threads
    and passes), so only the first index is right; one row's first maximum is its last element."""
    logits = randn(rng, rows, n)
    for r in range(1, rows):
        places = rng.choice(n, size=4, replace=False)
        logits[r, places] = logits[r].max() + 1
    logits[-1, -1] = logits[-1].max() + 2
    logits[-1, 0] = logits[-1, -1] - 1
    return logits


def greedy(logits):
    """The two argmax launches over `logits`: the ids, and their copy in mapped host memory (the rows past the
    launch's untouched)."""
    rows, n = logits.shape
    partials = cuda.device_array((rows, argmax_blocks(n), 2), np.float32)
    ids, host_ids = cuda.device_array(rows, np.int32), mapped_filled(rows + 2, np.int32, -5)
    d_logits = cuda.to_device(logits)
    pointwise.make_argmax_partials(n)(0, d_logits, partials)
    pointwise.make_argmax(n)(0, partials, ids, mapped_device_view(host_ids))
    cuda.synchronize()
    assert (host_ids[rows:] == -5).all()
    np.testing.assert_array_equal(host_ids[:rows], ids.copy_to_host())
    return ids.copy_to_host()


# one run, partial; three runs, the last partial; runs of whole blocks; ties across runs (tied_argmax_rows)
@pytest.mark.parametrize("n", [151, 2 * ARGMAX_BLOCK_VALUES + 808, ARGMAX_BLOCK_VALUES])
def test_argmax_first_index_of_the_maximum(rng, n):
    logits = tied_argmax_rows(rng, 5, n)
    np.testing.assert_array_equal(greedy(logits), np.argmax(logits, axis=1))


def test_argmax_of_a_row_of_minus_infinity_is_its_first_index_and_nan_never_wins(rng):
    n = ARGMAX_BLOCK_VALUES + 100
    logits = np.full((2, n), -np.inf, np.float32)
    logits[1] = randn(rng, n)
    logits[1, 3] = np.nan
    np.testing.assert_array_equal(greedy(logits), [0, np.nanargmax(logits[1])])


def test_argmax_refuses_rows_its_partials_cannot_index():
    with pytest.raises(ValueError, match="2\\*\\*24"):
        pointwise.make_argmax_partials(1 << 24)


# --- real shapes, on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", weights.KERNEL_TYPES, ids=lambda t: t.name)
def test_gpu_embed(rng, ggml_type):
    check_embed(rng, ggml_type, n_vocab=4096, n_embd=4096, rows=64)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2048, 4096])
def test_gpu_rmsnorm(rng, n):
    x, w = randn(rng, 64, n, scale=3.0), randn(rng, n)
    launch = pointwise.make_rmsnorm(n, EPS)
    got = run(launch, x, w, np.empty_like(x))
    assert rel_l2(got, reference.rmsnorm(x, w, EPS)) < TOLERANCE
    np.testing.assert_array_equal(rows_one_by_one(launch, x[:8], w, np.empty_like(x[:8])), got[:8])
    np.testing.assert_array_equal(run(launch, x, w, x, results=[0])[0], got)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_name, n_heads, n_k_heads, n_rot, base, norm", [("f16", 32, 4, 128, 1000000.0, True),
                                                                            ("q8_0", 96, 8, 64, 1000000.0, False),
                                                                            ("q4_0", 4, 4, 128, 10000.0, False)])
def test_gpu_rope(rng, kv_name, n_heads, n_k_heads, n_rot, base, norm):
    # distinct positions: two rows at one position would store into the same page bytes, in either order
    positions = np.sort(np.concatenate([[0, 30000], rng.choice(np.arange(1, 30000), 62, replace=False)]))
    case, got, stored = check_rope(rng, kv_name, n_heads, n_k_heads, 128, n_rot, base, positions, norm)
    firsts = case.pages()
    for r in range(8):
        q, k, _ = case.run(slice(r, r + 1), firsts)
        np.testing.assert_array_equal(q, got[0][r:r + 1])
        np.testing.assert_array_equal(k, got[1][r:r + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("gating", pointwise.GATINGS)
def test_gpu_router(rng, gating):
    n_expert, k, rows = 128, 8, 512
    bias = router_bias(rng, gating, n_expert)
    logits = separated_logits(rng, rows, n_expert, k, gating, bias)
    expected_ids, expected = reference.route(logits, k, gating, bias if gating == "sigmoid" else None, True, 2.5)
    ids, got = route(logits, bias, k, gating, True, 2.5)
    np.testing.assert_array_equal(ids, expected_ids)
    assert rel_l2(got, expected) < TOLERANCE


@pytest.mark.gpu
def test_gpu_argmax_vocab(rng):
    n = 151936
    logits = tied_argmax_rows(rng, 8, n)
    np.testing.assert_array_equal(greedy(logits), np.argmax(logits, axis=1))
