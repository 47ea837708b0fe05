"""csrc/ kernels: compile for Orin, 4090 and Hopper; host-compiled math equals the NumPy reference."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

import csrc_host
from s2moe.runtime.decoding.gating import ReuseGating
from s2moe.runtime.model.routing import route

CSRC = csrc_host.CSRC


@pytest.mark.parametrize("arch", ["sm_87", "sm_89", "sm_90"])
def test_every_kernel_compiles_with_nvcc(arch, tmp_path):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    assert os.path.exists(nvcc), "nvcc (CUDA toolkit) is required: CI checks that csrc/ compiles"
    for source in sorted(f for f in os.listdir(CSRC) if f.endswith(".cu")):
        r = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17", f"-I{CSRC}",
                            os.path.join(CSRC, source), "-o", str(tmp_path / f"{source}.{arch}.cubin")],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{source} for {arch}:\n{r.stderr}"


def _cases(rng):
    yield "random", rng.normal(size=(6, 16)).astype(np.float32)
    yield "ties", rng.integers(-2, 3, size=(5, 12)).astype(np.float32)
    yield "B=1", rng.normal(size=(1, 8)).astype(np.float32)
    yield "all equal", np.full((4, 8), 0.5, np.float32)
    yield "wide", rng.normal(size=(9, 64)).astype(np.float32)


@pytest.mark.parametrize("kind,renorm", [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", True)])
def test_host_router_matches_numpy(kind, renorm, rng):
    for name, logits in _cases(rng):
        for k in (1, 2, 4):
            ids, w = csrc_host.route(logits, k, kind, renorm)
            ref_ids, ref_w = route(logits, k, kind, renorm)
            assert np.array_equal(ids, ref_ids), (name, k)
            np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-7, err_msg=f"{name} k={k}")


@pytest.mark.parametrize("variant", ["paper", "code"])
@pytest.mark.parametrize("cap", [0, 3, 6, 100])  # 100 ≥ E: every expert preferred
def test_host_reuse_gating_matches_numpy(variant, cap, rng):
    for name, logits in _cases(rng):
        B, E = logits.shape
        conf = rng.uniform(0.1, 1.0, B).astype(np.float32)
        for k in (1, 2):
            if k >= E:
                continue
            n, ids, w = csrc_host.reuse_gating(logits, k, cap, variant, 1.5, "softmax_topk", False, conf)
            rg = ReuseGating(k, cap, variant, 1.5, conf.astype(np.float64))
            bias = rg.bias(0, logits)
            assert (n == 0) == (bias is None), (name, k)
            ref_ids, ref_w = route(logits, k, "softmax_topk", False, bias)
            assert np.array_equal(ids, ref_ids), (name, k, cap)
            np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-7)
