"""A prompt's MoE layer (csrc/cpu/ops.c `op_moe`): each expert's inputs are quantised once per phase
and shared by every pool chunk, which must give the bits of quantising them in each chunk, and the
NumPy reference's values."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.runtime.kernels import ExpertAct, cpu
from s2moe.runtime.kernels.reference import ReferenceOps
from s2moe.runtime.kernels.stored import StoredMatrix
from s2moe.runtime.offload.experts import ExpertWeights


def _matrix(rng, dtype: str, rows: int, cols: int) -> StoredMatrix:
    from test_kernels import random_matrix  # valid random blocks of any stored type

    return random_matrix(rng, dtype, rows, cols)


# one type for the three matrices, and the Q4_K_M mix (Q4_K gate/up, Q6_K down); Q4_0 takes dot.c's
# own int8 path, outside the shared batches: it must be untouched
MIXES = [("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q6_K", "Q6_K"), ("Q5_0", "Q5_0", "Q4_K"), ("Q4_0", "Q4_0", "Q4_0"),
         ("Q4_K", "Q4_K", "Q4_0")]


@pytest.mark.parametrize("mix", MIXES)
def test_shared_quantised_inputs_give_the_per_chunk_bits(mix, rng):
    from s2moe import _cpu

    I, H, T, n = 256, 512, 96, 6
    experts = [ExpertWeights(_matrix(rng, mix[0], I, H), _matrix(rng, mix[1], I, H), _matrix(rng, mix[2], H, I))
               for _ in range(n)]
    x = rng.standard_normal((T, H)).astype(np.float32)
    choice = np.stack([rng.choice(n, 3, replace=False) for _ in range(T)])  # 3 experts a token
    groups = [(w, np.flatnonzero((choice == e).any(1)).astype(np.int32), rng.random(T).astype(np.float32))
              for e, w in enumerate(experts)]
    groups = [(w, r, mix_w[:r.size]) for w, r, mix_w in groups]
    ops, act = cpu.CpuOps(threads=2), ExpertAct()
    base = rng.standard_normal((T, H)).astype(np.float32)
    outs = {}
    try:
        for on in (1, 0):
            _cpu.act_once(on)
            outs[on] = ops.experts(x, groups, act, base.copy())
    finally:
        _cpu.act_once(1)
    assert np.array_equal(outs[1], outs[0])
    want = ReferenceOps().experts(x, groups, act, base.copy())
    assert np.abs(outs[1] - want).max() <= 2e-2 * np.abs(want - base).max()  # int8 activations' error


@pytest.mark.parametrize("dtype", ["Q4_K", "Q6_K", "IQ4_XS", "Q5_1", "Q8_0"])
def test_a_batch_product_quantises_its_tokens_once_with_the_same_bits(dtype, rng):
    """op_matmul: a prompt's tokens quantised once for every pool chunk (Q8_0: dot.c's own path)."""
    from s2moe import _cpu

    from test_kernels import random_matrix

    W, ops = random_matrix(rng, dtype, 768, 512), cpu.CpuOps(threads=2)
    x = rng.standard_normal((40, 512)).astype(np.float32)
    outs = {}
    try:
        for on in (1, 0):
            _cpu.act_once(on)
            outs[on] = ops.linear(x, W)
    finally:
        _cpu.act_once(1)
    assert np.array_equal(outs[1], outs[0])
    want = ReferenceOps().linear(x, W)
    assert np.abs(outs[1] - want).max() <= 2e-2 * np.abs(want).max()


def _skewed(rng, dtype="Q4_K", n=6, T=80, H=512, I=256):
    from test_kernels import random_matrix

    experts = [ExpertWeights(random_matrix(rng, dtype, I, H), random_matrix(rng, dtype, I, H),
                             random_matrix(rng, "Q6_K", H, I)) for _ in range(n)]
    x = rng.standard_normal((T, H)).astype(np.float32)
    sizes = [T - 3, 9, 1, min(40, T), 2, 5][:n]  # one expert takes nearly every token, as a late layer of a random model
    groups = [(w, np.sort(rng.choice(T, s, replace=False)).astype(np.int32), rng.random(s).astype(np.float32))
              for w, s in zip(experts, sizes)]
    return x, groups


def test_chunks_split_by_work_give_the_bits_of_chunks_split_by_rows(rng):
    from s2moe import _cpu

    x, groups = _skewed(rng)
    ops, act = cpu.CpuOps(threads=2), ExpertAct()
    outs = {}
    try:
        for on in (1, 0):
            _cpu.moe_balance(on)
            outs[on] = ops.experts(x, groups, act, np.zeros_like(x))
    finally:
        _cpu.moe_balance(1)
    assert np.array_equal(outs[1], outs[0])
    want = ReferenceOps().experts(x, groups, act, np.zeros_like(x))
    assert np.abs(outs[1] - want).max() <= 2e-2 * np.abs(want).max()


def test_threads_keep_their_own_scratch(rng):
    """Kernels reuse a per-thread scratch between calls: callers on several threads at once, each
    with its own sizes, get what one caller alone gets."""
    import threading

    ops, act = cpu.CpuOps(threads=2), ExpertAct()
    cases = [_skewed(np.random.default_rng(s), T=T) for s, T in ((1, 80), (2, 80), (3, 120), (4, 120))]
    alone = [ops.experts(x, g, act, np.zeros_like(x)) for x, g in cases]
    got, errors = [None] * len(cases), []

    def work(i):
        try:
            for _ in range(40):
                x, g = cases[i]
                got[i] = ops.experts(x, g, act, np.zeros_like(x))
                assert np.array_equal(got[i], alone[i])
        except Exception as exc:  # (reported below: an assertion in a thread would be lost)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
