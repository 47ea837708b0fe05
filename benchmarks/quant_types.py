"""Backs docs/performance/quant-types.md, "Speed per type": every stored type's row products at decode,
weights per second, one matrix after another.

    python benchmarks/quant_types.py [--threads 2] [--tokens 1,8] [--reps 7]

Each type gets 48 distinct expert-sized matrices (1024 x 2048, OLMoE-1B-7B's gate and up), so
their bytes come from memory as a decode token's do, not from the caches. The types take turns
within each repetition (this machine drifts by tens of percent within seconds), and the records
hold every sample. Weights are random valid blocks (codes do not change the work). Results: a
table, and JSON / CSV in docs/results/quant-types.*; docs/performance/quant-types.md cites them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.real_models import _blocks  # noqa: E402
from benchmarks.common import Record, machine_info, rounds, write_outputs  # noqa: E402

TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q3_K", "Q2_K", "IQ4_NL", "Q4_1", "Q5_0", "Q5_1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,8", help="tokens per product (1: decode, 8: a verification)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--out", default="docs/results/quant-types")
    a = ap.parse_args()
    from s2moe import _cpu
    from s2moe.runtime.kernels.stored import GGML_TYPE, row_bytes

    _cpu.set_threads(a.threads)
    rng = np.random.default_rng(0)
    N, K, M = 1024, 2048, 48
    types = [t.strip().upper() for t in a.types.split(",")]
    mats = {t: [_blocks(rng, t, N * K, 0.01) for _ in range(M)] for t in types}
    records = []
    for T in (int(v) for v in a.tokens.split(",")):
        x = rng.standard_normal((T, K)).astype(np.float32)
        y = np.empty((T, N), np.float32)
        samples = {t: [] for t in types}
        for _, t in rounds(types, a.reps):
            start = time.perf_counter()
            for W in mats[t]:
                _cpu.matmul(W, GGML_TYPE[t], N, K, x, y, None)
            samples[t].append(N * K * M / (time.perf_counter() - start) / 1e9)
        for t in types:
            records.append(Record("quant-types", f"{t} T={T}", "Gweights/s", samples[t],
                                  params={"type": t, "tokens": T, "threads": a.threads, "rows": N, "cols": K,
                                          "matrices": M, "bytes_per_weight": row_bytes(t, K) / K}))
    write_outputs(records, {**machine_info(), "kernel_path": _cpu.path()}, a.out,
                  "row products on stored blocks, weights from memory")


if __name__ == "__main__":
    main()
