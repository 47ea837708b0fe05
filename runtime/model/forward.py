"""The MoE transformer forward pass in float32, on NumPy or a device backend (runtime/kernels/backend.py).

One batched call serves prefill, single-token decode and multi-token verification: tokens [T] at
positions [start, start + T) attend to every cached position before them. Architecture details
(attention kind, q/k norm, RoPE, router, expert activation, shared experts) come from
`ModelConfig`; expert weights come from a provider.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

from . import rope
from .attention import ATTENTION, rms_norm
from ..kernels.backend import NUMPY, Backend, xp_of
from .config import ModelConfig
from ..offload.experts import ExpertProvider, ExpertWeights
from .kv_cache import KVCache
from .loader import LoadedModel
from .routing import TARGET, LayerRouting, RoutingPolicy, RoutingRecord, route



def silu(x: np.ndarray) -> np.ndarray:
    xp = xp_of(x)
    with np.errstate(over="ignore"):  # exp(-x) → inf for very negative x gives the right limit, -0
        return x / (1.0 + xp.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    xp = xp_of(x)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + xp.exp(-x))


def _biased(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    return y if bias is None else y + bias


def expert_ffn(c: ModelConfig, w: ExpertWeights, h: np.ndarray) -> np.ndarray:
    """One expert on its tokens: SwiGLU, or GPT-OSS's clamped variant; biases where present."""
    gate, up = _biased(h @ w.gate.T, w.gate_bias), _biased(h @ w.up.T, w.up_bias)
    if c.expert_act == "swiglu_clamped":
        xp = xp_of(gate)
        gate = xp.minimum(gate, c.swiglu_limit)
        up = xp.clip(up, -c.swiglu_limit, c.swiglu_limit)
        act = (up + 1.0) * gate * _sigmoid(c.swiglu_alpha * gate)
    else:
        act = silu(gate) * up
    return _biased(act @ w.down.T, w.down_bias)


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
    def __init__(self, loaded: LoadedModel, experts: ExpertProvider | None = None, backend: Backend = NUMPY):
        self.loaded = loaded
        self.config: ModelConfig = loaded.config
        self.backend = backend
        # dense weights where the math runs (NumPy: the loaded arrays themselves, no copy); a tied
        # head is the embedding array itself, uploaded once
        self.W = loaded.dense
        if backend.on_device:
            uploaded: dict[int, object] = {}
            for v in loaded.dense.values():
                if id(v) not in uploaded:
                    uploaded[id(v)] = backend.to_device(v)
            self.W = {k: uploaded[id(v)] for k, v in loaded.dense.items()}
        if experts is None:  # full residency, buffered reads: the plain reference configuration
            from ..offload.cache import ExpertCache
            from ..offload.store import ExpertStore

            experts = ExpertCache(ExpertStore(loaded, direct=False), capacity_bytes=None, place=backend.upload_expert)
        self.experts = experts
        self._inv_freq, self._rope_factor = rope.inv_freq_and_factor(self.config)
        self._attention_kind = ATTENTION[self.config.attention]
        self.split: TimeSplit | _NoSplit = _NoSplit()

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache.for_config(self.config, capacity, xp=self.backend.xp)

    # -- pieces -------------------------------------------------------------------------------
    def _rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return rope.tables(self._inv_freq, self._rope_factor, positions)

    def _attention(self, L: int, x: np.ndarray, start: int, kv: KVCache, cos, sin, allowed) -> np.ndarray:
        return self._attention_kind(self.config, self.W, L, x, start, kv, (cos, sin), allowed)

    def _moe(self, L: int, x: np.ndarray, policy: RoutingPolicy, record: RoutingRecord | None) -> np.ndarray:
        c, W, host = self.config, self.W, self.loaded.dense
        p = f"layers.{L}."
        with self.split.part("router"):
            # routing runs on the host: the cache must know the experts before computing them
            logits = self.backend.to_host(_biased(x @ W[p + "router"].T, W.get(p + "router_bias")))  # [T, E]
            k = policy.k_for(L, c.top_k)
            bias = policy.selection_bias(L, logits) if policy.selection_bias else None
            groups = (c.expert_groups, c.expert_groups_used) if c.expert_groups else None
            experts, weights = route(logits, k, c.router, c.norm_topk_prob, bias, scale=c.routed_scaling_factor,
                                     groups=groups, score_bias=host.get(p + "router_score_bias"))
            if record is not None:
                record.layers[L] = LayerRouting(logits, experts, weights)
        with self.split.part("experts"):
            out = self._experts(L, x, experts, weights)
        if c.shared_expert_intermediate_size:  # dense, resident: not through the expert cache
            with self.split.part("shared_experts"):
                out += self._dense_mlp(L, x, "shared_")
        return out

    def _experts(self, L: int, x: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Tokens grouped by expert; each expert's weights fetched once for the whole pass."""
        flat = experts.ravel()
        order = np.argsort(flat, kind="stable")
        ids, starts = np.unique(flat[order], return_index=True)
        bounds = np.append(starts, flat.size)
        token_of = self.backend.to_device(order // experts.shape[1])
        weight_of = self.backend.to_device(weights.ravel()[order])
        out = xp_of(x).zeros_like(x)
        for w, i in zip(self.experts.get(L, [int(e) for e in ids]), range(len(ids))):
            self.backend.wait(w)  # its copy (device backends) may still be in flight
            rows = token_of[bounds[i]:bounds[i + 1]]
            out[rows] += weight_of[bounds[i]:bounds[i + 1], None] * expert_ffn(self.config, w, x[rows])
        return out

    def _dense_mlp(self, L: int, x: np.ndarray, kind: str = "mlp_") -> np.ndarray:
        W = self.W
        p = f"layers.{L}.{kind}"
        return (silu(x @ W[p + "gate"].T) * (x @ W[p + "up"].T)) @ W[p + "down"].T

    def _visibility(self, start: int, T: int, pos: np.ndarray, tree_mask: np.ndarray | None,
                    window: int | None) -> np.ndarray:
        """[T, start + T] bool: which cache slots each new token attends to."""
        S = start + T
        allowed = np.ones((T, S), dtype=bool)
        if tree_mask is None:
            allowed[:, start:] = np.tril(np.ones((T, T), dtype=bool))
        elif tree_mask.shape[1] == S:  # a full [T, S] mask (evaluation: draft beside target KV)
            allowed = np.array(tree_mask, dtype=bool)
        else:
            allowed[:, start:] = tree_mask
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
        c, W, dev = self.config, self.W, self.backend.to_device
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = tokens.size
        start = kv.filled if start is None else start
        kv.begin_write(start, T)
        if tokens.min(initial=0) < 0 or tokens.max(initial=0) >= c.vocab_size:
            raise ValueError(f"token id outside the vocabulary 0..{c.vocab_size - 1}")
        pos = np.arange(start, start + T) if positions is None else np.asarray(positions, dtype=np.int64)
        cos, sin = (dev(t) for t in self._rope(pos))
        windows = {c.window_of(L) for L in range(c.num_layers)}  # GPT-OSS: sliding and full layers
        masks = {w: dev(self._visibility(start, T, pos, tree_mask, w)) for w in windows}
        rec = RoutingRecord() if record else None
        begin, end = getattr(self.experts, "begin_pass", None), getattr(self.experts, "end_pass", None)
        if begin:
            begin()
        h = W["embed"][dev(tokens)]
        for L in range(c.num_layers):
            with self.split.part("attention"):
                h = h + self._attention(L, rms_norm(h, W[f"layers.{L}.attn_norm"], c.rms_norm_eps), start, kv, cos, sin,
                                        masks[c.window_of(L)])
            x = rms_norm(h, W[f"layers.{L}.ffn_norm"], c.rms_norm_eps)
            if c.moe_layers[L]:
                h = h + self._moe(L, x, policy, rec)
            else:
                with self.split.part("dense_mlp"):
                    h = h + self._dense_mlp(L, x)
        with self.split.part("lm_head"):
            if logits == "last":
                h = h[-1:]
            # [V, H] @ [H, T] streams the head once: 2–3× faster than h @ W.T for 2–16 tokens
            out = xp_of(h).ascontiguousarray((W["lm_head"] @ rms_norm(h, W["norm"], c.rms_norm_eps).T).T)
        if end:
            end()
        return self.backend.to_host(out), rec  # logits to the host: sampling and acceptance run there
