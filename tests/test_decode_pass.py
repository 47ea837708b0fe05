"""A decode token's whole pass in one C call (model/forward.py `_one_call`, csrc/cpu/pass.c). It must
give the step-by-step path's bits and bookkeeping, stop before a layer it cannot finish (a choice
not resident, a NaN score) and let that path go on from there, and refuse bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.engine import build_engine, phase_of
from s2moe.runtime.model.routing import RoutingPolicy


def _counting(model):
    """Wrap the model's `decode_pass`: per decode pass, the layers each of its calls reached (a call
    stops before a layer it cannot finish; after that layer, step by step, the next call goes on)."""
    passes, real, n = [], model.ops.decode_pass, model.config.num_layers

    def counted(c, h, layers, *a, **k):
        done = real(c, h, layers, *a, **k)
        first = n - len(layers)
        if first == 0:
            passes.append([])
        passes[-1].append(first + done)
        return done

    model.ops.decode_pass = counted
    return passes


def _preload(model) -> None:
    c = model.config
    model.experts.preload([(L, e) for L in range(c.num_layers) for e in range(c.num_experts)])


def _run(one_call: bool, budget: str | None, fallback: str = "best", nan_layer: int | None = None,
         cache_type: str = "auto"):
    """48 decode passes, target and resident-only draft taking turns, some kept and some rolled back:
    the logits, the routing, the KV cache (``cache_type``; runs default to f16) and the cache's counts
    (everything but time)."""
    model = build_engine(str(DEFAULT_MODEL), budget=budget, cache_type=cache_type).model
    if budget == "1.0":
        _preload(model)
    if not one_call:
        model.one_call = False  # the step-by-step path, one C call per layer
    if nan_layer is not None:  # a NaN router row: every token's scores in that layer hold a NaN
        name = f"layers.{nan_layer}.router"
        W = model.W[name].copy(order="F")  # (the loaded weights are not touched)
        W[3] = np.nan
        model.W = {**model.W, name: W}
    done = _counting(model)
    cache, E = model.experts, model.config.num_experts
    draft = RoutingPolicy(top_k=2, allowed=lambda L: cache.resident_mask(L, E), fallback=fallback)
    kv = model.new_cache(256)
    model.forward(list(range(100, 140)), kv, logits="last")
    kv.commit(40)
    rng, seen = np.random.default_rng(7), []
    for i in range(48):
        policy = draft if i % 2 else None
        with phase_of(model, "draft" if policy else "ar"):
            logits, rec = model.forward([int(rng.integers(model.config.vocab_size))], kv,
                                        **({"policy": policy} if policy else {}))
        seen.append((logits, [(r.logits, r.experts, r.weights) for _, r in sorted(rec.layers.items())]))
        kv.commit(kv.filled) if i % 3 == 0 else kv.rollback(kv.length)
    counts = {phase: {k: v for k, v in s.items() if k not in ("fetch_seconds", "bandwidth_mb_s")}
              for phase, s in cache.report()["phases"].items()}
    kv_state = [(k[:, :kv.length].copy(), v[:, :kv.length].copy()) for k, v in zip(kv.keys, kv.values)]
    return seen, counts, kv_state, done


def _same(a, b, where):
    seen_a, counts_a, kv_a, _ = a
    seen_b, counts_b, kv_b, _ = b
    for i, ((lg_a, rec_a), (lg_b, rec_b)) in enumerate(zip(seen_a, seen_b)):
        assert np.array_equal(lg_a, lg_b, equal_nan=True) and lg_a.dtype == lg_b.dtype, (where, i)
        assert len(rec_a) == len(rec_b), (where, i)
        for x, y in zip(rec_a, rec_b):
            assert all(np.array_equal(p, q, equal_nan=True) and p.dtype == q.dtype and p.shape == q.shape
                       for p, q in zip(x, y)), (where, i)
    assert counts_a == counts_b, where
    assert all(np.array_equal(p, q, equal_nan=True) for pair_a, pair_b in zip(kv_a, kv_b) for p, q in zip(pair_a, pair_b)), where


@pytest.mark.parametrize("budget,fallback", [(None, "best"), ("1.0", "best"), ("0.25", "best"), ("0.1", "skip")])
def test_the_one_call_pass_gives_the_step_by_step_bits_kv_and_bookkeeping(budget, fallback):
    one, plain = _run(True, budget, fallback), _run(False, budget, fallback)
    _same(one, plain, (budget, fallback))
    layers = 4
    done = one[3]
    assert len(done) == 48 and not plain[3]  # every decode pass took the one call; the other path none
    whole = [reached == [layers] for reached in done]
    if budget == "1.0":  # every expert preloaded: every pass finishes in one call
        assert all(whole)
    else:  # a layer with an expert to read goes step by step, and the call goes on after it
        if budget:
            assert all(whole[1::2]), "a resident-only draft pass must finish in one call"
        assert not all(whole) and one[1]["ar"]["misses"] > 0
        for reached in done:  # each call starts after the layer the one before stopped at (or at the last)
            assert reached[-1] >= layers - 1 and all(a < b for a, b in zip(reached, reached[1:])), reached
        assert any(len(reached) >= 2 for reached in done), "no pass went back to the call after a streamed layer"


def test_a_nan_score_stops_the_call_before_its_layer_and_the_step_path_decides():
    one, plain = _run(True, "0.25", nan_layer=2), _run(False, "0.25", nan_layer=2)
    _same(one, plain, "nan")
    assert len(one[3]) == 48 and all(2 in reached for reached in one[3]), "every call must stop before the NaN layer"
    assert all(reached[-1] > 2 for reached in one[3]), "and the next call go on after it"


def test_passes_the_one_call_does_not_take_go_step_by_step():
    model = build_engine(str(DEFAULT_MODEL), budget="0.25").model
    done = _counting(model)
    kv = model.new_cache(64)
    model.forward(list(range(5, 9)), kv, logits="last")  # a chain of 4: not a decode token
    mixed = RoutingPolicy(top_k=2, layer_top_k={1: 1})  # per-layer k: the call takes one k
    model.forward([3], kv, policy=mixed, logits="last")
    assert not done
    model.forward([3], kv, logits="last")
    assert len(done) == 1 and done[0][-1] >= model.config.num_layers - 1


def test_the_router_kernel_is_the_product_in_a_fixed_order():
    from s2moe import _cpu

    rng = np.random.default_rng(2)
    for E, H in ((32, 256), (7, 33), (64, 1024)):
        W = np.asfortranarray(rng.standard_normal((E, H)).astype(np.float32))  # kept input-major, as loaded
        x, bias = rng.standard_normal((1, H)).astype(np.float32), rng.standard_normal(E).astype(np.float32)
        y = np.empty((1, E), np.float32)
        _cpu.router(W.T, x, bias, y)
        want = (x.astype(np.float64) @ W.T.astype(np.float64)) + bias
        assert np.allclose(y, want, rtol=1e-5, atol=1e-4)
        ref = np.zeros(E, np.float32)  # the order it promises: x[0]'s products, then x[1]'s, …
        for h in range(H):
            ref += x[0, h] * W[:, h]
        assert np.array_equal(y[0], ref + bias)
    with pytest.raises(ValueError):
        _cpu.router(W.T, x[:, :-1], None, y)  # x of another length
    with pytest.raises(ValueError):
        _cpu.router(W.T, x, np.zeros(E + 1, np.float32), y)


def test_bad_arguments_are_refused_not_read():
    from s2moe import _cpu

    model = build_engine(str(DEFAULT_MODEL), budget="1.0").model
    _preload(model)
    c = model.config
    assert model._one_call_applies(RoutingPolicy(), model.new_cache(8), None)
    fixed = model._pass_layers
    kv = model.new_cache(8)
    E, n, k = c.num_experts, c.num_layers, c.top_k
    table = model.experts.resident_table(0, E, model.ops.expert_args)
    assert None not in table
    cos, sin = model._rope(np.array([0]))
    vis = np.ones((1, 1), bool)

    def call(layers=None, h=None, scores=None, experts=None, vis_=vis, start=0, k_=k):
        layers = layers if layers is not None else [f + (kv.keys[L], kv.values[L], table, None)
                                                    for L, f in enumerate(fixed)]
        return _cpu.decode_pass(
            h if h is not None else np.zeros((1, c.hidden_size), np.float32), layers, np.ascontiguousarray(cos),
            np.ascontiguousarray(sin), vis_, start, c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim,
            c.attn_scale, False, k_, 0, bool(c.norm_topk_prob), 1.0, True, 0, 1.0, 7.0, model.W["norm"],
            model.W["lm_head"].data, model.W["lm_head"].type_id, np.empty((1, c.vocab_size), np.float32),
            scores if scores is not None else np.empty((n, E), np.float32),
            experts if experts is not None else np.empty((n, k), np.int64), np.empty((n, k), np.float32))

    assert call() == n  # the arguments as built: a whole pass
    bad = [
        dict(layers=[fixed[0]] * n),  # tuples without the cache, table and mask
        dict(layers=[f + (kv.keys[L], kv.values[L], table[:-1], None) for L, f in enumerate(fixed)]),
        dict(layers=[f + (kv.keys[L], kv.values[L], table, np.ones(E - 1, bool)) for L, f in enumerate(fixed)]),
        dict(h=np.zeros((1, c.hidden_size - 1), np.float32)),
        dict(scores=np.empty((n, k - 1), np.float32)),
        dict(experts=np.empty((n, k), np.int32)),
        dict(vis_=np.ones((1, 2), bool)),
        dict(start=8, vis_=np.ones((1, 9), bool)),  # past the cache's capacity
        dict(k_=0),
        dict(layers=[]),
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            call(**kwargs)
    with pytest.raises(ValueError):  # a chosen entry that is not an expert's tuple
        call(layers=[f + (kv.keys[L], kv.values[L], [("not", "an", "expert")] * E, None) for L, f in enumerate(fixed)])


def test_speculative_decoding_gives_the_same_tokens_with_and_without_the_one_call():
    from s2moe.runtime.decoding.cost_model import CostConstants
    from s2moe.runtime.decoding.generate import generate_ar
    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder

    eager = CostConstants(t_ar=50.0, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0002)
    prompt = [5, 17, 99, 3, 250, 1024]
    results = []
    for one_call in (True, False):
        model = build_engine(str(DEFAULT_MODEL), "0.25").model
        if not one_call:
            model.one_call = False
        done = _counting(model)
        ar = generate_ar(model, prompt, 48).tokens
        dec = SpeculativeDecoder(model, get_method("s2moe", reuse_gating=False), SpecSettings(), eager)
        got = dec.generate(prompt, 48)
        assert got.tokens == ar and got.metrics.accepted > 0
        assert bool(done) == one_call
        results.append((ar, got.tokens, got.metrics.draft_passes, got.metrics.accepted))
    assert results[0] == results[1]


def test_new_weights_rebuild_the_calls_arguments():
    """The call's per-layer arguments are kept per model; weights swapped after a pass (as the NaN
    test and tools swap a router) must not leave the call on the old ones."""
    model = build_engine(str(DEFAULT_MODEL), budget="1.0").model
    _preload(model)
    done = _counting(model)
    kv = model.new_cache(64)
    model.forward(list(range(5, 9)), kv, logits="last")
    kv.commit(4)
    before = model.forward([3], kv, logits="last")[0]  # builds the call's arguments
    kv.rollback(4)
    name = "layers.1.router"
    flipped = -model.W[name]  # (a new array, input-major as loaded)
    model.W = {**model.W, name: np.asfortranarray(flipped)}
    one = model.forward([3], kv, logits="last")[0]
    kv.rollback(4)
    model.one_call = False
    step = model.forward([3], kv, logits="last")[0]
    assert len(done) == 2 and np.array_equal(one, step) and not np.array_equal(one, before)
