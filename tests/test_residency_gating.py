"""Residency-aware reuse gating ("resident" variant) and AE's prediction under gating."""

from __future__ import annotations

import numpy as np

from s2moe.runtime.decoding.gating import ReuseGating
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.model.routing import LayerRouting, RoutingRecord


def _logits():
    # 3 tokens, 8 experts: importance favours 0..3; experts 6, 7 are what the fast tier holds
    return np.array([[5, 4, 3, 2, 1, 0, -1, -2],
                     [5, 4, 3, 2, 1, 0, 0.5, -1],
                     [4, 5, 2, 3, 0, 1, -1, 0.8]], np.float32)


def test_resident_variant_puts_available_experts_in_the_preferred_set():
    avail = np.zeros(8, bool)
    avail[[6, 7]] = True
    conf = np.ones(3)
    paper = ReuseGating(2, 4, "paper", 1.0, conf).bias(0, _logits())
    mild = ReuseGating(2, 4, "resident", 1.0, conf, residency=0.0, available=lambda L: avail).bias(0, _logits())
    strong = ReuseGating(2, 4, "resident", 1.0, conf, residency=2.0, available=lambda L: avail).bias(0, _logits())
    favoured = lambda b: set(np.nonzero(b[0] > 0)[0])  # noqa: E731
    assert favoured(paper) == {0, 1, 2, 3} == favoured(mild)  # ρ = 0 is the paper's E*
    assert {6, 7} <= favoured(strong) and len(favoured(strong)) == 4  # available experts outrank the rest
    # the bias only adds to E*: the raise equals each token's own top-1 − (k+1)-th gap
    gap = -np.sort(-_logits(), -1)
    assert np.allclose(strong.max(-1), gap[:, 0] - gap[:, 2])


def test_ae_prices_the_experts_gating_will_pull_toward_the_batch():
    """Token with top-2 {0, 1} and expert 5 just below: once the batch holds expert 5, gating
    raises it over expert 1, so the token adds only expert 0 — without gating it adds 0 and 1."""

    class _Model:
        class config:
            num_experts = 8
            top_k = 2

        experts = None

    logits = np.array([[3.0, 2.0, -5, -5, -5, 1.9, -5, -5]], np.float32)
    record = RoutingRecord({0: LayerRouting(logits, np.array([[0, 1]]), np.ones((1, 2), np.float32))})
    costs = CostConstants(1, 1, 1, 1)
    batch = {(0, 5)}
    gated = SpeculativeDecoder(_Model, get_method("s2moe"), SpecSettings(), costs)
    plain = SpeculativeDecoder(_Model, get_method("ca+ae"), SpecSettings(), costs)
    assert gated._predicted_experts(record, 0, batch) - batch == {(0, 0)}
    assert plain._predicted_experts(record, 0, batch) - batch == {(0, 0), (0, 1)}
