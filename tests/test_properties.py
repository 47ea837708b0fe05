"""Lossless guarantees as properties over random prompts, seeds, budgets and methods."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_kv_is_fresh_prefill

from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.engine import build_engine
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder

SETTINGS = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))
prompts = st.lists(st.integers(0, 379), min_size=1, max_size=12)
budgets = st.sampled_from([None, "0.5", "0.25", "0.1"])
methods = st.sampled_from(["ca", "ca+ae", "s2moe", "es", "confidence", "cascade"])
costs = st.builds(lambda t_ar, miss: CostConstants(t_ar=t_ar, c_draft=0.002, t_exp_miss=miss, t_exp_hit=miss / 10),
                  st.sampled_from([0.01, 1.0, 100.0]), st.sampled_from([0.0, 0.001, 0.05]))


@SETTINGS
@given(prompt=prompts, budget=budgets, method=methods, cost=costs, draft_k=st.integers(1, 2),
       cap=st.integers(1, 7), family=st.sampled_from(["olmoe", "qwen3_moe", "mixtral"]))
def test_greedy_speculation_without_gating_equals_ar(tiny_model_dirs, prompt, budget, method, cost, draft_k, cap,
                                                      family):
    engine = build_engine(tiny_model_dirs[family][1], budget)
    expected = generate_ar(engine.model, prompt, 14).tokens
    dec = SpeculativeDecoder(engine.model, get_method(method, reuse_gating=False),
                             SpecSettings(draft_topk=draft_k, draft_cap=cap), cost)
    assert dec.generate(prompt, 14).tokens == expected


@SETTINGS
@given(prompt=prompts, budget=budgets, method=methods, cost=costs, n=st.integers(2, 20), seed=st.integers(0, 99),
       temperature=st.sampled_from([0.0, 1.0]))
def test_committed_kv_equals_fresh_prefill(tiny_model_dirs, prompt, budget, method, cost, n, seed, temperature):
    """After any run of draft/verify/rollback steps (greedy or sampled) the committed KV is exactly
    what a fresh target prefill of the committed text computes. Reuse-aware gating is off: it
    changes the experts verification uses, so with it the KV is the gated target's by design."""
    from s2moe.runtime.decoding.sampling import SamplingParams

    engine = build_engine(tiny_model_dirs["olmoe"][1], budget)
    dec = SpeculativeDecoder(engine.model, get_method(method, reuse_gating=False),
                             SpecSettings(draft_topk=1, draft_cap=5), cost, SamplingParams(temperature=temperature, seed=seed))
    tokens = dec.generate(prompt, n).tokens
    assert_kv_is_fresh_prefill(engine.model, dec.kv, prompt, tokens)
