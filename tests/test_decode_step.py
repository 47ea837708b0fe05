"""A decode token's own paths through the forward pass (model/forward.py): its rotary tables kept
per position, its attention mask, and the sum of its experts. Each must give what the batch path
gives, bit for bit: a token's output may not depend on how many tokens shared its pass."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.engine import build_engine
from s2moe.runtime.model import rope


def test_a_decode_tokens_expert_sum_is_the_batch_paths():
    model = build_engine(str(DEFAULT_MODEL)).model  # every expert resident: the batch path streams none
    c, rng = model.config, np.random.default_rng(11)
    for trial in range(40):
        L = trial % c.num_layers
        x = rng.standard_normal((1, c.hidden_size)).astype(np.float32) * rng.uniform(0.1, 10)
        experts = np.array([rng.permutation(c.num_experts)[:c.top_k]], np.int64)
        if trial % 5 == 0:
            experts[0, 1] = -1  # a dropped choice adds a zero row, as in the batch
        weights = rng.random((1, c.top_k)).astype(np.float32)
        one = model._experts(L, x, experts, weights)
        two = model._experts(L, np.repeat(x, 2, axis=0), np.repeat(experts, 2, axis=0), np.repeat(weights, 2, axis=0))
        assert one.shape == (1, c.hidden_size) and np.array_equal(one, two[:1]) and np.array_equal(one, two[1:]), trial


def test_a_decode_tokens_rotary_tables_are_kept_per_position_and_read_only():
    model = build_engine(str(DEFAULT_MODEL)).model
    for at in (0, 1, 17, 4095, 100_000):
        cos, sin = model._rope(np.array([at]))
        want = rope.tables(model._inv_freq, model._rope_factor, np.array([at]))
        assert np.array_equal(cos, want[0]) and np.array_equal(sin, want[1])
        assert model._rope(np.array([at]))[0] is cos and not cos.flags.writeable and not sin.flags.writeable
        batch = model._rope(np.array([at, at + 1]))  # a chain: computed, not kept
        assert np.array_equal(batch[0][:1], cos) and batch[0].flags.writeable
    for at in range(5000):  # bounded: a long generation does not grow it without end
        model._rope(np.array([at]))
    assert len(model._rope_one) <= 4096


def test_a_decode_tokens_mask_is_the_chains():
    model = build_engine(str(DEFAULT_MODEL)).model
    for start in (0, 1, 63, 300):
        pos = np.array([start])
        got = model._visibility(start, 1, pos, None, None)
        assert got.dtype == bool and np.array_equal(got, model._visibility(start, 1, pos, np.ones((1, 1), bool), None))
        windowed = model._visibility(start, 1, pos, None, 8)  # a sliding window still takes the full path
        assert windowed[0].sum() == min(start + 1, 8)


# -- a decode token's MoE layer in one C call (forward.py `_moe_step`, csrc/cpu/step.c) --------------

def _decode_run(steps: bool, budget: str | None, fallback: str):
    """40 decode passes, target and resident-only draft taking turns, some kept and some rolled
    back: the logits, the routing, and the cache's counts (everything but time)."""
    from s2moe.runtime.engine import phase_of
    from s2moe.runtime.model.routing import RoutingPolicy

    model = build_engine(str(DEFAULT_MODEL), budget=budget).model
    assert model._steps  # the default model takes the one-call path unless told not to
    model._steps = steps
    model.one_call = False  # a layer per call: the whole pass in one call is tests/test_decode_pass.py's
    cache = model.experts
    draft = RoutingPolicy(top_k=2, allowed=lambda L: cache.resident_mask(L, model.config.num_experts), fallback=fallback)
    kv = model.new_cache(256)
    model.forward(list(range(100, 140)), kv, logits="last")
    kv.commit(40)
    streamed, step_by_step = [], model._experts
    model._experts = lambda *a: streamed.append(a[0]) or step_by_step(*a)
    rng, seen = np.random.default_rng(5), []
    for i in range(40):
        policy = draft if i % 2 else None
        with phase_of(model, "draft" if policy else "ar"):
            logits, rec = model.forward([int(rng.integers(model.config.vocab_size))], kv,
                                        **({"policy": policy} if policy else {}))
        if steps and policy and budget:  # (no budget: nothing restricts the draft, and experts load on use)
            assert not streamed, "a resident-only draft layer left the one call"
        streamed.clear()
        seen.append((logits, [(r.logits, r.experts, r.weights) for _, r in sorted(rec.layers.items())]))
        kv.commit(kv.filled) if i % 3 == 0 else kv.rollback(kv.length)
    counts = {phase: {k: v for k, v in s.items() if k not in ("fetch_seconds", "bandwidth_mb_s")}
              for phase, s in cache.report()["phases"].items()}
    return seen, counts, cache.prefetch_stats.to_dict()


def test_a_decode_layer_in_one_call_gives_the_step_by_step_bits_and_bookkeeping():
    """Full residency, 25 % (target passes stream their misses: the call hands those back) and
    10 %, with a draft that falls back to its best resident expert or skips the layer."""
    for budget, fallback in ((None, "best"), ("0.25", "best"), ("0.1", "skip"), ("0.1", "best")):
        one, counts_one, pf_one = _decode_run(True, budget, fallback)
        plain, counts_plain, pf_plain = _decode_run(False, budget, fallback)
        for i, ((lg_a, rec_a), (lg_b, rec_b)) in enumerate(zip(one, plain)):
            assert np.array_equal(lg_a, lg_b), (budget, fallback, i)
            for a, b in zip(rec_a, rec_b):
                assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b)), (budget, fallback, i)
        assert counts_one == counts_plain and pf_one == pf_plain, (budget, fallback)
        if budget:
            assert counts_one["ar"]["misses"] > 0 and counts_one["draft"]["misses"] == 0


def test_the_one_call_routes_restricts_and_sums_as_the_kernels_do_one_by_one():
    from s2moe.runtime.kernels.cpu import CpuOps, _expert_args
    from s2moe.runtime.model.routing import restrict

    model = build_engine(str(DEFAULT_MODEL)).model
    ops, c, rng = model.ops, model.config, np.random.default_rng(3)
    assert isinstance(ops, CpuOps)
    L = 1
    weights_of = model.experts.get(L, list(range(c.num_experts)))
    full = [_expert_args(w) for w in weights_of]
    for trial in range(300):
        x = rng.standard_normal((1, c.hidden_size)).astype(np.float32)
        logits = rng.standard_normal((1, c.num_experts)).astype(np.float32)
        if trial % 7 == 0:
            logits[0, rng.permutation(c.num_experts)[:6]] = logits[0, 0]  # ties: the lower id first
        k = int(rng.integers(1, 9))
        allowed = None if trial % 4 == 0 else rng.random(c.num_experts) < rng.choice([0.0, 0.1, 0.5, 1.0])
        fallback = ("best", "skip")[trial % 2]
        table = [a if rng.random() < 0.8 else None for a in full] if trial % 3 == 0 else full
        got = ops.moe_step(x, logits, k, c.router, c.norm_topk_prob, c.routed_scaling_factor, allowed, fallback,
                           table, model.act)
        experts, weights = ops.route(logits, k, c.router, c.norm_topk_prob)
        if allowed is not None:
            experts, weights = restrict(experts, weights, logits, allowed, fallback)
        assert np.array_equal(got[0], experts) and np.array_equal(got[1], weights) and got[1].dtype == np.float32, trial
        chosen = [int(e) for e in experts[0] if e >= 0]
        if any(table[e] is None for e in chosen):
            assert got[2] is None, trial  # handed back: the pass streams the missing expert
            continue
        want = model._experts(L, x, experts, weights)  # the step-by-step path (every expert resident)
        assert got[2] is not None and np.array_equal(got[2], want), trial
    logits = np.zeros((1, c.num_experts), np.float32)
    logits[0, :2], logits[0, [7, 9, 20]] = (5.0, 4.0), 1.0  # the choices are not allowed; three allowed tie
    allowed = np.zeros(c.num_experts, bool)
    allowed[[9, 20, 7]] = True
    got = ops.moe_step(x, logits, 2, c.router, c.norm_topk_prob, 1.0, allowed, "best", full, model.act)
    assert got[0].tolist() == [[7, -1]], "the fallback is the first of the tied best (NumPy's argmax)"
    nan = np.full((1, c.num_experts), np.nan, np.float32)
    assert ops.moe_step(x, nan, 2, c.router, c.norm_topk_prob, 1.0, None, "best", full, model.act) is None


def test_the_one_call_refuses_arguments_that_do_not_fit():
    import s2moe._cpu as C
    from s2moe.runtime.kernels.cpu import _expert_args

    model = build_engine(str(DEFAULT_MODEL)).model
    c = model.config
    table = [_expert_args(w) for w in model.experts.get(0, list(range(c.num_experts)))]
    x, logits = np.zeros(c.hidden_size, np.float32), np.zeros(c.num_experts, np.float32)
    e, w, total = np.empty(2, np.int64), np.empty(2, np.float32), np.empty(c.hidden_size, np.float32)
    ok = (x, logits, 2, 0, False, 1.0, None, True, table, 0, 1.7, 7.0, e, w, total)
    assert C.moe_step(*ok) == 0
    bad = {
        "k": (2, 65), "kind": (3, 2), "table": (8, table[:-1]), "table entry": (8, [("x",)] * c.num_experts),
        "allowed": (6, np.ones(c.num_experts - 1, bool)), "total": (14, total[:-1]),
        "experts": (12, np.empty(2, np.int32)), "gate": (8, [(t[0][:-1],) + t[1:] for t in table]),
    }
    for what, (at, value) in bad.items():
        args = list(ok)
        args[at] = value
        with pytest.raises(ValueError):
            C.moe_step(*args)


def test_a_decode_token_with_a_selection_bias_routes_as_the_step_by_step_path():
    """Residency-aware gating biases a pass's selection: a one-token pass under it must route with
    that bias, whichever path computes it."""
    from s2moe.runtime.model.routing import RoutingPolicy

    E = build_engine(str(DEFAULT_MODEL)).model.config.num_experts
    favour = np.where(np.arange(E) % 5 == 0, 3.0, 0.0).astype(np.float32)
    biased = RoutingPolicy(selection_bias=lambda L, logits: np.broadcast_to(favour, logits.shape).astype(np.float32))
    runs = []
    for steps, policy in ((True, biased), (False, biased), (True, RoutingPolicy())):
        model = build_engine(str(DEFAULT_MODEL)).model
        model._steps = steps
        kv = model.new_cache(64)
        model.forward(list(range(100, 120)), kv, logits="last")
        runs.append([model.forward([t], kv, policy=policy) for t in (5, 77, 300)])
    for (lg_a, rec_a), (lg_b, rec_b) in zip(runs[0], runs[1]):
        assert np.array_equal(lg_a, lg_b)
        assert all(np.array_equal(rec_a.layers[L].experts, rec_b.layers[L].experts) for L in rec_a.layers)
    assert any(not np.array_equal(a[1].layers[L].experts, b[1].layers[L].experts)
               for a, b in zip(runs[0], runs[2]) for L in a[1].layers), "the bias changes no choice: the test shows nothing"


def test_attention_kept_per_layer_follows_the_model_the_ops_serve():
    """The CPU ops keep each layer's attention arguments; a second model served by the same ops
    (its layer 0 given layer 1's q|k|v) must get its own weights, not the first model's."""
    from s2moe.runtime.model.forward import MoEModel

    first = build_engine(str(DEFAULT_MODEL)).model
    other = build_engine(str(DEFAULT_MODEL)).model
    other.W = dict(other.W, **{"layers.0.qkv": other.W["layers.1.qkv"]})
    prompt = list(range(100, 116))
    want = other.forward(prompt, other.new_cache(32))[0]
    assert not np.array_equal(want, first.forward(prompt, first.new_cache(32))[0])  # the swap shows
    other.ops = first.ops  # shared, right after the first model's pass
    assert isinstance(other, MoEModel) and np.array_equal(other.forward(prompt, other.new_cache(32))[0], want)
