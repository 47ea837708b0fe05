"""`DeviceOps`: the seam on a device backend. The reference code on device arrays (`ReferenceOps`),
with the fused decode kernels of csrc/decode.cuh where they apply (issue 19: a decode token was
~620 small device ops, launch-bound).

What the kernels take, checked here before anything is launched (else the op-by-op reference path,
same results within float32 rounding): passes of at most `MAX_TOKENS` tokens (decode and
verification; prefill chunks stay on cuBLAS), weights stored as F32, F16, BF16, Q8_0, Q4_0, Q4_K,
Q6_K or MXFP4 (read in place, decoded in registers; or float32 arrays, either layout), float32
C-contiguous activations; attention: grouped-query, RoPE over the whole head, head width ≤
`MAX_HEAD_DIM`, no q/k/v clipping; experts: SwiGLU or GPT-OSS's clamped SwiGLU, biases float32 or
none.

The model code asks for the fused pieces by name (`gqa_block`, `experts_grouped`), so NumPy runs
exactly the code it ran before.
"""

from __future__ import annotations

import numpy as np

from .reference import ReferenceOps
from .stored import kernel_type, row_bytes

MAX_TOKENS = 16  # S2_MAX_TOKENS in decode.cuh: a few tokens per thread; prefill chunks take cuBLAS
MAX_HEAD_DIM = 256  # S2_MAX_HEAD_DIM in decode.cuh (a per-thread head in registers)
ATTEND_CHUNK = 256  # cached slots per attention thread; longer contexts add a merge launch
THREADS = 128
WARP = 32  # products give each output a warp (S2_WARP)
WEIGHT_TYPES = {"F32": 0, "F16": 1, "BF16": 2, "Q8_0": 3, "Q4_0": 4, "Q4_K": 5, "Q6_K": 6, "MXFP4": 7}  # quant.cuh
QK_NORMS = {"none": 0, "full": 1, "per_head": 2}  # S2QkNorm
ACTS = {"swiglu": 0, "swiglu_clamped": 1}  # S2ExpertAct

_MODULES: dict[int, tuple] = {}


def _module(xp):
    """The compiled csrc source for backend module ``xp`` (the stand-in or CuPy), once."""
    entry = _MODULES.get(id(xp))
    if entry is None or entry[0] is not xp:
        from .cuda import OPTIONS, source

        entry = _MODULES[id(xp)] = (xp, xp.RawModule(code=source(), options=OPTIONS))
    return entry[1]


def _ptr(a) -> int:
    """Device address of ``a``'s first element (CuPy: ``ndarray.data.ptr``)."""
    return int(a.data.ptr)


class DeviceOps(ReferenceOps):
    max_fused_tokens = MAX_TOKENS  # forward.py takes the fused branch for passes this short

    def __init__(self, backend, reason: str):
        super().__init__(reason)
        self.xp = backend.xp

    # -- helpers ----------------------------------------------------------------------------------
    def _launch(self, name: str, n: int, args: tuple, warps: bool = False) -> None:
        """``n`` threads of kernel ``name`` (``n`` warps with ``warps``: the products)."""
        n *= WARP if warps else 1
        if n > 0:
            _module(self.xp).get_function(name)(((n + THREADS - 1) // THREADS,), (THREADS,), args)

    def _is(self, a, ndim: int | None = None, dtype=np.float32) -> bool:
        """A C-contiguous device array of ``dtype`` (and ``ndim``)."""
        return (isinstance(a, self.xp.ndarray) and a.dtype == dtype and a.flags.c_contiguous
                and (ndim is None or a.ndim == ndim))

    def _weight(self, W):
        """(array, type, N, K, row stride, column stride) of a matrix the kernels read, else None."""
        if isinstance(W, self.xp.ndarray):
            if W.ndim != 2 or W.dtype != np.float32:
                return None
            N, K = W.shape
            if W.flags.c_contiguous:
                return W, 0, N, K, K, 1
            if W.flags.f_contiguous:  # input-major (the router): element (n, k) at n + k·N; W.T is
                return W.T, 0, N, K, 1, N  # the same memory, C-contiguous (what a pointer argument means)
            return None
        kind = WEIGHT_TYPES.get(getattr(W, "dtype", None))
        data = getattr(W, "data", None)
        if kind is None or not self._is(data, 1, np.uint8):
            return None
        N, K = W.shape
        if not kernel_type(W.dtype, K) or data.size != N * row_bytes(W.dtype, K):  # out of bounds otherwise
            return None
        return data, kind, N, K, K, 1

    def _bias(self, b, n: int):
        if b is None:
            return self.xp.intp(0)
        return b if self._is(b, 1) and b.shape[0] == n else None

    def _tokens(self, x) -> bool:
        return self._is(x, 2) and 0 < x.shape[0] <= MAX_TOKENS

    # -- the seam -----------------------------------------------------------------------------------
    def rms_norm(self, x, weight, eps: float):
        xp = self.xp
        if not (self._is(x, 2) and self._is(weight, 1) and weight.shape[0] == x.shape[1]):
            return super().rms_norm(x, weight, eps)
        T, H = x.shape
        y = xp.empty((T, H), dtype=xp.float32)
        self._launch("s2_rms_norm", T, (x, weight, xp.int32(T), xp.int32(H), xp.float32(eps), y))
        return y

    def linear(self, x, W, bias=None, residual=None, norm=None):
        """x @ W.T (+ bias) (+ ``residual``, added last: the residual stream joins the product);
        ``norm`` = (weight, eps): x is RMSNorm-ed first, in the same launch."""
        y = self.linear_parts(x, [(W, bias)], residual, norm)
        if y is not None:
            return y
        if norm is not None:
            x = self.rms_norm(x, *norm)
        y = super().linear(x, W, bias)
        return y if residual is None else residual + y

    def norm_linear(self, x, weight, eps: float, W, bias=None):
        """(RMSNorm(x), RMSNorm(x) @ W.T (+ bias)) in one launch (the router and the experts' input)."""
        xn = self.xp.empty(x.shape, dtype=self.xp.float32) if self._is(x, 2) else None
        y = None if xn is None else self.linear_parts(x, [(W, bias)], norm=(weight, eps), xn=xn)
        if y is not None:
            return xn, y
        xn = self.rms_norm(x, weight, eps)
        return xn, super().linear(xn, W, bias)

    def linear_parts(self, x, parts, residual=None, norm=None, xn=None):
        """[x @ W.T (+ b) for (W, b) in parts] side by side, [T, ΣN], in one launch (up to three
        matrices of one type, width and layout: q, k and v), of RMSNorm(x) with ``norm`` = (weight,
        eps), which ``xn`` [T, K] then receives; None (nothing launched) where the kernel does not apply."""
        xp = self.xp
        if not self._tokens(x) or not 1 <= len(parts) <= 3:
            return None
        if norm is not None and not (self._is(norm[0], 1) and norm[0].shape[0] == x.shape[1]):
            return None
        if xn is not None and not (norm is not None and self._is(xn, 2) and xn.shape == x.shape):
            return None
        infos = [self._weight(W) for W, _ in parts]
        if any(i is None for i in infos) or len({i[3:] for i in infos}) > 1 or infos[0][3] != x.shape[1]:
            return None
        biases = [self._bias(b, i[2]) for (_, b), i in zip(parts, infos)]
        if any(b is None for b in biases):
            return None
        T, K = x.shape
        N = sum(i[2] for i in infos)
        if residual is not None and not (self._is(residual, 2) and residual.shape == (T, N)):
            return None
        _, _, _, _, rs, cs = infos[0]
        args = []
        for j in range(3):
            if j < len(infos):
                args += [infos[j][0], xp.int32(infos[j][1]), biases[j], xp.int32(infos[j][2])]
            else:
                args += [xp.intp(0), xp.int32(0), xp.intp(0), xp.int32(0)]
        y = xp.empty((T, N), dtype=xp.float32)
        null = xp.intp(0)
        norm_w, eps = (null, 0.0) if norm is None else norm
        self._launch("s2_linear", max(N, -(-K // WARP)) if xn is not None else N,  # a warp per column, all tokens
                     (x, xp.int32(T), xp.int32(K), norm_w, xp.float32(eps), null if xn is None else xn,
                      xp.int64(rs), xp.int64(cs), *args, null if residual is None else residual, y), warps=True)
        return y

    def embed(self, W, ids):
        xp = self.xp
        info = self._weight(W)
        if info is None or info[4:] != (info[3], 1) or not self._is(ids, 1, np.int64):
            return super().embed(W, ids)
        data, kind, _, H, _, _ = info
        T = ids.shape[0]
        y = xp.empty((T, H), dtype=xp.float32)
        self._launch("s2_embed", T * H, (data, xp.int32(kind), ids, xp.int32(T), xp.int32(H), y))
        return y

    # -- attention ----------------------------------------------------------------------------------
    def gqa_block(self, c, W, L: int, h, norm, start: int, kv, cs, allowed):
        """h + the grouped-query attention block of layer ``L`` on RMSNorm(h, ``norm``)
        (model/attention.py `gqa`) in four launches: the norm with q|k|v, q/k norm + RoPE + KV
        write, attention, the output projection with the residual. None (nothing launched)
        where the kernels do not apply."""
        xp = self.xp
        x = residual = h
        p = f"layers.{L}."
        nh, nkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        if (c.attention != "gqa" or c.clip_qkv is not None or c.qk_norm not in QK_NORMS or c.rope_dim != D or D % 2
                or D > MAX_HEAD_DIM or not self._tokens(x) or not self._is(residual, 2)):
            return None
        T = x.shape[0]
        S = start + T
        cos, sin = cs
        keys, values = kv.keys[L], kv.values[L]
        kv_type = getattr(keys, "dtype", None)  # a float32 or f16 cache (q8_0: the op-by-op path)
        shapes_ok = (all(self._is(a, 2) and a.shape == (T, D // 2) for a in (cos, sin))
                     and kv_type in (np.float32, np.float16)
                     and all(self._is(a, 3, kv_type) and a.shape[0] == nkv and a.shape[2] == D and a.shape[1] >= S
                             for a in (keys, values))
                     and self._is(allowed, 2, np.bool_) and allowed.shape == (T, S))
        norms = (W.get(p + "q_norm"), W.get(p + "k_norm"))
        if c.qk_norm != "none":
            want = (nh * D, nkv * D) if c.qk_norm == "full" else (D, D)
            shapes_ok &= all(self._is(n, 1) and n.shape[0] == w for n, w in zip(norms, want))
        sinks = W.get(p + "sinks") if c.attention_sinks else None
        if sinks is not None:
            shapes_ok &= self._is(sinks, 1) and sinks.shape[0] == nh
        shapes_ok &= [W[p + n].shape[0] for n in "qkv"] == [nh * D, nkv * D, nkv * D]
        o = self._weight(W[p + "o"])
        o_bias = self._bias(W.get(p + "o_bias"), residual.shape[1])
        if not shapes_ok or o is None or o[3] != nh * D or o_bias is None or residual.shape != (T, o[2]):
            return None
        qkv = self.linear_parts(x, [(W[p + n], W.get(p + n + "_bias")) for n in "qkv"], norm=(norm, c.rms_norm_eps))
        if qkv is None:  # (nothing launched: linear_parts checks before it launches)
            return None
        q = xp.empty((T, nh * D), dtype=xp.float32)
        mode = QK_NORMS[c.qk_norm]
        qn, kn = (xp.intp(0), xp.intp(0)) if mode == 0 else norms
        self._launch("s2_qk_rope_kv", T * (nh + nkv),
                     (qkv, xp.int32(T), xp.int32(nh), xp.int32(nkv), xp.int32(D), xp.int32(mode), qn, kn,
                      xp.float32(c.rms_norm_eps), cos, sin, xp.int32(int(c.rope_interleave)), xp.int32(start),
                      xp.int32(keys.shape[1]), q, keys, values, xp.int32(kv_type == np.float16)))
        out = xp.empty((T, nh * D), dtype=xp.float32)
        chunks = -(-S // ATTEND_CHUNK)  # a long context: spread over threads, then merged
        part = xp.empty((T * nh * chunks, D + 2), dtype=xp.float32) if chunks > 1 else xp.intp(0)
        sinks = xp.intp(0) if sinks is None else sinks
        self._launch("s2_attend", T * nh * chunks,
                     (q, keys, values, allowed, xp.int32(T), xp.int32(S), xp.int32(nh), xp.int32(nkv), xp.int32(D),
                      xp.int32(keys.shape[1]), xp.int32(kv_type == np.float16), xp.float32(c.attn_scale),
                      xp.int32(ATTEND_CHUNK), sinks, out, part))
        if chunks > 1:
            self._launch("s2_attend_merge", T * nh,
                         (part, xp.int32(T), xp.int32(nh), xp.int32(D), xp.int32(chunks), sinks, out))
        return self.linear(out, W[p + "o"], W.get(p + "o_bias"), residual=residual)

    # -- experts ------------------------------------------------------------------------------------
    def experts_grouped(self, x, group, act, base, out=None):
        """``base`` + Σ weight · expert(x[token]) over ``group`` [(weights, tokens, mixture weights)]
        (host lists), into ``out`` (a new array when None; it may be ``base``): two launches and
        one upload of the group's table. Other experts: the reference path on ``out``."""
        xp = self.xp
        T, H = x.shape
        info = self._experts_info(x, group, act, base, out)
        if info is None:
            if out is None:
                out = base.copy()
            dev = lambda a: xp.asarray(a)  # noqa: E731
            self.experts(x, [(w, dev(np.array(ts, np.int32)), dev(np.array(ws, np.float32))) for w, ts, ws in group],
                         act, out)
            return out
        I = info
        pairs = sorted((t, j, float(m)) for j, (_, ts, ws) in enumerate(group) for t, m in zip(ts, ws))
        P = len(pairs)
        table = np.empty(9 * P + T + 1, dtype=np.int64)
        parts = [[self._weight(m) for m in (w.gate, w.up, w.down)] for w, _, _ in group]
        addresses = [[_ptr(i[0]) for i in ps] for ps in parts]
        types = [ps[0][1] | ps[1][1] << 8 | ps[2][1] << 16 for ps in parts]
        biases = [[0 if b is None else _ptr(b) for b in (w.gate_bias, w.up_bias, w.down_bias)] for w, _, _ in group]
        for n, (t, j, m) in enumerate(pairs):
            table[3 * n:3 * n + 3] = addresses[j]
            table[6 * P + 3 * n:6 * P + 3 * n + 3] = biases[j]
        table[3 * P:4 * P] = [t for t, _, _ in pairs]
        table[4 * P:5 * P].view(np.float64)[:] = [m for _, _, m in pairs]
        table[5 * P:6 * P] = [types[j] for _, j, _ in pairs]
        table[9 * P:] = np.searchsorted([t for t, _, _ in pairs], np.arange(T + 1), side="left")
        table = xp.asarray(table)
        hidden = xp.empty((P, I), dtype=xp.float32)
        out = xp.empty((T, H), dtype=xp.float32) if out is None else out
        self._launch("s2_experts_gate_up", P * I,
                      (x, xp.int32(H), xp.int32(I), xp.int32(P), table, xp.int32(ACTS[act.kind]), xp.float32(act.alpha),
                       xp.float32(act.limit), hidden), warps=True)
        self._launch("s2_experts_down", T * H,
                     (hidden, xp.int32(H), xp.int32(I), xp.int32(T), xp.int32(P), table, base, out), warps=True)
        return out

    def _experts_info(self, x, group, act, base, out):
        """The intermediate width when the grouped kernels take ``group`` (each matrix of any
        kernel type), else None."""
        if act.kind not in ACTS or not group or not self._tokens(x) or not self._is(base, 2):
            return None
        T, H = x.shape
        if base.shape != (T, H) or (out is not None and not (self._is(out, 2) and out.shape == (T, H))):
            return None
        widths = set()
        for w, ts, _ in group:
            parts = [self._weight(m) for m in (w.gate, w.up, w.down)]
            if any(i is None or i[4:] != (i[3], 1) for i in parts):
                return None
            widths_of = (parts[0][2], parts[1][2], parts[2][2])  # gate and up: I rows; down: H rows
            if any(b is not None and not (self._is(b, 1) and b.shape[0] == n)
                   for b, n in zip((w.gate_bias, w.up_bias, w.down_bias), widths_of)):
                return None
            (_, _, ig, hg, _, _), (_, _, iu, hu, _, _), (_, _, hd, id_, _, _) = parts
            if not (ig == iu == id_ and hg == hu == hd == H) or any(not 0 <= t < T for t in ts):
                return None
            widths.add(ig)
        return widths.pop() if len(widths) == 1 else None
