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


class _OneLayerModel:
    class config:
        num_experts = 8
        top_k = 2

    experts = None


def _record(logits, layer=0):
    top = np.argsort(-logits, -1, kind="stable")[:, :2]
    return RoutingRecord({layer: LayerRouting(logits, top, np.ones((1, 2), np.float32))})


def test_ae_prediction_raises_by_the_gap_to_the_k_plus_first_logit():
    """Top-2 {0: 3.0, 1: 2.5}, expert 5 at 1.9 in the batch: gating raises it by 3.0 − 1.9 (the
    top-1 − (k+1)-th gap) to 3.0, past expert 1; a top-1 − k-th gap (0.5) would leave it at 2.4."""
    logits = np.array([[3.0, 2.5, -5, -5, -5, 1.9, -5, -5]], np.float32)
    gated = SpeculativeDecoder(_OneLayerModel, get_method("s2moe"), SpecSettings(), CostConstants(1, 1, 1, 1))
    assert gated._predicted_experts(_record(logits), 0, {(0, 5)}) - {(0, 5)} == {(0, 0)}


def test_ae_prediction_favours_only_the_batchs_experts_of_the_same_layer():
    logits = np.array([[3.0, 2.0, -5, -5, -5, 1.9, -5, -5]], np.float32)
    gated = SpeculativeDecoder(_OneLayerModel, get_method("s2moe"), SpecSettings(), CostConstants(1, 1, 1, 1))
    assert gated._predicted_experts(_record(logits), 0, {(1, 5)}) == {(0, 0), (0, 1)}  # expert 5 of layer 1


def test_a_reuse_cap_below_k_still_prefers_k_experts():
    logits = np.array([[3, 2, 1, 0, -1, -2], [0, 3, 2, 1, -1, -2], [-2, -1, 0, 1, 2, 4]], np.float64)
    bias = ReuseGating(top_k=2, cap=1, confidences=np.array([1.0, 0.5, 0.25])).bias(0, logits)
    assert set(np.nonzero(bias[0])[0]) == {0, 1}  # E* is the top max(cap, k) = 2 of the importance


def test_resident_variant_without_a_bonus_weighs_tokens_by_draft_confidence_as_the_paper_does():
    logits = np.array([[3, 2, 1, 0, -1, -2], [0, 3, 2, 1, -1, -2], [-2, -1, 0, 1, 2, 4]], np.float64)
    conf = np.array([1.0, 0.5, 0.25])
    paper = ReuseGating(2, 3, "paper", 1.0, conf).bias(0, logits)
    resident = ReuseGating(2, 3, "resident", 1.0, conf, residency=0.0,
                           available=lambda L: np.zeros(6, bool)).bias(0, logits)
    np.testing.assert_array_equal(resident, paper)
    assert set(np.nonzero(paper[0])[0]) == {0, 1, 2}  # by confidence; by router peakedness it is {1, 2, 3}


def test_the_decoder_prices_an_expert_being_prefetched_as_in_flight():
    class _Cache:
        def contains(self, layer, expert):
            return (layer, expert) == (0, 1)

        def in_flight(self, key):
            return key == (0, 5)

    class _Model(_OneLayerModel):
        experts = _Cache()

    dec = SpeculativeDecoder(_Model, get_method("ca+ae"), SpecSettings(), CostConstants(1, 1, 1, 1))
    assert [dec._state(k) for k in [(0, 1), (0, 5), (0, 2)]] == ["held", "in_flight", "missing"]


def test_ae_prediction_raises_by_rg_strength_times_the_gap():
    """Expert 5 (1.9, in the batch) is raised by strength × (3.0 − 1.9): at 0.05 it reaches 1.955,
    still under expert 1 (2.0); at 0.5 it reaches 2.45 and replaces it."""
    logits = np.array([[3.0, 2.0, -5, -5, -5, 1.9, -5, -5]], np.float32)
    costs = CostConstants(1, 1, 1, 1)
    for strength, new in ((0.05, {(0, 0), (0, 1)}), (0.5, {(0, 0)})):
        dec = SpeculativeDecoder(_OneLayerModel, get_method("s2moe"), SpecSettings(rg_strength=strength), costs)
        assert dec._predicted_experts(_record(logits), 0, {(0, 5)}) - {(0, 5)} == new, strength


class _TierModel(_OneLayerModel):
    class experts:  # the fast tier holds (or is reading) expert 6
        @staticmethod
        def available_mask(layer, num_experts):
            mask = np.zeros(num_experts, bool)
            mask[6] = True
            return mask


def test_ae_prediction_under_the_resident_variant_favours_the_batch_and_the_tier():
    """Top-2 {0, 1}; expert 5 (1.9) in the batch, expert 6 (1.8) in the tier. Both are raised by
    the 3.0 − 1.9 gap, to 3.0 and 2.9, past expert 1: the token adds expert 0 only. With an empty
    batch, only the tier's expert 6 is raised (to 2.9), and the paper's variant raises nothing."""
    logits = np.array([[3.0, 2.0, -5, -5, -5, 1.9, 1.8, -5]], np.float32)
    costs = CostConstants(1, 1, 1, 1)
    resident = SpeculativeDecoder(_TierModel, get_method("s2moe"), SpecSettings(rg_variant="resident"), costs)
    paper = SpeculativeDecoder(_TierModel, get_method("s2moe"), SpecSettings(rg_variant="paper"), costs)
    assert resident.settings.rg_residency == 0.25  # expert 6 ranks high enough to enter E* at the default ρ
    assert resident._predicted_experts(_record(logits), 0, {(0, 5)}) - {(0, 5)} == {(0, 0)}
    assert resident._predicted_experts(_record(logits), 0, set()) == {(0, 0), (0, 6)}
    assert paper._predicted_experts(_record(logits), 0, set()) == {(0, 0), (0, 1)}


def test_the_decoders_resident_gating_sees_what_the_tier_holds():
    """Verification's policy under --rg-variant resident: the tier's experts enter E* (ρ = 2
    outranks any importance), so expert 6 is favoured; the paper's E* is {0, 1, 2, 3}."""
    settings = SpecSettings(rg_variant="resident", rg_residency=2.0)
    dec = SpeculativeDecoder(_TierModel, get_method("s2moe"), settings, CostConstants(1, 1, 1, 1))
    bias = dec.verify_policy([1.0, 0.8, 0.8]).selection_bias(0, _logits())
    assert 6 in set(np.nonzero(bias[0] > 0)[0])


def test_verification_gating_weighs_each_token_by_its_draft_confidence(monkeypatch):
    """The paper's w_b: the root weighs 1, each draft token its draft probability (0.8 here)."""
    import s2moe.runtime.decoding.speculative as speculative
    from stub_model import START, StubModel

    seen, real = [], speculative.ReuseGating

    def spy(*args, **kwargs):
        seen.append(np.asarray(args[4], np.float64))
        return real(*args, **kwargs)

    monkeypatch.setattr(speculative, "ReuseGating", spy)

    def chain(ctx):  # greedy drafts 0 → 1 → 2 → 0 …, each at 0.8
        p = np.array([0.1, 0.1, 0.1, 0.0])
        p[(ctx[-1] + 1) % 3 if ctx[-1] != START else 0] = 0.8
        return p

    model = StubModel(chain, chain, vocab=4, experts_of=lambda t: {t % 4, (t + 1) % 4})
    dec = SpeculativeDecoder(model, get_method("ca", reuse_gating=True), SpecSettings(draft_topk=1, draft_cap=3),
                             CostConstants(1, 1, 1, 1))
    dec.generate([START], 8)
    assert seen and all(len(w) == 4 for w in seen)
    for w in seen:
        np.testing.assert_allclose(w, [1.0, 0.8, 0.8, 0.8], rtol=1e-9)


def test_the_default_gating_is_resident_and_without_a_budget_it_is_the_papers():
    """The default variant favours what the fast tier holds (ρ = 0.25, the setting whose quality
    docs/performance.md measures). With every expert resident there is no tier to favour: the
    output is the paper variant's, token for token, and so is what each verification loads. Under a
    budget verification loads other experts (its misses and hits per pass differ). Whether the
    tokens then differ too depends on float rounding this test should not pin: on this prompt they
    did before the SIMD attention of 2026-12-02 and no longer do."""
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.engine import build_engine

    assert (SpecSettings().rg_variant, SpecSettings().rg_residency) == ("resident", 0.25)
    ids = [int(t) for t in np.random.default_rng(3).integers(10, 6000, 12)]
    costs = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)
    out = {}
    for budget in (None, "0.1"):
        for name, settings in (("default", SpecSettings(draft_cap=4)), ("paper", SpecSettings(draft_cap=4, rg_variant="paper"))):
            engine = build_engine(str(DEFAULT_MODEL), budget, 256)
            r = SpeculativeDecoder(engine.model, get_method("s2moe"), settings, costs).generate(ids, 40)
            out[budget, name] = r.tokens, [row[1:3] for row in r.metrics.verify_samples]  # (missing, resident)
            engine.close()
    assert out[None, "default"] == out[None, "paper"]
    assert out["0.1", "default"][1] != out["0.1", "paper"][1]


def test_ae_prediction_under_the_resident_variant_favours_only_tier_experts_its_preferred_set_takes():
    """Expert 6 is in the tier but ranked low (−3; scaled, 0.2 of the row's range). The token's gap
    is 5 − 0.9 = 4.1, so if favoured it would climb to 1.1, past expert 1. At ρ = 0.25 it does not
    enter E* (top 4: 0, 1, 2, 3 at 1.0, 0.6, 0.59, 0.58 against its 0.45): the token keeps {0, 1}.
    At ρ = 2 it does, and AE prices {0, 6} as verification would load them."""
    logits = np.array([[5.0, 1.0, 0.9, 0.8, 0.7, -4, -3, -5]], np.float32)
    costs = CostConstants(1, 1, 1, 1)
    for rho, want in ((0.25, {(0, 0), (0, 1)}), (2.0, {(0, 0), (0, 6)})):
        dec = SpeculativeDecoder(_TierModel, get_method("s2moe"), SpecSettings(rg_variant="resident", rg_residency=rho),
                                 costs)
        assert dec._predicted_experts(_record(logits), 0, set()) == want, rho


def test_the_tiers_preferred_set_is_the_same_from_the_shared_sort():
    """A draft pass sorts a token's logits once (`_logit_rows`) and the resident E* reads the row's
    range from that sort: it must rank exactly as from the rows' own minimum and maximum."""
    rng = np.random.default_rng(2)
    for rho in (0.1, 0.25, 0.5, 1.0):
        dec = SpeculativeDecoder(_TierModel, get_method("s2moe"), SpecSettings(rg_variant="resident", rg_residency=rho),
                                 CostConstants(1, 1, 1, 1))
        for _ in range(50):
            rows = rng.standard_normal((1, 8)) * rng.uniform(0.1, 5)
            ordered = -np.sort(-rows, axis=1)
            assert np.array_equal(dec._tier_in_preferred_set([0], rows, ordered), dec._tier_in_preferred_set([0], rows))


def test_the_decoders_verification_gates_at_the_settings_strength():
    """The bias verification selects with is the settings' --rg-strength times the paper's: 0 is no
    gating (the target's own top-k), 2 doubles every raise. (The CLI test checks the flag reaches
    the settings; this checks the decoder uses them.)"""
    logits = _logits()
    bias = {}
    for strength in (0.0, 1.0, 2.0):
        dec = SpeculativeDecoder(_TierModel, get_method("s2moe"), SpecSettings(rg_strength=strength),
                                 CostConstants(1, 1, 1, 1))
        bias[strength] = dec.verify_policy([1.0, 0.9, 0.8]).selection_bias(0, logits)
    assert bias[0.0] is None
    assert bias[1.0] is not None and np.count_nonzero(bias[1.0]) >= 3
    np.testing.assert_array_equal(bias[2.0], 2 * bias[1.0])
