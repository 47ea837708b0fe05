"""Read a GGUF file's metadata and tensor table into `TensorRef`s (no tensor data is read).

Our own parser, not `gguf.GGUFReader`: that one maps the whole file, and a model larger than memory
must not be mapped (its pages would count against the process's memory as it is touched)."""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

from ...errors import ModelFormatError
from .tensors import TensorRef

# GGUF stores these as plain IEEE types; everything else is a GGML block format.
_PLAIN = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64", "I32": "I32", "I64": "I64"}
# Arrays kept out of the metadata dict unless asked for: they can hold 100k+ strings.
_BULKY = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


# Smallest possible encodings: a tensor info is name length (8) + ≥1 name byte + n_dims (4) + ≥1 dim (8) +
# type (4) + offset (8); a key/value is key length (8) + ≥1 key byte + type (4) + ≥1 value byte.
_MIN_TENSOR_INFO, _MIN_KV, _HEADER = 33, 14, 24


def precheck_header(path: str, size: int) -> None:
    """Counts in the fixed header must fit the file before the reader allocates for them: a header
    that claims 10¹² tensors is refused here, not after a long loop or a huge allocation."""
    with open(path, "rb") as f:
        head = f.read(_HEADER)
    if len(head) < _HEADER:
        raise ModelFormatError(f"{path}: truncated GGUF header ({len(head)} of {_HEADER} bytes)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        raise ModelFormatError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    room = size - _HEADER
    if n_tensors * _MIN_TENSOR_INFO > room or n_kv * _MIN_KV > room:
        raise ModelFormatError(f"{path}: corrupt GGUF header: {n_tensors} tensors and {n_kv} metadata entries "
                               f"cannot fit in {size} bytes")


# GGUF value types: (struct format, size) of scalars; 8 = string, 9 = array
_SCALAR = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_MAX_DIMS = 4
_MAX_DEPTH = 2  # arrays of arrays of scalars at most: deeper nesting is refused, not recursed into


class _Cursor:
    """Reads the header sequentially from a buffered file, checking every length against the
    bytes left before allocating for it: a mutated length cannot make it allocate or loop beyond
    what the file holds. Reads only the header (grows its buffer on demand)."""

    def __init__(self, path: str, f, size: int):
        self.path, self.f, self.size = path, f, size
        self.blob = bytearray(f.read(min(size, 1 << 20)))
        self.pos = _HEADER

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise ModelFormatError(f"{self.path}: corrupt GGUF header: a field at byte {self.pos} runs past the end "
                                   "of the file")
        if self.pos + n > len(self.blob):
            self.blob.extend(self.f.read(max(self.pos + n - len(self.blob), len(self.blob))))
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, kind: int):
        fmt, n = _SCALAR[kind]
        return struct.unpack_from(fmt, self.blob, self.take(n))[0]

    def string(self) -> str:
        n = self.scalar(10)
        start = self.take(n)
        try:
            return bytes(self.blob[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFormatError(f"{self.path}: corrupt GGUF header: a string at byte {start} is not UTF-8") from None

    def value(self, kind: int, depth: int = 0):
        if kind in _SCALAR:
            return self.scalar(kind)
        if kind == 8:
            return self.string()
        if kind == 9 and depth < _MAX_DEPTH:
            sub, count = self.scalar(4), self.scalar(10)
            if sub in _SCALAR:  # numbers in one read, as NumPy would hold them
                start = self.take(count * _SCALAR[sub][1])
                return np.frombuffer(bytes(self.blob[start:start + count * _SCALAR[sub][1]]), _NUMPY[sub]).tolist()
            if count * 8 > self.size - self.pos:  # every string or array takes at least 8 bytes
                raise ModelFormatError(f"{self.path}: corrupt GGUF header: array of {count} entries at byte {self.pos}")
            return [self.value(sub, depth + 1) for _ in range(count)]
        raise ModelFormatError(f"{self.path}: corrupt GGUF header: unknown or too deeply nested value type {kind} "
                               f"at byte {self.pos}")


class GGUFIndex:
    """A GGUF file's metadata and tensor table, parsed from its header with bounded reads (the file
    is never mapped, and the header's pages are dropped from the page cache afterwards)."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFormatError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        precheck_header(path, size)
        with open(path, "rb") as f:
            cur = _Cursor(path, f, size)
            n_tensors, n_kv = struct.unpack_from("<QQ", cur.blob, 8)
            fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                if key in fields:
                    raise ModelFormatError(f"{path}: metadata key {key} appears twice")
                fields[key] = cur.value(cur.scalar(4))
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = cur.scalar(4)
                if not 1 <= dims <= _MAX_DIMS:
                    raise ModelFormatError(f"{path}: corrupt GGUF header: tensor with {dims} dimensions at byte {cur.pos}")
                ne = [cur.scalar(10) for _ in range(dims)]
                infos.append((name, ne, cur.scalar(4), cur.scalar(10)))
            alignment = fields.get("general.alignment", 32)
            if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                raise ModelFormatError(f"{path}: general.alignment {alignment!r} is not a power of two")
            self.data_offset = -(-cur.pos // alignment) * alignment
            if hasattr(os, "posix_fadvise"):  # the header was read buffered: drop its pages
                os.posix_fadvise(f.fileno(), 0, cur.pos, os.POSIX_FADV_DONTNEED)
        self.alignment = alignment
        self._bulky = {k: fields.pop(k) for k in _BULKY if k in fields}
        self.metadata: dict[str, Any] = fields
        self.tensors: dict[str, TensorRef] = {}
        spans = []
        for name, ne, kind, rel in infos:
            dtype, nbytes = _tensor_bytes(path, name, kind, ne)
            start = self.data_offset + rel
            end = start + nbytes
            if end > size:
                raise ModelFormatError(f"{path}: truncated GGUF file: tensor {name} ends at byte {end}, the file has {size}")
            if name in self.tensors:
                raise ModelFormatError(f"{path}: tensor {name} appears twice")
            self.tensors[name] = TensorRef(path, name, start, nbytes, dtype, tuple(reversed(ne)))
            spans.append((start, end, name))
        spans.sort()
        for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise ModelFormatError(f"{path}: tensors {n0} and {n1} overlap")

    def array(self, key: str) -> list | None:
        value = self._bulky.get(key, self.metadata.get(key))
        return value if value is None or isinstance(value, list) else None

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path}: GGUF metadata lacks 'general.architecture'")
        return arch


def _tensor_bytes(path: str, name: str, kind: int, ne: list[int]) -> tuple[str, int]:
    """(type name, byte size) of a tensor from its GGML type id and dimensions."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # the type table only, not the reader

    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise ModelFormatError(f"{path}: tensor {name} has unknown GGML type {kind}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    count = 1
    for d in ne:
        count *= d
    if ne[0] % block:
        raise ModelFormatError(f"{path}: tensor {name}: rows of {ne[0]} values do not fill {qtype.name} blocks of {block}")
    return _PLAIN.get(qtype.name, qtype.name), count // block * type_size
