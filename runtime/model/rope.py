"""Rotary position embeddings: inverse frequencies (default or YaRN), tables, and the two layouts.

YaRN follows transformers' `_compute_yarn_parameters` term by term (correction range, optional
truncation, linear ramp, attention factor), computed in float64. The attention factor scales cos
and sin, i.e. both q and k, exactly as transformers applies it.
"""

from __future__ import annotations

import math

import numpy as np

from ..kernels.backend import xp_of
from .config import ModelConfig, yarn_mscale


def inv_freq_and_factor(c: ModelConfig) -> tuple[np.ndarray, float]:
    dim, base = c.rope_dim, c.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if c.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = c.rope_factor
    attention_factor = c.rope_attention_factor
    if attention_factor is None:
        if c.rope_mscale and c.rope_mscale_all_dim:
            attention_factor = yarn_mscale(factor, c.rope_mscale) / yarn_mscale(factor, c.rope_mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    orig = c.rope_original_max_position or c.max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(c.rope_beta_fast), correction_dim(c.rope_beta_slow)
    if c.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate (divide by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def tables(inv_freq: np.ndarray, factor: float, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, rope_dim / 2] (one angle per rotated pair), scaled by the attention factor."""
    angles = np.outer(positions.astype(np.float64), inv_freq)
    return (np.cos(angles) * factor).astype(np.float32), (np.sin(angles) * factor).astype(np.float32)


def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """Rotate the last axis of ``x`` [..., T, D]. Pairs are (i, i + D/2) (HF's rotate-half) or, with
    ``interleave``, adjacent (2i, 2i + 1) as DeepSeek's complex-number form; those stay in place."""
    xp = xp_of(x)
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
        out = xp.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return xp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
