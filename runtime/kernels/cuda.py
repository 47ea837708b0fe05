"""The `csrc/` kernels through `cupy.RawModule` (only imported when CuPy and a GPU are usable).

Routing decisions must reach the host to group tokens by expert, so each call ends in one
device→host copy of the chosen ids; that is the only per-layer sync the GPU path needs.
"""

from __future__ import annotations

from functools import lru_cache

KINDS = {"softmax_topk": 0, "topk_softmax": 1}
VARIANTS = {"paper": 0, "code": 1}


@lru_cache(maxsize=1)
def module():
    import cupy as cp

    from s2moe.csrc import SOURCE_DIR

    source = (SOURCE_DIR / "kernels.cu").read_text()
    return cp.RawModule(code=source, options=("-std=c++17", f"-I{SOURCE_DIR}"),
                        name_expressions=None)


def router_topk(logits, k: int, kind: str, renorm: bool, bias=None):
    import cupy as cp

    B, E = logits.shape
    ids = cp.empty((B, k), dtype=cp.int32)
    weights = cp.empty((B, k), dtype=cp.float32)
    threads = 128
    fn = module().get_function("s2_router_topk")
    fn(((B + threads - 1) // threads,), (threads,),
       (cp.ascontiguousarray(logits, dtype=cp.float32), bias if bias is not None else cp.intp(0), cp.int32(B),
        cp.int32(E), cp.int32(k), cp.int32(KINDS[kind]), cp.int32(int(renorm)), ids, weights))
    return ids, weights


def reuse_gating(logits, k: int, cap: int, variant: str, strength: float, kind: str, renorm: bool,
                 confidence=None):
    import cupy as cp

    B, E = logits.shape
    ids = cp.empty((B, k), dtype=cp.int32)
    weights = cp.empty((B, k), dtype=cp.float32)
    fn = module().get_function("s2_reuse_gating")
    conf = cp.ascontiguousarray(confidence, dtype=cp.float32) if confidence is not None else cp.intp(0)
    fn((1,), (max(32, B),),
       (cp.ascontiguousarray(logits, dtype=cp.float32), conf, cp.int32(B), cp.int32(E), cp.int32(k), cp.int32(cap),
        cp.int32(VARIANTS[variant]), cp.float32(strength), cp.int32(KINDS[kind]), cp.int32(int(renorm)), ids,
        weights))
    return ids, weights
