"""A draft token's two expert predictions in one C call (`CpuOps.ae_predict`, csrc/cpu/predict.c)
against the NumPy path (speculative.py `_predicted_experts`), inside real S²-MoE runs, the two
taking turns in one process: this machine drifts by tens of percent within seconds.

    python benchmarks/ae_predict.py [--model DIR] [--budget 0.25] [--reps 5] [--workload humaneval]
                                    [--out docs/results/ae-predict/default]

Both paths predict the same experts (tests/test_ae_predict.py), so a run decodes the same tokens with
the same drafts either way; only time differs. Each repetition runs `s2moe bench --methods s2moe`
(6 prompts, 64 tokens, greedy) once per path, timing every `_predictions` call (a draft pass's
predictions, in the run rather than in a warm loop: after a forward pass the interpreter's data has
left the caches, and the same Python costs 3-4× what a loop shows). Extra arguments go to the bench
(``--no-rate-guard``). Results: per path, µs of predictions per draft pass and tok/s; a markdown
table on stdout, JSON/CSV under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.in_process import bench_records  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--out", default="docs/results/ae-predict/default")
    args, extra = ap.parse_known_args()

    from s2moe.runtime.decoding.speculative import SpeculativeDecoder
    from s2moe.runtime.kernels.cpu import CpuOps

    fast, real = CpuOps.ae_predict, SpeculativeDecoder._predictions
    spent = [0.0, 0]

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return real(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    SpeculativeDecoder._predictions = timed
    samples: dict[str, dict[str, list[float]]] = {p: {"us": [], "tok_s": []} for p in ("one call", "numpy")}
    for rep in range(args.reps):
        for path in (("one call", "numpy") if rep % 2 == 0 else ("numpy", "one call")):
            if path == "one call":
                CpuOps.ae_predict = fast
            elif hasattr(CpuOps, "ae_predict"):
                del CpuOps.ae_predict
            spent[:] = [0.0, 0]
            record = bench_records("s2moe", args.budget, args.workload, args.model, extra)[0]
            samples[path]["us"].append(spent[0] / max(spent[1], 1) * 1e6)
            samples[path]["tok_s"].append(record["median"])
            print(f"rep {rep} {path}: {samples[path]['us'][-1]:.0f} us a pass, {record['median']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    CpuOps.ae_predict = fast
    params = {"model": args.model or "embedded", "budget": args.budget, "workload": args.workload, "bench_args": extra}
    records = [Record("ae-predict", f"{path}: predictions per draft pass", "us", s["us"], params) for path, s in samples.items()]
    records += [Record("ae-predict", f"{path}: decode", "tok/s", s["tok_s"], params) for path, s in samples.items()]
    write_outputs(records, machine_info(), args.out, "a draft token's predictions: one C call against NumPy")
    one, ref = samples["one call"], samples["numpy"]
    ratio = [a / b for a, b in zip(one["us"], ref["us"])]
    speed = [a / b for a, b in zip(one["tok_s"], ref["tok_s"])]
    print("| path | predictions per draft pass (median) | tok/s (median) |")
    print("|---|---|---|")
    for path, s in samples.items():
        print(f"| {path} | {statistics.median(s['us']):.0f} µs | {statistics.median(s['tok_s']):.1f} |")
    print(f"| one call / numpy, per round | **{statistics.median(ratio):.2f}×** ({min(ratio):.2f}–{max(ratio):.2f}) | "
          f"**{statistics.median(speed):.2f}×** ({min(speed):.2f}–{max(speed):.2f}) |")


if __name__ == "__main__":
    main()
