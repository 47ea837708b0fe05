"""A decode token's whole pass in one C call (`MoEModel._one_call`, csrc/cpu/pass.c) against the
step-by-step path (one C call per attention block and per MoE layer, Python between), the two taking
turns in one process: this machine drifts by tens of percent within seconds.

    python benchmarks/decode_pass.py [--model DIR] [--budget 0.25] [--reps 4] [--workload humaneval]
                                     [--loop 400] [--out docs/results/decode-pass/default] [bench args]

Both paths give the same bits (tests/test_decode_pass.py), so a run decodes the same tokens either
way; only time differs. Two measurements, each alternating the paths:
- a warm loop: ``--loop`` resident-only draft passes at one position, rolled back, per round;
- real runs: `s2moe bench --methods ar,s2moe` (6 prompts, 64 tokens, greedy) once per path and round,
  timing every draft pass inside it (after verification and the draft's other work the interpreter's
  data has left the caches, so a pass costs more than the loop shows), with AR's and S²-MoE's tok/s
  and their ratio in that run. Extra arguments go to the bench (``--no-rate-guard``).
Results: a markdown table on stdout, JSON/CSV under ``--out``.
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

PATHS = ("one call", "step by step")


def warm_loop(model_path: str | None, budget: str, n: int, rounds: int) -> dict[str, list[float]]:
    """µs per resident-only draft pass in a warm loop, the paths taking turns each round."""
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.engine import build_engine, phase_of
    from s2moe.runtime.model.routing import RoutingPolicy

    model = build_engine(model_path or str(DEFAULT_MODEL), budget=budget).model
    c, cache = model.config, model.experts
    draft = RoutingPolicy(top_k=max(1, c.top_k // 2), allowed=lambda L: cache.resident_mask(L, c.num_experts))
    kv = model.new_cache(256)
    model.forward(list(range(100, 160)), kv, logits="last")
    kv.commit(60)
    out: dict[str, list[float]] = {p: [] for p in PATHS}
    for r in range(rounds):
        for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
            model.one_call = path == "one call"
            with phase_of(model, "draft"):
                for i in range(n // 10):  # warm-up
                    model.forward([5 + i % 50], kv, policy=draft, logits="last")
                    kv.rollback(60)
                t0 = time.perf_counter()
                for i in range(n):
                    model.forward([5 + i % 50], kv, policy=draft, logits="last")
                    kv.rollback(60)
            out[path].append((time.perf_counter() - t0) / n * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--loop", type=int, default=400, help="draft passes per path and round in the warm loop")
    ap.add_argument("--out", default="docs/results/decode-pass/default")
    args, extra = ap.parse_known_args()

    from s2moe.runtime.model.forward import MoEModel

    loop = warm_loop(args.model, args.budget, args.loop, args.reps)
    applies, forward = MoEModel._one_call_applies, MoEModel.forward
    spent = [0.0, 0]

    def timed(self, *a, **k):
        if getattr(self.experts, "phase", None) != "draft":
            return forward(self, *a, **k)
        t0 = time.perf_counter()
        try:
            return forward(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    MoEModel.forward = timed
    runs: dict[str, dict[str, list[float]]] = {p: {"us": [], "ar": [], "s2moe": [], "ratio": []} for p in PATHS}
    for rep in range(args.reps):
        for path in (PATHS if rep % 2 == 0 else PATHS[::-1]):
            MoEModel._one_call_applies = applies if path == "one call" else (lambda self, *a: False)
            spent[:] = [0.0, 0]
            tok_s = {r["name"]: r["median"] for r in bench_records("ar,s2moe", args.budget, args.workload,
                                                                   args.model, extra)}
            s = runs[path]
            s["us"].append(spent[0] / max(spent[1], 1) * 1e6)
            s["ar"].append(tok_s["ar"])
            s["s2moe"].append(tok_s["s2moe"])
            s["ratio"].append(tok_s["s2moe"] / tok_s["ar"])
            print(f"rep {rep} {path}: draft pass {s['us'][-1]:.0f} us, AR {tok_s['ar']:.1f}, "
                  f"S2-MoE {tok_s['s2moe']:.1f} tok/s", file=sys.stderr, flush=True)
    MoEModel._one_call_applies, MoEModel.forward = applies, forward
    params = {"model": args.model or "embedded", "budget": args.budget, "workload": args.workload, "bench_args": extra,
              "loop_passes": args.loop}
    records = [Record("decode-pass", f"{p}: draft pass, warm loop", "us", loop[p], params) for p in PATHS]
    records += [Record("decode-pass", f"{p}: draft pass in runs", "us", runs[p]["us"], params) for p in PATHS]
    records += [Record("decode-pass", f"{p}: {m}", "tok/s", runs[p][m], params) for p in PATHS for m in ("ar", "s2moe")]
    records += [Record("decode-pass", f"{p}: S2-MoE / AR in the same run", "x", runs[p]["ratio"], params) for p in PATHS]
    write_outputs(records, machine_info(), args.out, "a decode token's pass: one C call against step by step")
    med = statistics.median
    over = lambda a, b: [x / y for x, y in zip(a, b)]  # noqa: E731  (per round: the paths ran side by side)
    one, step = runs[PATHS[0]], runs[PATHS[1]]
    print("| path | draft pass, warm loop | draft pass in runs | AR tok/s | S²-MoE tok/s | S²-MoE / AR |")
    print("|---|---|---|---|---|---|")
    for p in PATHS:
        r = runs[p]
        print(f"| {p} | {med(loop[p]):.0f} µs | {med(r['us']):.0f} µs | {med(r['ar']):.1f} | {med(r['s2moe']):.1f} | "
              f"{med(r['ratio']):.2f}× |")
    print(f"| one call / step by step, per round | {med(over(loop[PATHS[0]], loop[PATHS[1]])):.2f}× | "
          f"{med(over(one['us'], step['us'])):.2f}× | {med(over(one['ar'], step['ar'])):.2f}× | "
          f"{med(over(one['s2moe'], step['s2moe'])):.2f}× | |")

if __name__ == "__main__":
    main()
