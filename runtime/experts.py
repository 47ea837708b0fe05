"""Expert weights behind one interface: ``provider.get(layer, expert_ids) -> [ExpertWeights]``.

The forward pass calls ``get`` once per MoE layer per pass with the distinct experts that layer's
tokens chose, so each expert's weights are fetched at most once per pass. `ExpertCache`
(runtime/cache.py) is the provider; `ExpertStore` (runtime/store.py) the slow tier behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np


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
