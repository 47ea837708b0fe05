"""Assertions and small utilities shared by several test files."""

from __future__ import annotations

import numpy as np

from s2moe.runtime.model.loader import load_model
from s2moe.runtime.model.forward import MoEModel

# Logits vs transformers, float32 end to end. Measured worst error over prefill, decode and verify
# (5 random id sequences, per-expert and fused folders): olmoe 2.7e-7, qwen3_moe 3.0e-7, mixtral
# 2.4e-7, deepseek_v2 2.7e-7, deepseek_v2_plain 2.5e-7, deepseek_v3 2.4e-7, gpt_oss 4.1e-6 (its
# clamped SwiGLU and attention sinks); F32 GGUF the same, router logits (≈10× larger) ≤ 4.8e-6.
# On an Intel VM (other BLAS kernels) GPT-OSS's third router reached 1.07e-5 at an RMS of 3.9, so
# router logits are held to TOL times their RMS (test_families_extra.py).
# 1e-5 keeps ≥ 2× headroom over the worst of these and stays below what a real numerical bug
# moves: rounding every expert weight to fp16 moves the logits by 1.9–4e-5
# (test_reference_logits.py::test_tolerance_sees_fp16_rounded_experts).
TOL = 1e-5


def save_families(families, tmp_path_factory, tokenizer_json: str) -> dict:
    """family -> (torch model, per-expert folder, fused folder), each folder with the tokenizer
    (GPT-OSS is fused either way)."""
    import os
    import shutil

    import tiny_models as tm

    out = {}
    for family in families:
        model = tm.build(family)
        base = tmp_path_factory.mktemp(family)
        folders = tm.save(model, base / "per_expert", fused=False), tm.save(model, base / "fused", fused=True)
        for folder in folders:
            shutil.copy(tokenizer_json, os.path.join(folder, "tokenizer.json"))
        out[family] = (model, *folders)
    return out


def check_prefill_decode_verify(torch_model, path, rng, ref_model=None) -> MoEModel:
    """Logits vs transformers: 16-token prefill, 8 single-token decodes, garbage draft writes past
    the committed length, rollback into committed positions, then a 4-token verification batch."""
    import tiny_models as tm

    model = MoEModel(load_model(path))
    ids = rng.integers(0, 380, 28)
    ref = tm.torch_logits(ref_model or torch_model, ids)  # [28, V]
    kv = model.new_cache(64)
    logits, record = model.forward(ids[:16], kv)
    kv.commit(16)
    np.testing.assert_allclose(logits, ref[:16], atol=TOL, rtol=0)
    assert set(record.layers) == set(model.config.moe_layer_ids)
    for i in range(16, 24):
        step, _ = model.forward(ids[i:i + 1], kv)
        kv.commit(i + 1)
        np.testing.assert_allclose(step[0], ref[i], atol=TOL, rtol=0)
    model.forward(rng.integers(0, 380, 3), kv)  # garbage KV at 24..26, never committed
    assert kv.filled == 27 and kv.length == 24
    kv.rollback(20)  # drop 4 committed positions too: verification restarts at 20
    verify, _ = model.forward(ids[20:24], kv)
    np.testing.assert_allclose(verify, ref[20:24], atol=TOL, rtol=0)
    return model


def gguf_logits(path, ids) -> np.ndarray:
    """Prefill logits of a model file loaded fresh."""
    model = MoEModel(load_model(path))
    logits, _ = model.forward(ids, model.new_cache(len(ids)))
    return logits


def assert_f32_gguf_matches(torch_model, folder, path, split: bool, ids, tol: float) -> None:
    """Write the HF folder as an F32 GGUF (merged or split experts), load it back, and compare its
    config and prefill logits with the torch model."""
    import tiny_models as tm
    from s2moe.runtime.model.formats.gguf_writer import write_gguf
    from s2moe.runtime.offload.store import ExpertStore

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
    # rows computed in other batches differ in float32's last bits; a rounded cache (f16, runs'
    # default) can then hold the neighbouring value: one step of its type
    rtol = {"f32": 0.0, "f16": 2.0 ** -10, "q8_0": 1 / 127}[kv.cache_type]
    for L in range(model.config.num_layers):
        for ours, theirs in zip(kv.view(L, len(text)), fresh.view(L, len(text))):
            np.testing.assert_allclose(ours, theirs, atol=1e-5 + rtol * np.abs(theirs).max(), rtol=rtol)


def invoke(app, *args) -> tuple[int, str, str]:
    """Run a typer app (`s2moe`, `s2moe-calib`) in-process: (exit code, stdout, stderr). An
    exception the CLI's error table did not handle is raised as itself: the documented outcome
    (a one-line error) did not happen."""
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, [str(a) for a in args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def s2moe(*args) -> tuple[int, str, str]:
    """Run an `s2moe` command in-process: (exit code, stdout, stderr)."""
    from s2moe.runtime.cli import app

    return invoke(app, *args)


def one_line_error(code, stderr, *needles, exit_code=2) -> None:
    """The documented outcome of bad input: exactly one `error: ` line holding each needle."""
    lines = stderr.strip().splitlines()
    assert code == exit_code, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
