"""csrc/ kernels: compile for Orin, 4090 and Hopper; host-compiled math equals the NumPy reference.

Needs nothing from tests/conftest.py (benchmarks/gpu.py runs it with --noconftest, on a machine that
has only what the `cuda` extra installs): the compile test uses nvcc, else CuPy's NVRTC, and skips
with the reason only when neither can compile; the host tests need a C++ compiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import csrc_host  # noqa: E402
from s2moe.runtime.decoding.gating import ReuseGating  # noqa: E402
from s2moe.runtime.kernels import cuda  # noqa: E402
from s2moe.runtime.model.routing import route  # noqa: E402

CSRC = csrc_host.CSRC
HOST_CXX = shutil.which("g++") or shutil.which("c++")
needs_cxx = pytest.mark.skipif(HOST_CXX is None, reason="no C++ compiler (g++) to build csrc/ for the host")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _nvcc() -> str | None:
    found = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return found if os.path.exists(found) else None


def _nvrtc_reason() -> str | None:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # ImportError, or a wheel without its NVRTC library
        return f"{exc.__class__.__name__}: {' '.join(str(exc).split())[:120]}"
    return None


@pytest.mark.parametrize("arch", ["sm_87", "sm_89", "sm_90"])
def test_every_kernel_compiles(arch, tmp_path):
    """What CuPy compiles (kernels.cu, headers inlined: `cuda.source()`), and each .cu as written."""
    sources = {"inlined kernels.cu": cuda.source()}
    for name in sorted(f for f in os.listdir(CSRC) if f.endswith(".cu")):
        with open(os.path.join(CSRC, name)) as f:
            sources[name] = f.read()
    nvcc = _nvcc()
    if nvcc is None:
        reason = _nvrtc_reason()
        if reason is not None:
            pytest.skip(f"neither nvcc nor CuPy's NVRTC can compile here (no CUDA toolkit; NVRTC: {reason})")
        from cupy.cuda import nvrtc

        for name, code in sources.items():
            prog = nvrtc.createProgram(code, name, [], [])
            try:
                nvrtc.compileProgram(prog, [f"-arch={arch}", "-std=c++17", f"-I{CSRC}"])
            except nvrtc.NVRTCError as exc:
                pytest.fail(f"{name} for {arch}: {exc}\n{nvrtc.getProgramLog(prog)}")
        return
    jobs = {}
    for name, code in sources.items():  # side by side: each nvcc is one core's work for seconds
        src = tmp_path / (name.replace(" ", "_") if name.endswith(".cu") else "inlined.cu")
        src.write_text(code)
        include = [] if name.startswith("inlined") else [f"-I{CSRC}"]  # the inlined source stands alone
        jobs[name] = subprocess.Popen([nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17", *include, str(src),
                                       "-o", str(tmp_path / f"{src.stem}.{arch}.cubin")],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors = {name: job.communicate()[1] for name, job in jobs.items()}  # wait for all before judging
    failed = {name: err for name, err in errors.items() if jobs[name].returncode != 0}
    assert not failed, "\n".join(f"{name} for {arch}:\n{err}" for name, err in failed.items())


def _cases(rng):
    yield "random", rng.normal(size=(6, 16)).astype(np.float32)
    yield "ties", rng.integers(-2, 3, size=(5, 12)).astype(np.float32)
    yield "B=1", rng.normal(size=(1, 8)).astype(np.float32)
    yield "all equal", np.full((4, 8), 0.5, np.float32)
    yield "wide", rng.normal(size=(9, 64)).astype(np.float32)
    yield "batch 100", rng.normal(size=(100, 16)).astype(np.float32)  # beyond the old 64-token limit


@needs_cxx
@pytest.mark.parametrize("kind,renorm", [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", True)])
def test_host_router_matches_numpy(kind, renorm, rng):
    for name, logits in _cases(rng):
        for k in (1, 2, 4):
            ids, w = csrc_host.route(logits, k, kind, renorm)
            ref_ids, ref_w = route(logits, k, kind, renorm)
            assert np.array_equal(ids, ref_ids), (name, k)
            np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-7, err_msg=f"{name} k={k}")


@needs_cxx
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
