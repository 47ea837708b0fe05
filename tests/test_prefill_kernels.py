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
