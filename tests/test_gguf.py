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


def _random_q4k_blocks(rng, rows: int, cols: int) -> np.ndarray:
    """Valid Q4_K bytes: per 256-value block d, dmin (f16), 12 scale bytes, 128 nibble bytes."""
    blocks = rows * cols // 256
    raw = rng.integers(0, 256, (blocks, 144), dtype=np.uint8)
    scales = np.stack([rng.uniform(0.001, 0.01, blocks), rng.uniform(0.0, 0.01, blocks)], -1).astype(np.float16)
    raw[:, :4] = scales.view(np.uint8).reshape(blocks, 4)
    return raw.reshape(rows, cols // 256 * 144)


def test_q4k_experts_match_gguf_dequantisation(tmp_path, rng):
    """Q4_K (dequantise-only in the gguf package): experts built from random blocks."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    torch_model = tm.build("olmoe", hidden=256, experts=4)
    folder = tm.save(torch_model, tmp_path / "hf")
    loaded = load_model(folder)
    c = loaded.config
    E, I, H = c.num_experts, c.expert_intermediate_size, c.hidden_size
    overrides = {}
    with torch.no_grad():
        for L in range(c.num_layers):
            fused = torch_model.model.layers[L].mlp.experts.gate_up_proj  # [E, 2I, H]
            halves = []
            for proj in ("gate", "up"):
                q = _random_q4k_blocks(rng, E * I, H)
                overrides[f"blk.{L}.ffn_{proj}_exps.weight"] = (q.reshape(E, I, -1), GGMLQuantizationType.Q4_K)
                halves.append(dequantize(q, GGMLQuantizationType.Q4_K).reshape(E, I, H))
            fused.copy_(torch.from_numpy(np.concatenate(halves, axis=1)))
    path = str(tmp_path / "q4k.gguf")
    write_gguf(loaded, path, ExpertStore(loaded).read, "F32", raw_overrides=overrides)
    g = load_model(path)
    assert g.experts[0, 1].gate.dtype == "Q4_K" and g.experts[0, 1].gate.nbytes == I * H // 256 * 144
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
