"""Reuse-aware gating (RG): nudge verification tokens toward experts the batch already loads.

For one MoE layer and the B tokens of a verification batch, with router logits ℓ [B, E] and
target top-k k:
    w_b  token weight        paper: the token's draft confidence; code: router peakedness
                             max_e ℓ_b,e − mean_e ℓ_b,e, scaled by 1 / max_b w_b
    g_e  = Σ_b w_b · ℓ_b,e   expert importance for the batch
    E*   = top max(cap, k) experts by g_e (ties to the lower id)
    λ_b  = strength · (ℓ_b,(1) − ℓ_b,(k+1))   paper: per token; code: the batch mean
    ℓ'_b,e = ℓ_b,e + λ_b · 1[e ∈ E*]
The biased logits only select the top-k; mixture weights come from the unbiased router (the
forward pass's `route` does that). No-op when B ≤ 1, cap ≤ 0, every λ_b ≤ 0 or every w_b = 0.

Variant "resident" (ours): as "paper", but E* also favours what the fast tier already holds or is
reading (resident or prefetched): E* = top max(cap, k) by ĝ_e + ρ · 1[e available], with ĝ the
importance scaled to [0, 1] and ρ = ``residency`` (0 = the paper's E*; ≥ 1 = every available
expert outranks every other). The batch then reuses what it holds instead of fetching; the price
is quality (benchmarks/quality.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.routing import top_k_indices

VARIANTS = ("paper", "code", "resident")


def preferred_set(g: np.ndarray, size: int, residency: float = 0.0, available=None) -> np.ndarray:
    """E*: the ``size`` experts of largest importance ``g`` [E] (ties to the lower id). With
    ``available`` ([E] bool, the "resident" variant), g is first scaled to [0, 1] and available
    experts get the bonus ``residency``."""
    if available is not None:
        spread = g.max() - g.min()
        g = (g - g.min()) / (spread if spread > 0 else 1.0) + residency * available
    return top_k_indices(g[None, :], min(size, g.size))[0]


@dataclass
class ReuseGating:
    top_k: int
    cap: int
    variant: str = "paper"
    strength: float = 1.0
    confidences: np.ndarray | None = None  # [B] draft confidence per batch token (paper's w_b)
    residency: float = 0.5  # "resident": the bonus ρ of an available expert in E*
    available: object = None  # "resident": layer -> [E] bool (resident or in flight), or None
    kernel: object = None  # the compiled bias (`CpuOps.reuse_bias`), the same bits; None: NumPy here

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"reuse gating variant {self.variant!r} not in {VARIANTS}")
        if self.confidences is not None:  # once per batch, not once per layer
            self.confidences = np.ascontiguousarray(self.confidences, dtype=np.float64)

    def weights(self, logits: np.ndarray) -> np.ndarray:
        if self.variant in ("paper", "resident") and self.confidences is not None:
            return self.confidences
        w = logits.max(-1) - logits.mean(-1)
        top = w.max()
        return w / top if top > 0 else np.zeros_like(w)

    def bias(self, layer: int, logits: np.ndarray) -> np.ndarray | None:
        B, E = logits.shape
        k = self.top_k
        if B <= 1 or self.cap <= 0 or self.strength <= 0 or k >= E:
            return None
        avail = self.available(layer) if self.variant == "resident" and self.available is not None else None
        if (self.kernel is not None and self.variant != "code" and self.confidences is not None
                and self.confidences.shape == (B,) and logits.dtype == np.float32 and logits.flags.c_contiguous):
            # about 15 NumPy calls a layer, 12 % of a verification, in one
            return self.kernel(logits, self.confidences, k, min(max(self.cap, k), E), self.strength,
                               self.residency, avail)
        w = self.weights(logits)
        if not np.any(w > 0):
            return None
        g = (w[:, None] * logits).sum(0)  # [E]
        preferred = preferred_set(g, max(self.cap, k), self.residency, avail)
        ordered = -np.sort(-logits, axis=-1)
        gap = ordered[:, 0] - ordered[:, k]  # top-1 minus (k+1)-th, per token
        lam = self.strength * (np.full(B, gap.mean()) if self.variant == "code" else gap)
        if not np.any(lam > 0):
            return None
        bias = np.zeros_like(logits)
        bias[:, preferred] = lam[:, None]
        return bias
