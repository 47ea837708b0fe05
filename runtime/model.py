"""The MoE transformer forward pass in NumPy (float32).

One batched call serves prefill, single-token decode and multi-token verification: tokens [T] at
positions [start, start + T) attend to every cached position before them. Architecture details
(q/k norm kind, router kind, clip) come from `ModelConfig`; expert weights come from a provider.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

from .config import ModelConfig
from .experts import ExpertProvider
from .kv_cache import KVCache
from .loader import LoadedModel
from .routing import TARGET, LayerRouting, RoutingPolicy, RoutingRecord, route, softmax


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class TimeSplit:
    """Accumulated seconds per part of the pass (attention, router, experts, lm_head)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def part(self, name: str):
        t0 = time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - t0


class _NoSplit:
    @contextmanager
    def part(self, name: str):
        yield


class MoEModel:
    def __init__(self, loaded: LoadedModel, experts: ExpertProvider | None = None):
        self.loaded = loaded
        self.config: ModelConfig = loaded.config
        if experts is None:  # full residency, buffered reads: the plain reference configuration
            from .cache import ExpertCache
            from .store import ExpertStore

            experts = ExpertCache(ExpertStore(loaded, direct=False), capacity_bytes=None)
        self.experts = experts
        c = self.config
        self._inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim))
        self.split: TimeSplit | _NoSplit = _NoSplit()

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache.for_config(self.config, capacity)

    # -- pieces -------------------------------------------------------------------------------
    def _rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        freqs = np.outer(positions.astype(np.float64), self._inv_freq)  # [T, D/2]
        emb = np.concatenate([freqs, freqs], axis=-1)
        return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)

    @staticmethod
    def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        # x: [heads, T, D]; HF's rotate-half convention.
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def _attention(self, L: int, x: np.ndarray, start: int, kv: KVCache, cos, sin, allowed) -> np.ndarray:
        c, W = self.config, self.loaded.dense
        T = x.shape[0]
        nh, nkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        p = f"layers.{L}."
        q, k, v = x @ W[p + "q"].T, x @ W[p + "k"].T, x @ W[p + "v"].T
        if c.attention_bias:
            q, k, v = q + W[p + "q_bias"], k + W[p + "k_bias"], v + W[p + "v_bias"]
        if c.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
            q = rms_norm(q, W[p + "q_norm"], c.rms_norm_eps)
            k = rms_norm(k, W[p + "k_norm"], c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (np.clip(a, -c.clip_qkv, c.clip_qkv) for a in (q, k, v))
        q = q.reshape(T, nh, D).transpose(1, 0, 2)  # [nh, T, D]
        k = k.reshape(T, nkv, D).transpose(1, 0, 2)
        v = v.reshape(T, nkv, D).transpose(1, 0, 2)
        if c.qk_norm == "per_head":  # Qwen3: per head, after the split
            q = rms_norm(q, W[p + "q_norm"], c.rms_norm_eps)
            k = rms_norm(k, W[p + "k_norm"], c.rms_norm_eps)
        q, k = self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin)
        kv.write(L, start, k, v)
        keys, values = kv.view(L, start + T)  # [nkv, S, D]
        S = start + T
        group = nh // nkv
        qg = q.reshape(nkv, group * T, D)  # heads sharing a kv head stacked on the query axis
        scores = (qg @ keys.transpose(0, 2, 1)) * (1.0 / np.sqrt(D))  # [nkv, group*T, S]
        scores = scores.reshape(nkv, group, T, S)
        scores = np.where(allowed, scores, -np.inf)
        probs = softmax(scores).reshape(nkv, group * T, S)
        out = (probs @ values).reshape(nkv, group, T, D).reshape(nh, T, D)
        return out.transpose(1, 0, 2).reshape(T, nh * D) @ W[p + "o"].T

    def _moe(self, L: int, x: np.ndarray, policy: RoutingPolicy, record: RoutingRecord | None) -> np.ndarray:
        c, W = self.config, self.loaded.dense
        with self.split.part("router"):
            logits = x @ W[f"layers.{L}.router"].T  # [T, E]
            k = policy.k_for(L, c.top_k)
            bias = policy.selection_bias(L, logits) if policy.selection_bias else None
            experts, weights = route(logits, k, c.router, c.norm_topk_prob, bias)
            if record is not None:
                record.layers[L] = LayerRouting(logits, experts, weights)
        with self.split.part("experts"):
            return self._experts(L, x, experts, weights)

    def _experts(self, L: int, x: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Tokens grouped by expert; each expert's weights fetched once for the whole pass."""
        flat = experts.ravel()
        order = np.argsort(flat, kind="stable")
        ids, starts = np.unique(flat[order], return_index=True)
        bounds = np.append(starts, flat.size)
        token_of = order // experts.shape[1]
        weight_of = weights.ravel()[order]
        out = np.zeros_like(x)
        for w, i in zip(self.experts.get(L, [int(e) for e in ids]), range(len(ids))):
            rows = token_of[bounds[i]:bounds[i + 1]]
            h = x[rows]
            act = silu(h @ w.gate.T) * (h @ w.up.T)
            out[rows] += weight_of[bounds[i]:bounds[i + 1], None] * (act @ w.down.T)
        return out

    def _dense_mlp(self, L: int, x: np.ndarray) -> np.ndarray:
        W = self.loaded.dense
        p = f"layers.{L}."
        return (silu(x @ W[p + "mlp_gate"].T) * (x @ W[p + "mlp_up"].T)) @ W[p + "mlp_down"].T

    def _visibility(self, start: int, T: int, pos: np.ndarray, tree_mask: np.ndarray | None) -> np.ndarray:
        """[T, start + T] bool: which cache slots each new token attends to."""
        S = start + T
        allowed = np.ones((T, S), dtype=bool)
        if tree_mask is None:
            allowed[:, start:] = np.tril(np.ones((T, T), dtype=bool))
        elif tree_mask.shape[1] == S:  # a full [T, S] mask (evaluation: draft beside target KV)
            allowed = np.array(tree_mask, dtype=bool)
        else:
            allowed[:, start:] = tree_mask
        window = self.config.sliding_window
        if window:  # slot positions before `start` equal their RoPE positions (committed chain)
            slot_pos = np.concatenate([np.arange(start), pos])
            allowed &= slot_pos[None, :] > pos[:, None] - window
        return allowed

    # -- the pass -----------------------------------------------------------------------------
    def forward(
        self,
        tokens,
        kv: KVCache,
        start: int | None = None,
        policy: RoutingPolicy = TARGET,
        logits: str = "all",
        record: bool = True,
        positions=None,
        tree_mask: np.ndarray | None = None,
    ) -> tuple[np.ndarray, RoutingRecord | None]:
        """Run ``tokens`` in cache slots [start, start + T); ``start`` defaults to ``kv.filled``.

        For a chain, slot = position and attention is causal. For a token tree, ``positions``
        gives each token's RoPE position and ``tree_mask`` [T, T] which new tokens each may see
        (itself and its ancestors); every token sees all slots before ``start``. A [T, start + T]
        ``tree_mask`` instead says exactly which slots each token sees.
        Returns logits [T, V] (or [1, V] with ``logits="last"``) and the routing record.
        """
        c, W = self.config, self.loaded.dense
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = tokens.size
        start = kv.filled if start is None else start
        kv.begin_write(start, T)
        if tokens.min(initial=0) < 0 or tokens.max(initial=0) >= c.vocab_size:
            raise ValueError(f"token id outside the vocabulary 0..{c.vocab_size - 1}")
        pos = np.arange(start, start + T) if positions is None else np.asarray(positions, dtype=np.int64)
        cos, sin = self._rope(pos)
        allowed = self._visibility(start, T, pos, tree_mask)
        rec = RoutingRecord() if record else None
        begin, end = getattr(self.experts, "begin_pass", None), getattr(self.experts, "end_pass", None)
        if begin:
            begin()
        h = W["embed"][tokens]
        for L in range(c.num_layers):
            with self.split.part("attention"):
                h = h + self._attention(L, rms_norm(h, W[f"layers.{L}.attn_norm"], c.rms_norm_eps), start, kv, cos, sin,
                                        allowed)
            x = rms_norm(h, W[f"layers.{L}.ffn_norm"], c.rms_norm_eps)
            if c.moe_layers[L]:
                h = h + self._moe(L, x, policy, rec)
            else:
                with self.split.part("dense_mlp"):
                    h = h + self._dense_mlp(L, x)
        with self.split.part("lm_head"):
            if logits == "last":
                h = h[-1:]
            out = rms_norm(h, W["norm"], c.rms_norm_eps) @ W["lm_head"].T
        if end:
            end()
        return out, rec
