"""Lossless guarantees as properties over random prompts, seeds, budgets and draft settings, for every
speculative method.

Each method is its own test (so every method is exercised, whatever Hypothesis draws), and each test
checks afterwards that the property was not vacuous: most examples drafted tokens, and the examples
covered every draft top-k and draft cap (explicit examples guarantee the cover; Hypothesis adds
random ones). Hypothesis runs derandomised without a database: the same examples on every machine
and every run.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import assert_kv_is_fresh_prefill

from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.sampling import SamplingParams
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine

METHODS = ["ca", "ca+ae", "s2moe", "es", "confidence", "cascade"]
DRAFT_K, CAPS = (1, 2), tuple(range(1, 8))


def _settings(n: int):
    return settings(max_examples=n, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


prompts = st.lists(st.integers(0, 379), min_size=1, max_size=12)
budgets = st.sampled_from([None, "0.5", "0.25", "0.1"])
costs = st.builds(lambda t_ar, miss: CostConstants(t_ar=t_ar, c_draft=0.002, t_exp_miss=miss, t_exp_hit=miss / 10),
                  st.sampled_from([0.01, 1.0, 100.0]), st.sampled_from([0.0, 0.001, 0.05]))
# tiny random models' draft top-1 probabilities lie in 0.0037–0.0054: these thresholds admit all,
# about half, and a few of the confidence rule's tokens
thresholds = st.sampled_from([0.0, 0.004, 0.0045])
FAMILIES = ["olmoe", "qwen3_moe", "mixtral"]
EAGER = CostConstants(t_ar=100.0, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0001)


def with_cover(prop):
    """Explicit examples: every draft cap once, both draft top-k, the three families."""
    for i, cap in enumerate(CAPS):
        prop = example(prompt=[5 + i, 17, 42][: 1 + i % 3], budget=[None, "0.25"][i % 2], cost=EAGER,
                       draft_k=DRAFT_K[i % 2], cap=cap, family=FAMILIES[i % 3], threshold=0.004)(prop)
    return prop


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_without_gating_equals_ar(tiny_model_dirs, method):
    seen = []

    @_settings(20)
    @given(prompt=prompts, budget=budgets, cost=costs, draft_k=st.sampled_from(DRAFT_K), cap=st.sampled_from(CAPS),
           family=st.sampled_from(FAMILIES), threshold=thresholds)
    @with_cover
    def prop(prompt, budget, cost, draft_k, cap, family, threshold):
        engine = build_engine(tiny_model_dirs[family][1], budget)
        expected = generate_ar(engine.model, prompt, 14).tokens
        dec = SpeculativeDecoder(engine.model, get_method(method, reuse_gating=False),
                                 SpecSettings(draft_topk=draft_k, draft_cap=cap, confidence_threshold=threshold), cost)
        assert dec.generate(prompt, 14).tokens == expected
        seen.append((draft_k, cap, dec.metrics.drafted))

    prop()
    assert {k for k, _, _ in seen} == set(DRAFT_K) and {c for _, c, _ in seen} == set(CAPS), seen
    drafting = sum(1 for *_, d in seen if d > 0)
    assert drafting >= len(seen) // 2, f"{method} drafted in only {drafting} of {len(seen)} examples"


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampled_speculation_without_gating_equals_seeded_ar(tiny_model_dirs, method):
    """The coupled sampler (the default with a seed) makes sampled speculation as lossless as greedy:
    the text is AR's text for the seed, under budgets, caps, cost constants and truncations."""
    seen = []

    @_settings(8)
    @given(prompt=prompts, budget=budgets, cost=costs, seed=st.integers(0, 2 ** 32), cap=st.sampled_from(CAPS),
           family=st.sampled_from(FAMILIES), threshold=thresholds,
           truncation=st.sampled_from([{}, {"top_k": 40}, {"top_p": 0.9, "temperature": 0.7}, {"temperature": 0.1}]))
    @example(prompt=[5, 17], budget="0.25", cost=EAGER, seed=1, cap=4, family="qwen3_moe", threshold=0.0,
             truncation={})
    # the tiny models' laws are flat: at T 1 a draft this close to its target is rarely refused; at T 0.1,
    # under a budget (a resident-only draft), often
    @example(prompt=[7, 3, 11], budget="0.25", cost=EAGER, seed=2, cap=6, family="olmoe", threshold=0.0,
             truncation={"temperature": 0.1})
    def prop(prompt, budget, cost, seed, cap, family, threshold, truncation):
        engine = build_engine(tiny_model_dirs[family][1], budget)
        params = SamplingParams(**{"temperature": 1.0, **truncation}, seed=seed)
        expected = generate_ar(engine.model, prompt, 14, params).tokens
        dec = SpeculativeDecoder(engine.model, get_method(method, reuse_gating=False),
                                 SpecSettings(draft_topk=1, draft_cap=cap, confidence_threshold=threshold), cost, params)
        assert dec.generate(prompt, 14).tokens == expected
        seen.append((dec.metrics.drafted, dec.metrics.accepted))

    prop()
    drafted, accepted = sum(d for d, _ in seen), sum(a for _, a in seen)
    assert accepted > 0 and drafted > accepted, f"{method}: both verdicts must occur: {seen}"


@pytest.mark.parametrize("method", METHODS)
def test_committed_kv_equals_fresh_prefill(tiny_model_dirs, method):
    """After any run of draft/verify/rollback steps (greedy or sampled) the committed KV is exactly
    what a fresh target prefill of the committed text computes. Reuse-aware gating is off: it
    changes the experts verification uses, so with it the KV is the gated target's by design."""
    seen = []

    @_settings(10)
    @given(prompt=prompts, budget=budgets, cost=costs, n=st.integers(2, 20), seed=st.integers(0, 99),
           temperature=st.sampled_from([0.0, 1.0]), cap=st.sampled_from(CAPS), threshold=thresholds)
    def prop(prompt, budget, cost, n, seed, temperature, cap, threshold):
        engine = build_engine(tiny_model_dirs["olmoe"][1], budget)
        dec = SpeculativeDecoder(engine.model, get_method(method, reuse_gating=False),
                                 SpecSettings(draft_topk=1, draft_cap=cap, confidence_threshold=threshold), cost,
                                 SamplingParams(temperature=temperature, seed=seed))
        tokens = dec.generate(prompt, n).tokens
        assert_kv_is_fresh_prefill(engine.model, dec.kv, prompt, tokens)
        seen.append((temperature, dec.metrics.accepted))

    prop()
    assert {t for t, _ in seen} == {0.0, 1.0}
    assert any(a > 0 for _, a in seen), f"{method}: no draft accepted in any example: rollback never tested"
