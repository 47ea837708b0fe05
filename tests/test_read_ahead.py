"""Reads a layer ahead inside verification (model/read_ahead.py, offload/read_ahead.py): the guess,
the workspace it reads into, what it leaves alone (the cache, gating's E*), and the decoder using it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli import s2moe
from test_offload import _HeldReads, _rank_above_guesses

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine
from s2moe.runtime.errors import UsageError
from s2moe.runtime.model.read_ahead import NextLayerGuess
from s2moe.runtime.offload.cache import ExpertCache

AE_DRAFTS = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)


def test_the_guess_is_the_next_layers_router_on_this_layers_input_rescaled_between_the_norms():
    model = build_engine(str(DEFAULT_MODEL), "0.25", 64).model
    c, W = model.config, model.W
    x = np.random.default_rng(0).standard_normal((3, c.hidden_size)).astype(np.float32)
    guess = NextLayerGuess(model)
    moe = [L for L in range(c.num_layers) if c.moe_layers[L]]
    for L, nxt in zip(moe, moe[1:]):
        # x = RMSNorm(h)·w_L, so RMSNorm(h)·w_next = x / w_L · w_next: the next router's input
        norm = lambda i: np.asarray(W[f"layers.{i}.ffn_norm"], np.float64)  # noqa: E731
        logits = (x / norm(L) * norm(nxt)) @ np.asarray(W[f"layers.{nxt}.router"], np.float64).T
        top = np.argsort(-logits, axis=1, kind="stable")[:, :2]  # [T, 2]
        want = list(dict.fromkeys((nxt, int(e)) for e in top.T.ravel()))  # every token's first choice first
        assert guess.guess(L, x, 2) == want
    assert guess.guess(moe[-1], x, 2) == []  # no MoE layer after the last


def test_guesses_queue_behind_the_layers_own_reads_and_the_next_layer_takes_them_without_a_second_read():
    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=4 * 48, window=4)
    _rank_above_guesses(cache, store, [(0, 0), (1, 0)])
    cache.read_ahead([(1, 0), (1, 5), (1, 6)])  # (1, 0) is resident: never read
    groups = cache.stream(0, [0, 1, 2])
    assert [e for e, _ in next(groups)] == [0]
    assert store.submitted == [(0, 1), (0, 2), (1, 5), (1, 6)]  # the layer's own reads first
    for f in store.futures.values():
        f.set_result(store.weights())
    assert sorted(e for g in groups for e, _ in g) == [1, 2]
    # the guesses are not the cache's and gating's E* never counts them
    assert (1, 5) not in cache.held and not cache.in_flight((1, 5))
    assert not cache.available_mask(1, 8)[5] and not cache.available_masks([1], 8)[0, 5]
    assert sorted(e for g in cache.stream(1, [0, 5]) for e, _ in g) == [0, 5]
    assert store.submitted.count((1, 5)) == 1  # taken as the read already made
    s = cache.ahead.stats
    assert (s.issued, s.used, s.wasted, s.wasted_bytes) == (2, 1, 1, 48)  # (1, 6): read for nothing
    assert cache.stats["read_ahead"].bytes_read == 48 and cache.report()["read_ahead"]["used"] == 1


def test_a_layer_with_nothing_to_read_starts_the_next_ones_guesses_and_a_running_read_is_left_to_land():
    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=2 * 48, window=4, prefetch_slots=8)
    _rank_above_guesses(cache, store, [(0, 0), (2, 0)])
    cache.read_ahead([(1, e) for e in (1, 2, 3, 4, 5)])
    assert [e for g in cache.stream(0, [0]) for e, _ in g] == [0]
    assert store.submitted == [(1, 1), (1, 2), (1, 3), (1, 4)]  # as many as the workspace lends
    assert cache.prefetch([(3, 1)]) == 0 and cache.prefetch_stats.refused == 1  # nothing left to borrow
    store.futures[(1, 1)].set_result(store.weights())
    store.futures[(1, 2)].set_running_or_notify_cancel()  # the disk has started it: it cannot be called back
    assert cache.resident_group(2, [0]) is not None  # the pass is past layer 1: its guesses go
    assert list(cache.ahead.reads) == [(1, 2)]  # landed and unstarted ones dropped, the running one left
    assert cache.ahead.stats.wasted == 3 and cache.ahead.stats.wasted_bytes == 48  # (only (1, 1) was read)
    assert cache.prefetch([(3, 1)]) == 1  # the workspace it left is lent again
    cache.settle_prefetches()
    assert list(cache.ahead.reads) == [(1, 2)]  # still being read: still counted against the workspace
    store.futures[(1, 2)].set_result(store.weights())
    cache.settle_prefetches()
    assert not cache.ahead.reads and cache.ahead.stats.wasted == 4


@pytest.mark.parametrize("window", [1, 2, 4])
def test_guesses_and_the_streams_beside_them_stay_within_the_plans_two_windows(window):
    """Every buffer alive once a read starts (reads in flight or landed and not yet let go, guesses
    included, and the group the caller computes on) stays within the 2 × window of experts the
    memory plan holds for streaming, through a layer that guesses and the next that takes them."""
    store = _HeldReads()
    cache = ExpertCache(store, capacity_bytes=2 * 48, window=window)
    _rank_above_guesses(cache, store, [(0, 0), (1, 0)])  # the cache is full of experts it keeps
    real_submit, alive, finished = store.submit, [], []

    def submit(layer, experts):  # reads land at once; count what is alive after each starts
        out = real_submit(layer, experts)
        for f in out:
            f.set_result(store.weights())
        alive.append(len(store.submitted) - len(finished) - cache.ahead.stats.wasted)
        return out

    store.submit = submit
    cache.read_ahead([(1, e) for e in range(1, 9)])
    for L in (0, 1):
        holding: list = []
        for group in cache.stream(L, list(range(7))):
            finished.extend(holding)  # the caller is done with the group before this one
            holding = [e for e, _ in group if e != 0]
        finished.extend(holding)
    assert max(alive) <= 2 * window
    s = cache.ahead.stats
    assert s.issued == cache.staging and s.used == min(cache.staging, 6)  # window 1 lends nothing
    assert len(store.submitted) == len(set(store.submitted))  # no expert read twice


def test_verification_reads_ahead_and_greedy_output_stays_ar():
    ids = [int(t) for t in np.random.default_rng(5).integers(10, 6000, 12)]
    want = generate_ar(build_engine(str(DEFAULT_MODEL), "0.25", 256).model, ids, 48).tokens
    for n in (1, 0):
        engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)
        settings = SpecSettings(draft_cap=4, prefetch=False, read_ahead=n)
        result = SpeculativeDecoder(engine.model, get_method("s2moe", reuse_gating=False), settings,
                                    AE_DRAFTS).generate(ids, 48)
        assert result.tokens == want
        s = engine.cache.ahead.stats
        if n:  # verification found next-layer guesses already read; each guess is accounted once
            assert s.used > 0 and s.issued == s.used + s.wasted + len(engine.cache.ahead)
            assert engine.cache.report()["read_ahead"]["used"] == s.used
        else:
            assert s.issued == 0
        assert engine.cache.resident_bytes <= engine.cache.capacity
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)  # gating on: its verification reads ahead too
    SpeculativeDecoder(engine.model, get_method("s2moe"), SpecSettings(draft_cap=4, prefetch=False),
                       AE_DRAFTS).generate(ids, 48)
    assert engine.cache.ahead.stats.used > 0


@pytest.mark.parametrize("command", ["run", "bench"])
def test_the_flag_reaches_the_settings_and_the_record(command, tmp_path):
    def said(*flags, method="s2moe"):
        if command == "run":
            r = s2moe("run", "--prompt", "def f(x):", "-n", "4", "--budget", "0.25", "--method", method, "--json", *flags)
            assert r.returncode == 0, r.stderr
            stats = json.loads(r.stdout)["stats"]
            return stats["read_ahead"], stats["offload"]["cache"]["read_ahead"]
        out = tmp_path / "r.json"
        r = s2moe("bench", "--methods", method, "--n-prompts", "1", "--max-tokens", "4", "--budget", "0.25",
                  "--json", str(out), *flags)
        assert r.returncode == 0, r.stderr
        rec = json.loads(out.read_text())["records"][-1]
        return rec["params"]["read_ahead"], rec["read_ahead"]

    assert said()[0] == SpecSettings.read_ahead == 1
    n, counts = said("--read-ahead", "0")
    assert n == 0 and counts["issued"] == 0
    assert said("--read-ahead", "2")[0] == 2
    assert said(method="ar")[0] == 0  # AR verifies nothing: it has no read ahead to record
    r = s2moe(command, *(["--prompt", "x"] if command == "run" else ["--methods", "s2moe", "--n-prompts", "1"]),
              "--read-ahead", "-1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--read-ahead -1: must be >= 0" in r.stderr.strip().splitlines()[-1]


def test_read_ahead_is_checked_like_every_setting():
    with pytest.raises(UsageError, match="--read-ahead -1: must be >= 0"):
        SpecSettings(read_ahead=-1).validate(8, 64)
    with pytest.raises(UsageError, match="--read-ahead 65"):
        SpecSettings(read_ahead=65).validate(8, 64)
