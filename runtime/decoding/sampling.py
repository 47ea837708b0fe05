"""Next-token sampling: temperature, top-k, top-p, min-p; temperature 0 is argmax."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import number


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        number("--temperature", self.temperature, low=0)
        number("--top-p", self.top_p, low=0, low_open=True, high=1)
        number("--min-p", self.min_p, low=0, high=1, high_open=True)
        number("--top-k", self.top_k, low=0, integer=True)
        if self.seed is not None:
            number("--seed", self.seed, low=0, high=2 ** 63 - 1, integer=True)

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
