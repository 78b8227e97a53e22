"""Matmul kernels (codegen.lower.matmul) against the float64 reference, and the bitwise
invariance each family promises: prefill rows equal whatever the chunk, decode rows whatever the window.

Simulator tests use tiny shapes (dims 32-256, a few rows); `gpu` tests the real ones on the H200."""


import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import prefill_tiling
from codegen.lower import MAX_WINDOW, matmul, matmul_decode, matmul_prefill, weights
from codegen.lower.cuda import CapturedGraph, cuda, kernels_overlap
from codegen.lower.word_formats import FORMATS
from planner.model import split_bytes
from runtime import reference

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0]
TOL = 1e-5


def rel_err(got, ref) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def packed_weight(rng, ggml_type, shape):
    """(packed, device weight, float64 values the kernel must compute with)."""
    packed = weights.quantize(rng.standard_normal(shape).astype(np.float32), ggml_type)
    return packed, weights.upload(packed), weights.dequantize(packed)


def activations(rng, rows, n):
    return rng.standard_normal((rows, n)).astype(np.float32)


def run_matmul(family, ggml_type, x, w, bias=None, residual=None):
    """x @ W.T (+ bias); with `residual` (rows, n_out), added in place to it."""
    n_out = w.shape[0]
    launch = matmul.make_matmul(family, ggml_type, x.shape[1], n_out, bias is not None, residual is not None)
    b = cuda.to_device(bias if bias is not None else np.zeros(1, np.float32))
    out = cuda.to_device(np.full((len(x), n_out), np.nan, np.float32) if residual is None else residual)
    launch(0, cuda.to_device(x), w, b, out)
    return out.copy_to_host()


def assert_rows_reproduced(family, ggml_type, x, w, expected, parts):
    """Launches over rows x[start:start + size] give exactly those rows of `expected`."""
    for start, size in parts:
        assert np.array_equal(run_matmul(family, ggml_type, x[start:start + size], w), expected[start:start + size])


def run_swiglu(family, ggml_type, x, gate, up):
    n_ff = gate.shape[0]
    out = cuda.to_device(np.full((len(x), n_ff), np.nan, np.float32))
    matmul.make_swiglu_matmul(family, ggml_type, x.shape[1], n_ff)(0, cuda.to_device(x), gate, up, out)
    return out.copy_to_host()


# ---------------------------------------------------------------------------------------------------------
# dense


@pytest.mark.parametrize("family", ["decode", "prefill"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matmul_matches_reference(rng, family, ggml_type):
    n_in, n_out, rows = 96, 40, (3 if family == "decode" else 5)
    _, w, ref_w = packed_weight(rng, ggml_type, (n_out, n_in))
    x = activations(rng, rows, n_in)
    bias = rng.standard_normal(n_out).astype(np.float32) if ggml_type in (T.F16, T.Q8_0) else None
    ref = x.astype(np.float64) @ ref_w.T + (0 if bias is None else bias)
    assert rel_err(run_matmul(family, ggml_type, x, w, bias), ref) < TOL


@pytest.mark.parametrize("family", ["decode", "prefill"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_matmul_adds_to_the_residual_stream_as_an_add_would(rng, family, with_bias):
    """With a residual, out += the product: bitwise the product (and bias) first, then one float32 addition
    to the residual, the bits a separate add kernel gave."""
    n_in, n_out, rows = 96, 40, (3 if family == "decode" else 5)
    _, w, _ = packed_weight(rng, T.Q8_0, (n_out, n_in))
    x, residual = activations(rng, rows, n_in), activations(rng, rows, n_out)
    bias = rng.standard_normal(n_out).astype(np.float32) if with_bias else None
    product = run_matmul(family, T.Q8_0, x, w, bias)
    np.testing.assert_array_equal(run_matmul(family, T.Q8_0, x, w, bias, residual), residual + product)


@pytest.mark.parametrize("family", ["decode", "prefill"])
@pytest.mark.parametrize("ggml_type", [T.F32, T.BF16, T.Q4_0], ids=lambda t: t.name)
def test_swiglu_matches_reference(rng, family, ggml_type):
    n_in, n_ff, rows = 64, 72, 3
    _, gate, ref_gate = packed_weight(rng, ggml_type, (n_ff, n_in))
    _, up, ref_up = packed_weight(rng, ggml_type, (n_ff, n_in))
    x = activations(rng, rows, n_in)
    got = run_swiglu(family, ggml_type, x, gate, up)
    assert rel_err(got, reference.swiglu(x.astype(np.float64), ref_gate, ref_up)) < TOL


def test_prefill_rows_do_not_depend_on_the_chunk(rng):
    """A row's outputs are bitwise the same computed in a chunk of 1, 3, 16 or 64 rows, at any offset (Q4_0:
    its half-block loads are the trickiest; the GPU test repeats this for F32, F16 and Q8_0)."""
    n_in, n_out = 64, 24
    _, w, _ = packed_weight(rng, T.Q4_0, (n_out, n_in))
    x = activations(rng, 64, n_in)
    assert_rows_reproduced("prefill", T.Q4_0, x, w, run_matmul("prefill", T.Q4_0, x, w), ((5, 1), (17, 3), (33, 16)))


def test_prefill_swiglu_rows_do_not_depend_on_the_chunk(rng):
    _, gate, _ = packed_weight(rng, T.Q8_0, (40, 64))
    _, up, _ = packed_weight(rng, T.Q8_0, (40, 64))
    x = activations(rng, 16, 64)
    whole = run_swiglu("prefill", T.Q8_0, x, gate, up)
    assert np.array_equal(run_swiglu("prefill", T.Q8_0, x[9:12], gate, up), whole[9:12])


def test_decode_rows_do_not_depend_on_the_window(rng):
    """Windows of 1..5 rows give each row bitwise what a window of that row alone gives (the GPU test
    repeats this for Q8_0 and BF16)."""
    n_in, n_out = 256, 20
    _, w, _ = packed_weight(rng, T.Q4_0, (n_out, n_in))
    x = activations(rng, 5, n_in)
    alone = np.concatenate([run_matmul("decode", T.Q4_0, x[r:r + 1], w) for r in range(5)])
    assert_rows_reproduced("decode", T.Q4_0, x, w, alone, [(0, window) for window in range(2, 6)])


def test_decode_refuses_groups_wider_than_the_matrix(rng):
    """A group computes nr consecutive rows (the last group the matrix's last nr), so a matrix needs nr rows."""
    n_in, n_out = 64, 3
    _, w, _ = packed_weight(rng, T.Q8_0, (n_out, n_in))
    data, scales = matmul.words(w)
    x = cuda.to_device(activations(rng, 1, n_in))
    shape = matmul_decode.decode_shape(FORMATS[T.Q8_0], n_in, n_out, 1)
    assert shape.nr <= n_out
    kernel = matmul_decode.decode_kernel(T.Q8_0, n_in, False, False, shape._replace(nr=4))
    with pytest.raises(ValueError, match="decode matmul of 3 rows: .* computes 4 rows a group"):
        kernel(0, x, data, scales, data, scales, x, cuda.to_device(np.zeros((1, n_out), np.float32)))


def test_decode_rows_do_not_depend_on_rows_per_group_or_chunks_in_flight(rng):
    """The decode shape's free parameters (weight rows a group owns, chunks a lane holds in flight) change
    which lanes load what, never a row's sum: the kernel picks them per window, and windows must agree."""
    n_in, n_out = 256, 20
    packed, w, _ = packed_weight(rng, T.Q8_0, (n_out, n_in))
    data, scales = matmul.words(w)
    x = cuda.to_device(activations(rng, 3, n_in))
    base = matmul_decode.decode_shape(FORMATS[T.Q8_0], n_in, n_out, 3)
    results = []
    for nr, unroll in [(1, 1), (2, 2), (8, 1), (3, 2)]:
        out = cuda.to_device(np.full((3, n_out), np.nan, np.float32))
        kernel = matmul_decode.decode_kernel(T.Q8_0, n_in, False, False, base._replace(nr=nr, unroll=unroll))
        kernel(0, x, data, scales, data, scales, x, out)
        results.append(out.copy_to_host())
    assert not np.isnan(results[0]).any()
    for other in results[1:]:
        assert np.array_equal(other, results[0])


def check_qkv(rng, n_in, mats, rows):
    """A decode window's q, k and v in one launch, `mats` their (type, rows, bias?): each output bitwise
    make_matmul's decode launch of that matrix, which matches the reference."""
    x = activations(rng, rows, n_in)
    args, parts, expected = [], [], []
    for ggml_type, n_out, with_bias in mats:
        _, w, ref_w = packed_weight(rng, ggml_type, (n_out, n_in))
        bias = rng.standard_normal(n_out).astype(np.float32) if with_bias else None
        alone = run_matmul("decode", ggml_type, x, w, bias)
        assert rel_err(alone, x.astype(np.float64) @ ref_w.T + (0 if bias is None else bias)) < TOL
        expected.append(alone)
        out = cuda.to_device(np.full((rows, n_out), np.nan, np.float32))
        args += [w, cuda.to_device(bias if with_bias else np.zeros(1, np.float32)), out]
        parts.append(matmul.DecodePart(ggml_type, n_out, with_bias))
    matmul.make_qkv_matmul(n_in, tuple(parts))(0, cuda.to_device(x), *args)
    for out, alone in zip(args[2::3], expected):
        np.testing.assert_array_equal(out.copy_to_host(), alone)


@pytest.mark.parametrize("rows", [1, 4])
def test_qkv_launch_gives_each_projection_its_own_launchs_bits(rng, rows):
    check_qkv(rng, 128, [(T.Q8_0, 48, True), (T.Q4_0, 16, False), (T.F16, 16, True)], rows)


def test_decode_swiglu_rows_do_not_depend_on_the_window(rng):
    _, gate, _ = packed_weight(rng, T.Q4_0, (24, 128))
    _, up, _ = packed_weight(rng, T.Q4_0, (24, 128))
    x = activations(rng, MAX_WINDOW, 128)
    full = run_swiglu("decode", T.Q4_0, x, gate, up)
    assert np.array_equal(run_swiglu("decode", T.Q4_0, x[3:4], gate, up), full[3:4])


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_decode_dequantizes_extreme_quants(rng, ggml_type):
    """Every quant value (-128..127, nibbles 0..15) decodes exactly: the extremes in every byte position."""
    n_in, n_out = 64, 8
    packed, _, _ = packed_weight(rng, ggml_type, (n_out, n_in))
    data = packed.data.copy()
    if ggml_type == T.Q8_0:
        data[:4] = np.resize(np.array([-128, 127, -1, 0], np.int8), data[:4].shape)
    else:
        data[:4] = np.resize(np.array([0x0F, 0xF0, 0x00, 0xFF, 0x87, 0x78], np.uint8), data[:4].shape)
    extreme = weights.PackedWeight(ggml_type, packed.shape, data, packed.scales)
    x = activations(rng, 2, n_in)
    got = run_matmul("decode", ggml_type, x, weights.upload(extreme))
    assert rel_err(got, x.astype(np.float64) @ weights.dequantize(extreme).T) < TOL


# ---------------------------------------------------------------------------------------------------------
# K-quants: blocks of 256 values. Q4_K and Q5_K: each 32-value sub-block's values scale * q - min (4-bit, 5-bit
# quants); Q6_K: each 16-value run's values d * sc * (q - 32), 6-bit quants


def random_k_quant(rng, ggml_type, shape):
    """Weights of random bytes (Q4_K, Q5_K: every 6-bit scale and min and every 4- or 5-bit quant; Q6_K: every
    int8 scale and 6-bit quant), d (and dmin) 1e-3..1e-2: all of gguf-py's unpacking exercised, not only what
    a quantizer writes."""
    block_bytes, d_at = {T.Q4_K: (144, 0), T.Q5_K: (176, 0), T.Q6_K: (210, 208)}[ggml_type]
    raw = rng.integers(0, 256, (int(np.prod(shape[:-1])), shape[-1] // 256, block_bytes), dtype=np.uint8)
    n_floats = 1 if ggml_type == T.Q6_K else 2
    raw[:, :, d_at:d_at + 2 * n_floats] = \
        rng.uniform(1e-3, 1e-2, raw.shape[:2] + (n_floats,)).astype(np.float16).view(np.uint8)
    return weights.pack(raw, ggml_type, shape)


@pytest.mark.parametrize("ggml_type, quant_bytes, header_bytes, code_error",
                         [(T.Q4_K, 128, 16, 0.1), (T.Q5_K, 160, 16, 0.05), (T.Q6_K, 192, 18, 0.03)],
                         ids=["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_pack_their_gguf_bytes_apart_and_back(rng, ggml_type, quant_bytes, header_bytes, code_error):
    """The quants reordered, the headers apart: the bytes the planner counts (`split_bytes`), and unpack gives
    the GGUF bytes back."""
    packed = random_k_quant(rng, ggml_type, (3, 512))
    assert (packed.data.nbytes, packed.scales.nbytes) == split_bytes(ggml_type, 3 * 512) \
        == (3 * 2 * quant_bytes, 3 * 2 * header_bytes)
    raw = weights.unpack(packed)
    assert weights.pack(raw, ggml_type, (3, 512)).data.tobytes() == packed.data.tobytes()
    assert np.array_equal(weights.unpack(weights.pack(raw, ggml_type, (3, 512))), raw)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    assert rel_err(weights.dequantize(weights.quantize(x, ggml_type)), x) < code_error     # a 4- to 6-bit code


@pytest.mark.parametrize("family", ["decode", "prefill"])
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quant_matmul_and_swiglu_match_reference(rng, family, ggml_type):
    """Against gguf-py's dequantization, a bias and a random-bytes weight; decode: a row alone gives its
    window's bits."""
    n_in, rows = 512, (3 if family == "decode" else 5)
    w = random_k_quant(rng, ggml_type, (8, n_in))
    x = activations(rng, rows, n_in)
    bias = rng.standard_normal(8).astype(np.float32)
    got = run_matmul(family, ggml_type, x, weights.upload(w), bias)
    assert rel_err(got, x.astype(np.float64) @ weights.dequantize(w).T + bias) < TOL
    if family == "decode":
        assert np.array_equal(run_matmul(family, ggml_type, x[1:2], weights.upload(w), bias), got[1:2])
    gate, up = (weights.quantize(rng.standard_normal((8, n_in)).astype(np.float32), ggml_type) for _ in range(2))
    act = run_swiglu(family, ggml_type, x, weights.upload(gate), weights.upload(up))
    want = reference.swiglu(x.astype(np.float64), weights.dequantize(gate), weights.dequantize(up))
    assert rel_err(act, want) < TOL


@pytest.mark.parametrize("ggml_type", [T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_multi_word_chunks_keep_prefill_rows_of_any_chunk_and_decode_rows_of_any_window(rng, ggml_type):
    """Q5_K's 20-word and Q6_K's 12-word chunks, whose steps span several scales, keep both families'
    invariances."""
    _, w, _ = packed_weight(rng, ggml_type, (12, 256))
    x = activations(rng, 17, 256)
    assert_rows_reproduced("prefill", ggml_type, x, w, run_matmul("prefill", ggml_type, x, w),
                           ((2, 1), (5, 3), (1, 16)))
    alone = np.concatenate([run_matmul("decode", ggml_type, x[r:r + 1], w) for r in range(4)])
    assert_rows_reproduced("decode", ggml_type, x, w, alone, [(0, 4)])


@pytest.mark.parametrize("args, message", [
    (("verify", T.F32, 64, 8, False), "unknown kernel family"),
    (("decode", T.Q4_1, 64, 8, False), "no matmul kernel for Q4_1"),
    (("prefill", T.F32, 40, 8, False), "multiple of 32"),
    (("decode", T.Q4_K, 96, 8, False), "multiple of 256"),
    (("prefill", T.Q6_K, 128, 8, False), "multiple of 256"),
])
def test_refuses_what_it_cannot_run(args, message):
    with pytest.raises(ValueError, match=message):
        matmul.make_matmul(*args)


# ---------------------------------------------------------------------------------------------------------
# real shapes on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("family, ggml_type", [("decode", T.Q8_0), ("decode", T.Q4_0), ("decode", T.BF16),
                                               ("decode", T.Q4_K), ("decode", T.Q5_K), ("decode", T.Q6_K),
                                               ("prefill", T.F32), ("prefill", T.Q8_0), ("prefill", T.F16),
                                               ("prefill", T.Q4_K), ("prefill", T.Q5_K), ("prefill", T.Q6_K)],
                         ids=lambda v: getattr(v, "name", v))
def test_gpu_real_shape(rng, family, ggml_type):
    """Against the reference; decode windows of 2..5 give each row's bits alone, prefill chunks of 1, 3, 16
    and 64 rows at any offset give those rows of a 300-row chunk."""
    n_in = 4096 if family == "decode" else 2048
    _, w, ref_w = packed_weight(rng, ggml_type, (4096, n_in))
    if family == "decode":
        x = activations(rng, 5, n_in)
        expected = np.concatenate([run_matmul(family, ggml_type, x[r:r + 1], w) for r in range(5)])
        parts = [(0, window) for window in range(2, 6)]
    else:
        x = activations(rng, 300, n_in)
        expected = run_matmul(family, ggml_type, x, w)
        parts = ((0, 1), (100, 3), (131, 16), (200, 64))
    assert rel_err(expected, x.astype(np.float64) @ ref_w.T) < TOL
    assert_rows_reproduced(family, ggml_type, x, w, expected, parts)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, MAX_WINDOW])
@pytest.mark.parametrize("n_in, n_q, n_kv, with_bias", [(2048, 4096, 512, False), (4096, 12288, 1024, True)],
                         ids=["qwen3-30b", "glm-4.5-air"])
def test_gpu_qkv_real_shapes(rng, n_in, n_q, n_kv, with_bias, rows):
    check_qkv(rng, n_in, [(T.Q8_0, n_q, with_bias), (T.Q8_0, n_kv, with_bias), (T.Q8_0, n_kv, with_bias)], rows)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, MAX_WINDOW])
def test_gpu_decode_chain_of_overlapping_kernels(rng, rows):
    """Six decode matmuls (Q4_0, Q8_0, Q4_K), each reading the one before's output and every other one adding
    into its output as into the residual stream, launched back to back so that each may start while the one
    before drains (`kernels_overlap`): ten rounds, and ten replays of a captured round, give bitwise what ten
    rounds give with the GPU synchronised after every launch. Each round changes every output, so a kernel
    that read its activations, or its residual, before the previous kernel's writes would read the round
    before's."""
    if not kernels_overlap():
        pytest.skip("this GPU runs kernels one after another (compute capability below 9.0)")
    n = 4096
    links = []
    for k, ggml_type in enumerate([T.Q4_0, T.Q8_0, T.Q4_K] * 2):
        # values ~1/64: a link keeps its input's magnitude
        w = weights.upload(weights.quantize(rng.standard_normal((n, n)).astype(np.float32) / 64, ggml_type))
        links.append((matmul.make_matmul("decode", ggml_type, n, n, False, residual=k % 2 == 0), w))
    start = [activations(rng, rows, n) for _ in range(len(links) + 1)]
    outputs = [cuda.to_device(values) for values in start]
    no_bias = cuda.to_device(np.zeros(1, np.float32))
    stream = cuda.stream()

    def one_round(stream, synchronize=False):
        for k, (launch, w) in enumerate(links):
            launch(stream, outputs[k], w, no_bias, outputs[k + 1])
            if synchronize:
                stream.synchronize()

    def ten_rounds(run_round):
        for output, values in zip(outputs, start):
            output.copy_to_device(values, stream=stream)
        stream.synchronize()
        for _ in range(10):
            run_round(stream)
        stream.synchronize()
        return [output.copy_to_host() for output in outputs]

    one_round(stream, synchronize=True)     # every kernel compiled before the capture
    once = outputs[-1].copy_to_host()
    expected = ten_rounds(lambda s: one_round(s, synchronize=True))
    assert np.isfinite(expected[-1]).all() and not np.array_equal(expected[-1], once)
    back_to_back = ten_rounds(one_round)
    graph = CapturedGraph(one_round, stream)
    try:
        replayed = ten_rounds(graph.replay)
    finally:
        graph.close()
    for k in range(1, len(outputs)):
        np.testing.assert_array_equal(back_to_back[k], expected[k], err_msg=f"link {k - 1}, back to back")
        np.testing.assert_array_equal(replayed[k], expected[k], err_msg=f"link {k - 1}, graph replay")


@pytest.mark.parametrize("n_in, n_out, rows, swiglu", [(256, 96, 1, False), (256, 4096, 200, False),
                                                       (512, 130, 65, False), (256, 200, 129, True)])
def test_prefill_matmul_launches_the_tiles_the_cost_model_prices(monkeypatch, rng, n_in, n_out, rows, swiglu):
    """The prefill kernel's grid is the tiles codegen.cost prices (codegen.graph.prefill_tiling): one geometry for
    both (a launch intercepted, nothing runs)."""
    grids = []
    monkeypatch.setattr(matmul_prefill, "launch_kernel", lambda kernel, grid, *args: grids.append(grid))
    _, w, _ = packed_weight(rng, T.Q8_0, (n_out, n_in))
    x, out = cuda.to_device(activations(rng, rows, n_in)), cuda.device_array((rows, n_out), np.float32)
    if swiglu:
        matmul.make_swiglu_matmul("prefill", T.Q8_0, n_in, n_out)(0, x, w, w, out)
    else:
        matmul.make_matmul("prefill", T.Q8_0, n_in, n_out, False)(0, x, w, cuda.to_device(np.zeros(1, np.float32)), out)
    node = {"op": "swiglu_matmul" if swiglu else "matmul", "shape": (rows, n_out), "n_in": n_in}
    tiling = prefill_tiling(node)
    (grid,) = grids
    assert grid[0] == tiling.col_tiles and grid[0] * grid[1] == tiling.tiles(rows)
