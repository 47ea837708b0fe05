"""The prefetch gate (offload/read_costs.py): on the CPU, a draft's guesses start only while the tier's
reads take long to land against what starting one costs; the store measures both on every read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fake_cupy
from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine
from s2moe.runtime.errors import UsageError
from s2moe.runtime.kernels import backend as B
from s2moe.runtime.offload.read_costs import DEFAULT_PREFETCH_GATE, ReadCosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSTS = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)  # AE drafts


def _ids() -> list[int]:
    return [int(t) for t in np.random.default_rng(5).integers(10, 6000, 12)]


def _costs(start_us: float, landing_us: float, n: int = 8) -> ReadCosts:
    c = ReadCosts()
    for _ in range(n):
        c.observe_start(start_us * 1e-6)
        c.observe_landing(landing_us * 1e-6)
    return c


def test_the_ratio_is_median_landing_over_median_start_once_enough_reads_are_measured():
    c = ReadCosts(min_reads=8)
    for _ in range(7):
        c.observe_start(10e-6)
        c.observe_landing(300e-6)
    assert c.ratio() is None  # 7 reads: no verdict, the gate stays open
    c.observe_start(10e-6)
    c.observe_landing(300e-6)
    assert c.ratio() == pytest.approx(30.0)
    # one start preempted for 5 ms and one read queued behind others do not swing a median
    c.observe_start(5e-3)
    c.observe_landing(50e-3)
    for _ in range(6):  # (the ratio is worked out again after 8 new observations)
        c.observe_start(10e-6)
    assert c.ratio() == pytest.approx(30.0)
    # a call that started 4 reads in 80 µs counts 4 starts of 20 µs
    d = ReadCosts(min_reads=4)
    d.observe_start(80e-6, reads=4)
    for _ in range(4):
        d.observe_landing(400e-6)
    assert d.ratio() == pytest.approx(20.0) and list(d.starts) == pytest.approx([20e-6] * 4)
    # a window: what the tier does now, not what it did 64 reads ago
    for _ in range(64):
        d.observe_start(10e-6)
        d.observe_landing(5e-3)
    assert d.ratio() == pytest.approx(500.0)
    assert d.to_dict() == {"start_us": 10.0, "landing_us": 5000.0, "ratio": 500.0}


def _missing(cache, layer: int = 0, n: int = 2):
    return [(layer, e) for e in range(32) if not cache.contains(layer, e)][:n]


def test_the_cache_starts_no_guess_while_reads_land_too_soon_to_pay_for_starting_them():
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256, prefetch_gate=24.0)
    cache = engine.cache
    assert cache.prefetch_gate == 24.0
    guesses = _missing(cache)
    cache.store.read_costs = ReadCosts()  # nothing measured yet: prefetch as before the gate
    assert cache.prefetch_pays() and cache.prefetch(guesses) == 2
    cache.settle_prefetches()
    guesses = _missing(cache)
    cache.store.read_costs = _costs(30, 300)  # ratio 10: the embedded model's regime on a 2-vCPU VM
    assert not cache.prefetch_pays() and cache.prefetch(guesses) == 0
    assert cache.prefetching == 0 and cache.prefetch_stats.gated == 1 and cache.prefetch_stats.issued == 2
    assert cache.gate_report() == {"gate": 24.0, "start_us": 30.0, "landing_us": 300.0, "ratio": 10.0}
    cache.store.read_costs = _costs(30, 3000)  # ratio 100: a slow tier, the reads are worth hiding
    assert cache.prefetch_pays() and cache.prefetch(guesses) == 2
    cache.settle_prefetches()
    cache.prefetch_gate = 0.0  # 0: always
    cache.store.read_costs = _costs(30, 300)
    assert cache.prefetch_pays()
    engine.close()


def test_the_store_measures_every_read_it_starts_and_a_slow_tier_keeps_the_gate_open():
    # a run under a 20 MB/s emulated link (Python fetch threads): each 168 KiB read lands after
    # ≥ 8 ms, ~1000× what starting one costs, so prefetch runs, and greedy output is AR's
    ids = _ids()
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256, emulate_bandwidth=20.0, prefetch_gate=24.0)
    want = generate_ar(build_engine(str(DEFAULT_MODEL), "0.25", 256).model, ids, 24).tokens
    result = SpeculativeDecoder(engine.model, get_method("ca+ae"), SpecSettings(draft_cap=4), COSTS).generate(ids, 24)
    assert result.tokens == want
    costs = engine.cache.store.read_costs
    assert len(costs.starts) >= 8 and len(costs.landings) >= 8
    assert min(costs.landings) >= 8e-3 and costs.ratio() >= 24.0
    p = engine.cache.prefetch_stats
    assert p.issued > 0 and p.gated == 0
    engine.close()


def test_a_gated_run_keeps_ar_output_and_stops_prefetching_once_reads_are_measured():
    # a gate no tier reaches: after the first measured reads every guess is held back, and the
    # output is AR's (prefetch only moves reads, never the tokens)
    ids = _ids()
    want = generate_ar(build_engine(str(DEFAULT_MODEL), "0.25", 256).model, ids, 48).tokens
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256, prefetch_gate=1e12)
    result = SpeculativeDecoder(engine.model, get_method("ca+ae"), SpecSettings(draft_cap=4), COSTS).generate(ids, 48)
    assert result.tokens == want
    p = engine.cache.prefetch_stats
    assert p.gated > 0 and engine.cache.store.read_costs.ratio() is not None
    # verification's reads the gate left to it are counted as such, not as guesses never made
    assert p.missed_gated > 0 and p.missed_gated >= p.missed_unpredicted
    split = p.missed_refused + p.missed_capped + p.missed_evicted + p.missed_unpredicted + p.missed_gated
    assert p.used + split == engine.cache.stats["verify"].misses
    issued_before = p.issued
    SpeculativeDecoder(engine.model, get_method("ca+ae"), SpecSettings(draft_cap=4), COSTS).generate(ids, 24)
    assert p.issued == issued_before  # measured: none more
    engine.close()


def test_a_device_tier_is_never_gated():
    # the CPU that starts a device's copies is not the one its compute waits on
    dev = B.select_backend("cupy", module=fake_cupy.module)
    for tier in ("file", "host"):
        engine = build_engine(str(DEFAULT_MODEL), "0.25", 64, backend=dev, offload_tier=tier, prefetch_gate=24.0)
        assert engine.cache.prefetch_gate == 0.0 and engine.cache.prefetch_pays()
        engine.close()
    host = build_engine(str(DEFAULT_MODEL), "0.25", 64, prefetch_gate=24.0)
    assert host.cache.prefetch_gate == 24.0
    host.close()


def test_the_settings_carry_the_default_gate_and_refuse_a_negative_one():
    assert SpecSettings().prefetch_gate == DEFAULT_PREFETCH_GATE > 0
    with pytest.raises(UsageError, match="--prefetch-gate"):
        SpecSettings(prefetch_gate=-1).validate(4, 32)


def test_bench_reports_the_gate_and_a_run_refuses_a_bad_one(tmp_path):
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "s2moe.runtime.cli"]
    r = subprocess.run(cmd + ["bench", "--methods", "s2moe", "-b", "0.25", "--n-prompts", "2", "--max-tokens", "24",
                              "--prefetch-gate", "1e12", "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    extra = json.loads(out.read_text())["records"][0]["extra"]
    assert extra["prefetch_gate"]["gate"] == 1e12 and extra["prefetch_gate"]["ratio"] > 0
    assert extra["prefetch"]["gated"] > 0
    r = subprocess.run(cmd + ["run", "-p", "hi", "-n", "2", "--prefetch-gate", "-1"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: --prefetch-gate -1.0: must be >= 0"]
