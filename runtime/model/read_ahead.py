"""A multi-token pass's guess of the next MoE layer's experts, made from this layer's input.

The residual stream changes little from one layer to the next, so the next MoE layer's router applied
to this layer's normalised MoE input, rescaled from this layer's norm weights to the next one's, names
most of what that layer will choose: 71 % of the next layer's top 4 on the embedded and widened models,
against 42 % for the previous token's choice at the same layer (`benchmarks/layer_ahead.py`;
docs/performance/offload.md, "How good the guess is"). Offloading runtimes for Mixtral pre-gate the
same way. The guess only starts reads (`offload/read_ahead.py`): routing never sees it.
"""

from __future__ import annotations

import numpy as np

Key = tuple[int, int]


class NextLayerGuess:
    """``guess(L, x, n)``: each token's ``n`` likeliest experts of the MoE layer after L, ranked by
    that layer's own routing rule (softmax or sigmoid, score bias, groups) on the rescaled input."""

    def __init__(self, model):
        c, W = model.config, model.W
        moe = [L for L in range(c.num_layers) if c.moe_layers[L]]
        self._next = dict(zip(moe, moe[1:]))
        self._model = model
        self._scales: dict[int, np.ndarray] = {}
        norm = {L: np.asarray(W[f"layers.{L}.ffn_norm"], dtype=np.float32) for L in moe}
        for L, nxt in self._next.items():
            # x = RMSNorm(h)·w_L; the next layer's input ≈ RMSNorm(h)·w_next (zero where w_L is: padding)
            self._scales[L] = np.divide(norm[nxt], norm[L], out=np.zeros_like(norm[L]), where=norm[L] != 0)

    def guess(self, L: int, x: np.ndarray, n: int) -> list[Key]:
        """Keys (layer, expert), every token's first choice before any token's second: where the
        workspace lends fewer reads than there are guesses, the likeliest are read. [] after the
        last MoE layer."""
        nxt = self._next.get(L)
        if nxt is None or n <= 0:
            return []
        m, c = self._model, self._model.config
        p = f"layers.{nxt}."
        logits = m.backend.to_host(m._router(x * self._scales[L], m.W[p + "router"], m.W.get(p + "router_bias")))
        groups = (c.expert_groups, c.expert_groups_used) if c.expert_groups else None
        experts, _ = m.ops.route(logits, min(n, c.num_experts), c.router, c.norm_topk_prob,
                                 scale=c.routed_scaling_factor, groups=groups,
                                 score_bias=m._host.get(p + "router_score_bias"))
        return list(dict.fromkeys((nxt, int(e)) for e in np.asarray(experts).T.ravel() if e >= 0))
