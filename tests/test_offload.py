"""Budgeted expert cache and slow tier: identical output at any budget, budgets respected."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future

import numpy as np
import pytest

from s2moe.runtime.offload.memory import Budget, plan_memory
from s2moe.runtime.offload.cache import ExpertCache
from s2moe.runtime.engine import build_engine, read_hot_experts
from s2moe.runtime.errors import UsageError
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.model.loader import load_model
from s2moe.runtime.offload.reader import ALIGN, BufferPool
from s2moe.runtime.offload.store import Emulation, ExpertStore


@pytest.fixture(scope="module")
def olmoe_dir(tiny_model_dirs):
    return tiny_model_dirs["olmoe"][1]


def _greedy(engine, prompt, n=12):
    return generate_ar(engine.model, prompt, n).tokens


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_output_identical_at_every_budget(tiny_model_dirs, policy):
    prompts = [list(np.random.default_rng(s).integers(0, 380, 6 + s)) for s in range(4)]
    for family in ("olmoe", "qwen3_moe"):
        folder = tiny_model_dirs[family][1]
        full = build_engine(folder)
        expected = [_greedy(full, p) for p in prompts]
        for share in ("0.5", "0.25", "0.1"):
            engine = build_engine(folder, share, policy=policy)
            assert [_greedy(engine, p) for p in prompts] == expected, (family, share)
            cache = engine.cache
            assert cache.capacity == int(float(share) * engine.plan.expert_total)
            assert 0 < cache.peak_resident_bytes <= cache.capacity
            # the cache's own accounting equals the sizes of what it holds
            assert cache.resident_bytes == sum(w.nbytes for w in cache.held.values())
            ar = cache.stats["ar"]
            assert ar.misses > 0 and ar.bytes_read > 0 and ar.passes > 0
            buffers = cache.report()["read_buffers"]  # evicted experts' buffers carried later reads
            if share == "0.1" and all(engine.model.experts.store.direct_files.values()):
                assert buffers["reused"] > 0, buffers
            assert buffers["free_bytes"] + buffers["outstanding_bytes"] <= buffers["limit_bytes"]


def test_requests_larger_than_the_budget_stream_and_stay_within_it(olmoe_dir, rng):
    loaded = load_model(olmoe_dir)
    one = next(iter(loaded.experts.values())).resident_bytes
    cache = ExpertCache(ExpertStore(loaded), capacity_bytes=3 * one, policy="lru")
    got = cache.get(0, list(range(8)))  # 8 experts needed by one pass, room for 3
    assert len(got) == 8 and cache.stats["ar"].streamed == 5
    assert cache.resident_bytes <= 3 * one and len(cache.held) == 3
    ref = ExpertStore(loaded).read(0, 6)
    np.testing.assert_array_equal(got[6].down.data, ref.down.data)


def test_protected_experts_are_not_evicted_mid_request(olmoe_dir):
    loaded = load_model(olmoe_dir)
    one = next(iter(loaded.experts.values())).resident_bytes
    cache = ExpertCache(ExpertStore(loaded), capacity_bytes=2 * one, policy="lru")
    cache.get(0, [0, 1])
    cache.get(0, [1, 2])  # 1 is a hit and protected: 0 must go, not 1
    assert set(cache.held) == {(0, 1), (0, 2)}


def test_pinned_hot_experts_stay(olmoe_dir):
    loaded = load_model(olmoe_dir)
    one = next(iter(loaded.experts.values())).resident_bytes
    cache = ExpertCache(ExpertStore(loaded), 3 * one, "lfu", hot=[(1, 5)])
    assert cache.stats["load"].misses == 1
    for e in range(8):
        cache.get(0, [e])
    assert (1, 5) in cache.held and cache.resident_bytes <= 3 * one


@pytest.mark.parametrize("text,share,total", [
    ("0.25", 0.25, None), ("25%", 0.25, None), ("512m", None, 512 << 20), ("16g", None, 16 << 30),
    ("123456789", None, 123456789), (None, 1.0, None),
])
def test_budget_parsing(text, share, total):
    b = Budget.parse(text)
    assert (b.share, b.total_bytes) == (share, total)


@pytest.mark.parametrize("bad", ["-1", "0", "lots", "1.5", "12q"])
def test_bad_budget_strings(bad):
    with pytest.raises(UsageError, match="--budget"):
        Budget.parse(bad)


def test_budget_below_dense_part_names_the_minimum(olmoe_dir):
    loaded = load_model(olmoe_dir)
    with pytest.raises(UsageError, match=r"below the dense part.*need at least"):
        plan_memory(loaded, Budget.parse("10k"), 64)
    plan = plan_memory(loaded, Budget.parse(str(loaded.dense_bytes + 10 ** 8)), 64)
    assert 0 < plan.expert_capacity <= plan.expert_total


@pytest.mark.parametrize("entries,needle", [
    ([[0, 99]], "expert 99 out of range"),
    ([[7, 0]], "layer 7 is not a MoE layer"),
    ([[0, 1], [0, 1]], "duplicate"),
    ([[0, "a"]], "not a [layer, expert] pair"),
])
def test_bad_hot_expert_files(olmoe_dir, tmp_path, entries, needle):
    path = tmp_path / "hot.json"
    path.write_text(json.dumps({"gpu_experts": entries}))
    with pytest.raises(UsageError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        read_hot_experts(str(path), load_model(olmoe_dir))


def test_hot_experts_over_budget(olmoe_dir, tmp_path):
    path = tmp_path / "hot.json"
    path.write_text(json.dumps({"gpu_experts": [[L, e] for L in range(2) for e in range(8)]}))
    with pytest.raises(UsageError, match="need"):
        build_engine(olmoe_dir, "0.25", hot_experts=str(path))
    ok = build_engine(olmoe_dir, "0.5", hot_experts=[(0, 1), (1, 2)])
    assert ok.cache.pinned == {(0, 1), (1, 2)}


def test_emulated_link_sets_the_floor_on_fetch_time(olmoe_dir):
    loaded = load_model(olmoe_dir)
    emu = Emulation(bandwidth_mb_s=2.0, latency_us=20000)
    store = ExpertStore(loaded, emulation=emu, threads=4)
    nbytes = store.stored_bytes(0, 0)
    t0 = time.perf_counter()
    store.read_many(0, [0, 1, 2, 3])
    took = time.perf_counter() - t0
    # four requests share the link: latencies overlap, bytes do not
    floor = 0.02 + 4 * nbytes / 2e6
    assert floor <= took < floor + 0.5


def test_direct_io_or_announced_fallback(olmoe_dir, capsys):
    store = ExpertStore(load_model(olmoe_dir))
    w = store.read(1, 3)
    ref = ExpertStore(load_model(olmoe_dir), direct=False).read(1, 3)
    np.testing.assert_array_equal(w.gate.data, ref.gate.data)
    (path, direct), = store.direct_files.items()
    if not direct:  # some file systems (tmpfs) refuse O_DIRECT: then it must have said so
        assert "O_DIRECT refused" in capsys.readouterr().err


def test_an_emulated_wait_sleeps_instead_of_spinning():
    """The emulated link's waits run on the fetch threads beside the compute: they must not burn a
    core (or hold the GIL) while they wait, or the emulated tier slows compute as no real disk does."""
    from s2moe.runtime.offload.store import _wait_until

    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(50):
        deadline = time.perf_counter() + 300e-6  # the emulated latency the benchmarks use
        _wait_until(deadline)
        assert time.perf_counter() >= deadline  # never early: the link's floor holds
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall >= 50 * 300e-6 and cpu < 0.3 * wall, (cpu, wall)


def test_a_read_buffer_is_reused_only_after_its_last_view_is_gone():
    pool = BufferPool(1 << 20)
    a = pool.take(5000)  # two pages
    assert a.size == 2 * ALIGN and a.ctypes.data % ALIGN == 0
    a[:] = 7
    view = a[100:300].view(np.uint16).reshape(20, 5)  # what an expert keeps: views of the buffer
    del a
    assert pool.free_bytes == 0 and pool.outstanding == 2 * ALIGN  # the view still holds it
    b = pool.take(5000)
    b[:] = 9
    assert pool.created == 2 and (view == 0x0707).all()  # a new buffer: the view's bytes untouched
    del view
    assert pool.free_bytes == 2 * ALIGN and pool.outstanding == 2 * ALIGN
    c = pool.take(8000)  # same page count: the freed buffer comes back
    assert pool.reused == 1 and pool.created == 2 and c.ctypes.data % ALIGN == 0
    del b, c
    assert pool.outstanding == 0 and pool.free_bytes == 4 * ALIGN


def test_the_read_buffer_pool_never_holds_more_than_its_limit():
    pool = BufferPool(3 * ALIGN)
    x, y = pool.take(2 * ALIGN), pool.take(2 * ALIGN)  # handed out past the limit: reads never wait
    del x  # 2 pages still out + 2 kept would be 4 > 3: unmapped, not kept
    assert pool.free_bytes == 0
    del y
    assert pool.free_bytes == 2 * ALIGN
    z = pool.take(ALIGN)  # another size: 2 free + 1 out = 3 fits, the free one stays
    assert pool.free_bytes == 2 * ALIGN and pool.created == 3
    w = pool.take(ALIGN)  # 2 free + 2 out = 4 > 3: the free one makes way
    assert pool.free_bytes == 0 and pool.outstanding == 2 * ALIGN
    del z, w
    assert pool.free_bytes + pool.outstanding <= pool.limit


def test_lfu_heap_picks_the_same_victim_as_a_full_scan():
    """The O(log n) victim equals the lowest decayed score (ties: least recent) of a full scan."""
    from s2moe.runtime.offload.cache import DecayedLFU

    rng = np.random.default_rng(7)
    lfu = DecayedLFU(half_life=64.0)
    keys = [(L, e) for L in range(4) for e in range(16)]
    evictions = 0
    for step in range(4000):
        key = keys[int(rng.zipf(1.3)) % len(keys)]  # skewed, like routing
        lfu.access(key)
        if key in lfu.resident:
            continue
        if len(lfu.resident) >= 20:
            protected = {keys[int(i)] for i in rng.integers(0, len(keys), 3)}
            candidates = [k for k in lfu.resident if k not in protected]
            expected = min(candidates, key=lambda k: (lfu._score(k), lfu.last.get(k, 0)))
            got = lfu.victim(protected)
            assert got == expected, step
            lfu.remove(got)
            evictions += 1
        lfu.insert(key)
    assert evictions > 500
    assert len(lfu._heap) <= 4 * len(lfu.resident) + 65  # superseded entries do not pile up


class _HeldReads:
    """A store whose reads complete only when the test says so; remembers what was submitted."""

    def __init__(self):
        self.submitted: list[tuple[int, int]] = []
        self.futures: dict[tuple[int, int], Future] = {}

    @staticmethod
    def weights():
        from s2moe.runtime.offload.experts import ExpertWeights

        return ExpertWeights(*(np.zeros((2, 2), np.float32) for _ in range(3)))

    def submit(self, layer, experts):
        for e in experts:
            self.submitted.append((layer, e))
        return [self.futures.setdefault((layer, e), Future()) for e in experts]

    def stored_bytes(self, layer, expert):
        return 48


def _rank_above_guesses(cache, store, keys):
    """Make ``keys`` resident and used so often that the policy never evicts them for a guess."""
    for key in keys:
        for _ in range(9):
            cache.policy.access(key)
        cache.hold(key, store.weights())


@pytest.mark.parametrize("window,first_reads", [(4, [1, 2, 3]), (2, [1, 2])])
def test_a_layers_reads_are_queued_before_its_resident_experts_are_computed(window, first_reads):
    """The resident group is handed out with the first ``window`` reads already in flight, so the
    caller's compute on it overlaps them; the rest follow as they land, each read once."""
    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=None, window=window)
    cache.hold((0, 0), store.weights())
    groups = cache.stream(0, [0, 1, 2, 3])
    assert [e for e, _ in next(groups)] == [0]
    assert store.submitted == [(0, e) for e in first_reads]
    for e in (1, 2, 3):
        store.futures.setdefault((0, e), Future()).set_result(store.weights())
    assert sorted(e for group in groups for e, _ in group) == [1, 2, 3]
    assert store.submitted == [(0, 1), (0, 2), (0, 3)]


def test_a_prefetched_read_counts_in_the_window_and_an_early_stop_cancels_the_queued_reads():
    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=None, window=1, prefetch_slots=2)
    cache.hold((0, 0), store.weights())
    assert cache.prefetch([(0, 1)]) == 1  # a draft's guess, in flight
    groups = cache.stream(0, [0, 1, 2, 3])
    assert [e for e, _ in next(groups)] == [0]
    assert store.submitted == [(0, 1), (0, 2)]  # the prefetch, and one read of our own (window 1)
    groups.close()  # the caller's compute failed: nothing it queued may keep a fetch thread busy
    assert store.futures[(0, 1)].cancelled() and store.futures[(0, 2)].cancelled()
    assert (0, 3) not in store.futures


def test_a_prefetch_holds_its_room_until_its_read_lands_or_fails_and_a_running_guess_is_waited_for():
    import threading

    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=3 * 48, window=1, prefetch_slots=2)
    cache.hold((0, 0), store.weights())
    assert cache.prefetch([(0, 1), (0, 2)]) == 2 and cache.resident_bytes == 3 * 48  # room taken at the start
    store.futures[(0, 1)].set_exception(OSError("EIO"))
    with pytest.raises(OSError):
        list(cache.stream(0, [1]))
    assert cache.resident_bytes == 2 * 48 and (0, 1) not in cache._reserved  # a failed read gives its room back
    guess = store.futures[(0, 2)]
    assert guess.set_running_or_notify_cancel()  # being read: it cannot be cancelled
    threading.Timer(0.05, guess.set_result, [store.weights()]).start()
    with cache.in_phase("verify"):
        cache.settle_prefetches()  # waits for it: dropped, its buffer would land outside the budget
    assert cache.contains(0, 2) and cache.resident_bytes == 2 * 48 and not cache._reserved
    assert cache.stats["verify"].fetch_seconds >= 0.04  # the wait is verification's
    p = cache.prefetch_stats
    assert (p.issued, p.used, p.kept) == (2, 1, 1)


def test_a_prefetch_never_evicts_an_expert_the_draft_used_this_iteration():
    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=2 * 48, prefetch_slots=2)
    for key, uses in (((0, 0), 8), ((0, 1), 2), ((0, 2), 16)):
        for _ in range(uses):
            cache.policy.access(key)
    cache.hold((0, 0), store.weights())
    cache.hold((0, 1), store.weights())
    with cache.in_phase("draft"):
        list(cache.stream(0, [1]))  # the draft ran on (0, 1), the colder one
    assert cache.prefetch([(0, 2)]) == 1
    assert cache.contains(0, 1) and not cache.contains(0, 0)  # the victim is the one the draft did not use
    store.futures[(0, 2)].set_result(store.weights())
    cache.settle_prefetches()
    for _ in range(2):
        cache.policy.access((0, 3))
    assert cache.prefetch([(0, 3)]) == 1 and not cache.contains(0, 1)  # protection ends with the iteration


def test_guesses_the_cache_has_no_room_for_wait_in_the_streaming_workspace_and_shrink_the_next_window():
    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=2 * 48, window=4, prefetch_slots=8)
    _rank_above_guesses(cache, store, [(0, 0), (2, 0)])  # never evicted for a guess
    assert cache.prefetch([(1, 1), (1, 2)]) == 2 and len(cache.held) == 2 and not cache._reserved
    assert cache.prefetch_stats.borrowed == 2 and cache.resident_bytes == 2 * 48
    groups = cache.stream(0, [0, 1, 2, 3, 4])  # another layer: its own window gives up half of the 2 guesses
    assert [e for e, _ in next(groups)] == [0]  # the resident one, with the first reads queued
    assert store.submitted[2:] == [(0, 1), (0, 2), (0, 3)]
    groups.close()
    for f in store.futures.values():
        if not f.done():
            f.set_result(store.weights())
    assert sorted(e for group in cache.stream(1, [1, 2]) for e, _ in group) == [1, 2]  # the guesses, used
    assert not cache._borrowed and cache.prefetch_stats.used == 2
    groups = cache.stream(0, [0, 5, 6, 7, 8, 9])  # none held: the whole window again
    assert [e for e, _ in next(groups)] == [0]
    assert store.submitted[-4:] == [(0, 5), (0, 6), (0, 7), (0, 8)]
    groups.close()
    cache.staging = 0
    assert cache.prefetch([(1, 3)]) == 0 and cache.prefetch_stats.refused == 1  # no workspace to borrow


@pytest.mark.parametrize("window", [1, 2, 4])
def test_a_full_workspace_of_guesses_and_a_pass_stay_within_the_plans_two_windows(window):
    """As many guesses as the workspace lends, held for other layers: a pass beside them streams
    with a shrunk window, so its group in compute, its reads in flight and the guesses never exceed
    the 2 × window planned (a window of 1 lends nothing)."""
    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=2 * 48, window=window, prefetch_slots=8)
    _rank_above_guesses(cache, store, [(0, 0), (3, 0)])  # never evicted for a guess
    guesses = [(L, e) for L in (1, 2) for e in (1, 2, 3, 4)]
    lent = cache.prefetch(guesses)
    assert lent == cache.staging == {1: 0, 2: 2, 4: 4}[window] and cache.prefetch_stats.refused == 8 - lent
    for f in store.futures.values():
        f.set_result(store.weights())
    own, seen, alive = [], [], []
    real_submit = store.submit

    def submit(layer, experts):  # the buffers alive once this read starts
        out = real_submit(layer, experts)
        own.extend(experts)
        alive.append(lent + len(own) - len(seen) + len(held_group))
        for f in out:
            f.set_result(store.weights())
        return out

    store.submit = submit
    held_group: list = []
    for group in cache.stream(0, [0, 5, 6, 7, 8, 9, 10]):
        held_group = [e for e, _ in group if e != 0]  # the caller holds it until the next one comes
        seen.extend(held_group)
    assert sorted(seen) == [5, 6, 7, 8, 9, 10] and max(alive) <= 2 * cache.window


def test_verification_reads_no_prefetch_started_are_split_by_why():
    """PrefetchStats says why verification still read on its critical path: the guess was refused
    (no room), left past the reads-in-flight cap, predicted while resident and evicted since, or
    never predicted."""
    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=3 * 48, window=4, prefetch_slots=3)
    cache.staging = 1
    _rank_above_guesses(cache, store, [(0, 0), (0, 1)])
    # (1, 1) takes the free room, (1, 2) the one workspace slot; (1, 3) and (1, 4) are refused
    assert cache.prefetch([(1, 1), (1, 2), (1, 3), (1, 4)]) == 2
    assert cache.prefetch([(1, 3), (0, 0)]) == 0  # (1, 3) refused again: one more refusal, no new key
    p = cache.prefetch_stats
    assert (p.borrowed, p.refused, p.refused_keys) == (1, 3, 2)
    cache.prefetch_slots = 2  # the cap: (1, 5) is predicted and never started
    assert cache.prefetch([(1, 5)]) == 0 and p.refused == 3
    for f in store.futures.values():
        f.set_result(store.weights())
    real_submit = store.submit

    def landed(layer, experts):  # verification's own reads complete at once
        out = real_submit(layer, experts)
        for f in out:
            if not f.done():
                f.set_result(store.weights())
        return out

    store.submit = landed
    cache.clear()  # (0, 0), predicted while resident, is evicted before verification reads it
    with cache.in_phase("verify"):
        assert [e for group in cache.stream(0, [0]) for e, _ in group] == [0]
        got = sorted(e for group in cache.stream(1, [1, 2, 3, 4, 5, 6]) for e, _ in group)
    assert got == [1, 2, 3, 4, 5, 6]
    split = (p.used, p.missed_refused, p.missed_capped, p.missed_evicted, p.missed_unpredicted)
    assert split == (2, 2, 1, 1, 1) and sum(split) == cache.stats["verify"].misses
    assert cache.report()["prefetch"]["missed_evicted"] == 1
    cache.settle_prefetches()
    assert not cache.contains(1, 3)
    with cache.in_phase("verify"):  # a new iteration: nothing predicted, refused or capped yet
        list(cache.stream(1, [3, 5]))
    assert (p.missed_refused, p.missed_capped, p.missed_unpredicted) == (2, 1, 3)
    with cache.in_phase("ar"):  # AR reads nothing ahead: its misses are not split
        list(cache.stream(1, [8]))
    assert p.missed_unpredicted == 3
