"""S²-MoE decoding and baselines: lossless when gating is off; AE, RG and rollback pinned down."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_kv_is_fresh_prefill

from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.engine import build_engine
from s2moe.runtime.decoding.gating import ReuseGating
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.model.routing import RoutingPolicy, route, softmax
from s2moe.runtime.decoding.cost_model import marginal_verification_cost
from s2moe.runtime.decoding.speculative import SpeculativeDecoder

LOSSLESS = ["ca", "ca+ae", "s2moe", "es", "confidence", "cascade"]
# Tiny random models give near-uniform draft probabilities, so a realistic T_AR admits nothing;
# a large T_AR makes AE admit and exercises the whole verify/commit path.
EAGER = CostConstants(t_ar=50.0, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0002)
FRUGAL = CostConstants(t_ar=0.5, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0002)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 380, rng.integers(3, 12))) for _ in range(n)]


# Tiny random models' draft top-1 probabilities lie in 0.0037–0.0054 (median 0.0041): a threshold
# of 0.004 makes the confidence rule admit some tokens and stop at others (at 0.5 it drafts nothing).
SETTINGS = SpecSettings(draft_topk=1, draft_cap=5, confidence_threshold=0.004)


@pytest.mark.parametrize("family,budget", [("olmoe", None), ("olmoe", "0.25"), ("qwen3_moe", "0.5"),
                                           ("mixtral", "0.1")])
def test_greedy_methods_equal_ar(tiny_model_dirs, family, budget):
    folder = tiny_model_dirs[family][1]
    engine = build_engine(folder, budget)
    prompts = _prompts(12, seed=len(family))  # 12 × 16 tokens × 6 methods × 2 cost regimes
    expected = [generate_ar(engine.model, p, 16).tokens for p in prompts]
    for name in LOSSLESS:
        spec = get_method(name, reuse_gating=False)
        for costs in (EAGER, FRUGAL):
            dec = SpeculativeDecoder(engine.model, spec, SETTINGS, costs)
            got, drafted, accepted = [], 0, 0
            for p in prompts:
                got.append(dec.generate(p, 16).tokens)
                drafted, accepted = drafted + dec.metrics.drafted, accepted + dec.metrics.accepted
            assert got == expected, (name, costs.t_ar)
            # the comparison is not empty: every method drafted (AE under FRUGAL costs only a few
            # tokens whose experts are already selected), and drafts were accepted
            assert drafted > 0, (name, costs.t_ar)
            assert accepted > 0 or (spec.admit == "utility" and costs is FRUGAL), (name, costs.t_ar)


def test_ae_lookahead_drops_drafted_tokens_and_stays_ar(monkeypatch):
    """Greedy AE with the default lookahead drafts past tokens that do not pay and then verifies only
    the best-gain prefix: the tokens it drafted and dropped (their KV written past the committed
    cache, their experts prefetched) must leave the text AR's. The embedded model, whose drafts are
    often kept, at a miss price where drafts get cut."""
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.decoding.speculative import Draft

    engine = build_engine(DEFAULT_MODEL, "0.25")
    prompts = [[8, 1630, 12, 77, 13, 224], [611, 408, 198, 1046, 3452, 25, 198], [464, 3139, 286, 4881, 318]]
    expected = [generate_ar(engine.model, p, 32).tokens for p in prompts]
    costs = CostConstants(t_ar=1.0, c_draft=0.1, t_exp_miss=0.4, t_exp_hit=0.01)
    dropped: list[int] = []
    truncate = Draft.truncate
    monkeypatch.setattr(Draft, "truncate", lambda d, n: dropped.append(len(d.tokens) - n) or truncate(d, n))
    for name in ("ca+ae", "s2moe"):
        dropped.clear()
        dec = SpeculativeDecoder(engine.model, get_method(name, reuse_gating=False), SpecSettings(), costs)
        assert [dec.generate(p, 32).tokens for p in prompts] == expected, name
        assert sum(d > 0 for d in dropped) >= 3, (name, dropped)  # the lookahead really cut drafts


def test_no_share_kv_ablation_is_lossless(tiny_model_dirs):
    engine = build_engine(tiny_model_dirs["qwen3_moe"][1], "0.25")
    spec = get_method("ca+ae", share_kv=False)
    # the flag really changes the method both ways (lossless either way, so output cannot show it)
    assert not spec.share_kv and get_method("es", share_kv=True).share_kv and not get_method("es").share_kv
    dec = SpeculativeDecoder(engine.model, spec, SpecSettings(draft_topk=1, draft_cap=4), EAGER)
    for p in _prompts(6, seed=3):
        assert dec.generate(p, 20).tokens == generate_ar(engine.model, p, 20).tokens


@pytest.mark.parametrize("name", ["ca+ae", "es", "cascade"])
def test_committed_kv_equals_fresh_prefill(tiny_model_dirs, name):
    engine = build_engine(tiny_model_dirs["olmoe"][1], "0.5")
    dec = SpeculativeDecoder(engine.model, get_method(name), SpecSettings(draft_topk=1, draft_cap=5), EAGER)
    prompt = _prompts(1, seed=9)[0]
    tokens = dec.generate(prompt, 23).tokens
    assert_kv_is_fresh_prefill(engine.model, dec.kv, prompt, tokens)


def test_marginal_cost_counts_only_new_experts_and_resident_is_cheaper():
    costs = CostConstants(t_ar=1.0, c_draft=0.1, t_exp_miss=0.01, t_exp_hit=0.001, t_exp_inflight=0.004)
    E_i = {(0, 1), (0, 2), (1, 3)}
    S = {(0, 1)}
    missing = lambda k: "missing"  # noqa: E731
    assert marginal_verification_cost(E_i - S, missing, costs) == pytest.approx(0.02)
    held = lambda k: "held" if k == (1, 3) else "missing"  # noqa: E731
    assert marginal_verification_cost(E_i - S, held, costs) == pytest.approx(0.011)
    # a prefetch still reading it: a hit plus what verification has been waiting for such reads
    flying = lambda k: "in_flight" if k == (1, 3) else "missing"  # noqa: E731
    assert marginal_verification_cost(E_i - S, flying, costs) == pytest.approx(0.015)
    assert marginal_verification_cost(E_i - E_i, missing, costs) == 0.0


def test_utility_rule_admits_more_when_verification_is_cheap(tiny_model_dirs):
    engine = build_engine(tiny_model_dirs["olmoe"][1])
    spec = get_method("ca+ae")
    lengths = []
    for miss in (10.0, 0.0):
        costs = CostConstants(t_ar=2.0, c_draft=0.002, t_exp_miss=miss, t_exp_hit=miss)
        dec = SpeculativeDecoder(engine.model, spec, SpecSettings(draft_topk=1, draft_cap=6), costs)
        lengths.append(dec.generate([1, 2, 3], 24).stats()["mean_draft_length"])
    assert lengths[0] < lengths[1]


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_reuse_gating_no_op_cases(variant, rng):
    logits = rng.normal(size=(4, 16))
    assert ReuseGating(2, 4, variant).bias(0, logits[:1]) is None  # B = 1
    assert ReuseGating(2, 0, variant).bias(0, logits) is None  # cap 0
    assert ReuseGating(2, 4, variant, strength=0.0).bias(0, logits) is None  # λ = 0
    assert ReuseGating(2, 4, "paper", confidences=np.zeros(4)).bias(0, logits) is None  # all w = 0
    assert ReuseGating(2, 4, variant, confidences=np.ones(4)).bias(0, logits) is not None


def test_reuse_gating_bias_changes_selection_never_weights(rng):
    logits = rng.normal(size=(6, 16)).astype(np.float32)
    rg = ReuseGating(top_k=2, cap=3, strength=1000.0, confidences=rng.uniform(0.2, 1, 6))
    bias = rg.bias(0, logits)
    experts, weights = route(logits, 2, "softmax_topk", False, bias)
    preferred = set(np.nonzero(bias[0])[0])
    assert len(preferred) == 3 and set(experts.ravel()) <= preferred  # large λ: all pick from E*
    probs = softmax(logits.copy())
    np.testing.assert_allclose(weights, np.take_along_axis(probs, experts, -1), rtol=1e-6)


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_reuse_gating_bias_by_hand(variant):
    """E* = the cap experts the batch weighs most (g_e = Σ_b w_b ℓ_b,e), each token's bias on E* is
    strength × (its top-1 − its (k+1)-th logit) (paper) or the batch mean of that gap (code)."""
    logits = np.array([[3, 2, 1, 0, -1, -2],
                       [0, 3, 2, 1, -1, -2],
                       [-2, -1, 0, 1, 2, 4]], dtype=np.float64)
    conf = np.array([1.0, 0.5, 0.25])
    rg = ReuseGating(top_k=2, cap=3, variant=variant, strength=1.0, confidences=conf)
    if variant == "paper":
        # w = confidences; g = [2.5, 3.25, 2.0, 0.75, -1.0, -2.0] → E* = {0, 1, 2}
        preferred, lam = [0, 1, 2], np.array([2.0, 2.0, 3.0])  # gaps 3−1, 3−1, 4−1
    else:
        # w = (max − mean) / max_b: [2.5, 2.5, 10/3] / (10/3) = [0.75, 0.75, 1]
        # g = [0.25, 2.75, 2.25, 1.75, 0.5, 1.0] → E* = {1, 2, 3}; λ = the mean gap 7/3
        preferred, lam = [1, 2, 3], np.full(3, 7 / 3)
    expected = np.zeros_like(logits)
    expected[:, preferred] = lam[:, None]
    np.testing.assert_allclose(rg.bias(0, logits), expected, rtol=1e-12, atol=1e-12)
    # the bias pulls selection toward the batch's experts, never away from them
    biased, _ = route(logits.astype(np.float32), 2, "softmax_topk", False, rg.bias(0, logits))
    plain, _ = route(logits.astype(np.float32), 2, "softmax_topk", False, None)
    overlap = lambda e: sum(len(set(row) & set(preferred)) for row in e.tolist())  # noqa: E731
    assert overlap(biased) > overlap(plain)
    assert ReuseGating(top_k=6, cap=8, variant=variant, confidences=conf).bias(0, logits) is None  # k ≥ E


def test_reuse_gating_lowers_reuse_ratio(tiny_model_dirs):
    engine = build_engine(tiny_model_dirs["olmoe"][1])
    ratios = []
    for rg in (False, True):
        dec = SpeculativeDecoder(engine.model, get_method("s2moe", reuse_gating=rg),
                                 SpecSettings(draft_topk=1, draft_cap=6, rg_strength=1.0), EAGER)
        ratios.append(dec.generate([3, 1, 4, 1, 5], 40).stats()["reuse_ratio"])
    assert ratios[1] < ratios[0]


def test_draft_policy_uses_fewer_experts(tiny_model_dirs):
    engine = build_engine(tiny_model_dirs["olmoe"][1])
    _, rec = engine.model.forward([1, 2, 3], engine.model.new_cache(3), policy=RoutingPolicy(top_k=1))
    assert all(r.experts.shape[1] == 1 for r in rec.layers.values())


def _peaked(top: int, second: int) -> np.ndarray:
    p = np.full(4, 0.05)
    p[3] = 0.0  # START is never generated
    p[top], p[second] = 0.6, 0.3
    return p / p.sum()


def test_greedy_tree_accepts_the_second_branch_and_moves_its_kv():
    """The expert-skip baseline drafts two branches (the draft's top-1 and runner-up first token).
    On a stub where the draft's top-1 is wrong and its runner-up right after even-length contexts,
    the second branch is accepted (its KV must move into place), and output and committed KV
    still equal greedy AR's. Tiny random models almost never accept the second branch."""
    from stub_model import START, StubModel

    def target(ctx):
        last = ctx[-1] % 3
        return _peaked((last + 1) % 3, (last + 2) % 3)

    def draft(ctx):
        last = ctx[-1] % 3
        right, wrong = (last + 1) % 3, (last + 2) % 3
        return _peaked(wrong, right) if len(ctx) % 2 == 0 else _peaked(right, wrong)

    model = StubModel(target, draft, vocab=4)
    branches = []
    for prompt in ([START], [START, 1], [START, 2, 0]):
        dec = SpeculativeDecoder(model, get_method("es"), SpecSettings(draft_topk=1, draft_cap=4), EAGER)
        verify = dec._verify

        def spy(*args, **kwargs):
            accepted, nxt = verify(*args, **kwargs)
            branches.append((dec._last_branch, len(accepted)))
            return accepted, nxt

        dec._verify = spy
        # es keeps its own draft KV: whatever it treats as valid when it drafts again must hold the
        # text (after a first branch won, it holds the second branch's tokens past the root)
        draft_root, stale = dec._draft_root, []

        def check(feed, kv):
            held = kv.keys[0][0, :kv.filled, 0].astype(int).tolist()
            text = prompt + dec_out[0]
            if held != text[:kv.filled]:
                stale.append((held, text))
            return draft_root(feed, kv)

        dec._draft_root = check
        dec_out = [[]]
        tokens = dec.generate(prompt, 20, on_token=dec_out[0].append).tokens
        assert not stale, stale[:2]
        assert tokens == generate_ar(model, prompt, 20).tokens
        committed = dec.kv.keys[0][0, :dec.kv.length, 0].astype(int).tolist()
        assert committed == prompt + tokens[:-1]  # the stub's KV holds each slot's token id
    assert any(b == 1 and a >= 2 for b, a in branches), branches  # second branch, several tokens moved
    assert any(b == 0 for b, _ in branches), branches


def test_a_verification_s_reuse_ratio_and_effective_cost_count_distinct_experts():
    """Reuse ratio: distinct experts a layer loads over batch × k, averaged over layers; effective
    cost: the experts the accepted rows needed over all loaded. Counted by hand on two layers."""
    from s2moe.runtime.decoding.metrics import SpecMetrics
    from s2moe.runtime.model.routing import LayerRouting, RoutingRecord

    rec = RoutingRecord()
    ones = np.ones((3, 2), np.float32)
    rec.layers[0] = LayerRouting(np.zeros((3, 8), np.float32), np.array([[1, 2], [2, 3], [5, 6]]), ones)
    rec.layers[2] = LayerRouting(np.zeros((3, 8), np.float32), np.array([[4, 4], [4, -1], [7, 4]]), ones)
    m = SpecMetrics()
    m.record_verification(rec, 3, [0, 1], drafted=2, accepted=1, top_k=2)
    # layer 0: {1, 2, 3, 5, 6} = 5 of 6; layer 2: {4, -1, 7} = 3 of 6 (a dropped choice counts as one)
    assert m.reuse_ratios == [pytest.approx((5 / 6 + 3 / 6) / 2)]
    # accepted rows 0, 1: layer 0 needs {1, 2, 3}, layer 2 {4, -1}: 5 of the 8 loaded
    assert m.effective_costs == [pytest.approx(5 / 8)]
    assert (m.verifications, m.drafted, m.accepted) == (1, 2, 1)
