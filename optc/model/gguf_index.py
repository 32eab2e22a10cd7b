"""A GGUF file's metadata and tensor directory, read in one pass over its header.

gguf-py's ``GGUFReader`` builds a numpy view for every element of every metadata array; a
tokenizer's 49,152 tokens and as many merges (the default model's) make that hundreds of
thousands of views, seconds per file. Everything optc reads from a GGUF file besides the
weights (its architecture, file type, optc's own keys, the tensors' types, shapes and byte
ranges, an imatrix's sums) needs only this header, so it is parsed here with ``struct`` over a
memory map, and tensor data is a numpy view on demand.

Layout (GGUF specification, ggml ``docs/gguf.md``, version 2 and 3): magic ``GGUF``, ``uint32``
version, ``uint64`` tensor count, ``uint64`` key-value count; each key-value is a string key, a
``uint32`` value type and the value (a string is a ``uint64`` length and UTF-8 bytes; an array
is a ``uint32`` element type, a ``uint64`` count and the elements); then per tensor its name, a
``uint32`` dimension count, ``uint64`` dimensions (innermost first), a ``uint32`` ggml type and
a ``uint64`` offset from the start of the data section, which begins at the next multiple of
``general.alignment`` (32 when absent) after the header. All little-endian, unless the version
reads byte-swapped, which is how a big-endian file shows itself.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Value types (GGUF specification, ``gguf_metadata_value_type``): struct code of each scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types whose data is plain numbers; every other type is blocks of bytes.
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry in the directory. ``shape`` is in GGUF order (innermost first), as
    gguf-py reports it; ``offset`` is absolute in the file."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def type_name(self) -> str:
        """ggml's name of the tensor type (``F32``, ``Q4_K``, ...)."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.qtype).name


@dataclass(frozen=True)
class GGUFIndex:
    path: Path
    version: int
    fields: dict[str, object]
    tensors: list[GGUFTensor]
    byteorder: str  # "<" or ">"

    def data(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only view, in gguf-py's layout (plain types as numbers in
        row-major order, block types as ``uint8`` rows of whole blocks), so gguf's ``dequantize``
        takes it."""
        rows = tuple(reversed(t.shape))
        mm = self._file[t.offset:t.offset + t.n_bytes]
        plain = _PLAIN.get(t.qtype)
        if plain is not None:
            return mm.view(np.dtype(plain).newbyteorder(self.byteorder)).reshape(rows)
        return mm.reshape(*rows[:-1], -1)

    @cached_property
    def _file(self) -> np.memmap:
        """The whole file, mapped once for every tensor's view."""
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def string(self, key: str) -> str | None:
        value = self.fields.get(key)
        return value if isinstance(value, str) else None


def _block(qtype: int) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown ggml tensor type {qtype}") from None


class _Cursor:
    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, code: str):
        """One scalar of ``struct`` type ``code``."""
        fmt = self.order + code
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"truncated header at byte {self.pos}")
        (out,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"truncated string of {n} bytes at byte {self.pos}")
        out = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return out

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                return [self.value(self.take("I")) for _ in range(count)]
            code = _SCALARS.get(etype)
            if code is None:
                raise ValueError(f"unknown array element type {etype} at byte {self.pos}")
            dtype = np.dtype(code).newbyteorder(self.order)
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise ValueError(f"truncated array of {count} elements at byte {self.pos}")
            out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos = end
            return out
        code = _SCALARS.get(vtype)
        if code is None:
            raise ValueError(f"unknown value type {vtype} at byte {self.pos}")
        return self.take(code)


def read_gguf_index(path: Path | str) -> GGUFIndex:
    """The metadata and tensor directory of a GGUF file. A file that is not one, or is cut
    short, raises ``ValueError`` naming the byte where it stops making sense."""
    path = Path(path)
    with open(path, "rb") as f:
        if path.stat().st_size < 24:
            raise ValueError(f"{path.stat().st_size} bytes is too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != _MAGIC:
                raise ValueError(f"no GGUF magic (starts with {bytes(buf[:4])!r})")
            order = "<"
            version = struct.unpack_from("<I", buf, 4)[0]
            if version & 0xFFFF == 0:  # a big-endian file's version read little-endian
                order, version = ">", struct.unpack_from(">I", buf, 4)[0]
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (versions 2 and 3 are read)")
            cur = _Cursor(buf, order)
            cur.pos = 8
            n_tensors, n_kv = cur.take("Q"), cur.take("Q")
            fields: dict[str, object] = {}
            for _ in range(n_kv):
                key = cur.string()
                fields[key] = cur.value(cur.take("I"))
            entries = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.take("I")
                if n_dims > 8:
                    raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
                shape = tuple(int(cur.take("Q")) for _ in range(n_dims))
                entries.append((name, cur.take("I"), shape, cur.take("Q")))
            size = len(buf)
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, qtype, shape, rel in entries:
        block, type_size = _block(qtype)
        n = int(np.prod(shape, dtype=np.int64))
        t = GGUFTensor(name, qtype, shape, start + rel, n // block * type_size)
        if t.offset + t.n_bytes > size:
            raise ValueError(f"tensor {name!r} ends at byte {t.offset + t.n_bytes}, past the file's {size}")
        tensors.append(t)
    return GGUFIndex(path, version, fields, tensors, order)
