"""Backs docs/performance/s2moe-gating.md, "The price of a stronger bias" (and the speed records behind
docs/performance/s2moe-targets.md, "Where a token's time goes at the default gating"): S²-MoE over AR
for each gating strength, beside the quality it costs.

What reuse-aware gating buys and what it costs: S²-MoE's speed over AR for each gating setting,
taking turns in one run, beside the quality `benchmarks/quality.py` measured for the same setting.

    python benchmarks/gating_price.py --model WIDENED --budgets 0.25 --reps 3 \
        --quality docs/results/gating-strength/quality-b5.json --out docs/results/gating-strength/speed-0.25 \
        [-- extra s2moe bench flags, e.g. --emulate-bandwidth 2000 --emulate-latency 100]

Each (budget, workload) runs every setting as one `s2moe bench --methods ar,s2moe`, in turns that
reverse every repetition (this machine drifts by tens of percent within seconds, so a setting's
figure is S²-MoE over the AR of its own run). Settings are named as quality.py names them.
Writes ``--out``.json / .csv (every bench record, with its setting and repetition) and prints a
markdown table: median speedup (each repetition's), MB read per generated token, acceptance
length, and the PPL ratio and top-1 agreement from ``--quality``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import Record, machine_info, rounds, write_outputs  # noqa: E402

# name (as quality.py names it): the s2moe bench flags that give it
SETTINGS = {
    "resident ρ=0.25": [],  # the default
    "resident ρ=1": ["--rg-residency", "1"],
    "resident ρ=1 λ×1.1": ["--rg-residency", "1", "--rg-strength", "1.1"],
    "resident ρ=1 λ×1.25": ["--rg-residency", "1", "--rg-strength", "1.25"],
    "resident ρ=1 λ×2": ["--rg-residency", "1", "--rg-strength", "2"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", default="0.25")
    ap.add_argument("--workloads", default="humaneval,gsm8k,mt-bench")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names from: " + ", ".join(SETTINGS))
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quality", default=None, help="a quality.py JSON to quote beside each setting")
    ap.add_argument("--out", required=True)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    names = [s.strip() for s in args.settings.split(",")]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        ap.error(f"--settings: unknown {', '.join(unknown)}")
    quality = {}
    if args.quality:
        quality = {r["name"]: r["extra"] for r in json.load(open(args.quality))["records"]}

    records: list[Record] = []
    rows: dict = {}  # (budget, workload, setting) -> [(speedup, MB/token, acceptance)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        for budget in args.budgets.split(","):
            for workload in args.workloads.split(","):
                for rep, name in rounds(names, args.reps, reverse=True):
                    print(f"budget {budget} · {workload} · repetition {rep + 1} · {name}", file=sys.stderr)
                    cmd = ["s2moe", "bench", "--methods", "ar,s2moe", "--model", args.model, "-b", budget,
                           "-w", workload, "--n-prompts", str(args.n_prompts), "--json", out, *SETTINGS[name], *extra]
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                    got = json.load(open(out))["records"]
                    ar, s2 = got[0], got[1]
                    for r in got:
                        records.append(Record(r["benchmark"], r["name"], r["unit"], r["samples"],
                                              params={**r["params"], "setting": name, "repetition": rep + 1,
                                                      "extra_flags": extra},
                                              extra=r["extra"]))
                    rows.setdefault((budget, workload, name), []).append(
                        (s2["median"] / ar["median"], s2["extra"]["bytes_fetched_per_token"] / 1e6,
                         s2["extra"]["acceptance_length"]))
    write_outputs(records, machine_info(), args.out, "reuse-aware gating: speed and quality")
    print("| budget | workload | setting | S²-MoE / AR (each repetition) | MB read per token | acceptance length "
          "| PPL ratio | top-1 agreement |")
    print("|---|---|---|---|---|---|---|---|")
    for (budget, workload, name), got in rows.items():
        q = quality.get(name)
        qtext = (f"{q['ppl_ratio']:.4f} | {100 * q['top1_agreement']:.1f} %" if q else "– | –")
        print(f"| {budget} | {workload} | {name} | {statistics.median(g[0] for g in got):.2f}× "
              f"({', '.join(f'{g[0]:.2f}' for g in got)}) | {statistics.median(g[1] for g in got):.2f} | "
              f"{statistics.median(g[2] for g in got):.2f} | {qtext} |")


if __name__ == "__main__":
    main()
