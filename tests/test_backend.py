"""The backend layer: selection, and the device code paths run on a CPU stand-in for CuPy
(tests/fake_cupy.py) that rejects host/device mixing and implicit host reads. tests/gpu runs the
same checks with real CuPy on a GPU."""

import numpy as np
import pytest

from s2moe.runtime.kernels import backend as B
from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.engine import build_engine
from s2moe.runtime.errors import UsageError
from s2moe.runtime.model.loader import load_model
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.model.forward import MoEModel
from s2moe.runtime.decoding.speculative import SpeculativeDecoder

import fake_cupy
import tiny_models as tm
from helpers import TOL
from test_replay import UNUSED


DEVICE_TOL = 5e-5  # device vs host on the embedded model (logits up to ±20): measured 8.6e-6


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(DEFAULT_MODEL))


@pytest.fixture
def device():
    return B.select_backend("cupy", module=fake_cupy.module)


def test_selection_states_its_reason(monkeypatch):
    assert B.select_backend("numpy").name == "numpy"
    real = B.cuda_unusable_reason
    monkeypatch.setattr(B, "cuda_unusable_reason", lambda module=None: real(module) if module is not None else
                        "CuPy is not installed (pip install 's2moe[cuda]')")
    auto = B.select_backend("auto")
    assert auto.name == "numpy" and auto.reason.startswith("auto: CuPy is not installed")
    with pytest.raises(UsageError, match="--backend cupy: CuPy is not installed"):
        B.select_backend("cupy")
    with pytest.raises(UsageError, match="choose from auto, numpy, cupy"):
        B.select_backend("tpu")
    assert B.select_backend("auto", module=fake_cupy.module).name == "cupy"


def test_device_logits_match_numpy_and_syncs_are_the_documented_ones(loaded, device):
    host, dev = MoEModel(loaded), MoEModel(loaded, backend=device)
    tokens = [5, 99, 1000, 42, 7, 3000]
    kv_h, kv_d = host.new_cache(16), dev.new_cache(16)
    assert isinstance(kv_d.keys[0], fake_cupy.DeviceArray) and isinstance(dev.W["lm_head"].data, fake_cupy.DeviceArray)
    # weights stay in their stored encoding on the device too (F16: half of float32)
    assert dev.W["lm_head"].dtype == "F16" and dev.W["lm_head"].nbytes == loaded.dense["lm_head"].nbytes
    ref, _ = host.forward(tokens, kv_h)
    before = device.host_reads
    got, rec = dev.forward(tokens, kv_d)
    assert isinstance(got, np.ndarray) and not isinstance(got, fake_cupy.DeviceArray)  # logits land on the host
    # the embedded model's logits reach ±20: the device path's other summation order measured 8.6e-6
    np.testing.assert_allclose(got, ref, atol=DEVICE_TOL, rtol=0)
    # one read per MoE layer (router logits, to choose experts) and one for the logits: nothing else
    assert device.host_reads - before == len(loaded.config.moe_layer_ids) + 1
    assert all(isinstance(r.logits, np.ndarray) for r in rec.layers.values())
    # decode after prefill, from the device KV cache
    kv_h.commit(6), kv_d.commit(6)
    np.testing.assert_allclose(dev.forward([11], kv_d)[0], host.forward([11], kv_h)[0], atol=DEVICE_TOL, rtol=0)


@pytest.mark.parametrize("method,gating", [("s2moe", False), ("s2moe", True), ("ar", False)])
def test_greedy_output_is_identical_between_backends(loaded, device, method, gating):
    outs = []
    for arrays in (B.NUMPY, device):
        engine = build_engine(loaded.path, "0.25", 256, None, loaded=loaded, backend=arrays)
        spec = get_method(method, reuse_gating=gating if method == "s2moe" else None)
        settings = SpecSettings(draft_topk=2, draft_cap=4, reuse_cap=8, utility_threshold=0.0, backoff=False)
        outs.append(SpeculativeDecoder(engine.model, spec, settings, UNUSED).generate([5, 99, 1000, 42], 16).tokens)
        engine.close()
    assert outs[0] == outs[1] and len(outs[0]) == 16


def test_budget_holds_in_device_memory_and_copies_go_through_the_copy_stream(loaded, device):
    engine = build_engine(loaded.path, "0.25", 256, None, loaded=loaded, backend=device)
    cache = engine.cache
    SpeculativeDecoder(engine.model, get_method("ar"), SpecSettings(draft_topk=2), UNUSED).generate([5, 99, 1000], 12)
    assert cache.peak_resident_bytes <= cache.capacity
    held = list(cache.held.values())
    # resident in device memory at their stored size (F16 bytes, not float32)
    assert held and all(isinstance(w.gate.data, fake_cupy.DeviceArray) and isinstance(w.down.data, fake_cupy.DeviceArray)
                        and w.gate.dtype == "F16" for w in held)
    assert all(w.nbytes == engine.loaded.experts[key].resident_bytes_for(False) for key, w in cache.held.items())
    misses = sum(s.misses for s in cache.stats.values())
    copies = device._copy_stream.recorded
    assert len(copies) == misses  # every fetched expert was uploaded on the copy stream, with its event
    waited = fake_cupy.module.cuda.default.waited
    assert set(map(id, copies)) <= set(map(id, waited))  # and compute waited on each before using it
    # one copy per fetched expert (its parts staged together in one pinned buffer), on the copy stream
    assert {stream for stream, _ in fake_cupy.module.copies[-misses:]} == {device._copy_stream}
    engine.close()


def test_host_tier_serves_pinned_experts_and_decodes_the_same(loaded, device):
    outs = []
    for tier in ("file", "host"):
        engine = build_engine(loaded.path, "0.25", 256, None, loaded=loaded, backend=device, offload_tier=tier)
        dec = SpeculativeDecoder(engine.model, get_method("ar"), SpecSettings(draft_topk=2), UNUSED)
        outs.append(dec.generate([5, 99, 1000], 12).tokens)
        assert engine.report()["offload_tier"] == tier
        engine.close()
    assert outs[0] == outs[1]
    store = build_engine(loaded.path, "0.25", 64, None, loaded=loaded, backend=device, offload_tier="host").cache.store
    w = store.read(0, 3)
    # pinned as stored bytes (staged copies skip a memcpy, and the host tier holds F16, not float32)
    assert w.pinned and type(w.gate.data) is np.ndarray and w.gate.data.flags.c_contiguous and w.gate.dtype == "F16"
    assert fake_cupy._pinned_block(w.gate.data) is not None
    with pytest.raises(UsageError, match="--offload-tier 'ssd'"):
        build_engine(loaded.path, "0.25", 64, None, loaded=loaded, offload_tier="ssd")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_other_families_run_on_the_device_path(tmp_path, device, family):
    # per-head q/k norm; MLA with shared experts and sigmoid group routing; sinks, sliding window,
    # biases and the clamped SwiGLU
    model = load_model(tm.save(tm.build(family), tmp_path / family, fused=family == "gpt_oss"))
    host, dev = MoEModel(model), MoEModel(model, backend=device)
    tokens = [1, 5, 9, 2, 7]
    ref, _ = host.forward(tokens, host.new_cache(8))
    got, _ = dev.forward(tokens, dev.new_cache(8))
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)  # measured ≤ 2.7e-7


def test_start_up_estimates_run_on_the_device_path(loaded, device):
    from s2moe.runtime.decoding.estimate import estimate_costs
    from s2moe.runtime.model.routing import RoutingPolicy

    engine = build_engine(loaded.path, "0.25", 64, None, loaded=loaded, backend=device)
    costs = estimate_costs(engine.model, [5, 99, 1000, 42], RoutingPolicy(top_k=2))
    assert costs.t_ar > 0 and costs.t_exp_miss >= costs.t_exp_hit > 0
    engine.close()


def test_a_tied_head_is_uploaded_once(loaded, device):
    import dataclasses

    dense = dict(loaded.dense, lm_head=loaded.dense["embed"])  # a tied model: one array, two names
    model = MoEModel(dataclasses.replace(loaded, dense=dense), backend=device)
    assert model.W["lm_head"] is model.W["embed"]


def test_profile_and_validate_on_the_device_path(tiny_model_dirs, tmp_path, device, monkeypatch):
    """The GPU calibration path (CuPy backend, CUDA-event timing, host → device copies) end to end."""
    import os

    from s2moe.calib import profile_cmd, validate_cmd
    from s2moe.runtime.profile import load_profile, save_profile
    from s2moe.runtime.model.tokenizer import load_tokenizer

    workload = os.path.join(os.path.dirname(__file__), "data", "prompts.jsonl")
    _, folder, _ = tiny_model_dirs["olmoe"]
    out = tmp_path / "gpu.json"
    # a 2 ms emulated request latency: a miss must stand out of compute bursts, or the
    # non-negative fit may clamp the tiny model's ~0.1 ms miss to 0 under load
    data = profile_cmd.run_profile(folder, "cpu", "0.5", workload, str(out), None, 12, None, 2000.0, 1, 4, rounds=2,
                                   backend=device)
    save_profile(str(out), data)  # the schema accepts what the device path writes
    assert data["device"]["backend"] == "cupy" and "CUDA-event" in data["device"]["how_measured"]
    assert data["offload"]["host_to_device_mb_s"] > 0 and data["cost_model"]["t_exp_miss_ms"] > 0
    prof = load_profile(str(out))
    monkeypatch.setattr(profile_cmd, "profile_backend", lambda name, kind: device)
    loaded = load_model(folder)
    passes, probe = validate_cmd.measured_passes(prof, loaded, load_tokenizer(loaded), workload, 2, 8, 2)
    assert probe["reads"]["ms"] > 0 and data["cost_model"]["fit"]["probe"]["compute"]["ms"] > 0  # probes run there too
    assert passes and all(isinstance(p.kv.keys[0], fake_cupy.DeviceArray)
                          for p in passes)
    assert validate_cmd.evaluate(prof, [p.sample() for p in passes])["n"] == len(passes)
