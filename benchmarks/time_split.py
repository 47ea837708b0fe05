"""Backs docs/performance/s2moe-targets.md, "Where a token's time goes at the default gating, and the
ceiling of full overlap": where a token's time goes, and what hiding every read could give.

Where a generated token's time goes, and the most full overlap could give, from bench records.

    python benchmarks/time_split.py docs/results/gating-strength/speed-0.25.json \
        --setting "resident ρ=0.25" --gb-s 1.69 [--emulated-ms-per-read 0.1 --expert-mib 3]

Reads `s2moe bench` records (from `benchmarks/speculative.py`, `gating_price.py`, or `s2moe bench
--json`): each run's `ms_per_token` split (draft compute, verification compute, other compute, reads
on the critical path, reads hidden by prefetch, total) and its bytes read per generated token. Prints
the medians per (budget, workload, method), and for each method beside AR of the same cell the ceiling
of full overlap:

    AR's total / max(the method's compute, its bytes at the tier's bandwidth)

That is what the method would reach if every read ran behind compute, at the disk rate measured
beside the run (`--gb-s`, e.g. `benchmarks/disk_parallel.py`). With ``--emulated-ms-per-read``
each read of ``--expert-mib`` also pays the emulated request latency. A target above the ceiling
cannot be met by hiding reads, only by reading fewer bytes or computing less.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

PARTS = ("draft_compute", "verify_compute", "other_compute", "fetch_critical", "fetch_hidden", "total")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+", help="bench record JSON files")
    ap.add_argument("--setting", default=None, help="only records whose params.setting is this (gating_price.py)")
    ap.add_argument("--gb-s", type=float, required=True, help="the tier's read rate, GB/s")
    ap.add_argument("--emulated-ms-per-read", type=float, default=0.0)
    ap.add_argument("--expert-mib", type=float, default=3.0, help="bytes of one read, MiB (with the latency)")
    args = ap.parse_args()
    cells: dict = defaultdict(list)
    for path in args.records:
        for r in json.load(open(path))["records"]:
            p, x = r["params"], r.get("extra", {})
            if "ms_per_token" not in x or (args.setting and p.get("setting") != args.setting):
                continue
            cells[(p["budget"], p["workload"], p["method"])].append((x["ms_per_token"], x["bytes_fetched_per_token"]))
    per_read = args.expert_mib * 2**20
    print("| budget | workload | method | draft compute | verify compute | other compute | reads waited "
          "| reads hidden | total | MB a token | full-overlap ceiling over AR |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (budget, workload, method), runs in cells.items():
        med = {k: statistics.median(m[k] for m, _ in runs) for k in PARTS}
        nbytes = statistics.median(b for _, b in runs)
        ceiling = "–"
        ar = cells.get((budget, workload, "ar"))
        if ar and method != "ar":
            ar_total = statistics.median(m["total"] for m, _ in ar)
            compute = med["draft_compute"] + med["verify_compute"] + med["other_compute"]
            disk = nbytes / (args.gb_s * 1e9) * 1e3 + nbytes / per_read * args.emulated_ms_per_read
            ceiling = f"{ar_total / max(compute, disk):.2f}× ({'compute' if compute >= disk else 'reads'} bound)"
        print(f"| {budget} | {workload} | {method} | " + " | ".join(f"{med[k]:.2f}" for k in PARTS)
              + f" | {nbytes / 1e6:.2f} | {ceiling} |")


if __name__ == "__main__":
    main()
