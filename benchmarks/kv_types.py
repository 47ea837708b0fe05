"""Decode speed and KV bytes by KV cache type (f32, f16, q8_0) at a short and a long context:
the types take turns in one process (this machine drifts by tens of percent within minutes).

    python benchmarks/kv_types.py --model ~/.cache/s2moe-peer/olmoe-1b-7b-q4_k_m.gguf

The cache is filled to the context with random keys and values (a prefill of thousands of tokens
would take minutes here and gives attention nothing it needs), then ``--tokens`` decode steps are
timed. Every expert is resident. Results: a table, and JSON / CSV in docs/results/kv-types.*;
docs/performance/peer.md ("KV cache types") cites them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

TYPES = ("f32", "f16", "q8_0")


def filled_cache(model, cache_type: str, context: int, extra: int, rng):
    model.cache_type = cache_type
    kv = model.new_cache(context + extra)
    for L in range(model.config.num_layers):
        shape = (kv.keys[L].shape[0], context)
        kv.write(L, 0, rng.standard_normal(shape + (kv.key_dim,)).astype(np.float32),
                 rng.standard_normal(shape + (kv.value_dim,)).astype(np.float32))
    kv.filled = kv.length = context
    return kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", default="512,3584")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/kv-types")
    a = ap.parse_args()
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.kv_cache import kv_bytes_per_position

    contexts = [int(x) for x in a.contexts.split(",")]
    engine = build_engine(a.model, None, kv_positions=max(contexts) + a.tokens, preload=True, kernels="cpu",
                          threads=a.threads, memory_limit=None)
    model = engine.model
    rng = np.random.default_rng(0)
    steps = rng.integers(0, model.config.vocab_size, a.tokens)
    samples = {(t, ctx): [] for ctx in contexts for t in TYPES}
    try:
        for _ in range(a.reps):
            for ctx in contexts:
                for t in TYPES:
                    kv = filled_cache(model, t, ctx, a.tokens, rng)
                    model.forward(steps[:1], kv, logits="last", record=False)  # warm: the first step's allocations
                    start = time.perf_counter()
                    for tok in steps[1:]:
                        model.forward([int(tok)], kv, logits="last", record=False)
                    samples[(t, ctx)].append((a.tokens - 1) / (time.perf_counter() - start))
                    del kv
    finally:
        engine.close()
    per = {t: kv_bytes_per_position(model.config, t) for t in TYPES}
    records = [Record("kv-types", f"{t} at {ctx}", "tok/s", samples[(t, ctx)],
                      params={"model": os.path.basename(a.model), "cache_type": t, "context": ctx,
                              "kv_bytes": per[t] * ctx, "threads": a.threads})
               for ctx in contexts for t in TYPES]
    write_outputs(records, machine_info(), a.out, "decode by KV cache type, one process, alternating")


if __name__ == "__main__":
    main()
