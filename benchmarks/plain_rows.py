"""Row products on three paths, taking turns in one process: AVX2 a row at a time (the kernels
before e7c7b0a), AVX2 with one token taking four rows at a time, and AVX-512 for plain rows (four
rows too). `_cpu.rows4` and `_cpu.use_avx512` switch them; all give a token the same bits alone or
in a batch (tests/test_simd_paths.py), so a run decodes the same tokens on each path and only time
moves. Int8 rows (Q8_0, Q4_0 against int8 activations) take their VNNI products on both of the last
two paths: for them those columns are the same code.

    python benchmarks/plain_rows.py [--reps 6] [--model DIR] [--budget 0.25] [--workloads humaneval]
                                    [--n-prompts 3] [--types F16] [--no-runs] [--decode FILE ...]
                                    [--out docs/results/plain-rows/widened] [bench args]

Two measurements, the paths taking turns in each repetition:
- products: the widened model's shapes (a 6144 × 1024 head, 512 × 1024 and 1024 × 512 expert rows,
  the 6144 × 256 head of the embedded model) at 1 and 5 tokens, on the kernels' two threads, over
  several copies of each matrix so that the data comes from the caches below L2, as in a pass
  (median of 3 sweeps);
- runs: `s2moe bench --methods ar,s2moe` (greedy, 64 tokens) per workload and path, with AR's and
  S²-MoE's tok/s, their ratio, and the draft's and verification's compute per token.
With ``--decode`` (a GGUF or folder, e.g. benchmarks/peer.py's ``olmoe-h1024-f16.gguf``; repeatable) it
also decodes 64 tokens greedily with every expert resident (AR, as the peer benchmark runs s2moe),
once per path and round. Results: a markdown table on stdout, JSON/CSV under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.in_process import bench_records  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

PATHS = ("avx2, a row at a time", "avx2, four rows", "avx512")


def use(path: str) -> None:
    from s2moe import _cpu

    _cpu.rows4(path != PATHS[0])
    _cpu.use_avx512(path == PATHS[2])


def products(reps: int, types: list[str]) -> dict[str, dict[str, list[float]]]:
    """µs per product, per shape and path."""
    from s2moe import _cpu
    from s2moe.runtime.kernels.cpu import CpuOps
    from s2moe.runtime.kernels.stored import StoredMatrix

    CpuOps()  # the kernels' two threads, as in a run
    rng = np.random.default_rng(0)
    cases = []
    for dtype in types:
        for N, K, copies in ((6144, 1024, 4), (512, 1024, 40), (1024, 512, 40), (6144, 256, 8)):
            Ws = [StoredMatrix.from_float((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32), dtype)
                  for _ in range(copies)]
            for T in (1, 5):
                x = rng.standard_normal((T, K)).astype(np.float32)
                out = np.empty((T, N), np.float32)
                cases.append((f"{dtype} {N}x{K} T={T}", Ws, N, K, x, out))
    times: dict[str, dict[str, list[float]]] = {c[0]: {p: [] for p in PATHS} for c in cases}
    for rep in range(reps):
        for label, Ws, N, K, x, out in cases:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.05:  # untimed: a case's first sweeps ran up to 2x slower,
                for W in Ws:                         # whichever path took them
                    _cpu.matmul(W.data, W.type_id, N, K, x, out)
            for path in PATHS[rep % 3:] + PATHS[:rep % 3]:  # each path first in a third of the rounds
                use(path)
                sweeps = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    for W in Ws:
                        _cpu.matmul(W.data, W.type_id, N, K, x, out)
                    sweeps.append((time.perf_counter() - t0) / len(Ws) * 1e6)
                times[label][path].append(statistics.median(sweeps))
    use(PATHS[2])
    return times


def decodes(reps: int, paths: list[str], tokens: int = 64) -> dict[str, dict[str, list[float]]]:
    """tok/s of a greedy AR decode with every expert resident, per file and path."""
    from s2moe.runtime.decoding.generate import generate_ar
    from s2moe.runtime.engine import build_engine

    ids = [int(t) for t in np.random.default_rng(0).integers(10, 1000, 16)]
    models = {os.path.basename(p): build_engine(p, preload=True).model for p in paths}
    out: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PATHS} for name in models}
    for rep in range(reps):
        for name, model in models.items():
            generate_ar(model, ids, 8)  # warm
            for path in PATHS[rep % 3:] + PATHS[:rep % 3]:
                use(path)
                t0 = time.perf_counter()
                n = len(generate_ar(model, ids, tokens).tokens)
                out[name][path].append(n / (time.perf_counter() - t0))
    use(PATHS[2])
    return out


def runs(reps: int, model: str | None, budget: str, workloads: list[str], extra: list[str]) -> list[dict]:
    rows = []
    for rep in range(reps):
        for wl in workloads:
            for path in PATHS[rep % 3:] + PATHS[:rep % 3]:
                use(path)
                ar, s2 = bench_records("ar,s2moe", budget, wl, model, extra)
                ms = s2["extra"]["ms_per_token"]
                rows.append({"rep": rep, "workload": wl, "path": path, "ar": ar["median"], "s2moe": s2["median"],
                             "ratio": s2["median"] / ar["median"], "draft_ms": ms["draft_compute"],
                             "verify_ms": ms["verify_compute"], "ar_compute_ms": ar["extra"]["ms_per_token"]["other_compute"]})
        print(f"run rep {rep} done", file=sys.stderr, flush=True)
    use(PATHS[2])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=6, help="rounds; each path goes first in a third of them")
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--workloads", default="humaneval")
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--types", default="F16", help="stored types of the products (F16, BF16, Q8_0, Q4_0, ...)")
    ap.add_argument("--no-runs", action="store_true", help="no `s2moe bench` runs")
    ap.add_argument("--decode", action="append", default=[], help="also time a greedy AR decode of this model")
    ap.add_argument("--out", default="docs/results/plain-rows/widened")
    args, extra = ap.parse_known_args()

    from s2moe import _cpu

    if not (_cpu.use_simd(True) and _cpu.use_avx512(1)):
        sys.exit("plain_rows: this CPU has no AVX-512 (F, BW, VL): only the AVX2 paths exist here")
    workloads = args.workloads.split(",")
    extra = ["--n-prompts", str(args.n_prompts)] + extra
    prod = products(args.reps, args.types.split(","))
    dec = decodes(args.reps, args.decode) if args.decode else {}
    run = [] if args.no_runs else runs(args.reps, args.model, args.budget, workloads, extra)
    params = {"model": args.model or "embedded", "budget": args.budget, "n_prompts": args.n_prompts,
              "extra": extra, "kernels": _cpu.path()}
    records = []
    for label, by in prod.items():
        for path in PATHS:
            records.append(Record("plain-rows", f"{label}: {path}", "us", by[path], params={**params, "path": path}))
    for wl in workloads if run else []:
        for path in PATHS:
            rs = [r for r in run if r["workload"] == wl and r["path"] == path]
            for key, unit in (("ar", "tok/s"), ("s2moe", "tok/s"), ("ratio", "x"), ("draft_ms", "ms"),
                              ("verify_ms", "ms"), ("ar_compute_ms", "ms")):
                records.append(Record("plain-rows", f"{wl} {key}: {path}", unit, [r[key] for r in rs],
                                      params={**params, "workload": wl, "path": path}))
    for name, by in dec.items():
        for path in PATHS:
            records.append(Record("plain-rows", f"decode {name}: {path}", "tok/s", by[path],
                                  params={**params, "decode": name, "path": path, "tokens": 64}))
    write_outputs(records, machine_info(), args.out, "plain rows: AVX2 a row at a time, four rows, AVX-512")
    med = statistics.median
    print("| product | " + " | ".join(PATHS) + " | four rows / one, AVX-512 / one |")
    print("|---|---|---|---|---|")
    for label, by in prod.items():
        one, four, wide = (med(by[p]) for p in PATHS)
        print(f"| {label} | {one:.1f} µs | {four:.1f} µs | {wide:.1f} µs | {four / one:.2f}×, {wide / one:.2f}× |")
    for name, by in dec.items():
        one, four, wide = (med(by[p]) for p in PATHS)
        print(f"| AR decode {name} | {one:.1f} tok/s | {four:.1f} tok/s | {wide:.1f} tok/s | "
              f"{one / four:.2f}×, {one / wide:.2f}× (time) |")
    if not run:
        return
    print()
    print("| workload | path | AR tok/s | S²-MoE tok/s | S²-MoE / AR | draft ms/token | verify ms/token | AR compute ms/token |")
    print("|---|---|---|---|---|---|---|---|")
    for wl in workloads:
        for path in PATHS:
            rs = [r for r in run if r["workload"] == wl and r["path"] == path]
            m = {k: med(r[k] for r in rs) for k in ("ar", "s2moe", "ratio", "draft_ms", "verify_ms", "ar_compute_ms")}
            print(f"| {wl} | {path} | {m['ar']:.1f} | {m['s2moe']:.1f} | {m['ratio']:.2f}× | {m['draft_ms']:.2f} | "
                  f"{m['verify_ms']:.2f} | {m['ar_compute_ms']:.2f} |")


if __name__ == "__main__":
    main()
