"""Next-token sampling: temperature, top-k, top-p, min-p; temperature 0 is argmax.

Two ways to draw (``--sampler``):
- standard: one generator consumed in call order. Speculative verification is the classic accept
  with min(1, p/q), else resample from max(p − q, 0); it accepts Σ min(p, q) per token, the most any
  single-draft scheme can, but what was drafted decides which random numbers later tokens get, so a
  seed reproduces the text only when every draft decision repeats (AE's live timings and the expert
  cache's contents change them from run to run).
- coupled: Gumbel-max with noise that depends on (seed, position) only. Every token at position j is
  argmax(log p + g_j), a draft token is accepted iff it is the target's own draw with the same g_j,
  so the text is AR's text for that seed whatever was drafted, and each token still has law p.
  Its acceptance is lower (≥ (1 − TV)/(1 + TV) against Σ min(p, q) = 1 − TV). Reuse-aware gating
  changes the target's own law with the drafted batch, so "AR's text" needs gating off (--no-rg).
auto (the default) is coupled when a seed is given, since a seed asks for reproducible text, and
standard otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import number
from ..errors import UsageError

SAMPLERS = ("auto", "coupled", "standard")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    sampler: str = "auto"  # see the module docstring

    def __post_init__(self):
        number("--temperature", self.temperature, low=0)
        number("--top-p", self.top_p, low=0, low_open=True, high=1)
        number("--min-p", self.min_p, low=0, high=1, high_open=True)
        number("--top-k", self.top_k, low=0, integer=True)
        if self.seed is not None:
            number("--seed", self.seed, low=0, high=2 ** 63 - 1, integer=True)
        if self.sampler not in SAMPLERS:
            raise UsageError(f"--sampler {self.sampler!r}: must be one of {', '.join(SAMPLERS)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def coupled(self) -> bool:
        return not self.greedy and (self.sampler == "coupled" or (self.sampler == "auto" and self.seed is not None))

    @property
    def draws(self) -> str:
        """What decides each token, as reports name it: greedy, coupled or standard."""
        return "greedy" if self.greedy else "coupled" if self.coupled else "standard"


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
        keep[nucleus_outside(p, params.top_p)] = False
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def nucleus_outside(p: np.ndarray, top_p: float, first: int = 64) -> np.ndarray:
    """Mask of the tokens outside the nucleus: the smallest prefix of p in decreasing order (ties by
    index) whose mass reaches top_p, with a hair of slack so 0.5 + 0.3 "reaches" 0.8 in floats.

    Exactly the prefix a full stable sort gives, without sorting the vocabulary (a stable argsort of
    6144 float64 took 0.5 ms here, a fifth of a default-model token): sort only the m largest, and
    accept when the prefix ends inside them, strictly above everything left out (a tie across the
    boundary could hide an earlier index). The prefix sums are the same additions in the same order,
    so the same floats. Otherwise m grows to at least what the missing mass needs at the m-th
    probability, and past a quarter of the vocabulary the full sort is cheaper."""
    target, n = top_p - 1e-12, p.size
    m = min(first, n)
    while True:
        if 4 * m > n:
            m, order = n, np.argsort(-p, kind="stable")
        else:
            top = np.argpartition(-p, m - 1)[:m]  # the m largest; which of a tie at the m-th, arbitrary
            order = top[np.lexsort((top, -p[top]))]
        cum = np.cumsum(p[order])
        cutoff = int(np.searchsorted(cum, target)) + 1
        if m == n or (cutoff <= m and p[order[cutoff - 1]] > p[order[-1]]):
            out = np.ones(n, dtype=bool)
            out[order[:cutoff]] = False
            return out
        last = float(p[order[-1]])  # everything left out is at most this
        short = (target - float(cum[-1])) / last if last > 0 else n
        m = int(min(n, max(2 * m, m + 1.25 * short + 1)))


class StandardDraws:
    """One generator, consumed in call order (the position is not used)."""

    coupled = False

    def __init__(self, seed: int | None):
        self.rng = np.random.default_rng(seed)

    def token(self, p: np.ndarray, position: int) -> int:
        return int(self.rng.choice(p.size, p=p))

    def uniform(self) -> float:
        return float(self.rng.random())

    def forget_before(self, position: int) -> None:
        pass


class CoupledDraws:
    """Gumbel-max on noise that is a function of (seed, position) alone, computed as the equivalent
    exponential race argmax p_i / E_i (E ~ Exp(1), so −log E is Gumbel): no logarithms, about the
    cost of one `rng.choice` over the vocabulary. Position j's noise is drawn once and kept until the
    text moves past j (the draft and verification both read it)."""

    coupled = True

    def __init__(self, seed: int | None):
        # no seed: a fresh one, so the run is random but draft and target still share its noise
        self.seed = int(np.random.SeedSequence().entropy) if seed is None else int(seed)
        self._noise: dict[int, np.ndarray] = {}

    def noise(self, position: int, size: int) -> np.ndarray:
        """E for this position. The position is a spawn key, not a second entropy word: NumPy drops
        trailing zero words, so [seed, j] would give seed s + 2^32·j at position 0 seed s's noise at j."""
        e = self._noise.get(position)
        if e is None or e.size != size:
            rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(position,)))
            e = self._noise[position] = rng.standard_exponential(size)
        return e

    def scores(self, p: np.ndarray, position: int) -> np.ndarray:
        """Race keys p / E: the largest wins; a truncated token (p = 0) scores 0 and never does."""
        return p / self.noise(position, p.size)

    def token(self, p: np.ndarray, position: int) -> int:
        return int(np.argmax(self.scores(p, position)))

    def forget_before(self, position: int) -> None:
        for j in [j for j in self._noise if j < position]:
            del self._noise[j]


def draws_for(params: SamplingParams) -> StandardDraws | CoupledDraws:
    return CoupledDraws(params.seed) if params.coupled else StandardDraws(params.seed)


def sample(logits: np.ndarray, params: SamplingParams, draws: StandardDraws | CoupledDraws, position: int) -> int:
    """The token at ``position`` (its index in the generated text) from these logits."""
    if params.greedy:
        return int(np.argmax(logits))
    return draws.token(probabilities(logits, params), position)
