"""Calibration's pass timing: capture real passes, replay them from their own cache state and KV
context; the cost model's weighted, relative-error fit; the KV / cache hooks replays rely on."""

import numpy as np
import pytest

from s2moe.calib import measure
from s2moe.calib.passes import decode_passes
from s2moe.calib.replay import WeightPool, capture_passes, replay, single_shot_samples, spread
from s2moe.runtime.offload.cache import ExpertCache
from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants, VerificationCostModel
from s2moe.runtime.errors import KVCacheError, UsageError
from s2moe.runtime.model.kv_cache import KVCache
from s2moe.runtime.model.loader import load_model
from s2moe.runtime.model.forward import MoEModel
from s2moe.runtime.offload.store import ExpertStore

SPEC = {"draft_topk": 2, "draft_cap": 4, "reuse_cap": 8}
UNUSED = CostConstants(t_ar=1.0, c_draft=1.0, t_exp_miss=0.0, t_exp_hit=0.0)


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(DEFAULT_MODEL))


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(10, 6000, 12).tolist() for _ in range(n)]


def test_replays_run_from_the_captured_cache_state_and_never_touch_the_decode_kv(loaded):
    pool = WeightPool()
    # a 25 % budget with no hot list: LFU residency changes from pass to pass
    with decode_passes(loaded, _prompts(3), "0.25", None, SPEC, UNUSED, None, 10, pool) as (passes, _):
        assert len(passes) >= 3
        assert any(p.resident for p in passes) and any(p.n_missing for p in passes)
        kv_before = {id(p.kv): [a.copy() for a in p.kv.keys + p.kv.values] for p in passes}
        replay(passes, pool, rounds=2)  # raises if a replay misses or hits other experts
        for p in passes:
            assert len(p.times) == 2 and p.seconds == min(p.times) > 0
            assert all(np.array_equal(a, b) for a, b in zip(kv_before[id(p.kv)], p.kv.keys + p.kv.values))
        rows = [p.sample() for p in passes]
        assert {"n_tokens", "n_missing", "n_resident", "seconds", "repeats", "single_seconds"} <= set(rows[0])
        assert len(single_shot_samples(passes)) == len(passes) and spread(passes)["rounds"] == 2


def test_a_replay_that_differs_from_its_original_raises(loaded):
    pool = WeightPool()
    with decode_passes(loaded, _prompts(1), "0.25", None, SPEC, UNUSED, None, 6, pool) as (passes, _):
        passes[0].n_missing += 1
        with pytest.raises(RuntimeError, match="replay of a"):
            replay(passes[:1], pool, rounds=1)


class _LandsShuffled:
    """An expert provider whose reads land one at a time in a seeded random order, as a real disk's
    threads return them."""

    def __init__(self, inner, seed: int):
        self.inner, self.rng = inner, np.random.default_rng(seed)

    def stream(self, layer, experts):
        items = [item for group in self.inner.stream(layer, experts) for item in group]
        for i in self.rng.permutation(len(items)):
            yield [items[i]]

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("n_tokens", [9, 20])  # 20 × top-4 > 64 choices: the vectorised grouping
def test_a_pass_computes_the_same_bits_whatever_order_its_reads_land_in(loaded, n_tokens):
    # a replay (or a rerun) must route as the original did; a sum in arrival order moves the
    # residual stream by ulps, enough to flip a near-tie in a later layer's router
    tokens = sum(_prompts(2), [])[:n_tokens]
    runs = []
    for seed in (None, 1, 2, 3):
        cache = ExpertCache(ExpertStore(loaded, direct=False), capacity_bytes=None)
        model = MoEModel(loaded, cache if seed is None else _LandsShuffled(cache, seed))
        logits, rec = model.forward(tokens, model.new_cache(32))
        runs.append((logits, {L: r.experts.copy() for L, r in rec.layers.items()}))
    for logits, experts in runs[1:]:
        np.testing.assert_array_equal(logits, runs[0][0])
        assert all(np.array_equal(experts[L], runs[0][1][L]) for L in experts)


def test_profile_passes_run_without_prefetch_and_a_capture_refuses_reads_in_flight(loaded):
    pool = WeightPool()
    with decode_passes(loaded, _prompts(2), "0.1", None, SPEC, UNUSED, None, 12, pool) as (passes, _):
        cache = passes[0].model.experts
        assert cache.prefetch_stats.issued == 0 and cache.prefetching == 0
        model = passes[0].model
        cache.prefetch_slots = 2
        missing = [(L, e) for L in loaded.config.moe_layer_ids for e in range(loaded.config.num_experts)
                   if not cache.contains(L, e)]
        for key in missing[:2]:  # ranked above what the cache holds, so their prefetches get room there
            for _ in range(64):
                cache.policy.access(key)
        assert cache.prefetch(missing[:2]) == 2 and cache.prefetching == 2
        with capture_passes(model, "verify", pool), cache.in_phase("verify"), \
                pytest.raises(RuntimeError, match="2 prefetches in flight"):
            model.forward([5, 6], model.new_cache(8))
        cache.settle_prefetches()


def test_controlled_passes_fetch_and_hit_what_they_were_set_up_with(loaded):
    model = MoEModel(loaded, ExpertCache(ExpertStore(loaded, direct=False), capacity_bytes=None))
    pool = WeightPool()
    tokens = [list(range(100, 160))]
    passes = measure.controlled_passes(model, tokens, max_batch=5, n_samples=10, pool=pool, reuse_cap=8)
    assert {p.n_resident == len(p.resident) for p in passes} == {True}
    assert any(p.n_missing == 0 for p in passes) and any(p.n_resident == 0 for p in passes)
    assert all("policy" in p.forward_kwargs for p in passes)  # they route like S²-MoE verification
    replay(passes, pool, rounds=2)
    assert all(len(p.times) == 2 for p in passes)


def test_weight_pool_stops_at_its_limit(loaded):
    store = ExpertStore(loaded, direct=False)
    w = store.read(0, 0)
    pool = WeightPool(limit_bytes=w.nbytes)
    pool.offer((0, 0), w)
    pool.offer((0, 1), store.read(0, 1))
    assert list(pool.weights) == [(0, 0)] and pool.nbytes == w.nbytes


def test_cache_hold_restores_without_reading_and_respects_the_budget(loaded):
    store = ExpertStore(loaded, direct=False)
    w = store.read(1, 3)
    cache = ExpertCache(store, capacity_bytes=w.nbytes)
    cache.hold((1, 3), w)
    assert cache.contains(1, 3) and cache.resident_bytes == w.nbytes
    assert not cache.stats  # no phase saw a read or a lookup
    cache.get(1, [3])
    assert cache.stats["ar"].hits == 1 and cache.stats["ar"].misses == 0
    with pytest.raises(UsageError, match="does not fit"):
        cache.hold((1, 4), store.read(1, 4))


def test_kv_copy_prefix_is_exact_and_checks_bounds():
    src = KVCache(2, 2, 4, 16)
    rng = np.random.default_rng(0)
    src.begin_write(0, 10)
    for L in range(2):
        src.write(L, 0, rng.normal(size=(2, 10, 4)), rng.normal(size=(2, 10, 4)))
    dst = KVCache(2, 2, 4, 12)
    dst.copy_prefix(src, 7)
    assert dst.length == dst.filled == 7
    for L in range(2):
        np.testing.assert_array_equal(dst.view(L, 7)[0], src.view(L, 7)[0])
        np.testing.assert_array_equal(dst.view(L, 7)[1], src.view(L, 7)[1])
    with pytest.raises(KVCacheError):
        dst.copy_prefix(src, 11)  # the source holds only 10
    with pytest.raises(KVCacheError):
        KVCache(2, 2, 4, 5).copy_prefix(src, 6)  # more than the capacity


def _synthetic(n: int, rng, base: float) -> tuple[np.ndarray, np.ndarray]:
    X = np.column_stack([rng.integers(1, 10, n), rng.integers(0, 40, n), rng.integers(0, 40, n)]).astype(float)
    return X, base + X @ np.array([3e-4, 8e-4, 5e-5])


@pytest.mark.parametrize("loss", ["relative", "absolute"])
def test_both_losses_recover_constants_under_multiplicative_noise(loss):
    rng = np.random.default_rng(3)
    X, y = _synthetic(400, rng, 2e-3)
    y = y * rng.normal(1.0, 0.03, y.size)
    m = VerificationCostModel(loss=loss).fit(X, y)
    assert m.get_params()["loss"] == loss
    assert m.intercept_ == pytest.approx(2e-3, rel=0.15)
    np.testing.assert_allclose(m.coef_, [3e-4, 8e-4, 5e-5], rtol=0.2, atol=2e-5)


def test_sample_weight_lets_the_heavy_group_decide():
    rng = np.random.default_rng(4)
    Xa, ya = _synthetic(200, rng, 2e-3)  # the passes to predict
    Xb, yb = _synthetic(200, rng, 4e-3)  # another condition: a different per-pass base
    X, y = np.vstack([Xa, Xb]), np.concatenate([ya, yb])
    even = VerificationCostModel().fit(X, y)
    light_b = VerificationCostModel().fit(X, y, sample_weight=np.r_[np.ones(200), np.full(200, 0.01)])
    assert abs(light_b.intercept_ - 2e-3) < abs(even.intercept_ - 2e-3)
    assert light_b.mape(Xa, ya) < even.mape(Xa, ya)
    with pytest.raises(ValueError, match="loss"):
        VerificationCostModel(loss="huber").fit(X, y)


def _rows(X, y) -> list[dict]:
    return [{"n_tokens": a, "n_missing": b, "n_resident": c, "seconds": t} for (a, b, c), t in zip(X, y)]


def test_profile_fit_weighs_controlled_passes_by_cross_validation():
    """Controlled passes (no budget) whose hits cost 4x less than decoding's: the fixed weight 0.1
    lets them pull the fit; cross-validation on the decode passes gives them less say."""
    from s2moe.calib.profile_cmd import CONTROLLED_WEIGHT, fit_cost_model

    rng = np.random.default_rng(5)
    Xc = np.column_stack([rng.integers(1, 10, 150), rng.integers(0, 40, 150), rng.integers(0, 40, 150)]).astype(float)
    yc = 5e-3 + Xc @ np.array([1e-3, 4e-3, 0.15e-3])
    Xd = np.column_stack([rng.integers(2, 10, 160), rng.integers(1, 22, 160), rng.integers(7, 30, 160)]).astype(float)
    yd = (6e-3 + Xd @ np.array([0.8e-3, 4.8e-3, 0.6e-3])) * rng.normal(1.0, 0.03, 160)
    model, r2, mape = fit_cost_model(_rows(Xc, yc), _rows(Xd, yd))
    assert model.controlled_weight_ < CONTROLLED_WEIGHT and model.cv_mape_ is not None
    fixed = VerificationCostModel().fit(np.vstack([Xc, Xd]), np.concatenate([yc, yd]),
                                        sample_weight=np.r_[np.full(150, CONTROLLED_WEIGHT), np.ones(160)])
    assert mape == pytest.approx(model.mape(Xd, yd))  # scored on the decode passes
    assert mape < fixed.mape(Xd, yd)
    # decode passes without a miss (a 100 % budget): the controlled passes still set the miss cost
    Xd[:, 1] = 0
    yd = 6e-3 + Xd @ np.array([0.8e-3, 4.8e-3, 0.6e-3])
    model, _, _ = fit_cost_model(_rows(Xc, yc), _rows(Xd, yd))
    assert model.coef_[1] > 1e-3
    few, _, _ = fit_cost_model(_rows(Xc, yc), _rows(Xd[:10], yd[:10]))
    assert few.controlled_weight_ == CONTROLLED_WEIGHT and few.cv_mape_ is None


def test_validate_separates_a_machine_that_slowed_down_from_a_wrong_model():
    """Scaled by the speed probe's ratio, a model on a machine 12 % slower scores as it did; a cost
    it lacks stays an error at any probe ratio; without drift nothing is adjusted (raw figures only)."""
    from types import SimpleNamespace

    from s2moe.calib.validate_cmd import evaluate

    costs = CostConstants(t_ar=0.05, c_draft=0.005, t_exp_miss=4e-3, t_exp_hit=3e-4, t_base=0.01, t_token=1e-3)
    rng = np.random.default_rng(6)
    X = np.column_stack([rng.integers(1, 10, 80), rng.integers(0, 30, 80), rng.integers(0, 30, 80)]).astype(float)
    truth = costs.t_base + X @ np.array([costs.t_token, costs.t_exp_miss, costs.t_exp_hit])
    prof = SimpleNamespace(costs=costs)
    slow = evaluate(prof, _rows(X, 1.12 * truth), 1.12)  # the machine got 12 % slower
    assert slow["mape_percent"] > 9 and slow["residual_percent_p50"] > 9
    assert slow["fit_ratio"] == pytest.approx(1.12, abs=1e-3)
    assert slow["drift_adjusted"]["probe_ratio"] == pytest.approx(1.12)
    assert slow["drift_adjusted"]["mape_percent"] < 0.01 and slow["drift_adjusted"]["r2"] > 0.9999
    assert "drift_adjusted" not in evaluate(prof, _rows(X, 1.12 * truth))  # no drift seen: raw only
    wrong = truth + 6e-3 * (X[:, 0] > 5)  # a cost the model lacks: no speed factor explains it
    assert evaluate(prof, _rows(X, wrong), 1.0)["drift_adjusted"]["mape_percent"] > 3


def test_noise_ceiling_follows_the_repeat_noise():
    """Perfect repeats allow R² 1; repeats as noisy as the spread of the passes allow almost none."""
    from types import SimpleNamespace

    rng = np.random.default_rng(0)
    true = rng.uniform(0.010, 0.020, 200)

    def passes(noise_s):
        return [SimpleNamespace(times=list(t + rng.normal(0, noise_s, 6))) for t in true]

    quiet, some, loud = spread(passes(0.0)), spread(passes(0.0005)), spread(passes(0.01))
    assert quiet["noise_ceiling_r2"] == 1.0 and quiet["noise_mape_floor_percent"] == 0.0
    assert 0.9 < some["noise_ceiling_r2"] < 1.0 and 0.5 < some["noise_mape_floor_percent"] < 5
    assert loud["noise_ceiling_r2"] < 0.5
    flat = [SimpleNamespace(times=list(0.015 + rng.normal(0, 0.0005, 6))) for _ in range(200)]
    assert spread(flat)["noise_ceiling_r2"] < 0.3  # nothing to explain but noise
