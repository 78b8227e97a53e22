"""Read the header of a GGUF file (metadata and tensor infos) without touching its tensor data.

gguf-py's GGUFReader memory-maps the whole file and builds a view of every tensor, so it fails on a
partial download and makes no sense for a 200 GB model when the planner needs only shapes, types and
hyperparameters. This parser reads the file front to back in chunks and stops where the header ends:
a file cut right after its header plans like the complete one, and the data section is never read.

Whatever the bytes, the only exception raised is StratumError, worded for the user: every count read
from the file is checked against the bytes that remain before anything is allocated, and nested
arrays are bounded.
"""

import math
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    Keys,
)

from planner.errors import StratumError

SUPPORTED_VERSIONS = (2, 3)  # version 1 used 32-bit counts and is long obsolete
GGML_MAX_DIMS = 4
MAX_ARRAY_NESTING = 8
# Real headers hold a few MB to a few tens of MB; a length field claiming more in a large file is
# corruption, and following it would read gigabytes of tensor data into memory.
MAX_HEADER_BYTES = 1 << 30
_CHUNK = 1 << 20

_MAGIC = struct.pack("<I", GGUF_MAGIC)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_DIMS = [struct.Struct(f"<{n}q") for n in range(GGML_MAX_DIMS + 1)]  # signed, as ggml reads ne[]

_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
# Smallest encodings, to refuse a count the remaining bytes cannot hold before looping over it.
_MIN_STRING_BYTES = 8
_MIN_ARRAY_BYTES = 4 + 8
_MIN_KV_BYTES = _MIN_STRING_BYTES + 4 + 1
_MIN_TENSOR_INFO_BYTES = _MIN_STRING_BYTES + 4 + 4 + 8
_KNOWN_TYPES = frozenset(int(t) for t in GGML_QUANT_SIZES)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne[0], the row length, first
    ggml_type: GGMLQuantizationType
    offset: int  # relative to the start of the data section

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.n_elements // block_size * type_size


@dataclass(frozen=True)
class GGUFHeader:
    source: str
    version: int
    metadata: dict[str, object]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int  # where the aligned data section starts in the file
    header_bytes: int  # bytes of the header proper, before the alignment padding


class _Cursor:
    """The header's bytes, pulled from the file in chunks only as far as parsing reaches."""

    def __init__(self, source: str, size: int, buf: bytes | bytearray, file: BinaryIO | None = None):
        self.source = source
        self.size = size  # the whole file's length: what every count is checked against
        self.buf = buf
        self.file = file
        self.pos = 0

    def error(self, message: str) -> StratumError:
        return StratumError(message, source=self.source)

    def ensure(self, end: int, what: str) -> None:
        """Make buf[:end] available, or refuse because the file ends before the header does."""
        if end <= len(self.buf):
            return
        if end > self.size:
            raise self.error(
                f"truncated GGUF header: ended at byte {self.size} while reading {what} "
                f"(the file holds {self.size} bytes; the header needs more)"
            )
        if end > MAX_HEADER_BYTES:
            raise self.error(
                f"GGUF header would exceed {MAX_HEADER_BYTES} bytes while reading {what}; the file is corrupt"
            )
        want = min(self.size, max(end, len(self.buf) + _CHUNK)) - len(self.buf)
        self.buf += self.file.read(want)
        if len(self.buf) < end:  # the file shrank since it was measured
            self.size = len(self.buf)
            self.ensure(end, what)

    def check_count(self, count: int, min_item_bytes: int, what: str) -> None:
        self.ensure(self.pos + count * min_item_bytes, what)

    def take(self, n: int, what: str) -> int:
        """Advance past n bytes; returns where they start."""
        start = self.pos
        self.ensure(start + n, what)
        self.pos = start + n
        return start

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        return fmt.unpack_from(self.buf, self.take(fmt.size, what))

    def u32(self, what: str) -> int:
        return self.unpack(_U32, what)[0]

    def u64(self, what: str) -> int:
        return self.unpack(_U64, what)[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode()
        except UnicodeDecodeError:
            raise self.error(f"{what} is not valid UTF-8") from None

    def strings(self, count: int, what: str) -> list[str]:
        # The hot loop of a real header (a tokenizer of ~150k strings): no per-item method calls.
        self.check_count(count, _MIN_STRING_BYTES, what)
        out: list[str] = []
        append = out.append
        unpack = _U64.unpack_from
        buf, pos = self.buf, self.pos
        i = 0
        try:
            for i in range(count):
                if pos + 8 > len(buf):
                    self.ensure(pos + 8, what)
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > len(buf):
                    self.ensure(pos + n, what)
                append(buf[pos:pos + n].decode())
                pos += n
        except UnicodeDecodeError:
            raise self.error(f"item {i} of {what} is not valid UTF-8") from None
        self.pos = pos
        return out

    def numbers(self, item_type: int, count: int, what: str) -> np.ndarray:
        fmt = _SCALARS[item_type]
        start = self.take(count * fmt.size, what)
        if item_type == GGUFValueType.BOOL:
            # A byte other than 0 or 1 would make an invalid numpy bool.
            return np.frombuffer(self.buf, np.uint8, count, start) != 0
        return np.frombuffer(self.buf, np.dtype(fmt.format), count, start).copy()


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse the header of the GGUF file at path, reading no further than the header's end."""
    source = str(path)
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            return _parse(_Cursor(source, size, bytearray(), file))
    except OSError as e:
        raise StratumError(f"cannot read GGUF file: {e.strerror or e}", source=source) from None


def parse_header(data: bytes, source: str = "<bytes>") -> GGUFHeader:
    """Parse a GGUF header from bytes in memory (the file's start; the data section may be absent)."""
    data = bytes(data)
    return _parse(_Cursor(source, len(data), data))


def _parse(cur: _Cursor) -> GGUFHeader:
    # A short file that is no GGUF at all should say so, not that it is truncated.
    cur.ensure(min(len(_MAGIC), cur.size), "the magic number")
    magic = bytes(cur.buf[:len(_MAGIC)])
    if magic != _MAGIC[:len(magic)]:
        raise cur.error(f"not a GGUF file (magic {magic!r}, expected {_MAGIC!r})")
    cur.take(len(_MAGIC), "the magic number")
    version = cur.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        if version and not version & 0xFFFF:  # a small version number in the other byte order
            raise cur.error("big-endian GGUF files are not supported; use a little-endian conversion of the model")
        raise cur.error(f"GGUF version {version} is not supported (only versions 2 and 3)")

    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    cur.check_count(n_kv, _MIN_KV_BYTES, f"the metadata ({n_kv} entries)")
    metadata: dict[str, object] = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise cur.error(f"metadata key '{key}' appears twice")
        value_type = cur.u32(f"the value type of metadata key '{key}'")
        metadata[key] = _read_value(cur, value_type, key)
        if key == Keys.General.ALIGNMENT:
            alignment = _check_alignment(cur, value_type, metadata[key])

    cur.check_count(n_tensors, _MIN_TENSOR_INFO_BYTES, f"the tensor infos ({n_tensors} tensors)")
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for i in range(n_tensors):
        tensor = _read_tensor_info(cur, i, alignment)
        if tensor.name in names:
            raise cur.error(f"tensor '{tensor.name}' appears twice")
        names.add(tensor.name)
        tensors.append(tensor)

    header_bytes = cur.pos
    return GGUFHeader(
        source=cur.source,
        version=version,
        metadata=metadata,
        tensors=tuple(tensors),
        alignment=alignment,
        data_offset=-(-header_bytes // alignment) * alignment,
        header_bytes=header_bytes,
    )


def _read_value(cur: _Cursor, value_type: int, key: str) -> object:
    if value_type in _SCALARS:
        return cur.unpack(_SCALARS[value_type], f"the value of '{key}'")[0]
    if value_type == GGUFValueType.STRING:
        return cur.string(f"the value of '{key}'")
    if value_type == GGUFValueType.ARRAY:
        return _read_array(cur, key, depth=1)
    raise cur.error(f"metadata key '{key}' has unknown value type {value_type}")


def _read_array(cur: _Cursor, key: str, depth: int) -> object:
    if depth > MAX_ARRAY_NESTING:
        raise cur.error(f"metadata key '{key}' nests arrays more than {MAX_ARRAY_NESTING} deep")
    item_type = cur.u32(f"the item type of array '{key}'")
    count = cur.u64(f"the length of array '{key}'")
    what = f"array '{key}' ({count} items)"
    if item_type in _SCALARS:
        return cur.numbers(item_type, count, what)
    if item_type == GGUFValueType.STRING:
        return cur.strings(count, what)
    if item_type == GGUFValueType.ARRAY:
        cur.check_count(count, _MIN_ARRAY_BYTES, what)
        return [_read_array(cur, key, depth + 1) for _ in range(count)]
    raise cur.error(f"array '{key}' has unknown item type {item_type}")


def _check_alignment(cur: _Cursor, value_type: int, value: object) -> int:
    key = Keys.General.ALIGNMENT
    if value_type != GGUFValueType.UINT32:
        raise cur.error(f"'{key}' must be a uint32, not {GGUFValueType(value_type).name}")
    if value <= 0 or value & (value - 1):
        raise cur.error(f"'{key}' is {value}; it must be a positive power of two")
    return value


def _read_tensor_info(cur: _Cursor, index: int, alignment: int) -> TensorInfo:
    name = cur.string(f"the name of tensor #{index}")
    what = f"tensor '{name}'"
    n_dims = cur.u32(f"the dimension count of {what}")
    if n_dims > GGML_MAX_DIMS:
        raise cur.error(f"{what} has {n_dims} dimensions; GGML allows at most {GGML_MAX_DIMS}")
    shape = cur.unpack(_DIMS[n_dims], f"the shape of {what}")
    if any(d <= 0 for d in shape):
        raise cur.error(f"{what} has shape {list(shape)}; every dimension must be positive")
    raw_type = cur.u32(f"the type of {what}")
    if raw_type not in _KNOWN_TYPES:
        raise cur.error(f"{what} has unknown ggml type {raw_type}")
    ggml_type = GGMLQuantizationType(raw_type)
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    row_length = shape[0] if shape else 1  # ggml gives a missing dimension the length 1
    if row_length % block_size:
        raise cur.error(
            f"{what} has rows of {row_length} elements, not a multiple of the "
            f"{block_size}-element blocks of type {ggml_type.name}"
        )
    offset = cur.u64(f"the data offset of {what}")
    if offset % alignment:
        raise cur.error(f"{what} starts at data offset {offset}, not a multiple of the alignment {alignment}")
    return TensorInfo(name=name, shape=shape, ggml_type=ggml_type, offset=offset)
