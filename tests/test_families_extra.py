"""DeepSeek-V2/V3 and GPT-OSS against transformers: logits (HF and GGUF), routing, expert bytes,
MXFP4 (bit-exact dequantisation, GGUF and safetensors experts), speculative decoding, `s2moe info`.

Tiny random models (tests/tiny_models.py, EXTRA_FAMILIES); float32 throughout, tolerance helpers.TOL (1e-5).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import tiny_models as tm
from helpers import TOL, assert_f32_gguf_matches, check_prefill_decode_verify, gguf_logits, save_families
from s2moe.runtime.model.formats.gguf_writer import write_gguf
from s2moe.runtime.model.formats.mxfp4 import dequantize_ggml, dequantize_hf
from s2moe.runtime.model.loader import load_model
from s2moe.runtime.model.forward import MoEModel
from s2moe.runtime.model.routing import RoutingPolicy, route, softmax
from s2moe.runtime.offload.store import ExpertStore

# transformers comparisons: the NumPy reference path (conftest.reference_kernels)
pytestmark = pytest.mark.usefixtures("reference_kernels")

DEEPSEEK = ("deepseek_v2", "deepseek_v2_plain", "deepseek_v3")


@pytest.fixture(scope="module")
def extra_dirs(tmp_path_factory, tiny_tokenizer_json):
    return save_families(tm.EXTRA_FAMILIES, tmp_path_factory, tiny_tokenizer_json)


@pytest.mark.parametrize("family,layout", [(f, lay) for f in DEEPSEEK for lay in ("per_expert", "fused")]
                         + [("gpt_oss", "fused")])
def test_prefill_decode_and_verify_after_rollback(extra_dirs, family, layout, rng):
    torch_model, per_expert, fused = extra_dirs[family]
    model = check_prefill_decode_verify(torch_model, per_expert if layout == "per_expert" else fused, rng)
    expected = {"per_expert": "per-expert", "fused": "fused"}[layout] if family != "gpt_oss" else "interleaved"
    assert model.loaded.expert_layout == expected


@pytest.mark.parametrize("family", tm.EXTRA_FAMILIES)
def test_router_matches_torch(extra_dirs, family, rng):
    """Logits, chosen experts and mixture weights of every MoE layer equal transformers' router."""
    torch_model, folder, _ = extra_dirs[family]
    model = MoEModel(load_model(folder))
    captured = []
    hooks = []
    for layer in torch_model.model.layers:
        router = getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None)
        if router is not None and not isinstance(router, torch.nn.Linear):
            hooks.append(router.register_forward_hook(lambda mod, inp, out: captured.append(out)))
    ids = rng.integers(0, 380, 20)
    try:
        tm.torch_logits(torch_model, ids)
    finally:
        for h in hooks:
            h.remove()
    _, record = model.forward(ids, model.new_cache(20))
    assert len(captured) == len(model.config.moe_layer_ids)
    for L, (logits, weights, experts) in zip(model.config.moe_layer_ids, captured):
        ours = record.layers[L]
        # router logits run ≈4× the final logits' scale (RMS 3.9–4.6): TOL in units of their RMS
        scale = max(1.0, float(np.sqrt(np.mean(logits.numpy().astype(np.float64) ** 2))))
        np.testing.assert_allclose(ours.logits, logits.numpy(), atol=TOL * scale, rtol=0)
        theirs = experts.numpy()
        order_t, order_o = np.argsort(theirs, -1), np.argsort(ours.experts, -1)
        assert np.array_equal(np.take_along_axis(theirs, order_t, -1), np.take_along_axis(ours.experts, order_o, -1))
        np.testing.assert_allclose(np.take_along_axis(ours.weights, order_o, -1),
                                   np.take_along_axis(weights.numpy(), order_t, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", tm.EXTRA_FAMILIES)
def test_expert_bytes_shared_experts_and_kv(extra_dirs, family):
    _, folder, fused = extra_dirs[family]
    for path in (folder, fused):
        loaded = load_model(path)
        c = loaded.config
        store = ExpertStore(loaded, direct=False)
        for (L, e), refs in loaded.experts.items():
            w = store.read(L, e)
            assert refs.resident_bytes_for(False) == w.nbytes  # what the cache will count (buffered reads)
            assert w.gate.shape == (c.expert_intermediate_size, c.hidden_size) and w.down.shape[0] == c.hidden_size
        store.close()
        biases = 2 * c.expert_intermediate_size + c.hidden_size if c.expert_bias else 0
        per_expert = (3 * c.expert_intermediate_size * c.hidden_size + biases) * 4
        assert {r.stored_bytes for r in loaded.experts.values()} == {per_expert}  # float32 checkpoint
        assert len(loaded.experts) == len(c.moe_layer_ids) * c.num_experts
    if family in DEEPSEEK:
        assert c.moe_layers == (False, True, True)  # first_k_dense_replace = 1
        for L in c.moe_layer_ids:  # shared experts are dense weights, never expert-cache entries
            assert loaded.dense[f"layers.{L}.shared_gate"].shape == (c.shared_expert_intermediate_size, c.hidden_size)
        kv = MoEModel(loaded).new_cache(10)
        assert kv.keys[0].shape == (1, 10, c.kv_lora_rank) and kv.values[0].shape == (1, 10, c.qk_rope_head_dim)


@pytest.mark.parametrize("split", [False, True], ids=["merged", "split"])
@pytest.mark.parametrize("family", tm.EXTRA_FAMILIES)
def test_f32_gguf_matches_transformers(extra_dirs, tmp_path, family, split, rng):
    torch_model, folder, _ = extra_dirs[family]
    assert_f32_gguf_matches(torch_model, folder, tmp_path / "m.gguf", split, rng.integers(0, 380, 28), TOL)


def test_deepseek_v3_rope_on_halves(tmp_path, rng):
    """V3 with rope_interleave false rotates (i, i + d/2) pairs; llama.cpp's GGUF cannot say so."""
    from s2moe.runtime.errors import UsageError

    torch_model = tm.build("deepseek_v3")
    torch_model.config.rope_interleave = False  # read at forward time; saved into config.json
    folder = tm.save(torch_model, tmp_path / "hf")
    model = check_prefill_decode_verify(torch_model, folder, rng)
    assert model.config.rope_interleave is False
    with pytest.raises(UsageError, match="adjacent RoPE pairs"):
        write_gguf(model.loaded, str(tmp_path / "m.gguf"), ExpertStore(model.loaded).read, "F32")


def test_gguf_kv_b_rebuilt_from_llama_cpp_split(extra_dirs, tmp_path):
    """llama.cpp writes MLA's kv_b also as attn_k_b / attn_v_b; either one gives the same kv_b."""
    from s2moe.runtime.model import dense as D
    from s2moe.runtime.model.loader import _kv_b_from_split, _Resolver
    from s2moe.runtime.model.models import BY_GGUF_ARCH, names_for
    from s2moe.runtime.model.formats import tensors as T

    _, folder, _ = extra_dirs["deepseek_v2"]
    loaded = load_model(folder)
    path = str(tmp_path / "m.gguf")
    write_gguf(loaded, path, ExpertStore(loaded).read, "F32")
    g = load_model(path)
    res = _Resolver(g.gguf.tensors, names_for(BY_GGUF_ARCH["deepseek2"], "gguf"), path)
    for L in range(g.config.num_layers):
        rebuilt = D.build(_kv_b_from_split(g.config, res, L, "kv_b"), lambda ref: T.read_bytes(ref))
        np.testing.assert_array_equal(rebuilt, g.dense[f"layers.{L}.kv_b"])


# -- MXFP4 --------------------------------------------------------------------------------------
def test_mxfp4_hf_dequantisation_is_bit_exact_with_transformers(rng):
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, (3, 10, 4), dtype=np.uint8)  # every E8M0 value, 0 and 255 included
    scales.flat[:256] = np.arange(256)
    ref = _convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    ours = dequantize_hf(blocks, scales).transpose(0, 2, 1)  # transformers returns [E, in, out]
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_mxfp4_ggml_dequantisation_is_bit_exact_with_gguf(rng):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = rng.integers(0, 256, (300, 17), dtype=np.uint8)
    raw[:256, 0] = np.arange(256)
    with np.errstate(over="ignore"):
        ref = dequantize(raw, GGMLQuantizationType.MXFP4).reshape(-1)
    assert np.array_equal(dequantize_ggml(raw).view(np.uint32), ref.view(np.uint32))


def _mxfp4_roundtrip(w: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q = GGMLQuantizationType.MXFP4
    return dequantize(quantize(np.ascontiguousarray(w, dtype=np.float32), q), q).reshape(w.shape)


def test_mxfp4_gguf_experts_match_dequantised_torch(extra_dirs, tmp_path, rng):
    torch_model, folder, _ = extra_dirs["gpt_oss"]
    loaded = load_model(folder)
    path = str(tmp_path / "mxfp4.gguf")
    write_gguf(loaded, path, ExpertStore(loaded).read, "F32", expert_type="MXFP4")
    g = load_model(path)
    c = g.config
    I, H = c.expert_intermediate_size, c.hidden_size
    refs = g.experts[0, 1]
    assert refs.storage_type == "MXFP4" and refs.gate.nbytes == I * H // 32 * 17
    assert refs.stored_bytes == 3 * I * H // 32 * 17 + (2 * I + H) * 4  # biases stay F32
    # resident as stored: MXFP4 blocks (page-rounded read buffers) and float32 biases
    store = ExpertStore(g)
    direct = store.reader.is_direct(refs.gate.path)
    assert refs.resident_bytes_for(direct) == store.read(0, 1).nbytes
    assert refs.stored_bytes <= refs.resident_bytes_for(False) <= refs.stored_bytes + (2 * I + H) * 4
    reference = copy.deepcopy(torch_model)
    with torch.no_grad():
        for layer in reference.model.layers:
            ex = layer.mlp.experts
            gu = ex.gate_up_proj.numpy().copy()  # [E, H, 2I], gate/up interleaved
            for half in (0, 1):  # GGUF stores gate/up as [E, I, H]: quantised along H
                gu[..., half::2] = _mxfp4_roundtrip(gu[..., half::2].transpose(0, 2, 1)).transpose(0, 2, 1)
            ex.gate_up_proj.copy_(torch.from_numpy(gu))
            down = ex.down_proj.numpy()  # [E, I, H]; GGUF [E, H, I]: quantised along I
            ex.down_proj.copy_(torch.from_numpy(_mxfp4_roundtrip(down.transpose(0, 2, 1)).transpose(0, 2, 1).copy()))
    ids = rng.integers(0, 380, 28)
    np.testing.assert_allclose(gguf_logits(path, ids), tm.torch_logits(reference, ids), atol=TOL, rtol=0)


def _mxfp4_folder(torch_model, folder, dst, rng):
    """The hub's GPT-OSS layout: experts as `*_blocks` / `*_scales` (uint8) from random blocks;
    returns the torch model with those experts set to transformers' own dequantisation."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    shutil.copytree(folder, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    reference = copy.deepcopy(torch_model)
    with torch.no_grad():
        for L, layer in enumerate(reference.model.layers):
            ex = layer.mlp.experts
            E, H, I2 = ex.gate_up_proj.shape
            # scale ranges keep activations moderate while the gate clamp still bites
            for name, rows, cols, lo, hi in (("gate_up_proj", I2, H, 123, 126), ("down_proj", H, I2 // 2, 119, 122)):
                blocks = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
                scales = rng.integers(lo, hi, (E, rows, cols // 32), dtype=np.uint8)
                getattr(ex, name).copy_(_convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                                    dtype=torch.float32))
                key = f"model.layers.{L}.mlp.experts.{name}"
                del tensors[key]
                tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return reference


def test_mxfp4_safetensors_experts_match_transformers_dequantisation(extra_dirs, tmp_path, rng):
    from s2moe.runtime.cli.info import describe

    torch_model, folder, _ = extra_dirs["gpt_oss"]
    reference = _mxfp4_folder(torch_model, folder, tmp_path / "mxfp4", rng)
    model = check_prefill_decode_verify(None, str(tmp_path / "mxfp4"), rng, ref_model=reference)
    loaded = model.loaded
    c = loaded.config
    I, H = c.expert_intermediate_size, c.hidden_size
    assert loaded.expert_layout == "interleaved-mxfp4"
    facts = describe(loaded)
    packed = 3 * I * H // 2 + 3 * I * H // 32  # 4-bit values + one scale byte per 32
    assert facts["expert_storage_type"] == "MXFP4"
    assert facts["expert_bytes_stored"] == packed + (2 * I + H) * 4
    # repacked into GGML MXFP4 rows (same bytes) with float32 biases: the stored size, not float32's
    assert facts["expert_bytes_resident"] == packed + (2 * I + H) * 4
    w = ExpertStore(loaded).read(1, 3)
    assert facts["expert_bytes_resident"] == w.nbytes


# -- routing policies ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind,groups,score_bias", [("softmax_topk", (4, 2), False), ("sigmoid_topk", (4, 2), True),
                                                    ("topk_softmax", None, False)])
def test_selection_bias_changes_choice_never_weights(kind, groups, score_bias, rng):
    logits = rng.normal(0, 0.5, size=(6, 16)).astype(np.float32)
    # small correction bias: RG shifts the logit before the sigmoid, so its effect saturates at 1
    sb = rng.normal(0, 0.02, 16).astype(np.float32) if score_bias else None
    bias = np.zeros_like(logits)
    bias[:, [1, 5, 9, 13]] = 1000.0  # one expert in each group: selection must follow the bias
    experts, weights = route(logits, 2, kind, kind == "sigmoid_topk", bias, scale=2.0, groups=groups, score_bias=sb)
    assert set(experts.ravel()) <= {1, 5, 9, 13}
    plain = {"softmax_topk": softmax(logits), "sigmoid_topk": 1 / (1 + np.exp(-logits))}.get(kind)
    if plain is None:  # top-k then softmax: over the chosen (unbiased) logits
        expected = softmax(np.take_along_axis(logits, experts, -1))
    else:
        expected = np.take_along_axis(plain, experts, -1)
        if kind == "sigmoid_topk":
            expected = expected / expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, 2.0 * expected, rtol=1e-5)


@pytest.mark.parametrize("family", tm.EXTRA_FAMILIES)
def test_draft_top_k(extra_dirs, family):
    model = MoEModel(load_model(extra_dirs[family][1]))
    _, rec = model.forward([1, 2, 3], model.new_cache(3), policy=RoutingPolicy(top_k=1))
    assert all(r.experts.shape[1] == 1 for r in rec.layers.values())


# -- speculative decoding -----------------------------------------------------------------------
@pytest.mark.parametrize("family,budget", [("deepseek_v2", "0.5"), ("deepseek_v2_plain", None), ("deepseek_v3", "0.3"),
                                           ("gpt_oss", "0.4")])
def test_greedy_speculative_equals_ar(extra_dirs, family, budget):
    from s2moe.runtime.decoding.cost_model import CostConstants
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.decoding.generate import generate_ar
    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder

    eager = CostConstants(t_ar=50.0, c_draft=0.002, t_exp_miss=0.001, t_exp_hit=0.0002)  # AE admits: drafts run
    engine = build_engine(extra_dirs[family][1], budget)
    prng = np.random.default_rng(7)
    prompts = [list(prng.integers(0, 380, prng.integers(3, 12))) for _ in range(4)]
    expected = [generate_ar(engine.model, p, 14).tokens for p in prompts]
    for name in ("ca", "ca+ae", "es"):
        dec = SpeculativeDecoder(engine.model, get_method(name, reuse_gating=False),
                                 SpecSettings(draft_topk=1, draft_cap=4), eager)
        assert [dec.generate(p, 14).tokens for p in prompts] == expected, name
    # reuse-aware gating on: lossy by design, but it must run through these routers
    dec = SpeculativeDecoder(engine.model, get_method("s2moe"), SpecSettings(draft_topk=1, draft_cap=4), eager)
    assert dec.generate(prompts[0], 14).stats()["generated_tokens"] > 0
    engine.close()


# -- s2moe info ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["deepseek_v2", "gpt_oss"])
def test_info_json(extra_dirs, family):
    _, folder, _ = extra_dirs[family]
    r = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "info", "--model", folder, "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    c = tm.make_config(family)
    H = c.hidden_size
    if family == "deepseek_v2":
        I = c.moe_intermediate_size
        assert facts["architecture"] == "deepseek_v2" and facts["attention"] == "mla"
        assert facts["experts_per_layer"] == 16 and facts["top_k"] == 4 and facts["moe_layers"] == 2
        assert facts["expert_bytes_stored"] == 3 * H * I * 4
        # resident as stored; O_DIRECT rounds each read range (per-expert tensors: one) out to pages
        assert 0 <= facts["expert_bytes_resident"] - facts["expert_bytes_stored"] < 2 * 4096
        shared = 2 * 3 * H * I * 2 * 4  # 2 MoE layers × gate/up/down, 2 shared experts wide, F32
        assert shared <= facts["shared_expert_bytes_resident"] <= shared + 6 * 2 * 4096  # page-rounded reads
        assert facts["kv_cache_type"] == "f16"  # runs' default
        assert facts["kv_bytes_per_position"] == 3 * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
        assert "best 2 of 4 groups" in facts["router"]
    else:
        I = c.intermediate_size
        assert facts["architecture"] == "gpt_oss" and facts["expert_layout"] == "interleaved"
        assert facts["experts_per_layer"] == 8 and facts["top_k"] == 2 and facts["moe_layers"] == 3
        assert facts["expert_bytes_stored"] == (3 * H * I + 2 * I + H) * 4
        assert facts["expert_bytes_resident"] == (3 * H * I + 2 * I + H) * 4  # transposed into F32 rows
        assert facts["attention"] == "gqa, window 8 on 2 of 3 layers, sinks"
        assert facts["expert_activation"] == "swiglu_clamped with biases"
