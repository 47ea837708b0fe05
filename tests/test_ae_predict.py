"""A draft token's two expert predictions in one C call (csrc/cpu/predict.c, `CpuOps.ae_predict`,
speculative.py `predictions`) against the NumPy path they replace (`_predicted_experts`): the same
experts for every gating setting, ties, and tier mask, and the same decoding run end to end."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine
from s2moe.runtime.kernels.cpu import CpuOps
from s2moe.runtime.model.routing import LayerRouting, RoutingRecord

COSTS = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)  # AE drafts


@pytest.fixture(scope="module")
def engine():
    e = build_engine(str(DEFAULT_MODEL), "0.25", 256)
    assert isinstance(e.model.ops, CpuOps), "the compiled kernels are part of the build (setup.py)"
    return e


def _record(rows: np.ndarray, layers, before: np.ndarray | None = None, after: np.ndarray | None = None) -> RoutingRecord:
    """A pass's routing record whose token t has the logits ``rows`` [layers, E], with the tokens
    ``before`` and ``after`` [n, layers, E] around it (a draft root's feed)."""
    rec = RoutingRecord()
    for i, (L, row) in enumerate(zip(layers, rows)):
        parts = [p[:, i] for p in (before,) if p is not None] + [row[None, :]] + [p[:, i] for p in (after,) if p is not None]
        rec.layers[L] = LayerRouting(np.concatenate(parts).astype(np.float32), np.zeros((1, 1), np.int64),
                                     np.ones((1, 1), np.float32))
    return rec


def _numpy_path(dec, rec, batch, t=0):
    shared = dec._logit_rows(rec, t)
    return dec._predicted_experts(rec, t, rows=shared), None if batch is None else dec._predicted_experts(rec, t, batch, shared)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the NumPy path on a row holding -inf
def test_one_call_predicts_what_the_numpy_path_predicts(engine):
    rng = np.random.default_rng(7)
    E = engine.model.config.num_experts
    cases = 0
    for trial in range(600):
        variant = ("resident", "paper", "code")[trial % 3]
        settings = SpecSettings(rg_variant=variant, rg_strength=float(rng.choice([0.0, 0.3, 1.0, 2.5])),
                                rg_residency=float(rng.choice([0.0, 0.1, 0.25, 1.0, 3.0])),
                                reuse_cap=int(rng.integers(1, 9)))
        method = get_method("s2moe", reuse_gating=bool(trial % 7))
        dec = SpeculativeDecoder(engine.model, method, settings, COSTS)
        layers = sorted(rng.choice(np.arange(6), size=int(rng.integers(1, 5)), replace=False).tolist())
        if trial % 4 == 0:  # few distinct values: ties everywhere, to the lower expert id on both paths
            rows = rng.integers(-2, 3, (len(layers), E)).astype(np.float32)
        elif trial % 4 == 1:  # a flat row: no spread in E*'s scaling
            rows = np.full((len(layers), E), rng.standard_normal(), np.float32)
        else:
            rows = (rng.standard_normal((len(layers), E)) * rng.uniform(0.1, 5)).astype(np.float32)
        if trial % 9 == 0:  # -inf scores, up to all but one: NaN in the gated and E* rows, ranked last on both paths
            rows[0, rng.permutation(E)[:int(rng.integers(1, E))]] = -np.inf
        if trial % 9 == 3:  # all but 1-3: the (k+1)-th score is -inf, so the raise is inf and unfavoured rows NaN
            rows[0, rng.permutation(E)[:E - 1 - trial % 3]] = -np.inf
        avail = rng.random((len(layers), E)) < rng.random()
        dec._available_rows = lambda ls, n, a=avail: a.copy()  # the tier, as both paths ask for it
        batch = None if trial % 5 == 0 else {(int(rng.choice(layers + [9])), int(rng.integers(E)))
                                              for _ in range(int(rng.integers(0, 30)))}
        t = trial % 3  # the token's row: after t others (a root's feed), or first of two (t = 0)
        before = rng.standard_normal((t, len(layers), E)) if t else None
        after = rng.standard_normal((1, len(layers), E)) if trial % 6 == 3 else None
        rec = _record(rows, layers, before, after)
        got = dec.predictions(rec, batch, t)
        assert got == _numpy_path(dec, rec, batch, t), trial
        cases += got[1] is not None and got[1] != got[0]
    assert cases > 100  # gating moved the prediction in many of them


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_one_call_matches_numpy_where_rows_are_many(engine):
    """40 layers of 160 experts: past 4096 scores the NumPy path's top-k partitions, then repairs
    ties (and NaN, from -inf logits) to the lower id; the one call must agree."""
    rng = np.random.default_rng(9)
    dec = SpeculativeDecoder(engine.model, get_method("s2moe"), SpecSettings(rg_residency=0.25), COSTS)
    layers, E = list(range(40)), 160
    for trial in range(30):
        rows = rng.integers(-3, 4, (40, E)).astype(np.float32) if trial % 2 else rng.standard_normal((40, E)).astype(np.float32)
        rows[rng.random(rows.shape) < 0.2 * (trial % 3)] = -np.inf
        avail = rng.random((40, E)) < 0.3
        dec._available_rows = lambda ls, n, a=avail: a.copy()
        batch = {(int(rng.integers(40)), int(rng.integers(E))) for _ in range(60)}
        rec = _record(rows, layers)
        assert dec.predictions(rec, batch) == _numpy_path(dec, rec, batch), trial


def test_the_one_call_is_taken_and_refuses_what_it_cannot_read(engine, monkeypatch):
    dec = SpeculativeDecoder(engine.model, get_method("s2moe"), SpecSettings(), COSTS)
    rows = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    calls = []
    real = CpuOps.ae_predict
    monkeypatch.setattr(CpuOps, "ae_predict", lambda self, *a: calls.append(a) or real(self, *a))
    dec.predictions(_record(rows, range(4)), {(0, 1), (7, 99)})  # a key of another layer is left out
    assert len(calls) == 1 and calls[0][3] is not None  # both predictions, one call
    from s2moe import _cpu
    good = ([rows[i] for i in range(4)], [0, 1, 2, 3], 32, 4, {(0, 1)}, 1.0, None, 0.0, 0)
    assert _cpu.ae_predict(*good)[1] is not None
    for at, bad in [(1, [0, 1, 2]), (2, 0), (2, 5000), (3, 33), (3, 0), (4, {(0, 32)}), (4, {(0, -1)}), (4, {"x"}),
                    (4, {(0, "x")}), (4, {(0, 1, 2)}), (6, np.zeros(5, bool)), (1, ["a", 1, 2, 3])]:
        args = list(good)
        args[at] = bad
        if at == 6:
            args[8] = 4
        with pytest.raises((ValueError, TypeError)):  # TypeError: a layer id that is not an int
            _cpu.ae_predict(*args)
    assert _cpu.ae_predict(*good[:4], {(-3, 99), (9, -1)}, *good[5:])[1] is not None  # other layers' keys: left out
    class Unhashable:  # a layer id that reads as an int but cannot be a set's member: found as the sets are built
        __hash__ = None

        def __index__(self):
            return 0

    with pytest.raises(TypeError):
        _cpu.ae_predict([rows[0]], [Unhashable()], 32, 4, None, 1.0, None, 0.0, 0)
    # rows it cannot read (short, float64, strided): None, and the decoder's NumPy path decides
    for rows_bad in ([rows[0], rows[1][:16], rows[2], rows[3]], [r.astype(np.float64) for r in rows],
                     [np.asfortranarray(np.tile(r, (2, 1)))[:, ::2] for r in rows]):
        assert _cpu.ae_predict(rows_bad, *good[1:]) is None
    assert _cpu.ae_predict(good[0], good[1], 33, *good[3:]) is None  # rows narrower than E
    strided = _record(rows, range(4))
    for L in range(4):
        strided.layers[L].logits = np.repeat(strided.layers[L].logits, 2, axis=1)[:, ::2]  # same values, not contiguous
    assert not strided.layers[0].logits.flags.c_contiguous
    assert dec.predictions(strided, {(0, 1)}) == _numpy_path(dec, _record(rows, range(4)), {(0, 1)})


@pytest.mark.parametrize("method", ["s2moe", "ca+ae"])
def test_a_decoding_run_is_the_same_on_either_path(method, monkeypatch):
    """Greedy, fixed constants: the same tokens, drafts, verifications and prefetches."""
    ids = [int(t) for t in np.random.default_rng(5).integers(10, 6000, 12)]

    def run():
        engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)
        result = SpeculativeDecoder(engine.model, get_method(method), SpecSettings(draft_cap=6), COSTS).generate(ids, 48)
        p, counts = engine.cache.prefetch_stats, result.metrics.to_dict(len(result.tokens))
        counts = {k: v for k, v in counts.items() if not k.endswith("seconds")}  # everything but time
        return result.tokens, counts, (p.issued, p.refused, p.borrowed, p.used)

    fast = run()
    monkeypatch.delattr(CpuOps, "ae_predict")
    reference = run()
    assert fast[1]["draft_passes"] > 10 and fast[2][0] > 0
    assert fast == reference


def test_a_greedy_draft_tokens_probability_is_softmaxs_bit_for_bit(engine):
    """`pick`'s NumPy path takes 1 / Σ exp(x − max) for the argmax instead of the whole softmax: the
    same bits. (The CPU kernels' pick is held to this path in tests/test_greedy_pick.py.)"""
    from s2moe.runtime.decoding.sampling import draws_for
    from s2moe.runtime.model.routing import softmax

    dec = SpeculativeDecoder(engine.model, get_method("s2moe"), SpecSettings(), COSTS)
    dec._greedy_pick = None  # the NumPy path
    rng = np.random.default_rng(3)
    for trial in range(300):
        x = (rng.standard_normal(int(rng.integers(1, 7000))) * rng.uniform(0.01, 40)).astype(np.float32)
        if trial % 7 == 0:
            x[rng.permutation(x.size)[:x.size // 2]] = -np.inf
        token, prob, dist = dec.pick(x, draws_for(dec.params), 0)
        assert token == int(np.argmax(x)) and dist is None
        assert prob == float(softmax(x.astype(np.float64))[token]), trial
