"""A greedy draft token in one C call (csrc/cpu/predict.c `greedy_pick`, `CpuOps.greedy_pick`)
against the NumPy pick it replaces (decoding/speculative.py `_pick`): the same token (NumPy's
argmax: the first maximum, the first NaN), its probability to 1e-6, NaN where NumPy's is NaN, on
both the AVX2 and the portable path; the decoder uses it, and a draft's tokens and probabilities
match the NumPy pick's."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe import _cpu
from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine
from s2moe.runtime.kernels.cpu import CpuOps

SIZES = (1, 2, 7, 8, 9, 15, 16, 17, 31, 255, 256, 257, 272, 6144, 50304)


def _numpy(logits: np.ndarray) -> tuple[int, float]:
    with np.errstate(invalid="ignore"):  # (inf − inf: NumPy's probability is NaN, as the kernel's)
        z = logits.astype(np.float64)
        z -= z.max()
        return int(np.argmax(logits)), float(1.0 / np.exp(z).sum())


@pytest.fixture(params=["avx2", "portable"])
def path(request):
    """Both paths of the kernel: the AVX2 one where this CPU has it, and the portable loop."""
    if request.param == "avx2" and not _cpu.use_simd(1):
        pytest.skip("this CPU has no AVX2: the portable path below covers the kernel")
    if request.param == "portable":
        _cpu.use_simd(0)
    yield request.param
    _cpu.use_simd(1)


def _agrees(logits: np.ndarray) -> None:
    token, p = CpuOps.greedy_pick(logits)
    want_token, want_p = _numpy(logits)
    assert token == want_token
    if np.isnan(want_p):
        assert np.isnan(p)
    else:
        assert p == pytest.approx(want_p, rel=1e-6, abs=0)


def test_random_logits_give_numpys_token_and_probability(path):
    rng = np.random.default_rng(7)
    for V in SIZES:
        for scale in (0.01, 1.0, 8.0, 40.0):
            _agrees((rng.standard_normal(V) * scale + rng.uniform(-50, 50)).astype(np.float32))


def test_ties_take_the_first_maximum_within_and_across_blocks(path):
    rng = np.random.default_rng(8)
    for V in (16, 40, 300, 6144):
        for _ in range(20):
            x = rng.standard_normal(V).astype(np.float32)
            at = np.sort(rng.choice(V, size=min(4, V), replace=False))
            x[at] = 9.0  # several equal maxima, sometimes in one 8-value block
            _agrees(x)
            assert CpuOps.greedy_pick(x)[0] == at[0]
    x = np.zeros(64, np.float32)  # every value equal: token 0, probability 1/V
    assert CpuOps.greedy_pick(x) == (0, pytest.approx(1 / 64, rel=1e-6))


def test_nan_inf_and_masked_rows(path):
    rng = np.random.default_rng(9)
    for V in (5, 16, 37, 6144):
        x = rng.standard_normal(V).astype(np.float32)
        for at in sorted({0, V // 3, V - 1}):  # NumPy's argmax: the first NaN; the probability NaN
            y = x.copy()
            y[at] = np.nan
            y[-1] = np.nan
            _agrees(y)
        y = x.copy()
        y[V // 2] = np.inf  # a +inf maximum: NumPy's z holds inf − inf
        _agrees(y)
        y = np.full(V, -np.inf, np.float32)  # a draft head's logits outside its rows are −inf
        keep = rng.choice(V, size=max(1, V // 4), replace=False)
        y[keep] = x[keep]
        _agrees(y)
        _agrees(np.full(V, -np.inf, np.float32))  # nothing finite: token 0, probability NaN


def test_other_arrays_go_to_the_numpy_pick():
    assert CpuOps.greedy_pick(np.zeros(8, np.float64)) is None
    assert CpuOps.greedy_pick(np.zeros((8, 2), np.float32)[:, 0]) is None  # not contiguous
    assert CpuOps.greedy_pick(np.zeros(0, np.float32)) is None
    with pytest.raises(ValueError):
        _cpu.greedy_pick(np.zeros(0, np.float32))


def test_a_draft_picks_with_the_kernel_as_with_numpy():
    """The same greedy run, the kernel's pick against NumPy's: the same tokens, and the draft's
    token probabilities (what AE prices and learns from) within 1e-6."""
    costs = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 6000, 12)]
    runs = []
    for kernel in (True, False):  # a fresh cache each: the draft routes among resident experts
        engine = build_engine(str(DEFAULT_MODEL), "0.25", 256)
        try:
            dec = SpeculativeDecoder(engine.model, get_method("ca"), SpecSettings(draft_topk=2), costs)
            assert dec._greedy_pick is not None  # the CPU kernels' pick is wired in
            calls = []
            if kernel:
                fast = dec._greedy_pick
                dec._greedy_pick = lambda x: calls.append(1) or fast(x)
            else:
                dec._greedy_pick = None
            probs = []
            chain = dec._draft_chain

            def record(*a, **k):
                d = chain(*a, **k)
                probs.extend(d.token_probs)
                return d

            dec._draft_chain = record
            runs.append((dec.generate(prompt, 40).tokens, probs, len(calls)))
        finally:
            engine.close()
    (tokens, probs, used), (tokens_np, probs_np, _) = runs
    assert tokens == tokens_np and used > 0 and len(probs) == len(probs_np) > 0
    assert np.allclose(probs, probs_np, rtol=1e-6, atol=0)
