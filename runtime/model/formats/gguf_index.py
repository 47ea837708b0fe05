"""Read a GGUF file's metadata and tensor table into `TensorRef`s (no tensor data is read)."""

from __future__ import annotations

import os
import struct
from typing import Any

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


# GGUF value types → byte size of a scalar (8 = string, 9 = array are variable).
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_MAX_DIMS = 4


def prescan(path: str, size: int) -> None:
    """Walk the metadata and tensor-info sections checking every length against the bytes left,
    before `GGUFReader` builds objects for them: a mutated string or array length cannot make it
    allocate or loop beyond what the file holds."""
    f = open(path, "rb")
    blob = bytearray(f.read(min(size, 4 << 20)))  # headers of real models are a few MB; grow on demand
    pos = _HEADER
    n_tensors, n_kv = struct.unpack_from("<QQ", blob, 8)

    def take(n: int) -> int:
        nonlocal pos
        if n < 0 or pos + n > size:
            raise ModelFormatError(f"{path}: corrupt GGUF header: a field at byte {pos} runs past the end of the file")
        if pos + n > len(blob):
            blob.extend(f.read(max(pos + n - len(blob), len(blob))))
        start, pos = pos, pos + n
        return start

    def u32() -> int:
        return struct.unpack_from("<I", blob, take(4))[0]

    def u64() -> int:
        return struct.unpack_from("<Q", blob, take(8))[0]

    def value(kind: int, depth: int = 0) -> None:
        if kind in _SCALAR:
            take(_SCALAR[kind])
        elif kind == 8:
            take(u64())
        elif kind == 9 and depth < 2:
            sub, count = u32(), u64()
            if sub in _SCALAR:
                take(count * _SCALAR[sub])
            else:
                if count * 8 > size - pos:
                    raise ModelFormatError(f"{path}: corrupt GGUF header: array of {count} entries at byte {pos}")
                for _ in range(count):
                    value(sub, depth + 1)
        else:
            raise ModelFormatError(f"{path}: corrupt GGUF header: unknown value type {kind} at byte {pos}")

    try:
        for _ in range(n_kv):
            take(u64())  # key
            value(u32())
        for _ in range(n_tensors):
            take(u64())  # name
            dims = u32()
            if not 1 <= dims <= _MAX_DIMS:
                raise ModelFormatError(f"{path}: corrupt GGUF header: tensor with {dims} dimensions at byte {pos}")
            take(8 * dims)
            take(4 + 8)  # type, offset
    finally:
        f.close()


class GGUFIndex:
    def __init__(self, path: str):
        from gguf import GGUFReader  # lazy: only GGUF runs need it

        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFormatError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        precheck_header(path, size)
        prescan(path, size)
        try:
            self.reader = GGUFReader(path, "r")
        except (Exception, RecursionError) as exc:  # ValueError, struct/index/unicode errors on bad headers
            detail = str(exc).splitlines()[0][:120] if str(exc) else ""
            raise ModelFormatError(f"{path}: invalid or truncated GGUF file ({exc.__class__.__name__}: {detail})") from None
        self.tensors: dict[str, TensorRef] = {}
        spans = []
        for t in self.reader.tensors:
            shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
            start, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelFormatError(f"{path}: truncated: tensor {t.name} ends at byte {end}, the file has {size}")
            if t.name in self.tensors:
                raise ModelFormatError(f"{path}: tensor {t.name} appears twice")
            kind = t.tensor_type.name
            self.tensors[t.name] = TensorRef(path, t.name, start, end - start, _PLAIN.get(kind, kind), shape)
            spans.append((start, end, t.name))
        spans.sort()
        for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise ModelFormatError(f"{path}: tensors {n0} and {n1} overlap")
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF.") or key in _BULKY:
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception:
                raise ModelFormatError(f"{path}: metadata field {key} cannot be decoded") from None

    def array(self, key: str) -> list | None:
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path}: GGUF metadata lacks 'general.architecture'")
        return arch
