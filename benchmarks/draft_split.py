"""Where a draft pass's time goes inside real runs: each step of the draft chain timed in place.

    python benchmarks/draft_split.py [--model DIR] [--budget 0.25] [--reps 3] [--workload humaneval]
                                     [--out docs/results/draft-python/split] [bench args, e.g. --no-rate-guard]

Runs `s2moe bench --methods s2moe` (6 prompts, 64 tokens, greedy) in this process ``--reps`` times,
with a timer around each step the draft chain (decoding/speculative.py `_draft_chain`) takes per
pass: the forward pass, and inside it the C call (`CpuOps.decode_pass`) and the one-call pass's
Python (`MoEModel._one_call`); the greedy pick; AE's acceptance estimate; the expert predictions;
the prefetch; AE's marginal verification cost. A warm loop of the same steps costs much less: inside
a run each pass finds the interpreter's data cold after verification and the draft's other work,
so only in-run timing says what the draft costs. The timers add about 1 µs a step.

Reports µs per pass, per step, for the chain's passes and, apart, for the root pass each iteration
starts with (the first after a verification), median over the repetitions, with the raw
per-repetition values in the JSON/CSV records.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.in_process import bench_records  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

# (label, owner, attribute): timed only inside a draft chain
STEPS = (
    ("forward", "model", "forward"),
    ("forward: the C call", "ops", "decode_pass"),
    ("forward: the one-call pass", "model", "_one_call"),
    ("greedy pick", "spec", "_pick"),
    ("acceptance estimate", "spec", "_p_accept"),
    ("predictions", "spec", "_predictions"),
    ("prefetch", "spec", "_prefetch"),
    ("marginal verification cost", "spec_module", "marginal_verification_cost"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--out", default="docs/results/draft-python/split")
    args, extra = ap.parse_known_args()

    from s2moe.runtime.decoding import speculative
    from s2moe.runtime.kernels.cpu import CpuOps
    from s2moe.runtime.model.forward import MoEModel

    owners = {"model": MoEModel, "ops": CpuOps, "spec": speculative.SpeculativeDecoder, "spec_module": speculative}
    spent: dict[tuple[str, str], float] = defaultdict(float)  # (where: "chain" or "root", step) -> seconds
    where: list[str | None] = [None]
    saved = []

    def wrap(owner, name: str, label: str):
        orig = getattr(owner, name)
        saved.append((owner, name, orig))

        def timed(*a, **k):
            if where[0] is None:
                return orig(*a, **k)
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                spent[where[0], label] += time.perf_counter() - t0
        setattr(owner, name, timed)

    for label, owner, name in STEPS:
        wrap(owners[owner], name, label)
    counts = {"chain": 0, "root": 0}

    def region(name: str):  # the chain's passes, or root passes (one per verification)
        orig = getattr(speculative.SpeculativeDecoder, name)
        saved.append((speculative.SpeculativeDecoder, name, orig))
        kind = "chain" if name == "_draft_chain" else "root"

        def timed(self, *a, **k):
            where[0] = kind
            before, t0 = self.metrics.draft_passes, time.perf_counter()
            try:
                return orig(self, *a, **k)
            finally:
                spent[kind, "whole"] += time.perf_counter() - t0
                counts[kind] += self.metrics.draft_passes - before
                where[0] = None
        setattr(speculative.SpeculativeDecoder, name, timed)

    region("_draft_chain")
    region("_draft_root")
    per_rep: dict[str, list[float]] = defaultdict(list)
    tok_s = []
    try:
        for rep in range(args.reps):
            spent.clear()
            counts.update(chain=0, root=0)
            recs = bench_records("s2moe", args.budget, args.workload, args.model, extra)
            tok_s.append(recs[0]["median"])
            for kind in ("chain", "root"):
                n = max(counts[kind], 1)
                for label in ("whole",) + tuple(s[0] for s in STEPS):
                    per_rep[f"{kind}: {label}"].append(spent[kind, label] / n * 1e6)
            print(f"rep {rep}: {counts['chain']} chain passes ({per_rep['chain: whole'][-1]:.0f} us each), "
                  f"{counts['root']} root passes ({per_rep['root: whole'][-1]:.0f} us each), "
                  f"S2-MoE {tok_s[-1]:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)
    params = {"model": args.model or "embedded", "budget": args.budget, "workload": args.workload, "bench_args": extra}
    records = [Record("draft-split", label, "us per pass", values, params) for label, values in per_rep.items()]
    records.append(Record("draft-split", "S2-MoE", "tok/s", tok_s, params))
    write_outputs(records, machine_info(), args.out, "where a draft pass's time goes inside runs")
    med = statistics.median
    print("| where: step (µs per pass of that kind) | median | per repetition |")
    print("|---|---|---|")
    for label, values in per_rep.items():
        print(f"| {label} | {med(values):.0f} | {', '.join(f'{v:.0f}' for v in values)} |")
    print(f"| S²-MoE tok/s | {med(tok_s):.1f} | {', '.join(f'{v:.1f}' for v in tok_s)} |")


if __name__ == "__main__":
    main()
