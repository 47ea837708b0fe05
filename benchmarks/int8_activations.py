"""Q8_0 and Q4_0 products against int8 activations (the default) and float ones, taking turns in
one process (`_cpu.act_q8` switches the path), F16 beside them as the control that must not move.

    python benchmarks/int8_activations.py [--reps 6] [--out docs/results/int8-activations]

Each repetition times both paths (best of 60 calls after 10 warm ones), in alternating order; the
table gives medians over repetitions and the float / int8 ratio. Shapes are the widened model's
(1024 × 1024 attention, 512 × 1024 expert rows) and a 6144-token lm head, at 1 and 4 tokens, on 1
and 2 kernel threads. Writes raw samples, machine and commit to OUT.json / .csv.
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


def best_of(fn, warm: int = 10, calls: int = 60) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", default="docs/results/int8-activations")
    args = ap.parse_args()
    from s2moe import _cpu
    from s2moe.runtime.kernels.stored import StoredMatrix

    rng = np.random.default_rng(0)
    records, rows = [], []
    for threads in (1, 2):
        _cpu.set_threads(threads)
        for N, K in ((1024, 1024), (512, 1024), (6144, 1024)):
            W = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
            for T in (1, 4):
                x = rng.standard_normal((T, K)).astype(np.float32)
                out = np.empty((T, N), np.float32)
                for dtype in ("Q8_0", "Q4_0", "F16"):
                    S = StoredMatrix.from_float(W, dtype)
                    times: dict[int, list[float]] = {0: [], 1: []}
                    for rep in range(args.reps):
                        for mode in ((0, 1) if rep % 2 == 0 else (1, 0)):
                            _cpu.act_q8(mode)
                            times[mode].append(best_of(lambda: _cpu.matmul(S.data, S.type_id, N, K, x, out)))
                    _cpu.act_q8(1)
                    ratio = [f / i for f, i in zip(times[0], times[1])]
                    params = {"threads": threads, "N": N, "K": K, "tokens": T, "dtype": dtype, "bytes": S.data.nbytes}
                    for mode, label in ((0, "float"), (1, "int8")):
                        records.append(Record("int8-activations", f"{dtype} {N}x{K} T={T} threads={threads} {label}",
                                              "us", [t * 1e6 for t in times[mode]], params={**params, "activations": label},
                                              extra={"float_over_int8": ratio} if mode == 1 else {}))
                    f, i = statistics.median(times[0]), statistics.median(times[1])
                    rows.append((threads, f"{N} × {K}", T, dtype, f * 1e6, S.data.nbytes / f / 1e9, i * 1e6,
                                 S.data.nbytes / i / 1e9, statistics.median(ratio)))
                    print(f"{rows[-1]}", file=sys.stderr, flush=True)
    write_outputs(records, machine_info(), args.out, "Q8_0 / Q4_0 against int8 and float activations")
    print("| threads | matrix | tokens | type | float activations | int8 activations | float / int8 |")
    print("|---|---|---|---|---|---|---|")
    for th, shape, T, dtype, f, fg, i, ig, r in rows:
        print(f"| {th} | {shape} | {T} | {dtype} | {f:.0f} µs ({fg:.1f} GB/s) | {i:.0f} µs ({ig:.1f} GB/s) | **{r:.2f}×** |")


if __name__ == "__main__":
    main()
