"""The `csrc/` kernels through `cupy.RawModule` (only imported when CuPy and a GPU are usable).

The source CuPy compiles is `source()`: kernels.cu with its quoted includes inlined, because
CuPy's kernel cache is keyed on the source string and options, not on headers found with ``-I``
(a header edit would otherwise load a stale kernel). Arguments are checked here, where the kernels
would read out of bounds or silently ignore a limit: 2-D logits, 1 ≤ k ≤ E, a bias of shape
[B, E] and a confidence of [B] (made float32 and C-contiguous), and the fused gating's expert and
top-k limits (beyond them: the NumPy path, same result). Routing decisions must reach the host to
group tokens by expert, so a caller ends with one device→host copy of the chosen ids.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

KINDS = {"softmax_topk": 0, "topk_softmax": 1}
VARIANTS = {"paper": 0, "code": 1}
MAX_EXPERTS, MAX_TOPK = 512, 64  # S2_MAX_EXPERTS, S2_MAX_TOPK in routing.cuh
ROUTER_THREADS = 128
GATING_THREADS = 256  # one block loops over the batch: any B


def _inline(path: Path, seen: set) -> str:
    lines = []
    for line in path.read_text().splitlines():
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if m:
            dep = (path.parent / m.group(1)).resolve()
            if dep not in seen:
                seen.add(dep)
                lines += [f"// ---- {m.group(1)} (inlined) ----", _inline(dep, seen), f"// ---- end {m.group(1)} ----"]
            continue
        if re.match(r"\s*#\s*pragma\s+once", line):
            continue
        lines.append(line)
    return "\n".join(lines)


def source() -> str:
    """kernels.cu with every quoted include inlined: the exact string CuPy compiles (and keys on)."""
    from s2moe.csrc import SOURCE_DIR

    path = Path(SOURCE_DIR) / "kernels.cu"
    return _inline(path, {path.resolve()})


OPTIONS = ("-std=c++17",)


@lru_cache(maxsize=1)
def module():
    import cupy as cp

    return cp.RawModule(code=source(), options=OPTIONS, name_expressions=None)


def _logits(cp, logits, k: int):
    if getattr(logits, "ndim", None) != 2:
        raise ValueError(f"router logits must be [B, E], got shape {getattr(logits, 'shape', None)}")
    B, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"top-k {k} must be in 1..{E} (the number of experts)")
    return cp.ascontiguousarray(logits, dtype=cp.float32), B, E


def _rows(cp, a, shape: tuple, name: str):
    """``a`` as the kernel reads it: float32, C-contiguous, of ``shape`` (or a null pointer)."""
    if a is None:
        return cp.intp(0)
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(a.shape)}")
    return cp.ascontiguousarray(a, dtype=cp.float32)


def router_topk(logits, k: int, kind: str, renorm: bool, bias=None):
    import cupy as cp

    logits, B, E = _logits(cp, logits, k)
    bias = _rows(cp, bias, (B, E), "bias")
    ids = cp.empty((B, k), dtype=cp.int32)
    weights = cp.empty((B, k), dtype=cp.float32)
    if B == 0:
        return ids, weights
    fn = module().get_function("s2_router_topk")
    fn(((B + ROUTER_THREADS - 1) // ROUTER_THREADS,), (ROUTER_THREADS,),
       (logits, bias, cp.int32(B), cp.int32(E), cp.int32(k), cp.int32(KINDS[kind]), cp.int32(int(renorm)), ids,
        weights))
    return ids, weights


def reuse_gating(logits, k: int, cap: int, variant: str, strength: float, kind: str, renorm: bool,
                 confidence=None):
    import cupy as cp

    logits, B, E = _logits(cp, logits, k)
    conf = _rows(cp, confidence, (B,), "confidence")
    if E > MAX_EXPERTS or k > MAX_TOPK:
        return _reuse_gating_numpy(cp, logits, k, cap, variant, strength, kind, renorm, confidence)
    ids = cp.empty((B, k), dtype=cp.int32)
    weights = cp.empty((B, k), dtype=cp.float32)
    if B == 0:
        return ids, weights
    w, lam = cp.empty(B, dtype=cp.float64), cp.empty(B, dtype=cp.float32)  # the plan's per-token scratch
    fn = module().get_function("s2_reuse_gating")
    fn((1,), (min(GATING_THREADS, 32 * ((B + 31) // 32)),),
       (logits, conf, cp.int32(B), cp.int32(E), cp.int32(k), cp.int32(cap), cp.int32(VARIANTS[variant]),
        cp.float32(strength), cp.int32(KINDS[kind]), cp.int32(int(renorm)), w, lam, ids, weights))
    return ids, weights


def _reuse_gating_numpy(cp, logits, k, cap, variant, strength, kind, renorm, confidence):
    """Beyond the kernel's limits: the NumPy reference (what the kernel equals within them)."""
    import numpy as np

    from ..decoding.gating import ReuseGating
    from ..model.routing import route

    host = cp.asnumpy(logits)
    conf = None if confidence is None else cp.asnumpy(confidence).astype(np.float64)
    bias = ReuseGating(k, cap, variant, strength, conf).bias(0, host)
    ids, weights = route(host, k, kind, renorm, bias)
    return cp.asarray(ids.astype(np.int32)), cp.asarray(weights.astype(np.float32))
