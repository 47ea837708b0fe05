"""Q8_0 / Q4_0 rows against int8 activations: VNNI products against AVX2's, taking turns in one
process (`_cpu.use_vnni` switches them; both give the same bits, tests/test_simd_paths.py).

    python benchmarks/vnni.py [--reps 6] [--form 1|2] [--model FILE.gguf] [--out docs/results/vnni]

``--form 2`` times AVX-512 VNNI's EVEX form (for CPUs without AVX-VNNI) instead of AVX-VNNI.

Each repetition times both paths on the widened model's shapes (1024 × 1024, 512 × 1024 expert
rows, a 6144-token head) at 1 and 4 tokens on the kernels' two threads (best of 60 calls after 10
warm ones), alternating which goes first. With ``--model`` (a Q8_0 GGUF, e.g. benchmarks/peer.py's
``olmoe-h1024-q8_0.gguf``) it also decodes 64 tokens greedily with every expert resident, once per
path per repetition. Writes raw samples, machine and commit to OUT.json / .csv; a markdown table on
stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402
from benchmarks.int8_activations import best_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--model", default=None, help="a Q8_0 GGUF to decode on each path")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--form", type=int, default=1, choices=(1, 2),
                    help="1: AVX-VNNI (VEX), 2: AVX-512 VNNI on 256-bit registers (EVEX)")
    ap.add_argument("--out", default="docs/results/vnni")
    args = ap.parse_args()

    from s2moe import _cpu
    from s2moe.runtime.kernels.stored import StoredMatrix

    if not (_cpu.use_simd(True) and _cpu.use_vnni(args.form) == args.form):
        sys.exit(f"vnni: this CPU (or the build) has no {'AVX-VNNI' if args.form == 1 else 'AVX-512 VNNI'}")
    rng = np.random.default_rng(0)
    cases = []  # (label, params, fn)
    for N, K in ((1024, 1024), (512, 1024), (6144, 1024)):
        W = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
        for dtype in ("Q8_0", "Q4_0"):
            S = StoredMatrix.from_float(W, dtype)
            for T in (1, 4):
                x = rng.standard_normal((T, K)).astype(np.float32)
                out = np.empty((T, N), np.float32)
                cases.append((f"{dtype} {N}x{K} T={T}", {"N": N, "K": K, "tokens": T, "dtype": dtype, "bytes": S.data.nbytes},
                              lambda S=S, N=N, K=K, x=x, out=out: best_of(lambda: _cpu.matmul(S.data, S.type_id, N, K, x, out))))
    decode = None
    if args.model:
        from s2moe.runtime.decoding.generate import generate_ar
        from s2moe.runtime.engine import build_engine

        model = build_engine(args.model, preload=True).model
        ids = [int(t) for t in rng.integers(10, 1000, 16)]

        def decode() -> float:  # tokens per second over a whole greedy decode
            t0 = time.perf_counter()
            n = len(generate_ar(model, ids, args.tokens).tokens)
            return n / (time.perf_counter() - t0)

        decode()
        cases.append((f"decode {os.path.basename(args.model)}", {"model": os.path.basename(args.model), "tokens": args.tokens},
                      decode))
    times = {label: {True: [], False: []} for label, _, _ in cases}
    for rep in range(args.reps):
        for label, _, fn in cases:
            for vnni in ((True, False) if rep % 2 == 0 else (False, True)):
                _cpu.use_vnni(args.form if vnni else 0)
                times[label][vnni].append(fn())
        print(f"rep {rep} done", file=sys.stderr, flush=True)
    _cpu.use_vnni(1)
    records, rows = [], []
    for label, params, _ in cases:
        v, a = times[label][True], times[label][False]
        is_rate = label.startswith("decode")
        ratio = [y / x for x, y in zip(v, a)] if not is_rate else [x / y for x, y in zip(v, a)]  # >1: VNNI faster
        unit = "tok/s" if is_rate else "us"
        scale = 1.0 if is_rate else 1e6
        for on, name in ((True, "avxvnni" if args.form == 1 else "avx512vnni"), (False, "avx2")):
            records.append(Record("vnni", f"{label} {name}", unit, [t * scale for t in times[label][on]],
                                  params={**params, "products": name}, extra={"vnni_speedup": ratio} if on else {}))
        rows.append((label, statistics.median(a) * scale, statistics.median(v) * scale, unit, statistics.median(ratio),
                     min(ratio), max(ratio)))
    write_outputs(records, machine_info(), args.out, "int8 rows: VNNI against AVX2 products")
    print(f"| case | AVX2 | {'AVX-VNNI' if args.form == 1 else 'AVX-512 VNNI'} | VNNI speedup, median per round (range) |")
    print("|---|---|---|---|")
    for label, a, v, unit, r, lo, hi in rows:
        print(f"| {label} | {a:.1f} {unit} | {v:.1f} {unit} | **{r:.2f}×** ({lo:.2f}–{hi:.2f}) |")


if __name__ == "__main__":
    main()
