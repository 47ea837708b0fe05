"""Read a GGUF file's metadata and tensor table into `TensorRef`s (no tensor data is read)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ModelFormatError
from .tensors import TensorRef

# GGUF stores these as plain IEEE types; everything else is a GGML block format.
_PLAIN = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64", "I32": "I32", "I64": "I64"}
# Arrays kept out of the metadata dict unless asked for: they can hold 100k+ strings.
_BULKY = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


class GGUFIndex:
    def __init__(self, path: str):
        from gguf import GGUFReader  # lazy: only GGUF runs need it

        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFormatError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            self.reader = GGUFReader(path, "r")
        except Exception as exc:  # the reader raises ValueError, struct/index errors on bad headers
            raise ModelFormatError(f"{path}: invalid or truncated GGUF file ({exc.__class__.__name__}: {exc})") from None
        self.tensors: dict[str, TensorRef] = {}
        for t in self.reader.tensors:
            shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelFormatError(f"{path}: truncated: tensor {t.name} ends at byte {end}, the file has {size}")
            kind = t.tensor_type.name
            self.tensors[t.name] = TensorRef(path, t.name, int(t.data_offset), int(t.n_bytes), _PLAIN.get(kind, kind), shape)
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
