"""Logits of the NumPy runtime vs `transformers` on tiny random models (float32, ≤ 1e-5: helpers.TOL)."""

from __future__ import annotations

import numpy as np
import pytest

import tiny_models as tm
from helpers import TOL, check_prefill_decode_verify
from s2moe.runtime.model.loader import load_model
from s2moe.runtime.model.forward import MoEModel

# transformers comparisons: the NumPy reference path (conftest.reference_kernels)
pytestmark = pytest.mark.usefixtures("reference_kernels")

@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", tm.FAMILIES)
def test_prefill_decode_and_verify_after_rollback(tiny_model_dirs, family, layout, rng):
    torch_model, per_expert, fused = tiny_model_dirs[family]
    model = check_prefill_decode_verify(torch_model, per_expert if layout == "per_expert" else fused, rng)
    assert model.loaded.expert_layout == ("per-expert" if layout == "per_expert" else "fused")


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_routing_record_matches_torch_router(tiny_model_dirs, family, rng):
    """The chosen experts per token equal transformers' router choice (layer 0 input)."""
    import torch

    torch_model, per_expert, _ = tiny_model_dirs[family]
    model = MoEModel(load_model(per_expert))
    ids = rng.integers(0, 380, 12)
    _, record = model.forward(ids, model.new_cache(16))
    with torch.no_grad():
        out = torch_model(torch.tensor([ids.tolist()]), output_router_logits=True)
    torch_logits = out.router_logits[0].float().numpy()  # layer 0: [T, E]
    np.testing.assert_allclose(record.layers[0].logits, torch_logits, atol=TOL, rtol=0)
    k = model.config.top_k
    expected = np.argsort(-torch_logits, axis=-1, kind="stable")[:, :k]
    assert np.array_equal(np.sort(record.layers[0].experts, -1), np.sort(expected, -1))


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_tolerance_sees_fp16_rounded_experts(tiny_model_dirs, family, tmp_path, rng):
    """TOL is tight enough to see a real numerical bug: a checkpoint whose expert weights were
    rounded to fp16 (what a kernel staging experts in half precision would compute) is off by
    1.9–2.8e-5 from the original model, more than TOL, while it matches its own rounded reference."""
    import copy

    import torch

    torch_model = tiny_model_dirs[family][0]
    rounded = copy.deepcopy(torch_model)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if "experts" in name:
                p.copy_(p.half().float())
    model = MoEModel(load_model(tm.save(rounded, tmp_path / "fp16", fused=False)))
    ids = rng.integers(0, 380, 28)
    ours, _ = model.forward(ids, model.new_cache(32))
    np.testing.assert_allclose(ours, tm.torch_logits(rounded, ids), atol=TOL, rtol=0)
    assert np.abs(ours - tm.torch_logits(torch_model, ids)).max() > TOL
