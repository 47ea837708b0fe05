"""Routers, `RoutingPolicy` (what a pass is told) and `RoutingRecord` (what a pass did).

The forward pass stays ignorant of speculation: a draft asks for a smaller top-k, reuse-aware
gating adds a logit bias that changes only *which* experts are selected; mixture weights always
come from the unbiased router scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

# (layer, router logits [T, E]) -> additive bias [T, E] used for selection only.
SelectionBias = Callable[[int, np.ndarray], "np.ndarray | None"]


@dataclass(frozen=True)
class RoutingPolicy:
    top_k: int | None = None  # override for every MoE layer (a self-draft's smaller k)
    layer_top_k: Mapping[int, int] = field(default_factory=dict)  # per-layer override wins
    selection_bias: SelectionBias | None = None

    def k_for(self, layer: int, default: int) -> int:
        return int(self.layer_top_k.get(layer, self.top_k or default))


TARGET = RoutingPolicy()


@dataclass
class LayerRouting:
    logits: np.ndarray  # [T, E] float32, unbiased
    experts: np.ndarray  # [T, k] int, chosen experts (in selection order)
    weights: np.ndarray  # [T, k] float32 mixture weights


@dataclass
class RoutingRecord:
    """Per MoE layer, per token of one pass: router logits and chosen experts."""

    layers: dict[int, LayerRouting] = field(default_factory=dict)

    def experts_of_token(self, t: int) -> dict[int, np.ndarray]:
        return {L: r.experts[t] for L, r in self.layers.items()}

    def unique_experts(self, tokens: slice | None = None) -> set[tuple[int, int]]:
        sel = tokens or slice(None)
        return {(L, int(e)) for L, r in self.layers.items() for e in np.unique(r.experts[sel])}


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=axis, keepdims=True)
    return z


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Top-k per row, highest first, ties to the lower expert id (deterministic)."""
    if k >= scores.shape[-1]:
        return np.argsort(-scores, axis=-1, kind="stable")
    part = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
    # argpartition does not order ties by id; re-rank the candidates, then make sure no tied
    # outsider with a lower id was left out (rare: fall back to a full stable sort for those rows).
    cand = np.take_along_axis(scores, part, -1)
    order = np.lexsort((part, -cand), axis=-1)
    chosen = np.take_along_axis(part, order, -1)
    kth = np.take_along_axis(scores, chosen[:, -1:], -1)
    ties_outside = ((scores == kth).sum(-1) != (np.take_along_axis(scores, chosen, -1) == kth).sum(-1))
    if ties_outside.any():
        rows = np.nonzero(ties_outside)[0]
        chosen[rows] = np.argsort(-scores[rows], axis=-1, kind="stable")[:, :k]
    return chosen


def route(
    logits: np.ndarray, k: int, kind: str, norm_topk_prob: bool, bias: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Select k experts per token and their mixture weights.

    kind "softmax_topk": weights = softmax over all experts, restricted to the chosen (renormalised
    if ``norm_topk_prob``). kind "topk_softmax": softmax over the chosen logits (Mixtral).
    Softmax is monotone, so selecting on logits (+ bias) equals selecting on probabilities.
    """
    select_on = logits if bias is None else logits + bias
    experts = top_k_indices(select_on, k)
    if kind == "topk_softmax":
        weights = softmax(np.take_along_axis(logits, experts, -1).astype(np.float32))
    else:
        probs = softmax(logits.astype(np.float32))
        weights = np.take_along_axis(probs, experts, -1)
        if norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
    return experts, weights.astype(np.float32)
