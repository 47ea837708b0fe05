"""Expert weights behind one interface: ``provider.get(layer, expert_ids) -> [ExpertWeights]``.

`ExpertStore` is the slow tier: it reads one (layer, expert)'s byte ranges from the model file and
decodes them. Providers in front of it decide what stays resident; the forward pass only calls
``get`` once per MoE layer per pass, so every expert's weights are fetched once per pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .errors import ExpertReadError
from .formats.tensors import TensorRef, decode
from .loader import ExpertRefs, LoadedModel


@dataclass
class ExpertWeights:
    gate: np.ndarray  # [I, H]
    up: np.ndarray  # [I, H]
    down: np.ndarray  # [H, I]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


class ExpertProvider(Protocol):
    def get(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]: ...


class ExpertStore:
    """Reads experts from the model file(s) with ``os.pread`` (one open descriptor per file)."""

    def __init__(self, model: LoadedModel):
        self.refs: dict[tuple[int, int], ExpertRefs] = model.experts
        self._fds: dict[str, int] = {}

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise ExpertReadError(f"{path}: cannot open for expert reads ({exc.strerror})") from None
        return fd

    def _read(self, ref: TensorRef, where: str) -> np.ndarray:
        try:
            raw = os.pread(self._fd(ref.path), ref.nbytes, ref.offset)
        except OSError as exc:
            raise ExpertReadError(f"{ref.path}: reading {where} failed ({exc.strerror})") from None
        if len(raw) != ref.nbytes:
            raise ExpertReadError(
                f"{ref.path}: short read of {where} ({len(raw)} of {ref.nbytes} bytes); was the file truncated or replaced?"
            )
        return decode(ref, raw)

    def read(self, layer: int, expert: int) -> ExpertWeights:
        refs = self.refs[layer, expert]
        where = f"expert {expert} of layer {layer}"
        return ExpertWeights(*(self._read(r, where) for r in refs.refs))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class ResidentExperts:
    """Every expert stays in memory once read (full residency; no budget)."""

    def __init__(self, store: ExpertStore):
        self.store = store
        self._held: dict[tuple[int, int], ExpertWeights] = {}

    def get(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        out = []
        for e in experts:
            w = self._held.get((layer, e))
            if w is None:
                w = self._held[layer, e] = self.store.read(layer, e)
            out.append(w)
        return out

    @property
    def resident_bytes(self) -> int:
        return sum(w.nbytes for w in self._held.values())
