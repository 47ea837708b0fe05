"""A draft that never waits on the slow tier: under a budget, draft passes use resident experts only."""

from __future__ import annotations

import time

import numpy as np
import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine
from s2moe.runtime.model.routing import restrict


def test_restrict_keeps_allowed_choices_and_falls_back_by_rule():
    experts = np.array([[3, 1], [0, 2], [1, 3]])
    weights = np.array([[0.5, 0.2], [0.4, 0.3], [0.6, 0.1]], np.float32)
    logits = np.array([[0, 5, 0, 9], [1, 0, 3, 2], [0, 8, 1, 4]], np.float32)
    allowed = np.array([False, True, True, False])
    e, w = restrict(experts, weights, logits, allowed, "best")
    assert e.tolist() == [[-1, 1], [-1, 2], [1, -1]]
    np.testing.assert_allclose(w, [[0.0, 0.2], [0.0, 0.3], [0.6, 0.0]], rtol=1e-6)
    only_first = np.array([True, False, False, False])
    e, w = restrict(experts, weights, logits, only_first, "best")
    # row 0 keeps nothing: the best allowed expert (0) takes its top choice's weight; row 1 keeps 0
    assert e.tolist() == [[0, -1], [0, -1], [0, -1]] and w[0, 0] == pytest.approx(0.5)
    e, w = restrict(experts, weights, logits, only_first, "skip")
    assert e.tolist() == [[-1, -1], [0, -1], [-1, -1]] and w[0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("fallback", ["best", "skip"])
def test_restrict_of_one_token_matches_the_batch_path(fallback):
    """A single token takes a list fast path; it must agree with the array path (the same row
    twice) on every mask, dropped choices (-1) and fallbacks included."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        E, k = int(rng.integers(2, 9)), int(rng.integers(1, 4))
        experts = rng.choice(np.arange(-1, E), size=(1, k))
        weights = rng.random((1, k)).astype(np.float32)
        logits = rng.standard_normal((1, E)).astype(np.float32)
        allowed = rng.random(E) < rng.random()
        e1, w1 = restrict(experts, weights, logits, allowed, fallback)
        e2, w2 = restrict(np.repeat(experts, 2, 0), np.repeat(weights, 2, 0), np.repeat(logits, 2, 0), allowed, fallback)
        assert e1.tolist() == e2[:1].tolist() and w1.tolist() == w2[:1].tolist()
        assert e1.dtype == e2.dtype and w1.dtype == w2.dtype == np.float32


@pytest.mark.parametrize("fallback", ["best", "skip"])
@pytest.mark.parametrize("method", ["s2moe", "ca", "confidence"])
def test_draft_never_fetches_and_greedy_output_stays_ar(method, fallback):
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)
    ids = [int(t) for t in np.random.default_rng(3).integers(10, 6000, 12)]
    want = generate_ar(build_engine(str(DEFAULT_MODEL), "0.25", 256).model, ids, 40).tokens
    costs = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)  # AE drafts
    settings = SpecSettings(draft_topk=2, draft_cap=4, draft_fallback=fallback, confidence_threshold=0.05)
    spec = get_method(method, reuse_gating=False)
    result = SpeculativeDecoder(engine.model, spec, settings, costs).generate(ids, 40)
    draft = engine.cache.stats["draft"]
    assert result.metrics.draft_passes > 0 and draft.hits > 0
    assert draft.misses == 0 and draft.bytes_read == 0  # every draft pass ran on resident experts
    assert result.tokens == want


def test_draft_guided_prefetch_serves_verification_and_keeps_ar_output():
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)
    assert engine.cache.prefetch_slots == 2 * engine.loaded.config.top_k
    ids = [int(t) for t in np.random.default_rng(5).integers(10, 6000, 12)]
    want = generate_ar(build_engine(str(DEFAULT_MODEL), "0.25", 256).model, ids, 48).tokens
    costs = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)
    result = SpeculativeDecoder(engine.model, get_method("ca+ae"), SpecSettings(draft_cap=4), costs).generate(ids, 48)
    assert result.tokens == want
    p = engine.cache.prefetch_stats
    assert p.issued > 0 and p.used > 0  # verification found predicted experts already read or in flight
    assert p.issued == p.used + p.kept + p.wasted and not engine.cache._prefetched  # each settled once
    assert engine.cache.resident_bytes <= engine.cache.capacity
    report = engine.cache.report()["prefetch"]
    assert report["issued"] == p.issued and report["hidden_seconds"] >= 0


def test_a_prefetch_that_lands_before_its_submit_returns_is_timed_from_its_issue():
    """A native read can finish before `submit` returns (small experts, an idle disk). Its issue
    time must be taken before the submit, or the read's time comes out negative and the hidden
    fetch time with it (seen once in a bench run: fetch_hidden -0.10 ms per token)."""
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)
    cache, store = engine.cache, engine.cache.store
    real = store.submit

    def landed_first(layer, experts):
        futures = real(layer, experts)
        for f in futures:
            f.result()  # landed...
        time.sleep(0.01)  # ...well before the submit returns
        return futures

    store.submit = landed_first
    assert cache.prefetch([(1, e) for e in range(3)]) == 3
    store.submit = real
    with cache.in_phase("verify"):
        list(cache.stream(1, [0, 1, 2]))  # the pass that uses them
    p = cache.prefetch_stats
    # issue to landing, all before the pass: no wait, nothing negative (the bug: about -0.01 s each)
    assert p.used == 3 and p.read_seconds > 0 and p.waited_seconds == 0
    assert cache.report()["prefetch"]["hidden_seconds"] > 0
    engine.close()


def test_no_prefetch_when_every_expert_is_resident():
    assert build_engine(str(DEFAULT_MODEL), None, 64).cache.prefetch_slots == 0


def test_prefetch_stays_within_its_slots_and_marks_only_its_own_layer_available():
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)
    cache, E = engine.cache, engine.loaded.config.num_experts
    slots = cache.prefetch_slots
    assert slots > 0 and not cache.held  # nothing resident yet: every key below starts a read
    keys = [(1, e) for e in range(slots + 3)]
    assert cache.prefetch(keys) == slots and cache.prefetching == slots
    assert cache.prefetch([(2, 0)]) == 0  # full until the pass they were for settles them
    assert set(np.nonzero(cache.available_mask(1, E))[0]) == set(range(slots))
    assert not cache.available_mask(0, E).any() and not cache.available_mask(2, E).any()
    engine.model.forward([5, 6], engine.model.new_cache(8))  # some experts resident beside the reads
    for layers in ([0, 1, 2, 3], [3, 1]):  # every layer's mask at once, in the order asked
        assert (cache.available_masks(layers, E) == np.stack([cache.available_mask(L, E) for L in layers])).all()
    cache.settle_prefetches()
    assert cache.prefetching == 0 and cache.resident_bytes <= cache.capacity
    every = [0, 1, 2, 3]
    cache.available_masks(every, E)[:] = True  # the caller's copy: the kept mask is not changed
    assert (cache.available_masks(every, E) == np.stack([cache.available_mask(L, E) for L in every])).all()
    assert cache.available_masks(every, E).any()
    cache.clear()  # evictions: the kept mask follows them
    assert not cache.available_masks(every, E).any()
    engine.close()


def test_only_drafting_methods_read_ahead_and_the_slots_are_the_settings():
    s2moe, ar = get_method("s2moe"), get_method("ar")
    assert SpecSettings().slots_for(s2moe) is None  # the engine's default: 2 × top-k under a budget
    assert SpecSettings(prefetch_slots=3).slots_for(s2moe) == 3
    assert SpecSettings(prefetch_slots=3).slots_for(ar) == 0
    assert SpecSettings(prefetch=False, prefetch_slots=3).slots_for(s2moe) == 0
    default = build_engine(str(DEFAULT_MODEL), "0.25", 256)
    three = build_engine(str(DEFAULT_MODEL), "0.25", 256, prefetch_slots=3)
    assert three.cache.prefetch_slots == 3 and default.cache.prefetch_slots == 2 * default.loaded.config.top_k
    # slots cost no memory of their own: prefetches go into the cache
    assert (three.plan.model_bytes, three.cache.capacity) == (default.plan.model_bytes, default.cache.capacity)


def test_prefetch_into_the_cache_takes_its_room_there_and_keeps_ar_output():
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)
    cache = engine.cache
    ids = [int(t) for t in np.random.default_rng(5).integers(10, 6000, 12)]
    want = generate_ar(build_engine(str(DEFAULT_MODEL), "0.25", 256).model, ids, 48).tokens
    costs = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)
    result = SpeculativeDecoder(engine.model, get_method("ca+ae"), SpecSettings(draft_cap=4), costs).generate(ids, 48)
    assert result.tokens == want
    p = cache.prefetch_stats
    assert p.issued > 0 and p.used > 0 and p.issued == p.used + p.kept + p.wasted
    assert not cache._prefetched and not cache._reserved  # every reservation settled
    assert cache.peak_resident_bytes <= cache.capacity and cache.resident_bytes <= cache.capacity


def test_a_prefetch_into_the_cache_evicts_colder_experts_never_predicted_or_pinned_ones():
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256, hot_experts=[(0, 0)])
    cache, E = engine.cache, engine.loaded.config.num_experts
    size = engine.loaded.experts[(0, 0)].resident_bytes_for(True)
    fill = [(L, e) for L in range(engine.loaded.config.num_layers) for e in range(E)][1:]
    for L, e in fill:  # fill the cache, each expert used once
        if cache.resident_bytes + size > cache.capacity:
            break
        cache.get(L, [e])
    full = set(cache.held)
    assert cache.capacity - cache.resident_bytes < size
    for L, e in sorted(full):  # each resident expert used twice more
        cache.get(L, [e])
        cache.get(L, [e])
    new = [(L, e) for L, e in fill if (L, e) not in full][:2]
    for key in new:  # used once less than the residents: only the use they are read for ranks them above a victim
        for _ in range(2):
            cache.policy.access(key)
    predicted = sorted(full - {(0, 0)})[:1] + new
    assert cache.prefetch(predicted) == 2
    assert cache.resident_bytes <= cache.capacity  # their room was made when they started
    evicted = full - set(cache.held)
    assert len(evicted) == 2 and (0, 0) not in evicted and predicted[0] not in evicted
    assert all(cache.in_flight(k) for k in new)
    for key in new:  # the pass they were for runs while they are read: they land before it settles
        cache._prefetched[key][0].result()  # (a read still queued at settling is cancelled, not kept)
    cache.settle_prefetches()
    assert set(new) <= set(cache.held) and not cache._reserved and cache.resident_bytes <= cache.capacity
    colder = [(L, e) for L, e in fill if (L, e) not in cache.held][-5:]  # never used: every resident ranks above them
    held = set(cache.held)
    # no room is made for a colder guess: it is read into the idle streaming workspace, a window at most
    assert cache.prefetch(colder) == cache.staging == 4 and not cache._reserved and set(cache.held) == held
    p = cache.prefetch_stats
    assert (p.borrowed, p.refused) == (4, 1) and cache.report()["prefetch"]["refused"] == 1
    cache.settle_prefetches()  # the guesses nothing used: dropped, or kept where free room holds them
    assert set(cache.held) >= held and cache.resident_bytes <= cache.capacity and not cache._borrowed
    engine.close()


def test_a_decode_tokens_experts_take_the_one_token_path_and_match_the_batch_path_bit_for_bit(monkeypatch):
    """At one token `_experts` builds its rows without NumPy per choice, and a layer whose
    experts are all resident is one group without the stream generator. Both must give the
    batch path's bits: the output of a decode step may not depend on which path ran it."""
    import s2moe.runtime.model.forward as fwd

    engine = build_engine(str(DEFAULT_MODEL), budget="0.25")
    model, cache = engine.model, engine.model.experts
    c, rng = model.config, np.random.default_rng(3)
    model.forward(list(range(100, 160)), model.new_cache(64))  # experts resident in the late layers
    layers = [L for L in range(c.num_layers) if len(cache._by_layer[L]) >= c.top_k]
    assert layers
    for trial in range(30):
        L = layers[trial % len(layers)]
        held = sorted(cache._by_layer[L])
        x = rng.standard_normal((1, c.hidden_size)).astype(np.float32)
        picks = rng.permutation(held)[:c.top_k] if trial % 3 else rng.permutation(c.num_experts)[:c.top_k]
        experts = np.array([picks], np.int64)
        if trial % 4 == 0:
            experts[0, -1] = -1  # a choice the draft dropped
        weights = rng.random((1, c.top_k)).astype(np.float32)
        fast = model._experts(L, x, experts, weights)
        monkeypatch.setattr(fwd, "_SLOTS", ())  # the batch path's rows
        monkeypatch.setattr(cache, "resident_group", None, raising=False)  # and the stream
        slow = model._experts(L, x, experts, weights)
        monkeypatch.undo()
        assert fast.dtype == slow.dtype == np.float32
        assert np.array_equal(fast, slow), trial


def test_a_resident_group_notes_what_stream_notes_and_nothing_when_one_is_missing():
    engine = build_engine(str(DEFAULT_MODEL), budget="0.25")
    cache = engine.model.experts
    engine.model.forward(list(range(100, 160)), engine.model.new_cache(64))
    L = max(cache._by_layer, key=lambda L: len(cache._by_layer[L]))
    held = sorted(cache._by_layer[L])[:3]
    assert len(held) == 3
    absent = next(e for e in range(engine.model.config.num_experts) if e not in cache._by_layer[L])
    with cache.in_phase("check"):
        st = cache.stats["check"]
        before = (st.hits, st.misses, cache.policy.clock)
        assert cache.resident_group(L, [*held, absent]) is None
        assert (st.hits, st.misses, cache.policy.clock) == before  # nothing noted
        cache.begin_pass(1)
        group = cache.resident_group(L, held)
        cache.end_pass()
        assert [e for e, _ in group] == held and all(w is cache.held[(L, e)] for e, w in group)
        after_fast = (st.hits, cache.policy.clock, dict(cache.policy.last))
        cache.begin_pass(1)
        streamed = [item for g in cache.stream(L, held) for item in g]
        cache.end_pass()
    assert streamed == group
    last = cache.policy.last
    assert st.hits - after_fast[0] == after_fast[0] - before[0] == len(held)  # counted alike
    assert cache.policy.clock - after_fast[1] == after_fast[1] - before[2] == len(held)  # each touched once
    assert [last[(L, e)] for e in held] == [after_fast[2][(L, e)] + len(held) for e in held]
    assert st.passes == 2 and st.unique_experts == 2 * len(held) and st.misses == 0


def test_the_resident_mask_follows_every_eviction_and_read():
    engine = build_engine(str(DEFAULT_MODEL), budget="0.25")
    cache, E = engine.model.experts, engine.model.config.num_experts
    rng = np.random.default_rng(0)
    for _ in range(60):
        L = int(rng.integers(engine.model.config.num_layers))
        mask = cache.resident_mask(L, E)
        assert mask.tolist() == [(L, e) in cache.held for e in range(E)]
        mask[:] = ~mask  # a copy: the caller may write it
        assert cache.resident_mask(L, E).tolist() == [(L, e) in cache.held for e in range(E)]
        cache.get(L, rng.permutation(E)[:4].tolist())  # misses read, colder experts evicted
