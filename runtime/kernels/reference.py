"""The NumPy reference kernels: what every compiled kernel is tested against, and the fallback
when the extension is missing.

A stored matrix is decoded a few MiB of rows at a time (bounded scratch, so the memory plan holds on
this path too) and multiplied with BLAS; float32 arrays go straight to BLAS. Q8_0 and Q4_0 rows meet
activations quantised to int8 blocks, as the compiled kernels do (stored.int8_activations).
"""

from __future__ import annotations

import numpy as np

from .stored import (INT8_ACTIVATION_TYPES, RUN_TYPES, StoredMatrix, activation_block, int8_activations, int8_product,
                     int8_runs_product, quantize_activations)


def silu(x: np.ndarray) -> np.ndarray:
    from .backend import xp_of

    xp = xp_of(x)
    with np.errstate(over="ignore"):  # exp(-x) → inf for very negative x gives the right limit, -0
        return x / (1.0 + xp.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    from .backend import xp_of

    xp = xp_of(x)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + xp.exp(-x))


def activate(gate, up, act):
    """SwiGLU, or GPT-OSS's clamped variant (``act`` = `ExpertAct`)."""
    if act.kind == "swiglu_clamped":
        from .backend import xp_of

        xp = xp_of(gate)
        gate = xp.minimum(gate, act.limit)
        up = xp.clip(up, -act.limit, act.limit)
        return (up + 1.0) * gate * sigmoid(act.alpha * gate)
    return silu(gate) * up


def _plus(y, bias):
    return y if bias is None else y + bias


class ReferenceOps:
    """The seam's NumPy implementation (also serves device arrays: `x @ W.T` on CuPy)."""

    name = "numpy"
    kv_types: tuple[str, ...] = ()  # KV cache types read in one C call (the NumPy path reads every type)

    def __init__(self, reason: str = "requested"):
        self.reason = reason

    def route(self, logits: np.ndarray, k: int, kind: str, norm_topk_prob: bool, bias=None, **kw):
        """Experts and mixture weights per token from host router logits (model/routing.py)."""
        from ..model.routing import route

        return route(logits, k, kind, norm_topk_prob, bias, **kw)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        from ..model.attention import rms_norm

        return rms_norm(x, weight, eps)

    def attend(self, q, k, v, kv, L, start, cs, allowed, sinks, nh, nkv, D, scale, interleave):
        """RoPE, KV write and softmax attention of grouped-query heads (model/attention.py)."""
        from ..model.attention import attend

        return attend(q, k, v, kv, L, start, cs, allowed, sinks, nh, nkv, D, scale, interleave)

    def linear(self, x: np.ndarray, W, bias=None) -> np.ndarray:
        """x [T, K] @ W.T → [T, N] (+ bias). W: a float matrix, or stored (`StoredMatrix` on the
        host, `DeviceStored` on a device), decoded a few MiB of rows at a time."""
        if not hasattr(W, "chunks"):
            return _plus(x @ W.T, bias)
        if isinstance(W, StoredMatrix):
            x = np.ascontiguousarray(x, dtype=np.float32)
        if W.dtype == "F32":
            return _plus(x @ W.dequantize().T, bias)
        from .backend import xp_of

        xp = xp_of(x)
        y = xp.empty((x.shape[0], W.shape[0]), dtype=np.float32)
        if W.dtype in INT8_ACTIVATION_TYPES and int8_activations():  # codes meet codes, as the kernels do
            xq, dx = quantize_activations(xp, x)
            for rows, codes, dw in W.code_chunks(x.shape[0]):
                y[:, rows] = int8_product(xp, xq, dx, codes, dw)
            return _plus(y, bias)
        if W.dtype in RUN_TYPES and int8_activations() and hasattr(W, "run_chunks"):  # kquant.c's scheme
            xq, dx = quantize_activations(xp, x, activation_block(W.dtype))
            for rows, codes, scale, offset in W.run_chunks(x.shape[0]):
                y[:, rows] = int8_runs_product(xp, xq, dx, codes, scale, offset)
            return _plus(y, bias)
        for rows, w in W.chunks():
            y[:, rows] = x @ w.T
        return _plus(y, bias)

    def embed(self, W, ids: np.ndarray) -> np.ndarray:
        if not hasattr(W, "chunks"):
            return W[ids]
        return W.dequantize(ids if not isinstance(W, StoredMatrix) else np.asarray(ids, dtype=np.int64))

    def expert(self, x: np.ndarray, w, act) -> np.ndarray:
        """One expert on its tokens: act(x Wg + bg, x Wu + bu) Wd + bd."""
        gate, up = self.linear(x, w.gate, w.gate_bias), self.linear(x, w.up, w.up_bias)
        return self.linear(activate(gate, up, act), w.down, w.down_bias)

    def experts(self, x: np.ndarray, groups, act, out: np.ndarray) -> np.ndarray:
        """out[rows] += weights · expert(x[rows]) for each (weights, rows, mixture weights) group."""
        for w, rows, mix in groups:
            out[rows] += mix[:, None] * self.expert(x[rows], w, act)
        return out
