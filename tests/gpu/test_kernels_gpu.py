"""csrc/ kernels on a real GPU through cupy.RawModule vs the NumPy reference.

Skipped, with the reason, where CuPy or a CUDA device is missing (CI has neither); run on a GPU
machine with `pip install -e ".[cuda]" && python -m pytest -q --noconftest tests/gpu` (tests/conftest.py
is not needed here).
"""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.runtime.kernels.backend import cuda_unusable_reason
from s2moe.runtime.decoding.gating import ReuseGating
from s2moe.runtime.model.routing import route


REASON = cuda_unusable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"GPU test: {REASON}")


@pytest.mark.parametrize("B", [1, 300, 2000])  # 2000: more tokens than one block's 1024 threads
@pytest.mark.parametrize("kind,renorm", [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", True)])
def test_router_kernel_matches_numpy(kind, renorm, B):
    import cupy as cp

    from s2moe.runtime.kernels.cuda import router_topk

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B, 64)).astype(np.float32)
    ids, w = router_topk(cp.asarray(logits), 8, kind, renorm)
    ref_ids, ref_w = route(logits, 8, kind, renorm)
    assert np.array_equal(cp.asnumpy(ids), ref_ids)
    np.testing.assert_allclose(cp.asnumpy(w), ref_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("B", [9, 100, 2000])  # beyond 64 tokens the old kernel did nothing
@pytest.mark.parametrize("variant", ["paper", "code"])
def test_fused_reuse_gating_kernel_matches_numpy(variant, B):
    import cupy as cp

    from s2moe.runtime.kernels.cuda import reuse_gating

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(B, 64)).astype(np.float32)
    conf = rng.uniform(0.1, 1, B).astype(np.float32)
    ids, w = reuse_gating(cp.asarray(logits), 8, 16, variant, 1.0, "softmax_topk", False, cp.asarray(conf))
    bias = ReuseGating(8, 16, variant, 1.0, conf.astype(np.float64)).bias(0, logits)
    assert bias is not None  # the gating does something here
    ref_ids, ref_w = route(logits, 8, "softmax_topk", False, bias)
    assert np.array_equal(cp.asnumpy(ids), ref_ids)
    np.testing.assert_allclose(cp.asnumpy(w), ref_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "MXFP4"])
def test_stored_blocks_decode_on_the_device_as_on_the_host(dtype):
    """Weights stay stored on the device; its block decoders equal the host reference bit for bit."""
    import cupy as cp

    from s2moe.runtime.kernels.stored import StoredMatrix, decode_rows

    rng = np.random.default_rng(0)
    if dtype == "Q4_K":
        raw = rng.integers(0, 256, (24 * 2, 144), dtype=np.uint8)
        raw[:, :4] = np.stack([rng.uniform(1e-3, 1e-2, 48), rng.uniform(0, 1e-2, 48)], -1).astype(np.float16) \
            .view(np.uint8).reshape(48, 4)
        W = StoredMatrix(raw.reshape(-1), "Q4_K", (24, 512))
    else:
        W = StoredMatrix.from_float(rng.standard_normal((24, 512)).astype(np.float32), dtype)
    got = decode_rows(cp, dtype, cp.asarray(W.data.reshape(24, W.row_bytes)), 512)
    np.testing.assert_array_equal(cp.asnumpy(got), W.dequantize())
