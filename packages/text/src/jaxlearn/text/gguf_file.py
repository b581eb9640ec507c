"""A validating GGUF header reader: every count, length, dimension and offset is checked
against the file size before anything is allocated, so a hostile file costs bounded time
and memory and fails with one line naming the file and the field.

    header = read_header("model.gguf")          # GGUFHeader
    header.metadata["llama.block_count"]         # python int / float / bool / str / list
    header.tensors["token_embd.weight"]          # TensorInfo (type, ggml shape, offset)
    header.data("token_embd.weight")             # numpy view of the raw bytes (mmap)

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, versions 2 and 3,
little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key/value count; each
key/value is a string key (u64 length + UTF-8 bytes), a u32 value type and the value
(scalars, strings, arrays of scalars or strings); each tensor info is a string name, u32
n_dims, u64 dims (ggml order, innermost first), u32 ggml type, u64 offset relative to the
data section, which starts at the next multiple of `general.alignment` (default 32).

Checks: magic and version; the two counts against the bytes left (a key/value needs at
least 13 bytes, a tensor info 32); every string and array length against the bytes left
before it is read (no nested arrays); duplicate keys and tensor names; 1 <= n_dims <= 4,
every dim > 0, element count < 2**63; a known ggml type whose block size divides the row;
each tensor's offset aligned and its bytes inside the file, with no two tensors sharing
bytes (so the dequantised total is bounded by the file size).

The `gguf` package's `GGUFReader` trusts these fields (a metadata array claiming 2**62
elements makes it loop over empty reads without end), so it is not used for reading.
"""

from __future__ import annotations

import dataclasses
import mmap
import pathlib
import struct
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from jaxlearn.text.errors import MalformedGGUFError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value (u8 / i8 / bool)
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
STRING, ARRAY = 8, 9
# GGUF value type -> (struct format, numpy dtype) of the fixed-size scalars.
SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
# ggml types the data of which is read as numbers (the rest as bytes, as gguf.quants wants).
_NUMERIC = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4"}
_NUMERIC["I64"] = "<i8"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: `shape` in ggml order (innermost first), `offset` the
    absolute byte offset in the file, `nbytes` its size there."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


_U64 = struct.Struct("<Q")


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


class _Cursor:
    """Reads little-endian values from `buf`, refusing any read past its end."""

    def __init__(self, buf: Any, path: pathlib.Path):
        self.buf, self.path, self.pos, self.end = buf, path, 0, len(buf)

    def fail(self, what: str) -> MalformedGGUFError:
        return MalformedGGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise self.fail(
                f"{what} needs {n} bytes at offset {self.pos}, but the file has "
                f"{self.end - self.pos} left"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        self.need(struct.calcsize(fmt), what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"{what} (string length)")
        self.need(n, f"{what} (a string of {n} bytes)")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in SCALARS:
            return self.unpack(SCALARS[vtype][0], what)
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            return self.array(what)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, what: str) -> list[Any]:
        etype = self.unpack("<I", f"{what} (array element type)")
        n = self.unpack("<Q", f"{what} (array length)")
        if etype == ARRAY:
            raise self.fail(f"{what} is an array of arrays, which GGUF readers do not accept")
        if etype in SCALARS:
            size = np.dtype(SCALARS[etype][1]).itemsize
            self.need(n * size, f"{what} (an array of {n} elements)")
            out = np.frombuffer(self.buf, SCALARS[etype][1], count=n, offset=self.pos)
            self.pos += n * size
            return list(out.tolist())
        if etype != STRING:
            raise self.fail(f"{what} is an array of unknown value type {etype}")
        self.need(n * 8, f"{what} (an array of {n} strings)")
        return self.strings(n, what)

    def strings(self, n: int, what: str) -> list[str]:
        """`n` strings (the loop of `string`, inlined: token lists hold 10**5 of them)."""
        buf, pos, end, length = self.buf, self.pos, self.end, _U64.unpack_from
        raw: list[bytes] = []
        for i in range(n):
            if end - pos < 8:
                self.pos = pos
                self.need(8, f"{what}[{i}] (string length)")
            (k,) = length(buf, pos)
            pos += 8
            if k > end - pos:
                self.pos = pos
                self.need(k, f"{what}[{i}] (a string of {k} bytes)")
            raw.append(buf[pos : pos + k])
            pos += k
        self.pos = pos
        try:
            return [b.decode("utf-8") for b in raw]
        except UnicodeDecodeError as e:
            bad = next(i for i, b in enumerate(raw) if not _is_utf8(b))
            raise self.fail(f"{what}[{bad}] is not valid UTF-8 ({e.reason})") from None


class GGUFHeader:
    """The validated header of a GGUF file (see module docstring); the file stays mapped
    read-only for `data`."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        if not self.path.is_file():  # a FIFO or device would block or never end
            raise MalformedGGUFError(f"{self.path}: not a regular file")
        try:
            with open(self.path, "rb") as fh:
                self.size = self.path.stat().st_size
                if self.size < 24:
                    raise MalformedGGUFError(
                        f"{self.path}: {self.size} bytes is too short for a GGUF header"
                    )
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise MalformedGGUFError(f"{self.path}: cannot be read ({e.strerror})") from None
        cur = _Cursor(self._map, self.path)
        self.version, tensor_count, kv_count = _preamble(cur)
        self.metadata = _read_metadata(cur, kv_count)
        infos = [_read_tensor_info(cur) for _ in range(tensor_count)]
        self.alignment = _alignment(cur, self.metadata)
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = _place_tensors(cur, infos, self.data_offset, self.alignment)

    def data(self, name: str) -> np.ndarray:
        """The raw data of tensor `name`, a view of the mapped file: numbers for F32 / F16
        / F64 / I8..I64 in numpy order (outermost first), else bytes [..., row bytes]."""
        t = self.tensors[name]
        shape = tuple(reversed(t.shape))
        raw = np.frombuffer(self._map, np.uint8, count=t.nbytes, offset=t.offset)
        dtype = _NUMERIC.get(t.tensor_type.name)
        if dtype is not None:
            return raw.view(dtype).reshape(shape)
        return raw.reshape(quant_shape_to_byte_shape(shape, t.tensor_type))


def read_header(path: str | pathlib.Path) -> GGUFHeader:
    """The validated header of GGUF file `path` (MalformedGGUFError naming the field)."""
    return GGUFHeader(path)


def _preamble(cur: _Cursor) -> tuple[int, int, int]:
    """(version, tensor count, key/value count), the counts checked against the file."""
    magic = bytes(cur.buf[0:4])
    if magic != MAGIC:
        raise cur.fail(f"not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("<I", "GGUF.version")
    if version & 0xFFFF == 0 and version:
        raise cur.fail("a big-endian GGUF file; only little-endian files are read")
    if version not in VERSIONS:
        raise cur.fail(f"GGUF.version = {version}; versions {VERSIONS} are read")
    tensor_count = cur.unpack("<Q", "GGUF.tensor_count")
    kv_count = cur.unpack("<Q", "GGUF.kv_count")
    need = kv_count * MIN_KV_BYTES + tensor_count * MIN_TENSOR_INFO_BYTES
    if need > cur.end - cur.pos:
        raise cur.fail(
            f"GGUF.tensor_count = {tensor_count} and GGUF.kv_count = {kv_count} need at "
            f"least {need} header bytes, but the file has {cur.end - cur.pos} left"
        )
    return version, tensor_count, kv_count


def _read_metadata(cur: _Cursor, count: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(count):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.unpack("<I", f"metadata {key!r} (value type)")
        value = cur.value(vtype, f"metadata {key!r}")
        if key in out:
            raise cur.fail(f"metadata key {key!r} appears twice")
        out[key] = value
    return out


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """(name, ggml shape, raw type, relative offset) of the next tensor info."""
    name = cur.string(f"tensor info at offset {cur.pos} (name)")
    n_dims = cur.unpack("<I", f"tensor {name} (n_dims)")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name}: n_dims = {n_dims}, expected 1..{MAX_DIMS}")
    shape = tuple(cur.unpack("<Q", f"tensor {name} (dim {d})") for d in range(n_dims))
    raw_type = cur.unpack("<I", f"tensor {name} (type)")
    offset = cur.unpack("<Q", f"tensor {name} (offset)")
    return name, shape, raw_type, offset


def _alignment(cur: _Cursor, metadata: dict[str, Any]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise cur.fail(f"general.alignment = {value!r} is not a positive power of two")
    return value


def _place_tensors(
    cur: _Cursor, infos: list[tuple[str, tuple[int, ...], int, int]], start: int, align: int
) -> dict[str, TensorInfo]:
    """TensorInfos with absolute offsets, each checked to lie inside the file, aligned and
    apart from every other tensor's bytes."""
    out: dict[str, TensorInfo] = {}
    for name, shape, raw_type, offset in infos:
        where = f"tensor {name}"
        if name in out:
            raise cur.fail(f"{where} appears twice")
        if any(d <= 0 for d in shape):
            raise cur.fail(f"{where}: shape {list(shape)} has a dimension <= 0")
        n = 1
        for d in shape:
            n *= d
        if n >= 2**63:
            raise cur.fail(f"{where}: shape {list(shape)} has {n} elements (>= 2**63)")
        try:
            ttype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise cur.fail(f"{where}: unknown ggml type {raw_type}") from None
        if shape[0] % block:
            raise cur.fail(
                f"{where}: row size {shape[0]} is not a multiple of the {ttype.name} block "
                f"size {block}"
            )
        nbytes = n // block * type_size
        if offset % align:
            raise cur.fail(f"{where}: offset {offset} is not a multiple of the alignment {align}")
        if start + offset + nbytes > cur.end:
            raise cur.fail(
                f"{where}: {nbytes} bytes at data offset {offset} end past the end of the "
                f"file ({cur.end} bytes, data section at {start})"
            )
        out[name] = TensorInfo(name, ttype, shape, start + offset, nbytes)
    ordered = sorted(out.values(), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.offset < a.offset + a.nbytes:
            raise cur.fail(f"tensors {a.name} and {b.name} overlap in the file")
    return out
