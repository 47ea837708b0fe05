"""Live recalibration: the cost constants AE uses follow the passes a run makes. On synthetic
passes the estimator recovers known coefficients and follows a step change; on the default model
under an emulated slow tier whose bandwidth a test changes mid-run, the live T_exp (miss) follows
the new link within 10 % after 20 verification passes."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.live_costs import LiveCosts
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine

PRIOR = CostConstants(t_ar=5e-3, c_draft=3e-3, t_exp_miss=1e-3, t_exp_hit=5e-5, t_base=2e-3, t_token=3e-4)


def _passes(rng, n, miss):
    for _ in range(n):
        tokens, missing = int(rng.integers(1, 9)), int(rng.integers(0, 12))
        resident = int(rng.integers(8, 40))
        seconds = 2e-3 + 3e-4 * tokens + miss * missing + 5e-5 * resident
        yield tokens, missing, resident, seconds * (1 + 0.02 * rng.standard_normal())


def test_estimator_recovers_and_follows_a_step_change(rng):
    live = LiveCosts(PRIOR)
    for p in _passes(rng, 40, 4e-3):  # the device is 4× slower than the profile says
        live.observe_verify(*p)
    assert abs(live.current().t_exp_miss / 4e-3 - 1) < 0.05
    for p in _passes(rng, 20, 1.5e-3):  # the disk recovers: 20 passes later the estimate follows
        live.observe_verify(*p)
    assert abs(live.current().t_exp_miss / 1.5e-3 - 1) < 0.10
    assert live.drift()["t_exp_miss"] > 0.4  # still 1.5× the profile's: reported as drift
    for _ in range(30):
        live.observe_draft(0.012, 3)
    assert abs(live.current().c_draft / 4e-3 - 1) < 0.02


def test_without_passes_the_profile_is_returned():
    live = LiveCosts(PRIOR)
    now = live.current()
    assert (now.t_ar, now.c_draft, now.t_exp_miss, now.t_exp_hit) == (5e-3, 3e-3, 1e-3, 5e-5)
    assert set(live.drift().values()) == {0.0}


def test_a_single_token_verification_is_an_ar_step_for_t_ar():
    live = LiveCosts(PRIOR)
    live.observe_verify(3, 2, 10, 0.02)  # a draft of two: not an AR step
    assert live.t_ar.n == 0 and live.current().t_ar == PRIOR.t_ar
    live.observe_verify(1, 2, 10, 0.02)  # [root] alone: an empty draft's verification is one
    assert live.t_ar.n == 1
    assert live.current().t_ar == pytest.approx((0.02 + PRIOR.t_ar * live.prior_passes) / (1 + live.prior_passes))


def test_the_prior_weighs_each_feature_in_its_own_units():
    """By hand: n identical passes a = (1, 4, 3, 2) taking y. The prior adds p·mean(a_j²)·(θ_j −
    θ0_j)² per feature, so the fit moves every feature's share a_j·θ_j by the same u, and the
    predicted pass by 4u, u = W·e / (p + 4W): e = y − a·θ0, W = Σ decay^i the passes' weight."""
    p, half, n = 0.5, 10.0, 6
    live = LiveCosts(PRIOR, half_life=half, prior_passes=p)
    a, theta0 = np.array([1.0, 4.0, 3.0, 2.0]), live.theta0.copy()
    y = 1.1 * float(a @ theta0)  # 10 % off the profile: below the regime-change threshold (15 %)
    for _ in range(n):
        live.observe_verify(4, 3, 2, y)
    assert live.restarts == 0
    decay = 0.5 ** (1 / half)
    W = (1 - decay ** n) / (1 - decay)
    u = W * (y - a @ theta0) / (p + 4 * W)
    np.testing.assert_allclose(a * (live.coefficients() - theta0), np.full(4, u), rtol=1e-9)


def test_one_token_passes_give_the_miss_price_they_show(rng):
    """AR-like passes (one token, 16 expert uses: n_missing + n_resident is constant) from a device
    where a pass takes 5 ms + 3 ms a miss, after a profile that said 13.8 ms + 1.6 ms a token + 17 ms
    a miss (a slow tier's). Only the miss price's excess over the hit price and the whole pass are
    identified; the non-negative fit must keep both. Measured on the real disk: an unconstrained
    ridge fit clipped at 0 afterwards kept 9–14 ms a miss (a negative base and token price had paid
    for it), and AE, pricing a draft token's new experts at that, stopped drafting."""
    prior = CostConstants(t_ar=0.145, c_draft=4e-3, t_exp_miss=17e-3, t_exp_hit=0.0, t_base=13.8e-3, t_token=1.6e-3)
    live = LiveCosts(prior)
    for _ in range(30):
        missing = int(rng.integers(3, 15))
        live.observe_verify(1, missing, 16 - missing, (5e-3 + 3e-3 * missing) * (1 + 0.05 * rng.standard_normal()))
    base, token, miss, hit = live.coefficients()
    assert abs((miss - hit) / 3e-3 - 1) < 0.15, (miss, hit)
    for m in (3, 9, 14):  # and the passes it was shown are predicted within 10 %
        predicted = base + token + miss * m + hit * (16 - m)
        assert abs(predicted / (5e-3 + 3e-3 * m) - 1) < 0.10, (m, predicted)


def _run_until(decoder, ids, passes: int) -> None:
    goal = decoder.live.passes + passes
    for _ in range(40):
        if decoder.live.passes >= goal:
            return
        decoder.generate(ids, 24)
    raise AssertionError(f"only {decoder.live.passes} verification passes observed")


def test_live_miss_cost_follows_the_emulated_link_changed_mid_run():
    # a slow link (17 ms a miss, then 69 ms) so that fetch time, not compute, decides each pass: on
    # 2 cores shared with two busy processes, compute noise at 20 MB/s moved the estimate by 17 %
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256, emulate_bandwidth=10.0)
    expert = engine.cache.store.stored_bytes(0, 0)
    settings = SpecSettings(draft_topk=2, draft_cap=4, prefetch=False)  # no prefetch: misses wait whole
    decoder = SpeculativeDecoder(engine.model, get_method("ca"), settings, PRIOR, live=True)
    ids = [int(t) for t in np.random.default_rng(7).integers(0, 6000, 12)]
    _run_until(decoder, ids, 30)
    first = decoder.live.current()
    # one 10 MB/s transfer per miss. Loose here (compute bursts under load move this leg's slope by
    # up to ~9 %); the bugs it guards against are far off (the prior's 1 ms, a read priced per batch)
    assert abs(first.t_exp_miss / (expert / 10e6) - 1) < 0.25, (first.t_exp_miss, expert / 10e6)
    engine.emulation.bandwidth_mb_s = 2.5  # the link slows 4× mid-run
    _run_until(decoder, ids, 20)
    after = decoder.live.current()
    assert abs(after.t_exp_miss / (expert / 2.5e6) - 1) < 0.10, (after.t_exp_miss, expert / 2.5e6)


def test_decoder_uses_the_live_constants_and_keeps_them_fixed_without_live():
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256, emulate_bandwidth=20.0)
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 6000, 12)]
    settings = SpecSettings(draft_topk=2, draft_cap=4, prefetch=False)
    live = SpeculativeDecoder(engine.model, get_method("ca"), settings, PRIOR, live=True)
    live.generate(ids, 24)
    assert live.costs.source == "live" and live.costs == live.live.current()
    assert live.costs.t_exp_miss > 2 * PRIOR.t_exp_miss  # a 20 MB/s link: ~8.6 ms a miss, not 1 ms
    # live C_draft is per draft pass: the decayed mean of each drafting phase's seconds / passes
    samples, decay = live.metrics.draft_samples, live.live.decay
    total = weight = 0.0
    for passes, seconds in samples:
        total, weight = total * decay + seconds / passes, weight * decay + 1
    assert live.live.c_draft.n == len(samples) > 0 and max(p for p, _ in samples) > 1
    prior = live.live.prior_passes
    assert live.live.current().c_draft == pytest.approx((total + PRIOR.c_draft * prior) / (weight + prior))
    fixed = SpeculativeDecoder(engine.model, get_method("ca"), settings, PRIOR)
    fixed.generate(ids, 24)
    assert fixed.costs is PRIOR and fixed.live is None


def test_the_wait_for_prefetched_experts_is_a_running_mean_per_expert():
    live = LiveCosts(PRIOR)
    assert live.current().t_exp_inflight == 0.0  # the profile's: prefetches land during the draft
    for _ in range(30):
        live.observe_prefetch_wait(4, 0.02)  # 4 prefetched experts used, 20 ms waited for them
    live.observe_prefetch_wait(0, 1.0)  # a verification that used none says nothing
    assert abs(live.current().t_exp_inflight / 5e-3 - 1) < 0.02


def test_live_in_flight_cost_is_what_verification_waited_for_prefetches():
    # a 10 MB/s link: a prefetch needs ~17 ms, far longer than a draft pass, so verification
    # still waits for most of what the draft prefetched; AE must not price those as hits. Under
    # load, compute can slow 5× and let the prefetches land during the passes (a stress run saw
    # 1.9 ms waited per 17 ms read), so a short wait is retried once on a link 4× slower; a wait
    # that is not recorded at all fails both
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256, emulate_bandwidth=10.0)
    settings = SpecSettings(draft_topk=2, draft_cap=4)  # prefetch on
    ids = [int(t) for t in np.random.default_rng(7).integers(0, 6000, 12)]
    seen = []
    for mb_s in (10.0, 2.5):
        engine.emulation.bandwidth_mb_s = mb_s
        miss = engine.cache.store.stored_bytes(0, 0) / (mb_s * 1e6)
        decoder = SpeculativeDecoder(engine.model, get_method("ca"), settings, PRIOR, live=True)
        _run_until(decoder, ids, 10)
        assert engine.cache.prefetch_stats.used > 0 and decoder.live.inflight.n > 0
        seen.append((mb_s, decoder.costs.t_exp_inflight, miss, engine.cache.prefetch_stats.to_dict()))
        if decoder.costs.t_exp_inflight > 0.2 * miss:
            return
    raise AssertionError(f"verification waited too little for prefetched experts on either link: {seen}")


def test_the_start_up_estimate_prices_a_miss_at_one_expert_read():
    """Without a profile, `run` starts from estimated constants: a miss is a hit plus one expert's
    read (several read together, divided by their count). Under a 20 MB/s emulated link one read
    of a 168 KiB expert takes 8.6 ms; load only adds to it (hence the wider upper bound), and the
    bounds are far from the 4× a read priced per batch of four would give."""
    from s2moe.runtime.decoding.estimate import estimate_costs
    from s2moe.runtime.model.routing import RoutingPolicy

    engine = build_engine(str(DEFAULT_MODEL), "0.25", 64, emulate_bandwidth=20.0)
    read = engine.cache.store.stored_bytes(0, 0) / 20e6
    ratios = []
    for _ in range(3):  # the emulated link is a floor, so load can only raise the ratio: retry a high one
        costs = estimate_costs(engine.model, [5, 99, 1000, 42], RoutingPolicy(top_k=2))
        ratios.append((costs.t_exp_miss - costs.t_exp_hit) / read)
        assert ratios[-1] > 0.7, (costs, read)
        if ratios[-1] < 1.6:
            break
    else:
        raise AssertionError(f"a miss priced above 1.6 reads three times: {ratios}")
    engine.close()


def test_the_start_up_t_ar_is_what_the_run_s_ar_steps_cost_under_a_budget():
    """T_AR is an AR step of the run: a new token that reads what the cache does not hold. The old
    estimate timed a token again after a warm pass had made its experts resident, and so priced a
    step at hits only (0.6 ms against 2.8-3.1 ms at 25 % on this machine). Under a 20 MB/s link a
    read costs 8.6 ms, so the two differ by an order of magnitude and load cannot hide which."""
    from s2moe.runtime.decoding.estimate import estimate_costs
    from s2moe.runtime.model.routing import RoutingPolicy

    engine = build_engine(str(DEFAULT_MODEL), "0.25", 128, emulate_bandwidth=20.0)
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 6000, 16)]
    costs = estimate_costs(engine.model, ids, RoutingPolicy(top_k=2))
    ar = SpeculativeDecoder(engine.model, get_method("ar"), SpecSettings(), costs)
    ar.generate(ids, 12)
    steps = sorted(s[3] for s in ar.metrics.ar_samples)
    run = steps[len(steps) // 2]
    assert sum(s[1] for s in ar.metrics.ar_samples) > 0, "no AR step missed: the test shows nothing"
    assert 0.25 * run < costs.t_ar < 4 * run, (costs.t_ar, steps)
    # the draft reads only resident experts: its pass stays far below a step that reads
    assert costs.c_draft < 0.5 * costs.t_ar, costs
    engine.close()


@pytest.mark.parametrize("prompt", [[], [7], [7, 8, 9]])
def test_the_start_up_estimate_takes_prompts_shorter_than_its_steps(prompt):
    """The estimate prefills the context, then times steps on its next tokens: a prompt with fewer
    tokens than that is repeated (an empty one is token 0), never an error or an empty prefill."""
    from s2moe.runtime.decoding.estimate import estimate_costs
    from s2moe.runtime.model.routing import RoutingPolicy

    engine = build_engine(str(DEFAULT_MODEL), "0.25", 64)
    costs = estimate_costs(engine.model, prompt, RoutingPolicy(top_k=2))
    for name in ("t_ar", "c_draft", "t_exp_miss", "t_exp_hit"):
        value = getattr(costs, name)
        assert np.isfinite(value) and value > 0, (name, costs)
    engine.close()


def test_the_fits_solver_is_imported_before_decoding_not_in_the_first_verification():
    """Importing scipy.optimize takes about 0.5 s here: done in the first verification it landed in
    the decode time `s2moe run` reports (a 256-token run of the default model, 1.5 s against 1.0)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from s2moe.runtime.decoding.live_costs import LiveCosts\n"
            "from s2moe.runtime.decoding.cost_model import CostConstants\n"
            "assert 'scipy.optimize' not in sys.modules, 'imported with the module: every command pays it'\n"
            "LiveCosts(CostConstants(t_ar=5e-3, c_draft=3e-3, t_exp_miss=1e-3, t_exp_hit=5e-5))\n"
            "print('scipy.optimize' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"
