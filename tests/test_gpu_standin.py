"""What a first real CUDA run would hit, checked on the strict CPU stand-in (tests/fake_cupy.py):
missing CUDA libraries, the csrc kernels' source and limits (their CUDA source run on the CPU),
staging layout, fetches timed to completion, the integrated-GPU (Orin) path, greedy tokens against
NumPy for both tiers and three budgets, launch and sync counts (on the default model and on two
real-shaped Q4_K + Q6_K layers), and benchmarks/gpu.py without a GPU and as a dry run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import fake_cupy
from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.gating import ReuseGating
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine
from s2moe.runtime.errors import UsageError
from s2moe.runtime.kernels import backend as B
from s2moe.runtime.kernels import cuda
from s2moe.runtime.model.forward import MoEModel
from s2moe.runtime.model.loader import load_model
from s2moe.runtime.model.routing import route
from s2moe.runtime.offload.experts import ExpertWeights
from test_replay import UNUSED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fake = fake_cupy.module


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(DEFAULT_MODEL))


@pytest.fixture
def as_cupy(monkeypatch):
    """`import cupy` gives the stand-in (the kernels module imports it by name)."""
    monkeypatch.setitem(sys.modules, "cupy", fake)
    cuda.module.cache_clear()
    yield fake
    cuda.module.cache_clear()


# -- 1. CuPy without its CUDA libraries -------------------------------------------------------------

def test_missing_cuda_libraries_fall_back_to_numpy_and_say_why_in_one_line(as_cupy):
    from typer.testing import CliRunner

    from s2moe.runtime.cli import app

    assert B.cuda_unusable_reason() is None  # the stand-in as a working device passes the probe
    with fake_cupy.mode(missing_library="libnvrtc.so.12"):
        assert fake.cuda.runtime.getDeviceCount() == 1  # the device is seen: only the libraries are missing
        reason = B.cuda_unusable_reason()
        assert reason is not None and "\n" not in reason and "DynamicLibNotFoundError" in reason
        assert "cupy-cuda12x[ctk]" in reason
        auto = B.select_backend("auto")
        assert auto.name == "numpy" and auto.reason == f"auto: {reason}"
        with pytest.raises(UsageError, match="--backend cupy: CuPy cannot run"):
            B.select_backend("cupy")
        r = CliRunner().invoke(app, ["run", "--prompt", "def f(x):", "-n", "2", "--json", "--backend", "auto"])
    assert r.exit_code == 0, r.output
    backend = json.loads(r.stdout)["stats"]["backend"]
    assert backend["name"] == "numpy" and backend["reason"] == f"auto: {reason}"


# -- 4. kernel source and limits ------------------------------------------------------------------

def test_the_source_cupy_compiles_has_its_headers_inlined(as_cupy, tmp_path, monkeypatch):
    import shutil

    import s2moe.csrc

    src = cuda.source()
    assert '#include "' not in src and "#pragma once" not in src
    header = (s2moe.csrc.SOURCE_DIR / "routing.cuh").read_text()
    assert "inline int s2_rg_plan(" in header and "inline int s2_rg_plan(" in src
    cuda.module()
    code, options = fake.compiled[-1]
    assert code == src and not any(o.startswith("-I") for o in options)
    # an edit to the header changes the string CuPy keys its cache on
    shutil.copytree(s2moe.csrc.SOURCE_DIR, tmp_path / "csrc", ignore=shutil.ignore_patterns("cpu", "__pycache__"))
    with open(tmp_path / "csrc" / "routing.cuh", "a") as f:
        f.write("\n// edited\n")
    monkeypatch.setattr(s2moe.csrc, "SOURCE_DIR", tmp_path / "csrc")
    assert cuda.source() != src and "// edited" in cuda.source()


@pytest.mark.parametrize("B", [1, 300, 2000])  # 2000 tokens: more than one block's 1024 threads
def test_router_kernel_takes_any_batch(as_cupy, B):
    rng = np.random.default_rng(B)
    logits = rng.normal(size=(B, 64)).astype(np.float32)
    ids, w = cuda.router_topk(fake.asarray(logits), 8, "softmax_topk", True)
    ref_ids, ref_w = route(logits, 8, "softmax_topk", True)
    assert np.array_equal(fake.asnumpy(ids), ref_ids)
    np.testing.assert_allclose(fake.asnumpy(w), ref_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("B", [9, 65, 300, 1500])  # the old kernel: a no-op beyond 64, a failed launch beyond 1024
@pytest.mark.parametrize("variant", ["paper", "code"])
def test_fused_gating_kernel_takes_any_batch(as_cupy, B, variant):
    rng = np.random.default_rng(B)
    logits = rng.normal(size=(B, 32)).astype(np.float32)
    conf = rng.uniform(0.1, 1, B).astype(np.float32)
    ids, w = cuda.reuse_gating(fake.asarray(logits), 4, 8, variant, 1.0, "softmax_topk", False, fake.asarray(conf))
    bias = ReuseGating(4, 8, variant, 1.0, conf.astype(np.float64)).bias(0, logits)
    assert bias is not None
    ref_ids, ref_w = route(logits, 4, "softmax_topk", False, bias)
    assert np.array_equal(fake.asnumpy(ids), ref_ids)
    np.testing.assert_allclose(fake.asnumpy(w), ref_w, rtol=1e-5, atol=1e-7)


def test_kernel_arguments_are_checked(as_cupy):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 16)).astype(np.float32)
    bias = rng.normal(size=(16, 6))  # float64, and its transpose is not C-contiguous
    ids, w = cuda.router_topk(fake.asarray(logits), 2, "softmax_topk", False, fake.asarray(bias).T)
    ref_ids, ref_w = route(logits, 2, "softmax_topk", False, bias.T.astype(np.float32))
    assert np.array_equal(fake.asnumpy(ids), ref_ids)
    with pytest.raises(ValueError, match=r"bias must have shape \[6, 16\]"):
        cuda.router_topk(fake.asarray(logits), 2, "softmax_topk", False, fake.asarray(bias))
    with pytest.raises(ValueError, match="top-k 17"):
        cuda.router_topk(fake.asarray(logits), 17, "softmax_topk", False)
    with pytest.raises(ValueError, match=r"confidence must have shape \[6\]"):
        cuda.reuse_gating(fake.asarray(logits), 2, 4, "paper", 1.0, "softmax_topk", False, fake.asarray(bias))
    # beyond the kernel's 512 experts: the NumPy path, same result
    wide = rng.normal(size=(5, 600)).astype(np.float32)
    conf = rng.uniform(0.1, 1, 5).astype(np.float32)
    ids, w = cuda.reuse_gating(fake.asarray(wide), 4, 8, "paper", 1.0, "softmax_topk", False, fake.asarray(conf))
    ref_ids, _ = route(wide, 4, "softmax_topk", False, ReuseGating(4, 8, "paper", 1.0, conf.astype(np.float64))
                       .bias(0, wide))
    assert np.array_equal(fake.asnumpy(ids), ref_ids)


# -- 3. staging layout, fetches timed to completion ---------------------------------------------------

def test_staging_buffers_keep_the_layout_of_what_they_stage():
    dev = B.select_backend("cupy", module=fake)
    rng = np.random.default_rng(0)
    parts = [np.asfortranarray(rng.standard_normal(shape).astype(np.float32)) for shape in ((24, 16), (24, 16), (16, 24))]
    w = ExpertWeights(*parts)
    slow, pageable = fake.transposing_copies, fake.pageable_copies
    up = dev.upload_expert(w)
    assert fake.transposing_copies == slow  # no copy through pageable memory to transpose
    assert fake.pageable_copies == pageable  # every copy from pinned memory (asynchronous)
    assert up.gate.flags.f_contiguous and not up.gate.flags.c_contiguous
    dev.wait(up)
    for got, want in zip((up.gate, up.up, up.down), parts):
        np.testing.assert_array_equal(fake.asnumpy(got), want)


def test_fetches_are_timed_until_their_copies_land(loaded):
    dev = B.select_backend("cupy", module=fake)
    host = build_engine(loaded.path, "0.25", 64, None, loaded=loaded, backend=dev, offload_tier="host")
    got = host.cache.store.read_many(0, [1, 2])  # what start-up estimates time for a host-tier miss
    assert all(w.ready is not None and w.ready.done for w in got)
    np.testing.assert_array_equal(fake.asnumpy(got[0].gate.data), host.cache.store.read(0, 1).gate.data)
    host.close()
    for tier in ("file", "host"):  # the cache's fetches: its clock stops once the copies have landed
        engine = build_engine(loaded.path, "0.25", 64, None, loaded=loaded, backend=dev, offload_tier=tier)
        cache = engine.cache
        missing = [e for e in range(8) if not cache.contains(0, e)][:6]
        ws = cache.get(0, missing)
        assert missing and all(w.ready.done for w in ws)
        engine.close()


# -- 5. integrated GPU (Orin) -------------------------------------------------------------------------

def test_an_integrated_gpu_stages_nothing_and_the_pool_takes_the_budget(loaded):
    with fake_cupy.mode(integrated=True):
        dev = B.select_backend("auto", module=fake)
        assert dev.integrated and "integrated GPU" in dev.reason
        ref = _greedy(loaded, B.NUMPY, "file", "0.25")
        pinned = fake.pinned_allocs
        for tier in ("file", "host"):
            assert _greedy(loaded, dev, tier, "0.25") == ref
        assert fake.pinned_allocs == pinned  # no pinned staging, no pinned host tier
        # the dense weights live once, in the shared memory the device reads: no host copy kept
        engine = build_engine(loaded.path, "0.25", 64, None, loaded=loaded, backend=dev)
        assert loaded.dense == {} and engine.model.W
        engine.close()
        loaded.load_dense()  # (the module's other tests use the host copy)
        dev.limit_memory(1 << 28)
        assert fake.pool.get_limit() == 1 << 28
        dev.limit_memory(None)
    assert not B.select_backend("cupy", module=fake).integrated


def test_the_engine_caps_the_device_pool_at_its_plan(loaded):
    dev = B.select_backend("cupy", module=fake)
    engine = build_engine(loaded.path, "0.25", 256, None, loaded=loaded, backend=dev)
    limit = fake.pool.get_limit()
    assert engine.plan.model_bytes < limit <= 1.05 * engine.plan.model_bytes + (32 << 20)
    assert fake.pool.total_bytes() <= limit
    # a prefetch's room is in the device cache; its host read buffer waits for verification's upload
    # in the host workspace, which plans the engine's prefetches beside the window of reads
    largest = max(refs.resident_bytes_for(False) for refs in loaded.experts.values())  # as the device holds it
    assert engine.cache.prefetch_slots > 0
    assert engine.plan.work.streaming == (2 * 4 + engine.cache.prefetch_slots) * largest  # 2 × a window of 4
    engine.close()
    build_engine(loaded.path, None, 256, None, loaded=loaded, backend=dev).close()  # no budget: no cap
    assert fake.pool.get_limit() == 0


# -- 7. the strict stand-in: greedy tokens for both tiers and three budgets --------------------------

def _greedy(loaded, arrays, tier, budget, method="s2moe"):
    engine = build_engine(loaded.path, budget, 256, None, loaded=loaded, backend=arrays, offload_tier=tier)
    settings = SpecSettings(draft_topk=2, draft_cap=4, reuse_cap=8, utility_threshold=0.0, backoff=False)
    dec = SpeculativeDecoder(engine.model, get_method(method, reuse_gating=False), settings, UNUSED)
    tokens = dec.generate([5, 99, 1000, 42], 12).tokens
    engine.close()
    return tokens


@pytest.mark.parametrize("budget", ["1.0", "0.25", "0.10"])
def test_greedy_tokens_equal_numpy_for_both_tiers(loaded, budget):
    ref = _greedy(loaded, B.NUMPY, "file", budget)
    dev = B.select_backend("cupy", module=fake)
    assert fake.strict
    for tier in ("file", "host"):
        assert _greedy(loaded, dev, tier, budget) == ref, tier


# -- 6. launches and host syncs per decode token --------------------------------------------------------

def _decode_counts(loaded, budget):
    dev = B.select_backend("cupy", module=fake)
    engine = build_engine(loaded.path, budget, 64, None, loaded=loaded, backend=dev)
    model: MoEModel = engine.model
    kv = model.new_cache(32)
    model.forward([5, 99, 1000, 42], kv, record=False)
    kv.commit(4)
    counts = []
    for token in (7, 11, 13):
        with fake_cupy.counting() as n:
            model.forward([token], kv, logits="last", record=False)
        kv.commit(kv.filled)
        counts.append((n.launches, n.syncs))
    engine.close()
    return counts, len(loaded.config.moe_layer_ids)


@pytest.mark.parametrize("budget", ["1.0", "0.25"])
def test_at_most_two_host_syncs_per_moe_layer(loaded, budget):
    counts, layers = _decode_counts(loaded, budget)
    # per MoE layer: the router logits, and at most one wait for the layer's fetched experts; + the logits
    assert all(syncs <= 2 * layers + 1 for _, syncs in counts), counts


def test_at_most_60_device_ops_per_decode_token(loaded):
    # fused kernels (csrc/decode.cuh): ~40 launches a token, + one copy per expert fetched
    counts, _ = _decode_counts(loaded, "1.0")
    assert all(launches <= 60 for launches, _ in counts), counts


# -- 2. benchmarks/gpu.py without a GPU ---------------------------------------------------------------

def test_the_gpu_benchmark_exits_0_without_a_gpu_and_needs_no_torch(tmp_path):
    blocked = tmp_path / "blocked"
    for name in ("torch", "cupy"):  # torch: not in the cuda extra; cupy: no GPU here, whatever this machine has
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked by the test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked), os.environ.get("PYTHONPATH", "")]))
    # step 1 on the GPU tests and one quick host test: the suite compiles the csrc kernels itself
    tests = ["tests/gpu", "tests/test_csrc.py::test_host_router_matches_numpy"]
    r = subprocess.run([sys.executable, "benchmarks/gpu.py", "--out", str(tmp_path / "gpu"), "--tests", *tests],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for part in ("csrc kernel timings", "decode tokens/s on CuPy", "calibration on CuPy"):
        assert f"skipped: {part}" in r.stdout and "CuPy is not installed" in r.stdout
    # the quick host test's 3 cases pass (--tests reached pytest), every GPU test skips
    assert re.search(r"\b3 passed, \d+ skipped", r.stdout) and "failed" not in r.stdout, r.stdout[-2000:]
    assert "SKIPPED" in r.stdout and "GPU test: CuPy is not installed" in r.stdout  # each skip with its reason


# -- a draft head's row order on a device ---------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_a_device_model_on_rank_ordered_rows_keeps_the_token_order(as_cupy, tied):
    """A host model's draft head stores the loaded lm head's rows in rank order; a device model built
    on those weights afterwards uploads them so, and must look tokens up (a tied embedding) and
    return logits in token order, as a model on unpermuted weights does."""
    loaded = load_model(str(DEFAULT_MODEL))
    dev = B.select_backend("cupy", module=fake)
    host = build_engine(loaded.path, None, 64, None, loaded=loaded)
    if tied:  # the head stands in for a tied embedding (one object for both)
        host.model.W["embed"] = host.model.W["lm_head"]
    prompt = [15, 64, 13, 266, 280, 9]
    want = build_engine(loaded.path, None, 64, None, loaded=loaded, backend=dev).model
    before = want.backend.to_host(want.forward(prompt, want.new_cache(32), logits="all")[0])
    host.model.draft_head(1000)
    assert loaded.head_order is not None
    after = build_engine(loaded.path, None, 64, None, loaded=loaded, backend=dev).model
    got = after.backend.to_host(after.forward(prompt, after.new_cache(32), logits="all")[0])
    np.testing.assert_allclose(got, before, rtol=0, atol=1e-5)


# -- 8. at the size users run: a real-shaped Q4_K_M-typed model -------------------------------------

@pytest.fixture(scope="module")
def real_shaped(tmp_path_factory):
    """Two OLMoE-1B-7B layers (hidden 2048, 16 heads of 128, 64 experts of 1024, top-8) in Q4_K_M's
    two types (Q4_K; Q6_K for down, v and the head), a small vocabulary: 0.5 GB of real-sized layers."""
    from benchmarks import real_models

    path = str(tmp_path_factory.mktemp("real") / "olmoe-2-layers.gguf")
    real_models.write("olmoe-1b-7b", "Q4_K_MIX", path, override=dict(layers=2, vocab=6144))
    return load_model(path)


@pytest.mark.parametrize("budget", ["1.0", "0.25"])
def test_a_real_shaped_layer_decodes_in_few_ops_on_stored_blocks(real_shaped, monkeypatch, budget):
    from s2moe.runtime.kernels.stored import DeviceStored, row_bytes

    monkeypatch.setenv("S2MOE_FLOAT_ACTIVATIONS", "1")  # the NumPy reference: dequantised blocks · float32 x
    c = real_shaped.config
    assert (c.hidden_size, c.num_experts, c.top_k, c.expert_intermediate_size) == (2048, 64, 8, 1024)
    prompt, steps = [5, 99, 1000, 42], (7, 11, 13)
    host = build_engine(real_shaped.path, budget, 64, None, loaded=real_shaped)
    kv = host.model.new_cache(32)
    want = [host.model.forward(prompt, kv, logits="last", record=False)[0]]
    kv.commit(4)
    for token in steps:
        want.append(host.model.forward([token], kv, logits="last", record=False)[0])
        kv.commit(kv.filled)
    host.close()

    dev = B.select_backend("cupy", module=fake)
    engine = build_engine(real_shaped.path, budget, 64, None, loaded=real_shaped, backend=dev)
    model: MoEModel = engine.model
    kv = model.new_cache(32)
    got = [model.forward(prompt, kv, logits="last", record=False)[0]]
    kv.commit(4)
    names = []
    real_call = fake_cupy._Function.__call__

    def spy(self, *args, **kwargs):
        names.append(self.name)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(fake_cupy._Function, "__call__", spy)
    for token in steps:
        with fake_cupy.counting() as n:
            got.append(model.forward([token], kv, logits="last", record=False)[0])
        kv.commit(kv.filled)
        layers = len(c.moe_layer_ids)
        assert n.launches <= 60 and n.syncs <= 2 * layers + 1, (n.launches, n.syncs)
    # every product ran fused on the stored blocks (no op-by-op decode of a Q4_K or Q6_K matrix)
    assert {"s2_linear", "s2_attend", "s2_experts_gate_up", "s2_experts_down"} <= set(names)
    for w, h in zip(got, want):
        h = np.asarray(h)
        assert np.abs(fake.asnumpy(w) - h).max() <= 1e-3 * np.abs(h).max()
    # resident experts on the device are their stored blocks, at their stored size
    held = list(engine.cache.held.values())
    assert held
    for w in held:
        for m, (N, K) in ((w.gate, (1024, 2048)), (w.up, (1024, 2048)), (w.down, (2048, 1024))):
            assert isinstance(m, DeviceStored) and m.dtype in ("Q4_K", "Q6_K")
            assert m.nbytes == N * row_bytes(m.dtype, K)
    assert {w.down.dtype for w in held} == {"Q6_K"} and {w.gate.dtype for w in held} == {"Q4_K"}
    engine.close()


def test_the_gpu_benchmark_runs_end_to_end_on_the_stand_in(tmp_path):
    """`benchmarks/gpu.py --dry-run`: the real-size check's every step on the CPU stand-in, sizes
    scaled down, no torch: the file made, kernels, both tiers at three budgets, profile + validate."""
    blocked = tmp_path / "blocked" / "torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('torch is blocked by the test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "gpu"
    r = subprocess.run([sys.executable, "benchmarks/gpu.py", "--dry-run", "--no-tests", "--out", str(out),
                        "--models", str(tmp_path / "models")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "skipped" not in r.stdout and "dry run" in r.stdout
    for tier in ("file", "host"):
        for budget in ("100%", "25%", "10%"):
            assert any([c.strip() for c in line.split("│")[1:3]] == [tier, budget] for line in r.stdout.splitlines()
                       if line.startswith("│")), (tier, budget, r.stdout)
    assert "calibration at 25 %: validate R²" in r.stdout
    records = json.loads((tmp_path / "gpu.json").read_text())["records"]
    rates = [x for x in records if x["unit"] == "tok/s"]
    assert len(rates) == 2 * 3 * 2 and all(x["dry_run"] and x["median"] > 0 for x in rates)
    assert {(x["tier"], x["budget"], x["method"]) for x in rates} == {
        (t, b, m) for t in ("file", "host") for b in ("1.0", "0.25", "0.10") for m in ("ar", "s2moe")}
    r2 = next(x for x in records if x["unit"] == "R²")["median"]
    assert np.isfinite(r2) and (tmp_path / "gpu-profile.json").exists()
