"""Logits of the NumPy runtime vs `transformers` on tiny random models (float32, ≤ 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

import tiny_models as tm
from s2moe.runtime.loader import load_model
from s2moe.runtime.model import MoEModel

TOL = 1e-4


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", tm.FAMILIES)
def test_prefill_decode_and_verify_after_rollback(tiny_model_dirs, family, layout, rng):
    torch_model, per_expert, fused = tiny_model_dirs[family]
    loaded = load_model(per_expert if layout == "per_expert" else fused)
    assert loaded.expert_layout == ("per-expert" if layout == "per_expert" else "fused")
    model = MoEModel(loaded)
    ids = rng.integers(0, 380, 28)
    ref = tm.torch_logits(torch_model, ids)  # [28, V]
    kv = model.new_cache(64)

    # 16-token prefill
    logits, record = model.forward(ids[:16], kv)
    kv.commit(16)
    np.testing.assert_allclose(logits, ref[:16], atol=TOL, rtol=0)
    assert set(record.layers) == set(loaded.config.moe_layer_ids)

    # 8 tokens decoded one at a time through the cache
    for i in range(16, 24):
        step, _ = model.forward(ids[i:i + 1], kv)
        kv.commit(i + 1)
        np.testing.assert_allclose(step[0], ref[i], atol=TOL, rtol=0)

    # draft-like writes past the committed length, then rollback and a 4-token verification batch
    model.forward(rng.integers(0, 380, 3), kv)  # garbage KV at 24..26, never committed
    assert kv.filled == 27 and kv.length == 24
    kv.rollback(20)  # drop 4 committed positions too: verification restarts at 20
    verify, _ = model.forward(ids[20:24], kv)
    np.testing.assert_allclose(verify, ref[20:24], atol=TOL, rtol=0)


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
