"""Reuse-aware gating's bias in one C call (csrc/cpu/predict.c `reuse_bias`, `CpuOps.reuse_bias`)
against the NumPy path it replaces (decoding/gating.py `ReuseGating.bias`): the same bits for the
"paper" and "resident" variants over batch sizes, expert counts, ties, NaN, non-positive weights and
tier masks; "code" keeps the NumPy path; a gated S²-MoE run gives the same tokens either way."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.gating import ReuseGating
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine
from s2moe.runtime.kernels.cpu import CpuOps


@pytest.fixture(scope="module")
def ops():
    return CpuOps(threads=1)


def _both(ops, logits, conf, variant="resident", k=4, cap=8, strength=1.0, rho=0.25, avail=None):
    def gating(kernel):
        return ReuseGating(k, cap, variant, strength, conf, rho, (lambda L: avail) if avail is not None else None,
                           kernel)
    return gating(None).bias(3, logits), gating(ops.reuse_bias).bias(3, logits)


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if not (a.dtype == b.dtype == np.float32 and a.shape == b.shape):
        return False
    nan = np.isnan(a)  # (a NaN logit's row: λ is NaN on both, a NaN's sign bit may differ, and no rule reads it)
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def test_the_kernel_gives_the_numpy_bits_over_random_batches(ops):
    rng = np.random.default_rng(0)
    checked = biased = 0
    for trial in range(600):
        B = int(rng.integers(2, 18))
        E = int(rng.choice([8, 16, 32, 64, 128]))
        k = int(rng.integers(1, min(E - 1, 8) + 1))
        cap = int(rng.integers(0, E + 2))
        logits = rng.standard_normal((B, E)).astype(np.float32) * float(rng.choice([0.1, 1.0, 30.0]))
        if trial % 5 == 0:  # ties: few distinct values
            logits = rng.integers(-2, 3, (B, E)).astype(np.float32)
        if trial % 17 == 0:  # a NaN in the router's output
            logits[rng.integers(B), rng.integers(E)] = np.nan
        conf = rng.random(B)
        if trial % 7 == 0:
            conf[rng.random(B) < 0.5] = 0.0
        if trial % 29 == 0:
            conf[:] = -rng.random(B)  # no positive weight: no bias
        avail = rng.random(E) < rng.random() if trial % 3 else None
        variant = "paper" if trial % 4 == 0 else "resident"
        strength = float(rng.choice([0.5, 1.0, 2.5, 0.3, 1.7]))  # 0.3, 1.7: not float32 values
        rho = float(rng.choice([0.0, 0.25, 1.0, 3.0]))
        ref, got = _both(ops, logits, conf, variant, k, cap, strength, rho, avail)
        assert _same(ref, got), (trial, B, E, k, cap, variant, ref, got)
        checked += 1
        biased += ref is not None
    assert checked == 600 and biased > 400  # most trials produce a bias: the comparison is not of Nones


def test_equal_logits_give_no_bias_and_code_keeps_the_numpy_path(ops):
    flat = np.ones((4, 16), dtype=np.float32)
    ref, got = _both(ops, flat, np.ones(4))
    assert ref is None and got is None  # every gap is 0: λ = 0
    calls = []
    rg = ReuseGating(2, 4, "code", 1.0, np.ones(4), 0.25, None, lambda *a: calls.append(a))
    rg.bias(0, np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32))
    assert calls == []  # "code" weights are float32 router peakedness: the NumPy path's types


def test_bad_arguments_raise(ops):
    from s2moe import _cpu

    lg = np.zeros((3, 8), np.float32)
    out = np.empty_like(lg)
    with pytest.raises(ValueError):
        _cpu.reuse_bias(lg, np.ones(3, np.float32), 2, 4, 1.0, 0.0, None, out)  # w must be float64
    with pytest.raises(ValueError):
        _cpu.reuse_bias(lg, np.ones(3), 8, 4, 1.0, 0.0, None, out)  # k ≥ E
    with pytest.raises(ValueError):
        _cpu.reuse_bias(lg, np.ones(3), 2, 4, 1.0, 0.0, np.ones(7, np.uint8), out)  # avail of 7
    with pytest.raises(ValueError):
        _cpu.reuse_bias(lg, np.ones(3), 2, 4, 1.0, 0.0, None, np.empty((3, 7), np.float32))


def test_a_gated_run_gives_the_same_tokens_with_the_kernel_and_without():
    engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)
    costs = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 6000, 12)]
    outs, used = [], []
    for kernel in (True, False):
        ops = engine.model.ops
        saved = ops.reuse_bias
        calls = []
        ops.reuse_bias = (lambda *a, _f=saved: calls.append(1) or _f(*a)) if kernel else None
        try:
            dec = SpeculativeDecoder(engine.model, get_method("s2moe"), SpecSettings(draft_topk=2), costs)
            outs.append(dec.generate(prompt, 48).tokens)
        finally:
            ops.reuse_bias = saved
        used.append(len(calls))
    engine.close()
    assert outs[0] == outs[1]
    assert used[0] > 0 and used[1] == 0
