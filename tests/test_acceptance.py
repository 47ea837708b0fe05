"""AE's acceptance probabilities (runtime/decoding/acceptance.py): by hand on the estimator, then on
a stub whose draft is unsure but always right, where the paper's p_i = q(d_i) declines drafts that
learned probabilities admit, with the same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import one_line_error, s2moe
from stub_model import START, StubModel

from s2moe.runtime.decoding.acceptance import AcceptanceModel
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder


def test_without_evidence_the_estimate_is_the_draft_confidence():
    model = AcceptanceModel()
    for q in (0.0, 0.004, 0.3, 0.77, 1.0):
        assert model.p(q) == pytest.approx(q)  # the paper's rule until verification says otherwise


def test_estimate_by_hand():
    """w = 2, no decay. Bin [0.05, 0.1): 3 kept of 4; bin [0.9, 1]: 1 rejected. For q = 0.06:
    pooled = (3 + 0 + 2·0.06) / (5 + 2) and p = (3 + 2·pooled) / (4 + 2)."""
    model = AcceptanceModel(prior_weight=2.0, half_life=float("inf"))
    for kept in (True, True, False, True):
        model.observe(0.07, kept)
    model.observe(0.95, False)
    pooled = (3 + 2 * 0.06) / (5 + 2)
    assert model.p(0.06) == pytest.approx((3 + 2 * pooled) / (4 + 2))
    pooled = (3 + 2 * 0.5) / 7  # a bin with no evidence takes the pooled rate at its own q
    assert model.p(0.5) == pytest.approx(pooled)
    assert [row["drafted"] for row in model.table()] == [4.0, 1.0]


def test_each_observation_moves_the_estimate_at_once():
    """`p` keeps the pooled counts between observations: an observation must drop them. Bin
    [0.5, 0.6) never gets evidence here, so p(0.5) is the pooled rate (w = 2)."""
    model = AcceptanceModel(half_life=float("inf"))
    for n, (q, kept) in enumerate(((0.07, True), (0.95, False), (0.33, True), (0.33, False)), 1):
        before = model.p(0.5)
        model.observe(q, kept)
        kept_so_far = sum(k for _, k in ((0.07, 1), (0.95, 0), (0.33, 1), (0.33, 0))[:n])
        assert model.p(0.5) == pytest.approx((kept_so_far + 2 * 0.5) / (n + 2)) != before


def test_old_verifications_fade():
    """half-life 1: each observation halves the weight of those before it."""
    model = AcceptanceModel(prior_weight=1.0, half_life=1.0)
    model.observe(0.45, True)
    model.observe(0.45, False)  # accepted 0.5, drafted 1.5 (the same bin, [0.4, 0.5))
    pooled = (0.5 + 0.42) / (1.5 + 1)
    assert model.p(0.42) == pytest.approx((0.5 + pooled) / (1.5 + 1))


def test_a_bin_learns_what_its_confidence_hides():
    model = AcceptanceModel()
    for _ in range(200):
        model.observe(0.9, True)  # confident tokens: all kept
        model.observe(0.04, True)  # unsure ones (q < 0.05): kept 3 times in 4 here
        model.observe(0.04, True)
        model.observe(0.04, True)
        model.observe(0.04, False)
    assert abs(model.p(0.04) - 0.75) < 0.02 and model.p(0.9) > 0.98
    fresh = AcceptanceModel()
    for _ in range(50):
        fresh.observe(0.9, True)
    assert fresh.p(0.25) > 0.9  # a bin AE never drafted from starts from what the run has seen


def test_bins_are_closed_below():
    model = AcceptanceModel()
    model.observe(0.1, True)  # on an edge: the bin [0.1, 0.2), as table() reports it
    assert [row["q"] for row in model.table()] == [[0.1, 0.2]]
    assert AcceptanceModel.bin(0.0999) < AcceptanceModel.bin(0.1) == AcceptanceModel.bin(0.1999)


def test_a_verification_teaches_its_tokens_up_to_the_first_rejection():
    from s2moe.runtime.decoding.speculative import Draft

    dec = SpeculativeDecoder(_stub(), get_method("ca+ae"), SpecSettings(draft_topk=1, draft_cap=4), UNSURE)
    d = Draft(tokens=[1, 2, 0], token_probs=[0.93, 0.45, 0.25], p_accept=[0.9, 0.5, 0.3])
    dec._learn_acceptance(d, 1)  # the first kept, the second rejected, the third never judged
    kept = {row["q"][0]: row["drafted"] for row in dec.acceptance.table()}
    assert kept == {0.9: 1.0, 0.4: 1.0}
    assert dec.acceptance.accepted.sum() == pytest.approx(dec.acceptance.decay)  # the 0.93 one, then decayed once
    m = dec.metrics
    assert (m.ae_tokens, m.ae_kept, m.ae_predicted) == (2, 1, pytest.approx(1.4))


# An unsure draft that is always right: after token 0 the draft is sure of token 1 (q = 0.9), after
# 1 and 2 it gives its pick only 0.4; the target's argmax is always the draft's. T_AR / C_draft = 2
# and no expert costs, so U = prefix p × 2: with p = q the 0.4 tokens never pay (0.8 < 1); with
# what verification shows (every token kept) they do.
NEXT = {0: 1, 1: 2, 2: 0, START: 0}


def _dist(top: float, last: int) -> np.ndarray:
    d = np.full(4, (1 - top) / 3)
    d[NEXT[last]] = top
    return d


def _stub() -> StubModel:
    return StubModel(lambda ctx: _dist(0.7, ctx[-1]),
                     lambda ctx: _dist(0.9 if ctx[-1] == 0 else 0.4, ctx[-1]), vocab=4)


UNSURE = CostConstants(t_ar=0.004, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0)


@pytest.mark.parametrize("method", ["ca+ae", "s2moe"])
def test_learned_acceptance_drafts_what_confidence_declines(method):
    runs = {}
    for rule in ("confidence", "learned"):
        dec = SpeculativeDecoder(_stub(), get_method(method), SpecSettings(draft_topk=1, draft_cap=4, acceptance=rule),
                                 UNSURE)
        res = dec.generate([START], 40)
        runs[rule] = (res.tokens, res.stats())
    ar = generate_ar(_stub(), [START], 40).tokens
    (conf_tokens, conf), (learned_tokens, learned) = runs["confidence"], runs["learned"]
    assert conf_tokens == learned_tokens == ar  # only what is drafted changes, not the text
    # confidence drafts only after token 0 (one token, then a 0.4 one it refuses): at most 2 per step
    assert conf["acceptance_length"] < 2.1 and learned["acceptance_length"] > 3.0, (conf, learned)
    # the draft said 0.9 or 0.4 and verification kept everything: confidence is miscalibrated, the
    # learned estimate converges on the truth (the first verifications start from q)
    assert conf["ae_acceptance"]["observed"] == 1.0 and conf["ae_acceptance"]["predicted"] < 0.95
    assert learned["ae_acceptance"]["observed"] == 1.0 and learned["ae_acceptance"]["predicted"] > 0.9


def test_ae_that_learned_never_kept_still_drafts_what_the_paper_would():
    """A decoder whose model says nothing is ever kept (a past workload, another request) would draft
    nothing and so never learn otherwise: p_i never goes below q, so q = 0.9 (U = 1.08 here, and all
    kept) drafts, and the model relearns."""
    sure = StubModel(lambda ctx: _dist(0.7, ctx[-1]), lambda ctx: _dist(0.9, ctx[-1]), vocab=4)
    dec = SpeculativeDecoder(sure, get_method("ca+ae"), SpecSettings(draft_topk=1, draft_cap=4),
                             CostConstants(t_ar=0.0024, c_draft=0.002, t_exp_miss=0.0, t_exp_hit=0.0))  # q=0.9: U 1.08
    for _ in range(2000):
        dec.acceptance.observe(0.95, False)
    res = dec.generate([START], 300)
    assert res.metrics.drafted > 100 and res.metrics.accepted == res.metrics.drafted, res.stats()
    assert res.tokens == generate_ar(sure, [START], 300).tokens
    before = 0.0  # what 2,000 rejections left (about 370 after the decay): p(0.95) ≈ 3e-5
    assert dec.acceptance.p(0.95) > before + 0.2  # relearning: the new evidence outweighs the old


def test_bench_reports_each_rules_calibration():
    """Utility threshold 0: AE admits every token whatever the constants, so both rules verify the
    same drafts (no timing in it); confidence predicts the draft's mean q, learned what is kept."""
    import json

    out = {}
    for rule in ("confidence", "learned"):
        code, stdout, err = s2moe("bench", "--methods", "ca+ae", "--n-prompts", "2", "--max-tokens", "32",
                                  "-w", "humaneval", "--utility-threshold", "0", "--acceptance", rule, "--no-rate-guard",
                                  "--json", "-")  # (the guard follows the clock: its AR steps would differ)
        assert code == 0, err
        rec = json.loads(stdout)["records"][-1]
        assert rec["params"]["acceptance"] == rule
        out[rule] = rec["extra"]["ae_acceptance"]
    assert out["confidence"]["tokens"] == out["learned"]["tokens"] > 50
    assert out["confidence"]["observed"] == out["learned"]["observed"]  # the same drafts, kept alike
    assert out["confidence"]["observed"] - out["confidence"]["predicted"] > 0.2, out  # q understates it
    assert abs(out["learned"]["observed"] - out["learned"]["predicted"]) < 0.1, out


def test_only_ae_keeps_an_acceptance_model():
    for name, has in (("ca", False), ("confidence", False), ("cascade", False), ("ca+ae", True), ("s2moe", True)):
        dec = SpeculativeDecoder(_stub(), get_method(name), SpecSettings(draft_topk=1, draft_cap=4), UNSURE)
        assert (dec.acceptance is not None) == has, name
        assert ("ae_acceptance" in dec.generate([START], 12).stats()) == has, name


def test_acceptance_flag_is_checked():
    code, _, err = s2moe("run", "-p", "x", "-n", "2", "--acceptance", "always")
    one_line_error(code, err, "--acceptance", "learned or confidence")
