"""Next-token sampling: temperature, top-k, top-p, min-p; temperature 0 is argmax."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p < 1:
            raise UsageError(f"--min-p must be in [0, 1) (got {self.min_p})")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (got {self.top_k})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from, after temperature and truncation (float64, sums to 1).

    Speculative sampling needs this same distribution for the target and the draft.
    """
    z = logits.astype(np.float64) / params.temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if params.top_k and params.top_k < p.size:
        kth = np.partition(p, -params.top_k)[-params.top_k]
        keep &= p >= kth
    if params.min_p > 0:
        keep &= p >= params.min_p * p.max()
    if params.top_p < 1:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # smallest prefix reaching top_p (a hair of slack so 0.5 + 0.3 "reaches" 0.8 in floats)
        cutoff = np.searchsorted(cum, params.top_p - 1e-12) + 1
        nucleus = np.zeros_like(keep)
        nucleus[order[:cutoff]] = True
        keep &= nucleus
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    p = probabilities(logits, params)
    return int(rng.choice(p.size, p=p))
