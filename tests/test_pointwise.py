"""Pointwise and routing kernels against runtime.reference: tiny shapes in the CUDA simulator, real shapes on
a GPU (`NUMBA_ENABLE_CUDASIM=0 pytest -m gpu tests/test_pointwise.py`)."""

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from codegen.lower import pointwise, weights
from codegen.lower.cuda import cuda
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


# --- RoPE, with qwen3moe's q/k norm before it ----------------------------------------------------------------

PLACEHOLDER = np.zeros(1, np.float32)       # a RoPE without the norm never reads its weight


def check_rope(rng, n_heads, n_k_heads, head_dim, n_rot, base, positions, norm=False):
    """The kernel against the reference (head_rmsnorm, then rope_neox) on q and k of one launch: (launch, its
    arrays, [q, k] rotated)."""
    rows = len(positions)
    q, k = randn(rng, rows, n_heads * head_dim, scale=2.0), randn(rng, rows, n_k_heads * head_dim, scale=2.0)
    positions = np.asarray(positions, dtype=np.int32)
    q_w, k_w = (randn(rng, head_dim), randn(rng, head_dim)) if norm else (PLACEHOLDER, PLACEHOLDER)
    launch = pointwise.make_rope(n_heads, n_k_heads, head_dim, n_rot, base, EPS if norm else None)
    arrays = (q, q_w, k, k_w, positions)
    got = run(launch, *arrays, results=[0, 2])
    for x, w, heads, rotated in ((q, q_w, n_heads, got[0]), (k, k_w, n_k_heads, got[1])):
        normed = reference.head_rmsnorm(x, w, heads, EPS) if norm else x
        assert rel_l2(rotated, reference.rope_neox(normed, positions, heads, n_rot, base)) < TOLERANCE
        after, before = rotated.reshape(rows, heads, head_dim), normed.reshape(rows, heads, head_dim)
        if norm and n_rot < head_dim:
            assert rel_l2(after[..., n_rot:], before[..., n_rot:]) < TOLERANCE
        elif not norm:      # dims past the rotation are left as they were
            np.testing.assert_array_equal(after[..., n_rot:], before[..., n_rot:])
    return launch, arrays, got


# full and partial rotary; head dims of one element a thread and of several (300: a partial last step)
@pytest.mark.parametrize("n_heads, n_k_heads, head_dim, n_rot, base", [(3, 1, 32, 32, 10000.0),
                                                                       (3, 2, 32, 16, 1000000.0),
                                                                       (2, 1, 300, 128, 1000000.0)])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "norm+rope"])
def test_rope(rng, n_heads, n_k_heads, head_dim, n_rot, base, norm):
    positions = [0, 1, int(rng.integers(2, 4096)), 29999, int(rng.integers(30000, 32768))]
    launch, arrays, got = check_rope(rng, n_heads, n_k_heads, head_dim, n_rot, base, positions, norm)
    for one_by_one, batched in zip(rows_one_by_one(launch, *arrays, results=[0, 2]), got):
        np.testing.assert_array_equal(one_by_one, batched)


def test_rope_norms_each_head_on_its_own(rng):
    n_heads, head_dim = 3, 32
    launch, (q, q_w, k, k_w, positions), (got_q, got_k) = check_rope(rng, n_heads, 2, head_dim, head_dim, 10000.0,
                                                                     [3, 70, 900], norm=True)
    scaled = q.copy()
    scaled[:, :head_dim] *= 7
    again_q, again_k = run(launch, scaled, q_w, k, k_w, positions, results=[0, 2])
    np.testing.assert_array_equal(again_q[:, head_dim:], got_q[:, head_dim:])
    np.testing.assert_array_equal(again_k, got_k)        # k's heads do not see q's
    assert rel_l2(again_q[:, :head_dim], got_q[:, :head_dim]) < TOLERANCE     # a norm does not see a head's scale


def test_rope_rejects_odd_or_oversized_rotation():
    with pytest.raises(ValueError):
        pointwise.make_rope(2, 1, 32, 15, 10000.0)
    with pytest.raises(ValueError):
        pointwise.make_rope(2, 1, 32, 64, 10000.0)


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


@pytest.mark.parametrize("n", [1000, 151])     # several passes with a partial last; one partial pass
def test_argmax_first_index_of_the_maximum(rng, n):
    logits = tied_argmax_rows(rng, 5, n)
    got = run(pointwise.make_argmax(n), logits, np.empty(5, np.int32))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=1))


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
@pytest.mark.parametrize("n_heads, n_k_heads, n_rot, base, norm", [(32, 4, 128, 1000000.0, True),
                                                                   (96, 8, 64, 1000000.0, False),
                                                                   (4, 4, 128, 10000.0, False)])
def test_gpu_rope(rng, n_heads, n_k_heads, n_rot, base, norm):
    positions = np.sort(rng.integers(0, 32768, 64))
    positions[:2] = [0, 30000]
    launch, (q, q_w, k, k_w, positions), got = check_rope(rng, n_heads, n_k_heads, 128, n_rot, base, positions,
                                                          norm)
    firsts = rows_one_by_one(launch, q[:8], q_w, k[:8], k_w, positions[:8], results=[0, 2])
    for one_by_one, batched in zip(firsts, got):
        np.testing.assert_array_equal(one_by_one, batched[:8])


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
    got = run(pointwise.make_argmax(n), logits, np.empty(8, np.int32))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=1))
