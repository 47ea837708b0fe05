"""Self-attention over one layer of the KV cache: grouped-query (GQA) and multi-head latent (MLA).

Both write the new positions into the cache first, then attend from the T new queries to every
slot ``allowed`` marks ([T, S] bool: causal / tree / sliding-window visibility). Optional per-head
attention sinks (GPT-OSS) are one extra logit column of the softmax that takes probability mass
but carries no value.
"""

from __future__ import annotations

import numpy as np

from . import rope
from ..kernels.backend import xp_of
from .config import ModelConfig
from .kv_cache import KVCache


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    xp = xp_of(x)
    var = xp.mean(x * x, axis=-1, keepdims=True)
    return x / xp.sqrt(var + eps) * weight


def masked_softmax(scores: np.ndarray, allowed: np.ndarray, sinks: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis where ``allowed``; ``sinks`` (broadcast to [..., 1]) join the
    normaliser only. Every row sees at least its own slot, so the max is finite."""
    xp = xp_of(scores)
    scores = xp.where(allowed, scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    if sinks is not None:
        top = xp.maximum(top, sinks)
    e = xp.exp(scores - top)
    total = e.sum(-1, keepdims=True)
    if sinks is not None:
        total += xp.exp(sinks - top)
    return e / total


def _linear(ops, x: np.ndarray, W: dict, name: str) -> np.ndarray:
    return ops.linear(x, W[name], W.get(name + "_bias"))


def gqa(c: ModelConfig, W: dict, ops, L: int, x: np.ndarray, start: int, kv: KVCache, cs, allowed) -> np.ndarray:
    T = x.shape[0]
    nh, nkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    p = f"layers.{L}."
    if p + "qkv" in W:  # one product for the three projections (model/dense.py joins them)
        qkv = _linear(ops, x, W, p + "qkv")
        q, k, v = qkv[:, :nh * D], qkv[:, nh * D:(nh + nkv) * D], qkv[:, (nh + nkv) * D:]
    else:
        q, k, v = _linear(ops, x, W, p + "q"), _linear(ops, x, W, p + "k"), _linear(ops, x, W, p + "v")
    if c.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
        q = ops.rms_norm(q, W[p + "q_norm"], c.rms_norm_eps)
        k = ops.rms_norm(k, W[p + "k_norm"], c.rms_norm_eps)
    if c.clip_qkv is not None:
        q, k, v = (xp_of(a).clip(a, -c.clip_qkv, c.clip_qkv) for a in (q, k, v))
    if c.qk_norm == "per_head":  # Qwen3: per head, after the split
        q = ops.rms_norm(q.reshape(T * nh, D), W[p + "q_norm"], c.rms_norm_eps).reshape(T, nh * D)
        k = ops.rms_norm(k.reshape(T * nkv, D), W[p + "k_norm"], c.rms_norm_eps).reshape(T, nkv * D)
    sinks = W[p + "sinks"] if c.attention_sinks else None
    out = ops.attend(q, k, v, kv, L, start, cs, allowed, sinks, nh, nkv, D, c.attn_scale, c.rope_interleave)
    return _linear(ops, out, W, p + "o")


def attend(q, k, v, kv: KVCache, L: int, start: int, cs, allowed, sinks, nh: int, nkv: int, D: int, scale: float,
           interleave: bool) -> np.ndarray:
    """The attention core on arrays (the reference path, host or device): RoPE on q and k, k and v
    into the cache at [start, start + T), softmax(q · K / √d) over the slots ``allowed`` [T, S]
    marks, with optional sinks, times V. q [T, nh·D], k and v [T, nkv·D] → [T, nh·D]."""
    T = q.shape[0]
    q = q.reshape(T, nh, D).transpose(1, 0, 2)  # [nh, T, D]
    k = k.reshape(T, nkv, D).transpose(1, 0, 2)
    v = v.reshape(T, nkv, D).transpose(1, 0, 2)
    q, k = rope.apply(q, *cs, interleave), rope.apply(k, *cs, interleave)
    kv.write(L, start, k, v)
    keys, values = kv.view(L, start + T)  # [nkv, S, D]
    S = start + T
    group = nh // nkv
    qg = q.reshape(nkv, group * T, D)  # heads sharing a kv head stacked on the query axis
    scores = ((qg @ keys.transpose(0, 2, 1)) * scale).reshape(nkv, group, T, S)
    sinks = sinks.reshape(nkv, group, 1, 1) if sinks is not None else None
    probs = masked_softmax(scores, allowed, sinks).reshape(nkv, group * T, S)
    out = (probs @ values).reshape(nh, T, D)
    return out.transpose(1, 0, 2).reshape(T, nh * D)


def mla(c: ModelConfig, W: dict, ops, L: int, x: np.ndarray, start: int, kv: KVCache, cs, allowed) -> np.ndarray:
    """DeepSeek's multi-head latent attention in its absorbed form.

    The cache holds, per position, the normalised latent c_kv [r] and the shared RoPE key k_pe
    [dr]. transformers decompresses every cached latent into per-head keys/values with kv_b; here
    kv_b's key half is folded into the query and its value half applied after the weighted sum,
    which is the same product reassociated: O(heads·S·r) per token instead of O(S·r·heads·(dn+dv)).
    """
    T = x.shape[0]
    nh, r, dr, dv = c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.v_head_dim
    dn = c.head_dim - dr
    p = f"layers.{L}."
    if c.q_lora_rank:
        q = ops.linear(ops.rms_norm(_linear(ops, x, W, p + "q_a"), W[p + "q_a_norm"], c.rms_norm_eps), W[p + "q_b"])
    else:
        q = ops.linear(x, W[p + "q"])
    q = q.reshape(T, nh, dn + dr).transpose(1, 0, 2)  # [nh, T, dn + dr]
    compressed = _linear(ops, x, W, p + "kv_a")  # [T, r + dr]
    latent = ops.rms_norm(compressed[:, :r], W[p + "kv_a_norm"], c.rms_norm_eps)
    q_pe = rope.apply(q[..., dn:], *cs, c.rope_interleave)
    k_pe = rope.apply(compressed[None, :, r:], *cs, c.rope_interleave)  # [1, T, dr]
    kv.write(L, start, latent[None], k_pe)
    lat, pe = kv.view(L, start + T)  # [1, S, r], [1, S, dr]
    kv_b = W[p + "kv_b"].reshape(nh, dn + dv, r)
    q_lat = q[..., :dn] @ kv_b[:, :dn]  # [nh, T, r]: the nope query in latent space
    scores = (q_lat @ lat[0].T + q_pe @ pe[0].T) * c.attn_scale  # [nh, T, S]
    probs = masked_softmax(scores, allowed)
    out = (probs @ lat[0]) @ kv_b[:, dn:].transpose(0, 2, 1)  # [nh, T, dv]
    return _linear(ops, out.transpose(1, 0, 2).reshape(T, nh * dv), W, p + "o")


ATTENTION = {"gqa": gqa, "mla": mla}
