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


# layer -> bool [E]: the experts a pass may use (a draft that never waits: the resident ones)
Allowed = Callable[[int], "np.ndarray | None"]
FALLBACKS = ("best", "skip")


@dataclass(frozen=True)
class RoutingPolicy:
    top_k: int | None = None  # override for every MoE layer (a self-draft's smaller k)
    layer_top_k: Mapping[int, int] = field(default_factory=dict)  # per-layer override wins
    selection_bias: SelectionBias | None = None
    allowed: Allowed | None = None  # restrict the chosen experts (see `restrict`)
    fallback: str = "best"  # a token left with no allowed expert: the best allowed one, or none

    def k_for(self, layer: int, default: int) -> int:
        return int(self.layer_top_k.get(layer, self.top_k or default))


def restrict(experts: np.ndarray, weights: np.ndarray, logits: np.ndarray, allowed: np.ndarray,
             fallback: str = "best") -> tuple[np.ndarray, np.ndarray]:
    """Keep each token's chosen experts that are ``allowed`` ([E] bool); the rest become -1 with
    weight 0 (the pass skips them). A token left with none gets, with ``fallback="best"``, the
    allowed expert its router scores highest, at the weight of its own top choice; with "skip"
    that layer's experts contribute nothing for it."""
    if experts.shape[0] == 1:  # a decode token (every draft pass): lists beat NumPy's per-call cost
        row_e, row_w, ok = experts[0].tolist(), weights[0].tolist(), allowed.tolist()
        kept = [(e, w) if e >= 0 and ok[e] else (-1, 0.0) for e, w in zip(row_e, row_w)]
        if fallback == "best" and all(e < 0 for e, _ in kept) and any(ok):
            kept[0] = (int(np.where(allowed, logits[0], -np.inf).argmax()), row_w[0])
        return (np.array([[e for e, _ in kept]], dtype=experts.dtype),
                np.array([[w for _, w in kept]], dtype=np.float32))
    keep = (experts >= 0) & allowed[np.maximum(experts, 0)]
    empty = ~keep.any(-1)
    out_e = np.where(keep, experts, -1)
    out_w = np.where(keep, weights, 0.0).astype(np.float32)
    if fallback == "best" and empty.any() and allowed.any():
        out_e[empty, 0] = np.where(allowed[None, :], logits[empty], -np.inf).argmax(-1)
        out_w[empty, 0] = weights[empty, 0]
    return out_e, out_w


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

    @classmethod
    def concatenate(cls, records: list["RoutingRecord"]) -> "RoutingRecord":
        """One record for consecutive chunks of one chain (a prompt run in pieces)."""
        out = cls()
        for L in records[0].layers:
            parts = [r.layers[L] for r in records]
            out.layers[L] = LayerRouting(*(np.concatenate([getattr(p, f) for p in parts])
                                           for f in ("logits", "experts", "weights")))
        return out

    def experts_of_token(self, t: int) -> dict[int, np.ndarray]:
        return {L: r.experts[t] for L, r in self.layers.items()}

    def unique_experts(self, tokens: slice | None = None) -> set[tuple[int, int]]:
        sel = tokens or slice(None)
        return {(L, int(e)) for L, r in self.layers.items() for e in np.unique(r.experts[sel]) if e >= 0}


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=axis, keepdims=True)
    return z


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Top-k per row, highest first, ties to the lower expert id (deterministic)."""
    if k >= scores.shape[-1] or scores.size <= 4096:  # small: a stable sort is exact and cheapest
        return np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    part = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
    # argpartition does not order ties by id; re-rank the candidates, then make sure no tied
    # outsider with a lower id was left out (rare: fall back to a full stable sort for those rows).
    # NaN never equals the k-th score, so rows holding one take the full sort too (NaN last, by id).
    cand = np.take_along_axis(scores, part, -1)
    order = np.lexsort((part, -cand), axis=-1)
    chosen = np.take_along_axis(part, order, -1)
    kth = np.take_along_axis(scores, chosen[:, -1:], -1)
    ties_outside = ((scores == kth).sum(-1) != (np.take_along_axis(scores, chosen, -1) == kth).sum(-1)) \
        | np.isnan(scores).any(-1)
    if ties_outside.any():
        rows = np.nonzero(ties_outside)[0]
        chosen[rows] = np.argsort(-scores[rows], axis=-1, kind="stable")[:, :k]
    return chosen


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) → inf for very negative x gives the right 0
        return 1.0 / (1.0 + np.exp(-x))


def _group_mask(select_on: np.ndarray, groups: tuple[int, int], sum_top2: bool) -> np.ndarray:
    """[T, E] bool: experts inside each token's best ``used`` of ``n`` groups. DeepSeek-V2 ranks a
    group by its best expert, V3 by the sum of its best two (on the scores used for selection)."""
    n, used = groups
    T, E = select_on.shape
    grouped = select_on.reshape(T, n, E // n)
    if sum_top2:
        score = -np.sort(-grouped, axis=-1)[..., :2].sum(-1)
    else:
        score = grouped.max(-1)
    keep = np.zeros((T, n), dtype=bool)
    np.put_along_axis(keep, top_k_indices(score, used), True, axis=-1)
    return np.repeat(keep, E // n, axis=-1)


def route(
    logits: np.ndarray, k: int, kind: str, norm_topk_prob: bool, bias: np.ndarray | None = None, *,
    scale: float = 1.0, groups: tuple[int, int] | None = None, score_bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Select k experts per token and their mixture weights.

    kind "softmax_topk": weights = softmax over all experts, restricted to the chosen (renormalised
    if ``norm_topk_prob``). kind "topk_softmax": softmax over the chosen logits (Mixtral, GPT-OSS).
    kind "sigmoid_topk" (DeepSeek-V3): weights = sigmoid of the chosen logits (renormalised if
    ``norm_topk_prob``); ``score_bias`` (e_score_correction_bias) is added to the sigmoid scores
    for the choice only. ``groups`` = (n, used): choose only among each token's best ``used`` of
    ``n`` expert groups. Weights are finally multiplied by ``scale`` (routed_scaling_factor).
    ``bias`` (reuse-aware gating) is in logit units and also affects only the choice; for sigmoid
    routing it shifts the logit before the sigmoid. Softmax and sigmoid are monotone, so selecting
    on logits (+ bias) equals selecting on probabilities.
    """
    logits = logits.astype(np.float32)
    select_on = logits if bias is None else logits + bias
    if kind == "sigmoid_topk":
        select_on = sigmoid(select_on)
        if score_bias is not None:
            select_on = select_on + score_bias
    allowed = None
    if groups is not None and groups[1] < groups[0]:
        allowed = _group_mask(select_on, groups, sum_top2=kind == "sigmoid_topk")
        select_on = np.where(allowed, select_on, -np.inf)
    experts = top_k_indices(select_on, k)
    rows = np.arange(experts.shape[0])[:, None]  # plain fancy indexing: cheaper than take_along_axis
    if kind == "topk_softmax":
        weights = softmax(logits[rows, experts])
    else:
        scores = sigmoid(logits) if kind == "sigmoid_topk" else softmax(logits)
        weights = scores[rows, experts]
        if allowed is not None:  # k beyond the allowed groups: transformers gives those weight 0
            weights = np.where(allowed[rows, experts], weights, 0.0)
        if norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if kind == "sigmoid_topk" else 0.0))
    if scale != 1.0:
        weights = weights * scale
    return experts, weights.astype(np.float32)
