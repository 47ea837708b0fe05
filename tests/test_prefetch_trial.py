"""Prefetch where the run measures it paying (decoding/prefetch_trial.py): a trial of both ways taking
turns, then the way that cost less; only on the host, only with live costs; lossless."""

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
from s2moe.runtime.decoding.prefetch_trial import PrefetchTrial
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine
from s2moe.runtime.kernels import backend as B

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSTS = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)  # AE drafts


def _ids() -> list[int]:
    return [int(t) for t in np.random.default_rng(5).integers(10, 6000, 12)]


def _run_trial(trial: PrefetchTrial, on: tuple, off: tuple, iterations: int) -> list[bool]:
    """Feed ``iterations``: (seconds, expected tokens) by the way each was asked to go."""
    ways = []
    for _ in range(iterations):
        way = trial.prefetch_now()
        ways.append(way)
        trial.observe(*(on if way else off))
    return ways


def test_the_trial_takes_turns_then_keeps_the_way_that_cost_less_per_token():
    # the embedded model's trade: with prefetch an iteration took 1.3 ms longer for 4.5 tokens
    t = PrefetchTrial(trial=4, hold=6)
    ways = _run_trial(t, on=(7.5e-3, 4.5), off=(6.2e-3, 4.5), iterations=8)
    assert ways == [True, False] * 4  # turns: drift reaches both ways alike
    assert t.decisions == [{"ms_per_token_prefetching": 1.6667, "ms_per_token_not": 1.3778, "prefetch": False}]
    assert not t.choice
    ways = _run_trial(t, on=(7.5e-3, 4.5), off=(6.2e-3, 4.5), iterations=6)
    assert ways == [False] * 6  # the hold
    assert t.to_dict() == {"decisions": t.decisions, "prefetched_iterations": 4, "held_back_iterations": 10}
    # the next trial: a slow tier now (verification waits 20 ms without prefetch); the old evidence
    # counts half, so the new one decides
    ways = _run_trial(t, on=(8e-3, 4.0), off=(28e-3, 4.0), iterations=8)
    assert ways == [True, False] * 4 and t.choice and t.decisions[-1]["prefetch"]
    assert t.sides[True].iterations == pytest.approx(4 * 0.5 + 4)  # aged once, then 4 more
    # per token, not per iteration: prefetch's iterations may draft (and keep) more
    u = PrefetchTrial(trial=4, hold=6)
    _run_trial(u, on=(9e-3, 6.0), off=(7e-3, 4.0), iterations=8)
    assert u.choice  # 1.5 ms a token against 1.75


def test_the_trial_prefetches_until_it_has_measured_both_ways():
    t = PrefetchTrial(trial=4, hold=4, min_iterations=4)
    assert t.prefetch_now()
    _run_trial(t, on=(1e-3, 2.0), off=(0.0, 2.0), iterations=8)  # untimed iterations are not evidence
    assert t.sides[False].iterations == 0
    assert t.decisions == [] and t.choice  # too little to go on: prefetch, as before the trial


def _decoder(engine, live=True, **settings) -> SpeculativeDecoder:
    """A decoder that runs the trial where it applies (the default prefetches on every iteration)."""
    settings = {"prefetch_always": False, **settings}
    return SpeculativeDecoder(engine.model, get_method("ca+ae"), SpecSettings(draft_cap=4, **settings), COSTS, live=live)


def test_a_decoder_feeds_the_trial_its_iterations_and_keeps_ar_output():
    # an emulated tier with 20 ms a request: verification waits that long for each layer whose
    # experts the draft did not read ahead, and reads started at the draft's root land during it
    # (requests overlap their latencies), so prefetch makes a token cheaper
    ids = _ids()
    want = generate_ar(build_engine(str(DEFAULT_MODEL), "0.25", 256).model, ids, 40).tokens
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256, emulate_latency=20_000.0)
    dec = _decoder(engine, rate_guard=False)
    dec.trial = PrefetchTrial(trial=4, hold=100)
    result = dec.generate(ids, 40)
    assert result.tokens == want  # prefetch moves reads, never tokens
    on, off = dec.trial.sides[True], dec.trial.sides[False]
    assert on.iterations == off.iterations == 4
    assert on.tokens >= 4 and off.tokens >= 4  # at least the bonus token each
    assert off.rate > 20e-3 / 8  # held back: a verification waits ≥ 20 ms, for at most 8 tokens
    assert dec.trial.decisions and dec.trial.decisions[0]["prefetch"] and dec.trial.choice
    p = engine.cache.prefetch_stats
    assert p.gated > 0 and p.issued > 0  # held back in its off turns, read ahead in the rest
    # verification's reads of experts held back are counted as such, and the split still adds up
    assert p.missed_gated > 0
    split = p.missed_refused + p.missed_capped + p.missed_evicted + p.missed_unpredicted + p.missed_gated
    assert p.used + split == engine.cache.stats["verify"].misses
    engine.close()


def test_only_a_live_host_run_of_a_drafting_method_with_prefetch_tries():
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 64)
    assert isinstance(_decoder(engine).trial, PrefetchTrial)
    default = SpeculativeDecoder(engine.model, get_method("ca+ae"), SpecSettings(), COSTS, live=True)
    assert default.trial is None  # asked for only: by default every iteration prefetches
    assert _decoder(engine, live=False).trial is None  # fixed constants: the same decisions anywhere
    assert _decoder(engine, prefetch_always=True).trial is None
    assert _decoder(engine, prefetch=False).trial is None
    ar = SpeculativeDecoder(engine.model, get_method("ar"), SpecSettings(), COSTS, live=True)
    assert ar.trial is None
    engine.close()
    engine = build_engine(str(DEFAULT_MODEL), "1.0", 64)  # every expert resident: nothing to read ahead
    assert _decoder(engine).trial is None
    engine.close()
    dev = B.select_backend("cupy", module=fake_cupy.module)  # a device's compute is not the CPU's
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 64, backend=dev)
    assert _decoder(engine).trial is None
    engine.close()


def test_bench_records_the_trial_only_when_asked_for(tmp_path):
    cmd = [sys.executable, "-m", "s2moe.runtime.cli", "bench", "--methods", "s2moe", "-b", "0.25", "--n-prompts", "2",
           "--max-tokens", "24"]
    for extra, tried in (((), False), (("--prefetch-trial",), True), (("--prefetch-trial", "--always-prefetch"), False),
                         (("--prefetch-trial", "--no-live-costs"), False)):
        out = tmp_path / "b.json"
        r = subprocess.run(cmd + ["--json", str(out), *extra], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        trial = json.loads(out.read_text())["records"][0]["extra"]["prefetch_trial"]
        if tried:
            assert trial["prefetched_iterations"] > 0 and trial["held_back_iterations"] > 0
        else:
            assert trial is None
