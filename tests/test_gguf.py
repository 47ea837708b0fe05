"""GGUF files (merged and split experts; F32, F16, BF16, Q8_0, Q4_0, Q4_K) give matching logits.

For lossy types the reference is the torch model with every stored weight replaced by what the
`gguf` package itself dequantises, so the check isolates our slicing and layout handling.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import tiny_models as tm
from helpers import TOL, assert_f32_gguf_matches, gguf_logits
from s2moe.runtime.offload.store import ExpertStore
from s2moe.runtime.model.formats.gguf_writer import write_gguf
from s2moe.runtime.model.loader import load_model
from s2moe.runtime.model.tokenizer import load_tokenizer

# transformers comparisons: the NumPy reference path (conftest.reference_kernels)
pytestmark = pytest.mark.usefixtures("reference_kernels")


def _roundtrip_reference(torch_model, kind: str):
    """Copy of the model with weights as a GGUF of ``kind`` stores them (the writer's rules)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    ref = copy.deepcopy(torch_model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim < 2 or name.endswith("gate.weight"):  # norms and routers stay F32
                continue
            w = p.detach().numpy().astype(np.float32)
            if kind == "F16":
                new = w.astype(np.float16).astype(np.float32)
            else:
                qtype = GGMLQuantizationType[kind]
                if w.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
                    new = w.astype(np.float16).astype(np.float32)
                else:
                    new = dequantize(quantize(w, qtype), qtype).reshape(w.shape)
            p.copy_(torch.from_numpy(new))
    return ref


@pytest.mark.parametrize("split", [False, True], ids=["merged", "split"])
@pytest.mark.parametrize("family", tm.FAMILIES)
def test_f32_gguf_matches_transformers(tiny_model_dirs, tmp_path, family, split, rng):
    torch_model, folder, _ = tiny_model_dirs[family]
    assert_f32_gguf_matches(torch_model, folder, tmp_path / "m.gguf", split, rng.integers(0, 380, 16), TOL)


@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_lossy_gguf_matches_gguf_dequantisation(tiny_model_dirs, tmp_path, family, kind, rng):
    torch_model, folder, _ = tiny_model_dirs[family]
    loaded = load_model(folder)
    path = str(tmp_path / "m.gguf")
    write_gguf(loaded, path, ExpertStore(loaded).read, kind)
    ids = rng.integers(0, 380, 16)
    expected = tm.torch_logits(_roundtrip_reference(torch_model, kind), ids)
    np.testing.assert_allclose(gguf_logits(path, ids), expected, atol=TOL, rtol=0)  # measured ≤ 2.7e-7


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_1"])
def test_block_experts_match_gguf_dequantisation(kind, tmp_path, rng):
    """The types the gguf package only dequantises (and Q5_1): experts built from random blocks,
    kept stored at their size, give transformers' logits for the dequantised weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from test_kernels import random_blocks

    from s2moe.runtime.kernels.stored import row_bytes

    torch_model = tm.build("olmoe", hidden=256, experts=4)
    folder = tm.save(torch_model, tmp_path / "hf")
    loaded = load_model(folder)
    c = loaded.config
    E, I, H = c.num_experts, c.expert_intermediate_size, c.hidden_size
    qtype = GGMLQuantizationType[kind]
    overrides = {}
    with torch.no_grad():
        for L in range(c.num_layers):
            fused = torch_model.model.layers[L].mlp.experts.gate_up_proj  # [E, 2I, H]
            halves = []
            for proj in ("gate", "up"):
                q = random_blocks(rng, kind, E * I, H)
                overrides[f"blk.{L}.ffn_{proj}_exps.weight"] = (q.reshape(E, I, -1), qtype)
                halves.append(dequantize(q, qtype).reshape(E, I, H))
            fused.copy_(torch.from_numpy(np.concatenate(halves, axis=1)))
    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(loaded, path, ExpertStore(loaded).read, "F32", raw_overrides=overrides)
    g = load_model(path)
    assert g.experts[0, 1].gate.dtype == kind and g.experts[0, 1].gate.nbytes == I * row_bytes(kind, H)
    ids = rng.integers(0, 380, 12)
    np.testing.assert_allclose(gguf_logits(path, ids), tm.torch_logits(torch_model, ids), atol=TOL, rtol=0)


def test_gguf_tokenizer_round_trips(tiny_model_dirs, tmp_path):
    _, folder, _ = tiny_model_dirs["olmoe"]
    loaded = load_model(folder)
    path = str(tmp_path / "m.gguf")
    write_gguf(loaded, path, ExpertStore(loaded).read, "F16", tokenizer_json=loaded.tokenizer_path)
    hf_tok = load_tokenizer(loaded)
    gguf_tok = load_tokenizer(load_model(path))
    text = "def add(a, b):\n    return a + b  # ünïcode ✓"
    assert gguf_tok.encode(text).ids == hf_tok.encode(text).ids
    assert gguf_tok.decode(hf_tok.encode(text).ids) == text


def test_a_type_without_a_kernel_is_named_once_with_its_cost(tmp_path, rng, tiny_tokenizer_json):
    """IQ2_XXS (a rarer llama.cpp type) has no kernel: its experts are decoded to float32 at load,
    and the run says so in one line with what it costs; the common types say nothing."""
    from gguf import GGMLQuantizationType

    from helpers import s2moe

    torch_model = tm.build("olmoe", hidden=256, experts=4)
    loaded = load_model(tm.save(torch_model, tmp_path / "hf"))
    c = loaded.config
    E, I, H = c.num_experts, c.expert_intermediate_size, c.hidden_size
    overrides = {}
    for L in range(c.num_layers):  # random IQ2_XXS blocks (66 bytes per 256), an f16 scale of 1e-3
        raw = rng.integers(0, 256, (E * I * H // 256, 66), dtype=np.uint8)
        raw[:, :2] = np.array([1e-3], np.float16).view(np.uint8)
        overrides[f"blk.{L}.ffn_up_exps.weight"] = (raw.reshape(E, I, -1), GGMLQuantizationType.IQ2_XXS)
    path = str(tmp_path / "iq2.gguf")
    write_gguf(loaded, path, ExpertStore(loaded).read, "Q8_0", raw_overrides=overrides,
               tokenizer_json=str(tiny_tokenizer_json))
    assert load_model(path).without_kernel() == {"IQ2_XXS": (c.num_layers, c.num_layers * E * I * H // 256 * 66,
                                                              c.num_layers * E * I * H * 4)}
    code, _, err = s2moe("run", "--model", path, "--prompt", "hi", "-n", "2", "--method", "ar")
    notes = [line for line in err.splitlines() if "no kernel" in line]
    assert code == 0 and len(notes) == 1 and notes[0].startswith(f"note: {c.num_layers} IQ2_XXS tensors"), err
    assert "decoded to float32 at load" in notes[0]
    q8 = str(tmp_path / "q8.gguf")
    write_gguf(loaded, q8, ExpertStore(loaded).read, "Q8_0")
    assert load_model(q8).without_kernel() == {}
