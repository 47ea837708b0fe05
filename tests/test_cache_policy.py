"""Replacement policies against hand computations: LRU order, LFU's exponential decay and admission."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from s2moe.runtime.model.loader import load_model
from s2moe.runtime.offload.cache import DecayedLFU, ExpertCache
from s2moe.runtime.offload.store import ExpertStore

A, B, C = (0, 1), (0, 2), (0, 3)


def _miss(lfu, key):  # what the cache does on a miss that it keeps
    lfu.access(key)
    lfu.insert(key)


def test_lfu_decay_by_hand():
    """half-life 2 accesses. A is used at clock 1, 2, 3; B at 9 and 10. At clock 10 the decayed
    counts are A = 0.5^(7/2) + 0.5^(8/2) + 0.5^(9/2) ≈ 0.195 and B = 1 + 0.5^(1/2) ≈ 1.707: the
    victim is A, though it was used more often (without decay it would be B, 3 uses against 2)."""
    lfu = DecayedLFU(half_life=2.0)
    _miss(lfu, A)
    lfu.touch(A)
    lfu.touch(A)
    for _ in range(5):  # clock 4..8: other experts, never resident
        lfu.access((1, 7))
    _miss(lfu, B)
    lfu.touch(B)
    assert lfu.clock == 10
    assert lfu.victim(set()) == A
    assert lfu.victim({A}) == B  # protected experts are skipped
    # admission: C, seen once now (clock 11), scores 1 against A's 0.195 · 0.5^(1/2) ≈ 0.138: admitted;
    # against B's 1.707 · 0.5^(1/2) ≈ 1.207 it is not
    lfu.access(C)
    assert lfu.admit(C, A) and not lfu.admit(C, B)


def test_lfu_default_half_life_is_512_accesses():
    """The default (the cache's LFU): A used at clock 1 and 2, then 300 other accesses, then B once.
    With a half-life of 512, A keeps 0.5^(301/512) + 0.5^(300/512) ≈ 1.33 > B's 1: B is the victim.
    A half-life of 64 would leave A ≈ 0.08 and evict it."""
    lfu = DecayedLFU()
    _miss(lfu, A)
    lfu.touch(A)
    for _ in range(300):
        lfu.access((1, 7))
    _miss(lfu, B)
    assert lfu.victim(set()) == B


def test_lfu_dates_a_kept_expert_by_its_last_use_not_its_insertion():
    """One pass misses a then b (both accessed, then both kept): same count, a used earlier, so a
    is the victim whatever the keys' order."""
    lfu = DecayedLFU(half_life=2.0)
    a, b = (0, 3), (0, 1)
    lfu.access(a)
    lfu.access(b)
    lfu.insert(a)
    lfu.insert(b)
    assert lfu.victim(set()) == a


def test_lfu_counts_survive_eviction_and_ties_go_to_the_least_recent():
    lfu = DecayedLFU(half_life=1e9)  # no decay to speak of: plain counts
    _miss(lfu, A)
    _miss(lfu, B)
    lfu.remove(A)  # evicted; its count stays
    lfu.access(A)  # back: two uses now
    lfu.insert(A)
    _miss(lfu, C)
    assert lfu.victim(set()) == B  # B and C one use each, B the least recent
    assert lfu.victim({B}) == C
    assert lfu.victim({B, C}) == A


def test_lfu_victim_matches_a_reference_computed_from_the_access_log():
    """Under skewed random traffic the O(log n) victim has the lowest decayed count, computed
    here independently as Σ 0.5^((now − t) / half_life) over the expert's uses (ties: the least
    recently used)."""
    rng = np.random.default_rng(7)
    h = 64.0
    lfu = DecayedLFU(half_life=h)
    keys = [(L, e) for L in range(4) for e in range(16)]
    uses: dict = {}
    evictions = 0
    for step in range(1, 3001):
        key = keys[int(rng.zipf(1.3)) % len(keys)]
        uses.setdefault(key, []).append(step)
        lfu.access(key)
        if key in lfu.resident:
            continue
        if len(lfu.resident) >= 20:
            protected = {keys[int(i)] for i in rng.integers(0, len(keys), 3)}
            score = {k: sum(0.5 ** ((step - t) / h) for t in uses[k]) for k in lfu.resident if k not in protected}
            got = lfu.victim(protected)
            low = min(score.values())
            assert score[got] <= low * (1 + 1e-9), (step, got, score[got], low)
            ties = [k for k, v in score.items() if v <= low * (1 + 1e-9)]
            assert uses[got][-1] == min(uses[k][-1] for k in ties), step
            lfu.remove(got)
            evictions += 1
        lfu.insert(key)
    assert evictions > 400


@pytest.fixture(scope="module")
def tiny_store(tiny_model_dirs):
    loaded = load_model(tiny_model_dirs["olmoe"][1])
    return ExpertStore(loaded), next(iter(loaded.experts.values())).resident_bytes


def test_lru_evicts_the_least_recently_used(tiny_store):
    store, one = tiny_store
    cache = ExpertCache(store, capacity_bytes=2 * one, policy="lru")
    cache.get(0, [0])
    cache.get(0, [1])
    cache.get(0, [0])  # a hit: 0 becomes the most recent
    cache.get(0, [2])  # room for two: 1 goes
    assert set(cache.held) == {(0, 0), (0, 2)}
    cache.get(0, [1])  # 0 is now the least recent
    assert set(cache.held) == {(0, 2), (0, 1)}
    assert cache.stats["ar"].hits == 1 and cache.stats["ar"].misses == 4


def test_lfu_cache_keeps_the_frequent_expert_and_streams_a_one_off(tiny_store):
    store, one = tiny_store
    cache = ExpertCache(store, capacity_bytes=2 * one, policy="lfu")
    for _ in range(3):
        cache.get(0, [0])
    cache.get(0, [1])
    cache.get(0, [1])
    cache.get(0, [2])  # used once: not admitted over 1 (two uses), streamed through
    assert set(cache.held) == {(0, 0), (0, 1)} and cache.stats["ar"].streamed == 1
    for _ in range(3):
        cache.get(0, [2])  # now used more than 1: admitted, and 1 (the lower count) leaves
    assert set(cache.held) == {(0, 0), (0, 2)}


class SizedStore:
    """A store whose experts have the given sizes (bytes), for eviction arithmetic by hand."""

    def __init__(self, sizes: dict[int, int]):
        self.sizes = sizes

    def read_many(self, layer, experts):
        return [SimpleNamespace(nbytes=self.sizes[e], expert=e) for e in experts]

    def stored_bytes(self, layer, expert):
        return self.sizes[expert]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_large_expert_evicts_as_many_as_it_needs(policy):
    cache = ExpertCache(SizedStore({0: 4, 1: 4, 2: 8}), capacity_bytes=10, policy=policy)
    cache.get(0, [0])
    cache.get(0, [1])
    for _ in range(4 if policy == "lfu" else 1):  # LFU admits 2 once it is used more than 0 and 1
        got = cache.get(0, [2])
    assert got[0].expert == 2
    assert set(cache.held) == {(0, 2)} and cache.resident_bytes == 8 <= cache.capacity


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_request_never_evicts_its_own_experts(policy):
    """Room for two, a pass needs three: the first two stay, the third streams through."""
    cache = ExpertCache(SizedStore({0: 4, 1: 4, 2: 4}), capacity_bytes=8, policy=policy)
    got = cache.get(0, [0, 1, 2])
    assert [w.expert for w in got] == [0, 1, 2]
    assert set(cache.held) == {(0, 0), (0, 1)} and cache.stats["ar"].streamed == 1
    assert cache.resident_bytes == 8
