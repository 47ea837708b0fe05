"""Reads that overlap compute inside a pass: a layer's missing experts are queued before its
resident ones are computed, and each MoE layer starts reading the next one's likely experts
(its router on this layer's residual stream). Neither may change an output."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine
from s2moe.runtime.offload.cache import ExpertCache
from s2moe.runtime.offload.experts import ExpertWeights


class _Store:
    """Reads that complete only when the test says so; remembers what was submitted, in order."""

    def __init__(self):
        self.submitted: list[tuple[int, int]] = []
        self.futures: dict[tuple[int, int], Future] = {}

    def weights(self) -> ExpertWeights:
        return ExpertWeights(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32))

    def submit(self, layer, experts):
        out = []
        for e in experts:
            self.submitted.append((layer, e))
            out.append(self.futures.setdefault((layer, e), Future()))
        return out

    def stored_bytes(self, layer, expert):
        return 48


def test_a_layers_reads_are_queued_before_its_resident_experts_are_computed():
    store = _Store()
    cache = ExpertCache(store, capacity_bytes=None, window=4)
    cache.hold((0, 0), store.weights())
    started = []
    groups = cache.stream(0, [0, 1, 2, 3], started=lambda: started.append(list(store.submitted)))
    first = next(groups)
    assert [e for e, _ in first] == [0]  # the resident expert, for the caller to compute now ...
    assert store.submitted == [(0, 1), (0, 2), (0, 3)]  # ... while the misses are read
    assert started == [[(0, 1), (0, 2), (0, 3)]]  # the lookahead's reads queue behind them
    for key in [(0, 1), (0, 2), (0, 3)]:
        store.futures[key].set_result(store.weights())
    assert sorted(e for group in groups for e, _ in group) == [1, 2, 3] and len(started) == 1


def test_the_lookahead_waits_until_a_layers_last_read_is_queued():
    store = _Store()
    cache = ExpertCache(store, capacity_bytes=None, window=2)
    started = []
    groups = cache.stream(0, [1, 2, 3], started=lambda: started.append(list(store.submitted)))
    for key in [(0, 1), (0, 2), (0, 3)]:
        store.futures[key] = Future()
        store.futures[key].set_result(store.weights())
    got = [e for e, _ in next(groups)]
    assert got == [1, 2] and started == []  # two of three queued (the window): no lookahead yet
    assert [e for e, _ in next(groups)] == [3] and started == [[(0, 1), (0, 2), (0, 3)]]


def test_a_layer_with_nothing_to_read_still_starts_its_lookahead():
    store = _Store()
    cache = ExpertCache(store, capacity_bytes=None)
    cache.hold((0, 0), store.weights())
    started = []
    assert [[e for e, _ in g] for g in cache.stream(0, [0], started=lambda: started.append(1))] == [[0]]
    assert started == [1] and store.submitted == []


def _ids(seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 6000, 12)]


@pytest.mark.parametrize("budget", ["0.25", "0.1"])
def test_lookahead_reads_next_layers_experts_and_keeps_ar_output(budget):
    off = build_engine(str(DEFAULT_MODEL), budget, 256, lookahead=False)
    assert not off.model.lookahead
    want = generate_ar(off.model, _ids(11), 32).tokens
    engine = build_engine(str(DEFAULT_MODEL), budget, 256)
    assert engine.model.lookahead and engine.cache.prefetch_slots > 0
    assert generate_ar(engine.model, _ids(11), 32).tokens == want
    s = engine.cache.lookahead_stats
    assert s.issued > 0 and s.used > 0  # a later layer found its experts read or in flight
    assert s.issued == s.used + s.kept + s.wasted  # each guess used or settled, once
    assert not engine.cache.prefetching  # nothing left in flight between passes
    assert engine.cache.resident_bytes <= engine.cache.capacity
    assert engine.cache.report()["lookahead"]["issued"] == s.issued
    assert engine.cache.prefetch_stats.issued == 0  # AR has no draft: the draft's stats stay apart


def test_speculative_greedy_output_is_unchanged_by_lookahead():
    costs = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)  # AE drafts
    runs = {}
    for lookahead in (False, True):
        engine = build_engine(str(DEFAULT_MODEL), "0.25", 256, lookahead=lookahead)
        dec = SpeculativeDecoder(engine.model, get_method("s2moe"), SpecSettings(draft_cap=4), costs)
        runs[lookahead] = (dec.generate(_ids(5), 40).tokens, engine)
    assert runs[True][0] == runs[False][0]
    cache = runs[True][1].cache
    assert cache.lookahead_stats.issued > 0 and cache.stats["draft"].misses == 0  # drafts still read nothing
    assert not cache.prefetching


def test_no_lookahead_without_a_budget():
    assert not build_engine(str(DEFAULT_MODEL), None, 64).model.lookahead
