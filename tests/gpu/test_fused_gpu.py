"""The fused decode kernels (csrc/decode.cuh, csrc/quant.cuh) on a real GPU at real widths, against
the NumPy reference on the same stored blocks: every weight type the device reads in place, the
Q4_K_M mix in one launch, 1–16 tokens, grouped experts of OLMoE-1B-7B's shape, GPT-OSS's.

Skipped, with the reason, where CuPy or a CUDA device is missing (CI runs the same kernels on the
CPU stand-in: tests/test_fused_kernels.py); `python benchmarks/gpu.py` runs this on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.runtime.kernels import ExpertAct
from s2moe.runtime.kernels.backend import cuda_unusable_reason
from s2moe.runtime.kernels.device import WEIGHT_TYPES, DeviceOps
from s2moe.runtime.kernels.reference import ReferenceOps
from s2moe.runtime.kernels.stored import StoredMatrix
from s2moe.runtime.offload.experts import ExpertWeights

REASON = cuda_unusable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"GPU test: {REASON}")
FLOATS = ("F32", "F16", "BF16")
Q4_K_M = ("Q4_K", "Q4_K", "Q6_K")


@pytest.fixture
def gpu(monkeypatch):
    from s2moe.runtime.kernels.backend import select_backend

    monkeypatch.setenv("S2MOE_FLOAT_ACTIVATIONS", "1")  # the reference: dequantised blocks · float32 x
    dev = select_backend("cupy")
    return dev, DeviceOps(dev, "GPU test")


def _matrix(rng, dtype: str, rows: int, cols: int) -> StoredMatrix:
    if dtype in FLOATS:
        return StoredMatrix.from_float(rng.standard_normal((rows, cols)) / np.sqrt(cols), dtype)
    from benchmarks.real_models import _blocks, _unit_std

    return StoredMatrix(_blocks(rng, dtype, rows * cols, 1 / np.sqrt(cols) / _unit_std(dtype)), dtype, (rows, cols))


def _close(got, want, rel=1e-3):
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= rel, err


@pytest.mark.parametrize("dtypes", [(t,) * 3 for t in WEIGHT_TYPES] + [Q4_K_M])
@pytest.mark.parametrize("T", [1, 9, 16])
def test_fused_products_on_stored_blocks_match_numpy(gpu, dtypes, T):
    import cupy as cp

    dev, ops = gpu
    rng = np.random.default_rng(T)
    K = 2048
    x = rng.standard_normal((T, K)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, K).astype(np.float32)
    mats = [_matrix(rng, d, n, K) for d, n in zip(dtypes, (2048, 512, 512))]
    y = ops.linear_parts(cp.asarray(x), [(dev.to_device(m), None) for m in mats], norm=(cp.asarray(norm), 1e-6))
    assert y is not None  # the fused kernel took it
    xn = ReferenceOps().rms_norm(x, norm, 1e-6)
    _close(cp.asnumpy(y), np.concatenate([ReferenceOps().linear(xn, m) for m in mats], 1))


@pytest.mark.parametrize("dtypes,act,H,I", [(Q4_K_M, ExpertAct(), 2048, 1024), (("Q8_0",) * 3, ExpertAct(), 2048, 1024),
                                            (("MXFP4",) * 3, ExpertAct("swiglu_clamped", 1.702, 7.0), 2880, 2880)])
def test_grouped_experts_at_real_shapes_match_numpy(gpu, dtypes, act, H, I):
    import cupy as cp

    dev, ops = gpu
    rng = np.random.default_rng(1)
    T, E, k = 9, 12, 8  # a verification batch choosing 8 of 12 experts each
    bias = act.kind == "swiglu_clamped"
    host = [ExpertWeights(*(_matrix(rng, d, *s) for d, s in zip(dtypes, ((I, H), (I, H), (H, I)))),
                          *((rng.standard_normal(n).astype(np.float32) for n in (I, I, H)) if bias else ()))
            for _ in range(E)]
    choice = [rng.choice(E, k, replace=False) for _ in range(T)]
    tokens = [[t for t in range(T) if e in choice[t]] for e in range(E)]
    group = [(ts, [0.125] * len(ts)) for ts in tokens]
    x = rng.standard_normal((T, H)).astype(np.float32)
    base = rng.standard_normal((T, H)).astype(np.float32)
    want = base.copy()
    ReferenceOps().experts(x, [(w, np.array(ts), np.array(ws, np.float32)) for w, (ts, ws) in zip(host, group)
                               if ts], act, want)
    up = [dev.upload_expert(w) for w in host]
    for w in up:
        dev.wait(w)
    got = ops.experts_grouped(cp.asarray(x), [(w, *g) for w, g in zip(up, group) if g[0]], act, cp.asarray(base))
    _close(cp.asnumpy(got), want)
