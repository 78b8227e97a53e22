"""planner.header: agrees with gguf-py's GGUFReader, plans from a cut file, refuses bad bytes clearly."""

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.constants import GGUFEndian, GGUFValueType as VT, Keys
from gguf.quants import quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import header as header_module
from planner.errors import StratumError
from planner.header import GGUFHeader, parse_header, read_header

_DTYPES = {
    VT.UINT8: np.uint8, VT.INT8: np.int8, VT.UINT16: np.uint16, VT.INT16: np.int16,
    VT.UINT32: np.uint32, VT.INT32: np.int32, VT.UINT64: np.uint64, VT.INT64: np.int64,
    VT.FLOAT32: np.float32, VT.FLOAT64: np.float64, VT.BOOL: np.bool_,
}


# --- files written by gguf-py ----------------------------------------------------------------------

def _random_metadata(rng: np.random.Generator) -> dict[str, tuple]:
    """key -> (value type, value, item type or None): every value type, scalars and arrays."""
    meta: dict[str, tuple] = {
        "test.u8": (VT.UINT8, int(rng.integers(0, 2**8)), None),
        "test.i8": (VT.INT8, int(rng.integers(-2**7, 2**7)), None),
        "test.u16": (VT.UINT16, int(rng.integers(0, 2**16)), None),
        "test.i16": (VT.INT16, int(rng.integers(-2**15, 2**15)), None),
        "test.u32": (VT.UINT32, int(rng.integers(0, 2**32)), None),
        "test.i32": (VT.INT32, int(rng.integers(-2**31, 2**31)), None),
        "test.u64": (VT.UINT64, 2**64 - int(rng.integers(1, 2**40)), None),
        "test.i64": (VT.INT64, -(2**63) + int(rng.integers(0, 2**40)), None),
        "test.f32": (VT.FLOAT32, float(np.float32(rng.standard_normal())), None),
        "test.f64": (VT.FLOAT64, float(rng.standard_normal()), None),
        "test.bool": (VT.BOOL, bool(rng.integers(0, 2)), None),
        "test.str": (VT.STRING, "héllo ✓ " + str(rng.integers(1000)), None),
        "test.arr.str": (VT.ARRAY, ["", "a", "ünïcode", "<0x0A>"] + [f"t{i}" for i in range(50)], VT.STRING),
        "test.arr.nested": (VT.ARRAY, [[1, 2], [3, 4, 5], [6]], None),
        "test.arr.nested_str": (VT.ARRAY, [["a", "b"], ["c"]], None),
    }
    for vtype, dtype in _DTYPES.items():
        n = int(rng.integers(1, 40))
        if vtype == VT.BOOL:
            values = rng.integers(0, 2, n).astype(bool).tolist()
        elif np.issubdtype(dtype, np.floating):
            values = rng.standard_normal(n).astype(dtype).tolist()
        else:
            info = np.iinfo(dtype)
            values = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True).tolist()
        meta[f"test.arr.{vtype.name.lower()}"] = (VT.ARRAY, values, vtype)
    return meta


def _random_tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, QT | None]]:
    """name -> (array as handed to GGUFWriter, raw ggml type for quantized ones). Ends quantized."""
    def floats(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    rows = int(rng.integers(1, 6))
    return {
        "token_embd.weight": (floats(rows, int(rng.integers(1, 70))), None),
        "blk.0.attn_norm.weight": (floats(int(rng.integers(1, 100))), None),
        "blk.0.attn_q.weight": (floats(rows, 48).astype(np.float16), None),
        "blk.0.ffn_gate_exps.weight": (floats(3, 2, 5), None),
        "blk.0.pos.ids": (rng.integers(0, 9, 7, dtype=np.int32), None),
        "blk.0.ffn_up_exps.weight": (quantize(floats(2, rows, 64), QT.Q4_0), QT.Q4_0),
        "blk.0.attn_k.weight": (quantize(floats(rows, 96), QT.Q8_0), QT.Q8_0),
    }


def _write_gguf(path: Path, *, alignment: int | None = None, endianess: GGUFEndian = GGUFEndian.LITTLE,
                metadata: dict | None = None, tensors: dict | None = None) -> Path:
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (vtype, value, item_type) in (metadata or {}).items():
        writer.add_key_value(key, value, vtype, sub_type=item_type)
    for name, (array, raw_type) in (tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class Model:
    def __init__(self, path: Path, metadata: dict, tensors: dict):
        self.path, self.metadata, self.tensors = path, metadata, tensors
        self.raw = path.read_bytes()


@pytest.fixture(params=[None, 1, 256], ids=["default-alignment", "alignment-1", "alignment-256"])
def model(tmp_path: Path, request) -> Model:
    rng = np.random.default_rng()
    metadata, tensors = _random_metadata(rng), _random_tensors(rng)
    path = _write_gguf(tmp_path / "model.gguf", alignment=request.param, metadata=metadata, tensors=tensors)
    return Model(path, metadata, tensors)


@pytest.fixture
def small_model(tmp_path: Path) -> Model:
    """Default alignment, a few tensors, the last one Q8_0: the target of the byte patches below."""
    rng = np.random.default_rng()
    tensors = _random_tensors(rng)
    metadata = {k: v for k, v in _random_metadata(rng).items() if not k.startswith("test.arr.")}
    return Model(_write_gguf(tmp_path / "small.gguf", metadata=metadata, tensors=tensors), metadata, tensors)


def _flat(value) -> list:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [x for item in value for x in (_flat(item) if isinstance(item, (list, np.ndarray)) else [item])]
    return [value]


def _assert_value(ours, vtype: VT, value, item_type: VT | None) -> None:
    """ours (as parsed) is exactly the value written, with the documented Python/numpy type."""
    if vtype == VT.ARRAY and item_type in _DTYPES:
        assert isinstance(ours, np.ndarray) and ours.dtype == _DTYPES[item_type] and ours.flags.writeable
        assert ours.tolist() == value
    elif vtype == VT.ARRAY:
        assert isinstance(ours, list)
        assert [x.tolist() if isinstance(x, np.ndarray) else x for x in ours] == value
    else:
        expected_type = {VT.BOOL: bool, VT.STRING: str, VT.FLOAT32: float, VT.FLOAT64: float}.get(vtype, int)
        assert type(ours) is expected_type and ours == value


def _assert_same(a: GGUFHeader, b: GGUFHeader) -> None:
    assert (a.version, a.tensors, a.alignment, a.data_offset, a.header_bytes) == \
           (b.version, b.tensors, b.alignment, b.data_offset, b.header_bytes)
    assert list(a.metadata) == list(b.metadata)
    for key, value in a.metadata.items():
        other = b.metadata[key]
        assert type(value) is type(other) and _flat(value) == _flat(other), key
        if isinstance(value, np.ndarray):
            assert value.dtype == other.dtype


def _tensor_info_start(h: GGUFHeader, raw: bytes) -> int:
    """Byte position of the last tensor's info: the patches below edit its fields."""
    last = h.tensors[-1]
    return h.header_bytes - (8 + len(last.name.encode()) + 4 + 8 * len(last.shape) + 4 + 8)


# --- 1, 2: agreement with gguf-py and with the data section ------------------------------------------

def test_agrees_with_gguf_reader(model: Model):
    ours = read_header(model.path)
    reader = gguf.GGUFReader(model.path)
    assert ours.source == str(model.path)
    assert ours.version == reader.fields["GGUF.version"].contents() == 3
    assert (ours.alignment, ours.data_offset) == (reader.alignment, reader.data_offset)
    assert ours.data_offset % ours.alignment == 0 and 0 <= ours.data_offset - ours.header_bytes < ours.alignment

    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors] == list(model.tensors)
    for t, r in zip(ours.tensors, reader.tensors, strict=True):
        assert t.shape == tuple(int(d) for d in r.shape)
        assert t.ggml_type == r.tensor_type
        assert ours.data_offset + t.offset == r.data_offset
        assert (t.n_elements, t.n_bytes) == (r.n_elements, r.n_bytes)

    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        assert _flat(ours.metadata[key]) == _flat(reader.fields[key].contents()), key
    for key, (vtype, value, item_type) in model.metadata.items():
        _assert_value(ours.metadata[key], vtype, value, item_type)


def test_shapes_are_in_gguf_order(model: Model):
    for t in read_header(model.path).tensors:
        array, raw_type = model.tensors[t.name]
        shape = gguf.quants.quant_shape_from_byte_shape(array.shape, raw_type) if raw_type else array.shape
        assert t.shape == tuple(reversed(shape))


def test_n_bytes_cover_the_data_section(model: Model):
    h = read_header(model.path)
    padding = sum(-t.n_bytes % h.alignment for t in h.tensors)
    assert sum(t.n_bytes for t in h.tensors) == len(model.raw) - h.data_offset - padding
    for t in h.tensors:
        start = h.data_offset + t.offset
        assert model.raw[start:start + t.n_bytes] == model.tensors[t.name][0].tobytes(), t.name


# --- 3: cut files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cut_at", ["data_offset", "header_bytes"])
def test_file_cut_after_header_parses_identically(model: Model, tmp_path: Path, cut_at: str):
    full = read_header(model.path)
    cut = getattr(full, cut_at)
    partial = tmp_path / "partial.gguf"
    partial.write_bytes(model.raw[:cut])
    _assert_same(read_header(partial), full)
    _assert_same(parse_header(model.raw[:cut]), full)


def test_file_cut_inside_header_is_truncated(model: Model, tmp_path: Path):
    h = read_header(model.path)
    for cut in range(h.header_bytes):
        with pytest.raises(StratumError, match=rf"truncated GGUF header: ended at byte {cut} while reading"):
            parse_header(model.raw[:cut])
    partial = tmp_path / "partial.gguf"
    for cut in np.random.default_rng().integers(0, h.header_bytes, 20):
        partial.write_bytes(model.raw[:cut])
        with pytest.raises(StratumError, match="truncated") as caught:
            read_header(partial)
        assert caught.value.source == str(partial)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_reads_agree_with_parsing_from_memory(model: Model, monkeypatch, chunk: int):
    monkeypatch.setattr(header_module, "_CHUNK", chunk)
    _assert_same(read_header(model.path), parse_header(model.raw))


def test_never_reads_far_into_the_data_section(tmp_path: Path, monkeypatch):
    tensors = {"big.weight": (np.zeros((4096, 1024), np.float32), None)}  # 16 MiB of data
    path = _write_gguf(tmp_path / "big.gguf", tensors=tensors)
    bytes_read = []

    def counting_open(*args, **kwargs):
        file = open(*args, **kwargs)
        read = file.read
        file.read = lambda n: bytes_read.append(len(data := read(n))) or data
        return file

    monkeypatch.setattr(header_module, "open", counting_open, raising=False)
    h = read_header(path)
    assert h.tensors[0].n_bytes == 16 * 2**20
    assert sum(bytes_read) <= h.header_bytes + header_module._CHUNK


# --- 4: refusals, with messages that say what is wrong -------------------------------------------

def _refused(data: bytes, *words: str) -> str:
    with pytest.raises(StratumError) as caught:
        parse_header(data, source="model.gguf")
    message = str(caught.value)
    assert caught.value.source == "model.gguf" and message.startswith("model.gguf: ")
    for word in words:
        assert word in message
    return message


def _patched(raw: bytes, at: int, value: bytes) -> bytes:
    return raw[:at] + value + raw[at + len(value):]


def test_bad_magic(small_model: Model, tmp_path: Path):
    _refused(b"GGML" + small_model.raw[4:], "not a GGUF file", "b'GGML'", "expected b'GGUF'")
    text = tmp_path / "notes.txt"
    text.write_bytes(b"hi")
    with pytest.raises(StratumError, match="not a GGUF file"):
        read_header(text)


@pytest.mark.parametrize("version", [0, 1, 4, 99])
def test_unsupported_version(small_model: Model, version: int):
    _refused(_patched(small_model.raw, 4, struct.pack("<I", version)), f"version {version}", "not supported")


def test_version_2_is_read(small_model: Model):
    h = parse_header(_patched(small_model.raw, 4, struct.pack("<I", 2)))
    assert h.version == 2 and h.tensors == read_header(small_model.path).tensors


def test_big_endian_is_refused(tmp_path: Path):
    path = _write_gguf(tmp_path / "be.gguf", endianess=GGUFEndian.BIG)
    with pytest.raises(StratumError, match="big-endian"):
        read_header(path)


def test_unreadable_file(tmp_path: Path):
    for path in (tmp_path / "missing.gguf", tmp_path):
        with pytest.raises(StratumError, match="cannot read GGUF file: ") as caught:
            read_header(path)
        assert caught.value.source == str(path)


def test_bad_tensor_infos(small_model: Model):
    h = read_header(small_model.path)
    raw, last = small_model.raw, h.tensors[-1]
    assert last.ggml_type == QT.Q8_0
    dims_at = _tensor_info_start(h, raw) + 8 + len(last.name.encode()) + 4
    type_at = dims_at + 8 * len(last.shape)
    offset_at = type_at + 4

    _refused(_patched(raw, type_at, struct.pack("<I", 99)), f"tensor '{last.name}' has unknown ggml type 99")
    _refused(_patched(raw, dims_at - 4, struct.pack("<I", 5)), f"'{last.name}'", "5 dimensions", "at most 4")
    _refused(_patched(raw, dims_at, struct.pack("<q", 0)), f"'{last.name}'", "must be positive")
    _refused(_patched(raw, dims_at, struct.pack("<q", -64)), "must be positive")
    _refused(_patched(raw, dims_at, struct.pack("<q", 48)), "rows of 48 elements", "32-element blocks of type Q8_0")
    _refused(_patched(raw, offset_at, struct.pack("<Q", last.offset + 8)), "not a multiple of the alignment 32")


# A GGUF header written by hand, for malformations that GGUFWriter cannot produce.

def _s(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _ti(name: str, shape: tuple[int, ...], ggml_type: int = QT.F32, offset: int = 0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, ggml_type, offset)


def _gguf(kvs: list[bytes] = (), tis: list[bytes] = (), n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    counts = (len(tis) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    return b"GGUF" + struct.pack("<IQQ", 3, *counts) + b"".join(kvs) + b"".join(tis)


def _nested(depth: int) -> bytes:
    return struct.pack("<IQ", VT.INT32, 0) if depth == 1 else struct.pack("<IQ", VT.ARRAY, 1) + _nested(depth - 1)


def test_hand_written_header_parses():
    h = parse_header(_gguf([_kv("a", VT.UINT32, struct.pack("<I", 7)), _kv(Keys.General.ALIGNMENT, VT.UINT32,
                           struct.pack("<I", 64))], [_ti("x", (32, 2)), _ti("y", (), offset=256)]))
    assert h.metadata == {"a": 7, Keys.General.ALIGNMENT: 64} and h.alignment == 64
    assert h.tensors[1].shape == () and h.tensors[1].n_elements == 1 and h.tensors[1].n_bytes == 4
    assert h.data_offset % 64 == 0 and h.data_offset >= h.header_bytes


def test_bad_metadata():
    _refused(_gguf([_kv("a", 13, b"")]), "'a' has unknown value type 13")
    _refused(_gguf([_kv("a", VT.ARRAY, struct.pack("<IQ", 42, 1))]), "'a' has unknown item type 42")
    _refused(_gguf([_kv(b"\xff\xfe", VT.UINT8, b"\x00")]), "metadata key #0 is not valid UTF-8")
    _refused(_gguf([_kv("k", VT.STRING, _s(b"ok\xc3"))]), "the value of 'k' is not valid UTF-8")
    items = _s("fine") + _s(b"\x80")
    _refused(_gguf([_kv("toks", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2) + items)]), "item 1 of", "'toks'", "UTF-8")
    twice = _kv("a", VT.UINT8, b"\x01")
    _refused(_gguf([twice, twice]), "metadata key 'a' appears twice")
    _refused(_gguf([_kv("deep", VT.ARRAY, _nested(9))]), "'deep' nests arrays more than 8 deep")
    assert _flat(parse_header(_gguf([_kv("deep", VT.ARRAY, _nested(8))])).metadata["deep"]) == []


@pytest.mark.parametrize("alignment", [0, 3, 48, 2**31 + 1])
def test_alignment_must_be_a_power_of_two(alignment: int):
    _refused(_gguf([_kv(Keys.General.ALIGNMENT, VT.UINT32, struct.pack("<I", alignment))]),
             f"'general.alignment' is {alignment}", "positive power of two")


def test_alignment_must_be_a_uint32():
    _refused(_gguf([_kv(Keys.General.ALIGNMENT, VT.UINT64, struct.pack("<Q", 32))]), "must be a uint32, not UINT64")


def test_bad_tensor_list():
    _refused(_gguf(tis=[_ti("w", (32,)), _ti("w", (32,), offset=128)]), "tensor 'w' appears twice")
    _refused(_gguf(tis=[_ti("w", (32,), offset=16)]), "data offset 16", "alignment 32")
    _refused(_gguf(tis=[_s(b"\xe2\x82") + bytes(16)]), "the name of tensor #0 is not valid UTF-8")


def test_huge_counts_are_truncation_not_memory_errors():
    _refused(_gguf([struct.pack("<Q", 2**60) + bytes(8)]), "truncated", "metadata key #0")
    _refused(_gguf([_kv("k", VT.STRING, struct.pack("<Q", 2**60))]), "truncated", "the value of 'k'")
    _refused(_gguf([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.UINT64, 2**61))]), "truncated", "array 'k'")
    _refused(_gguf([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2**63))]), "truncated", "array 'k'")
    _refused(_gguf([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 2**63))]), "truncated", "array 'k'")
    _refused(_gguf(n_kv=2**64 - 1), "truncated", "the metadata (18446744073709551615 entries)")
    _refused(_gguf(n_tensors=2**62), "truncated", f"the tensor infos ({2**62} tensors)")


# --- 5: fuzzing: StratumError and nothing else ---------------------------------------------------

def _parses_or_refuses(data: bytes) -> None:
    try:
        h = parse_header(data)
    except StratumError:
        return
    assert h.data_offset % h.alignment == 0 and h.header_bytes <= h.data_offset <= len(data) + h.alignment
    for t in h.tensors:
        assert t.offset % h.alignment == 0 and (t.shape[0] if t.shape else 1) % gguf.GGML_QUANT_SIZES[t.ggml_type][0] == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes_after_the_magic(tail: bytes):
    _parses_or_refuses(b"GGUF" + struct.pack("<I", 3) + tail)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3), st.binary(max_size=512))
def test_fuzz_arbitrary_bytes_after_small_counts(n_tensors: int, n_kv: int, tail: bytes):
    _parses_or_refuses(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + tail)


@pytest.fixture(scope="module")
def valid_header(tmp_path_factory) -> bytes:
    rng = np.random.default_rng()
    path = _write_gguf(tmp_path_factory.mktemp("fuzz") / "model.gguf",
                       metadata=_random_metadata(rng), tensors=_random_tensors(rng))
    return path.read_bytes()[:read_header(path).data_offset]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzz_flipped_and_cut_valid_header(valid_header: bytes, data):
    mutated = bytearray(valid_header)
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(mutated) - 1), st.integers(0, 255)), max_size=8))
    for position, value in flips:
        mutated[position] = value
    cut = data.draw(st.integers(0, len(mutated)))
    _parses_or_refuses(bytes(mutated[:cut]))


# --- 6: a real-sized tokenizer ---------------------------------------------------------------------

def test_header_with_150k_token_strings(tmp_path: Path):
    n = 150_000
    tokens = [f"tok{i}" for i in range(n)]
    metadata = {
        "tokenizer.ggml.tokens": (VT.ARRAY, tokens, VT.STRING),
        "tokenizer.ggml.scores": (VT.ARRAY, np.arange(n, dtype=np.float32).tolist(), VT.FLOAT32),
        "tokenizer.ggml.token_type": (VT.ARRAY, [1] * n, VT.INT32),
    }
    path = _write_gguf(tmp_path / "tok.gguf", metadata=metadata,
                       tensors={"output.weight": (np.zeros((2, 32), np.float32), None)})
    start = time.perf_counter()
    h = read_header(path)
    print(f"parsed a {h.header_bytes / 2**20:.1f} MiB header with {n} tokens in "
          f"{(time.perf_counter() - start) * 1e3:.0f} ms")
    assert h.metadata["tokenizer.ggml.tokens"] == tokens
    assert h.metadata["tokenizer.ggml.scores"][-1] == n - 1 and h.metadata["tokenizer.ggml.token_type"].sum() == n
    assert h.tensors[0].shape == (32, 2) and h.header_bytes > 2 * header_module._CHUNK
