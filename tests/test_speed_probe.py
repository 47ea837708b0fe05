"""Validation tells drift from model error: the speed probe, and replays that read as runs read.

The end-to-end cases run profile then validate on the tiny model behind an emulated slow tier
(2 ms a request), so a pass's time is mostly the tier's waits and the verdicts do not hang on
this machine's noise."""

from __future__ import annotations

import gc
import json
import time

import numpy as np
import pytest

from s2moe.calib import speed_probe
from s2moe.calib.replay import WeightPool
from s2moe.calib.validate_cmd import Bars, bias_by_group, run_validation
from s2moe.runtime.decoding.cost_model import CostConstants

from test_calib import WORKLOAD, calib_model  # noqa: F401  (the fixture)

LATENCY_US = 2000.0


COSTS = CostConstants(t_ar=0.02, c_draft=0.002, t_exp_miss=1e-3, t_exp_hit=1e-4, t_base=1e-3, t_token=1e-4)
PASSES = [{"n_tokens": 4, "n_missing": m, "n_resident": 12 - m} for m in (0, 2, 4, 8, 12)]


def summary(compute_ms: float, reads_ms: float | None = None, se: float = 1.0) -> dict:
    return {"compute": {"ms": compute_ms, "se_percent": se, "n_tokens": 4, "n_missing": 0, "n_resident": 12},
            "reads": {"ms": 2 * compute_ms if reads_ms is None else reads_ms, "se_percent": se, "n_tokens": 4,
                      "n_missing": 12, "n_resident": 0}}


def compare(now: dict, fit_ratio: float, at: dict | None = None) -> dict:
    return speed_probe.compare(summary(10.0) if at is None else at, now, fit_ratio, COSTS, PASSES)


@pytest.mark.parametrize("probe_now, fit_ratio, drift, verdict", [
    (10.0, 1.02, False, "agrees"),  # nothing moved
    (10.3, 0.97, False, "agrees"),  # both within the threshold
    (10.0, 1.40, False, "model error"),  # the passes are slower, the machine is not
    (14.0, 1.40, True, "drift"),  # the machine is as much slower as the passes
    (14.0, 1.00, True, "agrees"),  # the machine moved, the fit did not: nothing to explain
    (14.0, 2.00, True, "model error"),  # drift explains part of the bias only
    (7.0, 0.70, True, "drift"),  # faster, both
    (10.49, 1.062, True, "drift"),  # the probe moved 4.9 %, under the threshold, and explains a 6.2 % bias
    (10.1, 1.055, False, "model error"),  # a bias just past the threshold, the probe barely moved
    (9.4, 1.08, True, "model error"),  # the probe moved the other way
])
def test_probe_calls_a_bias_drift_only_where_it_moved_as_much(probe_now, fit_ratio, drift, verdict):
    got = compare(summary(probe_now), fit_ratio)
    assert got["drift"] is drift and got["verdict"] == verdict
    assert got["ratio"] == pytest.approx(probe_now / 10.0, abs=1e-4)


def test_each_pass_expects_the_drift_of_its_own_mix():
    """The disk slowed (reads ×1.5), compute did not: a pass of misses only expects ×1.5, a pass
    with none ×1.0, and one between in proportion to its predicted miss time."""
    ratios, scale = speed_probe.expected_ratios(summary(10.0), summary(10.0, 30.0), COSTS, PASSES)
    assert ratios == {"compute": 1.0, "reads": 1.5}
    assert scale[0] == pytest.approx(1.0) and scale[-1] == pytest.approx(1.5)
    assert np.all(np.diff(scale) > 0)  # more misses, more of the reads' drift
    as_expected = float(np.median(scale))  # the passes as slow as their own mixes say: drift
    slow_disk = compare(summary(10.0, 30.0), as_expected)
    assert slow_disk["verdict"] == "drift" and slow_disk["ratio"] == pytest.approx(as_expected, abs=1e-4)
    assert compare(summary(10.0, 30.0), 1.0)["verdict"] == "agrees"  # a slower disk the passes did not feel
    slow_cpu = compare(summary(15.0, 20.0), as_expected)  # compute slowed instead: the same bias is not explained
    assert (slow_cpu["compute_ratio"], slow_cpu["reads_ratio"]) == (1.5, 1.0)
    assert slow_cpu["ratio"] < as_expected


def test_probe_noise_widens_the_drift_threshold():
    calm = compare(summary(10.8, se=0.5), 1.0, summary(10.0, se=0.5))
    noisy = compare(summary(10.8, se=4.0), 1.0, summary(10.0, se=4.0))
    assert calm["drift"] and calm["verdict"] == "agrees"  # the probe moved 8 %: beyond its noise
    assert not noisy["drift"] and noisy["threshold_percent"] > 15  # within 3 standard errors of two noisy probes
    # a noisy probe still explains a bias it roughly follows, and a 7 % bias is still a bias
    assert compare(summary(11.3, se=4.0), 1.07, summary(10.0, se=4.0))["verdict"] == "drift"
    assert compare(summary(10.0, se=4.0), 1.07, summary(10.0, se=4.0))["verdict"] == "model error"
    assert speed_probe.compare(None, summary(10.0), 1.5)["verdict"] == "unknown"  # an older profile


def test_probe_summary_is_the_median_of_the_copies_fastest():
    class P:
        def __init__(self, times, missing):
            self.times, self.n_missing, self.n_resident, self.tokens = times, missing, 5, [1, 2, 3, 4]

        @property
        def seconds(self):
            return min(self.times)

    got = speed_probe.summarize({"compute": [P([0.004, 0.003], 0), P([0.002, 0.005], 0), P([0.010, 0.030], 0)],
                                 "reads": [P([0.02], 7)]})
    assert got["compute"]["ms"] == pytest.approx(3.0) and got["compute"]["copies"] == 3
    assert got["compute"]["se_percent"] > 0 and got["reads"]["n_missing"] == 7 and got["reads"]["n_tokens"] == 4
    assert speed_probe.summarize({"compute": [], "reads": []}) is None


def test_bias_by_group_splits_batches_and_misses():
    samples = [{"n_tokens": n, "n_missing": m} for n, m in [(1, 0), (3, 2), (3, 12), (6, 12)]]
    rows = {r["group"]: r for r in bias_by_group(samples, np.array([0.0, 0.1, 0.2, 0.4]))}
    assert rows["1 token"]["n"] == 1 and rows["2-4 tokens"]["median_residual_percent"] == pytest.approx(15.0)
    assert rows["9+ misses"]["n"] == 2 and rows["9+ misses"]["median_residual_percent"] == pytest.approx(30.0)
    assert rows["no misses"]["median_residual_percent"] == 0.0


def test_pooled_weights_give_the_read_buffers_back(calib_model):  # noqa: F811
    """A replay's pool holds copies: the store's read buffers go back to its pool, as in a run.
    (Holding the buffers themselves made every replay's reads map fresh memory: 1.2-1.8x slower.)"""
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.offload.store import ExpertStore

    loaded = load_model(calib_model)
    store = ExpertStore(loaded, direct=True, threads=1, pool_bytes=64 << 20)
    bufs = store.reader.pool
    pool = WeightPool()
    originals = {(0, e): store.read(0, e) for e in range(3)}
    assert bufs is not None and bufs.outstanding > 0
    for key, w in originals.items():
        pool.offer(key, w)
    copies = {k: (pool.weights[k].gate.data.copy(), pool.weights[k].down.data.copy()) for k in originals}
    for key, w in originals.items():  # the copies hold the same bytes, in memory of their own
        assert np.array_equal(copies[key][0], w.gate.data) and np.array_equal(copies[key][1], w.down.data)
        assert not np.shares_memory(pool.weights[key].gate.data, w.gate.data)
        assert pool.weights[key].nbytes == w.nbytes  # counted as the run counts it
    del originals, w
    gc.collect()
    assert bufs.outstanding == 0  # every buffer is back for the next read to reuse
    store.close()


@pytest.fixture(scope="module")
def slow_tier_profile(calib_model, tmp_path_factory):  # noqa: F811
    from s2moe.calib.profile_cmd import run_profile
    from s2moe.runtime.profile import save_profile

    path = str(tmp_path_factory.mktemp("probe") / "slow.json")
    data = run_profile(calib_model, "cpu", "0.5", WORKLOAD, path, None, 20, 50.0, LATENCY_US, 1, 4,
                       rounds=3, n_prompts=4)
    save_profile(path, data)
    return path


def _validate(path: str) -> dict:
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer
    from s2moe.runtime.profile import load_profile

    prof = load_profile(path)
    loaded = load_model(prof.data["model"]["path"])
    return run_validation(prof, loaded, load_tokenizer(loaded), WORKLOAD, 4, 12, 3, Bars(), True)[0]


def test_a_cost_left_out_of_the_fit_is_model_error_not_drift(slow_tier_profile, monkeypatch):
    """Validate's gated passes pay 6 ms more than profile's did (say, gating's own work); the
    reference pass (plain routing) does not: the probe sees no drift and the bias is the model's."""
    from s2moe.runtime.model.forward import MoEModel

    probe = json.load(open(slow_tier_profile))["cost_model"]["fit"]["probe"]
    reads, compute = probe["reads"], probe["compute"]  # one pass that reads, one that only computes
    assert compute["n_missing"] == 0 and reads["n_missing"] > 0
    pinned = {tuple(k) for k in json.load(open(slow_tier_profile))["hot_experts"]["gpu_experts"]}
    assert reads["n_resident"] <= len(pinned)  # only pinned experts are hits: every other one is read
    assert reads["n_missing"] + reads["n_resident"] == compute["n_resident"]
    assert reads["ms"] > compute["ms"] + LATENCY_US / 1e3
    original = MoEModel._pass

    def gated_costs_more(self, tokens, kv, start, policy, *args, **kwargs):
        if policy.selection_bias is not None:
            time.sleep(0.006)
        return original(self, tokens, kv, start, policy, *args, **kwargs)

    monkeypatch.setattr(MoEModel, "_pass", gated_costs_more)
    got = _validate(slow_tier_profile)
    assert got["fit_ratio"] > 1.3, got["fit_ratio"]  # the passes did pay it
    # the probes did not (the tiny model's compute probe is a fraction of a millisecond and may
    # wobble past 5 % on a busy machine, so "moved" is not asserted: what they explain is)
    probe = got["probe"]
    assert probe["verdict"] == "model error" and probe["ratio"] < 1.15, json.dumps(probe)
    assert not got["passed"]
    if "drift_adjusted" in got:  # only where a probe moved, and then scaled by the probes' drift
        assert got["drift_adjusted"]["probe_ratio"] == probe["ratio"]


def test_a_slower_tier_between_profile_and_validate_is_drift(slow_tier_profile, tmp_path):
    """The tier's latency tripled after profile: the probe, which reads, moves with the passes."""
    data = json.load(open(slow_tier_profile))
    data["offload"]["emulation"]["latency_us"] = 3 * LATENCY_US
    slower = tmp_path / "slower.json"
    slower.write_text(json.dumps(data))
    got = _validate(str(slower))
    assert got["probe"]["drift"] is True and got["probe"]["ratio"] > 1.5, got["probe"]
    assert got["fit_ratio"] > 1.3
    assert got["drift_adjusted"]["probe_ratio"] == got["probe"]["ratio"]  # labelled with the probe's ratio


def test_default_bars_meet_the_noise_and_given_bars_stay():
    from s2moe.calib.validate_cmd import meets

    noisy = {"noise_ceiling_r2": 0.93, "noise_mape_floor_percent": 8.0}
    bar = Bars().within_noise(noisy)  # a perfect model scores about the ceiling and the floor
    assert bar["r2"] == pytest.approx(0.88) and bar["mape_percent"] == pytest.approx(12.0) and bar["within_noise"]
    calm = Bars().within_noise({"noise_ceiling_r2": 1.0, "noise_mape_floor_percent": 1.0})  # no noise
    assert (calm["r2"], calm["mape_percent"], calm["within_noise"]) == (0.95, 5.0, False)
    asked = Bars(0.99, 2.0, 3.0).within_noise(noisy)  # a bar given on the command line is kept
    assert (asked["r2"], asked["mape_percent"], asked["bias_percent"]) == (0.99, 2.0, 3.0)
    good = {"r2": 0.9, "mape_percent": 9.0, "residual_percent_p50": 1.0}
    assert meets(good, bar)
    assert not meets({**good, "residual_percent_p50": -6.0}, bar)  # a bias fails whatever the noise
    assert not meets({**good, "r2": 0.85}, bar) and not meets({**good, "mape_percent": 13.0}, bar)
