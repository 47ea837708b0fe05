"""Draft admit rules computed by hand on a stub model: AE's utility U_i = p_i·T_AR / (ΔC_ver(i|S) +
C_draft) with the prefix probability p_i and the experts S already selected, AE's backoff after a
draft that admits nothing, and the confidence rule."""

from __future__ import annotations

import numpy as np
import pytest

from stub_model import START, StubModel

from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder


def _chain(top_prob: float):
    """Greedy drafts 0 → 1 → 2 → 0 …, each with probability ``top_prob`` (the target agrees)."""
    def dist(ctx):
        p = np.full(4, (1 - top_prob) / 2)
        p[3] = 0.0
        p[(ctx[-1] + 1) % 3 if ctx[-1] != START else 0] = top_prob
        return p
    return dist


def _experts(token: int) -> set[int]:
    return {token % 4, (token + 1) % 4}  # token 0 → {0, 1}, 1 → {1, 2}, 2 → {2, 3}


def _first_draft_length(method: str, costs: CostConstants, cap: int = 4, top_prob: float = 0.8, **settings) -> int:
    """The first iteration's draft length; AE under the paper's rule (lookahead 1) unless given."""
    settings.setdefault("ae_lookahead", 1)
    model = StubModel(_chain(top_prob), _chain(top_prob), vocab=4, experts_of=_experts)
    dec = SpeculativeDecoder(model, get_method(method, reuse_gating=False),
                             SpecSettings(draft_topk=1, draft_cap=cap, **settings), costs)
    lengths = []
    chain = dec._draft_chain

    def spy(*args, **kwargs):
        d = chain(*args, **kwargs)
        lengths.append(len(d.tokens))
        return d

    dec._draft_chain = spy
    dec.generate([START], 3)
    return lengths[0]


# Root 0 (experts {0, 1} start S); drafts 1, 2, 0, 1 with prefix probabilities .8, .64, .512, .4096
# and new experts {2}, {3}, {}, {} (every expert missing: each costs t_exp_miss).
@pytest.mark.parametrize("miss,expected", [
    # U = .8/.75 = 1.07 ✓, .64/.75 = 0.85 ✗
    (0.5, 1),
    # U = .8/.55 = 1.45, .64/.55 = 1.16, .512/.25 = 2.05, .4096/.25 = 1.64: the cap
    (0.3, 4),
    # U = .8/1.25 = 0.64 ✗ at once
    (1.0, 0),
])
def test_ae_utility_by_hand(miss, expected):
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=miss, t_exp_hit=miss)
    assert _first_draft_length("ca+ae", costs) == expected


@pytest.mark.parametrize("lookahead,expected", [(1, 0), (2, 0), (3, 4)])
def test_ae_lookahead_by_hand(lookahead, expected):
    """Miss 0.6: gains P_j·T_AR − (ΔC_ver + C_draft) are .8 − .85 = −.05, .64 − .85 = −.21, .512 − .25
    = +.262, .4096 − .25 = +.16; summed −.05, −.26, +.002, +.162. The paper's rule (lookahead 1)
    stops at the first token; lookahead 2 stops two tokens past the best prefix (the empty one);
    lookahead 3 reaches the third token, where the sum turns positive, and the cap."""
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=0.6, t_exp_hit=0.6)
    assert _first_draft_length("ca+ae", costs, ae_lookahead=lookahead) == expected


def test_ae_lookahead_verifies_the_prefix_of_largest_summed_gain():
    """Miss 0.5 (gains +.05, −.11, +.262, +.16; summed .05, −.06, .202, .362) with cap 2: lookahead 2
    drafts both tokens, and the sum peaks at the first, so only that one is verified."""
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=0.5, t_exp_hit=0.5)
    assert _first_draft_length("ca+ae", costs, cap=2, ae_lookahead=2) == 1
    assert _first_draft_length("ca+ae", costs, cap=3, ae_lookahead=2) == 3


def test_ae_lookahead_stops_where_no_later_token_can_climb_back():
    """Miss 2: the first token's gain is .8 − 2.25 = −1.45. No later token gains more than
    P_1·T_AR − C_draft = .55 (P only falls, ΔC_ver ≥ 0), so with lookahead 2 the one token left
    cannot climb back to 0: drafting stops after the root pass and the first token's, 2 passes, not 3.
    With lookahead 4 the three tokens left could (3 × .55 > 1.45): the second token is drafted."""
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=2.0, t_exp_hit=2.0)
    passes = {}
    for lookahead in (2, 4):
        model = StubModel(_chain(0.8), _chain(0.8), vocab=4, experts_of=_experts)
        dec = SpeculativeDecoder(model, get_method("ca+ae"), SpecSettings(draft_topk=1, draft_cap=8,
                                                                          ae_lookahead=lookahead), costs)
        dec.generate([START], 3)
        passes[lookahead] = dec.metrics.draft_samples[0][0]
    assert passes[2] == 2 and passes[4] >= 3, passes


def test_ae_lookahead_bound_counts_only_the_tokens_the_draft_cap_leaves():
    """As above with lookahead 4, but a cap of 2: one token is left, not three, and .55 < 1.45, so
    drafting stops after 2 passes as with lookahead 2 (the third would draft a token that is dropped)."""
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=2.0, t_exp_hit=2.0)
    model = StubModel(_chain(0.8), _chain(0.8), vocab=4, experts_of=_experts)
    dec = SpeculativeDecoder(model, get_method("ca+ae"), SpecSettings(draft_topk=1, draft_cap=2, ae_lookahead=4),
                             costs)
    dec.generate([START], 3)
    assert dec.metrics.draft_samples[0][0] == 2, dec.metrics.draft_samples[0]


def test_ae_prefix_probability_and_threshold():
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=0.0, t_exp_hit=0.0)  # ΔC_ver = 0
    # U_i = prefix / 0.25 with prefix .8, .64, .512, .4096, .328, .262, .210 …
    assert _first_draft_length("ca+ae", costs, cap=8, utility_threshold=2.0) == 3  # prefix ≥ .5
    assert _first_draft_length("ca+ae", costs, cap=8, utility_threshold=1.5) == 4  # prefix ≥ .375
    assert _first_draft_length("ca+ae", costs, cap=8, utility_threshold=1.0) == 6  # prefix ≥ .25


def test_confidence_rule_by_hand():
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=0.0, t_exp_hit=0.0)
    # the rule looks at each token's own draft probability, not the prefix
    assert _first_draft_length("confidence", costs, cap=5, top_prob=0.8, confidence_threshold=0.79) == 5
    assert _first_draft_length("confidence", costs, cap=5, top_prob=0.8, confidence_threshold=0.81) == 0


def test_ae_backs_off_after_drafts_that_admit_nothing():
    """No draft token pays for itself: AE drafts (root pass only), then runs 1, 2, 4, 8 … (≤ 16)
    plain AR steps before drafting again. 19 decode tokens: D B D BB D BBBB D B×8."""
    costs = CostConstants(t_ar=1.0, c_draft=10.0, t_exp_miss=0.0, t_exp_hit=0.0)
    model = StubModel(_chain(0.8), _chain(0.8), vocab=4, experts_of=_experts)
    dec = SpeculativeDecoder(model, get_method("ca+ae"), SpecSettings(draft_topk=1, draft_cap=4), costs)
    tokens = dec.generate([START], 20).tokens
    m = dec.metrics
    assert len(tokens) == 20
    assert (m.empty_drafts, m.backoff_steps, m.draft_passes, m.drafted) == (4, 15, 4, 0)
    off = SpeculativeDecoder(model, get_method("ca+ae"), SpecSettings(draft_topk=1, draft_cap=4, backoff=False), costs)
    off.generate([START], 20)
    assert (off.metrics.empty_drafts, off.metrics.backoff_steps) == (19, 0)
    # the waits double up to 16, not further: 52 decode tokens are D B D B2 D B4 D B8 D B16 D B16 (cut)
    long = SpeculativeDecoder(model, get_method("ca+ae"), SpecSettings(draft_topk=1, draft_cap=4), costs)
    assert len(long.generate([START], 53).tokens) == 53
    assert (long.metrics.empty_drafts, long.metrics.backoff_steps) == (6, 46)


def test_ae_skips_the_draft_pass_of_a_token_that_cannot_pay_even_for_free():
    """U_i ≤ p_i·T_AR / C_draft whatever ΔC_ver is: once the prefix probability times the token's
    own falls below θ·C_draft / T_AR, drafting stops before that token's pass. Threshold 2, ΔC_ver
    0: tokens 1-3 are admitted (prefix .8, .64, .512) and the fourth (.41 · 4 < 2) is refused
    unrun, so the phase is the root pass plus three, not four."""
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=0.0, t_exp_hit=0.0)
    model = StubModel(_chain(0.8), _chain(0.8), vocab=4, experts_of=_experts)
    dec = SpeculativeDecoder(model, get_method("ca+ae"), SpecSettings(draft_topk=1, draft_cap=8, utility_threshold=2.0),
                             costs)
    dec.generate([START], 5)
    assert dec.metrics.draft_samples[0][0] == 4


def test_confidence_rule_admits_a_token_exactly_at_the_threshold():
    """The rule keeps q ≥ θ, the set sampled verification restricts the draft's law to: a token
    whose probability is θ to the last bit is drafted, one a bit above it is not."""
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=0.0, t_exp_hit=0.0)
    model = StubModel(_chain(0.8), _chain(0.8), vocab=4, experts_of=_experts)
    dec = SpeculativeDecoder(model, get_method("confidence"), SpecSettings(draft_topk=1, draft_cap=1), costs)
    seen, pick = [], dec.pick
    dec.pick = lambda *args: seen.append(pick(*args)) or seen[-1]
    dec.generate([START], 3)
    theta = seen[0][1]  # the first draft token's probability as the rule reads it
    assert _first_draft_length("confidence", costs, cap=1, confidence_threshold=theta) == 1
    assert _first_draft_length("confidence", costs, cap=1, confidence_threshold=float(np.nextafter(theta, 1))) == 0


class _GatedRouterStub(StubModel):
    """Router logits per token (4 experts, top-2): root 0 picks {0, 1}; draft token 1 picks {2, 3},
    with expert 0 next (1.9), just under expert 3 (2.0)."""
    ROUTER = {0: [3.0, 2.0, -5, -5], 1: [1.9, -5, 3.0, 2.0], 2: [-5, -5, 3.0, 2.0], START: [3.0, 2.0, -5, -5]}

    def _record(self, tokens):
        from s2moe.runtime.model.routing import LayerRouting, RoutingRecord

        logits = np.array([self.ROUTER[t] for t in tokens], np.float32)
        top = np.argsort(-logits, -1, kind="stable")[:, :2]
        return RoutingRecord({0: LayerRouting(logits, top, np.full(top.shape, 0.5, np.float32))})


def test_ae_prices_a_draft_token_under_the_gating_verification_will_use():
    """S = {0, 1} from the root. Token 1 alone would add experts 2 and 3 (U = .8 / (2·.5 + .25) =
    0.64: refused). Reuse gating raises expert 0 by the token's top-1 − 3rd gap, to 3.0, past
    expert 3: the token adds only expert 2 (U = .8 / .75 = 1.07: admitted). s2moe prices the
    latter, ca+ae (no gating) the former."""
    costs = CostConstants(t_ar=1.0, c_draft=0.25, t_exp_miss=0.5, t_exp_hit=0.5)
    lengths = {}
    for method in ("s2moe", "ca+ae"):
        model = _GatedRouterStub(_chain(0.8), _chain(0.8), vocab=4)
        dec = SpeculativeDecoder(model, get_method(method), SpecSettings(draft_topk=1, draft_cap=1), costs)
        chain, out = dec._draft_chain, []
        dec._draft_chain = lambda *a, **k: out.append(chain(*a, **k)) or out[-1]
        dec.generate([START], 2)
        lengths[method] = len(out[0].tokens)
    assert lengths == {"s2moe": 1, "ca+ae": 0}


def test_a_token_drafted_at_exactly_the_confidence_threshold_keeps_its_law():
    """The confidence rule admits q ≥ θ, so standard verification must check an admitted token
    against q restricted to {q ≥ θ}, boundary included: a token at q = θ exactly with law 0 there
    would be accepted for sure (p / 0) and bias the output."""
    from s2moe.runtime.decoding.sampling import SamplingParams

    half = lambda ctx: np.array([0.5, 0.5, 0.0, 0.0])  # noqa: E731  (both at θ = 0.5)
    target = lambda ctx: np.array([0.2, 0.3, 0.5, 0.0])  # noqa: E731
    dec = SpeculativeDecoder(StubModel(target, half, vocab=4), get_method("confidence"),
                             SpecSettings(draft_topk=1, draft_cap=2), CostConstants(1.0, 0.001, 0.0, 0.0),
                             SamplingParams(temperature=1.0, seed=0, sampler="standard"))
    laws = []
    chain = dec._draft_chain

    def spy(*args, **kwargs):
        d = chain(*args, **kwargs)
        laws.extend(d.dists)
        return d

    dec._draft_chain = spy
    dec.generate([START], 6)
    assert laws and all(np.allclose(q, [0.5, 0.5, 0.0, 0.0]) for q in laws), laws
