"""Paged K/V store and attention kernels (codegen.lower.attention) against gguf-py and runtime.reference.

Kernels run in numba's CUDA simulator here (tiny shapes: the simulator runs every thread as a Python thread);
the `gpu` tests repeat them at Qwen3-30B-A3B's shape on a real GPU (NUMBA_ENABLE_CUDASIM=0 pytest -m gpu).
"""


import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from codegen.graph import ATTENTION_SPLITS
from codegen.lower import MAX_WINDOW
from codegen.lower import attention as att
from codegen.lower.attention_decode import LANES as DECODE_TILE, block_warps, make_decode_attention
from codegen.lower.attention_combine import make_attention_combine
from codegen.lower import kv_pages
from codegen.lower.cuda import cuda
from planner.errors import StratumError
from planner.kv import parse_kv_type, row_bytes
from runtime.reference import attention, kv_round

KV_NAMES = ("f32", "f16", "q8_0", "q4_0", "k8v4")
TOLERANCE = 1e-5


def _relative(got, ref):
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


class Setup:
    """One layer's K/V for positions 0..ctx-1, stored through make_kv_store into pages behind a permuted table
    with spare slots, and the reference's rounded K/V."""

    def __init__(self, rng, kv_name, ctx, n_head=4, n_head_kv=2, dk=32, dv=32, page_tokens=4, stored=None,
                 q_from=0):
        self.kv_name, self.kv = kv_name, parse_kv_type(kv_name)
        self.n_head, self.n_head_kv, self.dk, self.dv, self.page_tokens = n_head, n_head_kv, dk, dv, page_tokens
        n_pages = -(-ctx // page_tokens)
        n_slots = n_pages + 3
        self.table = rng.permutation(n_slots)[:n_pages].astype(np.int32)
        self.pages = kv_pages.kv_arrays(kv_name, n_slots, page_tokens, n_head_kv, dk, dv).allocate()
        self.k = rng.standard_normal((ctx, n_head_kv * dk)).astype(np.float32)
        self.v = rng.standard_normal((ctx, n_head_kv * dv)).astype(np.float32)
        self.q_from = q_from                   # queries for positions q_from..ctx-1
        self.q = rng.standard_normal((ctx - q_from, n_head * dk)).astype(np.float32)
        self.d_table = cuda.to_device(self.table)
        stored = ctx if stored is None else stored
        self.store(np.arange(stored, dtype=np.int32))
        self.k_ref = kv_round(self.k, self.kv.k_type)
        self.v_ref = kv_round(self.v, self.kv.v_type)

    def store(self, positions, host_pages=None):
        launch = kv_pages.make_kv_store(self.kv_name, self.n_head_kv, self.dk, self.dv, self.page_tokens)
        launch(0, cuda.to_device(self.k[positions]), cuda.to_device(self.v[positions]), cuda.to_device(positions),
               self.d_table, self.pages, host_pages)

    def reference(self, positions):
        ctx = positions.max() + 1
        return attention(self.q[positions - self.q_from], self.k_ref[:ctx], self.v_ref[:ctx], positions, self.n_head,
                         self.n_head_kv)

    def prefill(self, positions, tuning=None, host_pages=None, window=0):
        """The production prefill kernel's rows, or with a `tuning` the previous kernel's (the benchmark's v1)."""
        launch = (att.make_attention("prefill", self.kv_name, self.n_head, self.n_head_kv, self.dk, self.dv,
                                     self.page_tokens, window) if tuning is None else
                  att._attention_launch("prefill", self.kv_name, self.n_head, self.n_head_kv, self.dk, self.dv,
                                        self.page_tokens, tuning, window))
        out = cuda.to_device(np.full((len(positions), self.n_head * self.dv), np.nan, np.float32))
        launch(0, cuda.to_device(self.q[positions - self.q_from]), cuda.to_device(positions.astype(np.int32)),
               self.d_table, self.pages, out, host_pages)
        return out.copy_to_host()

    def decode(self, positions, host_pages=None, window=0, warps=None):
        """(partials, combined output) of one decode window at `positions`."""
        rows = len(positions)
        partials = cuda.to_device(np.full((rows, self.n_head, ATTENTION_SPLITS, self.dv + 2), np.nan, np.float32))
        out = cuda.to_device(np.full((rows, self.n_head * self.dv), np.nan, np.float32))
        launch = (att.make_attention("decode", self.kv_name, self.n_head, self.n_head_kv, self.dk, self.dv,
                                     self.page_tokens, window) if warps is None else
                  make_decode_attention(self.kv_name, self.n_head, self.n_head_kv, self.dk, self.dv, self.page_tokens,
                                        window, warps))
        launch(0, cuda.to_device(self.q[positions - self.q_from]), cuda.to_device(positions.astype(np.int32)),
               self.d_table, self.pages, partials, host_pages)
        make_attention_combine(self.n_head, self.dv)(0, partials, out)
        return partials.copy_to_host(), out.copy_to_host()


# ---------------------------------------------------------------------------------------------------------
# pages


@pytest.mark.parametrize("kv_name", KV_NAMES + ("k16v8", "k4v16", "k8v16"))
@pytest.mark.parametrize("n_slots, page_tokens, n_head_kv, dk, dv", [(3, 4, 2, 32, 32), (7, 256, 4, 128, 128),
                                                                      (2, 64, 8, 128, 64)])
def test_page_bytes_are_the_planners(kv_name, n_slots, page_tokens, n_head_kv, dk, dv):
    kv = parse_kv_type(kv_name)
    planned = n_slots * page_tokens * (row_bytes(n_head_kv * dk, kv.k_type) + row_bytes(n_head_kv * dv, kv.v_type))
    pages = kv_pages.kv_arrays(kv_name, n_slots, page_tokens, n_head_kv, dk, dv)
    assert pages.nbytes == planned
    assert (pages.n_slots, pages.page_tokens) == (n_slots, page_tokens)
    allocated = pages.allocate(lambda shape, dtype: np.zeros(shape, dtype))
    assert allocated.nbytes == planned
    counted = [a for a, t in zip(allocated.arrays(), (None, kv.k_type, None, kv.v_type))
               if t is None or t in (T.Q8_0, T.Q4_0)]
    assert sum(a.nbytes for a in counted) == planned
    assert all(a.shape[0] == n_slots for a in counted)      # slot-major: a slot is one run of each array


@pytest.mark.parametrize("kv_name", ["bf16", "q5_0", "q4_1"])
def test_kv_types_without_kernels_are_refused(kv_name):
    with pytest.raises(StratumError, match="has no kernel"):
        kv_pages.kv_arrays(kv_name, 2, 4, 1, 32, 32)


def test_head_dims_must_be_whole_blocks():
    with pytest.raises(StratumError, match="multiple of 32"):
        kv_pages.kv_arrays("f16", 2, 4, 1, 48, 32)


def _stored_gguf_bytes(data, scales, ggml_type, slot, head, t, n_head_kv, page_tokens, dim):
    """One stored (slot, kv head, token) row as GGUF bytes: blocks of scale then quants, or the raw values."""
    raw = data.reshape(data.shape[0], n_head_kv, page_tokens, -1)[slot, head, t].view(np.uint8)
    if ggml_type not in (T.Q8_0, T.Q4_0):
        return raw
    blocks = dim // 32
    row_scales = scales.reshape(scales.shape[0], n_head_kv, page_tokens, blocks)[slot, head, t]
    return np.concatenate([row_scales.reshape(blocks, 1).view(np.uint8), raw.reshape(blocks, -1)], axis=1).reshape(-1)


def _special_rows(rng, rows, width):
    """Random rows with blocks that stress rounding: zeros, ties for the largest magnitude, tiny and huge values."""
    x = (rng.standard_normal((rows, width)) * rng.choice([0.01, 1.0, 30.0], (rows, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = np.where(np.arange(32) % 2, 3.0, -3.0)       # +-3 tie: the first wins the Q4_0 scale's sign
    x[2, 32:64] = rng.standard_normal(32) * 1e-6             # F16 subnormals
    x[3, :4] = [65504.0, 65519.0, 65520.0, -5e5]             # F16 overflow boundary
    x[4, :32] = np.arange(32) - 15.5                         # exact halves after scaling
    return x


def _check_stored_bytes(rng, kv_name, n_head_kv, dk, dv, page_tokens, start, rows):
    """Store rows at positions start.. (straddling pages) and compare every stored row with gguf-py's bytes."""
    kv = parse_kv_type(kv_name)
    setup = Setup(rng, kv_name, start + rows, n_head_kv=n_head_kv, dk=dk, dv=dv, page_tokens=page_tokens, stored=0)
    setup.k[start:] = _special_rows(rng, rows, n_head_kv * dk)
    setup.v[start:] = _special_rows(rng, rows, n_head_kv * dv)
    positions = np.arange(start, start + rows, dtype=np.int32)
    setup.store(positions)
    for x, (data, scales), ggml_type, dim in ((setup.k, setup.pages.arrays()[:2], kv.k_type, dk),
                                             (setup.v, setup.pages.arrays()[2:], kv.v_type, dv)):
        data, scales = data.copy_to_host(), scales.copy_to_host()
        with np.errstate(over="ignore"):
            expected = quants.quantize(x[positions].reshape(rows * n_head_kv, dim), ggml_type)
        expected = expected.reshape(rows, n_head_kv, -1).view(np.uint8)
        for pos in positions:
            slot, t = setup.table[pos // page_tokens], pos % page_tokens
            for head in range(n_head_kv):
                got = _stored_gguf_bytes(data, scales, ggml_type, slot, head, t, n_head_kv, page_tokens, dim)
                np.testing.assert_array_equal(got, expected[pos - start, head],
                                              err_msg=f"{ggml_type.name} position {pos} head {head}")
        written = np.zeros(data.shape[0], bool)
        written[setup.table[positions // page_tokens]] = True
        assert not data[~written].any()                          # slots the table does not name are untouched


@pytest.mark.parametrize("kv_name", KV_NAMES + ("k4v16",))
def test_stored_bytes_are_gguf_quantized(rng, kv_name):
    _check_stored_bytes(rng, kv_name, n_head_kv=2, dk=64, dv=32, page_tokens=4, start=5, rows=11)


# ---------------------------------------------------------------------------------------------------------
# prefill


@pytest.mark.parametrize("kv_name", KV_NAMES)
def test_prefill_matches_the_reference(rng, kv_name):
    setup = Setup(rng, kv_name, 30)
    positions = np.arange(13, 30)              # a chunk after a reused prefix, straddling pages
    got = setup.prefill(positions)
    assert _relative(got, setup.reference(positions)) < TOLERANCE


@pytest.mark.parametrize("kv_name", ["f16", "k8v4"])
def test_pages_the_table_marks_missing_are_read_from_the_host_copy(rng, kv_name):
    """A store writes each page into its slot and, given a host copy (mapped memory, page p at index p),
    through to it, the same bits; attention reads a page the table marks -1 from the host copy (its slot
    filled with garbage here): prefill rows and a decode window bitwise as with every page in its slot."""
    setup = Setup(rng, kv_name, 30)
    want_rows, want_window = setup.prefill(np.arange(13, 30)), setup.decode(np.arange(27, 30))
    n_pages = len(setup.table)
    host = kv_pages.mapped_host_copy(kv_pages.kv_arrays(kv_name, n_pages, setup.page_tokens, setup.n_head_kv,
                                                        setup.dk, setup.dv))
    setup.store(np.arange(30), host_pages=host)
    for name in ("k_data", "k_scales", "v_data", "v_scales"):
        slots, copy = getattr(setup.pages, name).copy_to_host(), getattr(host, name).copy_to_host()
        if slots.shape[1] > 1:          # a float type's scales are a placeholder
            assert np.array_equal(copy, slots[setup.table]), name
    missing = [0, 2, 5]
    for page in missing:
        slot = int(setup.table[page])
        garbage = rng.integers(-2 ** 31, 2 ** 31, (1, setup.pages.k_data.shape[1])).astype(np.int32)
        setup.pages.k_data[slot:slot + 1].copy_to_device(garbage)
        setup.pages.v_data[slot:slot + 1].copy_to_device(garbage[:, :setup.pages.v_data.shape[1]])
    setup.table[missing] = -1
    setup.d_table = cuda.to_device(setup.table)
    assert np.array_equal(setup.prefill(np.arange(13, 30), host_pages=host), want_rows)
    for got, want in zip(setup.decode(np.arange(27, 30), host_pages=host), want_window):
        assert np.array_equal(got, want)


def test_prefill_rows_are_bitwise_the_same_for_every_chunking(rng):
    setup = Setup(rng, "k8v4", 40)
    whole = setup.prefill(np.arange(40))       # chunk 64 (one launch of all 40 rows)
    for chunk, start in ((16, 8), (3, 17), (1, 30)):
        for begin in range(start, 40, chunk):
            positions = np.arange(begin, min(begin + chunk, 40))
            np.testing.assert_array_equal(setup.prefill(positions), whole[positions],
                                          err_msg=f"chunk {chunk} at {begin}")


def test_a_drafters_prefill_window_reads_only_its_last_positions(rng):
    """window_tokens W in prefill (the drafter reading its prompt): the row at p attends p - W + 1 .. p, also
    when the table marks the pages wholly older than every row's window missing with no host copy, and each
    row's bits are its own whatever rows share the launch."""
    width, ctx = 13, 70
    setup = Setup(rng, "q8_0", ctx, n_head=2, n_head_kv=1)
    positions = np.arange(40, ctx)
    oldest_page = (positions[0] - width + 1) // setup.page_tokens
    missing = np.arange(len(setup.table)) < oldest_page
    setup.d_table = cuda.to_device(np.where(missing, -1, setup.table).astype(np.int32))
    got = setup.prefill(positions, window=width)
    for row, p in enumerate(positions):
        first = p - width + 1
        want = attention(setup.q[p][None], setup.k_ref[first:p + 1], setup.v_ref[first:p + 1], np.array([width - 1]),
                         setup.n_head, setup.n_head_kv)
        assert _relative(got[row:row + 1], want) < TOLERANCE
    for begin, chunk in ((40, 1), (51, 7), (69, 1)):
        np.testing.assert_array_equal(setup.prefill(positions[begin - 40:begin - 40 + chunk], window=width),
                                      got[begin - 40:begin - 40 + chunk], err_msg=f"chunk {chunk} at {begin}")


def test_prefill_refuses_groups_whose_block_does_not_fit():
    with pytest.raises(StratumError, match="prefill attention cannot cut blocks for 64 query heads"):
        att.make_attention("prefill", "f16", 64, 1, 128, 128, 256)


def test_prefill_with_several_tiles_per_page(rng):
    setup = Setup(rng, "q8_0", 37, page_tokens=8)
    tuning = att.Tuning(tile=4)
    whole = setup.prefill(np.arange(37), tuning)
    assert _relative(whole, setup.reference(np.arange(37))) < TOLERANCE
    for begin in range(21, 37, 5):
        positions = np.arange(begin, min(begin + 5, 37))
        np.testing.assert_array_equal(setup.prefill(positions, tuning), whole[positions])


def test_prefill_with_one_buffer_for_both_partials(rng):
    """Where shared memory holds only one of the score and P V partials, the next scores wait for the fold."""
    setup = Setup(rng, "k8v4", 21)
    roomy = att._shape(2, 32, 32, 4, att.TUNING)
    tight = att.Tuning(shared_bytes=roomy.shared_bytes - 4 * min(roomy.score_partials, roomy.value_partials))
    assert roomy.separate and not att._shape(2, 32, 32, 4, tight).separate
    positions = np.arange(4, 21)
    got = setup.prefill(positions, tight)
    np.testing.assert_array_equal(got, setup.prefill(positions, att.TUNING))
    assert _relative(got, setup.reference(positions)) < TOLERANCE


@pytest.mark.parametrize("kv_name", KV_NAMES)
def test_hardware_and_software_conversion_agree_bitwise(rng, kv_name):
    """Prefill tiles read through typed views (converted by hardware) hold the values the software unpacking
    gives, so every result is bitwise the same."""
    setup = Setup(rng, kv_name, 21, n_head=2, n_head_kv=1)
    software = att.Tuning(convert=frozenset())
    hardware = att.Tuning(convert=frozenset(att._VIEWS))
    positions = np.arange(9, 21)
    np.testing.assert_array_equal(setup.prefill(positions, hardware), setup.prefill(positions, software))


def test_hardware_conversion_of_other_types_is_refused():
    with pytest.raises(StratumError, match="not Q4_0"):
        att._attention_launch("prefill", "q4_0", 2, 1, 32, 32, 4, att.Tuning(convert=frozenset({T.Q4_0})))


# ---------------------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize("kv_name, n_head, n_head_kv", [("f32", 2, 1), ("f16", 4, 2), ("q8_0", 2, 1),
                                                         ("q4_0", 2, 1), ("k8v4", 2, 1)])
def test_decode_matches_the_reference(rng, kv_name, n_head, n_head_kv):
    setup = Setup(rng, kv_name, 23, n_head=n_head, n_head_kv=n_head_kv)
    positions = np.arange(20, 23)              # a window of 3 across a page boundary
    partials, got = setup.decode(positions)
    assert _relative(got, setup.reference(positions)) < TOLERANCE
    used = -(-23 // DECODE_TILE)               # split 0 holds the one tile; the rest are neutral
    assert np.isfinite(partials[:, :, :used]).all()
    assert (partials[:, :, used:, 0] == -np.inf).all()
    assert not partials[:, :, used:, 1:].any()


@pytest.mark.parametrize("kv_name, dk", [("q8_0", 32), ("f16", 64)])   # f16 at 64: 8 K chunks in flight
def test_decode_windows_give_the_rows_of_single_steps(rng, kv_name, dk):
    setup = Setup(rng, kv_name, 22, n_head=2, n_head_kv=1, dk=dk)
    singles = [setup.decode(np.array([p])) for p in range(17, 22)]
    for window in range(2, 6):
        partials, out = setup.decode(np.arange(17, 17 + window))
        for row in range(window):
            np.testing.assert_array_equal(partials[row], singles[row][0][0], err_msg=f"window {window} row {row}")
            np.testing.assert_array_equal(out[row], singles[row][1][0])
    assert _relative(out, setup.reference(np.arange(17, 22))) < TOLERANCE


@pytest.mark.parametrize("warps", [None, 2])
def test_decode_splits_take_every_64th_tile(rng, warps):
    """Splits 0..2 hold two tiles: with two warps a block, each warp takes one and the block merges them."""
    tiles = ATTENTION_SPLITS + 3
    ctx = tiles * DECODE_TILE - 1
    setup = Setup(rng, "f16", ctx, n_head=2, n_head_kv=1, page_tokens=64)
    positions = np.arange(ctx - 2, ctx)
    partials, got = setup.decode(positions, warps=warps)
    assert _relative(got, setup.reference(positions)) < TOLERANCE
    assert np.isfinite(partials).all()        # every split holds a tile


def test_a_drafters_window_reads_only_its_last_positions(rng):
    """window_tokens W: the row at p attends p - W + 1 .. p, as if nothing older existed, also when the table
    marks the pages wholly older than every row's window missing (a drafter's ring has no host copy); a window
    of rows gives each row's single-step bits."""
    width, ctx = 13, 70
    setup = Setup(rng, "f16", ctx, n_head=2, n_head_kv=1)
    positions = np.arange(ctx - 4, ctx)
    oldest_page = (positions[0] - width + 1) // setup.page_tokens
    missing = np.arange(len(setup.table)) < oldest_page
    setup.d_table = cuda.to_device(np.where(missing, -1, setup.table).astype(np.int32))
    _, got = setup.decode(positions, window=width)
    for row, p in enumerate(positions):
        first = p - width + 1
        want = attention(setup.q[p][None], setup.k_ref[first:p + 1], setup.v_ref[first:p + 1], np.array([width - 1]),
                         setup.n_head, setup.n_head_kv)
        assert _relative(got[row:row + 1], want) < TOLERANCE
        _, single = setup.decode(np.array([p]), window=width)
        np.testing.assert_array_equal(got[row], single[0])


@pytest.mark.parametrize("kv_name", ["f16", "k8v4"])
def test_decode_with_k_and_v_heads_of_different_widths(rng, kv_name):
    """K rows of 64 values and V rows of 32 (K and V of one head need not match): the scores walk K's words,
    P V V's, and the output has V's width."""
    setup = Setup(rng, kv_name, 45, n_head=4, n_head_kv=2, dk=64, dv=32, page_tokens=8)
    positions = np.arange(41, 45)
    partials, got = setup.decode(positions)
    assert got.shape == (4, 4 * 32)
    assert _relative(got, setup.reference(positions)) < TOLERANCE


def test_large_groups_of_query_heads_get_fewer_warps_not_a_refusal():
    """Qwen3-30B's group of 8 and GLM-4.5's of 12 get the full block; a group of 32 query heads on one kv head
    (MQA-like) gets fewer warps, so their merge fits the block's shared memory; a group too large for even one
    warp is refused, saying why."""
    assert block_warps(8, 128, 128, preferred=4) == 4
    assert block_warps(12, 128, 128, preferred=4) == 4
    assert 1 <= block_warps(32, 128, 128, preferred=4) < 4
    assert block_warps(64, 128, 128, preferred=4) == 0
    with pytest.raises(StratumError, match="shared memory"):
        make_decode_attention("f16", 64, 1, 128, 128, 256)


def test_decode_refuses_windows_over_the_maximum(rng):
    launch = att.make_attention("decode", "f16", 2, 1, 32, 32, 4)
    q = cuda.to_device(np.zeros((MAX_WINDOW + 1, 64), np.float32))
    with pytest.raises(ValueError, match="at most"):
        launch(0, q, None, None, None, None)
    with pytest.raises(ValueError, match="window_tokens"):
        att.make_attention("decode", "f16", 2, 1, 32, 32, 4, window_tokens=-1)


# ---------------------------------------------------------------------------------------------------------
# real shapes on a GPU: Qwen3-30B-A3B (32 query heads, 4 kv heads, head dim 128, pages of 256)

QWEN = dict(n_head=32, n_head_kv=4, dk=128, dv=128, page_tokens=256)
# the production kernel for each K/V type, and the previous kernel (the benchmark's prefill v1) at its cut
GPU_CASES = [(kv_name, None) for kv_name in KV_NAMES] + [("f16", att.TUNING)]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_name, tuning", GPU_CASES)
def test_gpu_prefill_at_qwen3_shape(rng, kv_name, tuning):
    setup = Setup(rng, kv_name, 1300, q_from=1000, **QWEN)
    positions = np.arange(1000, 1300)
    whole = setup.prefill(positions, tuning)
    assert _relative(whole, setup.reference(positions)) < TOLERANCE
    for chunk, begin in ((1, 1100), (1, 1299), (37, 1150), (64, 1001)):
        part = np.arange(begin, min(begin + chunk, 1300))
        np.testing.assert_array_equal(setup.prefill(part, tuning), whole[part - 1000],
                                      err_msg=f"chunk {chunk} at {begin}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_name", KV_NAMES)
def test_gpu_stored_bytes_at_qwen3_shape(rng, kv_name):
    _check_stored_bytes(rng, kv_name, n_head_kv=4, dk=128, dv=128, page_tokens=256, start=1000, rows=300)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_name", KV_NAMES)
def test_gpu_decode_at_qwen3_shape(rng, kv_name):
    base = ATTENTION_SPLITS * 256 + 300             # 522 tiles of 32: splits 0..9 hold 9, the rest 8
    setup = Setup(rng, kv_name, base + 5, q_from=base, **QWEN)
    reference = setup.reference(np.arange(base, base + 5))
    singles = [setup.decode(np.array([p])) for p in range(base, base + 5)]
    for window in range(1, 6):
        partials, out = setup.decode(np.arange(base, base + window))
        for row in range(window):
            np.testing.assert_array_equal(partials[row], singles[row][0][0], err_msg=f"window {window} row {row}")
        assert _relative(out, reference[:window]) < TOLERANCE


@pytest.mark.parametrize("kv_name", ["f16", "q8_0"])
def test_prefill_and_decode_with_glm_45s_twelve_query_heads_a_kv_head(rng, kv_name):
    """GLM-4.5 and GLM-4.5-Air read 96 query heads over 8 kv heads: a group of 12, whose blocks' threads do not
    split a tile's words evenly (some threads sit out the loads)."""
    setup = Setup(rng, kv_name, 20, n_head=12, n_head_kv=1, dk=64, dv=64)
    positions = np.arange(9, 20)
    assert _relative(setup.prefill(positions), setup.reference(positions)) < TOLERANCE
    assert _relative(setup.decode(positions[-2:])[1], setup.reference(positions[-2:])) < TOLERANCE
