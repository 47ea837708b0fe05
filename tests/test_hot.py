"""Which experts a profile pins (calib/hot.py). A static list filling the whole expert budget is
chosen only when it beats the best dynamic cache by more than the held-out split's noise: on text
unlike the profile's, a list chosen by a near-tie fetched half as much again as an LFU cache."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.calib import hot as hot_mod
from s2moe.calib import measure
from s2moe.calib.profile_cmd import _workload_tokens
from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.engine import build_engine
from s2moe.runtime.model.tokenizer import load_tokenizer


def _hits(rng, rate: float, noise: float, n: int = 1000, looked: int = 16) -> np.ndarray:
    return np.clip(rng.normal(rate * looked, noise * looked, n), 0, looked).round().astype(np.int64)


def test_static_is_chosen_when_it_wins_clearly(rng):
    looked = np.full(1000, 16)
    hits = {"static": _hits(rng, 0.60, 0.05), "lfu": _hits(rng, 0.50, 0.05), "lru": _hits(rng, 0.40, 0.05)}
    winner, margins = hot_mod.choose_strategy(hits, looked)
    m = margins["static"]
    assert winner == "static" and m["over"] == "lfu"
    assert abs(m["mean"] - 0.10) < 0.01 and 0 < m["standard_error"] < 0.01


def test_a_static_lead_within_noise_goes_to_the_dynamic_cache(rng):
    looked = np.full(1000, 16)
    lfu = rng.integers(4, 13, 1000)
    # static: the same ±3 hits a token around the cache's, zero mean, plus 50 hits in all: ahead by
    # 0.3 points overall, while from block to block it swings by more than that
    x = rng.integers(-3, 4, 500)
    d = rng.permutation(np.concatenate([x, -x]))
    d[rng.choice(1000, 50, replace=False)] += 1
    hits = {"static": lfu + d, "lfu": lfu}
    assert hot_mod._rate(hits["static"], looked) - hot_mod._rate(lfu, looked) == pytest.approx(50 / 16000)
    winner, margins = hot_mod.choose_strategy(hits, looked)
    m = margins["static"]
    assert winner == "lfu" and 0 < m["mean"] < 2 * m["standard_error"]


def test_half_pinned_must_also_win_clearly_and_static_then_beats_it(rng):
    looked = np.full(1000, 16)
    lfu = rng.integers(4, 13, 1000)
    hits = {"lfu": lfu, "hybrid_lfu": lfu + 2, "static": lfu + 4}  # each clearly ahead of the last
    winner, margins = hot_mod.choose_strategy(hits, looked)
    assert winner == "static" and margins["hybrid_lfu"]["over"] == "lfu" and margins["static"]["over"] == "hybrid_lfu"
    hits["hybrid_lfu"] = lfu  # no better than nothing pinned: static is compared with the LFU cache
    winner, margins = hot_mod.choose_strategy(hits, looked)
    assert winner == "static" and margins["static"]["over"] == "lfu"


@pytest.fixture(scope="module")
def traces():
    """Routing traces of the embedded model: the default prompts' profiling and held-out splits,
    and HumanEval prompts (text unlike the profile's)."""
    engine = build_engine(str(DEFAULT_MODEL), "1.0", 512)
    tok = load_tokenizer(engine.loaded)
    profiling, heldout, _ = _workload_tokens(tok, "default")
    a, b, _ = _workload_tokens(tok, "humaneval", max_records=24)
    run = lambda ids: measure.routing_traces(engine.model, ids)  # noqa: E731
    return run(profiling), run(heldout), run(a + b), {k: 1 for k in engine.loaded.experts}


@pytest.mark.parametrize("capacity", [12, 32])
def test_the_embedded_models_profile_pins_nothing_it_cannot_back(traces, capacity):
    profiling, heldout, other, sizes = traces
    plan = hot_mod.plan_residency(profiling, heldout, sizes, capacity)
    rates = plan["heldout_hit_rates"]
    # on its own held-out split the whole-budget list leads by a fraction of a point ...
    assert rates["static"] >= max(rates["lfu"], rates["hybrid_lfu"]) - 0.01
    # ... which is within that split's noise: nothing is pinned
    assert plan["strategy"] == "lfu" and plan["gpu_experts"] == []
    assert all(m["mean"] <= 2 * m["standard_error"] for m in plan["pin_margins"].values())
    # and on other text the whole-budget list is what loses
    static = hot_mod.choose_hot(hot_mod.activation_counts(profiling), sizes, capacity)
    assert hot_mod.coverage(other, set(static)) < hot_mod.simulate_hit_rate(other, sizes, capacity, "lfu") - 0.01


def test_the_hot_list_is_written_in_rank_order(traces, monkeypatch):
    # a run with less room than the profile's pins the head of the list, so the head must be the
    # most used experts, not the lowest layer numbers
    profiling, heldout, _, sizes = traces
    counts = hot_mod.activation_counts(profiling)
    monkeypatch.setattr(hot_mod, "choose_strategy", lambda hits, looked: ("static", {}))
    listed = [tuple(k) for k in hot_mod.plan_residency(profiling, heldout, sizes, 32)["gpu_experts"]]
    assert len(listed) == 32 and [counts[k] for k in listed] == sorted((counts[k] for k in listed), reverse=True)
    assert listed != sorted(listed)
