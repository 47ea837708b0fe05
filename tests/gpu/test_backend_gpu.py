"""The CuPy backend on a real GPU: logits and greedy output against NumPy, and the expert budget
in device memory. Skipped, with the reason, where CuPy or a CUDA device is missing (CI); the same
checks run on every CI machine against a CPU stand-in in tests/test_backend.py."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.runtime.kernels.backend import NUMPY, cuda_unusable_reason, select_backend
from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.cost_model import CostConstants
from s2moe.runtime.engine import build_engine
from s2moe.runtime.model.loader import load_model
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.model.forward import MoEModel
from s2moe.runtime.decoding.speculative import SpeculativeDecoder

REASON = cuda_unusable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"GPU test: {REASON}")
UNUSED = CostConstants(t_ar=1.0, c_draft=1.0, t_exp_miss=0.0, t_exp_hit=0.0)


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(DEFAULT_MODEL))


def test_cupy_logits_match_numpy(loaded):
    dev = select_backend("cupy")
    tokens = list(range(40, 72))
    ref, _ = MoEModel(loaded).forward(tokens, MoEModel(loaded).new_cache(40))
    model = MoEModel(loaded, backend=dev)
    got, _ = model.forward(tokens, model.new_cache(40))
    assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("method,tier", [("ar", "file"), ("s2moe", "file"), ("s2moe", "host")])
def test_greedy_output_is_identical_between_backends(loaded, method, tier):
    outs = []
    for arrays in (NUMPY, select_backend("cupy")):
        engine = build_engine(loaded.path, "0.25", 256, None, loaded=loaded, backend=arrays, offload_tier=tier)
        settings = SpecSettings(draft_topk=2, draft_cap=4, reuse_cap=8, utility_threshold=0.0, backoff=False)
        dec = SpeculativeDecoder(engine.model, get_method(method, reuse_gating=False if method == "s2moe" else None),
                                 settings, UNUSED)
        outs.append(dec.generate([5, 99, 1000, 42], 32).tokens)
        engine.close()
    assert outs[0] == outs[1]


def test_expert_budget_holds_in_device_memory(loaded):
    import cupy as cp

    dev = select_backend("cupy")
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    engine = build_engine(loaded.path, "0.25", 256, None, loaded=loaded, backend=dev)
    SpeculativeDecoder(engine.model, get_method("ar"), SpecSettings(draft_topk=2), UNUSED).generate([5, 99, 1000], 24)
    cache = engine.cache
    assert cache.peak_resident_bytes <= cache.capacity
    assert all(isinstance(w.gate.data, cp.ndarray) for w in cache.held.values())
    dense = sum(a.nbytes for a in engine.model.W.values())
    # what the pool holds from the device (total, cached free blocks included: used_bytes hides them):
    # resident experts + dense weights + KV + transient activations (generous 64 MiB)
    bound = cache.capacity + dense + engine.model.new_cache(256).nbytes + (64 << 20)
    assert pool.total_bytes() <= bound
    dev.limit_memory(bound)  # the budget binds on the device: the pool refuses beyond it
    try:
        assert pool.get_limit() == bound
        with pytest.raises(cp.cuda.memory.OutOfMemoryError):
            cp.empty(bound + (1 << 20), dtype=cp.uint8)
    finally:
        dev.limit_memory(None)
    engine.close()


def test_integrated_gpu_is_detected_and_stages_nothing(loaded):
    """On Jetson Orin (``integrated``) experts go up without pinned staging; elsewhere staged."""
    import cupy as cp

    dev = select_backend("cupy")
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    assert dev.integrated == bool(props["integrated"])
    w = build_engine(loaded.path, "0.25", 64, None, loaded=loaded, backend=NUMPY).cache.store.read(0, 3)
    up = dev.upload_expert(w)
    dev.wait(up)
    assert np.array_equal(cp.asnumpy(up.gate.data), w.gate.data)


def test_profile_on_the_gpu_measures_its_link_and_validates(tmp_path):
    """`s2moe-calib profile --backend cupy` end to end: CUDA-event timing, pinned host → device
    bandwidth, then the held-out validation through the same backend."""
    import json
    import subprocess
    import sys

    out = tmp_path / "gpu.json"
    run = lambda *a: subprocess.run([sys.executable, "-m", "s2moe.calib", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=900)
    r = run("profile", "--device", "auto", "--backend", "cupy", "--budget", "0.25", "--samples", "40",
            "--rounds", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["device"]["backend"] == "cupy" and data["offload"]["host_to_device_mb_s"] > 1000
    v = run("validate", "--profile", str(out), "--n-prompts", "4", "--rounds", "3", "--json", "--min-r2", "-1e9",
            "--max-mape", "1e9")
    assert v.returncode == 0, v.stderr
    assert json.loads(v.stdout)["n"] >= 3
