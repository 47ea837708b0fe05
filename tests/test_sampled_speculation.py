"""Sampled speculative decoding reproduces the target distribution exactly (and seeds are honoured).

Both samplers of `sampling.py` are tested: standard (accept with min(1, p/q), resample from
max(p − q, 0)) and coupled (per-position Gumbel noise; a draft token is accepted iff it is the target's
own draw). The coupled one promises more, and is tested for it: its text is AR's text for the seed,
whatever was drafted (different cost constants, draft lengths, trees).

`SpeculativeDecoder` runs for real (drafting, `_verify`, `_accept_chain`, KV rollback and commit)
against `stub_model.StubModel`, whose target and draft next-token laws are known tables that differ
by a total variation of 0.3–0.4 in every context. The empirical joint law of the first tokens of
many seeded generations is compared with the exact target law (chi-square, small cells pooled).

Draft lengths 1, 2 and 4 with a fixed-length chain (method ``ca``), so the first iteration's draft
positions 1..L and the bonus token (position L + 1, emitted only when every draft is accepted) are
all inside the compared window; plus temperature/top-k truncation (alone, and under the confidence
rule, which must read the truncated probability), the confidence rule, AE's
utility rule with backoff, AE with a lookahead (tokens drafted past one that does not pay, all of them
verified), and the private-draft-KV baseline (``es``). Trees (two drafted branches)
are drafted under greedy and coupled sampling only (standard sampling needs one law per token): the
``es`` case's coupled run verifies two branches, and the coupled text equals AR's text there too.

Sample counts come from a power calculation for the standard sampler (``python tools/spec_power.py`` recomputes it). For each
fixed-length case the exact law of the compared tokens is computed by enumeration for the correct
sampler and for four broken ones (accept every draft; resample from p instead of max(p − q, 0);
accept with min(1, q/p); bonus token from the draft). The power of Pearson's chi-square at the
test's false-alarm level α = 1e-4 is the noncentral chi-square tail with λ = n·Σ(p₁−p₀)²/p₀ over
the pooled cells (the test also fails on any outcome the target cannot produce). n is the smallest
round count whose power is ≥ 0.999 against every broken sampler; the weakest one per case:

  case              n    weakest mutant    TV     w²      df   power
  ca-L1             800  resample from p   0.150  0.097    7   0.99992
  ca-L2             500  resample from p   0.183  0.200   19   0.99996
  ca-L4             600  resample from p   0.257  0.235   40   0.999999
  ca-L2-T0.7-top2   300  bonus from draft  0.031  0.019    9   0.9995 (impossible outcomes)

(bonus from draft at L = 4: TV 0.071, caught through impossible outcomes with power > 0.9999.)
Against any law at all, Cauchy–Schwarz gives w² ≥ 4·TV², so n = 500 detects a pooled-law TV ≥ 0.2
with power ≥ 0.988 in the variable-length cases (confidence, AE, es), which share the acceptance
code and exist to check that their admit rules and KV paths keep the law exact. Seeds are fixed:
the outcome is deterministic. The whole file runs in about 8 s.

The confidence and AE cases found a real bias (fixed in speculative.py): a rule that drops a sampled
draft token by its own probability changes the law of the tokens it keeps, so verifying them
against the unconditioned q was not lossless (p-value 1e-31 on the AE case).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from stub_model import START, StubModel, exact_law, table_draft, table_target

from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.sampling import SAMPLERS, CoupledDraws, SamplingParams, probabilities
from s2moe.runtime.decoding.speculative import SpeculativeDecoder

ALPHA = 1e-4  # false-alarm level of one case; seeds are fixed, so the outcome is deterministic
EAGER = CostConstants(t_ar=50.0, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0002)
# AE with T_AR / C_draft = 2.5: a draft token is admitted while its prefix probability is ≥ 0.4, so
# draft lengths vary (0 included: then AE backs off to plain AR steps) from iteration to iteration.
PICKY = CostConstants(t_ar=0.005, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0002)
# AE where a miss costs 5 draft passes: a token bringing new experts often does not pay, and one after
# it that reuses them does
LOOKING = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.005, t_exp_hit=0.0)

# name: (method, draft cap, temperature, top-k, tokens compared, samples, costs, confidence threshold
#        [, further SpecSettings, and "experts_of" for the stub])
CASES = {
    "ca-L1": ("ca", 1, 1.0, 0, 3, 800, EAGER, 0.5),
    "ca-L2": ("ca", 2, 1.0, 0, 4, 500, EAGER, 0.5),
    "ca-L4": ("ca", 4, 1.0, 0, 6, 600, EAGER, 0.5),
    "ca-L2-T0.7-top2": ("ca", 2, 0.7, 2, 4, 300, EAGER, 0.5),
    "confidence-L3": ("confidence", 3, 1.0, 0, 5, 500, EAGER, 0.35),
    # the confidence rule on a truncated draft law: the rule must read the probability the token was
    # sampled with (0.675 under T 0.7 / top-2 where softmax says 0.5), or the kept tokens' law is biased
    "confidence-L3-T0.7-top2": ("confidence", 3, 0.7, 2, 5, 500, EAGER, 0.6),
    "ca+ae-L3": ("ca+ae", 3, 1.0, 0, 5, 500, PICKY, 0.5),
    # AE with a lookahead drafts past a token that does not pay and verifies every drafted token: the
    # stop depends on drafted tokens only (a stopping time). Tokens route to experts {t, t+1} (of 4),
    # so a token's ΔC_ver is 0, 1 or 2 misses and the summed gain dips and recovers. Verifying only
    # the best-gain prefix (right for greedy) drops tokens by their own experts and probability: that
    # mutant fails here with p 2e-16 and 5e-15 on seeds 0-999 and 1000-1999 (at 500 seeds, 3 of 4
    # blocks of seeds caught it), so this case draws 1000
    "ca+ae-L4-lookahead2": ("ca+ae", 4, 1.0, 0, 4, 1000, LOOKING, 0.5,
                            {"ae_lookahead": 2, "experts_of": lambda t: {t % 4, (t + 1) % 4}}),
    "es": ("es", 3, 1.0, 0, 5, 500, EAGER, 0.5),  # fixed length 8, the draft keeps its own KV
}


def truncated(table, params: SamplingParams):
    """The law the decoder samples from for a table: `probabilities` applied to the stub's logits."""
    def dist(ctx):
        with np.errstate(divide="ignore"):
            return probabilities(np.log(table(ctx)), params)
    return dist


def run_case(name: str, sampler: str = "standard", seeds=None):
    """Counts of the compared tokens over seeded generations, the exact law and the decoder's metrics."""
    method, cap, temperature, top_k, n_tokens, n, costs, threshold, *extra = CASES[name]
    extra = dict(extra[0]) if extra else {}
    model = StubModel(table_target, table_draft, vocab=4, experts_of=extra.pop("experts_of", None))
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for seed in (range(n) if seeds is None else seeds):
        params = SamplingParams(temperature=temperature, top_k=top_k, seed=seed, sampler=sampler)
        dec = SpeculativeDecoder(model, get_method(method, reuse_gating=False),
                                 SpecSettings(draft_topk=1, draft_cap=cap, confidence_threshold=threshold, **extra),
                                 costs, params)
        out = tuple(dec.generate([START], n_tokens).tokens)
        counts[out] = counts.get(out, 0) + 1
        drafted += dec.metrics.drafted
        accepted += dec.metrics.accepted
    params = SamplingParams(temperature=temperature, top_k=top_k)
    law = exact_law(truncated(table_target, params), (START,), n_tokens)
    return counts, law, drafted, accepted


def chi_square_pvalue(counts: dict, law: dict, min_expected: float = 5.0) -> float:
    """Pearson chi-square of observed outcome counts against an exact law; outcomes whose expected
    count is below ``min_expected`` are pooled into one cell so the chi-square approximation holds."""
    n = sum(counts.values())
    big = sorted(k for k, p in law.items() if p * n >= min_expected)
    small = [k for k in law if k not in big]
    f_obs = [counts.get(k, 0) for k in big]
    f_exp = [law[k] * n for k in big]
    if small:
        f_obs.append(sum(counts.get(k, 0) for k in small))
        f_exp.append(sum(law[k] for k in small) * n)
    f_exp = np.array(f_exp) * (n / sum(f_exp))  # exact up to float rounding; chisquare wants equal sums
    return float(stats.chisquare(f_obs, f_exp).pvalue)


def test_the_tables_differ_materially():
    """TV(p, q) ≥ 0.2 in every context the test reaches, after the truncations the cases apply."""
    for temperature, top_k in [(1.0, 0), (0.7, 2)]:
        params = SamplingParams(temperature=temperature, top_k=top_k)
        p, q = truncated(table_target, params), truncated(table_draft, params)
        for last in range(3):
            for parity in range(2):
                ctx = (0,) * (1 + parity) + (last,)  # a context with that last token and length parity
                assert 0.5 * np.abs(p(ctx) - q(ctx)).sum() >= 0.2, (temperature, top_k, last, parity)


@pytest.mark.parametrize("sampler", ["standard", "coupled"])
@pytest.mark.parametrize("name", list(CASES))
def test_sampled_speculation_reproduces_the_target_law(name, sampler):
    counts, law, drafted, accepted = run_case(name, sampler)
    impossible = {k: v for k, v in counts.items() if k not in law}
    assert not impossible, f"{name}: outcomes the target cannot produce: {impossible}"
    # the accept and the reject branches both ran many times (the truncated confidence case
    # accepts 9 %: its top-2 laws disagree; the others 13-90 %)
    assert accepted >= 100 and drafted - accepted >= 100, (drafted, accepted)
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue > ALPHA, f"{name}: the generated tokens do not follow the target law (p = {pvalue:.2e})"


@pytest.mark.parametrize("sampler", ["standard", "coupled"])
def test_every_draft_position_and_the_bonus_token_are_exercised(sampler):
    """With L = 4, verifications reject at each draft position 1..4 (the residual branch) and accept
    all four (the bonus token from the last verification row): the law test covers them all."""
    model = StubModel(table_target, table_draft, vocab=4)
    seen: dict[int, int] = {}
    for seed in range(200):
        dec = SpeculativeDecoder(model, get_method("ca"), SpecSettings(draft_topk=1, draft_cap=4), EAGER,
                                 SamplingParams(temperature=1.0, seed=seed, sampler=sampler))
        accept = dec._accept_chain

        def spy(*args, **kwargs):
            a, nxt = accept(*args, **kwargs)
            seen[a] = seen.get(a, 0) + 1
            return a, nxt

        dec._accept_chain = spy
        dec.generate([START], 6)
    assert set(seen) == {0, 1, 2, 3, 4} and min(seen.values()) >= 10, seen


def test_the_draft_samples_from_its_own_truncated_law():
    """Lossless for any draft law, so the law test cannot see a draft that ignores temperature and
    top-k; it would only accept less. Every drafted token's recorded law (standard sampling records
    it) must be one of the stub's draft laws after T 0.7 / top-2, hold the token, and give it the
    probability the rules read."""
    params = SamplingParams(temperature=0.7, top_k=2)
    laws = [truncated(table_draft, params)(ctx) for ctx in [(START,)] + [(0,) * (1 + parity) + (last,)
                                                                    for last in range(3) for parity in range(2)]]
    model = StubModel(table_target, table_draft, vocab=4)
    rows = []
    for seed in range(40):
        dec = SpeculativeDecoder(model, get_method("ca"), SpecSettings(draft_topk=1, draft_cap=3), EAGER,
                                 SamplingParams(temperature=0.7, top_k=2, seed=seed, sampler="standard"))
        accept = dec._accept_chain

        def spy(logits, d, *args, **kwargs):
            rows.extend(zip(d.tokens, d.dists, d.token_probs))
            return accept(logits, d, *args, **kwargs)

        dec._accept_chain = spy
        dec.generate([START], 8)
    assert len(rows) >= 100
    for token, q, prob in rows:
        assert any(np.allclose(q, law, rtol=0, atol=1e-12) for law in laws) and q[token] > 0 and prob == q[token]
    assert sum(np.count_nonzero(q) == 2 for _, q, _ in rows) >= 20  # truncation was at work


# -- seeds ----------------------------------------------------------------------------------------
def _spec_tokens(seed, method="ca+ae", sampler="auto", costs=EAGER, cap=3, n=24, **kw):
    model = StubModel(table_target, table_draft, vocab=4)
    dec = SpeculativeDecoder(model, get_method(method), SpecSettings(draft_topk=1, draft_cap=cap), costs,
                             SamplingParams(temperature=1.0, seed=seed, sampler=sampler, **kw))
    return dec.generate([START], n).tokens


def _ar_tokens(seed, sampler="auto", n=24, **kw):
    return generate_ar(StubModel(table_target, table_draft, vocab=4), [START], n,
                       SamplingParams(temperature=1.0, seed=seed, sampler=sampler, **kw)).tokens


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("generate", [_spec_tokens, _ar_tokens], ids=["speculative", "ar"])
def test_same_seed_same_tokens_different_seeds_differ(generate, sampler):
    assert generate(11, sampler=sampler) == generate(11, sampler=sampler)
    assert generate(0, sampler=sampler) == generate(0, sampler=sampler)
    outputs = {tuple(generate(seed, sampler=sampler)) for seed in range(8)}
    assert len(outputs) == 8  # 24 tokens of ~1.5 bits each: a collision would mean a seed is ignored


# name: (method, draft cap, costs, confidence threshold, sampling options)
COUPLED = {
    "ca-L1": ("ca", 1, EAGER, 0.5, {}),
    "ca-L4": ("ca", 4, EAGER, 0.5, {}),
    "ca+ae": ("ca+ae", 3, PICKY, 0.5, {}),
    "confidence": ("confidence", 3, EAGER, 0.35, {}),
    "es-tree": ("es", 3, EAGER, 0.5, {}),
    "ca-L3-T0.7-top2": ("ca", 3, EAGER, 0.5, {"temperature": 0.7, "top_k": 2}),
    "ca-L3-top-p": ("ca", 3, EAGER, 0.5, {"top_p": 0.75}),
}


@pytest.mark.parametrize("name", list(COUPLED))
def test_coupled_text_is_ar_text_for_the_seed(name):
    """Whatever was drafted, accepted or rejected (trees included), a seed gives AR's tokens."""
    method, cap, costs, threshold, opts = COUPLED[name]
    drafted = accepted = 0
    for seed in range(60):
        params = SamplingParams(**{"temperature": 1.0, **opts}, seed=seed, sampler="coupled")
        dec = SpeculativeDecoder(StubModel(table_target, table_draft, vocab=4), get_method(method, reuse_gating=False),
                                 SpecSettings(draft_topk=1, draft_cap=cap, confidence_threshold=threshold), costs, params)
        tokens = dec.generate([START], 12).tokens
        assert tokens == generate_ar(StubModel(table_target, table_draft, vocab=4), [START], 12, params).tokens, seed
        drafted, accepted = drafted + dec.metrics.drafted, accepted + dec.metrics.accepted
    assert accepted >= 30 and drafted - accepted >= 30, (drafted, accepted)  # both verdicts, many times


def test_a_seed_gives_one_text_whatever_the_draft_decisions():
    """Issue 13's stress found `s2moe serve` answering one seeded request with two texts: AE's live
    timings changed a draft decision between requests, and the standard sampler's draws moved. With a
    seed the default sampler is coupled: decoders whose cost constants make AE draft differently (and
    one that drafts nothing) give the same text, AR's."""
    cheap = CostConstants(t_ar=0.004, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0002)
    for seed in range(20):
        texts, drafts = set(), []
        for costs, cap in [(EAGER, 3), (PICKY, 3), (cheap, 2), (EAGER, 6)]:
            model = StubModel(table_target, table_draft, vocab=4)
            dec = SpeculativeDecoder(model, get_method("ca+ae", reuse_gating=False),
                                     SpecSettings(draft_topk=1, draft_cap=cap), costs,
                                     SamplingParams(temperature=1.0, seed=seed))
            texts.add(tuple(dec.generate([START], 16).tokens))
            drafts.append(dec.metrics.drafted)
        texts.add(tuple(_ar_tokens(seed, n=16)))
        assert len(texts) == 1, (seed, texts)
        assert len(set(drafts)) >= 3, drafts  # the decisions did differ


@pytest.mark.parametrize("sampler", ["standard", "coupled"])
def test_a_draft_equal_to_the_target_is_always_accepted(sampler):
    """q = p: standard accepts with min(1, p/q) = 1, coupled draws the same token from the same noise.
    A draft and a verification that read different positions' noise would reject about half."""
    drafted = 0
    for seed in range(30):
        dec = SpeculativeDecoder(StubModel(table_target, table_target, vocab=4), get_method("ca", reuse_gating=False),
                                 SpecSettings(draft_topk=1, draft_cap=3), EAGER,
                                 SamplingParams(temperature=1.0, seed=seed, sampler=sampler))
        dec.generate([START], 12)
        assert dec.metrics.accepted == dec.metrics.drafted, (seed, dec.metrics.accepted, dec.metrics.drafted)
        drafted += dec.metrics.drafted
    assert drafted >= 200


@pytest.mark.parametrize("extra", [{"top_p": 0.75}, {"min_p": 0.5}])
def test_sampled_speculation_honours_top_p_and_min_p(extra):
    """Tokens the nucleus or min-p leaves out of the target law never come out of verification,
    and the draft samples from its own law under the same truncation."""
    params = SamplingParams(temperature=1.0, **extra)
    model = StubModel(table_target, table_draft, vocab=4)
    law = exact_law(truncated(table_target, params), (START,), 4)
    draft_laws = [truncated(table_draft, params)(ctx) for ctx in [(START,)] + [(0,) * (1 + parity) + (last,)
                                                                          for last in range(3) for parity in range(2)]]
    rows = []
    for seed in range(150):
        dec = SpeculativeDecoder(model, get_method("ca", reuse_gating=False), SpecSettings(draft_topk=1, draft_cap=2),
                                 EAGER, SamplingParams(temperature=1.0, seed=seed, sampler="standard", **extra))
        accept = dec._accept_chain

        def spy(logits, d, *args, **kwargs):
            rows.extend(zip(d.tokens, d.dists))
            return accept(logits, d, *args, **kwargs)

        dec._accept_chain = spy
        out = tuple(dec.generate([START], 4).tokens)
        assert out in law, (extra, seed, out)
    assert len(law) < len(exact_law(table_target, (START,), 4))  # the truncation removes outcomes
    assert rows and all(any(np.allclose(q, d, rtol=0, atol=1e-12) for d in draft_laws) and q[t] > 0 for t, q in rows)


def test_ar_through_the_decoder_draws_what_generate_ar_draws():
    """Method ar inside the speculative loop takes the same draws from the seed as generate_ar."""
    for seed in (0, 11):
        assert _spec_tokens(seed, method="ar") == _ar_tokens(seed)


def test_a_coupled_tree_drafts_two_different_first_tokens():
    """The second branch starts from the draft's second-best noisy score: never the first branch's
    token (which a plain top-2 of the logits can be, since the noise moved the first pick)."""
    trees = 0
    for seed in range(20):
        dec = SpeculativeDecoder(StubModel(table_target, table_draft, vocab=4), get_method("es"),
                                 SpecSettings(draft_topk=1, draft_cap=3), EAGER, SamplingParams(temperature=1.0, seed=seed))
        verify = dec._verify

        def spy(root, P, branches, *args):
            nonlocal trees
            if len(branches) == 2:
                assert branches[0].tokens[0] != branches[1].tokens[0], (seed, branches)
                trees += 1
            return verify(root, P, branches, *args)

        dec._verify = spy
        dec.generate([START], 12)
    assert trees >= 40


def test_both_tree_branches_draft_at_the_texts_next_position():
    """Noise belongs to the text position, not to the branch: the second branch drafts from the same
    position as the first, so when its first token is the target's draw, its next tokens can be too."""
    dec = SpeculativeDecoder(StubModel(table_target, table_draft, vocab=4), get_method("es"),
                             SpecSettings(draft_topk=1, draft_cap=3), EAGER, SamplingParams(temperature=1.0, seed=4))
    chains, verified = [], []
    draft, verify = dec._draft_chain, dec._verify

    def draft_spy(kv, draws, base, *args, **kwargs):
        chains.append(base)
        return draft(kv, draws, base, *args, **kwargs)

    def verify_spy(root, P, branches, kv, draws, at):
        verified.append((at, chains[:]))
        chains.clear()
        return verify(root, P, branches, kv, draws, at)

    dec._draft_chain, dec._verify = draft_spy, verify_spy
    dec.generate([START], 30)
    assert sum(len(c) == 2 for _, c in verified) >= 3
    assert all(c == [at] * len(c) for at, c in verified), verified


def test_a_truncation_that_leaves_one_token_drafts_no_second_branch():
    """top-k 1: the runner-up has probability 0 and would be rejected for sure; no branch is drafted."""
    dec = SpeculativeDecoder(StubModel(table_target, table_draft, vocab=4), get_method("es"),
                             SpecSettings(draft_topk=1, draft_cap=3), EAGER,
                             SamplingParams(temperature=1.0, top_k=1, seed=2))
    widths = []
    verify = dec._verify
    dec._verify = lambda root, P, branches, *a: (widths.append(len(branches)), verify(root, P, branches, *a))[1]
    dec.generate([START], 16)
    assert widths and set(widths) == {1}


@pytest.mark.parametrize("sampler", ["standard", "coupled"])
def test_ae_under_coupled_drops_a_token_that_cannot_pay(sampler):
    """Coupled verification needs no draft law, so AE drops a refused token as greedy does (standard
    keeps it and stops, to keep its law q). With PICKY constants (T_AR / C_draft = 2.5) and no expert
    costs, U_i = prefix acceptance probability (AE's p_i) × 2.5: coupled drafts only tokens with U_i ≥ 1."""
    utilities = []
    for seed in range(40):
        dec = SpeculativeDecoder(StubModel(table_target, table_draft, vocab=4), get_method("ca+ae", reuse_gating=False),
                                 SpecSettings(draft_topk=1, draft_cap=4), PICKY,
                                 SamplingParams(temperature=1.0, seed=seed, sampler=sampler))
        verify = dec._verify

        def spy(root, P, branches, *args):
            utilities.extend(np.cumprod(branches[0].p_accept) * 2.5)  # the p_i AE used (learned)
            return verify(root, P, branches, *args)

        dec._verify = spy
        dec.generate([START], 16)
    refused = sum(u < 1 - 1e-9 for u in utilities)  # the decoder computes U in another order: rounding
    assert len(utilities) >= 100
    assert refused == 0 if sampler == "coupled" else refused >= 20, (sampler, refused, len(utilities))


def test_coupled_noise_held_stays_bounded(monkeypatch):
    """The noise of emitted positions is let go: a vocabulary-sized array per position would otherwise
    grow with the text (1.2 MB per token at a 152k vocabulary)."""
    dec = SpeculativeDecoder(StubModel(table_target, table_draft, vocab=4), get_method("es"),
                             SpecSettings(draft_topk=1, draft_cap=3), EAGER, SamplingParams(temperature=1.0, seed=1))
    dec.generate([START], 200)
    assert 0 < len(dec.draws._noise) <= 8 + 2  # es drafts 8 per branch: the positions of one iteration
    from s2moe.runtime.decoding import generate as gen

    made = []
    monkeypatch.setattr(gen, "draws_for", lambda params: made.append(CoupledDraws(params.seed)) or made[-1])
    generate_ar(StubModel(table_target, table_draft, vocab=4), [START], 200, SamplingParams(temperature=1.0, seed=1))
    assert 0 < len(made[0]._noise) <= 2
