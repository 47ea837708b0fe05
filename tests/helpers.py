"""Assertions and small utilities shared by several test files."""

from __future__ import annotations

import numpy as np

from s2moe.runtime.loader import load_model
from s2moe.runtime.model import MoEModel


def gguf_logits(path, ids) -> np.ndarray:
    """Prefill logits of a model file loaded fresh."""
    model = MoEModel(load_model(path))
    logits, _ = model.forward(ids, model.new_cache(len(ids)))
    return logits


def assert_f32_gguf_matches(torch_model, folder, path, split: bool, ids, tol: float) -> None:
    """Write the HF folder as an F32 GGUF (merged or split experts), load it back, and compare its
    config and prefill logits with the torch model."""
    import tiny_models as tm
    from s2moe.runtime.formats.gguf_writer import write_gguf
    from s2moe.runtime.store import ExpertStore

    loaded = load_model(folder)
    write_gguf(loaded, str(path), ExpertStore(loaded).read, "F32", split_experts=split)
    g = load_model(str(path))
    assert g.format == "gguf" and g.expert_layout == ("split" if split else "merged")
    assert g.config == loaded.config
    np.testing.assert_allclose(gguf_logits(str(path), ids), tm.torch_logits(torch_model, ids), atol=tol, rtol=0)


def assert_kv_is_fresh_prefill(model, kv, prompt, tokens) -> None:
    """The committed KV equals a fresh target prefill of the committed text (the last generated
    token is pending: it is not in the KV yet)."""
    text = list(prompt) + list(tokens[:-1])
    assert kv.length == len(text)
    fresh = model.new_cache(len(text))
    model.forward(text, fresh, record=False)
    for L in range(model.config.num_layers):
        np.testing.assert_allclose(kv.keys[L][:, :len(text)], fresh.keys[L], atol=1e-5)
        np.testing.assert_allclose(kv.values[L][:, :len(text)], fresh.values[L], atol=1e-5)
