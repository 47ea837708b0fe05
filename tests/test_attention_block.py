"""The CPU kernels' one-call attention block (`CpuOps.gqa_block`, csrc/cpu/attend.c op_attn_block)
against the step-by-step path on the NumPy reference kernels (model/attention.py `gqa`), and the
forward pass with and without it."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from s2moe.runtime.kernels import cpu
from s2moe.runtime.kernels.reference import ReferenceOps
from s2moe.runtime.model import rope
from s2moe.runtime.model.attention import gqa, rms_norm
from s2moe.runtime.model.kv_cache import KVCache
from test_kernels import REL, ops, random_matrix, rel_err  # noqa: F401 (ops: the simd / portable fixture)


def _layer(rng, dtype, qk_norm, biases, sinks, H=128, nh=4, nkv=2, D=32):
    c = SimpleNamespace(attention="gqa", clip_qkv=None, qk_norm=qk_norm, rope_dim=D, head_dim=D, num_heads=nh,
                        num_kv_heads=nkv, rms_norm_eps=1e-5, attn_scale=D ** -0.5, attention_sinks=sinks,
                        rope_interleave=False)
    N = (nh + 2 * nkv) * D
    W = {"layers.0.qkv": random_matrix(rng, dtype, N, H), "layers.0.o": random_matrix(rng, dtype, H, nh * D)}
    if biases:
        W["layers.0.qkv_bias"] = rng.standard_normal(N).astype(np.float32)
        W["layers.0.o_bias"] = rng.standard_normal(H).astype(np.float32)
    if qk_norm != "none":
        n_q, n_k = (nh * D, nkv * D) if qk_norm == "full" else (D, D)
        W["layers.0.q_norm"] = (1 + 0.3 * rng.standard_normal(n_q)).astype(np.float32)
        W["layers.0.k_norm"] = (1 + 0.3 * rng.standard_normal(n_k)).astype(np.float32)
    if sinks:
        W["layers.0.sinks"] = rng.standard_normal(nh).astype(np.float32)
    return c, W, H


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("qk_norm,biases,sinks", [("none", False, False), ("full", False, False),
                                                  ("per_head", True, False), ("none", True, True)])
def test_the_attention_block_matches_the_steps(ops, dtype, qk_norm, biases, sinks, rng):
    """OLMoE (full q/k norm), Qwen3 (per head), GPT-OSS (biases, sinks), Mixtral (none): one
    decode token and a 3-token verification with a tree hole, after 21 cached positions."""
    c, W, H = _layer(rng, dtype, qk_norm, biases, sinks)
    norm = (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)
    start, D = 21, c.head_dim
    for T in (1, 3):
        h = rng.standard_normal((T, H)).astype(np.float32)
        cs = rope.tables(1.0 / 10000 ** (np.arange(0, D, 2) / D), 1.0, np.arange(start, start + T))
        allowed = np.ones((T, start + T), bool)
        allowed[:, start:] = np.tril(np.ones((T, T), bool))
        if T == 3:
            allowed[2, start + 1] = False
        kvs = [KVCache(1, c.num_kv_heads, D, 32) for _ in range(2)]
        kvs[0].keys[0][:, :start] = rng.standard_normal((c.num_kv_heads, start, D))
        kvs[0].values[0][:, :start] = rng.standard_normal((c.num_kv_heads, start, D))
        kvs[1].keys[0][:] = kvs[0].keys[0]
        kvs[1].values[0][:] = kvs[0].values[0]
        got = ops.gqa_block(c, W, 0, h, norm, start, kvs[0], cs, allowed)
        ref = ReferenceOps()
        want = h + gqa(c, W, ref, 0, rms_norm(h, norm, c.rms_norm_eps), start, kvs[1], cs, allowed)
        assert got is not None and got.shape == (T, H)
        assert rel_err(got, want) <= 10 * REL, (T, rel_err(got, want))  # two products and a softmax deep
        np.testing.assert_allclose(kvs[0].keys[0], kvs[1].keys[0], atol=1e-5)  # the rotated keys it wrote
        np.testing.assert_allclose(kvs[0].values[0], kvs[1].values[0], atol=1e-5)


def test_what_the_block_does_not_take_goes_step_by_step(rng):
    """F32 projections (BLAS), clipped q/k/v and partial RoPE return None: the caller's path."""
    ops = cpu.CpuOps()
    for change in ("f32", "clip", "partial_rope"):
        c, W, H = _layer(rng, "F16", "none", False, False)
        if change == "f32":
            W["layers.0.qkv"] = random_matrix(rng, "F32", *W["layers.0.qkv"].shape)
        elif change == "clip":
            c.clip_qkv = 8.0
        else:
            c.rope_dim = 16
        kv = KVCache(1, c.num_kv_heads, c.head_dim, 8)
        cs = rope.tables(1.0 / 10000 ** (np.arange(0, 32, 2) / 32), 1.0, np.arange(1))
        h = np.zeros((1, H), np.float32)
        assert ops.gqa_block(c, W, 0, h, np.ones(H, np.float32), 0, kv, cs, np.ones((1, 1), bool)) is None, change


def test_decode_with_and_without_the_block_agree(monkeypatch):
    """The embedded default model (F16, OLMoE's full q/k norm): logits of a prompt and of 8 decode
    steps are the same with the one-call block and with the steps (both on the C kernels)."""
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.model.forward import MoEModel
    from s2moe.runtime.model.loader import load_model

    loaded = load_model(str(DEFAULT_MODEL))
    outs = []
    for on in (True, False):
        monkeypatch.setattr(cpu.CpuOps, "attention_blocks", on)
        model = MoEModel(loaded, ops=cpu.CpuOps())
        kv = model.new_cache(64)
        logits, _ = model.forward(list(range(40, 60)), kv, logits="last", record=False)
        kv.commit(20)
        rows = [logits[-1]]
        for t in itertools.islice(itertools.count(100, 37), 8):
            logits, _ = model.forward([t], kv, record=False)
            kv.commit(kv.filled)
            rows.append(logits[-1])
        outs.append(np.array(rows))
    # the same kernels in the same order: equal but for the residual's addition order
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-6 * np.abs(outs[1]).max())
